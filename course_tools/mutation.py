"""Mutation testing of the training core: run mutmut module by module, keep each module's score as a record.

    make mutation                                         # every core module, one after the other
    make mutation MODULES="course_lib/training/accum.py"  # only these (what changed)
    python -m course_tools.mutation run [MODULE ...]      # the same, what `make mutation` calls
    python -m course_tools.mutation stale                 # modules whose code changed since their score

A module's run starts from an empty ``mutants/`` folder (mutmut's work copy), runs the module's test files
once to learn which tests call which function (mutmut's stats run), then each mutant of the module with
only the tests that call the mutated function, and writes the counts, the surviving mutants' changes and
the module's code fingerprint (``course_tools.freshness.module_fingerprint``: the syntax tree without
docstrings, as the lessons' stamps) to ``docs/results/mutation.json``, then renders docs/mutation.md.

A surviving mutant is either killed by a new test of the behaviour it breaks, or listed in
``docs/results/mutation_equivalents.toml`` with the mutated line and a one-line reason why no caller can
tell it from the original; a listed line that no longer matches the mutant counts as a survivor again.
``tests/test_mutation_record.py`` fails when a recorded module's code no longer has its fingerprint, when
a score is under ``THRESHOLD``, or when a survivor is left unaccounted for.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import tomllib
from datetime import date
from pathlib import Path

from course_tools.freshness import module_fingerprint

ROOT = Path(__file__).resolve().parent.parent
RECORD = "docs/results/mutation.json"
EQUIVALENTS = "docs/results/mutation_equivalents.toml"
THRESHOLD = 0.90  # killed / (mutants - equivalent), in every module
MEASURE = "make mutation MODULES=<module>"

# The test files that claim each module's behaviour (the first matching pattern wins). mutmut's stats run
# then picks, per mutated function, the tests that call it; tests/test_core_*.py hold the tests written
# for surviving mutants.
TESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("course_lib/training/accum.py", ("tests/test_training.py", "tests/test_core_training.py")),
    ("course_lib/training/resume.py", ("tests/test_training.py", "tests/test_core_training.py")),
    ("course_lib/training/metrics.py", ("tests/test_training.py", "tests/test_core_training.py")),
    (
        "course_lib/training/optim.py",
        ("tests/test_training.py", "tests/test_apparatus_optimizers.py", "tests/test_core_training.py"),
    ),
    (
        "course_lib/training/accelerator.py",
        ("tests/test_training_accelerator.py", "tests/test_core_parallel.py"),
    ),
    # the technique files: their own behaviour tests (the loop's tests call them, but check the run, not them)
    ("course_lib/training/kernels.py", ("tests/test_core_techniques.py",)),
    ("course_lib/training/amp.py", ("tests/test_core_techniques.py",)),
    ("course_lib/training/activation_checkpointing.py", ("tests/test_core_techniques.py",)),
    ("course_lib/training/slides.py", ("tests/test_core_techniques.py",)),
    ("course_lib/training/local_sgd.py", ("tests/test_core_techniques.py",)),
    ("course_lib/training/ddp.py", ("tests/test_core_parallel.py",)),
    (
        "course_lib/training/fsdp.py",
        (
            "tests/test_train_fsdp.py",
            "tests/test_core_checkpoints.py",
            "tests/test_core_parallel.py",
            "tests/test_core_fsdp.py",
        ),
    ),
    # the loop: its behaviour tests on models whose steps take microseconds (test_training's DistilBERT
    # runs would make each of its mutants a minute's run)
    ("course_lib/training/loop.py", ("tests/test_core_training.py", "tests/test_core_loop.py")),
    ("course_lib/training/*.py", ("tests/test_training.py", "tests/test_core_training.py")),
    (
        "course_lib/checkpoints.py",
        ("tests/test_checkpoints.py", "tests/test_core_checkpoints.py", "tests/test_training.py"),
    ),
    ("course_lib/data.py", ("tests/test_corpus_and_data.py", "tests/test_core_data.py")),
    ("course_lib/distributed.py", ("tests/test_distributed.py", "tests/test_core_distributed.py")),
    (
        "course_lib/mixed_precision.py",
        ("tests/test_mixed_precision.py", "tests/test_core_mixed_precision.py"),
    ),
    (
        "course_lib/instruments/replicas.py",
        ("tests/test_instruments_replicas.py", "tests/test_instruments.py", "tests/test_core_instruments.py"),
    ),
    ("course_lib/instruments/*.py", ("tests/test_instruments.py", "tests/test_core_instruments.py")),
    ("course_lib/memory_*.py", ("tests/test_memory_model.py", "tests/test_core_memory_model.py")),
)

# mutmut's exit codes, grouped as the record counts them (mutmut.stats.status_by_exit_code)
KILLED, TIMEOUT, SURVIVED, NO_TESTS = "killed", "timeout", "survived", "no tests"


def mutmut_settings(root: Path = ROOT) -> dict:
    """The ``[tool.mutmut]`` table of pyproject.toml."""
    return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["mutmut"]


def core_modules(root: Path = ROOT) -> list[str]:
    """Every module the mutation run covers: pyproject's ``only_mutate`` minus ``do_not_mutate``."""
    settings = mutmut_settings(root)
    found = set()
    for pattern in settings["only_mutate"]:
        for path in root.glob(pattern):
            rel = path.relative_to(root).as_posix()
            if not any(fnmatch.fnmatch(rel, skip) for skip in settings.get("do_not_mutate", [])):
                found.add(rel)
    return sorted(found)


def tests_for(module: str, root: Path = ROOT) -> list[str]:
    """The existing test files that claim ``module``'s behaviour (``TESTS``)."""
    for pattern, files in TESTS:
        if fnmatch.fnmatch(module, pattern):
            return [f for f in files if (root / f).is_file()]
    raise ValueError(
        f"{module} has no test files in course_tools.mutation.TESTS: add the files that test it."
    )


def mutant_module(name: str) -> str:
    """``course_lib.training.accum.x_micro_batches__mutmut_3`` -> ``course_lib/training/accum.py``."""
    dotted = name.split("__mutmut_")[0].rsplit(".", 1)[0]
    return dotted.replace(".", "/") + ".py"


def load_equivalents(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """Mutant name -> ``{"line": the mutated line, "reason": why it is equivalent}``."""
    path = root / EQUIVALENTS
    return tomllib.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def changed_line(diff: str) -> tuple[str, str]:
    """The (original, mutated) lines of a one-mutant diff, stripped; several lines joined by ' / '."""
    old = [
        line[1:].strip() for line in diff.splitlines() if line.startswith("-") and not line.startswith("---")
    ]
    new = [
        line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
    ]
    return " / ".join(old), " / ".join(new)


def tally(statuses: dict[str, str], diffs: dict[str, str], equivalents: dict[str, dict[str, str]]) -> dict:
    """One module's counts and lists from its mutants' statuses and the diffs of those not killed."""
    counts = {KILLED: 0, TIMEOUT: 0, "equivalent": 0, SURVIVED: 0, NO_TESTS: 0, "other": 0}
    equivalent, survivors = [], []
    for name in sorted(statuses, key=lambda n: (n.split("__mutmut_")[0], int(n.split("__mutmut_")[1]))):
        status = statuses[name]
        if status in (KILLED, TIMEOUT):
            counts[status] += 1
            continue
        was, now = changed_line(diffs.get(name, ""))
        listed = equivalents.get(name)
        if listed and listed.get("line", "").strip() == now:
            counts["equivalent"] += 1
            equivalent.append({"mutant": name, "was": was, "now": now, "reason": listed["reason"]})
            continue
        counts[status if status in (SURVIVED, NO_TESTS) else "other"] += 1
        survivors.append({"mutant": name, "status": status, "was": was, "now": now})
    total = len(statuses)
    scored = total - counts["equivalent"]
    return {
        "mutants": total,
        "killed": counts[KILLED],
        "timeout": counts[TIMEOUT],
        "equivalent": counts["equivalent"],
        "survived": counts[SURVIVED],
        "no_tests": counts[NO_TESTS],
        "other": counts["other"],
        "score": round((counts[KILLED] + counts[TIMEOUT]) / scored, 4) if scored else 1.0,
        "equivalents": equivalent,
        "survivors": survivors,
    }


# ----------------------------------------------------------------------------------------------
# One module's run, inside mutmut (a child process per module: mutmut keeps module-level state)


def _run_mutmut(module: str, tests: list[str], out: Path) -> None:
    """Run mutmut on ``module`` with ``tests`` (cwd: the repository root); write statuses and diffs to ``out``."""
    from mutmut import configuration

    cfg = configuration._load_config()  # pyproject's [tool.mutmut], narrowed to this module and its tests
    cfg.only_mutate = [module]
    cfg.pytest_add_cli_args_test_selection = list(tests)
    configuration._config = cfg
    import mutmut.__main__ as mutmut_main
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    mutmut_main.cli(["run", "--max-children", str(os.cpu_count() or 2)], standalone_mode=False)
    data = SourceFileMutationData(path=Path(module))
    data.load()
    statuses = {name: status_by_exit_code[code] for name, code in data.exit_code_by_key.items()}
    diffs = {
        name: get_diff_for_mutant(name, path=Path(module))
        for name, status in statuses.items()
        if status not in (KILLED, TIMEOUT)
    }
    out.write_text(json.dumps({"statuses": statuses, "diffs": diffs}, indent=1), encoding="utf-8")


def measure_module(module: str, root: Path = ROOT) -> dict:
    """Run mutmut on one module from an empty ``mutants/``; its record entry (counts, lists, time)."""
    tests = tests_for(module, root)
    shutil.rmtree(root / "mutants", ignore_errors=True)
    out = root / "mutants" / "course-summary.json"  # mutants/ is emptied first, then made by mutmut
    start = time.monotonic()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    code = (
        "import sys; from pathlib import Path; from course_tools.mutation import _run_mutmut; "
        "_run_mutmut(sys.argv[1], sys.argv[3:], Path(sys.argv[2]))"
    )
    subprocess.run([sys.executable, "-c", code, module, str(out), *tests], cwd=root, env=env, check=True)
    seconds = time.monotonic() - start
    summary = json.loads(out.read_text(encoding="utf-8"))
    out.unlink()
    entry = tally(summary["statuses"], summary["diffs"], load_equivalents(root))
    return {
        "fingerprint": module_fingerprint(root / module),
        "tests": tests,
        **entry,
        "seconds": round(seconds),
        "measured": date.today().isoformat(),
        "cpus": os.cpu_count(),
    }


def load_mutation_record(root: Path = ROOT) -> dict:
    """The committed record (an empty one before the first run)."""
    path = root / RECORD
    if not path.is_file():
        return {"tool": "", "modules": {}}
    return json.loads(path.read_text(encoding="utf-8"))


MUTATION_ABOUT = (
    "Mutation scores of the training core, one entry per module measured by `make mutation MODULES=...` "
    "(course_tools/mutation.py, mutmut): counts, survivors, run time and the fingerprint of the code measured. "
    "docs/mutation.md is rendered from it by `python -m course_tools.sections render mutation`."
)


def write_mutation_record(record: dict, root: Path = ROOT) -> None:
    record["about"] = MUTATION_ABOUT
    record["core"] = core_modules(root)
    record["modules"] = dict(sorted(record["modules"].items()))
    (root / RECORD).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def stale_modules(record: dict, root: Path = ROOT) -> list[str]:
    """Recorded modules whose code no longer has the recorded fingerprint (or that are gone)."""
    return [
        module
        for module, entry in record["modules"].items()
        if not (root / module).is_file() or module_fingerprint(root / module) != entry["fingerprint"]
    ]


# ----------------------------------------------------------------------------------------------
# The docs/mutation.md block


def _share(entry: dict) -> str:
    return f"{entry['score'] * 100:.0f} %"


def render_report(record: dict) -> str:
    """The ``mutation`` block: score per module, what is not measured, the equivalent mutants and why."""
    modules = record["modules"]
    lines = [
        f"Measured with {record['tool']}; score = (killed + timed out) / (mutants − equivalent), "
        f"at least {THRESHOLD * 100:.0f} % in every module.",
        "",
        "| module | mutants | killed | timed out | equivalent | survived | no tests | score | run time | "
        "measured | fingerprint |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for module, e in modules.items():
        lines.append(
            f"| `{module}` | {e['mutants']} | {e['killed']} | {e['timeout']} | {e['equivalent']} | "
            f"{e['survived']} | {e['no_tests']} | {_share(e)} | {e['seconds'] // 60} min {e['seconds'] % 60:02d} s | "
            f"{e['measured']} ({e['cpus']} CPUs) | `{e['fingerprint']}` |"
        )
    missing = [m for m in record.get("core", []) if m not in modules]
    if missing:
        lines += ["", "Not measured yet: " + ", ".join(f"`{m}`" for m in missing) + "."]
    listed = [(m, eq) for m, e in modules.items() for eq in e["equivalents"]]
    if listed:
        lines += ["", "Equivalent mutants (`docs/results/mutation_equivalents.toml`):", ""]
        lines += ["| mutant | original | mutated | why no caller can tell |", "|---|---|---|---|"]
        for _, eq in listed:
            cells = [eq["mutant"].split(".")[-1], eq["was"], eq["now"], eq["reason"]]
            cells = [c.replace("|", "\\|") for c in cells]  # a table cell holds no bare |
            lines.append("| " + " | ".join(f"`{c}`" if i < 3 else c for i, c in enumerate(cells)) + " |")
    left = [(m, s) for m, e in modules.items() for s in e["survivors"]]
    if left:
        lines += ["", "Survivors not yet killed or explained:", ""]
        lines += [f"- `{s['mutant']}` ({s['status']}): `{s['was']}` → `{s['now']}`" for _, s in left]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_tools.mutation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=["run", "stale", "list"])
    parser.add_argument("modules", nargs="*", help="run: the modules to measure (default: every core module)")
    args = parser.parse_args(argv)
    record = load_mutation_record()
    if args.command == "list":
        for module in core_modules():
            print(module, " ".join(tests_for(module)))
        return 0
    if args.command == "stale":
        stale = stale_modules(record)
        missing = [m for m in core_modules() if m not in record["modules"]]
        for module in stale:
            print(f"changed since its score: {module}")
        for module in missing:
            print(f"not measured: {module}")
        return 1 if stale else 0
    modules = args.modules or core_modules()
    unknown = [m for m in modules if m not in core_modules()]
    if unknown:
        print(
            f"error: not core modules (pyproject's [tool.mutmut] only_mutate): {', '.join(unknown)}",
            file=sys.stderr,
        )
        return 2
    from importlib.metadata import version

    from course_tools.sections import generated, render_section

    record["tool"] = (
        f"mutmut {version('mutmut')} ({platform.python_implementation()} {platform.python_version()})"
    )
    for module in modules:
        entry = measure_module(module)
        record["modules"][module] = entry
        write_mutation_record(record)
        print(
            f"{module}: {entry['mutants']} mutants, {entry['killed'] + entry['timeout']} killed, "
            f"{entry['equivalent']} equivalent, {len(entry['survivors'])} left, score {_share(entry)}, "
            f"{entry['seconds']} s"
        )
        for s in entry["survivors"]:
            print(f"  {s['mutant']} ({s['status']}): {s['was']!r} -> {s['now']!r}")
    render_section(generated("mutation"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
