"""Interactive explorers for the lessons (ipywidgets), with a plain-text fallback.

``precision_explorer()``: type a number, pick a loss scale, and see how fp32, fp16 and bf16 store it
(sign / exponent / mantissa bits), what it rounds to, and whether it underflows or overflows. The text
it shows is ``explain_number(...)``, which a headless run (nbval, nbclient, nbgrader) can print
instead: the widget needs a live Jupyter front end, the function does not.
"""

from __future__ import annotations

import html
import math

from course_lib.floats import describe_number

SCALES: dict[str, float] = {
    "1 (no scaling)": 1.0,
    "2^8": 2.0**8,
    "2^16 (GradScaler start)": 2.0**16,
    "2^24": 2.0**24,
}


def parse_number(text: str | float) -> float:
    """A float from what a learner typed (``1e-8``, ``6.5e4``, ``2**-24``, ``65,504``)."""
    if isinstance(text, int | float):
        return float(text)
    s = str(text).strip().replace(",", "").replace("_", "")
    if "**" in s or "^" in s:  # a power of two or ten such as 2**-24 or 2^-24
        base, _, exp = s.replace("^", "**").partition("**")
        try:
            return float(base) ** float(exp)
        except (ValueError, OverflowError, ZeroDivisionError) as err:
            raise ValueError(f"Could not read {text!r}: write a power as 2**-24 or 2^-24.") from err
    try:
        return float(s)
    except ValueError as err:
        raise ValueError(
            f"Could not read {text!r} as a number: type e.g. 1e-8, 0.1, 65504 or 2**-24."
        ) from err


def explain_number(text: str | float, scale: float = 1.0) -> str:
    """What the explorer shows for ``text``: the ``describe_number`` table, or what to type instead."""
    try:
        x = parse_number(text)
    except ValueError as err:
        return str(err)
    if math.isinf(x * scale) and not math.isinf(x):
        return f"{x:g} x {scale:g} does not fit even in float64: try a smaller number or scale."
    return describe_number(x, scale)


def precision_explorer(value: str = "1e-8", scale: float = 1.0):
    """An ipywidgets explorer of ``explain_number``; without ipywidgets, prints the text instead.

    Returns the widget (display it, or leave it as the cell's last expression), or ``None`` when
    ipywidgets is not installed.
    """
    try:
        import ipywidgets as w
    except ImportError:
        print("ipywidgets is not installed (pip install ipywidgets): showing the text instead.\n")
        print(explain_number(value, scale))
        return None

    # continuous_update: the text follows each keystroke (no Enter needed); a half-typed number such
    # as "1e-" shows what to type instead until it reads as a number again.
    number = w.Text(
        value=str(value),
        description="number",
        placeholder="1e-8, 65504, 2**-24",
        continuous_update=True,
    )
    options = list(SCALES.items())
    if float(scale) not in SCALES.values():  # a Dropdown's value must be one of its options: add it
        options.append((f"{float(scale):g}", float(scale)))
    scale_box = w.Dropdown(options=options, value=float(scale), description="scale")
    out = w.HTML()

    def render(_change=None) -> None:
        text = explain_number(number.value, scale_box.value)
        out.value = f"<pre style='font-size: 12px; line-height: 1.35'>{html.escape(text)}</pre>"

    number.observe(render, names="value")
    scale_box.observe(render, names="value")
    render()

    class PrecisionExplorer(w.VBox):
        def __repr__(self) -> str:  # what a headless run (no front end) records instead of the view
            return "PrecisionExplorer: interactive, open the notebook in Jupyter to use it"

    return PrecisionExplorer([w.HBox([number, scale_box]), out])
