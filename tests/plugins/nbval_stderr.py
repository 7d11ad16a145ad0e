"""nbval, with stderr held to account: a lesson cell (notebooks/) that writes to stderr something
``tests/explained_stderr.toml`` does not explain fails, so a new warning in a fresh execution is seen.

The committed outputs are checked the same way by ``tests/test_lesson_freshness.py``; this plugin checks
what the suite's own fresh execution writes. Loaded by the repository's ``conftest.py``.
"""

from pathlib import Path

import pytest

from course_tools import freshness


def _lesson_of(item: pytest.Item) -> str | None:
    """The lesson file name of a notebook cell item under notebooks/, else None."""
    if type(item).__name__ != "IPyNbCell" or not hasattr(item.parent, "get_kernel_message"):
        return None
    path = Path(str(item.path))
    return path.name if path.parent.name == "notebooks" else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    lesson = _lesson_of(item)
    if lesson is None:
        return (yield)
    notebook = item.parent
    previous = notebook.__dict__.get("get_kernel_message")  # another plugin's wrapper, if any
    receive = notebook.get_kernel_message
    written: list[str] = []

    def recording(*args, **kwargs):
        message = receive(*args, **kwargs)
        content = message.get("content", {})
        if message.get("msg_type") == "stream" and content.get("name") == "stderr":
            written.append(content.get("text", ""))
        return message

    notebook.get_kernel_message = recording
    try:
        result = yield
    finally:
        if previous is None:
            notebook.__dict__.pop("get_kernel_message", None)
        else:
            notebook.get_kernel_message = previous
    text = "".join(written)
    if text.strip() and not freshness.is_explained(text, lesson, freshness.explanations()):
        first = next(ln for ln in text.splitlines() if ln.strip())
        raise AssertionError(
            f"This cell of {lesson} wrote to stderr: {first[:300]!r}. Silence the warning in the lesson "
            f"(and say why in the prose), or explain it in tests/explained_stderr.toml."
        )
    return result
