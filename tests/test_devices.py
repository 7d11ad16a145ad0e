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


def test_describe_machine_reports_versions_and_features():
    info = devices.describe_machine()
    assert info["torch"] == torch.__version__
    for key in ("transformers", "accelerate", "cpu", "cpu_features", "gpus", "device"):
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
