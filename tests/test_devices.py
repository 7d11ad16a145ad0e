import warnings

import pytest
import torch

from course_lib import devices


def test_auto_device_is_cpu_without_accelerators():
    expected = (
        "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    )
    assert devices.get_device().type == expected
    assert devices.get_device("auto").type == expected


@pytest.mark.parametrize("name", ["gpu", "tpu0", "CPU!"])
def test_unknown_device_name_says_what_to_use(name):
    with pytest.raises(ValueError, match="use 'auto', 'cpu'"):
        devices.get_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        devices.get_device("cuda:0")


@pytest.mark.parametrize(
    ("given", "expected"),
    [("no", "no"), (None, "no"), ("fp32", "no"), ("FP16", "fp16"), ("bfloat16", "bf16"), (" bf16 ", "bf16")],
)
def test_normalize_precision(given, expected):
    assert devices.normalize_precision(given) == expected


@pytest.mark.parametrize("bad", ["fp8", "half-ish", "int8", ""])
def test_unknown_precision_is_rejected(bad):
    with pytest.raises(ValueError, match="use 'no'"):
        devices.normalize_precision(bad)


def test_fp16_on_cpu_warns_and_bf16_does_not_when_native(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    with pytest.warns(devices.PrecisionWarning, match="fp16 on a CPU is a trap"):
        assert devices.check_precision("fp16", "cpu") == "fp16"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert devices.check_precision("bf16", "cpu") == "bf16"
        assert devices.check_precision("no", "cpu") == "no"


def test_bf16_on_cpu_without_native_support_warns(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: False)
    with pytest.warns(devices.PrecisionWarning, match="emulated"):
        devices.check_precision("bf16", "cpu")
    assert devices.best_precision("cpu") == "no"


def test_best_precision_on_cpu_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    assert devices.best_precision("cpu") == "bf16"


def test_describe_machine_reports_versions_and_features():
    info = devices.describe_machine()
    assert info["torch"] == torch.__version__
    for key in ("transformers", "accelerate", "cpu", "cpu_features", "gpus", "best_precision", "device"):
        assert key in info
    text = devices.format_machine(info)
    assert "torch" in text and info["cpu"] in text


def test_seed_everything_makes_torch_repeatable():
    devices.seed_everything(123)
    a = torch.randn(5)
    devices.seed_everything(123)
    assert torch.equal(a, torch.randn(5))


def test_to_device_moves_nested_batches():
    batch = {"x": torch.ones(2), "y": [torch.zeros(1), 3], "z": "text"}
    moved = devices.to_device(batch, "cpu")
    assert moved["x"].device.type == "cpu" and moved["y"][1] == 3 and moved["z"] == "text"


def test_batch_on_wrong_device_gets_a_clear_error():
    model = torch.nn.Linear(2, 2)
    batch = {"input_ids": torch.ones(2, device="meta")}
    with pytest.raises(RuntimeError, match="Move the batch first"):
        devices.check_same_device(model, batch)
    devices.check_same_device(model, {"input_ids": torch.ones(2)})


def test_autocast_dtype():
    assert devices.autocast_dtype("bf16") is torch.bfloat16
    assert devices.autocast_dtype("fp16") is torch.float16
    assert devices.autocast_dtype("no") is torch.float32


def test_measured_best_precision_follows_the_measurement(monkeypatch):
    import course_lib.bench as bench

    monkeypatch.setattr(devices, "cpu_has_fast_bf16", lambda: True)
    speeds = {torch.float32: 100.0, torch.bfloat16: 300.0}
    monkeypatch.setattr(bench, "matmul_gflops", lambda dtype, device=None, n=None: {"gflops": speeds[dtype]})
    assert devices.best_precision("cpu", measure=True) == "bf16"
    speeds[torch.bfloat16] = 50.0
    assert devices.best_precision("cpu", measure=True) == "no"
