import json
import shutil

import pytest
import torch

from course_lib import models


def test_embedded_checkpoint_loads_with_auto_classes():
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = models.resolve_model_name("embedded")
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "distilbert"
    assert model.config.architectures == ["DistilBertForMaskedLM"]  # as printed on the slide
    enc = tokenizer(["the profit rose"], ["earnings increased"], return_tensors="pt")
    assert model(**enc).logits.shape == (1, 2)


def test_embedded_checkpoint_is_small_and_was_really_pretrained():
    assert (models.EMBEDDED_MODEL_DIR / "model.safetensors").stat().st_size < 5 * 2**20
    report = json.loads((models.EMBEDDED_MODEL_DIR / "pretraining.json").read_text())
    # Chance on a ~1200-token vocabulary is < 0.1 %: masked-LM pretraining really learned the corpus.
    assert report["heldout_masked_token_accuracy"] > 0.5


def test_load_model_is_fp32_and_random_init_differs():
    pretrained = models.load_model("embedded")
    scratch = models.load_model("embedded", pretrained=False)
    assert next(pretrained.parameters()).dtype == torch.float32
    name = "distilbert.embeddings.word_embeddings.weight"
    assert not torch.equal(pretrained.state_dict()[name], scratch.state_dict()[name])
    assert models.count_parameters(pretrained) == models.count_parameters(scratch)


def test_load_model_writes_nothing_to_stderr(capfd):
    models.load_model("embedded")
    assert capfd.readouterr().err == ""


def test_missing_checkpoint_dir_says_how_to_rebuild(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_assets"):
        models.load_model(str(tmp_path / "nowhere"))


def test_incomplete_checkpoint_dir_lists_missing_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        models.load_model(str(tmp_path))


def test_corrupt_checkpoint_config_is_reported(tmp_path):
    shutil.copytree(models.EMBEDDED_MODEL_DIR, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupt"):
        models.load_model(str(tmp_path / "ckpt"))


def test_corrupt_weights_are_reported(tmp_path):
    shutil.copytree(models.EMBEDDED_MODEL_DIR, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(
        OSError, match=r"(?s)Could not load model .*ckpt.*header.*python -m course_tools.build_assets"
    ):
        models.load_model(str(tmp_path / "ckpt"))


def test_hub_id_offline_fails_loudly():
    with pytest.raises(OSError, match="COURSE_MODEL=embedded"):
        models.load_model("distilbert-base-uncased")


def test_model_switch_reads_environment(monkeypatch):
    monkeypatch.setenv("COURSE_MODEL", str(models.EMBEDDED_MODEL_DIR))
    assert models.resolve_model_name() == str(models.EMBEDDED_MODEL_DIR)
    monkeypatch.setenv("COURSE_MODEL", "distilbert-base-uncased")
    assert models.resolve_model_name() == "distilbert-base-uncased"
