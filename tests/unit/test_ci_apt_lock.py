"""ci/wait_apt_lock.sh (ci/install_prereqs.sh runs it before each apt-get): with another process holding an apt/dpkg
lock it waits, saying so every 10 s and naming the holder, and gives up after the bound with one line and APT_LOCKED.
A real fcntl lock held by a real process, on a lock file of the test's own (UCX_DASK_GPU_APT_LOCKS)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from ucx_dask_gpu.errors import APT_LOCKED, USAGE

ROOT = Path(__file__).resolve().parents[2]
HOLD = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); fcntl.lockf(fd, fcntl.LOCK_EX); " \
       "print('held', flush=True); sys.stdin.read()"


def wait(locks: list[Path], seconds: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "UCX_DASK_GPU_APT_LOCKS": " ".join(map(str, locks)), "UCX_DASK_GPU_APT_LOCK_WAIT": seconds}
    return subprocess.run([str(ROOT / "ci" / "wait_apt_lock.sh")], capture_output=True, text=True, env=env,
                          timeout=120)


def test_free_locks_pass_at_once(tmp_path):
    (tmp_path / "lock").touch()
    r = wait([tmp_path / "missing", tmp_path / "lock"], "300")
    assert r.returncode == 0 and r.stdout == r.stderr == ""


def test_a_held_lock_is_waited_for_then_one_line_and_apt_locked(tmp_path):
    lock = tmp_path / "lock-frontend"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        r = wait([tmp_path / "free", lock], "2")
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert r.returncode == APT_LOCKED, r.stderr
    assert r.stdout.splitlines()[0].startswith(f"apt lock: {lock} is held by pid {holder.pid} (")
    assert re.search(r"\); waiting \(\d+ s of 2 s\)$", r.stdout.splitlines()[0])
    [line] = r.stderr.strip().splitlines()
    assert f"{lock} still held by pid {holder.pid}" in line and "after 2 s" in line
    assert "UCX_DASK_GPU_APT_LOCK_WAIT" in line
    # Released: the same wait passes.
    assert wait([lock], "2").returncode == 0


def test_a_bound_that_is_not_a_number_is_usage(tmp_path):
    r = wait([tmp_path / "lock"], "5m")
    assert r.returncode == USAGE and len(r.stderr.strip().splitlines()) == 1
