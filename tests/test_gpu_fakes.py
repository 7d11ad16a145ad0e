"""The GPU branches of course_lib, run on any machine against fake GPUs.

``FakeCuda`` puts one or more CUDA GPUs of a chosen compute capability into ``torch.cuda`` (answers
that a real driver would give); ``FakeCudaMemory`` replaces the allocator's counters and
``torch.cuda.synchronize``. Every test checks the fake's premise too (the patched function was
really asked, or the real torch function answers as a real GPU would), so a test whose code
path never reaches the fake fails instead of passing on the CPU branch. ``scripts/gpu_check.sh``
stays the real check on a CUDA machine (README, "Using a GPU").
"""

from __future__ import annotations

import collections
import json
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from course_lib import checkpoints, distributed
from course_lib import mixed_precision as mp
from course_lib.benchmark import config as bench_config
from course_lib.cli import train as train_cli
from course_lib.instruments import throughput
from course_lib.instruments.memory import TensorPeak
from course_lib.instruments.probe import StepProbe
from course_lib.recipe_ladder import rungs

MiB = 2**20
# Matmul GFLOP/s a GPU of each compute capability might measure (bf16 without native support: emulated).
GPU_SPEEDS = {
    (9, 0): {torch.float32: 50_000.0, torch.bfloat16: 700_000.0, torch.float16: 650_000.0},
    (8, 0): {torch.float32: 19_000.0, torch.bfloat16: 150_000.0, torch.float16: 140_000.0},
    (7, 5): {torch.float32: 8_000.0, torch.bfloat16: 8_000.0, torch.float16: 60_000.0},
    (7, 0): {torch.float32: 14_000.0, torch.bfloat16: 14_000.0, torch.float16: 110_000.0},
    (6, 1): {torch.float32: 11_000.0, torch.bfloat16: 200.0, torch.float16: 180.0},
}


class FakeCuda:
    """``count`` CUDA GPUs of compute ``capability`` in ``torch.cuda`` (and no Apple GPU).

    ``torch.cuda.is_bf16_supported`` stays torch's own function, answering from the fake device's
    properties: True for 8.0+, and for 7.x True by default (bf16 is emulated there) but False with
    ``including_emulation=False``. ``calls`` counts what was asked; ``bf16_queries`` records each
    ``including_emulation`` value.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capability=(8, 0), count: int = 1) -> None:
        self.capability, self.count = capability, count
        self.calls: collections.Counter = collections.Counter()
        self.bf16_queries: list[bool] = []
        real_bf16_supported = torch.cuda.is_bf16_supported
        major, minor = capability

        def counted(name, answer):
            def fake(*args, **kwargs):
                self.calls[name] += 1
                return answer(*args, **kwargs)

            monkeypatch.setattr(torch.cuda, name, fake)

        counted("is_available", lambda: True)
        counted("device_count", lambda: self.count)
        counted("current_device", lambda: 0)
        counted("get_device_capability", lambda device=None: (major, minor))
        counted(
            "get_device_properties",
            lambda device=None: SimpleNamespace(
                name=f"Fake GPU cc {major}.{minor}", total_memory=16 * 2**30, major=major, minor=minor
            ),
        )
        # torch's last test for emulated bf16 (creating a bf16 tensor on the device) succeeds on 7.x.
        counted("_check_bf16_tensor_supported", lambda device: True)

        def bf16_supported(including_emulation: bool = True) -> bool:
            self.bf16_queries.append(including_emulation)
            return real_bf16_supported(including_emulation=including_emulation)

        monkeypatch.setattr(torch.cuda, "is_bf16_supported", bf16_supported)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def measured(self, monkeypatch: pytest.MonkeyPatch) -> list:
        """Fake ``matmul_gflops`` answering ``GPU_SPEEDS`` on CUDA; returns the list of calls it gets."""
        asked = []

        def matmul_gflops(dtype=torch.float32, device=None, n=None, **kwargs):
            asked.append((dtype, torch.device(device).type))
            assert torch.device(device).type == "cuda", f"measured on {device}, not on the fake GPU"
            return {"n": n or 4096, "seconds": 1.0, "gflops": GPU_SPEEDS[self.capability][dtype]}

        monkeypatch.setattr(throughput, "matmul_gflops", matmul_gflops)
        return asked


# ---------------------------------------------------------------------------------------------
# Which precision on a GPU


def test_the_fake_answers_bf16_support_as_torch_does_on_a_real_gpu(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(7, 0))
    assert torch.cuda.is_bf16_supported() is True  # emulated: the default call says yes on 7.x ...
    assert torch.cuda.is_bf16_supported(including_emulation=False) is False  # ... natively it is not
    assert fake.calls["get_device_properties"] == 2 and fake.calls["_check_bf16_tensor_supported"] == 1
    FakeCuda(monkeypatch, capability=(8, 0))
    assert torch.cuda.is_bf16_supported(including_emulation=False) is True


@pytest.mark.parametrize(
    "capability, expected",
    [
        ((9, 0), "bf16"),
        ((8, 6), "bf16"),
        ((8, 0), "bf16"),
        ((7, 5), "fp16"),
        ((7, 0), "fp16"),
        ((6, 1), "no"),
    ],
)
def test_best_precision_on_a_gpu_follows_its_compute_capability(monkeypatch, capability, expected):
    fake = FakeCuda(monkeypatch, capability)
    assert mp.best_precision("cuda") == expected
    assert mp.best_precision() == expected  # auto: the fake GPU is the device
    assert fake.calls["get_device_capability"] == 2


def test_bf16_on_a_gpu_without_native_bf16_warns_even_though_torch_would_emulate_it(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(7, 0))
    assert torch.cuda.is_bf16_supported()  # the premise: the default (emulating) answer says yes
    fake.bf16_queries.clear()
    with pytest.warns(mp.PrecisionWarning, match="no native bf16 support.*use 'fp16'"):
        assert mp.check_precision("bf16", "cuda") == "bf16"
    assert fake.bf16_queries == []  # decided by the capability, not by torch's emulating answer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mp.check_precision("fp16", "cuda") == "fp16"  # fp16 on a GPU: no warning
        assert mp.check_precision("no", "cuda") == "no"


def test_bf16_on_a_gpu_with_native_bf16_does_not_warn(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(8, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mp.check_precision("bf16", "cuda") == "bf16"
    assert fake.bf16_queries == []


def test_bf16_advice_asks_the_gpu_it_is_about_not_the_current_one(monkeypatch):
    """cuda:1 is a 7.0 GPU while the current one (cuda:0) is an 8.0: bf16 on cuda:1 warns."""
    FakeCuda(monkeypatch, capability=(8, 0), count=2)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_capability",
        lambda device=None: (7, 0) if torch.device(device).index == 1 else (8, 0),
    )
    with pytest.warns(mp.PrecisionWarning, match="no native bf16 support"):
        mp.check_precision("bf16", "cuda:1")
    assert mp.best_precision("cuda:1") == "fp16" and mp.best_precision("cuda:0") == "bf16"
    assert bench_config.default_precisions(torch.device("cuda", 1)) == ("no", "fp16")


@pytest.mark.parametrize(
    "capability, expected",
    [((8, 0), ("no", "bf16", "fp16")), ((7, 0), ("no", "fp16")), ((7, 5), ("no", "fp16"))],
)
def test_benchmark_measures_bf16_only_on_gpus_with_native_bf16(monkeypatch, capability, expected):
    fake = FakeCuda(monkeypatch, capability)
    assert bench_config.default_precisions(torch.device("cuda")) == expected
    assert fake.bf16_queries == []  # emulated bf16 on 7.x is not measured as if it were native


@pytest.mark.parametrize(
    "capability, fastest, safe",
    [((8, 0), "bf16", "bf16"), ((7, 0), "fp16", "fp16"), ((6, 1), "no", "fp16")],
)
def test_advice_on_a_gpu_measures_it_and_rules_out_bf16_below_8_0(monkeypatch, capability, fastest, safe):
    fake = FakeCuda(monkeypatch, capability)
    asked = fake.measured(monkeypatch)
    advice = mp.advise("cuda")
    assert sorted(str(dtype) for dtype, _ in asked) == ["torch.bfloat16", "torch.float16", "torch.float32"]
    assert fake.calls["get_device_capability"] == 1
    assert (advice.device_type, advice.fastest, advice.safe_default) == ("cuda", fastest, safe)
    assert ("bf16" in advice.unusable) == (capability[0] < 8), advice.unusable
    assert "fp16" not in advice.unusable  # fp16 trains on every CUDA GPU (with a GradScaler)


@pytest.mark.parametrize(
    "capability, expected",
    [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 0), "fp16"), ((6, 1), "no")],
)
def test_recipe_picks_the_gpus_mixed_precision(monkeypatch, capability, expected):
    fake = FakeCuda(monkeypatch, capability)
    asked = fake.measured(monkeypatch)
    precision, why = rungs.mixed_precision_choice(torch.device("cuda"))
    assert precision == expected, why
    assert fake.calls["get_device_capability"] or asked  # decided on the fake GPU, not the CPU
    assert f"{capability[0]}.{capability[1]}" in why or asked, why


def test_train_command_auto_precision_and_fp16_on_a_gpu(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(7, 5))
    assert train_cli.resolve_precision("auto", cpu=False) == "fp16"
    assert train_cli.resolve_precision("fp16", cpu=False) == "fp16"  # allowed on a GPU ...
    with pytest.raises(ValueError, match="--precision fp16 on a CPU"):
        train_cli.resolve_precision("fp16", cpu=True)  # ... refused with --cpu
    assert fake.calls["get_device_capability"] == 1
    FakeCuda(monkeypatch, capability=(8, 0))
    assert train_cli.resolve_precision("auto", cpu=False) == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch sets
    assert train_cli.resolve_precision(None, cpu=False) == "bf16"


def test_fp16_is_refused_on_a_machine_without_cuda(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: asked.append(1) or False)
    with pytest.raises(ValueError, match="bf16"):
        train_cli.resolve_precision("fp16", cpu=False)
    assert asked and train_cli.resolve_precision("no", cpu=True) == "no"


# ---------------------------------------------------------------------------------------------
# Processes on GPUs: nccl


def _nccl_available(monkeypatch, available: bool = True) -> list:
    asked = []
    monkeypatch.setattr(dist, "is_nccl_available", lambda: asked.append(1) or available)
    return asked


def test_nccl_is_the_default_backend_with_one_gpu_per_process(monkeypatch):
    fake = FakeCuda(monkeypatch, capability=(8, 0), count=2)
    asked = _nccl_available(monkeypatch)
    assert distributed.default_backend(2) == "nccl"
    assert distributed.check_backend(None, world_size=2) == "nccl"
    assert distributed.check_backend("NCCL", world_size=2) == "nccl"
    assert distributed.default_backend(3) == "gloo"  # 3 processes, 2 GPUs
    with pytest.raises(RuntimeError, match="one CUDA GPU per process: 3 processes, 2 GPU"):
        distributed.check_backend("nccl", world_size=3)
    assert fake.calls["device_count"] >= 4 and asked
    _nccl_available(monkeypatch, available=False)  # a torch built without NCCL (Windows, macOS)
    assert distributed.default_backend(2) == "gloo"


def test_rank_device_under_nccl_is_the_ranks_gpu(monkeypatch):
    assert distributed.rank_device(1, "nccl") == torch.device("cuda", 1)
    assert distributed.rank_device(1, "gloo") == torch.device("cpu")
    asked = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: asked.append(1) or "nccl")
    assert distributed.rank_device(1) == torch.device("cuda", 1)  # the group's backend decides
    assert asked == [1]


# ---------------------------------------------------------------------------------------------
# Peak memory and step time on a GPU: the allocator's counters, read after a synchronize


class FakeCudaMemory:
    """The CUDA caching allocator's counters (bytes), and a log of every call in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, allocated: int = 0) -> None:
        self.allocated = self.peak = allocated
        self.log: list[str] = []
        fakes = {
            "synchronize": lambda device=None: self.log.append("synchronize"),
            "memory_allocated": lambda device=None: self._read("memory_allocated", self.allocated),
            "max_memory_allocated": lambda device=None: self._read("max_memory_allocated", self.peak),
            "reset_peak_memory_stats": lambda device=None: self._reset(),
        }
        for name, fake in fakes.items():
            monkeypatch.setattr(torch.cuda, name, fake)

    def _read(self, name: str, value: int) -> int:
        self.log.append(name)
        return value

    def _reset(self) -> None:
        self.log.append("reset_peak_memory_stats")
        self.peak = self.allocated

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)


def test_tensor_peak_on_a_gpu_is_the_allocators_peak_above_the_start(monkeypatch):
    memory = FakeCudaMemory(monkeypatch, allocated=500 * MiB)  # the model, already on the GPU
    memory.peak = 2000 * MiB  # an earlier step's peak: must not count
    peak = TensorPeak(torch.device("cuda", 0))
    peak.start()
    memory.alloc(300 * MiB)  # activations ...
    memory.alloc(-200 * MiB)  # ... freed in backward
    memory.alloc(50 * MiB)
    assert peak.stop() == 300.0
    assert memory.log == [
        "synchronize",  # queued work finishes before the counters are read
        "memory_allocated",
        "reset_peak_memory_stats",
        "synchronize",
        "max_memory_allocated",
    ]


def test_step_probe_on_a_gpu_synchronises_each_lap_and_measures_the_first_step(monkeypatch):
    memory = FakeCudaMemory(monkeypatch, allocated=100 * MiB)
    probe = StepProbe("cuda")
    probe.start()
    memory.alloc(64 * MiB)
    probe.tick()
    memory.alloc(512 * MiB)  # the second step's memory is not the probe's figure
    probe.tick()
    assert probe.peak_mb == 64.0 and len(probe.step_times) == 2
    assert memory.log.count("max_memory_allocated") == 1
    assert memory.log.count("synchronize") >= 2 + 3  # the memory reads + start and every lap


# ---------------------------------------------------------------------------------------------
# Checkpoints on a GPU: the CUDA RNG state is saved and restored (dropout continues exactly)


class FakeAccelerator:
    """What ``save_checkpoint`` / ``load_checkpoint`` use of an ``Accelerator``: one process on ``device``."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.num_processes, self.process_index = device, 1, 0
        self.is_main_process, self.scaler = True, None

    def wait_for_everyone(self) -> None:
        pass

    def print(self, *args) -> None:
        pass


def _fake_cuda_rng(monkeypatch) -> dict:
    state = {"value": torch.arange(16, dtype=torch.uint8), "got": [], "set": []}

    def get_rng_state(device="cuda"):
        state["got"].append(torch.device(device))
        return state["value"].clone()

    def set_rng_state(new_state, device="cuda"):
        state["set"].append((new_state.clone(), torch.device(device)))

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return state


def _gather_in_one_process(monkeypatch) -> list:
    import accelerate.utils

    calls = []
    monkeypatch.setattr(accelerate.utils, "gather_object", lambda obj: calls.append(obj) or obj)
    return calls


def test_a_checkpoint_on_a_gpu_saves_and_restores_the_cuda_rng_state(monkeypatch, tmp_path):
    from safetensors.torch import load_file

    rng = _fake_cuda_rng(monkeypatch)
    gathered = _gather_in_one_process(monkeypatch)
    device = torch.device("cuda", 0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(7)
    cpu_state = torch.get_rng_state()
    path = checkpoints.save_checkpoint(tmp_path, 5, model, optimizer, FakeAccelerator(device), {"seed": 0})
    assert gathered and rng["got"] == [device]
    saved = load_file(str(path / "rng.safetensors"))
    assert set(saved) == {"rank0.cpu", "rank0.cuda"}
    assert torch.equal(saved["rank0.cuda"], torch.arange(16, dtype=torch.uint8))

    torch.manual_seed(99)  # the RNGs move on ...
    step = checkpoints.load_checkpoint(path, model, optimizer, FakeAccelerator(device))
    assert step == 5 and json.loads((path / "state.json").read_text())["world_size"] == 1
    assert len(rng["set"]) == 1  # ... and both come back
    restored, on = rng["set"][0]
    assert torch.equal(restored, torch.arange(16, dtype=torch.uint8)) and on == device
    assert torch.equal(torch.get_rng_state(), cpu_state)


def test_a_cpu_checkpoint_resumed_on_a_gpu_leaves_the_cuda_rng_alone(monkeypatch, tmp_path):
    rng = _fake_cuda_rng(monkeypatch)
    _gather_in_one_process(monkeypatch)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = checkpoints.save_checkpoint(
        tmp_path, 2, model, optimizer, FakeAccelerator(torch.device("cpu")), {}
    )
    assert rng["got"] == []  # a CPU run has no CUDA RNG to save
    assert checkpoints.load_checkpoint(path, model, optimizer, FakeAccelerator(torch.device("cuda", 0))) == 2
    assert rng["set"] == []
