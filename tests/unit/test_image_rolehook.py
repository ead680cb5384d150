"""The image's start-up hook: which interpreter command lines are Dask roles (and so go through the entrypoint), and
that its .pth line stays out of every other process's way. The hook run at a real interpreter's start-up, with the
launcher forms, is in tests/integration/test_launcher_forms.py."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ucx_dask_gpu.image import entrypoint, rolehook

PY = "/opt/venv/bin/python3"


@pytest.mark.parametrize("orig, command", [
    ([PY, "-m", "dask_cuda.cli", "ucx://s:8786"], [sys.executable, "-m", "dask_cuda.cli", "ucx://s:8786"]),
    ([PY, "-u", "-X", "dev", "-m", "distributed.cli.dask_worker", "tcp://s:1", "--nanny"],
     [sys.executable, "-m", "distributed.cli.dask_worker", "tcp://s:1", "--nanny"]),
    ([PY, "-m", "distributed.cli.dask_scheduler"], [sys.executable, "-m", "distributed.cli.dask_scheduler"]),
    ([PY, "-m", "dask", "worker", "tcp://s:1"], ["dask", "worker", "tcp://s:1"]),
    # console scripts: the interpreter of the shebang, then the script's path
    ([PY, "/opt/venv/bin/dask", "cuda", "worker", "ucx://s:1"], ["dask", "cuda", "worker", "ucx://s:1"]),
    ([PY, "/opt/venv/bin/dask-cuda-worker", "ucx://s:1"], ["dask-cuda-worker", "ucx://s:1"]),
    ([PY, "/opt/venv/bin/dask-scheduler", "--port", "8786"], ["dask-scheduler", "--port", "8786"]),
    # not roles: no command, or another one
    ([PY, "-m", "ucx_dask_gpu.image.entrypoint", "dask", "worker"], None),
    ([PY, "-c", "import dask"], None),
    ([PY, "/home/u/my_dask_job.py"], None),
    ([PY, "/opt/venv/bin/ucx-dask-gpu", "workload", "transpose"], None),
    ([PY], None),
    ([PY, "-u"], None),
    ([PY, "-m"], None),
    ([PY, "-", "dask"], None),
])
def test_the_command_lines_of_dask_roles(orig, command):
    assert rolehook.role_command(orig) == command
    if command is not None:  # what the entrypoint takes (`dask info` and friends are sorted out there)
        assert entrypoint.classify(command).kind in entrypoint.DASK_KINDS


def test_install_writes_the_line_site_runs(tmp_path):
    path = rolehook.install(tmp_path)
    assert path == tmp_path / rolehook.ROLE_HOOK_PTH
    line = path.read_text()
    assert line.startswith("import ") and line.count("\n") == 1  # site executes lines that start with `import`
    assert entrypoint.ROLE_CHECKED_ENV in line


@pytest.mark.parametrize("extra, imported", [([], False), (["dask-not-a-role"], True),
                                             (["-m", "ucx_dask_gpu.image.entrypoint", "dask", "worker"], False)])
def test_the_line_imports_nothing_for_other_processes_and_lets_non_roles_run(tmp_path, extra, imported):
    """A real interpreter that processes the .pth (site.addsitedir, as at start-up): no word with "dask" in its
    command line, nothing of ours is imported; one with it, but no role, goes on unchanged."""
    rolehook.install(tmp_path)
    # (the code must not name our package: it is part of the command line the line looks at)
    code = (f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
            "print('ran', any(m.startswith('ucx_') for m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *extra], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != entrypoint.ROLE_CHECKED_ENV})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["ran", str(imported)]
