"""course_lib.devices: which device, the machine report, batches moved, seeds.

The GPU branches run here on any machine: ``torch.cuda.is_available`` / ``torch.backends.mps.is_available``
and the GPU properties are replaced by fakes with literal answers, and each fake checks that the
code really asked it (a test whose fake is never consulted proves nothing).
"""

from types import SimpleNamespace

import pytest
import torch

from course_lib import devices


class Answer:
    """A stand-in for a no-argument query such as ``torch.cuda.is_available``: a fixed answer, counted."""

    def __init__(self, value):
        self.value, self.calls = value, 0

    def __call__(self):
        self.calls += 1
        return self.value


def _fake_accelerators(monkeypatch, cuda: bool, mps: bool) -> tuple[Answer, Answer]:
    found = Answer(cuda), Answer(mps)
    monkeypatch.setattr(torch.cuda, "is_available", found[0])
    monkeypatch.setattr(torch.backends.mps, "is_available", found[1])
    return found


@pytest.mark.parametrize(
    "cuda, mps, expected",
    [(True, True, "cuda"), (True, False, "cuda"), (False, True, "mps"), (False, False, "cpu")],
)
def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    found_cuda, found_mps = _fake_accelerators(monkeypatch, cuda, mps)
    assert devices.get_device().type == expected
    assert devices.get_device("auto").type == expected
    assert devices.get_device("").type == expected
    assert found_cuda.calls >= 3  # the fake was asked (CUDA first, every time)
    assert found_mps.calls == (0 if cuda else 3)  # MPS only when there is no CUDA


def test_auto_device_on_this_machine_is_a_device_it_has():
    device = devices.get_device()
    assert torch.ones(1, device=device).device.type == device.type


@pytest.mark.parametrize("name", ["gpu", "tpu0", "CPU!"])
def test_unknown_device_name_says_what_to_use(name):
    with pytest.raises(ValueError, match="use 'auto', 'cpu'"):
        devices.get_device(name)


def test_a_requested_device_is_given_only_where_it_exists(monkeypatch):
    found_cuda, found_mps = _fake_accelerators(monkeypatch, cuda=False, mps=False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        devices.get_device("cuda:0")
    with pytest.raises(RuntimeError, match="'mps' was requested but is not available"):
        devices.get_device("mps")
    assert devices.get_device("cpu") == torch.device("cpu")
    assert (found_cuda.calls, found_mps.calls) == (1, 1)

    found_cuda.value = found_mps.value = True
    assert devices.get_device("cuda:1") == torch.device("cuda", 1)
    assert devices.get_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    assert devices.get_device("mps") == torch.device("mps")


def test_describe_machine_reports_versions_and_features():
    info = devices.describe_machine()
    assert info["torch"] == torch.__version__
    for key in ("transformers", "accelerate", "cpu", "cpu_features", "gpus", "device"):
        assert key in info
    text = devices.format_machine(info)
    assert "torch" in text and info["cpu"] in text


def test_describe_machine_lists_every_gpu_with_memory_and_compute_capability(monkeypatch):
    gpus = [
        SimpleNamespace(name="NVIDIA A100-SXM4-80GB", total_memory=80 * 2**30, major=8, minor=0),
        SimpleNamespace(name="Tesla V100-SXM2-16GB", total_memory=16 * 2**30 + 2**28, major=7, minor=0),
    ]
    asked = []

    def properties(index):
        asked.append(index)
        return gpus[index]

    _fake_accelerators(monkeypatch, cuda=True, mps=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    info = devices.describe_machine()
    assert asked == [0, 1]
    assert info["cuda_available"] is True and info["device"] == "cuda"
    assert info["gpus"] == [
        {"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80.0, "compute_capability": "8.0"},
        {"name": "Tesla V100-SXM2-16GB", "memory_gb": 16.2, "compute_capability": "7.0"},
    ]
    text = devices.format_machine(info)
    assert "NVIDIA A100-SXM4-80GB (80.0 GB, cc 8.0); Tesla V100-SXM2-16GB (16.2 GB, cc 7.0)" in text


def test_synchronize_waits_for_the_gpu_and_is_a_no_op_on_a_cpu(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(("cuda", device)))
    monkeypatch.setattr(torch.mps, "synchronize", lambda: waited.append(("mps", None)))
    devices.synchronize(torch.device("cpu"))
    assert waited == []
    devices.synchronize(torch.device("cuda", 1))
    devices.synchronize(torch.device("mps"))
    assert waited == [("cuda", torch.device("cuda", 1)), ("mps", None)]


def test_seed_everything_makes_torch_repeatable():
    devices.seed_everything(123)
    a = torch.randn(5)
    devices.seed_everything(123)
    assert torch.equal(a, torch.randn(5))
    devices.seed_everything(124)
    assert not torch.equal(a, torch.randn(5))


def test_to_device_moves_nested_batches(monkeypatch):
    moved_to = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        moved_to.append(args[0])
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    batch = {"x": torch.ones(2), "y": [torch.zeros(1), 3], "z": "text", "t": (torch.ones(1),)}
    moved = devices.to_device(batch, "cpu")
    assert moved_to == ["cpu", "cpu", "cpu"]  # every tensor, however deep, and nothing else
    assert moved["x"].device.type == "cpu" and moved["y"][1] == 3 and moved["z"] == "text"
    assert isinstance(moved["y"], list) and isinstance(moved["t"], tuple)


def test_to_device_keeps_a_namedtuple_a_namedtuple():
    from collections import namedtuple

    Pair = namedtuple("Pair", "inputs labels")
    moved = devices.to_device({"pair": Pair(torch.ones(2), torch.zeros(2))}, "cpu")["pair"]
    assert type(moved) is Pair and torch.equal(moved.labels, torch.zeros(2))


# /proc/cpuinfo excerpts: an x86 machine (flags) and an ARM one (Features), as the kernel writes them
X86_CPUINFO = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse2 avx512f amx_bf16\nbugs\t\t: spectre_v1\n"
ARM_CPUINFO = (
    "processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm bf16 i8mm\nCPU part\t: 0xd40\n"
)


@pytest.mark.parametrize(
    "cpuinfo, present, absent",
    [
        (X86_CPUINFO, {"amx_bf16", "avx512f"}, {"spectre_v1", "bf16"}),
        (ARM_CPUINFO, {"bf16", "asimd"}, {"0xd40"}),
    ],
    ids=["x86", "arm"],
)
def test_cpu_flags_reads_x86_flags_and_arm_features(tmp_path, cpuinfo, present, absent):
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    flags = devices.cpu_flags(str(path))
    assert present <= flags and not absent & flags
    assert devices.cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_an_arm_cpu_with_bf16_counts_as_having_bf16_instructions(tmp_path, monkeypatch):
    import course_lib.mixed_precision as mp

    for name, cpuinfo, expected in [
        ("bf16", ARM_CPUINFO, True),
        ("no-bf16", ARM_CPUINFO.replace(" bf16", ""), False),
    ]:
        path = tmp_path / name  # one file per content: cpu_flags caches by path
        path.write_text(cpuinfo)
        monkeypatch.setattr(mp, "cpu_flags", lambda path=path: devices.cpu_flags(str(path)))
        assert mp.cpu_has_fast_bf16() is expected, name


@pytest.mark.parametrize(
    "cpuinfo, listed",
    [
        (X86_CPUINFO, ["amx_bf16", "avx512f"]),
        (ARM_CPUINFO.replace("asimd ", "asimd asimdhp "), ["asimdhp", "bf16"]),
        (None, []),  # no /proc/cpuinfo (macOS, Windows): no flags are read
    ],
    ids=["x86", "arm", "none"],
)
def test_describe_machine_lists_the_x86_and_arm_features_the_course_uses(
    tmp_path, monkeypatch, cpuinfo, listed
):
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    read = devices.cpu_flags.__wrapped__  # uncached: every case writes the same path
    monkeypatch.setattr(devices, "cpu_flags", lambda: read(str(path)))
    assert devices.describe_machine()["cpu_features"] == listed
