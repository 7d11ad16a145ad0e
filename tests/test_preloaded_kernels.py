"""tests/preloaded_kernels.py, the fixture matrix's kernels: each notebook in a process of its own that
behaves like a fresh kernel where the matrix can tell (progress bars, threads, globals, the time limit)."""

import os

import nbformat
import pytest
from preloaded_kernels import NOT_PRELOADED, PreloadServer

from course_lib.cli.check import execute_copy

ENV = {"OMP_NUM_THREADS": "1"}
PROBE = """
import os, sys
import torch
from tqdm.auto import tqdm
bar = "notebook" if any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__) else "console"
print(os.getpid(), os.getppid(), torch.get_num_threads(), bar, "secret" in globals(), os.getcwd())
secret = 1
"""


def _outputs(nb) -> list[str]:
    return [o.get("text", "") + o.get("evalue", "") for c in nb.cells for o in c.get("outputs", [])]


def _probe(tmp_path, name: str, km=None, env=ENV, cells=(PROBE,), timeout: int = 30):
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells]), path)
    return execute_copy(path, timeout=timeout, env=env, km=km)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = PreloadServer(tmp_path_factory.mktemp("preload"), env=ENV)
    yield server
    server.close()


@pytest.mark.slow  # starts the server (torch imported) and three kernels
def test_a_preloaded_kernel_is_a_fresh_process_that_sees_what_a_fresh_kernel_sees(server, tmp_path):
    env = {**ENV, **server.kernel_env}
    fresh = _outputs(_probe(tmp_path, "fresh"))[0].split()
    first = _outputs(_probe(tmp_path, "first", server.kernel_manager(), env))[0].split()
    second = _outputs(_probe(tmp_path, "second", server.kernel_manager(), env))[0].split()
    assert first[1] == second[1] == str(server.process.pid)  # forked from the server ...
    assert len({first[0], second[0], str(server.process.pid), str(os.getpid())}) == 4  # ... each its own
    for probe in (first, second):
        # one OpenMP thread, the notebook progress bar (not stderr), no globals left by another notebook,
        # and the notebook's temporary folder as working directory: as in the fresh kernel
        assert probe[2:5] == fresh[2:5] == ["1", "notebook", "False"], (probe, fresh)
        assert "course-check-" in probe[5]


@pytest.mark.slow
def test_the_time_limit_interrupts_a_preloaded_kernel_and_the_next_cell_runs(server, tmp_path):
    nb = _probe(
        tmp_path,
        "runaway",
        server.kernel_manager(),
        {**ENV, **server.kernel_env},
        cells=("import time\nwhile True:\n    time.sleep(0.01)", "print('after')"),
        timeout=3,
    )
    assert nb.cells[0].outputs[-1]["ename"] in ("KeyboardInterrupt", "CellTimeoutError")  # interrupted
    assert _outputs(nb)[-1] == "after\n"


def test_the_server_refuses_to_preload_what_looks_at_its_surroundings(tmp_path):
    assert "tqdm.auto" in NOT_PRELOADED and "transformers" in NOT_PRELOADED
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text("import tqdm.auto\n")  # as if PRELOAD imported it
    env = {"PYTHONPATH": os.pathsep.join([str(planted), os.environ.get("PYTHONPATH", "")])}
    with pytest.raises(RuntimeError, match=r"PRELOAD imported \['tqdm.auto'"):
        PreloadServer(tmp_path / "server", env=env)
