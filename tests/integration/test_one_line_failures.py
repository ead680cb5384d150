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


def test_a_ucx_worker_at_a_tcp_scheduler_is_one_line_per_attempt_in_the_schedulers_log(procs, shipped_config,
                                                                                        tmp_path):
    """UCX's bytes at a tcp listener: dask logged "Failed to deserialize" and tornado the same error, each with a
    traceback, at every retry (12 tracebacks). The shipped preloads (quietclose) make it one warning line each."""
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env)
    try:
        worker = procs.start_worker(tmp_path, env, address.replace("tcp://", "ucx://"), "ucx-worker",
                                    extra_args=("--death-timeout", "12"))
        assert worker.wait(90) != 0
    finally:
        sched.stop()
    text = sched.text()
    assert "Traceback" not in text, text[-3000:]
    assert "a peer connected that does not speak Dask's protocol" in text, text[-3000:]
