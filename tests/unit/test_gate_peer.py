"""Where a workload connects: the address checked before anything starts (one line, USAGE), and how what answers
at a port is named. The servers that answer are real sockets on loopback; no Dask cluster is needed here
(tests/integration/test_failures_cluster.py has the real ones)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import SCHEDULER_UNREACHABLE, USAGE, UserError
from ucx_dask_gpu.gate.peer import Address, parse_address, what_answers

SRC = Path(__file__).resolve().parents[2] / "src"


@pytest.mark.parametrize("text, expected", [
    ("tcp://10.0.0.1:8786", Address("tcp", "10.0.0.1", 8786)),
    ("ucx://scheduler:8786", Address("ucx", "scheduler", 8786)),
    ("TLS://node-1.example.org:1", Address("tls", "node-1.example.org", 1)),
    ("scheduler:8786", Address("tcp", "scheduler", 8786)),           # no scheme: tcp, as dask reads it
    ("tcp://[::1]:8786", Address("tcp", "::1", 8786)),
    ("ucxx://127.0.0.1:65535", Address("ucxx", "127.0.0.1", 65535)),
])
def test_addresses_dask_accepts(text, expected):
    assert parse_address(text) == expected
    assert parse_address(str(expected)) == expected


@pytest.mark.parametrize("text, says", [
    ("not-an-address", "no port"),
    ("foo://1.2.3.4:1", "unknown scheme 'foo'"),
    ("http://scheduler:8787", "unknown scheme 'http'"),
    ("tcp://:8786", "no host"),
    ("tcp://scheduler", "no port"),
    ("tcp://scheduler:", "no port"),
    ("tcp://scheduler:0", "not a number from 1 to 65535"),
    ("tcp://scheduler:99999", "not a number from 1 to 65535"),
    ("tcp://scheduler:http", "not a number"),
    ("tcp://sched_uler:8786", "neither a host name nor an IP address"),
    ("tcp://::1:8786", "IPv6 host goes in brackets"),
    ("tcp://[::1:8786", "unclosed IPv6 bracket"),
    ("tcp://scheduler:8786/status", "nothing after the port"),
    ("", "empty"),
])
def test_malformed_addresses_are_one_line_usage(text, says):
    with pytest.raises(UserError) as err:
        parse_address(text)
    assert err.value.exit_code == USAGE and says in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("address", ["not-an-address", "foo://1.2.3.4:1"])
def test_the_cli_refuses_a_malformed_address_before_importing_dask(address):
    """`python -S`: without site-packages dask cannot even be imported, so the answer comes before it would be."""
    proc = subprocess.run([sys.executable, "-S", "-m", "ucx_dask_gpu", "workload", "transpose", "--scheduler",
                           address], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(SRC)})
    assert proc.returncode == USAGE, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and address in proc.stderr


class Server:
    """A real TCP server on loopback that answers every connection with `behaviour(conn)`."""

    def __init__(self, behaviour):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.behaviour = behaviour
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self.behaviour, args=(conn,), daemon=True).start()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def _http(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(1024)
        if not chunk:
            return
        data += chunk
    conn.sendall(b"HTTP/1.1 302 Found\r\nServer: TornadoServer/6.5\r\nLocation: status\r\nContent-Length: 0\r\n\r\n")
    conn.close()


def _ssh(conn):
    conn.sendall(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n")


def _silent(conn):
    pass


def _closes(conn):
    conn.close()


@pytest.mark.parametrize("behaviour, kind, says", [
    (_http, "other", "an HTTP server answered (HTTP/1.1 302 Found, Server: TornadoServer/6.5) - this looks like a "
                     "Dask dashboard"),
    (_ssh, "other", "an SSH server answered (SSH-2.0-OpenSSH_9.2p1 Debian-2)"),
    (_silent, "silent", "accepted the connection and said nothing"),
    (_closes, "silent", "closed the connection without answering"),
])
def test_what_answers_is_named(behaviour, kind, says):
    server = Server(behaviour)
    try:
        got = what_answers(Address("tcp", "127.0.0.1", server.port), 1.5)
    finally:
        server.close()
    assert got[0] == kind and says in got[1], got


def test_nothing_listening_is_unreachable():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with pytest.raises(UserError) as err:
        what_answers(Address("tcp", "127.0.0.1", port), 1)
    assert err.value.exit_code == SCHEDULER_UNREACHABLE and "connection refused" in str(err.value)


def test_a_tls_refusal_distributed_reports_without_a_cause_is_still_found():
    """distributed turns tornado's StreamClosedError(real_error=SSLError unknown CA) into FatalCommClosedError raised
    without `from`: the SSL error is only reachable through `real_error` of the exception being handled."""
    import ssl

    from distributed.comm.core import FatalCommClosedError
    from distributed.comm.tcp import convert_stream_closed_error
    from tornado.iostream import StreamClosedError

    from ucx_dask_gpu.gate.peer import _ssl_error

    alert = ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca")
    alert.reason = "TLSV1_ALERT_UNKNOWN_CA"
    try:
        try:
            raise StreamClosedError(real_error=alert)
        except StreamClosedError as closed:
            convert_stream_closed_error("Client->Scheduler", closed)
    except FatalCommClosedError as raised:
        assert raised.__cause__ is None
        assert _ssl_error(raised) is alert
    else:
        pytest.fail("distributed did not raise FatalCommClosedError")
    assert _ssl_error(RuntimeError("no TLS involved")) is None


def test_a_probe_that_raises_hands_its_error_to_the_awaiting_coroutine():
    # the exception is delivered after the thread's except block has ended (its name is unbound by then)
    import asyncio

    from ucx_dask_gpu.gate.peer import _in_daemon_thread

    def boom():
        raise ConnectionResetError("probe failed")

    async def main():
        with pytest.raises(ConnectionResetError, match="probe failed"):
            await _in_daemon_thread(boom)
        return await _in_daemon_thread(lambda: 7)

    assert asyncio.run(main()) == 7
