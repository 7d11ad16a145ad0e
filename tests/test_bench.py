"""The benchmark: its primitives (timing, matmul throughput, peak memory) and a quick end-to-end run.

Nothing here asserts on how fast anything is: only that the measurements are well formed and that
every implementation really trained.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from course_lib import bench, bench_harness
from course_lib.bench import Timing, matmul_gflops, model_flops_per_token, peak_rss_mb_subprocess, time_fn

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
ROW_KEYS = {
    "implementation": str,
    "precision": str,
    "model_size": str,
    "tokens_per_s": float,
    "step_time_s": float,
    "mfu": float,
    "final_loss": float,
    "losses": list,
    "amp_active": bool,
    "vs_pytorch": float,
    "vs_fp32": float,
}


# ---------------------------------------------------------------------------------------------
# Primitives


class FakeClock:
    """A stand-in for the ``time`` module whose ``perf_counter`` steps by given amounts."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        # time_fn reads the clock twice per repeat: before (advance 0) and after (advance by duration).
        self.calls += 1
        if self.calls % 2 == 0:
            self.now += self.durations[self.calls // 2 - 1]
        return self.now


def test_time_fn_warms_up_then_reports_the_median_of_its_repeats(monkeypatch):
    calls = []
    clock = FakeClock([0.5, 0.1, 0.3, 0.2, 0.4])
    monkeypatch.setattr(bench, "time", clock)
    timing = time_fn(lambda: calls.append(1), warmup=2, repeat=5, device="cpu")
    assert len(calls) == 7  # 2 warm-up + 5 timed
    assert timing.times == pytest.approx([0.5, 0.1, 0.3, 0.2, 0.4])
    assert timing.median == pytest.approx(0.3)
    assert timing.spread == pytest.approx((0.5 - 0.1) / 0.3)


def test_time_fn_rejects_zero_repeats():
    with pytest.raises(ValueError, match="repeat"):
        time_fn(lambda: None, repeat=0)


def test_timing_spread_of_a_zero_median_is_nan():
    assert math.isnan(Timing(0.0, [0.0, 0.0]).spread)


def test_matmul_gflops_is_positive_and_auto_sizes():
    fixed = matmul_gflops(torch.float32, "cpu", n=64, repeat=2)
    assert fixed["n"] == 64 and fixed["gflops"] > 0 and fixed["seconds"] > 0
    # A target no call can reach: the size doubles from 128 up to the cap.
    grown = matmul_gflops(torch.float32, "cpu", repeat=1, target_s=1e9, max_n=512)
    assert grown["n"] == 512 and grown["gflops"] > 0
    # A target every call reaches: the first size is kept.
    first = matmul_gflops(torch.bfloat16, "cpu", repeat=1, target_s=0.0)
    assert first["n"] == 128 and first["gflops"] > 0


def test_model_flops_per_token_is_six_n():
    assert model_flops_per_token(1_000) == 6_000


def test_cuda_peak_mb_refuses_a_cpu():
    with pytest.raises(ValueError, match="peak_rss_mb_subprocess"):
        bench.cuda_peak_mb(lambda: None, "cpu")


def allocate(mb: int = 0):
    """Target for the subprocess tests: set-up imports torch, the work fills ``mb`` MiB."""

    def work():
        t = torch.ones(mb * 2**20 // 4)  # float32: 4 bytes each, every page touched
        return float(t.sum()) if mb else 0.0

    return work


def setup_peak(mb: int = 0):
    """Target whose set-up (not its work) touches ``mb`` MiB, then frees it."""
    t = torch.ones(mb * 2**20 // 4)
    float(t.sum())
    del t

    def work():
        return 0.0

    return work


def fail():
    raise RuntimeError("set-up went wrong on purpose")


@pytest.fixture
def tests_on_child_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_rss_subprocess_sees_a_known_allocation(tests_on_child_path):
    big = peak_rss_mb_subprocess("test_bench:allocate", mb=200)
    small = peak_rss_mb_subprocess("test_bench:allocate", mb=0)
    assert big["result"] == pytest.approx(200 * 2**20 / 4)
    assert 150 <= big["work_mb"] <= 400
    assert small["work_mb"] < 50
    assert big["before_mb"] > 0 and big["peak_mb"] >= big["before_mb"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_rss_subprocess_ignores_the_parent_and_the_setup(tests_on_child_path):
    parent = torch.ones(600 * 2**20 // 4)  # a big parent: Linux copies its ru_maxrss into children
    float(parent.sum())
    idle = peak_rss_mb_subprocess("test_bench:allocate", mb=0)
    del parent
    assert idle["work_mb"] < 50
    setup = peak_rss_mb_subprocess("test_bench:setup_peak", mb=300)
    assert setup["peak_reset"] and setup["work_mb"] < 50


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("target", ["test_bench:fail", "test_bench:no_such_function", "no_such_module:f"])
def test_peak_rss_subprocess_reports_a_failing_target(tests_on_child_path, target):
    with pytest.raises(RuntimeError, match="failed in the measuring subprocess"):
        peak_rss_mb_subprocess(target)


# ---------------------------------------------------------------------------------------------
# Harness pieces


def test_count_matmul_parameters_leaves_out_embedding_tables():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    assert bench_harness.count_matmul_parameters(model) == 4 * 2 + 2


def test_step_clock_stamps_every_forward():
    model = torch.nn.Linear(2, 2)
    clock = bench_harness.StepClock(model, torch.device("cpu"))
    for _ in range(3):
        model(torch.zeros(1, 2))
    clock.remove()
    model(torch.zeros(1, 2))  # after remove: not counted
    assert len(clock.stamps) == 3
    assert len(clock.periods()) == 2 and all(p >= 0 for p in clock.periods())


def test_fixed_length_dataset_has_one_shape():
    ds = bench_harness.fixed_length_dataset(rows=5, seq_len=32)
    assert len(ds) == 5
    assert ds.encodings["input_ids"].shape == (5, 32)
    assert ds.encodings["attention_mask"].shape == (5, 32)
    assert ds[0]["labels"].dtype == torch.long


def test_build_model_sizes_and_a_too_long_sequence():
    small = bench_harness.build_model("small")
    assert small.config.dim == 256 and small.config.vocab_size == 1200
    with pytest.raises(ValueError, match="--seq-len 128"):
        bench_harness.build_model("tiny", seq_len=512)


def _row(size, precision, impl, tokens, mem=None, rounds=None, amp=True):
    return {
        "model_size": size,
        "precision": precision,
        "implementation": impl,
        "tokens_per_s": tokens,
        "peak_mem_mb": mem,
        "step_time_rounds_s": rounds,
        "amp_active": amp,
    }


def test_ratios_and_target_checks():
    rows = [
        _row("base", "no", "pytorch", 100.0, 1000.0),
        _row("base", "no", "trainer", 110.0, 1000.0),
        _row("base", "no", "course", 97.0, 1000.0, rounds=[1.0, 1.1, 1.0]),
        _row("base", "bf16", "pytorch", 190.0, 800.0),
        _row("base", "bf16", "trainer", 180.0, 800.0),
        _row("base", "bf16", "course", 190.0, 1200.0),
        _row("tiny", "fp16", "course", 50.0, 10.0),
        _row("tiny", "fp16", "trainer", 100.0, 10.0, amp=False),
    ]
    bench_harness.add_ratios(rows)
    by = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    assert by[("base", "no", "course")]["vs_pytorch"] == pytest.approx(0.97)
    assert by[("base", "bf16", "course")]["vs_fp32"] == pytest.approx(190 / 97)
    assert by[("tiny", "fp16", "course")]["vs_pytorch"] is None  # no PyTorch row to compare with
    checks = "\n".join(bench_harness.target_checks(rows))
    assert "vs PyTorch loop, base fp32: 0.970x (rounds spread 10%) (target >= 0.98x: MISSED)" in checks
    assert "vs Trainer, base fp32: 0.882x (rounds spread 10%) (target > 1x: MISSED)" in checks
    assert "vs Trainer, base bf16: 1.056x (target > 1x: met)" in checks
    assert (
        "bf16 over fp32, base: 1.96x (rounds spread 10%) (target >= 1.8x on a fast-bf16 CPU: met)" in checks
    )
    assert "bf16 vs fp32, base, course_lib.train: 1,200 vs 1,000 MB (target: below: MISSED)" in checks
    assert "bf16 vs fp32, base, Trainer: 800 vs 1,000 MB (target: below: met)" in checks
    assert "vs Trainer, tiny fp16: 0.500x (target > 1x: MISSED) (Trainer ran in fp32: no autocast)" in checks
    assert "peak memory fp16 vs fp32, tiny" not in checks  # memory is a base-size target


def test_readme_section_is_replaced_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    quoted = "Run `--readme` to fill <!-- bench:start --> ... <!-- bench:end -->.\n"  # prose: left alone
    readme.write_text(
        f"# Title\n{quoted}before\n<!-- bench:start -->\nold table\n<!-- bench:end -->\nafter\n"
    )
    bench_harness.write_readme_section(readme, "| a |\n|---|\n| 1 |\n")
    bench_harness.write_readme_section(readme, "| a |\n|---|\n| 1 |\n")  # idempotent
    assert readme.read_text() == (
        f"# Title\n{quoted}before\n<!-- bench:start -->\n| a |\n|---|\n| 1 |\n<!-- bench:end -->\nafter\n"
    )


def test_readme_without_markers_says_what_to_add(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="add the two marker lines"):
        bench_harness.write_readme_section(readme, "table")
    readme.write_text("<!-- bench:start -->\n<!-- bench:end -->\n<!-- bench:start -->\n<!-- bench:end -->\n")
    with pytest.raises(ValueError, match="exactly one"):
        bench_harness.write_readme_section(readme, "table")
    with pytest.raises(FileNotFoundError):
        bench_harness.write_readme_section(tmp_path / "missing.md", "table")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "huge"], "Unknown model size 'huge'"),
        (["--implementations", "keras"], "Unknown implementation 'keras'"),
        (["--precisions", "int8"], "Unknown precision 'int8'"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--quick", "--readme", "no/such/README.md"], "does not exist"),
    ],
)
def test_bad_flags_give_an_error_that_says_what_to_do(argv, message, capsys):
    assert bench_harness.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_memory_probe_measures_a_training_run():
    cfg = bench_harness.BenchConfig(sizes=("tiny",), memory_steps=1, batch_size=4, seq_len=32)
    mb = bench_harness.cpu_peak_mb("course", "tiny", "no", cfg)
    assert 0 < mb < 2000  # gradients, AdamW state and activations of a 0.6 M-parameter model


# ---------------------------------------------------------------------------------------------
# The quick benchmark, end to end, as a learner runs it


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    paths = {"json": out / "rows.json", "markdown": out / "table.md", "plot": out / "chart.png"}
    cmd = [sys.executable, "-m", "course_lib.bench", "--quick"]
    for flag, path in paths.items():
        cmd += [f"--{flag}", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, paths


def test_quick_run_prints_the_machine_and_the_table(quick_run):
    proc, _ = quick_run
    assert "torch: " in proc.stdout and "cpu: " in proc.stdout  # format_machine
    assert "| size | implementation | precision |" in proc.stdout


def test_quick_run_json_rows_are_well_formed(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())
    assert isinstance(rows, list)
    cfg = rows[0]["config"]
    assert len(rows) == len(cfg["precisions"]) * len(bench_harness.IMPLEMENTATIONS)
    assert {r["implementation"] for r in rows} == set(bench_harness.IMPLEMENTATIONS)
    for r in rows:
        for key, kind in ROW_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["model_size"] == "tiny"
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["step_time_s"])
        assert "peak_mem_mb" in r  # None when not measured (quick mode on a CPU)
        if r["implementation"] == "pytorch":
            assert r["vs_pytorch"] == pytest.approx(1.0)


def test_quick_run_every_row_trained(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())
    for r in rows:
        losses = r["losses"]
        steps = r["config"]["warmup"] + r["config"]["steps"] + 1
        assert len(losses) == steps, r["implementation"]
        assert all(math.isfinite(x) for x in losses)
        half = len(losses) // 2
        assert sum(losses[-half:]) < sum(losses[:half]), (r["implementation"], r["precision"], losses)


def test_quick_run_starts_every_implementation_from_the_same_weights_and_data(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())
    for precision in {r["precision"] for r in rows}:
        first = [r["first_loss"] for r in rows if r["precision"] == precision]
        assert max(first) - min(first) < 2e-3, (precision, first)


def test_quick_run_markdown_and_chart(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())
    table = [ln for ln in paths["markdown"].read_text().splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per row
    assert all(ln.count("|") == len(bench_harness.COLUMNS) + 1 for ln in table)
    png = paths["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000
