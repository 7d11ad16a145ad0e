"""Environment switches, read in one place.

``COURSE_MODEL``    ``embedded`` (default: the small DistilBERT shipped with the course), a Hugging
                    Face hub id such as ``distilbert-base-uncased``, or a local checkpoint folder.
``COURSE_DATASET``  ``embedded`` (default: the course's MRPC-shaped paraphrase data) or ``hub``
                    (``nyu-mll/glue``, config ``mrpc``).
``COURSE_IMAGE_DATASET`` / ``COURSE_AUDIO_DATASET``  ``embedded`` (default: lesson 01b's generated shapes
                    and keyword clips) or ``hub`` (images: ``HUB_IMAGE_DATASET``; audio: no hub dataset is
                    wired, ``course_lib.media.load_keywords`` says why).
Every hub choice needs internet the first time (the files are cached afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

EMBEDDED = "embedded"
HUB_DATASET = ("nyu-mll/glue", "mrpc")
HUB_IMAGE_DATASET = ("AI-Lab-Makerere/beans", None)  # leaf photos, 3 classes, column "labels"


@dataclass(frozen=True)
class Sources:
    """Where the model and the dataset come from."""

    model: str = EMBEDDED
    dataset: str = EMBEDDED


def sources() -> Sources:
    """Read ``COURSE_MODEL`` / ``COURSE_DATASET`` (default: both embedded)."""
    dataset = os.environ.get("COURSE_DATASET", EMBEDDED).strip() or EMBEDDED  # set but empty: the default
    if dataset not in (EMBEDDED, "hub"):
        raise ValueError(
            f"COURSE_DATASET={dataset!r} is not understood: use 'embedded' (offline default) "
            "or 'hub' (GLUE MRPC from the Hugging Face Hub)."
        )
    model = os.environ.get("COURSE_MODEL", EMBEDDED).strip() or EMBEDDED
    return Sources(model=model, dataset=dataset)


@dataclass(frozen=True)
class MediaSources:
    """Where lesson 01b's image and audio datasets come from."""

    image: str = EMBEDDED
    audio: str = EMBEDDED


def media_sources() -> MediaSources:
    """Read ``COURSE_IMAGE_DATASET`` / ``COURSE_AUDIO_DATASET`` (default: both embedded)."""
    chosen = {}
    for field, switch in (("image", "COURSE_IMAGE_DATASET"), ("audio", "COURSE_AUDIO_DATASET")):
        value = os.environ.get(switch, EMBEDDED).strip() or EMBEDDED
        if value not in (EMBEDDED, "hub"):
            raise ValueError(
                f"{switch}={value!r} is not understood: use 'embedded' (offline default) or 'hub'."
            )
        chosen[field] = value
    return MediaSources(**chosen)
