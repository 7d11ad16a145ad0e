"""Lesson 06's demonstrations (course_lib.apparatus.optimizers): optimizer state read from the tensors."""

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from course_lib.apparatus import optimizers as od
from course_lib.instruments.memory import optimizer_state_bytes
from course_lib.training import make_optimizer


def _stepped(name: str, layer: torch.nn.Module):
    optimizer = make_optimizer(layer, lr=1e-3, weight_decay=0.0, name=name)
    assert od.state_bytes(optimizer) == {}  # created lazily, in the first step
    od.random_grad_step(optimizer, list(layer.parameters()))
    return optimizer


def test_adamw_keeps_two_fp32_moments_per_parameter():
    layer = torch.nn.Linear(64, 32)
    optimizer = _stepped("adamw", layer)
    n = 64 * 32 + 32
    assert od.state_bytes(optimizer) == {"exp_avg": 4 * n, "exp_avg_sq": 4 * n}
    assert od.optimizer_params(optimizer) == n
    row = od.state_summary("adamw", optimizer)
    assert row["bytes/param"] == 8.0 and row["state bytes"] == optimizer_state_bytes(optimizer)
    layout = {r["key"]: r for r in od.state_layout(optimizer.state[layer.weight])}
    assert layout["exp_avg"]["shape"] == (32, 64) and layout["exp_avg"]["dtype"] == "float32"
    assert layout["step"]["shape"] == ()  # a 0-d tensor per parameter tensor, left out of the count


def test_adamw8bit_quantises_large_tensors_and_counts_shared_maps_once():
    od.import_bitsandbytes()
    layer = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 64))  # 2 weights >= 4,096
    optimizer = _stepped("adamw8bit", layer)
    by_key = od.state_bytes(optimizer)
    big, small = 128 * 64 + 64 * 64, 64 + 64  # the biases stay 32-bit (fewer than 4,096 elements)
    blocks = (128 * 64) // 256 + (64 * 64) // 256  # one fp32 absmax per 256 values
    assert by_key["state1"] == by_key["state2"] == big + 4 * small
    assert by_key["absmax1"] == by_key["absmax2"] == 4 * blocks
    assert by_key["qmap1"] == by_key["qmap2"] == 256 * 4  # one 256-entry map, shared by both weights
    assert optimizer_state_bytes(optimizer) == sum(by_key.values())  # the same rule: each storage once
    shares = od.small_tensor_share(optimizer)
    assert shares == {
        "tensors": 4,
        "small tensors": 2,
        "elements": big + small,
        "elements in small tensors": small,
    }
    row = od.state_summary("adamw8bit", optimizer)
    assert row["state in 8-bit"] == f"{big / (big + small):.1%}"
    layout = {r["key"]: r for r in od.state_layout(optimizer.state[layer[0].weight])}
    assert layout["state1"]["dtype"] == "uint8" and layout["state1"]["bytes"] == 128 * 64
    assert layout["step"] == {"key": "step", "shape": "-", "dtype": "int", "bytes": 0}  # a Python int


def test_large_layer_reaches_the_papers_savings():
    rows = {r["optimizer"]: r for r in od.layer_state_rows(256, 128)}
    assert rows["adamw"]["bytes/param"] == 8.0
    n = 256 * 128
    # 1 byte per moment, one fp32 scale per 256 values of each, the two 256-entry maps
    assert rows["adamw8bit"]["state bytes"] == 2 * n + 2 * 4 * (n // 256) + 2 * 256 * 4
    assert rows["adafactor"]["state bytes"] == 4 * (256 + 128)  # factored: n + m floats
    assert {r["shape"] for r in rows.values()} == {"256 x 128"}


@pytest.mark.parametrize("shape", [(6, 5), (7,), (3, 4, 5), (1, 9)])
def test_adafactor_state_numel_matches_torch_adafactor(shape):
    param = torch.nn.Parameter(torch.randn(shape))
    optimizer = torch.optim.Adafactor([param])
    od.random_grad_step(optimizer, [param])
    real = sum(t.numel() for k, t in optimizer.state[param].items() if k != "step")
    assert od.adafactor_state_numel(shape) == real


def test_zero_accounting_gives_papers_16_bytes_for_adam():
    row = od.zero_bytes_per_param(8.0)
    assert row["total"] == 16 and row["master weights (fp32)"] == 4
    assert od.zero_bytes_per_param(2.0)["total"] == 10
    fp32_training = od.zero_bytes_per_param(8.0, base={"weights (fp32)": 4, "gradients (fp32)": 4})
    assert fp32_training["total"] == 16 and "master weights (fp32)" not in fp32_training


def test_trainer_optim_names_resolve_to_the_three_optimizers(tmp_path):
    from transformers.optimization import Adafactor

    bnb = od.import_bitsandbytes()
    cls, kwargs = od.trainer_optimizer("adamw_torch_fused", str(tmp_path), learning_rate=3e-4)
    assert cls is torch.optim.AdamW and kwargs["fused"] is True and kwargs["lr"] == 3e-4
    cls, kwargs = od.trainer_optimizer("adafactor", str(tmp_path))
    assert cls is Adafactor and kwargs["relative_step"] is False
    cls, kwargs = od.trainer_optimizer("adamw_bnb_8bit", str(tmp_path))
    assert cls is bnb.optim.AdamW and kwargs["optim_bits"] == 8
    row = od.describe_trainer_optimizer("adamw_bnb_8bit", str(tmp_path))
    assert row["class"] == "bitsandbytes.optim.adamw.AdamW" and "optim_bits=8" in row["arguments"]


def test_trainer_keeps_the_embeddings_state_32bit_with_8bit_adamw(tmp_path):
    from course_lib.models import load_model

    od.import_bitsandbytes()
    model = load_model()
    gen = torch.Generator().manual_seed(0)
    vocab = model.distilbert.embeddings.word_embeddings.num_embeddings
    batch = {
        "input_ids": torch.randint(0, vocab, (2, 8), generator=gen),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "labels": torch.tensor([0, 1]),
    }
    optimizer = od.trainer_stepped_optimizer(model, batch, "adamw_bnb_8bit", str(tmp_path), 1e-3)
    word = model.distilbert.embeddings.word_embeddings.weight
    lin1 = model.distilbert.transformer.layer[0].ffn.lin1.weight
    assert word.numel() >= od.MIN_8BIT_SIZE  # large enough for 8-bit: 32-bit only by Trainer's override
    assert optimizer.state[word]["state1"].dtype == torch.float32
    assert optimizer.state[lin1]["state1"].dtype == torch.uint8
    share = od.embedding_share(model)
    assert share["elements"] == sum(p.numel() for p in model.parameters())
    assert share["in embeddings"] == sum(
        m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
    )
    row = od.state_summary("adamw_bnb_8bit", optimizer)
    assert row["state bytes"] == optimizer_state_bytes(optimizer) and row["state in 8-bit"] != "-"
    # Trainer's overrides are cleared afterwards: a later 8-bit AdamW quantises its first tensor again
    later = torch.nn.Linear(128, 64)
    assert _stepped("adamw8bit", later).state[later.weight]["state1"].dtype == torch.uint8


def test_importing_bitsandbytes_is_quiet_on_a_cpu_with_avx512_bf16():
    """On such a CPU bitsandbytes' import looks for an optional kernel and logs a warning: simulated here."""
    script = textwrap.dedent(
        """
        import importlib.abc, importlib.machinery, sys

        class AsIfAvx512Bf16(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name != "bitsandbytes.functional":
                    return None
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                run = spec.loader.exec_module

                def exec_module(module):
                    run(module)
                    module.has_avx512bf16 = lambda: True

                spec.loader.exec_module = exec_module
                return spec

        sys.meta_path.insert(0, AsIfAvx512Bf16())
        from course_lib.apparatus.optimizers import import_bitsandbytes

        import_bitsandbytes()
        import bitsandbytes.backends.cpu.ops as ops

        print("optional-kernel branch ran:", hasattr(ops, "gemm_4bit_forward_kernel"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    )
    assert "branch ran: True" in done.stdout, done.stdout + done.stderr
    assert done.stderr == "", done.stderr


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.LayerNorm = torch.nn.LayerNorm(64)
        self.head = torch.nn.Linear(64, 2)
        torch.nn.init.zeros_(self.head.bias)

    def forward(self, x):
        return self.head(self.LayerNorm(self.lin(x)))


def test_param_kinds_and_step_sizes_per_kind():
    torch.manual_seed(0)
    model = _Tiny()
    kinds = {name: od.param_kind(name, p) for name, p in model.named_parameters()}
    assert kinds == {
        "lin.weight": "weight matrices",
        "lin.bias": "biases",
        "LayerNorm.weight": "LayerNorm gains",
        "LayerNorm.bias": "biases at zero",  # LayerNorm's bias starts at 0
        "head.weight": "weight matrices",
        "head.bias": "biases at zero",
    }
    steps = {}
    for name, lr in (("adamw", 1e-3), ("adafactor", 1e-2)):
        work = copy.deepcopy(model)
        before = {n: p.detach().clone() for n, p in work.named_parameters()}
        optimizer = make_optimizer(work, lr=lr, weight_decay=0.0, name=name)
        work(torch.randn(8, 64, generator=torch.Generator().manual_seed(1))).pow(2).sum().backward()
        optimizer.step()
        steps[name] = od.step_rms_by_kind(work, before)
    # AdamW's first step is about lr for every kind; Adafactor's is lr x max(RMS, 1e-3): relative.
    assert all(abs(row["step RMS"] - 1e-3) < 2e-4 for row in steps["adamw"].values())
    assert steps["adafactor"]["LayerNorm gains"]["step RMS"] > 5e-3  # RMS 1: lr x 1
    assert steps["adafactor"]["biases at zero"]["step RMS"] < 1e-4  # RMS 0: lr x eps2
    with pytest.raises(ValueError, match="copy every named parameter"):
        od.step_rms_by_kind(model, {})


def test_step_peak_counts_the_temporaries_of_a_step():
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256, bias=False)
    adafactor = make_optimizer(layer, lr=1e-2, weight_decay=0.0, name="adafactor")
    with pytest.raises(ValueError, match="run one step first"):
        od.optimizer_step_peak_mb(adafactor, [layer.weight])
    od.random_grad_step(adafactor, [layer.weight])
    state_mib = sum(od.state_bytes(adafactor).values()) / 2**20
    peak = od.optimizer_step_peak_mb(adafactor, [layer.weight])
    one_copy = 256 * 256 * 4 / 2**20
    assert one_copy > 10 * state_mib  # the state: n + m floats
    # one n x m fp32 buffer (row_var @ col_var, turned into the update in place), not two
    assert one_copy <= peak < 1.5 * one_copy
    assert layer.weight.grad is None  # the gradients it set are gone again
