"""Where a client or a worker connects: the address checked before anything starts (`parse_address`: a typo ends
with USAGE before dask is imported), and what answers there, in one line.

`check_scheduler` (a client's), within one deadline (`--timeout`), in this order:
  1. a TCP connection to host:port (refused, unknown host, unreachable, no answer: SCHEDULER_UNREACHABLE);
  2. for tcp:// and tls://, a Dask handshake and the "identity" request, as Dask itself sends them; the answer must
     come from a Scheduler (a worker or nanny answers too: NOT_A_SCHEDULER). Dask's own connect waits forever for a
     handshake from a server that accepts and stays silent, and reads an HTTP reply as a frame length of exabytes:
     here the whole exchange runs under the deadline and any failure is caught;
  3. when that fails, what answered instead, from fresh plain connections: a server that speaks first (SSH, a
     Dask handshake), an HTTP server (its status line and Server header; the Dask dashboard is named as such), a
     TLS server, or silence (NOT_A_SCHEDULER); TLS refusals (no client certificate, one from another CA) are
     TLS_REFUSED.
  ucx:// and ucxx:// get step 1 only: UCX endpoints are created once per process by distributed-ucxx, on the
  loop of the Client that uses them, so a probe over UCX here would set UCX up on the wrong loop.

`await_scheduler` is a worker's start (the guard's pre-check in its nanny): the same names, through the worker's own
comm stack, waiting out a scheduler that is not up yet.

The standard library only, except the Dask exchange (distributed, imported inside the function that needs it).
"""
from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

from ..errors import NOT_A_SCHEDULER, SCHEDULER_UNREACHABLE, TLS_REFUSED, USAGE, UserError

SCHEMES = ("tcp", "tls", "ucx", "ucxx")
DEFAULT_PORT = 8786
# What the diagnosis (step 3) may use of the deadline, at most: it runs after the Dask exchange failed.
DIAGNOSIS_S = 6.0
# How long the first Dask exchange may take before what answers is found out (a scheduler answers in milliseconds).
FIRST_TRY_S = 3.0
# How often a wait says that it is still waiting.
REPORT_EVERY_S = 10.0
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


@dataclass(frozen=True)
class Address:
    scheme: str
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}"


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    return len(host) <= 253 and all(_LABEL.match(label) for label in host.rstrip(".").split("."))


def parse_address(text: str, what: str = "--scheduler") -> Address:
    """`tcp://10.0.0.1:8786` -> Address; anything else: UserError(USAGE) naming what is wrong."""
    raw = (text or "").strip()
    example = f"e.g. tcp://10.0.0.1:{DEFAULT_PORT}"
    if not raw:
        raise UserError(f"{what} is empty ({example})", USAGE)
    scheme, sep, rest = raw.partition("://")
    if not sep:
        scheme, rest = "tcp", raw
    scheme = scheme.lower()
    if scheme not in SCHEMES:
        raise UserError(f"{what} {raw}: unknown scheme {scheme!r} (expected {', '.join(s + '://' for s in SCHEMES)})",
                        USAGE)
    if "/" in rest or "?" in rest or "@" in rest:
        raise UserError(f"{what} {raw}: a scheduler address is SCHEME://HOST:PORT, nothing after the port ({example})",
                        USAGE)
    if rest.startswith("["):
        host, bracket, tail = rest[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise UserError(f"{what} {raw}: unclosed IPv6 bracket ({example})", USAGE)
        port_text = tail[1:] if tail else ""
        has_port = bool(tail)
    else:
        if rest.count(":") > 1:
            raise UserError(f"{what} {raw}: an IPv6 host goes in brackets, e.g. {scheme}://[::1]:{DEFAULT_PORT}", USAGE)
        host, colon, port_text = rest.partition(":")
        has_port = bool(colon)
    if not host:
        raise UserError(f"{what} {raw}: no host ({example})", USAGE)
    if not _valid_host(host):
        raise UserError(f"{what} {raw}: {host!r} is neither a host name nor an IP address ({example})", USAGE)
    if not has_port or not port_text:
        raise UserError(f"{what} {raw}: no port (a Dask scheduler listens on {DEFAULT_PORT} unless told otherwise: "
                        f"{scheme}://{host}:{DEFAULT_PORT})", USAGE)
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UserError(f"{what} {raw}: port {port_text!r} is not a number from 1 to 65535", USAGE)
    return Address(scheme, host, int(port_text))


# --- step 1: is anything there? --------------------------------------------------------------------------------

def _open(addr: Address, timeout: float) -> socket.socket:
    """A TCP connection to the address; failures are one line, SCHEDULER_UNREACHABLE."""
    where = f"{addr.host}:{addr.port}"
    try:
        return socket.create_connection((addr.host, addr.port), timeout=max(timeout, 0.1))
    except socket.gaierror as e:
        raise UserError(f"no scheduler at {addr}: host {addr.host!r} not found ({e.strerror})",
                        SCHEDULER_UNREACHABLE) from None
    except ConnectionRefusedError:
        raise UserError(f"no scheduler at {addr}: nothing listens on {where} (connection refused)",
                        SCHEDULER_UNREACHABLE) from None
    except (socket.timeout, TimeoutError):
        raise UserError(f"no scheduler at {addr}: {where} did not accept a connection within {timeout:.0f} s (host "
                        "down, or a firewall drops the packets)", SCHEDULER_UNREACHABLE) from None
    except OSError as e:
        raise UserError(f"no scheduler at {addr}: cannot reach {where} ({e.strerror or e})",
                        SCHEDULER_UNREACHABLE) from None


# --- step 2: the Dask exchange ------------------------------------------------------------------------------------

async def _dask_identity(addr: Address, connection_args: dict, timeout: float) -> dict:
    from distributed.comm import connect  # heavy: only when a scheduler is asked
    from distributed.core import send_recv

    comm = await connect(str(addr), timeout=timeout, **connection_args)
    try:
        return await send_recv(comm, op="identity", close=True)
    finally:
        await comm.close()


def _ssl_error(exc: BaseException | None) -> ssl.SSLError | None:
    """The TLS error behind what the exchange raised: in its cause/context chain, or the `real_error` of tornado's
    StreamClosedError there (distributed raises FatalCommClosedError for an unknown CA without `from`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ssl.SSLError):
            return exc
        real = getattr(exc, "real_error", None)
        if isinstance(real, ssl.SSLError):
            return real
        exc = exc.__cause__ or exc.__context__
    return None


def _tls_refusal(addr: Address, err: ssl.SSLError) -> UserError:
    reason = err.reason.lower().replace("_", " ") if err.reason else re.sub(r"\s*\(_ssl\.c:\d+\)", "", str(err))
    if "verify failed" in reason:
        what = "this client does not trust the scheduler's certificate (distributed.comm.tls.ca-file is not the CA " \
               "that signed it)"
    else:
        what = ("the scheduler refused this client's certificate (mutual TLS: the client needs a certificate signed by "
                "the cluster's CA, `ucx-dask-gpu tls init`)")
    return UserError(f"TLS handshake with {addr} failed: {what}; TLS says: {reason}", TLS_REFUSED)


def dask_identity(addr: Address, deadline: float, security=None) -> dict:
    """The "identity" answer of the Dask server at `addr`, before `deadline` (time.monotonic()); raises what went
    wrong."""
    from distributed import Security  # heavy: only when a scheduler is asked

    args = (security or Security()).get_connection_args("client")
    if addr.scheme == "tls" and args.get("ssl_context") is None:
        raise UserError(f"{addr} speaks TLS, and this client has no TLS certificate: set distributed.comm.tls.ca-file, "
                        "distributed.comm.tls.client.cert and .key in its dask config (docs/environment-gate.md, "
                        "\"Mutual TLS\")",
                        TLS_REFUSED)
    timeout = max(deadline - time.monotonic(), 0.5)
    return asyncio.run(asyncio.wait_for(_dask_identity(addr, args, timeout), timeout))


# --- step 3: what answered instead --------------------------------------------------------------------------------

def _first_line(data: bytes, limit: int = 80) -> str:
    line = data.split(b"\n", 1)[0].strip()
    return line[:limit].decode("ascii", "replace")


def _looks_like_dask_handshake(data: bytes) -> bool:
    # Dask's TCP frames: 8-byte total size, 8-byte frame count, 8-byte lengths, then a msgpack map of its settings.
    return len(data) >= 16 and int.from_bytes(data[:8], "little") < 1 << 20 and b"pickle-protocol" in data


def _describe(data: bytes) -> tuple[str, str]:
    if data.startswith(b"SSH-"):
        return "other", f"an SSH server answered ({_first_line(data)})"
    if _looks_like_dask_handshake(data):
        return "dask", "a Dask server answered with its handshake, but not with a scheduler's identity in time"
    if data.startswith(b"HTTP/"):
        return "other", _describe_http(data)
    text = _first_line(data)
    if text and all(32 <= ord(c) < 127 for c in text):
        return "other", f"a server answered with {text!r}"
    return "other", f"a server answered with {len(data)} bytes that are not Dask's ({data[:12].hex()}...)"


def _describe_http(data: bytes) -> str:
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1", "replace").splitlines()
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:]) if k}
    server = f", Server: {headers['server']}" if headers.get("server") else ""
    dashboard = ""
    if "status" in headers.get("location", "") or b"bokeh" in data.lower() or b"dask" in data.lower():
        dashboard = (" - this looks like a Dask dashboard: the scheduler itself listens on another port "
                     f"({DEFAULT_PORT} unless told otherwise)")
    return f"an HTTP server answered ({head[0].strip() if head else 'HTTP'}{server}){dashboard}"


def _read(sock: socket.socket, until: float) -> bytes | None:
    """Bytes the peer sent before `until` (b"" when it closed first), None when it sent nothing."""
    chunks = []
    while True:
        left = until - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except (socket.timeout, TimeoutError):
            break
        except OSError:
            data = b""
        if not data:
            return b"".join(chunks)
        chunks.append(data)
        if b"\r\n\r\n" in data or sum(map(len, chunks)) > 16384:
            break
    return b"".join(chunks) or None


def what_answers(addr: Address, budget: float) -> tuple[str, str]:
    """(kind, phrase) for what listens at `addr` (it accepted a TCP connection), found within about `budget` s, from
    fresh connections: kind "dask" (it sent a Dask handshake), "silent" (nothing, or a close without a word) or
    "other" (SSH, HTTP, TLS, anything else: the phrase names it)."""
    step = max(budget / 3, 0.3)
    with _open(addr, step) as s:  # does it speak first? (Dask does: its handshake)
        data = _read(s, time.monotonic() + step)
    if data:
        return _describe(data)
    with _open(addr, step) as s:  # an HTTP request
        try:
            s.sendall(f"GET / HTTP/1.0\r\nHost: {addr.host}\r\n\r\n".encode())
            data = _read(s, time.monotonic() + step)
        except OSError:
            data = b""
    if data:
        return _describe(data)
    with _open(addr, step) as s:  # a TLS handshake, trusting anything
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        s.settimeout(step)
        tls = "other", "a TLS server answered (a Dask scheduler started with TLS? use tls://)"
        try:
            with ctx.wrap_socket(s, server_hostname=addr.host):
                return tls
        except ssl.SSLError as e:
            if "alert" in str(e).lower():
                return tls
        except OSError:
            pass
    if data == b"":
        return "silent", "the server closed the connection without answering"
    return "silent", "it accepted the connection and said nothing"


# --- all steps -----------------------------------------------------------------------------------------------

def check_scheduler(addr: Address, timeout: float, security=None) -> dict | None:
    """Make sure a Dask scheduler answers at `addr` within `timeout` seconds; its identity (None for UCX). A
    scheduler answers the Dask exchange within milliseconds unless it is very busy: the first try gets FIRST_TRY_S;
    then what answers is found out (an HTTP server does not answer Dask's binary handshake at all); only a server
    that is silent, or sends a Dask handshake, gets the rest of the time."""
    start = time.monotonic()
    deadline = start + timeout
    if addr.scheme in ("ucx", "ucxx"):
        _open(addr, timeout).close()
        return None
    diagnosis = min(DIAGNOSIS_S, timeout * 0.3)
    tries = [min(start + FIRST_TRY_S, deadline - diagnosis), deadline]
    what = ("silent", "it accepted the connection and said nothing")
    info = None
    for i, until in enumerate(tries):
        if i and (what[0] == "other" or until - time.monotonic() < 0.5):
            break
        try:
            info = dask_identity(addr, until, security)
            break
        except UserError:
            raise
        except (Exception, asyncio.TimeoutError) as e:  # anything the exchange raised: find out what answered
            tls = _ssl_error(e)
            if addr.scheme == "tls":
                if tls is not None:
                    raise _tls_refusal(addr, tls) from None
                raise UserError(f"no Dask scheduler at {addr}: the TLS connection failed ({type(e).__name__}: "
                                f"{e or 'no answer'})", NOT_A_SCHEDULER) from None
            if i == 0:
                # Nothing there at all is SCHEDULER_UNREACHABLE (a plain connect before the exchange would cost a
                # real scheduler an "closed before handshake" line per client, so it comes only now).
                budget = min(diagnosis, max(deadline - time.monotonic() - 0.2, 0.9))
                _open(addr, budget).close()
                what = what_answers(addr, budget)
    if info is None:
        silence = f" within {time.monotonic() - start:.0f} s" if what[0] == "silent" else ""
        raise UserError(f"no Dask scheduler at {addr}: {what[1]}{silence}", NOT_A_SCHEDULER)
    kind = info.get("type") if isinstance(info, dict) else None
    if kind != "Scheduler":
        raise UserError(f"no Dask scheduler at {addr}: a Dask {kind or 'server'} answered (its address is not the "
                        "scheduler's)", NOT_A_SCHEDULER)
    return info


# --- a worker's start -------------------------------------------------------------------------------------------

def _refused(addr: Address, budget: float) -> str | None:
    """Why nothing accepts a TCP connection at `addr` (refused, unknown host, unreachable), or None when something
    does."""
    try:
        _open(addr, budget).close()
    except UserError as e:
        return str(e).split(": ", 1)[-1]
    return None


def _diagnose(addr: Address, budget: float) -> tuple[str, str]:
    """what_answers(), or ("refused", why) when nothing accepts a connection (yet)."""
    why = _refused(addr, budget)
    return ("refused", why) if why else what_answers(addr, budget)


async def _in_daemon_thread(fn, *args):
    """fn(*args) in a daemon thread: blocking sockets off the event loop, and a process told to stop (SIGTERM) does
    not wait for them, as it would for asyncio's default executor."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def run() -> None:
        try:
            out = fn(*args)
        except BaseException as e:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(lambda err=e: done.done() or done.set_exception(err))  # `e` is gone after except
        else:
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(out))

    threading.Thread(target=run, daemon=True, name="ucx-dask-gpu-peer-probe").start()
    return await done


async def await_scheduler(addr: Address, ask: Callable[[], Awaitable[dict]], wait: float,
                          report: Callable[[str], None], what: str = "--death-timeout") -> dict:
    """The identity of the Dask scheduler at `addr`, asked with `ask()` (the worker's own rpc: its scheme, its TLS
    settings), within `wait` seconds; else UserError naming what answered, as check_scheduler's. Nothing listening
    and silence are waited out until the deadline (a scheduler may start after its workers), with `report` every
    REPORT_EVERY_S; anything else that answers ends the wait at once."""
    start = time.monotonic()
    deadline = start + wait
    state = ("refused", f"nothing listens on {addr.host}:{addr.port}")

    async def say_still_waiting() -> None:
        while True:
            await asyncio.sleep(REPORT_EVERY_S)
            report(f"waiting for the scheduler at {addr}: {state[1]} ({time.monotonic() - start:.0f} s of "
                   f"{wait:.0f} s, {what})")

    reporter = asyncio.create_task(say_still_waiting())
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if addr.scheme in ("ucx", "ucxx"):
                # Over UCX, each try at a closed port is a UCX endpoint error line: ask only once something listens.
                why = await _in_daemon_thread(_refused, addr, min(FIRST_TRY_S, left))
                if why:
                    state = ("refused", why)
                    await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
                    continue
                left = deadline - time.monotonic()
            try:
                info = await asyncio.wait_for(ask(), min(FIRST_TRY_S, max(left, 0.1)))
            except (Exception, asyncio.TimeoutError) as e:  # whatever the exchange raised: find out what answered
                tls = _ssl_error(e)
                if addr.scheme == "tls" and tls is not None:
                    raise _tls_refusal(addr, tls) from None
                left = deadline - time.monotonic()
                state = await _in_daemon_thread(_diagnose, addr, max(min(DIAGNOSIS_S, left), 0.9))
                if state[0] == "other":
                    raise UserError(f"no Dask scheduler at {addr}: {state[1]}", NOT_A_SCHEDULER) from None
            else:
                kind = info.get("type") if isinstance(info, dict) else None
                if kind == "Scheduler":
                    return info
                raise UserError(f"no Dask scheduler at {addr}: a Dask {kind or 'server'} answered (its address is "
                                "not the scheduler's)", NOT_A_SCHEDULER)
            await asyncio.sleep(min(1.0, max(deadline - time.monotonic(), 0)))
    finally:
        reporter.cancel()
    waited = f"within {time.monotonic() - start:.0f} s ({what})"
    if state[0] == "refused":
        raise UserError(f"no scheduler at {addr}: {state[1]} {waited}", SCHEDULER_UNREACHABLE)
    if state[0] == "dask":
        raise UserError(f"no Dask scheduler at {addr}: a Dask server answered with its handshake, but not with a "
                        f"scheduler's identity {waited}", NOT_A_SCHEDULER)
    raise UserError(f"no Dask scheduler at {addr}: {state[1]} {waited}", NOT_A_SCHEDULER)
