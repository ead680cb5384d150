"""An idle UCX cluster stays idle: every process (scheduler, nannies, worker processes, a connected client) of a
cluster with nothing submitted uses a few percent of a core, in the forms a user starts it — the launchers with the
shipped config (`ucx-dask-gpu config install`), and the image's roles. UCXX's blocking mode used to poll its requests:
each such process then ran at 100 % of a core (2N+1 cores for N GPU workers). A control run with polling forced back
(UCXPY_ENABLE_PYTHON_FUTURE=0) shows the measurement sees a spinning process.

What is asserted is the difference between sleeping and spinning (a bound far above the few percent of heartbeats and
far below the share a spinning process takes even on a busy 2-core host); the figures themselves are printed.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from ucx_dask_gpu.bench.idle import idle_shares, with_children
from ucx_dask_gpu.image.docker import docker_bin

pytestmark = pytest.mark.integration

SETTLE_S = 4.0
WINDOW_S = 6.0
# Heartbeats and the event loop's tick cost a few percent; a polling process takes a core, or on a loaded host all
# the share the scheduler gives it (a quarter of a core at least, even beside other work on a 2-core host).
SLEEPING_AT_MOST = 0.15
SPINNING_AT_LEAST = 0.25

# A client connected and doing nothing: what a notebook holding a Client is between computations.
IDLE_CLIENT = textwrap.dedent("""
    import sys, time
    from distributed import Client
    with Client(sys.argv[1], timeout=60) as c:
        c.wait_for_workers(int(sys.argv[2]), timeout=120)
        print("ready", flush=True)
        time.sleep(600)
""")


def start_idle_client(env: dict, address: str, n_workers: int) -> subprocess.Popen:
    client = subprocess.Popen([sys.executable, "-c", IDLE_CLIENT, address, str(n_workers)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    line = client.stdout.readline()
    assert line.strip() == "ready", client.stderr.read()[-3000:] if client.poll() is not None else line
    return client


def measure(pids: dict[str, int], children: bool = True) -> dict[str, float]:
    time.sleep(SETTLE_S)
    shares = idle_shares(with_children(pids) if children else pids, WINDOW_S)
    print("idle CPU, share of one core:", {n: None if s is None else round(s, 3) for n, s in shares.items()})
    assert all(s is not None for s in shares.values()), shares
    return shares


def idle_venv_cluster(procs, tmp_path, env: dict, n_workers: int = 2) -> tuple[dict[str, float], str]:
    """`dask scheduler --protocol ucx`, `dask worker`s with nannies and a connected client, nothing submitted: each
    process's idle share, and the scheduler's and workers' logs."""
    sched, address = procs.start_scheduler(tmp_path, env, protocol="ucx")
    workers = [procs.start_worker(tmp_path, env, address, f"w{i}") for i in range(n_workers)]
    client = None
    try:
        client = start_idle_client(env, address, n_workers)
        pids = {"scheduler": sched.popen.pid, "client": client.pid}
        pids.update({f"w{i}-nanny": w.popen.pid for i, w in enumerate(workers)})
        shares = measure(pids)
    finally:
        if client is not None:
            client.kill()
            client.wait(30)
        for w in workers:
            w.stop()
        sched.stop()
    return shares, "\n".join(p.text() for p in (sched, *workers))


def test_an_idle_ucx_cluster_started_with_the_shipped_config_sleeps(procs, tmp_path, shipped_config):
    shares, logs = idle_venv_cluster(procs, tmp_path, procs.env_for(tmp_path, shipped_config))
    assert len(shares) >= 6  # scheduler, client, 2 nannies, 2 worker processes
    busy = {n: s for n, s in shares.items() if s > SLEEPING_AT_MOST}
    assert not busy, f"processes busy while idle: {busy}"
    # Each role says how UCXX waits (the scheduler and both workers).
    assert logs.count("UCXX progress blocking, event driven (idle: sleeps)") == 3, logs[-3000:]


def test_with_polled_requests_the_measurement_sees_the_spin(procs, tmp_path, shipped_config):
    """The control: UCXX's polling brought back by the environment, the same measurement reports the spin."""
    env = {**procs.env_for(tmp_path, shipped_config), "UCXPY_ENABLE_PYTHON_FUTURE": "0"}
    shares, logs = idle_venv_cluster(procs, tmp_path, env, n_workers=1)
    assert shares["scheduler"] >= SPINNING_AT_LEAST, shares
    assert shares["client"] >= SPINNING_AT_LEAST, shares
    # ... and each role warned at start-up.
    assert logs.count("UCXX progress blocking polls: this process keeps a core busy even when idle") == 2, logs[-3000:]


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
        shares = measure(pids, children=False)  # `docker top` lists every process of a container
    busy = {n: s for n, s in shares.items() if s > SLEEPING_AT_MOST}
    assert not busy, f"processes busy while idle: {busy}"
