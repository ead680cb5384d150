"""SIGINT (Ctrl-C) and SIGTERM (`docker stop`, `timeout`, systemd) at several phases of the long-running commands:
each ends with one line and 128 + the signal (130, 143), and leaves no process, container, network or volume it
started (docs/exit-codes.md)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ucx_dask_gpu.image.docker import docker_bin

pytestmark = pytest.mark.integration

SIGNALS = [signal.SIGINT, signal.SIGTERM]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` now (from /proc: the process table a user's `ps` reads)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pids: set[int]) -> set[int]:
    def running(p: int) -> bool:
        try:
            return (Path("/proc") / str(p) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    return {p for p in pids if running(p)}


def interrupt(cmd: list[str], env: dict, tmp: Path, sig: int, when, group: bool = False, timeout: float = 240):
    """Start `cmd`, wait until `when(stdout_so_far)` says so (or its seconds pass), send `sig` (to its process group
    where `group`: a terminal's Ctrl-C), and return (exit code, stdout, stderr lines, processes it had started)."""
    out_path = tmp / f"stdout-{sig}"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.PIPE, text=True, start_new_session=True)
        start = time.monotonic()
        while not (when(out_path.read_text()) if callable(when) else time.monotonic() - start >= when):
            assert proc.poll() is None, f"ended before the phase: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() - start < timeout
            time.sleep(0.1)
        started = descendants(proc.pid)
        (os.killpg if group else os.kill)(proc.pid, sig)
        _, err = proc.communicate(timeout=timeout)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    return proc.returncode, out_path.read_text(), lines, started


def assert_one_line(rc: int, lines: list[str], sig: int, label: str) -> None:
    assert rc == 128 + sig, lines[-20:]
    assert lines == [f"{label}: interrupted by {signal.Signals(sig).name}; what it started has stopped"], lines[-40:]


def assert_ended(pids: set[int]) -> None:
    deadline = time.monotonic() + 20
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:200] for p in alive(pids)]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
@pytest.mark.parametrize("phase", [0.5, 2.0, 6.0], ids=["importing", "cluster-starting", "computing"])
def test_a_workload_with_its_own_cluster_ends_on_a_signal(procs, tmp_path, sig, phase):
    env = procs.env_for(tmp_path, None)
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--size", "30000", "--chunk", "1000"]
    rc, _, lines, started = interrupt(cmd, env, tmp_path, sig, phase)
    assert_one_line(rc, lines, sig, "ucx-dask-gpu workload")
    assert_ended(started)


def test_ctrl_c_at_the_terminal_mid_run_is_one_line(procs, tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: the local cluster's worker processes ignore it (the
    workload stops them) instead of each printing a traceback (175-242 lines before)."""
    env = procs.env_for(tmp_path, None)
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--size", "30000", "--chunk", "1000"]
    rc, _, lines, started = interrupt(cmd, env, tmp_path, signal.SIGINT, 6.0, group=True)
    assert_one_line(rc, lines, signal.SIGINT, "ucx-dask-gpu workload")
    assert_ended(started)


def worker_spawned(_stdout: str) -> bool:
    """A local cluster's worker process exists: spawned by its nanny, still starting (a fresh interpreter importing
    distributed, then unpickling what its nanny sent). This test process's own descendants, found in /proc."""
    for pid in descendants(os.getpid()):
        try:
            if b"spawn_main" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                return True
        except OSError:
            continue
    return False


@pytest.mark.parametrize("after", [0.0, 0.2, 0.5, 1.0], ids=["spawned", "0.2s", "0.5s", "1.0s"])
def test_ctrl_c_at_the_terminal_while_workers_start_is_one_line(procs, tmp_path, after):
    """Ctrl-C while the worker processes start (before any Worker object exists in them) reaches them too: they
    ignore it from their first instruction, not only once their Worker is built (a KeyboardInterrupt traceback each
    before)."""
    env = procs.env_for(tmp_path, None)
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--size", "30000", "--chunk", "1000"]
    spawned_at: list[float] = []

    def when(stdout: str) -> bool:
        if not spawned_at and worker_spawned(stdout):
            spawned_at.append(time.monotonic())
        return bool(spawned_at) and time.monotonic() - spawned_at[0] >= after

    rc, _, lines, started = interrupt(cmd, env, tmp_path, signal.SIGINT, when, group=True)
    assert_one_line(rc, lines, signal.SIGINT, "ucx-dask-gpu workload")
    assert_ended(started)



@pytest.mark.parametrize("sig, phase, group", [(signal.SIGTERM, 3.0, False), (signal.SIGINT, 15.0, True)],
                         ids=["TERM-clusters-starting", "ctrl-c-measuring"])
def test_a_benchmark_ends_on_a_signal(procs, tmp_path, sig, phase, group):
    """bench says its rounds on stderr as they go: the line it ends with is the interrupted one, with no traceback
    before it, and its clusters' processes are gone; nothing is written where the report would go."""
    env = procs.env_for(tmp_path, None)
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "bench", "transpose", "--cpu", "--size", "4000", "--chunks", "500",
           "--runs", "60", "--allow-few", "--warmup", "1", "--variant", "ucx@defaults:none", "--variant",
           "tcp@defaults:none", "--budget", "300", "--out", str(out)]
    rc, _, lines, started = interrupt(cmd, env, tmp_path, sig, phase, group=group)
    assert rc == 128 + sig, lines[-20:]
    assert lines[-1] == f"ucx-dask-gpu bench: interrupted by {signal.Signals(sig).name}; what it started has stopped"
    assert not [ln for ln in lines if "Traceback" in ln or "Error" in ln], lines[-40:]
    assert_ended(started)
    assert not out.exists()

def docker_names(cluster: str) -> list[str]:
    """This cluster's containers, networks and volumes, as `docker ps -a`, `network ls` and `volume ls` list them."""
    found = []
    for listing in (["ps", "-a", "--format", "{{.Names}}"], ["network", "ls", "--format", "{{.Name}}"],
                    ["volume", "ls", "--format", "{{.Name}}"]):
        out = subprocess.run([docker_bin(), *listing], capture_output=True, text=True, check=True).stdout
        found += [n for n in out.split() if n.startswith(cluster)]
    return found


def cluster_up(stdout: str) -> bool:
    return "workers is up" in stdout


@pytest.mark.docker
@pytest.mark.parametrize("sig, when, group", [
    (signal.SIGTERM, 2.0, False),                       # creating the network, volume, scheduler
    (signal.SIGINT, cluster_up, False),                 # the client container running the workloads
    (signal.SIGTERM, cluster_up, False),
    (signal.SIGINT, cluster_up, True),                  # Ctrl-C: the docker clients get it too
], ids=["TERM-starting", "INT-running", "TERM-running", "ctrl-c-running"])
def test_image_demo_ends_on_a_signal_and_leaves_nothing(image, procs, tmp_path, sig, when, group):
    env = procs.env_for(tmp_path, None)
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "image", "demo", "--protocol", "tcp", "--image", image["tag"]]
    rc, stdout, lines, started = interrupt(cmd, env, tmp_path, sig, when, group=group)
    assert_one_line(rc, lines, sig, "ucx-dask-gpu image")
    assert_ended(started)
    names = re.findall(r"cluster: (udg-[0-9a-f]+):", stdout)
    assert names, stdout
    assert docker_names(names[0]) == []
