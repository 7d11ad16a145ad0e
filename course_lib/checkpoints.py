"""Checkpoints of a (distributed) training run: safetensors for tensors, JSON for the rest.

Written atomically by the main process (``_write_atomically``): a killed run never leaves a
half-written checkpoint. A checkpoint holds the model, the optimizer state, the GradScaler's state,
the step, every rank's RNG state and the run's configuration, so ``--resume`` continues to the same
final parameters as an uninterrupted run (``course_lib.training.resume``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from course_lib.devices import seed_everything
from course_lib.training import fsdp

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")
NESTED = "/"  # joins a nested state entry's keys in an optimizer file (bitsandbytes' quantisation state)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """``<output_dir>/checkpoint-<step>``."""
    # zero-padded: the folders sort by step in a listing too
    return Path(output_dir) / f"checkpoint-{step:06d}"


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in ``output_dir`` as ``(step, folder)``, oldest first."""
    root = Path(output_dir)
    found = []
    if root.is_dir():
        for child in root.iterdir():
            match = CHECKPOINT_RE.match(child.name)
            if match and (child / "state.json").is_file():  # state.json: a folder this code wrote
                found.append((int(match.group(1)), child))
    return sorted(found)


def find_resume_checkpoint(resume: str | None, output_dir: str | Path) -> Path | None:
    """The folder ``--resume`` points at (None without ``--resume``); a clear error if there is none.

    ``"latest"``: the newest complete checkpoint in ``output_dir``; ``"auto"``: the same, or None when
    there is none yet (a job that torchrun may restart: the first attempt starts at step 0)."""
    if resume is None:
        return None
    if resume in ("latest", "auto"):
        found = list_checkpoints(output_dir)
        if not found and resume == "auto":
            return None
        if not found:
            raise FileNotFoundError(
                f"--resume: no checkpoint in {output_dir}. Start without --resume, or pass "
                "--output-dir of the run to continue (or a checkpoint folder: --resume DIR)."
            )
        return found[-1][1]
    path = Path(resume)
    if not (path / "state.json").is_file():
        raise FileNotFoundError(
            f"--resume {path}: not a checkpoint folder (no state.json). Pass a checkpoint-NNNNNN folder "
            "written by this command, or --resume alone for the newest one in --output-dir."
        )
    return path


def _cpu_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with its tensors on the CPU (to gather it from another rank)."""
    state = optimizer.state_dict()
    return {
        "state": {
            i: {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in values.items()}
            for i, values in state["state"].items()
        },
        "param_groups": state["param_groups"],
    }


def save_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """The optimizer's state as safetensors: tensors as such, the param groups as JSON metadata."""
    save_optimizer_state(optimizer.state_dict(), path)


def save_optimizer_state(state: dict, path: Path) -> None:
    """An optimizer ``state_dict`` as safetensors (see ``save_optimizer``)."""
    from safetensors.torch import save_file

    tensors, other = {}, {}
    for index, values in state["state"].items():
        # One level of nesting: bitsandbytes keeps its 8-bit quantisation state in a dict per parameter.
        flat = {
            f"{key}{NESTED}{sub}" if isinstance(value, dict) else key: v
            for key, value in values.items()
            for sub, v in (value.items() if isinstance(value, dict) else [(None, value)])
        }
        for key, value in flat.items():
            if torch.is_tensor(value):
                tensors[f"state.{index}.{key}"] = value.detach().cpu().clone()  # shared (bnb qmaps): copies
            else:
                other[f"{index}.{key}"] = value
    metadata = {"param_groups": json.dumps(state["param_groups"]), "other": json.dumps(other)}
    save_file(tensors, str(path), metadata=metadata)


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Inverse of ``save_optimizer``."""
    optimizer.load_state_dict(read_optimizer_state(path))


def read_optimizer_state(path: Path) -> dict:
    """The optimizer ``state_dict`` that ``save_optimizer_state`` wrote to ``path``."""
    from safetensors import safe_open

    state: dict[int, dict[str, Any]] = {}

    def put(index: str, key: str, value) -> None:
        values = state.setdefault(int(index), {})
        if NESTED in key:
            key, sub = key.split(NESTED, 1)
            values.setdefault(key, {})[sub] = value
        else:
            values[key] = value

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        for name in f.keys():
            _, index, key = name.split(".", 2)  # "state.<index>.<key>"; maxsplit: a key may hold dots
            put(index, key, f.get_tensor(name))
    for name, value in json.loads(metadata["other"]).items():
        put(*name.split(".", 1), value)
    return {"state": state, "param_groups": json.loads(metadata["param_groups"])}


def _by_position(state: dict) -> dict:
    """A full FSDP optimizer state (keyed by parameter name) keyed by position instead, as DDP's is;
    the param groups keep the names, so ``_by_name`` can undo it."""
    position = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
    return {
        "state": {position[n]: v for n, v in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def _by_name(state: dict, path: Path) -> dict:
    names = [n for g in state["param_groups"] for n in g["params"]]
    if not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"{path} holds the optimizer state of a run without --fsdp (parameters by position, not by "
            "name): resume it without --fsdp, or start the FSDP run afresh."
        )
    return {"state": {names[i]: v for i, v in state["state"].items()}, "param_groups": state["param_groups"]}


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    """A model state dict for ``save_file``: contiguous copies (tied weights share no storage then)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}


def rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's torch RNG state (CPU, and CUDA on a GPU): dropout continues exactly on resume."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _write_atomically(final: Path, write) -> None:
    """Call ``write(tmp_folder)``, then rename the folder to ``final``: never a half-written ``final``."""
    tmp = final.parent / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    old = final.parent / f".old-{final.name}"
    if final.exists():  # the same step saved again (a resumed run): keep the old one until the new is in
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)  # os.replace cannot replace a non-empty folder: move it aside first
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model,
    optimizer,
    accelerator,
    config: dict,
    keep: int = 2,
    per_rank_optimizer: bool = False,
) -> Path:
    """Model, optimizer, scaler, step, every rank's RNG state and the run's ``config``; the newest
    ``keep`` checkpoints are kept. Written by the main process only; every rank must call it.

    ``per_rank_optimizer``: each rank's optimizer state is saved too (``optimizer-rank<r>``), for runs
    whose ranks keep different states (local SGD); DDP ranks hold identical states, saved once.
    """
    from accelerate.utils import gather_object
    from safetensors.torch import save_file, save_model

    if keep < 1:  # [:-0] below would keep every checkpoint
        raise ValueError(f"keep must be >= 1 (the newest checkpoints kept), got {keep}.")
    rngs = gather_object([rng_state(accelerator.device)])  # collective: every rank calls it
    states = gather_object([_cpu_state(optimizer)]) if per_rank_optimizer else []  # collective
    # FSDP: the full model and optimizer state, gathered on rank 0 (collective; any world size resumes it)
    sharded = fsdp.full_state(model, optimizer) if fsdp.is_sharded(model) else None
    final = checkpoint_dir(output_dir, step)
    if accelerator.is_main_process:

        def write(folder: Path) -> None:
            if sharded is None:
                save_model(model, str(folder / "model.safetensors"))
                save_optimizer(optimizer, folder / "optimizer.safetensors")
            else:
                save_file(_tensors(sharded[0]), str(folder / "model.safetensors"))
                save_optimizer_state(_by_position(sharded[1]), folder / "optimizer.safetensors")
            for rank, state in enumerate(states):
                save_optimizer_state(state, folder / f"optimizer-rank{rank}.safetensors")
            save_file(
                {f"rank{r}.{k}": v.cpu() for r, state in enumerate(rngs) for k, v in state.items()},
                str(folder / "rng.safetensors"),
            )
            scaler = accelerator.scaler.state_dict() if accelerator.scaler is not None else None
            state = {
                "step": step,
                "world_size": accelerator.num_processes,
                "scaler": scaler,
                "config": config,
            }
            (folder / "state.json").write_text(json.dumps(state, indent=1))

        _write_atomically(final, write)
        for _, old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()  # no rank goes on before the main process has written it
    return final


def load_checkpoint(path: Path, model, optimizer, accelerator) -> int:
    """Restore model, optimizer, scaler and this rank's RNG state from ``path``; return its step."""
    from safetensors import safe_open
    from safetensors.torch import load_file, load_model

    state = json.loads((path / "state.json").read_text())
    own = path / f"optimizer-rank{accelerator.process_index}.safetensors"
    same_world = state["world_size"] == accelerator.num_processes
    if fsdp.is_sharded(model):  # every rank reads the full state and keeps its shards
        optimizer_state = _by_name(read_optimizer_state(path / "optimizer.safetensors"), path)
        fsdp.load_full_state(model, optimizer, load_file(str(path / "model.safetensors")), optimizer_state)
    else:
        # read on the CPU; copied into the model's device
        load_model(model, str(path / "model.safetensors"), device="cpu")
        optimizer_state = read_optimizer_state(
            # local SGD: this rank's own state
            own if same_world and own.is_file() else path / "optimizer.safetensors"
        )
        if any(isinstance(n, str) for g in optimizer_state["param_groups"] for n in g["params"]):
            raise ValueError(
                f"{path} was written by an --fsdp run (parameters by name): resume it with --fsdp."
            )
        optimizer.load_state_dict(optimizer_state)
    if accelerator.scaler is not None and state.get("scaler"):
        accelerator.scaler.load_state_dict(state["scaler"])
    # one saved RNG state per rank: only a same-size run can take them
    if state["world_size"] == accelerator.num_processes:
        with safe_open(str(path / "rng.safetensors"), framework="pt") as f:
            prefix = f"rank{accelerator.process_index}."
            torch.set_rng_state(f.get_tensor(prefix + "cpu"))
            if accelerator.device.type == "cuda" and prefix + "cuda" in f.keys():
                torch.cuda.set_rng_state(f.get_tensor(prefix + "cuda"), accelerator.device)
    else:
        accelerator.print(
            f"note: {path} was written by {state['world_size']} process(es), this run has "
            f"{accelerator.num_processes}: training continues, but the data order and dropout differ "
            "from an uninterrupted run."
        )
        # a new stream, still reproducible from seed and step
        seed_everything(state["config"]["seed"] + state["step"])
    return int(state["step"])


def save_final_model(output_dir: str | Path, model, tokenizer, accelerator) -> Path:
    """``<output_dir>/final``: a Hugging Face folder ``course_lib.models.load_model`` can load."""
    final = Path(output_dir) / "final"
    full = fsdp.full_state(model, None)[0] if fsdp.is_sharded(model) else None  # collective under FSDP
    if accelerator.is_main_process:

        def write(folder: Path) -> None:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # a "Writing model shards" bar for one small file
            model.save_pretrained(folder, state_dict=full)
            tokenizer.save_pretrained(folder)

        _write_atomically(final, write)
    accelerator.wait_for_everyone()
    return final
