import sys

import pytest

from course_lib import widgets


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1e-8", 1e-8),
        (" 65,504 ", 65504.0),
        ("2**-24", 2.0**-24),
        ("2^-24", 2.0**-24),
        (3, 3.0),
        ("1_000", 1000.0),
    ],
)
def test_parse_number(text, value):
    assert widgets.parse_number(text) == value


@pytest.mark.parametrize("text", ["abc", "", "2**x"])
def test_parse_number_says_what_to_type(text):
    with pytest.raises(ValueError, match="2\\*\\*-24"):
        widgets.parse_number(text)


def test_explain_number_never_raises_on_bad_input():
    assert "type e.g." in widgets.explain_number("one")
    assert "does not fit even in float64" in widgets.explain_number("1e300", 1e10)


def test_explain_number_shows_underflow_and_its_rescue():
    assert "UNDERFLOW" in widgets.explain_number("1e-8")
    assert "UNDERFLOW" not in widgets.explain_number("1e-8", 2**16)
    assert "OVERFLOW" in widgets.explain_number("70000")


def test_explorer_updates_when_the_learner_types_or_picks_a_scale():
    explorer = widgets.precision_explorer("1e-8")
    (number, scale), out = explorer.children[0].children, explorer.children[1]
    assert "UNDERFLOW" in out.value and "<pre" in out.value
    assert number.continuous_update  # follows each keystroke: no Enter needed (tests/browser types)
    scale.value = 2.0**16
    assert "UNDERFLOW" not in out.value and "65536" in out.value
    number.value = "70000"
    scale.value = 1.0
    assert "OVERFLOW" in out.value
    number.value = "<b>"
    assert "&lt;b&gt;" in out.value and "type e.g." in out.value  # escaped, with advice
    assert "open the notebook in Jupyter" in repr(explorer)  # what a headless run records


def test_explorer_starts_at_the_scale_it_is_given_even_one_not_in_the_list():
    explorer = widgets.precision_explorer("1e-8", scale=2.0**10)  # not one of SCALES
    number, scale = explorer.children[0].children
    assert scale.value == 1024.0 and ("1024", 1024.0) in scale.options  # before: silently 1 (no scaling)
    assert "x scale 1024" in explorer.children[1].value


def test_explorer_without_ipywidgets_prints_the_text(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    assert widgets.precision_explorer("1e-8") is None
    out = capsys.readouterr().out
    assert "ipywidgets is not installed" in out and "UNDERFLOW" in out
