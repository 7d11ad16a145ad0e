"""Environment switches, read in one place.

``COURSE_MODEL``    ``embedded`` (default: the small DistilBERT shipped with the course), a Hugging
                    Face hub id such as ``distilbert-base-uncased``, or a local checkpoint folder.
``COURSE_DATASET``  ``embedded`` (default: the course's MRPC-shaped paraphrase data) or ``hub``
                    (``nyu-mll/glue``, config ``mrpc``).
Both hub choices need internet the first time (the files are cached afterwards).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

EMBEDDED = "embedded"
HUB_DATASET = ("nyu-mll/glue", "mrpc")


@dataclass(frozen=True)
class Sources:
    """Where the model and the dataset come from."""

    model: str = EMBEDDED
    dataset: str = EMBEDDED


def sources() -> Sources:
    """Read ``COURSE_MODEL`` / ``COURSE_DATASET`` (default: both embedded)."""
    dataset = os.environ.get("COURSE_DATASET", EMBEDDED).strip() or EMBEDDED
    if dataset not in (EMBEDDED, "hub"):
        raise ValueError(
            f"COURSE_DATASET={dataset!r} is not understood: use 'embedded' (offline default) "
            "or 'hub' (GLUE MRPC from the Hugging Face Hub)."
        )
    model = os.environ.get("COURSE_MODEL", EMBEDDED).strip() or EMBEDDED
    return Sources(model=model, dataset=dataset)
