"""Every wait ends, in one line, on real processes on loopback (issue 20):

- the workload client when its last worker dies mid-run ("all workers lost", exit 27, within --timeout) and when
  its scheduler stops mid-run ("scheduler lost", exit 28);
- the project's `dask-worker` (through the entrypoint, as the image runs it) pointed at a closed port, an HTTP server,
  a silent server or a Dask worker: one line naming what answered (20 / 24) within its bound, and SIGTERM during
  that wait ends it without a traceback;
- a worker whose scheduler stops (SIGTERM) over tcp, ucx (UCX over TCP) and tls: it ends soon after, and neither log
  has a traceback.

Bounds are asserted with wide margins (this host may be loaded: Python alone can take 10 s to start here); each test
prints what it measured.
"""
from __future__ import annotations

import http.server
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import ALL_WORKERS_LOST, NOT_A_SCHEDULER, SCHEDULER_LOST, SCHEDULER_UNREACHABLE
from ucx_dask_gpu.gate import tls
from ucx_dask_gpu.ucx.perftest import free_port
from ucx_dask_gpu.gate.guard import START_WAIT_S
from ucx_dask_gpu.proof.launchers import DaskProcess

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def dask_worker(tmp_path_factory, legacy_command) -> Path:
    """What the image installs as `dask-worker` (the package leaves the name to conda-forge's distributed)."""
    return legacy_command(tmp_path_factory.mktemp("legacy-bin"), "dask-worker")
MARGIN_S = 20.0
UCX_LOG = re.compile(r"^\[\d+\.\d+\] \[[^]]+\] +\S+:\d+ +UCX +WARN ")



def error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if " - ERROR - " in ln or ln.startswith("ucx-dask-gpu workload: error")]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.1)


# --- the workload client mid-run ------------------------------------------------------------------------------------

def _run_until_blocks_are_held(procs, env, address) -> subprocess.Popen:
    """A transpose long enough to be mid-run when something is stopped, once a worker holds blocks."""
    from distributed import Client

    import ucx_dask_gpu.gate.guard  # noqa: F401  the monitor must send its environment, as any client must

    run = None
    with Client(address, timeout=60) as monitor:
        monitor.wait_for_workers(1, timeout=120)
        run = subprocess.Popen([sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--scheduler",
                                address, "--size", "8000", "--chunk", "200", "--timeout", "10"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: run.poll() is not None or monitor.run_on_scheduler(lambda dask_scheduler: sum(
            len(ws.has_what) for ws in dask_scheduler.workers.values())) >= 5, 300, "the workload holding blocks")
    assert run.poll() is None, run.communicate()
    return run


def _ended(run: subprocess.Popen, since: float) -> tuple[str, float]:
    _, err = run.communicate(timeout=300)
    took = time.monotonic() - since
    lines = [ln for ln in err.strip().splitlines() if not UCX_LOG.match(ln)]
    assert "Traceback" not in err, err[-3000:]
    # Progress lines (every 10 s), then the one line.
    assert all(ln.startswith("workload: ") for ln in lines[:-1]), lines
    return lines[-1], took


def _stopped_mid_run(procs, shipped_config, tmp_path, protocol: str, stop) -> tuple[subprocess.Popen, str, float,
                                                                                   str]:
    """Scheduler + one worker (no nanny: a killed one stays dead), a transpose mid-run, then `stop(scheduler,
    worker)`: (the client's process, its last stderr line, seconds from the stop to its end, the address)."""
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env, protocol=protocol)
    worker = procs.start_worker(tmp_path, env, address, "w", nanny=False)
    run = None
    try:
        run = _run_until_blocks_are_held(procs, env, address)
        stop(sched, worker)
        line, took = _ended(run, time.monotonic())
    finally:
        if run is not None and run.poll() is None:
            run.kill()
        worker.stop()
        sched.stop()
    return run, line, took, address


def test_the_last_worker_dying_mid_run_is_all_workers_lost_within_the_timeout(procs, shipped_config, tmp_path):
    run, line, took, _ = _stopped_mid_run(procs, shipped_config, tmp_path, "tcp",
                                          lambda sched, worker: worker.stop(signal.SIGKILL))
    print(f"all workers lost: exit {run.returncode} {took:.1f} s after the kill (--timeout 10): {line}")
    assert run.returncode == ALL_WORKERS_LOST
    assert "all workers lost: the scheduler at" in line and "(--timeout 10 s) during the transpose" in line
    assert took <= 10 + MARGIN_S


@pytest.mark.parametrize("protocol", ["tcp", "ucx"])
def test_the_scheduler_stopped_mid_run_is_scheduler_lost(procs, shipped_config, tmp_path, protocol):
    run, line, took, address = _stopped_mid_run(procs, shipped_config, tmp_path, protocol,
                                                lambda sched, worker: sched.popen.send_signal(signal.SIGTERM))
    print(f"scheduler lost over {protocol}: exit {run.returncode} {took:.1f} s after SIGTERM: {line}")
    assert run.returncode == SCHEDULER_LOST
    assert f"scheduler lost: the connection to {address} closed during the transpose" in line
    assert took <= MARGIN_S


# --- a worker's start against what is not a scheduler ----------------------------------------------------------------

@pytest.fixture
def targets(procs, shipped_config, tmp_path):
    """What a worker may be pointed at, by kind: a closed port, an HTTP server, a silent server, a Dask worker."""
    made, stop = {}, []

    def closed():
        return f"tcp://127.0.0.1:{free_port()}"

    def http_server():
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        stop.append(server.shutdown)
        return f"tcp://127.0.0.1:{server.server_address[1]}"

    def silent():
        s = socket.create_server(("127.0.0.1", 0))
        held = []

        def accept_and_say_nothing():
            try:
                while True:
                    held.append(s.accept()[0])
            except OSError:  # closed at the end of the test
                pass

        threading.Thread(target=accept_and_say_nothing, daemon=True).start()
        stop.append(s.close)
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"

    def dask_worker():
        env = procs.env_for(tmp_path, shipped_config)
        sched, address = procs.start_scheduler(tmp_path, env, name="real")
        port = free_port()
        w = procs.start_worker(tmp_path, env, address, "real-worker", nanny=False,
                               extra_args=("--worker-port", str(port)))
        stop.extend([sched.stop, w.stop])
        wait_for(lambda: "Registered to" in w.text(), 180, "the real worker registering")
        return f"tcp://127.0.0.1:{port}"

    made.update(closed=closed, http=http_server, silent=silent, worker=dask_worker)
    yield made
    for fn in reversed(stop):
        fn()


def start_dask_worker(dask_worker: Path, tmp_path, env, address: str, *args: str) -> subprocess.Popen:
    return DaskProcess([str(dask_worker), address, "--nthreads", "1", "--dashboard-address", ":0",
                        "--local-directory", str(tmp_path / "space"), *args], env, tmp_path / "dask-worker.log").popen


@pytest.mark.parametrize("kind, code, says, death_timeout", [
    ("closed", SCHEDULER_UNREACHABLE, "(connection refused) within", None),
    ("http", NOT_A_SCHEDULER, "an HTTP server answered (HTTP/1.0 200 OK, Server: SimpleHTTP", None),
    ("worker", NOT_A_SCHEDULER, "a Dask Worker answered (its address is not the scheduler's)", None),
    ("silent", NOT_A_SCHEDULER, "it accepted the connection and said nothing within", "15"),
])
def test_a_worker_pointed_at_no_scheduler_ends_in_one_line_naming_what_answered(procs, shipped_config, tmp_path,
                                                                               dask_worker,
                                                                               targets, kind, code, says,
                                                                               death_timeout):
    address = targets[kind]()
    args = ("--death-timeout", death_timeout) if death_timeout else ()
    started = time.monotonic()
    proc = start_dask_worker(dask_worker, tmp_path, procs.env_for(tmp_path, shipped_config), address, *args)
    try:
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - started
    text = (tmp_path / "dask-worker.log").read_text()
    errors = error_lines(text)
    print(f"dask-worker at {kind}: exit {rc} after {took:.1f} s: {errors[-1] if errors else text[-500:]}")
    assert rc == code, text[-3000:]
    assert len(errors) == 1 and "ucx-dask-gpu guard: no" in errors[0] and says in errors[0], text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    bound = float(death_timeout) if death_timeout else START_WAIT_S
    assert took <= bound + MARGIN_S
    if kind == "closed":  # waited for a scheduler that may still be starting, and said so
        assert "ucx-dask-gpu guard: waiting for the scheduler at" in text


def test_sigterm_while_a_worker_waits_for_its_scheduler_ends_it_without_a_traceback(procs, shipped_config, tmp_path,
                                                                                    dask_worker):
    proc = start_dask_worker(dask_worker, tmp_path, procs.env_for(tmp_path, shipped_config),
                             f"tcp://127.0.0.1:{free_port()}")
    log = tmp_path / "dask-worker.log"
    try:
        wait_for(lambda: "Run preload setup: ucx_dask_gpu.gate.guard" in log.read_text(), 120, "the pre-check")
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        rc = proc.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    print(f"SIGTERM during the pre-check: exit {rc} {took:.1f} s later")
    assert "Traceback" not in text and not error_lines(text), text[-3000:]
    assert took <= MARGIN_S


# --- a worker whose scheduler stops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("protocol", ["tcp", "ucx", "tls"])
def test_a_worker_ends_quietly_soon_after_its_scheduler_stops(procs, shipped_config, tmp_path, protocol, dask_worker):
    """As the image runs a worker (the entrypoint: the guard in its nanny, the configured preloads); the scheduler
    gets SIGTERM. Before: over ucx and tls the worker stalled 10 s in the quiet-close wait, then logged 1-3
    tracebacks; distributed's 'Worker process died unexpectedly' traceback on any protocol."""
    env = procs.env_for(tmp_path, shipped_config)
    worker_env = env
    if protocol == "tls":
        tls.init(tmp_path / "certs", ["localhost", "127.0.0.1"])
        env = {**env, **tls.dask_env(tmp_path / "certs", "scheduler")}
        worker_env = {**worker_env, **tls.dask_env(tmp_path / "certs", "worker")}
    sched, address = procs.start_scheduler(tmp_path, env, protocol=protocol)
    worker = start_dask_worker(dask_worker, tmp_path, worker_env, address, "--name", f"w-{protocol}")
    log = tmp_path / "dask-worker.log"
    try:
        wait_for(lambda: "Register worker" in sched.text(), 180, "the worker registering")
        time.sleep(3)  # a few heartbeats
        sched.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        sched.popen.wait(timeout=120)
        sched_gone = time.monotonic() - signalled
        worker.wait(timeout=120)
        worker_gone = time.monotonic() - signalled
    finally:
        if worker.poll() is None:
            worker.kill()
        sched.stop()
    text = log.read_text()
    after = worker_gone - sched_gone
    print(f"{protocol}: scheduler process gone {sched_gone:.1f} s after SIGTERM, worker {worker_gone:.1f} s "
          f"({after:.1f} s after the scheduler)")
    assert "Traceback" not in text and not error_lines(text), text[-4000:]
    assert "Traceback" not in sched.text() and not error_lines(sched.text()), sched.text()[-4000:]
    assert "did not finish within" not in text  # no wait for a heartbeat to a scheduler that is gone
    assert after <= 15.0


ABANDON = """
import asyncio, sys, ucxx
host, port = sys.argv[1].split("://")[1].rsplit(":", 1)

async def main():
    # A connection given up on mid-handshake, as a worker's connect cancelled at its close, or a process that ends.
    for t in (0.002, 0.01, 0.05):
        try:
            await asyncio.wait_for(ucxx.create_endpoint(host, int(port)), t)
        except BaseException:
            pass
    await asyncio.sleep(8)  # past UCXX's 5 s connect timeout on the scheduler's side

asyncio.run(main())
"""


def test_an_abandoned_ucx_handshake_is_one_line_in_the_schedulers_log(procs, shipped_config, tmp_path):
    """The scheduler's occasional 'UCXPY ERROR ... TimeoutError in exchange_peer_info' at shutdown, reproduced: a
    peer that opens a UCX connection and gives up before the handshake ends. With quietclose (every role's preload)
    it is one warning line."""
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env, protocol="ucx")
    try:
        proc = subprocess.run([sys.executable, "-c", ABANDON, address], capture_output=True, text=True, timeout=300,
                              env={**env, "UCXX_LOG_LEVEL": "FATAL", "UCX_LOG_LEVEL": "error"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        wait_for(lambda: "UCXPY" in sched.text(), 60, "UCXX's line about the abandoned handshake")
    finally:
        sched.stop()
    text = sched.text()
    ucxpy = [ln for ln in text.splitlines() if "UCXPY" in ln]
    print("\n".join(ucxpy))
    assert ucxpy and all("UCXPY  WARNING a peer opened a UCX connection and did not finish its handshake" in ln
                         for ln in ucxpy), text[-3000:]
    assert "Traceback" not in text, text[-3000:]
