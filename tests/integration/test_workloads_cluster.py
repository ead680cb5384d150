"""The client workloads on real clusters: the CLI over tcp and UCX (UCXX over TCP on CPU hosts) with the shipped
dask config, column projection seen from the workers, and a worker killed mid-computation."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ucx_dask_gpu.gate import guard  # noqa: F401  the monitoring Client below sends its environment, as any must
from ucx_dask_gpu.proof import from_map, transpose


pytestmark = pytest.mark.integration


def workload(env, *args, timeout=300) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "workload", *args, "--json"], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


def numpy_transpose_sum(size: int, chunk: int, seed: int) -> float:
    sizes = transpose._chunk_sizes(size, chunk)
    x = np.block([[transpose._random_block(seed, i, j, (ri, rj)) for j, rj in enumerate(sizes)]
                  for i, ri in enumerate(sizes)])
    return float((x + x.T).sum())


@pytest.mark.parametrize("protocol", ["tcp", "ucx"])
def test_transpose_gives_the_numpy_answer(procs, protocol, shipped_config, tmp_path):
    result, stderr = workload(procs.env_for(tmp_path, shipped_config), "transpose", "--protocol", protocol,
                              "--size", "1200", "--chunk", "300", "--seed", "3")
    assert result["ok"] and result["protocol"] == protocol
    assert result["value"] == pytest.approx(numpy_transpose_sum(1200, 300, 3), rel=1e-9)
    assert result["versions_identical"] and result["workers_start"] == 2
    # Start-up and shutdown are clean: no tracebacks (UCX's own WARN lines about UCX_MEMTYPE_CACHE are allowed), and
    # the guard the shipped config loads on every role accepted every one of them.
    assert "Traceback" not in stderr and "refused" not in stderr, stderr[-4000:]



def test_dasks_own_log_lines_show_only_with_debug(procs, shipped_config, tmp_path):
    """A successful run prints its result and nothing of dask's logging; --debug lets dask's lines through."""
    env = procs.env_for(tmp_path, shipped_config)
    args = ("transpose", "--protocol", "tcp", "--size", "600", "--chunk", "300")
    dask_line = re.compile(r" - distributed\.[\w.]+ - (DEBUG|INFO|WARNING|ERROR) - ", re.M)
    _, quiet = workload(env, *args)
    assert not dask_line.search(quiet), quiet[-2000:]
    _, loud = workload(env, *args, "--debug")
    assert dask_line.search(loud), loud[-2000:]

def test_from_map_reads_only_the_projected_columns(procs, shipped_config, tmp_path):
    # Parquet over tcp here; Feather's projection is covered without a cluster in the unit tests.
    fmt, columns = "parquet", "d,id"
    result, stderr = workload(procs.env_for(tmp_path, shipped_config), "from-map", str(tmp_path / "data"),
                              "--format", fmt, "--files", "6", "--rows", "2000", "--columns", columns)
    wanted = sorted(columns.split(","))
    assert sorted(result["projected_columns"]) == wanted
    assert [sorted(c) for c in result["columns_read"]] == [wanted]      # every read, on every worker
    assert result["files_read"] == 6 and len(result["all_columns"]) > len(wanted)
    assert result["values_ok"] and result["ok"]
    # The sums are those of the files read whole, here, without dask.
    import pandas as pd

    frame = pd.concat(from_map.read_table(str(p), fmt, None).to_pandas()
                      for p in sorted((tmp_path / "data").glob("part-*")))
    for c in wanted:
        assert result["value"][c] == pytest.approx(frame[c].sum(), rel=1e-9)
    assert "Traceback" not in stderr, stderr[-4000:]


def test_transpose_survives_a_worker_killed_mid_run(procs, shipped_config, tmp_path):
    from distributed import Client

    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env)
    # No nanny: a killed worker stays dead, like a killed container.
    workers = {f"w{i}": procs.start_worker(tmp_path, env, address, f"w{i}", nanny=False) for i in range(3)}
    run = None
    try:
        with Client(address, timeout=60) as monitor:
            monitor.wait_for_workers(3, timeout=120)
            run = subprocess.Popen([sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--scheduler",
                                    address, "--size", "6000", "--chunk", "200", "--json"], env=env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            victim = None
            deadline = time.monotonic() + 240
            while victim is None and time.monotonic() < deadline and run.poll() is None:
                held = monitor.run_on_scheduler(lambda dask_scheduler: {
                    ws.name: sum(str(ts.key).startswith("('random-") for ts in ws.has_what)
                    for ws in dask_scheduler.workers.values()})
                # Kill as soon as one worker holds persisted blocks: the rest of the run still needs them.
                victim = next((name for name, n in held.items() if n >= 5), None)
                time.sleep(0.05)
            assert victim is not None, "the workload never persisted blocks"
            workers[victim].stop(signal.SIGKILL)
        out, err = run.communicate(timeout=600)
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        for w in workers.values():
            w.stop()
        sched.stop()
    assert run.returncode == 0, err[-4000:]
    result = json.loads(out)
    assert result["workers_start"] == 3 and result["workers_end"] == 2, "the kill did not land mid-run"
    assert result["ok"] and result["value"] == pytest.approx(numpy_transpose_sum(6000, 200, 0), rel=1e-9)
