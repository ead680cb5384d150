"""Every failure a user can cause ends in one line with its exit code, on real processes on loopback: the workload CLI
pointed at an HTTP server, at a scheduler's dashboard, at a server that accepts and never answers, at a closed
port, at a scheduler without workers; and mutual TLS, which refuses a client without a certificate of the cluster's CA.

No timed assertions: "within --timeout" is checked as "it ended, with this code and this line", under an outer
timeout several times larger.
"""
from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import textwrap
import time

import pytest

from ucx_dask_gpu.errors import NO_WORKERS, NOT_A_SCHEDULER, SCHEDULER_UNREACHABLE, TLS_REFUSED, UserError
from ucx_dask_gpu.gate import tls
from ucx_dask_gpu.ucx.perftest import free_port

pytestmark = pytest.mark.integration

SILENT_SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.create_server(("127.0.0.1", 0))
    print(s.getsockname()[1], flush=True)
    held = []
    while True:
        held.append(s.accept()[0])  # accept, then never say a word
""")



@pytest.fixture
def server():
    """server(argv) -> a process started with `argv` (`{port}` replaced by a free port), stopped after the test."""
    started = []

    def start(argv: list[str]) -> int:
        port = free_port()
        proc = subprocess.Popen([a.replace("{port}", str(port)) for a in argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        started.append(proc)
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return port
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"{argv} exited with {proc.returncode}")
                time.sleep(0.1)
        raise RuntimeError(f"{argv} did not listen on {port}")

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=30)


# UCX's own log format. In a venv whose start-up preload loads our UCX, UCX has read its settings before any command
# runs, so its warning about UCXX's UCX_MEMTYPE_CACHE cannot be silenced there (in the image it is).
UCX_LOG = re.compile(r"^\[\d+\.\d+\] \[[^]]+\] +\S+:\d+ +UCX +WARN ")


def one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in proc.stderr.strip().splitlines() if not UCX_LOG.match(ln)]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


def test_an_http_server_is_named(procs, server, tmp_path):
    port = server([sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"])
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--scheduler", f"tcp://127.0.0.1:{port}",
                          "--timeout", "10", timeout=120)
    assert proc.returncode == NOT_A_SCHEDULER
    line = one_line(proc)
    assert f"no Dask scheduler at tcp://127.0.0.1:{port}: an HTTP server answered (HTTP/1.0" in line
    assert "SimpleHTTP" in line


def test_the_dashboard_port_is_named(procs, shipped_config, tmp_path):
    sched, _ = procs.start_scheduler(tmp_path, procs.env_for(tmp_path, shipped_config))
    try:
        dashboard = json.loads((tmp_path / "scheduler.json").read_text())["services"]["dashboard"]
        proc = procs.workload(procs.env_for(tmp_path, shipped_config), "transpose", "--scheduler",
                              f"127.0.0.1:{dashboard}", "--timeout", "10", timeout=120)
    finally:
        sched.stop()
    assert proc.returncode == NOT_A_SCHEDULER
    line = one_line(proc)
    assert "an HTTP server answered" in line and "looks like a Dask dashboard" in line


def test_a_silent_server_ends_within_the_timeout(procs, tmp_path):
    silent = subprocess.Popen([sys.executable, "-c", SILENT_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(silent.stdout.readline())
        for scheme in ("tcp", "ucx"):
            proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--scheduler",
                                  f"{scheme}://127.0.0.1:{port}", "--timeout", "8", timeout=120)
            assert proc.returncode == NOT_A_SCHEDULER, proc.stderr[-3000:]
            line = one_line(proc)
            assert "accepted the connection and said nothing within" in line, line
    finally:
        silent.kill()
        silent.wait()


@pytest.mark.parametrize("scheme", ["tcp", "ucx"])
def test_a_closed_port_is_one_line_without_ucx_chatter(procs, tmp_path, scheme):
    """Over UCX, a closed port used to give 27 UCXX ERROR lines before the answer."""
    port = free_port()
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--scheduler", f"{scheme}://127.0.0.1:{port}",
                          "--timeout", "10", timeout=120)
    assert proc.returncode == SCHEDULER_UNREACHABLE
    assert f"nothing listens on 127.0.0.1:{port} (connection refused)" in one_line(proc)


def test_no_workers_gives_up_after_the_stated_time_saying_so(procs, shipped_config, tmp_path):
    sched, address = procs.start_scheduler(tmp_path, procs.env_for(tmp_path, shipped_config))
    try:
        proc = procs.workload(procs.env_for(tmp_path, shipped_config), "transpose", "--scheduler", address,
                              "--wait-workers", "12", timeout=180)
    finally:
        sched.stop()
    assert proc.returncode == NO_WORKERS
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr
    progress, last = lines[:-1], lines[-1]
    assert progress and all(ln.startswith(f"workload: waiting for workers at {address}: 0 of 1 joined")
                            for ln in progress), lines
    assert f"0 of 1 worker(s) joined the scheduler at {address} within 12 s (--wait-workers)" in last


# --- mutual TLS -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_cluster(procs, shipped_config, tmp_path_factory):
    """A TLS scheduler + worker, each with its certificate of the cluster's CA (`ucx-dask-gpu tls init`)."""
    tmp = tmp_path_factory.mktemp("tls")
    tls.init(tmp / "certs", ["localhost", "127.0.0.1"], clients=["alice"])
    tls.init(tmp / "other-ca", ["localhost", "127.0.0.1"])

    def env(role: str, certs: str = "certs", name: str | None = None, **extra) -> dict:
        return {**procs.env_for(tmp, shipped_config), **tls.dask_env(tmp / certs, role, name), **extra}

    sched, address = procs.start_scheduler(tmp, env("scheduler"), protocol="tls")
    worker = procs.start_worker(tmp, env("worker"), address, "tls-worker")
    yield address, env, sched
    worker.stop()
    sched.stop()


def test_a_client_with_a_certificate_of_the_cluster_computes(procs, tls_cluster):
    address, env, _ = tls_cluster
    assert address.startswith("tls://")
    proc = procs.workload(env("client", name="alice"), "transpose", "--scheduler", address, "--size", "400",
                          "--chunk", "200", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ok"] and json.loads(proc.stdout)["protocol"] == "tls"


def test_a_client_without_a_certificate_is_refused_by_the_scheduler(tls_cluster):
    """Someone who trusts the cluster's CA (so the scheduler's certificate checks out) but has no certificate of
    their own: dask's own connect with such a TLS context, as any client could make one. The scheduler ends the
    handshake; nothing reaches Dask."""
    address, env, sched = tls_cluster
    ca = env("client")["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"]
    code = textwrap.dedent(f"""
        import asyncio, ssl
        from distributed.comm import connect
        from distributed.core import send_recv
        ctx = ssl.create_default_context(cafile={ca!r})
        ctx.check_hostname = False
        async def main():
            comm = await connect({address!r}, timeout=10, ssl_context=ctx)
            return await send_recv(comm, op="identity")
        try:
            print("ANSWERED", asyncio.run(asyncio.wait_for(main(), 30)))
        except Exception as e:
            while e.__cause__ or e.__context__:
                e = e.__cause__ or e.__context__
            print("REFUSED", type(e).__name__, e)
    """)
    before = sched.text().count("Receive client connection")
    out = subprocess.run([sys.executable, "-c", code], env=env("client"), capture_output=True, text=True,
                         timeout=120).stdout
    # TLS 1.3 checks the client's certificate after the client's side of the handshake is done: the client reads
    # the scheduler's "certificate required" alert, or only the connection closing (EOF) when the alert is lost.
    assert out.startswith(("REFUSED SSLError", "REFUSED SSLEOFError")), out
    assert "certificate required" in out.lower() or "eof occurred" in out.lower(), out
    assert "TLS handshake failed" in sched.text()
    assert sched.text().count("Receive client connection") == before


def test_a_certificate_of_another_ca_is_refused_in_one_line(procs, tls_cluster):
    address, env, _ = tls_cluster
    # It trusts the scheduler (the cluster's CA file), but its own certificate comes from another CA.
    e = env("client", certs="other-ca", DASK_DISTRIBUTED__COMM__TLS__CA_FILE=env("client")[
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE"])
    proc = procs.workload(e, "transpose", "--scheduler", address, "--timeout", "10", timeout=120)
    assert proc.returncode == TLS_REFUSED
    assert "the scheduler refused this client's certificate" in one_line(proc)


def test_a_client_without_tls_settings_is_told_what_to_set(procs, tls_cluster, tmp_path):
    address, _, _ = tls_cluster
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--scheduler", address, "--timeout", "10",
                          timeout=120)
    assert proc.returncode == TLS_REFUSED
    assert "this client has no TLS certificate" in one_line(proc)


def test_a_plain_tcp_client_is_told_it_is_a_tls_scheduler(procs, tls_cluster, tmp_path):
    address, _, sched = tls_cluster
    before = sched.text().count("Receive client connection")
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--scheduler",
                          address.replace("tls://", "tcp://"), "--timeout", "10", timeout=120)
    assert proc.returncode == NOT_A_SCHEDULER
    assert "a TLS server answered" in one_line(proc)
    assert sched.text().count("Receive client connection") == before


def test_tls_init_refuses_to_issue_without_the_ca_key(tmp_path):
    tls.init(tmp_path, ["localhost"])
    (tmp_path / tls.CA_KEY).unlink()
    with pytest.raises(UserError) as err:
        tls.init(tmp_path, ["localhost"], clients=["bob"])
    assert "ca.key" in str(err.value) and not (tmp_path / "bob.pem").exists()
    assert ssl.create_default_context(cafile=str(tmp_path / tls.CA_CERT))  # what is there is still a valid CA
