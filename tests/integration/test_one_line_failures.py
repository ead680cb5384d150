"""Failures a user meets on a workstation end in one line with their documented exit code, and a computed result is
never lost (docs/exit-codes.md)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import RESULT_KEPT, WORKLOAD_FAILED

pytestmark = pytest.mark.integration


def workload(env, *args, stdout=subprocess.PIPE):
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "workload", *args], env=env, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=300)


def test_a_result_printed_to_a_full_stdout_is_kept_and_the_line_says_where(procs, tmp_path):
    with open("/dev/full", "w") as full:
        proc = workload(procs.env_for(tmp_path, None), "transpose", "--size", "1000", "--chunk", "500", stdout=full)
    lines = proc.stderr.splitlines()
    assert proc.returncode == RESULT_KEPT and len(lines) == 1, lines
    kept = re.search(r"kept at (\S+)$", lines[0])
    assert kept and "could not be written to stdout (No space left on device)" in lines[0]
    result = json.loads(Path(kept[1]).read_text())
    Path(kept[1]).unlink()
    assert result["ok"] and result["size"] == 1000


def test_cupy_workers_without_a_gpu_are_one_line(procs, tmp_path):
    if Path("/dev/nvidiactl").exists():
        pytest.skip("this host has a GPU driver: the cupy workload would run")
    proc = workload(procs.env_for(tmp_path, None), "transpose", "--backend", "cupy", "--size", "1000",
                    "--chunk", "500")
    lines = proc.stderr.splitlines()
    assert proc.returncode == WORKLOAD_FAILED and len(lines) == 1, lines
    assert lines[0].startswith("ucx-dask-gpu workload: error: transpose failed on the cluster: ")
