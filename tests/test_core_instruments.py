"""Behaviours of the measuring instruments that mutation testing found unguarded (docs/mutation.md).

One section per file of ``course_lib/instruments``: the timing of steps (``timing.py``: medians, the
``Stopwatch``, ``time_fn``, ``StepClock``), the per-step probe (``probe.py``), memory (``memory.py``: the
peak of a step, what autograd saves, optimizer and model states, the profiler's log lines), the traffic of
collectives (``comm.py``), the replicas' drift (``replicas.py``) and throughput (``throughput.py``).

No test reads a real clock's value: times come from a scripted clock, and each test checks what the
instrument computes from them. What only a GPU shows (which device is synchronised, the CUDA allocator's
counters) is checked with ``FakeCuda``, a stand-in for ``torch.cuda``'s counters that records the calls.
"""

import io
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from course_lib.instruments import memory, timing
from course_lib.instruments.comm import CollectiveLog, counting_collectives, ring_bytes
from course_lib.instruments.memory import (
    MIB,
    SavedTensors,
    TensorPeak,
    model_state_bytes,
    optimizer_state_bytes_by_key,
    tensor_peak_mb,
)
from course_lib.instruments.probe import StepProbe
from course_lib.instruments.throughput import (
    format_per_process,
    matmul_gflops,
    mfu,
    model_flops_per_token,
    per_process_throughput,
)
from course_lib.instruments.timing import StepClock, Stopwatch, median, time_fn
from course_lib.training import History


class ScriptedClock:
    """A stand-in for the ``time`` module: ``perf_counter`` returns the given readings in turn."""

    def __init__(self, readings):
        self.readings = list(readings)

    def perf_counter(self):
        return self.readings.pop(0)


class FakeCuda:
    """``torch.cuda`` on a machine with a GPU, for a CPU-only test: which device each call names.

    ``is_available()`` says yes, ``synchronize`` and the allocator's counters record their device, and the
    counters read ``allocated`` (live bytes) and ``peak`` (the peak since the last reset). Only these calls
    are faked: nothing here runs on a GPU.
    """

    def __init__(self, monkeypatch, allocated: int = 0, peak: int = 0) -> None:
        self.calls: list[tuple[str, object]] = []
        self.allocated, self.peak = allocated, peak
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self._call("synchronize", device))
        monkeypatch.setattr(
            torch.cuda, "reset_peak_memory_stats", lambda device=None: self._call("reset", device)
        )
        monkeypatch.setattr(
            torch.cuda,
            "memory_allocated",
            lambda device=None: self._call("allocated", device, self.allocated),
        )
        monkeypatch.setattr(
            torch.cuda, "max_memory_allocated", lambda device=None: self._call("peak", device, self.peak)
        )

    def _call(self, name, device, value=None):
        self.calls.append((name, device))
        return value

    def devices(self) -> set:
        return {device for _, device in self.calls}


CUDA1 = torch.device("cuda", 1)  # not the device get_device() picks by itself ("cuda", no index)


# ----------------------------------------------------------------------------------------------
# timing.py: medians, the Stopwatch, time_fn and StepClock


def test_median_keeps_every_value_by_default():
    assert median([9.0, 1.0, 2.0, 3.0]) == 2.5  # the warm-up value counts unless skipped
    assert median([9.0, 1.0, 2.0, 3.0], skip=1) == 2.0


def test_a_stopwatch_lap_before_start_says_what_to_do():
    with pytest.raises(
        RuntimeError,
        match=r"^Stopwatch\.lap\(\) before start\(\): call start\(\) where the first lap begins\.$",
    ):
        Stopwatch("cpu").lap()


def test_time_fn_times_each_repeat_and_reports_their_median_and_spread(monkeypatch):
    monkeypatch.setattr(timing, "time", ScriptedClock([0.0, 3.0, 10.0, 11.0, 20.0, 22.0]))
    calls = []
    result = time_fn(lambda: calls.append(1), warmup=1, repeat=3)
    assert result.times == [3.0, 1.0, 2.0] and len(calls) == 4
    assert result.median == 2.0
    assert result.spread == 1.0  # (3 - 1) / 2


def test_time_fn_defaults_to_two_warm_up_calls_and_five_repeats_and_accepts_one_repeat():
    calls = []
    assert len(time_fn(lambda: calls.append(1)).times) == 5 and len(calls) == 7
    calls.clear()
    assert len(time_fn(lambda: calls.append(1), warmup=0, repeat=1).times) == 1 and len(calls) == 1


def test_step_clock_stamps_every_forward_until_removed(monkeypatch):
    monkeypatch.setattr(timing, "time", ScriptedClock([1.0, 1.5, 3.5]))
    model = torch.nn.Linear(2, 2)
    clock = StepClock(model, "cpu")
    for _ in range(3):
        model(torch.ones(1, 2))
    assert clock.stamps == [1.0, 1.5, 3.5]
    assert clock.periods() == [0.5, 2.0]  # one period between consecutive forwards
    clock.remove()
    model(torch.ones(1, 2))  # no stamp: the clock (with no readings left) is not read again
    assert clock.periods() == [0.5, 2.0]


def test_devices_given_as_names_become_devices_on_a_machine_with_a_gpu(monkeypatch):
    """A device named "cpu" stays the CPU where a GPU exists (FakeCuda), and None picks the GPU."""
    FakeCuda(monkeypatch)
    for instrument in (Stopwatch, TensorPeak):
        assert instrument("cpu").device == torch.device("cpu")
        assert instrument("cuda:1").device == CUDA1
        assert instrument(None).device == torch.device("cuda")
        assert instrument(CUDA1).device == CUDA1
    assert StepProbe("cpu").device == torch.device("cpu")


def test_every_timer_synchronises_the_device_it_times(monkeypatch):
    """Only a GPU queues work to wait for: FakeCuda records which device each clock reading waits on."""
    cuda = FakeCuda(monkeypatch)
    watch = Stopwatch(CUDA1)
    watch.start()
    watch.lap()
    assert cuda.calls == [("synchronize", CUDA1)] * 2
    cuda.calls.clear()
    time_fn(lambda: None, warmup=0, repeat=2, device="cuda:1")
    assert cuda.calls == [("synchronize", CUDA1)] * 4
    cuda.calls.clear()
    model = torch.nn.Linear(2, 2)
    StepClock(model, "cuda:1")
    model(torch.ones(1, 2))
    assert cuda.calls == [("synchronize", CUDA1)]


def test_instruments_on_a_device_without_queue_or_counters_read_the_clock_and_report_no_peak(monkeypatch):
    """A device that is neither CPU nor CUDA (meta here, MPS's peak likewise): no peak, just NaN."""
    monkeypatch.setattr(timing, "time", ScriptedClock([2.0, 2.75]))
    meta = torch.device("meta")
    watch = Stopwatch(meta)
    watch.start()
    assert watch.lap() == 0.75
    peak = TensorPeak(meta)
    assert math.isnan(peak.stop())  # before start(): nothing measured
    peak.start()
    assert math.isnan(peak.stop())


# ----------------------------------------------------------------------------------------------
# probe.py: StepProbe on a GPU


def test_step_probe_times_and_measures_the_device_it_was_given(monkeypatch):
    cuda = FakeCuda(monkeypatch, allocated=3 * MIB, peak=10 * MIB + MIB // 2)
    probe = StepProbe("cuda:1")
    assert probe.device == CUDA1
    probe.start()
    probe.tick()
    probe.tick()
    assert probe.peak_mb == 7.5  # the peak above what was live at start
    assert len(probe.step_times) == 2
    assert cuda.devices() == {CUDA1}


# ----------------------------------------------------------------------------------------------
# memory.py: the peak of a step


def test_tensor_peak_on_cuda_is_the_allocators_peak_above_the_start(monkeypatch):
    cuda = FakeCuda(monkeypatch, allocated=3 * MIB, peak=10 * MIB + MIB // 2)
    peak = TensorPeak(CUDA1)
    peak.start()
    assert cuda.calls == [("synchronize", CUDA1), ("allocated", CUDA1), ("reset", CUDA1)]
    cuda.calls.clear()
    assert peak.stop() == 7.5
    assert cuda.calls == [("synchronize", CUDA1), ("peak", CUDA1)]
    assert TensorPeak(CUDA1).stop() == 10.5  # never started: the peak since the counters' last reset


def test_tensor_peak_mb_measures_on_the_device_it_is_given(monkeypatch):
    cuda = FakeCuda(monkeypatch, peak=100 * MIB)
    assert tensor_peak_mb(lambda: torch.ones(2**20), device="cpu") == 4.0  # the CPU, though a GPU exists
    assert cuda.calls == []
    assert tensor_peak_mb(lambda: None, device="cuda:1") == 100.0
    assert cuda.devices() == {CUDA1}


def test_tensor_peak_on_cpu_is_the_most_bytes_live_at_once():
    peak = TensorPeak("cpu")
    peak.start()
    a = torch.ones(2**21)  # 8 MiB
    b = torch.ones(2**20)  # 4 MiB more, while the 8 MiB are live: 12 MiB at once
    del a, b
    c = torch.ones(2**20)  # 4 MiB after both were freed: the peak stays 12 MiB
    assert peak.stop() == 12.0  # exactly: the profiler records every allocation's bytes
    assert math.isnan(peak.stop())  # read once: a second stop() without start() has nothing measured
    del c


def test_a_cpu_peak_counts_cpu_allocations_only():
    """The profiler's memory events name their device: on a GPU machine it can record the GPU's
    allocations too, which a CPU peak leaves out (events faked: a CPU-only machine has no GPU ones)."""
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(ns, name, device, nbytes):
        return SimpleNamespace(
            start_ns=lambda: ns, name=lambda: name, device_type=lambda: device, nbytes=lambda: nbytes
        )

    events = [
        event(4, "[memory]", cpu, -8 * MIB),  # out of order: taken in time order
        event(1, "[memory]", cpu, 8 * MIB),
        event(2, "aten::ones", cpu, 0),
        event(3, "[memory]", cuda, 100 * MIB),
        event(5, "[memory]", cpu, 4 * MIB),
    ]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    assert memory._peak_from_profiler(prof) == 8 * MIB


def _write_fd2(data: bytes) -> None:
    """What C/C++ code (the profiler, a kernel library) writes: straight to file descriptor 2."""
    os.write(2, data)


def test_under_jupyter_the_profilers_lines_are_dropped_and_the_rest_replayed_to_the_cell(monkeypatch, capfd):
    monkeypatch.setattr(memory, "_CAPTURE", memory._StderrFdCapture())  # as in a fresh process
    cell = io.StringIO()  # Jupyter's sys.stderr: a stream, not file descriptor 2
    monkeypatch.setattr(sys, "stderr", cell)
    peak = TensorPeak("cpu")
    peak.start()
    _write_fd2(b"a kernel's warning \xff\n\nSTAGE: the profiler's own line\n   \nsecond line\n")
    peak.stop()
    assert cell.getvalue() == "a kernel's warning \ufffd\nsecond line\n"  # undecodable bytes replaced
    _write_fd2(b"after\n")
    assert capfd.readouterr().err == "after\n"  # file descriptor 2 is back where it was


def test_in_a_plain_script_the_profiler_leaves_file_descriptor_2_alone(monkeypatch, capfd):
    monkeypatch.setattr(memory, "_CAPTURE", memory._StderrFdCapture())
    monkeypatch.setattr(sys, "stderr", sys.__stderr__)  # a script's sys.stderr is file descriptor 2
    peak = TensorPeak("cpu")
    peak.start()
    _write_fd2(b"STAGE: written while measuring\n")
    peak.stop()
    assert "STAGE: written while measuring\n" in capfd.readouterr().err  # as written, not filtered


# ----------------------------------------------------------------------------------------------
# memory.py: what autograd saves, optimizer state, model states


def test_saved_tensors_counts_a_storage_packed_twice_once_and_keeps_no_tensors_by_default():
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensors() as saved:
        y = x * x  # mul saves both operands: x, twice
    assert saved.by_dtype == {"float32": 4 * 8 * 4} and saved.tensors == []
    with SavedTensors(keep=True) as kept:
        x * x
    assert len(kept.tensors) == 2 and kept.bytes == 4 * 8 * 4
    y.sum().backward()


class SharedTableOptimizer(torch.optim.Optimizer):
    """Like bitsandbytes' 8-bit AdamW: one uint8 state per parameter, plus a table all parameters share."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.table = torch.zeros(256)  # 1 KiB, one storage in every parameter's state

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["table"] = self.table  # first: the shared entry comes before the own one
                self.state[p]["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                self.state[p]["step"] = 1


def test_optimizer_state_shared_by_parameters_counts_once_and_each_own_state_counts():
    params = [torch.nn.Parameter(torch.zeros(10)), torch.nn.Parameter(torch.zeros(6))]
    optimizer = SharedTableOptimizer(params)
    optimizer.step()
    assert optimizer_state_bytes_by_key(optimizer) == {"table": 1024, "state1": 16}


def test_optimizer_state_on_different_devices_at_one_address_is_not_taken_for_one_storage():
    """An empty CPU tensor and a meta tensor both report address 0, as a CPU and a GPU storage could."""
    state = {"a": {"exp_avg": torch.zeros(0)}, "b": {"exp_avg": torch.empty(3, device="meta")}}
    assert optimizer_state_bytes_by_key(SimpleNamespace(state=state)) == {"exp_avg": 12}


def test_model_state_bytes_counts_trainable_weights_their_gradients_and_the_optimizer_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[1].weight.requires_grad_(False)  # frozen: not a model state
    model.register_parameter("unused", torch.nn.Parameter(torch.zeros(5)))  # trainable, gets no gradient
    trainable = 12 + 3 + 2 + 5
    assert model_state_bytes(model) == {"weights": 4 * trainable, "gradients": 0, "optimizer state": 0}
    model(torch.randn(2, 4)).sum().backward()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    optimizer.step()
    assert model_state_bytes(model, optimizer) == {
        "weights": 4 * trainable,
        "gradients": 4 * (12 + 3 + 2),  # the unused parameter's .grad is None
        "optimizer state": 8 * (12 + 3 + 2),  # AdamW: exp_avg and exp_avg_sq, none for the unused one
    }


# ----------------------------------------------------------------------------------------------
# comm.py: the bytes of collectives


@pytest.mark.parametrize(
    ("kind", "payload", "world_size", "sent"),
    [
        ("all-reduce", 1000, 4, 1500),  # reduce-scatter + all-gather: 2 x 3/4 of the payload
        ("all-gather", 1000, 4, 750),
        ("reduce-scatter", 1000, 4, 750),
        ("broadcast", 1000, 4, 750),
        ("all-gather", 10, 3, 7),  # 6.67 bytes, rounded
        ("all-reduce", 1000, 1, 0),  # alone: nothing to send
    ],
)
def test_ring_bytes_is_what_each_rank_sends(kind, payload, world_size, sent):
    assert ring_bytes(kind, payload, world_size) == sent


def test_ring_bytes_refuses_an_unknown_kind_naming_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"^kind must be one of all-reduce, all-gather, reduce-scatter, broadcast, got 'gather'\.$",
    ):
        ring_bytes("gather", 10, 2)


def test_collective_log_ring_bytes_sums_every_kind():
    log = CollectiveLog()
    log.record("all-reduce", torch.zeros(250))  # 1000 bytes: 1500 sent in a ring of 4
    log.record("all-gather", torch.zeros(100))  # 400 bytes: 300 sent
    assert log.ring_bytes(4) == 1800


@pytest.mark.filterwarnings("ignore:.*all_gather_into_tensor.* is deprecated:FutureWarning")
def test_counting_collectives_records_each_collective_with_its_full_payload(group):
    real = dist.all_reduce
    with counting_collectives() as log:
        dist.all_reduce(torch.ones(6))  # the tensor positionally ...
        dist.all_reduce(tensor=torch.ones(2, dtype=torch.float16))  # ... or by name
        dist.broadcast(torch.ones(3, dtype=torch.int64), src=0)
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(5))
    assert log.calls == {"all-reduce": 2, "all-gather": 1, "reduce-scatter": 0, "broadcast": 1}
    assert log.bytes == {"all-reduce": 24 + 4, "all-gather": 20, "reduce-scatter": 0, "broadcast": 24}
    assert log.dtypes["all-reduce"] == {"float32", "float16"}
    assert dist.all_reduce is real  # leaving the block restores the function


def test_nested_counting_blocks_count_each_call_once_in_the_innermost(group):
    with counting_collectives() as outer:
        with counting_collectives() as inner:
            dist.all_reduce(torch.ones(4))
        dist.all_reduce(torch.ones(2))
    assert (inner.calls["all-reduce"], inner.bytes["all-reduce"]) == (1, 16)
    assert (outer.calls["all-reduce"], outer.bytes["all-reduce"]) == (1, 8)


# ----------------------------------------------------------------------------------------------
# replicas.py: where the replicas are gathered


def test_replica_drift_gathers_on_the_ranks_device(group, monkeypatch):
    """Under nccl a rank's parameters and anchor go to its GPU; on a CPU-only machine a stand-in device
    (meta) takes the GPU's place: everything is computed there, up to reading the numbers off it."""
    from course_lib.instruments import replicas

    asked, gathered_from = [], []

    def rank_device(rank):
        asked.append(rank)
        return torch.device("meta")

    def all_gather(outputs, tensor):
        gathered_from.append(tensor.device)
        for out in outputs:
            out.copy_(tensor)

    monkeypatch.setattr(replicas, "rank_device", rank_device)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"item\(\)"):  # meta tensors hold no numbers to read
        replicas.replica_drift(model, torch.zeros(6))
    assert asked == [0] and gathered_from == [torch.device("meta")]


# ----------------------------------------------------------------------------------------------
# throughput.py: matmul peak, model FLOPs, MFU, per-process figures


def test_model_flops_and_mfu_are_the_textbook_formulas():
    assert model_flops_per_token(10) == 60.0  # 6 N
    assert model_flops_per_token(10, n_layers=3, d_model=5, seq_len=7) == 60.0 + 12 * 3 * 5 * 7  # + attention
    assert (
        model_flops_per_token(10, 3, 5, 0) == model_flops_per_token(10, 0, 5, 7) == 60.0
    )  # each factor counts
    assert mfu(tokens_per_s=1000.0, flops_per_token=600.0, peak_gflops=2.0) == 1000.0 * 600.0 / 2e9


class FakeTimeFn:
    """``time_fn`` as ``matmul_gflops`` calls it: records what it was asked to time; the i-th call's median
    is ``medians[i]`` (the function to time is kept, not run: sizes up to 2048 would take seconds)."""

    def __init__(self, medians) -> None:
        self.medians, self.calls = list(medians), []

    def __call__(self, fn, warmup=2, repeat=5, device=None):
        self.calls.append({"fn": fn, "warmup": warmup, "repeat": repeat, "device": device})
        median = self.medians.pop(0)
        return timing.Timing(median, [median] * repeat)


def test_matmul_gflops_times_one_product_of_two_n_by_n_matrices_in_the_dtype_on_the_device(monkeypatch):
    from course_lib.instruments import throughput

    fake = FakeTimeFn([0.5])
    monkeypatch.setattr(throughput, "time_fn", fake)
    drawn_on, randn = [], torch.randn

    def spy_randn(*size, **kwargs):  # on a CPU-only machine every device is the CPU: record the one asked
        drawn_on.append(kwargs.get("device"))
        return randn(*size, **kwargs)

    monkeypatch.setattr(torch, "randn", spy_randn)
    result = matmul_gflops(torch.bfloat16, device="cpu", n=16)
    assert drawn_on == [torch.device("cpu")] * 2  # both matrices
    assert result == {"n": 16, "seconds": 0.5, "gflops": 2 * 16**3 / 0.5 / 1e9}
    (call,) = fake.calls
    assert (call["warmup"], call["repeat"], call["device"]) == (1, 5, torch.device("cpu"))
    product = call["fn"]()
    assert (product.shape, product.dtype, product.device) == ((16, 16), torch.bfloat16, torch.device("cpu"))


def test_matmul_gflops_measures_on_the_cpu_when_asked_though_a_gpu_exists(monkeypatch):
    from course_lib.instruments import throughput

    FakeCuda(monkeypatch)
    fake = FakeTimeFn([0.5])
    monkeypatch.setattr(throughput, "time_fn", fake)
    matmul_gflops(device="cpu", n=16)
    assert fake.calls[0]["device"] == torch.device("cpu") and fake.calls[0]["fn"]().device.type == "cpu"


@pytest.mark.parametrize(
    ("medians", "sizes"),
    [
        ([0.001, 0.008, 0.064], [128, 256, 512]),  # grows until a call takes the 20 ms target ...
        ([0.001, 0.02], [128, 256]),  # ... reaching it exactly is enough
        ([0.001] * 5, [128, 256, 512, 1024, 2048]),  # ... or until n reaches max_n, 2048 by default
    ],
)
def test_matmul_gflops_grows_the_size_until_a_call_takes_the_target_time(monkeypatch, medians, sizes):
    from course_lib.instruments import throughput

    fake = FakeTimeFn(medians)
    monkeypatch.setattr(throughput, "time_fn", fake)
    result = matmul_gflops()
    n = sizes[-1]
    assert result == {"n": n, "seconds": medians[-1], "gflops": 2 * n**3 / medians[-1] / 1e9}
    assert len(fake.calls) == len(sizes) and fake.medians == []
    assert fake.calls[0]["fn"]().shape == (128, 128)


def test_matmul_gflops_of_a_given_size_uses_the_real_timer(monkeypatch):
    # time_fn's own clock, scripted: repeats of 0.5, 0.25 and 0.25 s
    monkeypatch.setattr(timing, "time", ScriptedClock([0.0, 0.5, 1.0, 1.25, 2.0, 2.25]))
    result = matmul_gflops(n=64, repeat=3, device="cpu")
    assert result == {"n": 64, "seconds": 0.25, "gflops": 2 * 64**3 / 0.25 / 1e9}


def test_matmul_gflops_stops_growing_at_max_n(monkeypatch):
    monkeypatch.setattr(timing, "time", ScriptedClock([0.0, 0.001, 1.0, 1.002]))
    assert matmul_gflops(repeat=1, device="cpu", target_s=10.0, max_n=256)["n"] == 256


def test_per_process_throughput_of_one_process_and_its_text():
    from accelerate import Accelerator

    history = History(config={}, step_times=[1.0, 0.3, 0.3, 0.3], step_tokens=[7, 7, 7, 7])
    tp = per_process_throughput(history, rows_per_step=4, accelerator=Accelerator(cpu=True))
    assert tp == {
        "tokens_per_s": [7 / 0.3],  # exactly: the figures pass the gather as float64
        "samples_per_s": [4 / 0.3],
        "median_step_s": [0.3],
        "total_tokens_per_s": 7 / 0.3,
        "total_samples_per_s": 4 / 0.3,
    }


def test_format_per_process_prints_one_line_per_rank_then_the_total():
    tp = {
        "tokens_per_s": [12345.6, 1000.0],
        "samples_per_s": [10.25, 2.0],
        "median_step_s": [0.0504, 1.5],
        "total_tokens_per_s": 13345.6,
        "total_samples_per_s": 12.25,
    }
    assert format_per_process(tp) == (
        "  rank 0: 12,346 tokens/s, 10.2 samples/s, 50 ms/step\n"
        "  rank 1: 1,000 tokens/s, 2.0 samples/s, 1500 ms/step\n"
        "  total : 13,346 tokens/s, 12.2 samples/s"
    )


def test_per_process_throughput_gathers_on_the_accelerators_device_and_sums_the_processes(monkeypatch):
    """Two processes under nccl, which gathers CUDA tensors only: the gather is faked (it records where
    this process's figures are and answers with both processes' rows); meta stands in for the GPU."""
    import accelerate.utils

    placed = []

    def gather(tensor):
        placed.append((tensor.device, tensor.dtype, tuple(tensor.shape)))
        return torch.tensor([[100.0, 4.0, 0.5], [300.0, 12.0, 0.25]], dtype=torch.float64)

    monkeypatch.setattr(accelerate.utils, "gather", gather)
    history = History(config={}, step_times=[1.0, 0.5], step_tokens=[50, 50])
    tp = per_process_throughput(
        history, rows_per_step=2, accelerator=SimpleNamespace(device=torch.device("meta"))
    )
    assert placed == [(torch.device("meta"), torch.float64, (1, 3))]
    assert tp == {
        "tokens_per_s": [100.0, 300.0],
        "samples_per_s": [4.0, 12.0],
        "median_step_s": [0.5, 0.25],
        "total_tokens_per_s": 400.0,
        "total_samples_per_s": 16.0,
    }
