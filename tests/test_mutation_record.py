"""The mutation-testing record (docs/results/mutation.json, course_tools.mutation) is kept up to date."""

from course_tools import mutation
from course_tools.mutation import (
    MEASURE,
    THRESHOLD,
    core_modules,
    load_equivalents,
    load_mutation_record,
    mutant_module,
    stale_modules,
    tally,
)

RECORD = load_mutation_record()


def test_every_recorded_module_still_has_the_code_its_score_was_measured_on():
    stale = stale_modules(RECORD)
    assert not stale, (
        f"the code of {', '.join(stale)} changed since its mutation score was measured: measure it again "
        f"with `{MEASURE.replace('<module>', ' '.join(stale))}` and kill or explain the new survivors."
    )


def test_every_recorded_module_meets_the_score_and_leaves_no_survivor_unexplained():
    for module, entry in RECORD["modules"].items():
        assert entry["score"] >= THRESHOLD, f"{module}: mutation score {entry['score']:.0%} < {THRESHOLD:.0%}"
        assert not entry["survivors"], (
            f"{module}: surviving mutants neither killed by a test nor listed as equivalent: "
            + ", ".join(s["mutant"] for s in entry["survivors"])
        )


def test_the_record_names_the_current_core_and_each_module_has_test_files():
    assert RECORD["core"] == core_modules(), "the core changed: run `make mutation MODULES=<new module>`"
    assert all(
        mutation.tests_for(module) for module in core_modules()
    )  # not imported: pytest would collect it


def test_every_equivalent_entry_is_one_the_record_counted():
    counted = {eq["mutant"] for entry in RECORD["modules"].values() for eq in entry["equivalents"]}
    listed = {name for name in load_equivalents() if mutant_module(name) in RECORD["modules"]}
    assert listed == counted, (
        f"entries of docs/results/mutation_equivalents.toml that no run counted: {listed - counted}"
    )


def test_an_equivalent_entry_lapses_when_its_mutant_changes():
    diff = "--- a\n+++ b\n-    return a < b\n+    return a <= b\n"
    statuses = {"m.f__mutmut_1": "killed", "m.f__mutmut_2": "survived"}
    listed = {"m.f__mutmut_2": {"line": "return a <= b", "reason": "a never equals b"}}
    entry = tally(statuses, {"m.f__mutmut_2": diff}, listed)
    assert (entry["equivalent"], entry["survivors"], entry["score"]) == (1, [], 1.0)
    moved = {"m.f__mutmut_2": {"line": "return a > b", "reason": "a never equals b"}}
    entry = tally(statuses, {"m.f__mutmut_2": diff}, moved)
    assert entry["equivalent"] == 0 and entry["score"] == 0.5
    assert entry["survivors"] == [
        {"mutant": "m.f__mutmut_2", "status": "survived", "was": "return a < b", "now": "return a <= b"}
    ]
