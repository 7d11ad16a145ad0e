"""Build lesson 01b's two small models: ``python -m course_tools.build_media_assets``.

Writes, in Hugging Face format, with random weights (seed 0; not pretrained):

* ``course_lib/assets/tiny-vit``: a ``ViTForImageClassification`` (32 x 32 RGB images, 8 x 8 patches,
  hidden size 64, 2 layers, 4 heads; the four shape classes) and a ``preprocessor_config.json`` for
  ``AutoImageProcessor`` (resize to 32 x 32, rescale 1/255, normalise with mean 0.5 and std 0.5).
* ``course_lib/assets/tiny-wav2vec2``: a ``Wav2Vec2ForSequenceClassification`` (a 3-layer convolutional
  feature encoder with strides 5, 4, 4, so 80 samples per frame at 16 kHz, then 2 transformer layers of
  width 64; the four keyword classes) and the ``preprocessor_config.json`` of a
  ``Wav2Vec2FeatureExtractor`` for ``AutoFeatureExtractor`` (16 kHz, zero-mean unit-variance
  normalisation, attention mask returned, as for the layer-norm wav2vec2 checkpoints).

The weights depend only on the torch build and the seed; the files take well under a second to build
and stay far below 2 MB. No weights are downloaded: the architectures are built from their configs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from course_lib.media import AUDIO_CLASSES, AUDIO_MODEL_DIR, IMAGE_CLASSES, IMAGE_MODEL_DIR, MODEL_RATE

IMAGE_SIDE = 32


def _labels(classes: list[str]) -> dict:
    return {"id2label": dict(enumerate(classes)), "label2id": {c: i for i, c in enumerate(classes)}}


def build_vit(out: Path, seed: int = 0) -> Path:
    """Save a tiny ``ViTForImageClassification`` and its image processor in ``out``."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    config = ViTConfig(
        image_size=IMAGE_SIDE,
        patch_size=8,
        num_channels=3,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        **_labels(IMAGE_CLASSES),
    )
    torch.manual_seed(seed)
    ViTForImageClassification(config).save_pretrained(out)
    # The PIL class saves the same config as ViTImageProcessor ("image_processor_type": "ViTImageProcessor").
    processor = ViTImageProcessorPil(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(out)
    return out


def build_wav2vec2(out: Path, seed: int = 0) -> Path:
    """Save a tiny ``Wav2Vec2ForSequenceClassification`` and its feature extractor in ``out``."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor, Wav2Vec2ForSequenceClassification

    config = Wav2Vec2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 4, 4),
        conv_kernel=(10, 8, 8),
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        classifier_proj_size=32,
        mask_time_prob=0.0,  # no SpecAugment masking and no dropout: a tiny model, a short budget
        **dict.fromkeys(
            (
                "hidden_dropout",
                "activation_dropout",
                "attention_dropout",
                "feat_proj_dropout",
                "final_dropout",
                "layerdrop",
            ),
            0.0,
        ),
        **_labels(AUDIO_CLASSES),
    )
    torch.manual_seed(seed)
    Wav2Vec2ForSequenceClassification(config).save_pretrained(out)
    Wav2Vec2FeatureExtractor(
        feature_size=1,
        sampling_rate=MODEL_RATE,
        padding_value=0.0,
        do_normalize=True,
        return_attention_mask=True,
    ).save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image-out", type=Path, default=IMAGE_MODEL_DIR)
    parser.add_argument("--audio-out", type=Path, default=AUDIO_MODEL_DIR)
    args = parser.parse_args(argv)
    for path in (build_vit(args.image_out), build_wav2vec2(args.audio_out)):
        size = sum(f.stat().st_size for f in path.iterdir())
        print(f"wrote {path} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
