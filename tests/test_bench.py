"""The benchmark: its primitives (timing, matmul throughput, peak memory) and a quick end-to-end run.

Nothing here asserts on how fast anything is: only that the measurements are well formed and that
every implementation really trained.
"""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from course_lib.benchmark import config, harness, implementations, report, workloads
from course_lib.cli import bench as bench_cli
from course_lib.instruments import timing as timing_module
from course_lib.instruments.memory import tensor_peak_mb
from course_lib.instruments.throughput import matmul_gflops, model_flops_per_token
from course_lib.instruments.timing import StepClock, Timing, time_fn

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
    monkeypatch.setattr(timing_module, "time", clock)
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


def test_model_flops_per_token_is_six_n_plus_attention():
    assert model_flops_per_token(1_000) == 6_000
    assert model_flops_per_token(1_000, n_layers=2, d_model=8, seq_len=16) == 6_000 + 12 * 2 * 8 * 16


@pytest.mark.parametrize("seq_len", [32, 128])
def test_model_flops_per_token_agrees_with_torchs_flop_counter(seq_len):
    from torch.utils.flop_counter import FlopCounterMode

    from course_lib.benchmark.workloads import build_model, count_matmul_parameters

    model, rows = build_model("tiny", 0, seq_len).train(), 4
    ids = torch.randint(5, 400, (rows, seq_len))
    with FlopCounterMode(display=False) as counter:  # one forward and backward, every matmul counted
        model(
            input_ids=ids, attention_mask=torch.ones_like(ids), labels=torch.zeros(rows, dtype=torch.long)
        ).loss.backward()
    per_token = counter.get_total_flops() / (rows * seq_len)
    n, config = count_matmul_parameters(model), model.config
    ours = model_flops_per_token(n, config.n_layers, config.dim, seq_len)
    assert abs(per_token / ours - 1) < 0.05, (per_token, ours)
    if seq_len == 128:  # the premise: without attention's products the count misses more than 10 %
        assert per_token / model_flops_per_token(n) > 1.10


def test_tensor_peak_sees_a_known_allocation_above_the_start():
    kept = torch.ones(2**20)  # 4 MiB allocated before: not counted

    def work():
        a = torch.ones(2**21)  # 8 MiB
        del a
        b = torch.ones(2**20)  # 4 MiB, after the 8 MiB were freed: the peak stays 8 MiB
        del b

    assert 8.0 <= tensor_peak_mb(work, "cpu") < 9.0
    del kept


# ---------------------------------------------------------------------------------------------
# Harness pieces


def test_count_matmul_parameters_leaves_out_embedding_tables():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    assert workloads.count_matmul_parameters(model) == 4 * 2 + 2


def test_step_clock_stamps_every_forward(monkeypatch):
    readings = [1.0, 1.5, 3.0, 99.0]
    monkeypatch.setattr(timing_module, "time", type("Clock", (), {"perf_counter": lambda: readings.pop(0)}))
    model = torch.nn.Linear(2, 2)
    clock = StepClock(model, torch.device("cpu"))
    for _ in range(3):
        model(torch.zeros(1, 2))
    clock.remove()
    model(torch.zeros(1, 2))  # after remove: not counted
    assert clock.stamps == [1.0, 1.5, 3.0] and readings == [99.0]
    assert clock.periods() == [0.5, 1.5]  # from one forward pass to the next


def test_fixed_length_dataset_has_one_shape():
    ds = workloads.fixed_length_dataset(rows=5, seq_len=32)
    assert len(ds) == 5
    assert ds.encodings["input_ids"].shape == (5, 32)
    assert ds.encodings["attention_mask"].shape == (5, 32)
    assert ds[0]["labels"].dtype == torch.long


def test_build_model_sizes_and_a_too_long_sequence():
    small = workloads.build_model("small")
    assert small.config.dim == 256 and small.config.vocab_size == 1200
    with pytest.raises(ValueError, match="--seq-len 128"):
        workloads.build_model("tiny", seq_len=512)


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
    harness.add_ratios(rows)
    by = {(r["model_size"], r["precision"], r["implementation"]): r for r in rows}
    assert by[("base", "no", "course")]["vs_pytorch"] == pytest.approx(0.97)
    assert by[("base", "bf16", "course")]["vs_fp32"] == pytest.approx(190 / 97)
    assert by[("tiny", "fp16", "course")]["vs_pytorch"] is None  # no PyTorch row to compare with
    checks = "\n".join(report.target_checks(rows))
    assert "vs PyTorch loop, base fp32: 0.970x (rounds spread 10%) (target >= 0.98x: MISSED)" in checks
    assert "vs Trainer, base fp32: 0.882x (rounds spread 10%) (target > 1x: MISSED)" in checks
    assert "vs Trainer, base bf16: 1.056x (target > 1x: met)" in checks
    assert (
        "bf16 over fp32, base: 1.96x (rounds spread 10%) (target >= 1.8x on a fast-bf16 CPU: met)" in checks
    )
    assert "bf16 vs fp32, base, course loop: 1,200 vs 1,000 MB (target: below: MISSED)" in checks
    assert "bf16 vs fp32, base, Trainer: 800 vs 1,000 MB (target: below: met)" in checks
    assert "vs Trainer, tiny fp16: 0.500x (target > 1x: MISSED) (Trainer ran in fp32: no autocast)" in checks
    assert "peak memory fp16 vs fp32, tiny" not in checks  # memory is a base-size target


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sizes", "huge"], "Unknown model size 'huge'"),
        (["--implementations", "keras"], "Unknown implementation 'keras'"),
        (["--precisions", "int8"], "Unknown precision 'int8'"),
        (["--steps", "0"], "steps must be >= 1"),
    ],
)
def test_bad_flags_give_an_error_that_says_what_to_do(argv, message, capsys):
    assert bench_cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_peak_memory_of_a_training_run_holds_at_least_gradients_and_adamw_state():
    cfg = config.BenchConfig(sizes=("tiny",), batch_size=4, seq_len=32)
    template = workloads.build_model("tiny", seq_len=32)
    dataset = workloads.fixed_length_dataset(8, seq_len=32)
    spec = implementations.RunSpec("no", torch.device("cpu"), 2, cfg.batch_size)
    mb = harness.peak_memory_mb("course", template, dataset, spec, steps=1)
    n = sum(p.numel() for p in template.parameters())
    floor = 12 * n / 2**20  # fp32 gradients (4 bytes) + AdamW's two moments (8 bytes) per parameter
    assert floor <= mb < 20 * floor, (mb, floor)


def test_state_breakdown_counts_adamw_state_and_what_autocast_saves_for_backward():
    template = workloads.build_model("tiny", seq_len=32)
    dataset = workloads.fixed_length_dataset(8, seq_len=32)
    spec = implementations.RunSpec("no", torch.device("cpu"), 1, 4)
    n = sum(p.numel() for p in template.parameters())
    fp32 = harness.state_breakdown(template, dataset, spec)
    bf16 = harness.state_breakdown(template, dataset, replace(spec, precision="bf16"))
    assert fp32["optimizer_state_mb"] * 2**20 == 8 * n == bf16["optimizer_state_mb"] * 2**20
    assert 0 < bf16["saved_for_backward_mb"] < fp32["saved_for_backward_mb"], (bf16, fp32)


# ---------------------------------------------------------------------------------------------
# The quick benchmark, end to end, as a learner runs it (on smaller batches)

# The --quick preset (every implementation, fp32 and bf16, two interleaved rounds, peak memory) on
# batches of 8 x 64 tokens instead of 16 x 128: nothing below depends on the batch shape, and the run
# takes about half as long. The flags are the CLI's own overrides of a preset, tested on the way.
QUICK_SHAPE = ["--batch-size", "8", "--seq-len", "64"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    paths = {"json": out / "record.json", "markdown": out / "table.md", "plot": out / "chart.png"}
    cmd = [sys.executable, "-m", "course_lib.cli.bench", "--quick", *QUICK_SHAPE]
    for flag, path in paths.items():
        cmd += [f"--{flag}", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, paths


@pytest.mark.slow
def test_quick_run_prints_the_machine_and_the_table(quick_run):
    proc, _ = quick_run
    assert "torch: " in proc.stdout and "cpu: " in proc.stdout  # format_machine
    assert "| size | implementation | precision |" in proc.stdout


@pytest.mark.slow
def test_quick_run_json_rows_are_well_formed(quick_run):
    _, paths = quick_run
    record = json.loads(paths["json"].read_text())
    rows, cfg = record["rows"], record["config"]
    assert isinstance(rows, list) and record["seconds"] > 0 and record["cores"] == os.cpu_count()
    assert len(rows) == len(cfg["precisions"]) * len(config.IMPLEMENTATIONS)
    assert (cfg["batch_size"], cfg["seq_len"]) == (8, 64), "the shape flags override the preset"
    assert cfg["rounds"] >= 2 and cfg["memory"], "the preset interleaves rounds and measures peak memory"
    assert {r["implementation"] for r in rows} == set(config.IMPLEMENTATIONS)
    for r in rows:
        for key, kind in ROW_KEYS.items():
            assert isinstance(r[key], kind), (key, r[key])
        assert r["model_size"] == "tiny"
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch_size"] * r["seq_len"] / r["step_time_s"])
        assert len(r["step_time_rounds_s"]) == r["rounds"] == cfg["rounds"], "one median per round"
        # Peak memory, measured in a short extra run: at least the fp32 gradients (4 bytes) and AdamW's
        # two moments (8 bytes) of every parameter, which coexist at the optimizer step.
        assert r["peak_mem_method"] == "tensor_peak" and isinstance(r["peak_mem_mb"], float)
        assert r["peak_mem_mb"] * 2**20 >= 12 * r["n_params"], (r["implementation"], r["peak_mem_mb"])
        if r["implementation"] == "pytorch":
            assert r["vs_pytorch"] == pytest.approx(1.0)


@pytest.mark.slow
def test_quick_run_every_row_trained(quick_run):
    _, paths = quick_run
    record = json.loads(paths["json"].read_text())
    for r in record["rows"]:
        losses = r["losses"]
        steps = record["config"]["warmup"] + record["config"]["steps"] + 1
        assert len(losses) == steps, r["implementation"]
        assert all(math.isfinite(x) for x in losses)
        half = len(losses) // 2
        assert sum(losses[-half:]) < sum(losses[:half]), (r["implementation"], r["precision"], losses)


@pytest.mark.slow
def test_quick_run_starts_every_implementation_from_the_same_weights_and_data(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())["rows"]
    for precision in {r["precision"] for r in rows}:
        first = [r["first_loss"] for r in rows if r["precision"] == precision]
        assert max(first) - min(first) < 2e-3, (precision, first)


@pytest.mark.slow
def test_quick_run_markdown_and_chart(quick_run):
    _, paths = quick_run
    rows = json.loads(paths["json"].read_text())["rows"]
    table = [ln for ln in paths["markdown"].read_text().splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per row
    assert all(ln.count("|") == len(report.COLUMNS) + 1 for ln in table)
    png = paths["plot"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5_000


@pytest.mark.slow
def test_quick_run_record_renders_the_printed_report(quick_run):
    proc, paths = quick_run
    text = report.report_from_record(json.loads(paths["json"].read_text()))
    assert text in proc.stdout  # a committed record renders into the README exactly what the run printed
