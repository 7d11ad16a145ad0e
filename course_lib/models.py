"""Models: the embedded pretrained DistilBERT checkpoint, or a hub model behind one switch."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError

from course_lib.config import EMBEDDED, sources

EMBEDDED_MODEL_DIR = Path(__file__).resolve().parent / "assets" / "tiny-distilbert"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def resolve_model_name(name: str | None = None) -> str:
    """Turn ``None`` / ``"embedded"`` / a hub id / a folder into what ``from_pretrained`` takes."""
    name = sources().model if name is None else name
    if name == EMBEDDED:
        check_checkpoint_dir(EMBEDDED_MODEL_DIR)
        return str(EMBEDDED_MODEL_DIR)
    path = Path(name).expanduser()
    # a path-like name that does not exist gets a clear error, not a hub lookup
    if path.exists() or name.startswith((".", "/", "~")):
        check_checkpoint_dir(path)
        return str(path)
    return name  # a hub id


def check_checkpoint_dir(path: Path) -> None:
    """Raise a clear error if ``path`` is not a loadable Hugging Face checkpoint folder."""
    if not path.is_dir():
        raise FileNotFoundError(
            f"No checkpoint folder at {path}. Rebuild the embedded one with "
            "`python -m course_tools.build_assets`, or pass a hub id such as "
            "'distilbert-base-uncased' (needs internet)."
        )
    missing = [f for f in _REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Checkpoint folder {path} lacks {', '.join(missing)}. Rebuild it with "
            "`python -m course_tools.build_assets --out <folder>` or save a model there with "
            "`model.save_pretrained(folder)` and `tokenizer.save_pretrained(folder)`."
        )
    try:
        json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path / 'config.json'} is not valid JSON ({err}). The checkpoint is corrupt: "
            "rebuild it with `python -m course_tools.build_assets`."
        ) from err


def load_tokenizer(name: str | None = None):
    """The tokenizer of ``name`` (default: the ``COURSE_MODEL`` switch, i.e. the embedded one)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_name(name))


def load_model(name: str | None = None, num_labels: int = 2, pretrained: bool = True):
    """A ``AutoModelForSequenceClassification`` in fp32: pretrained weights, or random init.

    With ``pretrained=False`` the same architecture is built from the config alone, which is the
    fair baseline for "what does pretraining buy us?".
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    resolved = resolve_model_name(name)
    if not pretrained:
        config = AutoConfig.from_pretrained(resolved, num_labels=num_labels)
        return AutoModelForSequenceClassification.from_config(config)
    # The "newly initialized classifier weights" notice is expected here: keep it off stderr.
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bar: noise on stderr for a 1 s load
    try:
        try:
            return AutoModelForSequenceClassification.from_pretrained(
                # transformers 5 defaults to "auto", the checkpoint's dtype
                resolved,
                num_labels=num_labels,
                dtype=torch.float32,
            )
        except (OSError, ValueError) as err:
            raise type(err)(
                f"Could not load model {resolved!r}: {err}\nIf this is a hub id, you need internet "
                "(or a cached copy); offline, use COURSE_MODEL=embedded."
            ) from err
        except SafetensorError as err:  # a truncated or overwritten weights file
            raise OSError(
                f"Could not load model {resolved!r}: its model.safetensors is damaged ({err}). Restore "
                "it (`git checkout -- course_lib/assets` for the embedded one) or rebuild the embedded "
                "checkpoint with `python -m course_tools.build_assets`."
            ) from err
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def count_parameters(model: torch.nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
