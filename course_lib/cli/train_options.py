"""The flags of ``python -m course_lib.cli.train``: ``RunConfig`` (the command's own settings and the
loop's ``TrainConfig``) and ``parse_args``. The training flags are ``TrainConfig``'s fields
(``TRAIN_FLAGS``: one declaration, one validation, in ``TrainConfig.__post_init__``).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any, get_args, get_type_hints

from course_lib import training
from course_lib.mixed_precision import normalize_precision
from course_lib.training.ddp import COMM_HOOKS

# The training options are ``TrainConfig``'s fields: their types, defaults and checks come from there
# (declared once, validated once in ``TrainConfig.__post_init__``). The command adds only each flag's
# name, group and help. Fields it sets itself: precision (``--precision``, resolved against the
# launcher), device (the launcher and ``--cpu``), compile_dynamic (from ``--padding``).
SET_BY_COMMAND = ("precision", "device", "compile_dynamic")
TECHNIQUES, RECIPE = (
    "techniques (lessons 04-06b)",
    "recipe switches (lesson 07: python -m course_lib.cli.recipe prints a line)",
)
TRAIN_FLAGS: dict[str, tuple[str | None, str, tuple[str, ...]]] = {  # field: (group, help, flags)
    "epochs": (None, "passes over the training rows", ()),
    "max_steps": (None, "optimizer steps (overrides --epochs)", ()),
    "lr": (None, "peak learning rate (linear warm-up, then linear decay)", ()),
    "weight_decay": (None, "AdamW's decoupled weight decay (none on biases and LayerNorm)", ()),
    "warmup_ratio": (None, "share of the steps spent warming up", ()),
    "grad_accum_steps": (None, "micro-batches per optimizer step", ()),
    "max_grad_norm": (None, "clip the gradients' global norm to this ('none': no clipping)", ()),
    "seed": (None, "data order, dropout and the classifier head's initialisation", ()),
    "progress": (None, "no progress bar", ("--no-progress",)),
    "eval_every_epoch": (None, "skip the per-epoch evaluation", ("--no-eval",)),
    "optimizer": (
        TECHNIQUES,
        "AdamW (8 bytes of state per parameter), Adafactor (factored), 8-bit AdamW (bitsandbytes)",
        (),
    ),
    "gradient_checkpointing": (
        TECHNIQUES,
        "recompute activations in backward: less memory, about one extra forward pass",
        (),
    ),
    "local_sgd_steps": (
        TECHNIQUES,
        "N processes: average the parameters every N optimizer steps instead of the gradients every step",
        (),
    ),
    "comm_hook": (
        TECHNIQUES,
        "N processes: all-reduce gradients in 16 bits (bf16 needs NCCL, i.e. GPUs)",
        (),
    ),
    "fsdp": (
        TECHNIQUES,
        "N processes: shard parameters, gradients and AdamW state (FSDP2 fully_shard) instead of DDP",
        (),
    ),
    "fused_optimizer": (
        RECIPE,
        "AdamW's fused kernel (auto: where torch has it; no: torch's default kernel, foreach on GPUs and the for-loop on CPUs)",
        ("--fused-adamw",),
    ),
    "attn_implementation": (RECIPE, "attention kernels (default: as the model loads)", ()),
    "compile": (RECIPE, "torch.compile the model for training (compilation counts in the run's time)", ()),
}
CHOICES = {
    "optimizer": training.OPTIMIZERS,
    "comm_hook": COMM_HOOKS,
    "attn_implementation": training.ATTENTION,
}
TRI_STATE = {"auto": None, "yes": True, "no": False}  # a bool | None field's flag values


@dataclass
class RunConfig:
    """Everything one run of the command is told: its own settings, and the loop's ``TrainConfig``."""

    model: str | None = None  # None: the COURSE_MODEL switch (embedded by default)
    dataset: str | None = None  # None: the COURSE_DATASET switch; "embedded" or "hub"
    precision: str | None = None  # "no" | "bf16" | "fp16" | "auto"; None: the launcher's setting, else "no"
    batch_size: int = 16  # per process: the global batch is batch_size x processes x grad_accum_steps
    train_rows: int | None = None  # first N training rows; None: all
    eval_rows: int | None = None  # first N validation rows; None: all
    max_length: int = 128
    output_dir: str = "runs/train"
    save_every: int = 100  # optimizer steps between checkpoints (and always at the end)
    keep_checkpoints: int = 2
    resume: str | None = None  # "latest" / "auto" (in output_dir) or a checkpoint folder
    stop_after_steps: int | None = None  # simulate a crash after this step (tests, lessons)
    stop_rank: int | None = None  # with stop_after_steps: only this rank dies; None: every rank
    cpu: bool = False
    padding: str = "dynamic"  # "dynamic" (each batch to its longest row) | "max_length" (all to max_length)
    pad_multiple: int | None = (
        None  # dynamic padding rounded up to a multiple of this; None: 8 under fp16/bf16
    )
    group_by_length: bool = False  # batches of similar lengths (one process)
    train: training.TrainConfig = field(default_factory=training.TrainConfig)  # the loop's settings

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_length", "save_every", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")
        if self.stop_rank is not None and (self.stop_rank < 0 or self.stop_after_steps is None):
            raise ValueError("--stop-rank needs --stop-after-steps and a rank >= 0.")
        for name in ("train_rows", "eval_rows", "stop_after_steps"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (or left out), got {value}.")
        local_sgd_steps = self.train.local_sgd_steps
        if local_sgd_steps and self.save_every % local_sgd_steps:
            raise ValueError(
                f"--save-every {self.save_every} is not a multiple of --local-sgd-steps {local_sgd_steps}: "
                "a checkpoint must hold the averaged parameters. Pick --save-every as a multiple of it."
            )
        if self.precision not in (None, "auto"):
            self.precision = normalize_precision(self.precision)
        if self.padding not in ("dynamic", "max_length"):
            raise ValueError(f"--padding must be 'dynamic' or 'max_length', got {self.padding!r}.")
        if self.pad_multiple is not None and (self.pad_multiple < 1 or self.padding != "dynamic"):
            raise ValueError("--pad-multiple needs --padding dynamic and a value >= 1.")

    def as_dict(self) -> dict[str, Any]:
        """The command's settings and the loop's, in one flat dict (``metrics.json``, checkpoints)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "train"}
        return {**own, **asdict(self.train)}


def _flag(name: str) -> str:
    """The flag a ``TrainConfig`` field is set by (the first of its flags)."""
    return (TRAIN_FLAGS[name][2] or (f"--{name.replace('_', '-')}",))[0]


def _flags_in(message: str) -> str:
    """A ``TrainConfig`` error message in the command's words: each field name as its flag."""
    for name in sorted(TRAIN_FLAGS, key=len, reverse=True):
        # longest first, and not inside a word, a dotted name or a flag already written (--max-steps)
        message = re.sub(rf"(?<![\w.-]){name}(?!\w)", _flag(name), message)
    return message


def _or_none(kind):
    """An argparse type for an ``X | None`` field: a number, or 'none'."""

    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _add_train_options(parser: argparse.ArgumentParser) -> dict[str | None, Any]:
    """One flag per ``TRAIN_FLAGS`` field, its type, default and choices read from ``TrainConfig``;
    returns the argument groups by title."""
    hints, defaults = get_type_hints(training.TrainConfig), training.TrainConfig()
    groups: dict[str | None, Any] = {None: parser}
    for name, (group, help_text, flags) in TRAIN_FLAGS.items():
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        kind, default = hints[name], getattr(defaults, name)
        flags = flags or (f"--{name.replace('_', '-')}",)
        add = groups[group].add_argument
        if kind is bool:
            # a field that defaults to True gets a --no-... flag that stores False
            add(*flags, dest=name, action="store_false" if default else "store_true", help=help_text)
        elif kind == bool | None:  # auto / yes / no
            add(*flags, dest=name, default="auto", choices=list(TRI_STATE), help=help_text)
        else:
            base = next(t for t in get_args(kind) or (kind,) if t is not type(None))
            choices = list(CHOICES[name]) if name in CHOICES else None
            # 'none' only where it is not the default (--max-grad-norm none); a None default: leave it out
            parse = base if choices or base is str or default is None else _or_none(base)
            add(*flags, dest=name, type=parse, default=default, choices=choices, help=help_text)
    return groups


def parse_args(argv: list[str] | None = None) -> RunConfig:
    """The command line as a ``RunConfig`` (bad values exit with status 2 and say what to do)."""
    d = RunConfig()
    p = argparse.ArgumentParser(
        prog="python -m course_lib.cli.train",
        description="Fine-tune the course model with the course's training loop, on 1 or N processes.",
    )
    p.add_argument("--model", default=d.model, help="hub id or folder (default: COURSE_MODEL / embedded)")
    p.add_argument(
        "--dataset", default=d.dataset, choices=["embedded", "hub"], help="default: COURSE_DATASET"
    )
    p.add_argument(
        "--precision",
        default=d.precision,
        help="no (fp32), bf16, fp16 (GPU only) or auto (default: accelerate launch's --mixed_precision, else no)",
    )
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    p.add_argument(
        "--train-rows", type=int, default=d.train_rows, help="first N training rows (default: all)"
    )
    p.add_argument(
        "--eval-rows", type=int, default=d.eval_rows, help="first N validation rows (default: all)"
    )
    p.add_argument("--max-length", type=int, default=d.max_length, help="tokens per sentence pair")
    p.add_argument("--output-dir", default=d.output_dir, help="checkpoints, final model, metrics.json")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N optimizer steps")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints, help="newest N are kept")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from a checkpoint folder, or the newest one in --output-dir (no value / 'latest'); "
        "'auto': the newest one if there is one, else start at step 0 (for torchrun --max-restarts)",
    )
    p.add_argument(
        "--stop-after-steps",
        type=int,
        default=None,
        help="exit with status 3 after step N, as if killed (not in a group torchrun restarted, nor in a resumed run)",
    )
    p.add_argument(
        "--stop-rank", type=int, default=None, help="with --stop-after-steps: only this rank exits"
    )
    p.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs are present")
    recipe = _add_train_options(p)[RECIPE]
    recipe.add_argument(
        "--padding",
        default=d.padding,
        choices=["dynamic", "max_length"],
        help="dynamic: each batch to its longest row; max_length: every batch to --max-length (the slides)",
    )
    recipe.add_argument(
        "--pad-multiple", type=int, default=d.pad_multiple, help="round dynamic padding up to a multiple of N"
    )
    recipe.add_argument(
        "--group-by-length", action="store_true", help="batches of similar lengths (one process only)"
    )
    args = vars(p.parse_args(argv))
    train_args = {name: args.pop(name) for name in TRAIN_FLAGS}  # what is left: RunConfig's own fields
    if "fused_optimizer" in train_args:
        train_args["fused_optimizer"] = TRI_STATE[train_args["fused_optimizer"]]
    try:
        return RunConfig(**args, train=training.TrainConfig(**train_args))
    except ValueError as err:
        p.error(_flags_in(str(err)))  # exits with status 2
        raise  # unreachable
