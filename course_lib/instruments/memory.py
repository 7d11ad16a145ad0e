"""Memory of training, each quantity defined once: peak tensor memory, bytes saved for backward,
optimizer-state bytes, model states, and the bytes of any tensors.

* ``TensorPeak`` / ``tensor_peak_mb``: start it, run one training step, stop it: the peak of tensor
  bytes allocated in between, above what was allocated at the start (activations, gradients, optimizer
  state, autocast copies). CUDA: the caching allocator's peak (``torch.cuda.max_memory_allocated``).
  CPU: the running sum of the allocations ``torch.profiler`` records (there is no allocator counter).
  Same quantity on both, so lessons and the benchmark compare like with like. NaN on other devices (MPS).
* ``SavedTensors`` / ``saved_tensor_bytes``: what autograd saves for backward (``saved_tensors_hooks``).
* ``optimizer_state_bytes`` (``optimizer_state_bytes_by_key``): what an optimizer keeps between steps.
* ``model_state_bytes``: weights, gradients and optimizer state; ``tensor_bytes``: elements x bytes.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch

from course_lib.devices import get_device

MIB = 2**20  # bytes in a mebibyte, the unit the lessons' tables print


@contextmanager
def _quiet_stderr_fd():
    """Silence C-level stderr (the profiler's log lines) inside the block; Python's stays as is."""
    try:
        saved = os.dup(2)
    except OSError:  # no real fd 2 (some embedded interpreters)
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)  # fd 2 itself: the profiler's C++ writes bypass sys.stderr
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_PROFILER_NOISE = re.compile(
    r"profiler results will not|the profiling started|include the deallocation event|"
    r"ActivityProfiler|^\s*(STAGE|USDT|INFO|WARNING):"
)


def _python_stderr_is_fd2() -> bool:
    """True in a plain script (Python's stderr is fd 2); False under Jupyter, whose stderr is a stream."""
    try:
        return sys.stderr.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


class _StderrFdCapture:
    """Collect what C/C++ code writes to fd 2 into a temporary file; replay the useful lines later."""

    def __init__(self) -> None:
        self._saved: int | None = None
        self._file = None

    def start(self) -> None:
        self.stop()
        self._file = tempfile.TemporaryFile()
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)

    def stop(self) -> None:
        """Restore fd 2 and write what was captured, minus the profiler's own log lines, to stderr."""
        if self._saved is None:
            return
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._saved = None
        self._file.seek(0)
        text = self._file.read().decode(errors="replace")
        self._file.close()
        kept = [line for line in text.splitlines() if line.strip() and not _PROFILER_NOISE.search(line)]
        if kept:
            print("\n".join(kept), file=sys.stderr)


_CAPTURE = _StderrFdCapture()  # one per process: a new probe ends a capture a failed loop left open
_ACTIVE_PROFILER: list = []  # the profiler of a probe whose first step has not ended (at most one)


def _stop_active_profiler() -> None:
    """Stop a profiler that a loop which failed before its first ``tick()`` left running."""
    while _ACTIVE_PROFILER:
        with _quiet_stderr_fd():
            _ACTIVE_PROFILER.pop().stop()
    _CAPTURE.stop()


def _peak_from_profiler(prof) -> float:
    """Peak of the running sum of CPU tensor allocations recorded by ``prof`` (bytes above the start)."""
    events = prof.profiler.kineto_results.events()
    mem = sorted(
        (e.start_ns(), e.nbytes())  # a free is an event with negative nbytes
        for e in events
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
    )
    current = peak = 0
    for _, nbytes in mem:
        current += nbytes
        peak = max(peak, current)  # current: bytes live above the start
    return float(peak)


class TensorPeak:
    """Peak tensor memory (MiB) between ``start()`` and ``stop()``, above what was allocated at start."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = get_device(device) if not isinstance(device, torch.device) else device
        self._prof = None
        self._base = 0

    def start(self) -> None:
        _stop_active_profiler()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # queued kernels may still allocate: let them finish
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _quiet_stderr_fd():
                self._prof.start()
            _ACTIVE_PROFILER.append(self._prof)
            if not _python_stderr_is_fd2():  # Jupyter: keep the profiler's C++ log lines out of the cell
                _CAPTURE.start()  # also ends a capture a failed loop left open

    def stop(self) -> float:
        """The peak in MiB (NaN where the device has no counter)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            # above what was live at start()
            return (torch.cuda.max_memory_allocated(self.device) - self._base) / 2**20
        if self._prof is None:
            return float("nan")
        _stop_active_profiler()
        peak = _peak_from_profiler(self._prof) / 2**20
        self._prof = None
        return peak


def tensor_peak_mb(fn: Callable[[], object], device=None) -> float:
    """``TensorPeak`` around one call of ``fn()``."""
    peak = TensorPeak(device)
    peak.start()
    try:
        fn()
    finally:
        mb = peak.stop()
    return mb


class SavedTensors:
    """Bytes autograd saves for backward inside the block, per dtype (``saved_tensors_hooks``).

    Every tensor an operation packs for its backward passes through the hook; a storage packed by
    several operations (or a parameter saved as-is) is counted once. Under gradient checkpointing the
    checkpointed regions save (almost) nothing: that is the memory checkpointing saves. With
    ``keep=True`` the packed tensors themselves are kept too, in packing order (``tensors``), for a
    caller that asks which tensors were saved (lesson 03: autocast's cached 16-bit weight copies).

        with SavedTensors() as saved:
            loss = model(**batch).loss
        saved.bytes, saved.by_dtype
    """

    def __init__(self, keep: bool = False) -> None:
        self.by_dtype: dict[str, int] = {}
        self.tensors: list[torch.Tensor] = []
        self._keep = keep
        self._seen: set[int] = set()
        self._hooks = None

    @property
    def bytes(self) -> int:
        return sum(self.by_dtype.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._keep:
            self.tensors.append(t)
        key = t.untyped_storage().data_ptr()
        if key not in self._seen:  # held alive until backward, so no address is reused meanwhile
            self._seen.add(key)
            dtype = str(t.dtype).removeprefix("torch.")
            self.by_dtype[dtype] = self.by_dtype.get(dtype, 0) + tensor_bytes([t])
        return t  # the tensor itself, no copy: memory and backward stay as without the hook

    def __enter__(self) -> SavedTensors:
        # unpack: the tensor as packed
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_tensor_bytes(fn: Callable[[], object]) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs (``SavedTensors`` around one call)."""
    with SavedTensors() as saved:
        fn()
    return saved.bytes


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as they are: elements x bytes per element of each, summed."""
    return sum(t.numel() * t.element_size() for t in tensors)


def optimizer_state_bytes_by_key(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """``optimizer_state_bytes`` per state key (``exp_avg``, ``state1``, ...), in the order first seen."""
    counted, seen = {}, set()
    for state in optimizer.state.values():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor) or key == "step":
                continue
            storage = (str(value.device), value.untyped_storage().data_ptr())
            if value.numel() and storage in seen:  # bitsandbytes' qmap1/qmap2 are shared by all parameters
                continue
            seen.add(storage)
            counted[key] = counted.get(key, 0) + tensor_bytes([value])
    return counted


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors an optimizer keeps between steps (``optimizer.state``), step counters excluded.

    The state is created lazily: before the first ``step()`` this is 0. AdamW keeps two fp32 tensors
    per parameter (8 bytes per parameter); an 8-bit AdamW two uint8 tensors plus per-block scales and
    two quantisation maps that all its parameters share (a storage shared by several entries is
    counted once). Step counters (a 0-d tensor per parameter in torch, a Python int in bitsandbytes)
    are left out.
    """
    return sum(optimizer_state_bytes_by_key(optimizer).values())


def model_state_bytes(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, int]:
    """Bytes of the model states after a step: weights, gradients (``.grad``) and ``optimizer_state_bytes``.

    What ZeRO calls the model states, read from the tensors as they are (dtype included), not from a
    bytes-per-parameter formula. Gradients set to None count 0; without ``optimizer`` its state is 0.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    return {
        "weights": tensor_bytes(params),
        "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
        "optimizer state": optimizer_state_bytes(optimizer) if optimizer is not None else 0,
    }
