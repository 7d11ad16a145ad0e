"""Lesson 01b's data and models (course_lib.media): generated deterministically, varied as documented,
processed to the models' shapes, loadable offline, trainable through the course's loop."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from course_lib import media
from course_lib.config import media_sources


@pytest.fixture(scope="module")
def processors():
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    return (
        AutoImageProcessor.from_pretrained(media.IMAGE_MODEL_DIR),
        AutoFeatureExtractor.from_pretrained(media.AUDIO_MODEL_DIR),
    )


def test_generators_are_deterministic_and_seeded():
    a, b = (
        media.generate_keywords("validation", seed=0, n=12),
        media.generate_keywords("validation", seed=0, n=12),
    )
    assert a["label"] == b["label"] and a["sampling_rate"] == b["sampling_rate"]
    assert all(np.array_equal(x, y) for x, y in zip(a["audio"], b["audio"]))
    other = media.generate_keywords("validation", seed=1, n=12)
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a["audio"], other["audio"]))
    i, j = media.generate_images("test", seed=0, n=8), media.generate_images("test", seed=0, n=8)
    assert i["label"] == j["label"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(i["image"], j["image"]))
    train = media.generate_images("train", seed=0, n=8)["image"]
    assert any(x.size != y.size for x, y in zip(train, i["image"])), "splits are drawn from different streams"


def test_unknown_split_and_source_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="train, validation, test"):
        media.generate_images("dev")
    with pytest.raises(ValueError, match="'embedded' or 'hub'"):
        media.load_shapes("cifar")
    monkeypatch.setenv("COURSE_AUDIO_DATASET", "speech")
    with pytest.raises(ValueError, match="COURSE_AUDIO_DATASET"):
        media_sources()
    monkeypatch.delenv("COURSE_AUDIO_DATASET")
    assert media_sources().audio == "embedded"


def test_image_task_sizes_balance_and_variety():
    shapes = media.load_shapes()
    assert {s: len(d) for s, d in shapes.items()} == media.IMAGE_SPLITS
    assert shapes["train"].features["label"].names == media.IMAGE_CLASSES
    for split in shapes.values():
        counts = Counter(split["label"])
        assert max(counts.values()) - min(counts.values()) <= 1, counts
    sizes = [image.size for image in shapes["train"]["image"]]
    lo, hi = media.IMAGE_SIDES
    assert all(lo <= w <= hi and lo <= h <= hi for w, h in sizes)
    assert len(set(sizes)) > len(sizes) // 2, "image sizes vary, so resizing matters"
    assert {image.mode for image in shapes["validation"]["image"]} == {"RGB"}


def test_audio_task_rates_durations_and_balance():
    keywords = media.load_keywords()
    assert {s: len(d) for s, d in keywords.items()} == media.AUDIO_SPLITS
    rows = keywords["train"].with_format("numpy")[:]
    assert set(rows["sampling_rate"].tolist()) == set(media.SAMPLING_RATES)
    seconds = np.array([len(a) / r for a, r in zip(rows["audio"], rows["sampling_rate"])])
    lo, hi = media.DURATIONS
    assert seconds.min() >= lo - 1e-3 and seconds.max() <= hi + 1e-3
    assert (seconds > media.MAX_SECONDS).sum() > 50 and (seconds < media.MAX_SECONDS).sum() > 50
    counts = Counter(rows["label"].tolist())
    assert max(counts.values()) - min(counts.values()) <= 1
    assert all(np.isfinite(a).all() and np.abs(a).max() < 1.5 for a in rows["audio"])


def test_resample_keeps_in_band_tones_and_removes_aliases():
    rate = 44_100
    t = np.arange(int(0.5 * rate)) / rate
    out = media.resample(np.sin(2 * np.pi * 1_000 * t), rate, 16_000)
    assert out.dtype == np.float32 and len(out) == 8_000
    expected = np.sin(2 * np.pi * 1_000 * np.arange(8_000) / 16_000)
    assert np.abs(out[400:-400] - expected[400:-400]).max() < 1e-3
    high = np.sin(2 * np.pi * 7_000 * np.arange(22_050) / 22_050)
    assert np.abs(media.resample(high, 22_050, 8_000)).max() < 1e-3, "above the new Nyquist: removed"
    naive = np.interp(np.arange(8_000) / 8_000, np.arange(22_050) / 22_050, high)
    assert np.abs(naive).max() > 0.9, "plain interpolation aliases (the lesson's contrast)"
    assert len(media.resample(np.ones(13_331), 22_050, 16_000)) == round(13_331 * 16_000 / 22_050)
    # The FFT sees the clip as one period: a tone that ends mid-cycle jumps where the end meets the start,
    # and what is left of the jump below the new Nyquist frequency rings at both edges (lesson 01b).
    odd = np.abs(media.resample(np.sin(2 * np.pi * 7_000.5 * np.arange(22_050) / 22_050), 22_050, 8_000))
    assert max(odd[:80].max(), odd[-80:].max()) > 0.1, "the first or last 10 ms ring"
    assert odd[80:-80].max() < 1e-3, "away from the edges the tone is removed"
    assert np.array_equal(media.resample(np.ones(5), 16_000, 16_000), np.ones(5, dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        media.resample(np.ones((2, 5)), 8_000, 16_000)


def test_the_hub_audio_switch_says_that_no_hub_audio_dataset_is_wired(monkeypatch):
    monkeypatch.setenv("COURSE_AUDIO_DATASET", "hub")
    with pytest.raises(ValueError, match="No hub audio dataset is wired.*COURSE_AUDIO_DATASET=embedded"):
        media.load_keywords()
    with pytest.raises(ValueError, match="torchcodec"):
        media.load_keywords("hub")


def test_the_clip_to_resample_is_the_first_not_at_the_models_rate():
    assert media.first_to_resample(np.array([16_000, 16_000, 44_100, 8_000])) == 2
    assert media.first_to_resample([8_000, 16_000], model_rate=8_000) == 1
    # a hub dataset such as speech_commands: every clip at 16 kHz, none to resample
    assert media.first_to_resample(np.full(5, media.MODEL_RATE)) is None
    assert media.first_to_resample(np.array([], dtype=np.int32)) is None


def test_processors_give_the_models_shapes(processors):
    image_processor, feature_extractor = processors
    assert type(image_processor).__name__.startswith("ViTImageProcessor")
    images = media.generate_images("test", n=4)
    out = media.image_transform(image_processor)(images)
    assert out["pixel_values"].shape == (4, 3, 32, 32) and out["labels"].tolist() == images["label"]
    assert -1.0 - 1e-6 <= out["pixel_values"].min() and out["pixel_values"].max() <= 1.0 + 1e-6
    clips = media.generate_keywords("test", n=6)
    prepared = media.prepare_audio(clips, feature_extractor)
    assert prepared["input_values"].shape == (6, media.MODEL_RATE)
    real = prepared["attention_mask"].sum(axis=1)
    expected = [
        min(media.MODEL_RATE, round(len(a) * media.MODEL_RATE / r))
        for a, r in zip(clips["audio"], clips["sampling_rate"])
    ]
    assert real.tolist() == expected
    assert (prepared["input_values"][prepared["attention_mask"] == 0] == 0).all()


def test_channel_stats_reads_both_layouts():
    hwc = np.zeros((4, 5, 3))
    hwc[..., 1] = 2.0
    assert media.channel_stats(hwc)["mean"] == [0.0, 2.0, 0.0]
    assert media.channel_stats(torch.from_numpy(hwc.transpose(2, 0, 1)))["mean"] == [0.0, 2.0, 0.0]


def test_models_load_offline_with_from_pretrained():
    vit, w2v = media.load_media_model("image"), media.load_media_model("audio")
    assert type(vit).__name__ == "ViTForImageClassification" and vit.config.num_labels == len(
        media.IMAGE_CLASSES
    )
    assert type(w2v).__name__ == "Wav2Vec2ForSequenceClassification"
    assert w2v.config.id2label[3] == media.AUDIO_CLASSES[3]
    for model in (vit, w2v):
        assert sum(p.numel() for p in model.parameters()) < 500_000
    with pytest.raises(ValueError, match="'image' or 'audio'"):
        media.load_media_model("video")


def test_missing_checkpoint_says_how_to_rebuild(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_media_assets"):
        media.load_media_model("image", tmp_path)


def test_builder_writes_loadable_checkpoints(tmp_path):
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    from course_tools import build_media_assets

    build_media_assets.main(["--image-out", str(tmp_path / "vit"), "--audio-out", str(tmp_path / "w2v")])
    assert AutoImageProcessor.from_pretrained(tmp_path / "vit").size["height"] == 32
    assert AutoFeatureExtractor.from_pretrained(tmp_path / "w2v").sampling_rate == media.MODEL_RATE
    committed = media.load_media_model("image").state_dict()
    rebuilt = media.load_media_model("image", tmp_path / "vit").state_dict()
    assert all(torch.equal(committed[k], rebuilt[k]) for k in committed), (
        "the committed weights are the recipe's"
    )


@pytest.mark.slow
def test_two_training_steps_of_each_model_through_the_loop(processors):
    from course_lib.training import TrainConfig, train

    image_processor, feature_extractor = processors
    shapes = (
        media.load_shapes()["validation"]
        .select(range(16))
        .with_transform(media.image_transform(image_processor))
    )
    clips = media.load_keywords()["validation"].select(range(8))
    audio = clips.map(
        media.prepare_audio,
        batched=True,
        fn_kwargs={"feature_extractor": feature_extractor},
        remove_columns=clips.column_names,
    ).with_format("torch")
    for kind, data, batch in (("image", shapes, 8), ("audio", audio, 4)):
        model = media.load_media_model(kind)
        before = [p.detach().clone() for p in model.parameters()]
        history = train(
            model,
            DataLoader(data, batch_size=batch),
            TrainConfig(max_steps=2, progress=False),
            eval_dataloader=DataLoader(data, batch_size=batch),
        )
        assert len(history.losses) == 2 and all(np.isfinite(history.losses))
        assert history.step_tokens == [batch, batch], "images and audio count examples per step"
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert 0.0 <= history.evals[-1]["accuracy"] <= 1.0


@torch.no_grad()
def test_the_attention_mask_makes_the_audio_model_ignore_the_padding(processors):
    _, feature_extractor = processors
    columns = media.generate_keywords("validation", n=8)
    shortest = min(range(8), key=lambda i: len(columns["audio"][i]) / columns["sampling_rate"][i])
    clip = media.resample(columns["audio"][shortest], columns["sampling_rate"][shortest], media.MODEL_RATE)
    assert len(clip) < media.MODEL_RATE, "a clip shorter than 1 s, so that there is padding"
    model = media.load_media_model("audio").eval()
    alone = feature_extractor(clip, sampling_rate=media.MODEL_RATE, return_tensors="pt")
    padded = feature_extractor(
        clip,
        sampling_rate=media.MODEL_RATE,
        max_length=media.MODEL_RATE,
        padding="max_length",
        return_tensors="pt",
    )
    reference = model(**alone).logits
    masked = (model(**padded).logits - reference).abs().max().item()
    unmasked = (model(input_values=padded["input_values"]).logits - reference).abs().max().item()
    assert masked < unmasked / 100 and unmasked > reference.abs().max().item() / 10


def test_a_dataset_with_other_classes_gets_a_new_head_and_keeps_the_body():
    same = media.load_media_model("audio", labels=media.AUDIO_CLASSES)
    other = media.load_media_model("audio", labels=["yes", "no", "up"])
    assert same.config.num_labels == len(media.AUDIO_CLASSES)
    assert other.config.num_labels == 3 and other.config.id2label == {0: "yes", 1: "no", 2: "up"}
    assert other.classifier.weight.shape[0] == 3
    body, body_again = same.wav2vec2.feature_extractor, other.wav2vec2.feature_extractor
    assert all(torch.equal(a, b) for a, b in zip(body.parameters(), body_again.parameters()))
