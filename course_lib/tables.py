"""Plain-text tables for notebook output: aligned columns, no dependencies, stable for nbval."""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Any


def display_width(text: str) -> int:
    """Columns ``text`` takes in a monospaced font: full-width (Japanese) characters take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def align_columns(rows: list[tuple[str, ...]]) -> str:
    """Rows of strings as left-aligned columns separated by two spaces."""
    # [width] by display columns, not characters: "ゼロ" is 2 characters but 4 columns wide
    widths = [max(display_width(r[i]) for r in rows) for i in range(len(rows[0]))]
    # rstrip: no trailing blanks (an editor or a diff would strip them, and nbval would then differ)
    return "\n".join(
        "  ".join(c + " " * (w - display_width(c)) for c, w in zip(r, widths)).rstrip() for r in rows
    )


def render_table(rows: list[Mapping[str, Any]], floats: str = ".3g") -> str:
    """A list of dicts (same keys) as aligned text; floats formatted with ``floats``."""
    if not rows:
        raise ValueError("No rows to show: pass a non-empty list of dicts.")
    keys = list(rows[0])

    def cell(v: Any) -> str:
        return format(v, floats) if isinstance(v, float) else str(v)

    return align_columns([tuple(keys), *[tuple(cell(r.get(k, "")) for k in keys) for r in rows]])
