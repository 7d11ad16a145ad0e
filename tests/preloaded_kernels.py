"""Jupyter kernels forked from one process that has already imported torch.

The fixture matrix of tests/test_grading.py runs about 40 notebooks, each in a fresh kernel; a fresh
kernel spends about 5 CPU-seconds importing torch, transformers' Trainer, datasets and accelerate
before its first cell does any work, a large part of each notebook's time on 2 cores. Here one
*server* process imports torch and what else is safe (PRELOAD) once and forks a kernel per notebook:
each notebook still gets a process of its own (its own globals, its own torch state), only the
imported modules are shared, copy-on-write.

    server = PreloadServer(folder, env={"OMP_NUM_THREADS": "1"})   # imports once (a few seconds)
    km = server.kernel_manager()                                   # a jupyter_client AsyncKernelManager
    NotebookClient(nb, km=km).execute(env={**os.environ, **server.kernel_env})  # a fork of the server
    server.close()

How: the kernelspec's command is this file run as a small *launcher*; jupyter_client starts it with
the connection file as usual. The launcher sends the connection file, its environment and working
directory to the server over a Unix socket; the server forks, the child becomes an ipykernel on that
connection file, and the launcher waits until the server says the child has exited, then exits with
its status. The launcher forwards an interrupt (SIGINT) to its kernel; if the launcher is killed,
the server kills its kernel.

The server forks from a single thread (no thread of its own; it reaps children on SIGCHLD), the
kernels' environment is the launcher's, and the server itself starts with the matrix's environment
(one OpenMP thread), because OpenMP reads it when torch is imported. Only for the matrix: the
autograder (nbgrader) and the learner's self-check start their kernels the ordinary way, and the
headroom test reads set-up cell times from the nbgrader cycle, whose kernels import everything.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
from pathlib import Path

# What every assignment's kernel imports first, and that is the same whether or not it is imported
# inside a kernel: torch and the torch submodules transformers pulls in (about 3 of the 5 CPU-seconds),
# ipykernel itself, the tokenizer and safetensors bindings.
PRELOAD = (
    "torch",
    "torch._dynamo",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.export",
    "torch.fx.experimental.symbolic_shapes",
    "sympy",
    "numpy",
    "safetensors.torch",
    "tokenizers",
    "ipykernel.kernelapp",
    "ipykernel.ipkernel",
)
# Not preloaded, because they look at their surroundings when imported: transformers and datasets
# import tqdm.auto, which picks the notebook progress bar (a widget) inside a kernel and the console one
# (stderr, which costs a test cell its points) outside; matplotlib.pyplot picks its backend; pyarrow
# (under datasets) starts an allocator thread, and the server must fork from a single thread of its own.
NOT_PRELOADED = ("tqdm.auto", "tqdm.autonotebook", "matplotlib.pyplot", "transformers", "datasets", "pyarrow")
KERNEL_NAME = "course-preloaded"


def _send(sock: socket.socket, message: dict) -> None:
    sock.sendall(json.dumps(message).encode() + b"\n")


def _receive(sock: socket.socket) -> dict | None:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


# ------------------------------------------------------------------------------------------ server


def _become_kernel(request: dict) -> None:
    """In the forked child: the launcher's environment and folder, then an ipykernel on its file."""
    os.setsid()  # [fork] its own session: a signal to the server's group does not reach it
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):
        os.dup2(log, fd)  # the kernel's own stdout/stderr (its outputs go over ZMQ)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch

    if threads := os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(threads))
    from ipykernel.kernelapp import IPKernelApp

    sys.argv = [sys.executable, "-f", request["connection_file"]]
    IPKernelApp.launch_instance(argv=["-f", request["connection_file"]])


def serve(path: str) -> None:
    """Import PRELOAD, then fork a kernel for each launcher that connects to the socket at ``path``."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    if leaked := [name for name in NOT_PRELOADED if name in sys.modules]:
        print(f"PRELOAD imported {leaked}, which must be imported inside each kernel", flush=True)
        sys.exit(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # [reap] wakes the select loop through wake_w
    kernels: dict[int, socket.socket] = {}  # pid -> the launcher's connection
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_r, *kernels.values()], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if (conn := kernels.pop(pid, None)) is not None:
                    try:
                        _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    except OSError:
                        pass
                    conn.close()
        for pid, conn in list(kernels.items()):
            if conn in readable:  # [orphan] the launcher went away (killed): so does its kernel
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if listener in readable:
            conn, _ = listener.accept()
            request = _receive(conn)
            if request is None:
                conn.close()
            elif request.get("stop"):
                for pid in kernels:
                    os.kill(pid, signal.SIGKILL)
                return
            else:
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    conn.close()
                    try:
                        _become_kernel(request)
                        code = 0
                    except SystemExit as done:
                        code = done.code if isinstance(done.code, int) else 1
                    except BaseException:
                        import traceback

                        traceback.print_exc()
                        code = 1
                    os._exit(code)
                kernels[pid] = conn
                _send(conn, {"pid": pid})


# ---------------------------------------------------------------------------------------- launcher


def launch(connection_file: str) -> int:
    """The kernelspec's command: ask the server for a kernel on ``connection_file``; wait for its end."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ["COURSE_PRELOAD_SOCKET"])
    env = {k: v for k, v in os.environ.items() if k != "COURSE_PRELOAD_SOCKET"}
    log = str(Path(connection_file).with_suffix(".log"))
    _send(conn, {"connection_file": connection_file, "env": env, "cwd": os.getcwd(), "log": log})
    started = _receive(conn)
    if started is None:
        print("the preloaded-kernel server closed the connection", file=sys.stderr)
        return 1
    # SIGINT (jupyter_client's interrupt, sent to this process's group): to the kernel, which raises
    # KeyboardInterrupt in the running cell. SIGTERM (shutdown after a timeout): exit; the server then
    # kills the kernel.
    signal.signal(signal.SIGINT, lambda *_: os.kill(started["pid"], signal.SIGINT))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    ended = _receive(conn)
    if ended and ended["exit"] == 0:
        Path(log).unlink(missing_ok=True)  # kept only when the kernel failed
    return ended["exit"] if ended else 1


class PreloadServer:
    """The server process, its socket and its kernelspec, in ``folder``."""

    def __init__(self, folder: Path, env: dict[str, str] | None = None, timeout: float = 120):
        folder.mkdir(parents=True, exist_ok=True)
        self.socket = str(folder / "preload.sock")
        self.env = {**os.environ, **(env or {})}
        spec = folder / "kernels" / KERNEL_NAME
        spec.mkdir(parents=True, exist_ok=True)
        (spec / "kernel.json").write_text(
            json.dumps(
                {
                    "argv": [sys.executable, __file__, "launch", "{connection_file}"],
                    "display_name": "Python 3 (preloaded)",
                    "language": "python",
                    "interrupt_mode": "signal",
                }
            )
        )
        self.kernel_dirs = [str(folder / "kernels")]
        self.process = subprocess.Popen(
            [sys.executable, __file__, "serve", self.socket],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        # "ready" once PRELOAD is imported; an import that hangs fails here instead of the whole run
        started, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if started else ""
        if line.strip() != "ready":
            if self.process.poll() is None:
                self.process.kill()
            rest = self.process.stdout.read()
            raise RuntimeError(f"the preloaded-kernel server did not start within {timeout} s: {line}{rest}")

    @property
    def kernel_env(self) -> dict[str, str]:
        """What a kernel's environment needs on top of the usual: where the launcher finds the server."""
        return {"COURSE_PRELOAD_SOCKET": self.socket}

    def kernel_manager(self):
        """A kernel manager whose kernels are forks of the server (their env needs ``kernel_env``).

        Asynchronous, as the one nbclient makes itself: with a blocking KernelManager, nbclient's
        interrupt at the time limit hangs."""
        from jupyter_client import AsyncKernelManager
        from jupyter_client.kernelspec import KernelSpecManager

        ksm = KernelSpecManager(kernel_dirs=self.kernel_dirs, ensure_native_kernel=False)
        return AsyncKernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conn.connect(self.socket)
                _send(conn, {"stop": True})
                conn.close()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "launch":
        sys.exit(launch(sys.argv[2]))
