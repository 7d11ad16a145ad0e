"""nbval, bounded: a notebook cell may send at most ``IOPUB_BUDGET`` messages, and nbval waits
``OUTPUT_TIMEOUT`` s (not its hard-coded 5 s) for a finished cell's next message.

The budget is a count, not a time, so the check gives the same answer on every machine. Loaded by the
repository's ``conftest.py``; ``pytest -p nbval_budget`` loads it elsewhere (tests/plugins on the path).
"""

import pytest

IOPUB_BUDGET = 300  # messages a single notebook cell may send (outputs, widget updates, status)
OUTPUT_TIMEOUT = 60  # seconds nbval waits for a finished cell's next output message


def _is_notebook_cell(item: pytest.Item) -> bool:
    return type(item).__name__ == "IPyNbCell" and hasattr(item.parent, "get_kernel_message")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_notebook_cell(item):
            item.output_timeout = OUTPUT_TIMEOUT


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Count the kernel messages a notebook cell sends; fail the cell above ``IOPUB_BUDGET``."""
    if not _is_notebook_cell(item):
        return (yield)
    notebook = item.parent
    receive = notebook.get_kernel_message
    count = 0

    def counting(*args, **kwargs):
        nonlocal count
        message = receive(*args, **kwargs)
        count += 1
        return message

    notebook.get_kernel_message = counting
    try:
        result = yield
    finally:
        del notebook.get_kernel_message  # back to the class's method
    item.user_properties.append(("iopub_messages", count))
    if count > IOPUB_BUDGET:
        raise AssertionError(
            f"This cell sent {count} messages to the kernel client (budget {IOPUB_BUDGET}). A progress "
            "bar or display updated on every step floods the channel (nbval then times out on slow or "
            "busy machines): redraw at a bounded rate (tqdm mininterval, set_postfix(refresh=False))."
        )
    return result


_COUNTS: list[tuple[int, str]] = []


def pytest_runtest_logreport(report) -> None:
    for key, value in getattr(report, "user_properties", []):
        if key == "iopub_messages" and report.when == "call":
            _COUNTS.append((value, report.nodeid))


def pytest_terminal_summary(terminalreporter) -> None:
    if _COUNTS:
        top = sorted(_COUNTS, reverse=True)[:3]
        terminalreporter.write_line(
            f"notebook cells: {len(_COUNTS)} run, kernel messages per cell at most {top[0][0]} "
            f"(budget {IOPUB_BUDGET}); busiest: " + "; ".join(f"{n} {node}" for n, node in top)
        )
