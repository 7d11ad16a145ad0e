"""Generated sections: one writer each, rendered from a committed record, and no drift.

Nothing here measures: every writer runs in its render-only form (``course_tools.sections render`` /
``nbtools render``) on a temporary copy of the committed files.
"""

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from course_lib.benchmark import config as bench_config
from course_lib.benchmark import report as bench_report
from course_tools import nbtools, sections

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))
MARKED = [
    ("README.md", "lessons"),
    ("docs/embedded.md", "pretrained"),
    ("docs/benchmark.md", "bench"),
    ("docs/recipe.md", "recipe"),
    ("docs/mutation.md", "mutation"),
]
NAMES = ("lessons", "pretrained", "bench", "recipe", "mutation")


def _check(name: str, root: Path) -> list[str]:
    return sections.check_section(sections.generated(name), root)


@pytest.fixture
def repo(tmp_path):
    """A copy of the files with generated sections and of their records."""
    for rel in (
        "README.md",
        "docs/benchmark.md",
        "docs/embedded.md",
        "docs/recipe.md",
        "docs/mutation.md",
        *(f"docs/results/{p.name}" for p in (ROOT / "docs/results").glob("*.json")),
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tmp_path / rel)
    (tmp_path / "notebooks").mkdir()
    for nb in NOTEBOOKS:
        shutil.copy2(nb, tmp_path / "notebooks" / nb.name)
    return tmp_path


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tamper(path: Path, old: str, new: str) -> None:
    text = path.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} should occur once in {path.name}"
    path.write_text(text.replace(old, new), encoding="utf-8")


def _writer(root: Path, name: str):
    """Each writer's render-only command on the copy under ``root``: ``run(check=False) -> exit status``."""
    if name == "lessons":
        argv = ["render", *(str(root / "notebooks" / nb.name) for nb in NOTEBOOKS), "--readme"]
        argv += [str(root / "README.md"), "--from-json", str(root / "docs/results/lessons.json")]
        return lambda check=False: nbtools.main(argv + ["--check"] * check)
    return lambda check=False: sections.main(["check" if check else "render", name, "--root", str(root)])


# ---------------------------------------------------------------------------------------------
# The committed files


@pytest.mark.parametrize("rel, name", MARKED)
def test_each_marker_pair_occurs_once_outside_code_fences(rel, name):
    lines = (ROOT / rel).read_text(encoding="utf-8").splitlines(keepends=True)
    fenced = sections.fenced(lines)
    for marker in sections.markers(name):
        at = [i for i, line in enumerate(lines) if line.strip() == marker]
        assert len(at) == 1, f"{rel}: {marker} on lines {[i + 1 for i in at]}"
        assert not fenced[at[0]], f"{rel}: {marker} is inside a code fence"
    sections.find_block("".join(lines), name, rel)  # the writers' own reading agrees


def test_every_generated_section_has_a_committed_record():
    assert tuple(g.name for g in sections.GENERATED) == NAMES
    for gen in sections.GENERATED:
        record = json.loads((ROOT / gen.record).read_text(encoding="utf-8"))
        assert record["about"], gen.record


@pytest.mark.parametrize("name", NAMES)
def test_committed_section_equals_what_its_record_renders(name):
    assert _check(name, ROOT) == []


def test_lesson_headers_state_the_readme_run_time():
    record = json.loads((ROOT / "docs/results/lessons.json").read_text(encoding="utf-8"))
    table = sections.read_block(ROOT / "README.md", "lessons")
    for path in NOTEBOOKS:
        entry = record["notebooks"][path.name]
        cells = nbformat.read(path, as_version=4).cells  # the 実行環境 cell at the end holds the run time
        header = next(
            c for c in cells if c.cell_type == "markdown" and nbtools.RUNTIME_SENTENCE.search(c.source)
        )
        assert nbtools.runtime_sentence(entry) in header.source, path.name
        assert f"| `notebooks/{path.name}` |" in table
        row = next(line for line in table.splitlines() if f"`notebooks/{path.name}`" in line)
        assert (
            row.endswith(f"| {entry['seconds']:.0f} s |") and f"約 {entry['seconds']:.0f} 秒" in header.source
        )


# ---------------------------------------------------------------------------------------------
# The writers, render-only, on a copy


@pytest.mark.parametrize("name", NAMES)
def test_writer_leaves_the_committed_files_unchanged(repo, name, capsys):
    before = _snapshot(repo)
    run = _writer(repo, name)
    assert run() == 0, capsys.readouterr().err
    assert _snapshot(repo) == before
    assert run(check=True) == 0, capsys.readouterr().err


def test_sections_check_passes_on_the_copy_and_lists_the_writers(repo, capsys):
    assert sections.main(["check", "--root", str(repo)]) == 0
    assert sections.main(["list"]) == 0
    out = capsys.readouterr().out
    for gen in sections.GENERATED:
        assert gen.render in out and gen.measure in out


# The recipe table's first row as committed (re-measuring changes it): a tampered copy must be caught.
_RECIPE_ROW = next(
    line
    for line in sections.read_block(ROOT / "docs/recipe.md", "recipe").splitlines()
    if line.startswith("| 1 |")
)

# Lesson 01's committed run time, as the README table and its header render it (re-measuring changes it).
_RUNS = json.loads((ROOT / "docs/results/lessons.json").read_text(encoding="utf-8"))["notebooks"]
_L01 = int(f"{_RUNS['01_device_placement.ipynb']['seconds']:.0f}")
# Its row's last cell, which no other row shares (two lessons may take the same seconds).
_L01_ROW = next(
    line
    for line in sections.read_block(ROOT / "README.md", "lessons").splitlines()
    if line.startswith("| `notebooks/01_device_placement.ipynb` |")
)

# The last row's step time in the committed benchmark record, as the tables render it (ms, one decimal).
_STEP_MS = (
    json.loads((ROOT / "docs/results/bench.json").read_text(encoding="utf-8"))["rows"][-1]["step_time_s"]
    * 1000
)


@pytest.mark.parametrize(
    "name, rel, old, new, fix",
    [
        (
            "lessons",
            "README.md",
            _L01_ROW,
            _L01_ROW.replace(f"| {_L01} s |", f"| {_L01 + 1} s |"),
            "course_tools.nbtools render",
        ),
        (
            "lessons",
            "notebooks/01_device_placement.ipynb",
            f"約 {_L01} 秒",
            f"約 {_L01 + 3} 秒",
            "course_tools.nbtools render",
        ),
        (
            "pretrained",
            "docs/embedded.md",
            "| pretrained checkpoint | 0.888 |",
            "| pretrained checkpoint | 0.889 |",
            "course_tools.sections render pretrained",
        ),
        (
            "bench",
            "docs/benchmark.md",
            f"| {_STEP_MS:,.1f} |",
            f"| {_STEP_MS + 0.1:,.1f} |",
            "course_tools.sections render bench",
        ),
        ("bench", "docs/results/bench.json", None, None, "course_tools.sections render bench"),
        (
            "recipe",
            "docs/recipe.md",
            _RECIPE_ROW,
            _RECIPE_ROW.replace("| 1 |", "| 0 |", 1),
            "course_tools.sections render recipe",
        ),
    ],
)
def test_a_tampered_copy_is_reported_as_drift(repo, name, rel, old, new, fix, capsys):
    path = repo / rel
    if rel == "docs/results/bench.json":  # the record changed, not the table: the last row's loss
        record = json.loads(path.read_text(encoding="utf-8"))
        record["rows"][-1]["final_loss"] += 1e-3
        path.write_text(json.dumps(record, indent=2), encoding="utf-8")
    else:
        _tamper(path, old, new)
    problems = _check(name, repo)
    assert len(problems) == 1 or rel.endswith(".json"), problems
    assert all(fix in p for p in problems), problems
    assert sections.main(["check", "--root", str(repo)]) == 1
    assert fix in capsys.readouterr().err
    run = _writer(repo, name)
    assert run(check=True) == 1  # the writer's own check agrees
    if not rel.endswith(".json"):  # rendering again restores the committed text
        assert run() == 0
        assert path.read_bytes() == (ROOT / rel).read_bytes()


def test_rendering_a_header_keeps_ids_metadata_and_the_code_hash(repo):
    path = repo / "notebooks" / NOTEBOOKS[0].name
    before = nbformat.read(path, as_version=4)
    date = _RUNS[NOTEBOOKS[0].name]["date"]  # the committed header's date, tampered to another
    _tamper(path, f"（計測: {date}、", "（計測: 1999-12-31、")
    record = json.loads((repo / "docs/results/lessons.json").read_text(encoding="utf-8"))
    assert nbtools.render_run_times(record, None, [path]) == []
    after = nbformat.read(path, as_version=4)
    assert [c.get("id") for c in after.cells] == [c.get("id") for c in before.cells]
    assert after.metadata == before.metadata and nbtools.source_hash(after) == nbtools.source_hash(before)
    assert nbtools.stale_reason(after) is None
    assert path.read_bytes() == NOTEBOOKS[0].read_bytes()


def test_lesson_table_and_record_must_list_the_same_notebooks(repo):
    record = json.loads((repo / "docs/results/lessons.json").read_text(encoding="utf-8"))
    extra = {
        **record,
        "notebooks": {**record["notebooks"], "04_new.ipynb": {"seconds": 9, "date": "2026-12-01"}},
    }
    with pytest.raises(sections.SectionError, match="add a row"):
        nbtools.render_run_times(extra, repo / "README.md", [])
    fewer = {**record, "notebooks": dict(list(record["notebooks"].items())[1:])}
    with pytest.raises(sections.SectionError, match="has no run time"):
        nbtools.render_run_times(fewer, repo / "README.md", [])


def test_a_header_without_its_run_time_sentence_is_refused(repo):
    path = repo / "notebooks" / NOTEBOOKS[0].name
    _tamper(path, "、README の表と同じ値）", "）")
    with pytest.raises(sections.SectionError, match="one run-time sentence"):
        nbtools.check_committed(repo)


def test_a_missing_record_names_the_command_that_writes_it(repo, capsys):
    (repo / "docs/results/pretrained.json").unlink()
    assert _writer(repo, "pretrained")() == 2
    assert "python -m course_tools.experiments --json docs/results/pretrained.json" in capsys.readouterr().err


def test_a_fresh_bench_record_renders_the_report_of_its_run():
    rows = [
        {
            "implementation": impl,
            "precision": "no",
            "model_size": "tiny",
            "amp_active": False,
            "step_time_s": 0.1 + i / 100,
            "tokens_per_s": 1000.0 / (1 + i),
            "vs_pytorch": 1 / (1 + i),
            "vs_fp32": 1.0,
            "peak_mem_mb": None,
            "peak_mem_method": None,
            "achieved_gflops": 12.345,
            "mfu": 0.1234,
            "n_matmul_params": 400_000,
            "n_layers": 3,
            "d_model": 128,
            "seq_len": 128,
            "peak_gflops": 50.0,
            "final_loss": 0.69314,
            "machine": "cpu: test CPU, 2 threads; torch x",
            "load_average": [0.5, 0.75],
        }
        for i, impl in enumerate(bench_config.IMPLEMENTATIONS)
    ]
    cfg = bench_config.BenchConfig(sizes=("tiny",), precisions=("no",), steps=2, rounds=1)
    record = json.loads(json.dumps(bench_report.make_record(rows, cfg, seconds=75.0)))  # as read from disk
    assert bench_report.report_from_record(record) == bench_report.markdown_report(
        rows, cfg, 75.0, cores=record["cores"]
    )
    assert "the whole run took 1.2 min" in bench_report.report_from_record(record)


# ---------------------------------------------------------------------------------------------
# The marker rules


def test_replace_block_keeps_everything_around_it_and_ignores_quoted_markers():
    text = "# T\nsay `<!-- x:start -->` inline\n<!-- x:start -->\nold\n<!-- x:end -->\nafter\n"
    new = sections.replace_block(text, "x", "new\n\n")
    assert new == "# T\nsay `<!-- x:start -->` inline\n<!-- x:start -->\nnew\n<!-- x:end -->\nafter\n"
    assert sections.replace_block(new, "x", "new") == new  # idempotent


@pytest.mark.parametrize(
    "text, message",
    [
        ("# T\n", "add the two marker lines"),
        ("<!-- x:start -->\na\n<!-- x:end -->\n<!-- x:end -->\n", "exactly one"),
        ("<!-- x:end -->\n<!-- x:start -->\n", "exactly one"),
        ("<!-- x:start -->\n```bash\nrun\n<!-- x:end -->\n```\n", "inside a ``` code block"),
        ("<!-- x:start -->\n~~~\n<!-- x:end -->\n~~~\n<!-- x:end -->\n", "inside a ``` code block"),
    ],
)
def test_malformed_markers_are_refused_with_what_to_do(text, message):
    with pytest.raises(sections.SectionError, match=message):
        sections.find_block(text, "x", "doc.md")


def test_the_old_benchmark_page_layout_is_refused_by_its_writer(repo, capsys):
    # docs/benchmark.md before the fix: the table inside the "Run it" code block, a second end marker.
    page = repo / "docs/benchmark.md"
    block = sections.read_block(page, "bench")
    page.write_text(
        "## Run it\n\n```bash\npython -m course_tools.sections render bench  # between <!-- bench:start -->\n"
        f"{block}<!-- bench:end -->\n```\n\n## Results\n\n<!-- bench:start -->\n{block}<!-- bench:end -->\n",
        encoding="utf-8",
    )
    before = page.read_bytes()
    assert _writer(repo, "bench")() == 2
    err = capsys.readouterr().err
    assert "inside a ``` code block" in err and "benchmark.md" in err
    assert page.read_bytes() == before
