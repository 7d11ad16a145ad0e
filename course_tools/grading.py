"""The course's additions to nbgrader, registered in ``nbgrader_config.py``.

``QuietOverwriteCells`` is nbgrader's ``OverwriteCells`` without its false alarm. The release strips the
hidden tests from a test cell, so every submitted test cell that had hidden tests differs from the copy
in the gradebook, and ``OverwriteCells`` logs "Attribute 'checksum' for cell ... has changed!" for each
of them in every submission, although nobody edited anything. ``QuietOverwriteCells`` first puts the
hidden tests back into a cell that is exactly its released version (the gradebook's source with the
hidden-test region removed, as ``ClearHiddenTests`` removes it); ``OverwriteCells`` then finds it
unchanged. Any other edit is still reported and replaced by the original, so the protection is the
same: every locked cell is graded with the gradebook's source.

nbgrader's own ``LimitOutput`` bounds the number of *lines* a cell keeps, not their length: a submission
that prints one 5 MB line puts all of it into the autograded notebook, the gradebook's view of it and
the feedback page. ``LimitOutputSize`` bounds the *characters* instead: every code cell keeps at most
``max_chars`` characters of output (text streams, rich display data, error messages and tracebacks), and
each cut says how much was cut. It never removes an output, so the grade of a cell does not change: an
error or a write to stderr still scores zero, as nbgrader decides from the kind of output, not its text.
"""

from __future__ import annotations

import json

from nbformat.notebooknode import NotebookNode
from nbgrader.api import MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, LimitOutput, NbGraderPreprocessor, OverwriteCells
from traitlets import Integer

OUTPUT_CHAR_LIMIT = 20_000  # characters of output one cell keeps in autograded notebooks and feedback
NOTE = "\n... [output truncated by the autograder: {total:,} characters, the first {kept:,} kept] ...\n"
TEXT_MIME = "text/plain"


class LimitOutputSize(NbGraderPreprocessor):
    """Keep at most ``max_chars`` characters of output per code cell; mark every cut."""

    max_chars = Integer(
        OUTPUT_CHAR_LIMIT,
        help="characters of output kept per code cell (-1 means no limit)",
    ).tag(config=True)

    def preprocess_cell(self, cell, resources, cell_index):
        if cell.cell_type == "code" and self.max_chars >= 0:
            budget = _Budget(self.max_chars)
            for output in cell.get("outputs", []):
                _limit_output(output, budget)
        return cell, resources


class _Budget:
    """The characters a cell may still keep."""

    def __init__(self, chars: int):
        self.left = chars

    def take(self, text) -> str:
        """``text`` if it fits in what is left, else its head and a note saying how much was cut."""
        if not isinstance(text, str):
            text = "".join(text)  # a multi-line string stored as a list of lines
        if len(text) <= self.left:
            self.left -= len(text)
            return text
        kept, self.left = text[: self.left], 0
        return kept + NOTE.format(total=len(text), kept=len(kept))


def _size(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return sum(map(len, value))
    return len(json.dumps(value))


def _limit_output(output, budget: _Budget) -> None:
    kind = output.get("output_type")
    if kind == "stream":
        output["text"] = budget.take(output.get("text", ""))
    elif kind in ("execute_result", "display_data"):
        data = output.get("data", {})
        total = sum(_size(v) for v in data.values())
        if total <= budget.left:
            budget.left -= total
            return
        # Too big: keep only the plain text (a cut HTML page, image or JSON would be broken), bounded.
        plain = data.get(TEXT_MIME)
        if plain is None:
            plain = f"<{', '.join(sorted(data))} output of {total:,} characters>"
        output["data"] = {TEXT_MIME: budget.take(plain)}
    elif kind == "error":
        output["evalue"] = budget.take(output.get("evalue", ""))
        traceback = []
        for line in output.get("traceback", []):
            if budget.left == 0:
                traceback.append(NOTE.format(total=sum(map(len, output["traceback"])), kept=0).strip())
                break
            traceback.append(budget.take(line))
        output["traceback"] = traceback


def released_source(source: str) -> str:
    """``source`` as the release shows it: with its hidden-test region removed (nbgrader's ClearHiddenTests)."""
    cell = NotebookNode(cell_type="code", source=source, metadata={})
    ClearHiddenTests()._remove_hidden_test_region(cell)
    return cell.source


class QuietOverwriteCells(OverwriteCells):
    """``OverwriteCells`` that does not report a locked cell as changed when it is exactly as released."""

    def preprocess_cell(self, cell, resources, cell_index):
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is not None:
            try:
                source = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id)
            except MissingEntry:
                source = None  # OverwriteCells reports it
            if source is not None and source.locked and cell.source != source.source:
                if cell.source == released_source(source.source):
                    cell.source = source.source  # the released cell: only the hidden tests are missing
        return super().preprocess_cell(cell, resources, cell_index)


def with_quiet_overwrite(preprocessors: list) -> list:
    """``preprocessors`` with nbgrader's ``OverwriteCells`` replaced by ``QuietOverwriteCells``."""
    assert OverwriteCells in preprocessors, f"no OverwriteCells in {preprocessors}"
    return [QuietOverwriteCells if p is OverwriteCells else p for p in preprocessors]


def with_output_size_limit(preprocessors: list) -> list:
    """``preprocessors`` with ``LimitOutputSize`` right after nbgrader's ``LimitOutput`` (or at the end)."""
    result = [p for p in preprocessors if p is not LimitOutputSize]
    position = next((i + 1 for i, p in enumerate(result) if p is LimitOutput), len(result))
    return [*result[:position], LimitOutputSize, *result[position:]]


def default_preprocessors(converter: type, trait: str) -> list:
    """The preprocessor list nbgrader's ``converter`` uses by default (its ``trait``, e.g. ``preprocessors``)."""
    return list(converter.class_traits()[trait].default())
