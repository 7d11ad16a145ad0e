"""The instruments: step time, throughput and peak memory (course_lib.instruments), and text tables."""

import math

import pytest
import torch

from course_lib.instruments.probe import StepProbe, probe_callback
from course_lib.instruments.timing import Stopwatch, median, time_fn
from course_lib.tables import align_columns, render_table


def test_render_table():
    text = render_table([{"a": 1, "b": 0.123456}, {"a": 22, "b": "x"}])
    assert text.splitlines() == ["a   b", "1   0.123", "22  x"]
    with pytest.raises(ValueError, match="non-empty"):
        render_table([])


def test_align_columns_aligns_japanese_by_display_width():
    # "ゼロ" is 2 characters but 4 columns wide: padding by characters would push "next" 2 columns left
    lines = align_columns([("ゼロ", "next"), ("abcd", "next"), ("ab", "x")]).splitlines()
    assert lines == ["ゼロ  next", "abcd  next", "ab    x"]


def test_step_probe_measures_tensor_memory_of_the_first_step_on_cpu():
    probe = StepProbe("cpu")
    probe.start()
    a = torch.ones(2**21)  # 8 MiB
    del a
    b = torch.ones(2**20)  # 4 MiB, after the 8 MiB were freed: the peak stays 8 MiB
    probe.tick()
    assert 8.0 <= probe.peak_mb < 9.0
    for _ in range(3):
        probe.tick()
    assert len(probe.step_times) == 4
    assert probe.peak_mb < 9.0  # only the first step is measured
    del b


class ScriptedClock:
    """A stand-in for the ``time`` module: ``perf_counter`` returns the given readings in turn."""

    def __init__(self, readings):
        self.readings = list(readings)

    def perf_counter(self):
        return self.readings.pop(0)


def test_step_probe_times_each_step_and_its_median_skips_the_warm_up(monkeypatch):
    from course_lib.instruments import timing

    # start at 0; each tick reads the clock twice (the lap ends, the next one starts): steps 5, 1, 2, 6 s.
    clock = ScriptedClock([0.0, 5.0, 5.0, 6.0, 6.0, 8.0, 8.0, 14.0, 14.0])
    monkeypatch.setattr(timing, "time", clock)
    probe = StepProbe("cpu", measure_memory=False)
    probe.start()
    for _ in range(4):
        probe.tick()
    assert probe.step_times == [5.0, 1.0, 2.0, 6.0] and clock.readings == []
    assert probe.median_step_time() == 2.0  # median of 1, 2, 6 (not their mean, 3; the 5 s warm-up left out)
    assert probe.median_step_time(skip=0) == 3.5  # with the warm-up step


def test_a_probe_recovers_from_a_loop_that_failed_before_its_first_tick():
    failed = StepProbe("cpu")
    failed.start()  # ... and the loop raised: no tick(), the profiler is still running
    probe = StepProbe("cpu")
    probe.start()
    x = torch.ones(2**20)  # 4 MiB
    probe.tick()
    assert 4.0 <= probe.peak_mb < 5.0
    assert failed._peak._prof.profiler.profiling_end_time_ns > 0  # the abandoned profiler was stopped
    assert not torch.autograd.profiler._is_profiler_enabled
    del x


def test_step_probe_without_memory_and_its_trainer_callback():
    probe = StepProbe("cpu", measure_memory=False)
    callback = probe_callback(probe)
    callback.on_train_begin(None, None, None)
    callback.on_step_end(None, None, None)
    callback.on_step_end(None, None, None)
    assert len(probe.step_times) == 2 and math.isnan(probe.peak_mb)
    assert math.isnan(StepProbe("cpu").median_step_time())


def test_median_skips_warm_up_unless_that_leaves_nothing():
    assert median([9.0, 1.0, 2.0, 3.0], skip=1) == 2.0
    assert median([9.0], skip=1) == 9.0
    assert math.isnan(median([]))


def test_stopwatch_laps_are_the_time_between_readings_and_time_fn_counts_its_calls(monkeypatch):
    from course_lib.instruments import timing

    watch = Stopwatch("cpu")
    with pytest.raises(RuntimeError, match="start"):
        watch.lap()
    monkeypatch.setattr(timing, "time", ScriptedClock([10.0, 10.5, 10.75, 12.75]))
    watch.start()
    assert [watch.lap() for _ in range(3)] == [0.5, 0.25, 2.0]
    monkeypatch.undo()
    calls = []
    result = time_fn(lambda: calls.append(1), warmup=2, repeat=5)
    assert len(calls) == 7 and len(result.times) == 5  # the median itself: tests/test_bench.py, faked clock
    with pytest.raises(ValueError, match="repeat must be >= 1"):
        time_fn(lambda: None, repeat=0)


def test_tensor_bytes_and_optimizer_state_by_key_sum_to_the_total():
    from course_lib.instruments.memory import (
        optimizer_state_bytes,
        optimizer_state_bytes_by_key,
        tensor_bytes,
    )

    assert tensor_bytes([torch.zeros(10), torch.zeros(3, dtype=torch.bfloat16)]) == 40 + 6
    assert tensor_bytes([]) == 0
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters())
    assert optimizer_state_bytes_by_key(optimizer) == {} and optimizer_state_bytes(optimizer) == 0
    layer(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    n = sum(p.numel() for p in layer.parameters())
    assert optimizer_state_bytes_by_key(optimizer) == {"exp_avg": 4 * n, "exp_avg_sq": 4 * n}  # no "step"
    assert optimizer_state_bytes(optimizer) == 8 * n


def test_saved_tensors_counts_each_storage_once_and_keeps_the_tensors_when_asked():
    from course_lib.instruments.memory import SavedTensors, saved_tensor_bytes

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    with SavedTensors(keep=True) as saved:
        y = (x @ w).relu()
    storages = {t.untyped_storage().data_ptr() for t in saved.tensors}
    assert storages == {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}  # matmul: x; relu: y
    assert saved.by_dtype == {"float32": 2 * 4 * 8 * 4}  # each storage once
    assert saved.bytes == saved_tensor_bytes(lambda: (x @ w).relu())
    assert SavedTensors().tensors == []  # keep=False: counts only
    y.sum().backward()


def test_collective_log_records_calls_bytes_and_dtypes_per_kind():
    from course_lib.instruments.comm import KINDS, CollectiveLog

    log = CollectiveLog()
    log.record("all-reduce", torch.zeros(10))
    log.record("all-reduce", torch.zeros(10, dtype=torch.float16))
    log.record("broadcast", torch.zeros(2, dtype=torch.int64))
    assert (log.calls["all-reduce"], log.bytes["all-reduce"]) == (2, 60)
    assert log.dtypes == {
        **{k: set() for k in KINDS},
        "all-reduce": {"float32", "float16"},
        "broadcast": {"int64"},
    }
