"""A memory model of fine-tuning: the bytes each part of training needs, predicted before it runs.

``Arch`` (a DistilBERT-shaped model, read from a Hugging Face config) and ``Setup`` (precision,
activation checkpointing, optimizer, micro-batch, sequence length) give ``predict``: the bytes of the
weights, the gradients, the optimizer state, the tensors autograd saves for backward (derived tensor by
tensor from the architecture: ``block_saved_rows``, ``saved_tensors``) and the step's peak, the largest
of its three branches (``BRANCHES``): the forward's fullest moment (with autocast's cache of 16-bit
weight copies), the backward's and the optimizer step's. ``per_rank`` divides weights, gradients and
state as DDP, ZeRO-1, ZeRO-2 and ZeRO-3 / FSDP do over N ranks. ``course_lib.memory_check`` measures
the same quantities on a real model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from course_lib.mixed_precision import PRECISIONS
from course_lib.training.optim import OPTIMIZERS

PARTS = ("weights", "gradients", "optimizer state", "saved for backward", "step peak")
BRANCHES = ("forward", "backward", "optimizer step")  # the step's peak is the largest of the three
STAGES = ("ddp", "zero1", "zero2", "zero3")
# the attention kernels the model knows; flash: derived from the kernel's design, not measured on a CPU
MODELLED_ATTENTION = ("sdpa", "eager", "flash")
MIN_8BIT_SIZE = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep fp32 state
BLOCKSIZE_8BIT = 256  # bitsandbytes' block-wise quantisation: one fp32 absmax per 256 elements
QMAP_BYTES = 2 * 256 * 4  # two shared quantisation maps (signed, unsigned) of 256 fp32 values each
# The CPU kernel's figure: five fp32 working buffers per element of the tensor being updated, measured on
# one layer (memory_check.single_layer_step_peak). A GPU's fused 8-bit kernel is not measured here.
ADAMW8BIT_STEP_BYTES_PER_ELEM = 20


def _one_of(what: str, value: str, allowed: tuple[str, ...]) -> None:
    """Refuse a name the model does not know, saying which ones it does."""
    if value not in allowed:
        raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}.")


@dataclass(frozen=True)
class Arch:
    """The shape of a DistilBERT-style encoder with a sequence-classification head."""

    vocab_size: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    max_position_embeddings: int = 512
    num_labels: int = 2
    attention: str = "sdpa"  # "sdpa" (CPU math kernel) | "eager" | "flash" (GPU fused kernel)
    attention_dropout: float = 0.1

    @classmethod
    def from_config(cls, config) -> Arch:
        """Read a ``DistilBertConfig`` (``model.config``)."""
        missing = [
            k for k in ("vocab_size", "dim", "hidden_dim", "n_layers", "n_heads") if not hasattr(config, k)
        ]
        if missing:
            raise ValueError(
                f"The config lacks {', '.join(missing)}: the memory model knows DistilBERT's architecture "
                "(model_type 'distilbert'); build an Arch(...) by hand for another model."
            )
        return cls(
            vocab_size=config.vocab_size,
            dim=config.dim,
            hidden_dim=config.hidden_dim,
            n_layers=config.n_layers,
            n_heads=config.n_heads,
            max_position_embeddings=config.max_position_embeddings,
            num_labels=getattr(config, "num_labels", 2),
            attention=getattr(config, "_attn_implementation", None) or "sdpa",
            attention_dropout=config.attention_dropout,
        )

    def param_shapes(self) -> list[tuple[int, ...]]:
        """Every parameter tensor's shape, in the model's order (embeddings, layers, head)."""
        d, f = self.dim, self.hidden_dim
        shapes = [(self.vocab_size, d), (self.max_position_embeddings, d), (d,), (d,)]
        for _ in range(self.n_layers):
            shapes += [(d, d), (d,)] * 4  # q, k, v, out projections
            shapes += [(d,), (d,)]  # sa_layer_norm
            shapes += [(f, d), (f,), (d, f), (d,)]  # FFN lin1, lin2
            shapes += [(d,), (d,)]  # output_layer_norm
        shapes += [(d, d), (d,), (self.num_labels, d), (self.num_labels,)]  # pre_classifier, classifier
        return shapes

    def num_params(self) -> int:
        """Number of parameters (elements)."""
        return sum(math.prod(s) for s in self.param_shapes())

    def block_numel(self) -> int:
        """Elements of one transformer block's parameters (what ZeRO-2/3 hold in full for one block)."""
        d, f = self.dim, self.hidden_dim
        return 4 * (d * d + d) + 2 * d + (f * d + f) + (d * f + d) + 2 * d  # q/k/v/out, LN, lin1, lin2, LN

    def matmul_weight_numel(self) -> int:
        """Elements of the weights that go into matrix products (autocast keeps a 16-bit copy of each)."""
        d, f = self.dim, self.hidden_dim
        return self.n_layers * (4 * d * d + 2 * d * f) + d * d + self.num_labels * d


@dataclass(frozen=True)
class Setup:
    """What the training run does: precision, checkpointing, optimizer, micro-batch and sequence length."""

    batch: int
    seq_len: int
    precision: str = "no"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        _one_of("precision", self.precision, PRECISIONS)
        _one_of("optimizer", self.optimizer, OPTIMIZERS)
        if self.batch < 1 or self.seq_len < 1:
            raise ValueError(f"batch and seq_len must be >= 1, got {self.batch} and {self.seq_len}.")

    @classmethod
    def from_train_config(cls, config, batch: int, seq_len: int) -> Setup:
        """The setup of a ``training.TrainConfig`` on micro-batches of ``batch`` x ``seq_len`` tokens."""
        return cls(batch, seq_len, config.precision, config.gradient_checkpointing, config.optimizer)


def optimizer_state(arch: Arch, optimizer: str) -> int:
    """Bytes an optimizer keeps between steps for all of the model's parameters (fp32 parameters)."""
    _one_of("optimizer", optimizer, OPTIMIZERS)
    return sum(param_state(shape, optimizer) for shape in arch.param_shapes()) + (
        QMAP_BYTES if optimizer == "adamw8bit" else 0
    )


def param_state(shape: tuple[int, ...], optimizer: str) -> int:
    """Optimizer-state bytes for one parameter tensor of ``shape`` (bitsandbytes' shared qmaps excluded)."""
    _one_of("optimizer", optimizer, OPTIMIZERS)
    n = math.prod(shape)
    if optimizer == "adamw":
        return 2 * 4 * n  # exp_avg + exp_avg_sq, fp32
    if optimizer == "adafactor":
        if len(shape) < 2:
            return 4 * n  # a vector keeps one second moment per element, no first moment
        return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])  # row_var + col_var
    if n < MIN_8BIT_SIZE:
        return 2 * 4 * n  # bitsandbytes keeps small tensors in 32-bit
    return 2 * n + 2 * 4 * math.ceil(n / BLOCKSIZE_8BIT)  # two uint8 moments + an absmax per block each


def block_saved_rows(arch: Arch, setup: Setup) -> list[tuple]:
    """What autograd saves for backward in one transformer block (no checkpointing), read from
    DistilBERT's TransformerBlock: (where, tensor, numel, bytes/elem, count, alias) per kind of tensor.

    ``t`` tokens (batch x seq_len), ``d`` hidden size, ``f`` FFN width, ``s`` attention scores (batch x
    heads x seq_len^2). ``alias``: a parameter saved as it is (fp32), counted but no new memory.
    """
    t, d, f = setup.batch * setup.seq_len, arch.dim, arch.hidden_dim
    s = setup.batch * arch.n_heads * setup.seq_len**2
    amp = setup.precision != "no"
    e = 2 if amp else 4  # matmul inputs: autocast casts them to 16 bits; fp32 otherwise
    # autocast casts the input once per matmul: q, k and v each get their own 16-bit copy
    rows = [("layers", "q/k/v projection input", t * d, e, 3 if amp else 1, False)]
    if arch.attention == "flash":  # a fused GPU kernel (FlashAttention): no score matrix; not measured
        rows.append(("attention", "q, k, v, output", 4 * t * d, e, 1, False))
        rows.append(("attention", "log-sum-exp per row", s // setup.seq_len, 4, 1, False))
    elif arch.attention == "sdpa":  # CPU math kernel (dropout > 0): fp32 even for 16-bit inputs
        rows.append(("attention", "q, k (scaled), v (fp32)", 3 * t * d, 4, 1, False))
        rows.append(("attention", "probs, dropout mask, dropped probs", 3 * s, 4, 1, False))
    elif arch.attention == "eager":  # PyTorch ops one by one: saved in the matmuls' dtype
        rows.append(("attention", "q, k^T, v", 3 * t * d, e, 1, False))
        rows.append(("attention", "probs, dropout mask, dropped probs", 3 * s, e, 1, False))
    else:  # another kernel saves other tensors: no formula here
        raise ValueError(f"attention must be one of {', '.join(MODELLED_ATTENTION)}, got {arch.attention!r}.")
    return rows + [
        ("layers", "out_lin input", t * d, e, 1, False),
        ("layers", "2 LayerNorm inputs (residual sums, fp32)", 2 * t * d, 4, 1, False),
        ("layers", "2 LayerNorm mean + rstd", 4 * t, 4, 1, False),
        ("layers", "2 LayerNorm weight + bias", 4 * d, 4, 1, True),
        ("FFN", "lin1 input", t * d, e, 1, False),
        ("FFN", "GELU input, lin2 input", 2 * t * f, e, 1, False),
        ("FFN", "dropout mask", t * d, e, 1, False),
        ("layers", "matmul weights", 4 * d * d + 2 * d * f, e, 1, not amp),  # 16-bit copies under autocast
    ]


def saved_tensors(arch: Arch, setup: Setup) -> list[dict]:
    """The tensors autograd saves for backward in one forward pass, derived from the architecture.

    One row per kind of tensor (``block_saved_rows`` for each of the ``n_layers`` blocks, counted
    ``n_layers`` times): where it is saved, its elements per occurrence, bytes per element and how many
    times it occurs. Rows marked ``alias`` are parameters saved as they are (fp32 training): counted by
    ``SavedTensors``, but they take no new memory. Batches without padding (attention mask of ones,
    which transformers drops) are assumed.
    """
    _one_of("attention", arch.attention, MODELLED_ATTENTION)
    if arch.attention == "sdpa" and arch.attention_dropout == 0:
        # dropout > 0 sends SDPA on the CPU to its math kernel, whose saved tensors the rows model
        raise ValueError("SDPA without dropout runs a fused kernel that saves other tensors: not modelled.")
    b, t, d, L = setup.batch, setup.batch * setup.seq_len, arch.dim, arch.n_layers
    e = 2 if setup.precision != "no" else 4
    rows = [
        # position_ids: one row of seq_len, broadcast over the batch
        ("embeddings", "input_ids + position_ids (int64)", b * setup.seq_len + setup.seq_len, 8, 1, False),
        ("embeddings", "LayerNorm input, mean, rstd", t * d + 2 * t, 4, 1, False),
        ("embeddings", "LayerNorm weight + bias", 2 * d, 4, 1, True),
        ("embeddings", "dropout mask", t * d, 4, 1, False),
    ]
    if setup.gradient_checkpointing:
        # Each block keeps only its input (fp32: LayerNorm outputs are fp32); the rest is recomputed.
        rows.append(("layers", "block input (checkpoint)", t * d, 4, L, False))
    else:
        rows += [
            (w, name, n, size, count * L, alias)
            for w, name, n, size, count, alias in block_saved_rows(arch, setup)
        ]
    rows += [
        ("head", "[CLS] rows, ReLU out, dropout mask, classifier input", 4 * b * d, e, 1, False),
        (
            "head",
            "pre_classifier + classifier weights",
            d * d + arch.num_labels * d,
            e,
            1,
            setup.precision == "no",
        ),
        ("head", "log-softmax, labels (int64: 2 x 4 B), loss", b * arch.num_labels + 2 * b + 1, 4, 1, False),
    ]
    keys = ("where", "tensor", "numel", "bytes/elem", "count", "alias")
    out = [dict(zip(keys, r, strict=True)) for r in rows]
    for row in out:
        row["bytes"] = row["numel"] * row["bytes/elem"] * row["count"]
    return out


def predict(arch: Arch, setup: Setup) -> dict[str, int]:
    """Predicted bytes of each part (``PARTS``) and each branch (``BRANCHES``) of one training step.

    Weights and gradients stay fp32 under autocast (4 + 4 bytes per parameter). Each branch is counted
    above the weights and the optimizer state already held (a step after the first, gradients freed
    before it): ``forward_peak``, ``backward_peak``, and the optimizer step (all gradients plus its
    largest temporary, ``step_temporary``). The step's peak is the largest of the three.
    """
    rows = saved_tensors(arch, setup)
    grads = 4 * arch.num_params()
    branches = {
        "forward": forward_peak(arch, setup),
        "backward": backward_peak(arch, setup),
        "optimizer step": grads + step_temporary(arch, setup.optimizer),
    }
    return {
        "weights": 4 * arch.num_params(),
        "gradients": grads,
        "optimizer state": optimizer_state(arch, setup.optimizer),
        "saved for backward": sum(r["bytes"] for r in rows),
        **branches,
        "step peak": max(branches.values()),
    }


def autocast_cache(arch: Arch, blocks: int, head: bool = True) -> int:
    """Bytes of autocast's 16-bit copies of the matmul weights and biases of ``blocks`` blocks (and the head).

    Autocast casts each fp32 leaf parameter once and keeps the copy until the outermost autocast exits
    (torch/amp/autocast_mode.py); non-reentrant checkpointing does not clear it.
    """
    d, f = arch.dim, arch.hidden_dim
    block = 4 * (d * d + d) + (f * d + f) + (d * f + d)  # q, k, v, out_lin, lin1, lin2
    return 2 * (blocks * block + (d * d + d + arch.num_labels * (d + 1) if head else 0))


def forward_peak(arch: Arch, setup: Setup) -> int:
    """Bytes held at the forward's fullest moment, above the weights and optimizer state.

    Without checkpointing: everything saved (aliases excluded) and autocast's copies of the biases
    (the weights' copies are saved), plus the last block's output LayerNorm moment: its output, and under
    autocast the 16-bit dropout output and its fp32 copy for the residual sum. With checkpointing: the
    checkpointed inputs and autocast's copies of every block before the last, plus the last block's own
    fullest moment: the attention's (probs, dropout mask and dropped probs, q/k/v and their copies) or
    the FFN's (its input, the lin1 output beside the GELU output); or the end of forward, when autocast
    holds every copy, if that is more.
    """
    t, d, f, L = setup.batch * setup.seq_len, arch.dim, arch.hidden_dim, arch.n_layers
    s = setup.batch * arch.n_heads * setup.seq_len**2
    amp = setup.precision != "no"
    e = 2 if amp else 4
    saved = sum(r["bytes"] for r in saved_tensors(arch, setup) if not r["alias"])
    if not setup.gradient_checkpointing:
        biases = autocast_cache(arch, L) - 2 * arch.matmul_weight_numel() if amp else 0
        return saved + biases + t * d * 4 + (t * d * (e + 4) if amp else 0)
    d2 = d * d + d  # one d x d projection's weight and bias
    if arch.attention == "sdpa":  # the CPU math kernel: fp32 copies of q, k, v beside the 16-bit ones
        attention = 3 * s * 4 + (6 if amp else 4) * t * d * 4
    elif arch.attention == "eager":
        attention = 3 * s * e + 3 * t * d * e
    else:  # flash: q, k, v and the output; not measured here
        attention = 4 * t * d * e
    ffn = t * d * 4 + 2 * t * f * e  # the FFN's input (the residual) beside lin1's and GELU's outputs
    before = autocast_cache(arch, L - 1, head=False) if amp else 0  # every earlier block's copies
    moment = max(attention + (2 * 3 * d2 if amp else 0), ffn + (2 * (4 * d2 + f * d + f) if amp else 0))
    end = autocast_cache(arch, L) if amp else 0
    return saved + max(before + moment, end)


def backward_peak(arch: Arch, setup: Setup) -> int:
    """Bytes held at backward's fullest moment: the GELU backward of the last block to be processed.

    Without checkpointing that is the last block: everything saved (aliases excluded), the gradients
    of the head and of the block's lin2 and LayerNorm, and one more activation gradient of FFN width
    (T x F). With checkpointing it is the block whose recomputed activations meet the most gradients:
    the checkpointed inputs still held, one block's full activations, the gradients of the blocks after it.
    On small batches it is the end: every gradient, beside the gradient of the embeddings' output.
    """
    d, f, L, t = arch.dim, arch.hidden_dim, arch.n_layers, setup.batch * setup.seq_len
    e = 2 if setup.precision != "no" else 4
    head_grads = 4 * (d * d + d + arch.num_labels * (d + 1))
    block_partial = 4 * (2 * d + d * f + d)  # output LayerNorm, lin2 weight and bias
    transient = t * f * e  # the gradient of the GELU input beside the gradient of its output
    end = 4 * arch.num_params() + t * d * 4  # backward's end: every gradient, the embeddings' output's
    if not setup.gradient_checkpointing:
        saved = sum(r["bytes"] for r in saved_tensors(arch, setup) if not r["alias"])
        return max(saved + head_grads + block_partial + transient, end)
    full = saved_tensors(arch, Setup(setup.batch, setup.seq_len, setup.precision, False, setup.optimizer))
    block = sum(
        r["bytes"] for r in full if r["where"] != "embeddings" and r["where"] != "head" and not r["alias"]
    )
    block //= L  # every block saves the same: one block's share
    embeddings = sum(r["bytes"] for r in full if r["where"] == "embeddings" and not r["alias"])
    block_grads = 4 * arch.block_numel()  # fp32
    return max(
        end,
        *(
            embeddings
            + (i + 1) * 4 * t * d  # the checkpointed fp32 inputs of blocks 0..i, still held
            + block
            + head_grads
            + (L - 1 - i) * block_grads
            + block_partial
            + transient
            for i in range(L)
        ),
    )


def step_temporary(arch: Arch, optimizer: str) -> int:
    """Largest temporary an optimizer step allocates beside the gradients (bytes).

    Fused AdamW updates in place (0). Adafactor builds an fp32 n x m estimate of the second moment
    per matrix, one matrix at a time (the largest counts). 8-bit AdamW on the CPU dequantises one
    tensor at a time into fp32 working buffers: 20 bytes per element of the largest tensor (five fp32
    buffers; the CPU kernel's figure, measured on a single layer by ``memory_check.single_layer_step_peak``,
    not fitted to the grid; a GPU's kernel is not measured here).
    """
    _one_of("optimizer", optimizer, OPTIMIZERS)
    shapes = arch.param_shapes()
    if optimizer == "adamw":
        return 0
    if optimizer == "adafactor":
        return max(4 * math.prod(s) for s in shapes if len(s) >= 2)
    return ADAMW8BIT_STEP_BYTES_PER_ELEM * max(math.prod(s) for s in shapes)


def per_rank(parts: dict[str, int], stage: str, world_size: int) -> dict[str, float]:
    """Bytes per rank of weights, gradients and optimizer state under ``stage`` on ``world_size`` ranks.

    DDP replicates all three; ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 /
    FSDP also the weights (Rajbhandari et al. 2020). Activations are per rank anyway (its own batch).
    PyTorch's DDP is taken with ``gradient_as_bucket_view=True`` (the gradients are views into its
    all-reduce buckets); with DDP's default (``False``) the buckets are one more full copy of the
    gradients per rank (measured by ``apparatus.sharding``), which ``estimator.estimate`` adds.
    """
    _one_of("stage", stage, STAGES)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    level = STAGES.index(stage)
    n = world_size
    out = {
        "weights": parts["weights"] / (n if level >= 3 else 1),
        "gradients": parts["gradients"] / (n if level >= 2 else 1),
        "optimizer state": parts["optimizer state"] / (n if level >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def bytes_per_param(precision_weights: int, grads: int, master: int, state: int) -> dict[str, int]:
    """One row of the bytes-per-parameter accounting: weights, gradients, master copy, optimizer state."""
    row = {
        "weights": precision_weights,
        "gradients": grads,
        "master weights": master,
        "optimizer state": state,
    }
    row["total"] = sum(row.values())
    return row


MIXED_ADAMW = bytes_per_param(2, 2, 4, 8)  # the ZeRO paper's fp16 mixed-precision Adam, fp32 master copy
AUTOCAST_ADAMW = bytes_per_param(4, 4, 0, 8)  # the course's autocast: fp32 weights and grads, no master copy
