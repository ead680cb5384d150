"""proof/launchers.py: a process started in a session of its own, its output in its log, or attached (in this
process's group, no log); a scheduler's address read from its scheduler file; a stop that ends what ignores SIGTERM,
and what it spawned, after the bound."""
from __future__ import annotations

import os
import sys
import time

import pytest

from ucx_dask_gpu.proof.launchers import DaskProcess, stop_processes

# Writes a scheduler file a moment after it starts, as `dask scheduler --scheduler-file` does.
WRITES_ADDRESS = "import json, sys, time; time.sleep(0.5); json.dump({'address': 'tcp://127.0.0.1:1'}, " \
                 "open(sys.argv[1], 'w')); time.sleep(60)"
# Ignores SIGTERM and leaves a grandchild in its session, printing the grandchild's pid.
STUBBORN = "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); " \
           "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); print(c.pid, flush=True); " \
           "time.sleep(60)"
# Ignores SIGTERM, then says so by creating the file it is given.
IGNORES_TERM = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); open(sys.argv[1], 'w'); " \
               "time.sleep(60)"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_a_schedulers_address_comes_from_its_file(tmp_path):
    proc = DaskProcess([sys.executable, "-c", WRITES_ADDRESS, str(tmp_path / "s.json")], os.environ, tmp_path / "s.log")
    proc.scheduler_file = tmp_path / "s.json"
    try:
        assert proc.address(30) == "tcp://127.0.0.1:1"
    finally:
        proc.stop()
    assert proc.popen.returncode is not None


def test_a_scheduler_that_exits_first_is_named_with_its_log(tmp_path):
    proc = DaskProcess([sys.executable, "-c", "print('no port for me'); raise SystemExit(3)"], os.environ,
                       tmp_path / "s.log")
    proc.scheduler_file = tmp_path / "never.json"
    with pytest.raises(ChildProcessError, match=r"exited \(3\):\nno port for me"):
        proc.address(30)
    assert proc.text() == "no port for me\n"


def test_stop_ends_a_process_that_ignores_sigterm_and_what_it_spawned_after_the_bound(tmp_path):
    proc = DaskProcess([sys.executable, "-c", STUBBORN], os.environ, tmp_path / "stubborn.log")
    deadline = time.monotonic() + 30
    while not proc.text().strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(proc.text().split()[0])
    started = time.monotonic()
    proc.stop(timeout=1)
    assert proc.popen.returncode == -9 and time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(grandchild)


def test_an_attached_process_is_in_this_group_and_stopped_alone(tmp_path):
    """Attached: a signal to this process's group would reach it; stopped, the signals go to it alone (its group is
    this test's), SIGKILL once it outlived the bound."""
    ready = tmp_path / "ready"
    proc = DaskProcess([sys.executable, "-c", IGNORES_TERM, str(ready)], os.environ, tmp_path / "p.log", attached=True)
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.getpgid(proc.popen.pid) == os.getpgrp() and proc.log is None and not (tmp_path / "p.log").exists()
    assert stop_processes([proc.popen], 1, groups=False) == [proc.popen] and proc.popen.returncode == -9
