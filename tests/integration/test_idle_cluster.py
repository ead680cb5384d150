"""An idle UCX cluster stays idle: every process (scheduler, nannies, worker processes, a connected client) of a
cluster with nothing submitted uses a few percent of a core, in the forms a user starts it — the launchers with the
shipped config (`ucx-dask-gpu bench idle`: `dask scheduler`, `dask worker`, a client process), and the image's roles.
UCXX's blocking mode used to poll its requests: each such process then ran at 100 % of a core (2N+1 cores for N GPU
workers). A control run with polling forced back (UCXPY_ENABLE_PYTHON_FUTURE=0) shows the measurement sees a spinning
process.

What is asserted is the difference between sleeping and spinning (a bound far above the few percent of heartbeats and
far below the share a spinning process takes even on a busy 2-core host); the figures themselves are printed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ucx_dask_gpu.bench.idle import idle_shares
from ucx_dask_gpu.image.docker import docker_bin

pytestmark = pytest.mark.integration

# Heartbeats and the event loop's tick cost a few percent; a polling process takes a core, or on a loaded host all
# the share the kernel gives it (a quarter of a core at least, even beside other work on a 2-core host).
SLEEPING_AT_MOST = 0.15
SPINNING_AT_LEAST = 0.25


def bench_idle(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.bench.idle", "--cpu", "--settle", "4", "--windows",
                           "3", "--window", "2", "--json", *args], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(proc.stdout.strip().splitlines()[-1])
    for r in payload["runs"]:
        print(r["name"], {n: p["median"] for n, p in r["processes"].items()})
    return payload


def test_an_idle_ucx_cluster_started_with_the_shipped_config_sleeps():
    (run,) = bench_idle("--variant", "ucx@shipped:shipped", "--workers", "2")["runs"]
    procs = run["processes"]
    # scheduler, client, 2 nannies and their worker processes
    assert {"scheduler", "client", "w0-nanny", "w1-nanny", "w0-nanny/worker-process",
            "w1-nanny/worker-process"} <= set(procs), sorted(procs)
    busy = {n: p["median"] for n, p in procs.items() if p["median"] > SLEEPING_AT_MOST}
    assert not busy, f"processes busy while idle: {busy}"
    # Each role said how UCXX waits: the scheduler, both workers and the client.
    lines = run["progress_lines"]
    assert len([ln for ln in lines if "UCXX progress blocking, event driven (idle: sleeps)" in ln]) == 4, lines


def test_with_polled_requests_the_measurement_sees_the_spin():
    """The control: UCXX's polling brought back by the environment, the same measurement reports the spin, and each
    role warned at start-up."""
    (run,) = bench_idle("--variant", "ucx@polled:shipped:UCXPY_ENABLE_PYTHON_FUTURE=0", "--workers", "1")["runs"]
    procs = run["processes"]
    assert procs["scheduler"]["median"] >= SPINNING_AT_LEAST, procs
    assert procs["client"]["median"] >= SPINNING_AT_LEAST, procs
    lines = run["progress_lines"]
    assert len([ln for ln in lines if "UCXX progress blocking polls: this process keeps a core busy" in ln]) == 3, \
        lines


def test_a_cluster_on_uvloop_works_and_every_role_says_it_polls():
    """`distributed.admin.event-loop: uvloop` (dask's own key): uvloop has no selector to wait on UCX's events, so
    UCXX polls there; the workers must still start (with the futures the worker makes resolved as it polls, not
    awaited forever: UCXX patch 0001), and each role says at start-up that it keeps a core busy. uvloop comes with the
    suite's [test_tools] (stack.toml)."""
    (run,) = bench_idle("--variant", "ucx@uvloop:shipped:distributed.admin.event-loop=uvloop", "--workers", "1")["runs"]
    assert {"scheduler", "client", "w0-nanny/worker-process"} <= set(run["processes"]), sorted(run["processes"])
    lines = [ln for ln in run["progress_lines"] if "UCXX progress blocking polls: this process keeps a core busy" in ln]
    assert len(lines) == 3 and all("event loop uvloop" in ln for ln in lines), run["progress_lines"]
    assert run["processes"]["scheduler"]["median"] >= SPINNING_AT_LEAST, run["processes"]


@pytest.mark.docker
def test_the_images_idle_roles_sleep(image):
    """The image's scheduler and two workers (nanny + worker process each) over UCX, nothing submitted: measured
    from this host's process table (the containers' processes are this kernel's)."""
    from ucx_dask_gpu.image.cluster import Cluster

    with Cluster(image["tag"], protocol="ucx") as cluster:
        pids = {}
        for name in cluster.containers:
            top = subprocess.run([docker_bin(), "top", name, "-eo", "pid,args"], capture_output=True, text=True,
                                 check=True).stdout.splitlines()[1:]
            for line in top:
                pid, args = line.split(None, 1)
                if "python" in args or "dask" in args:
                    pids[f"{name.removeprefix(cluster.name + '-')}:{pid}"] = int(pid)
        assert len(pids) >= 5, pids  # scheduler, 2 nannies, 2 worker processes
        time.sleep(4)
        shares = idle_shares(pids, 6)  # `docker top` lists every process of a container
    print("idle CPU, share of one core:", {n: None if s is None else round(s, 3) for n, s in shares.items()})
    busy = {n: s for n, s in shares.items() if s is None or s > SLEEPING_AT_MOST}
    assert not busy, f"processes busy (or gone) while idle: {busy}"
