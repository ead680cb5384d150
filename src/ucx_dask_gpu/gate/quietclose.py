"""Worker, nanny and scheduler preload: a normal shutdown logs no traceback.

Worker: no heartbeat is left on the wire when the worker closes its connections.

`Worker.close` stops the heartbeat callback but not a heartbeat already on the wire, then closes its connection
pool under it; the heartbeat fails ("ConnectionPool is closed") and the worker logs a traceback while shutting down
normally. Plugins are torn down at the start of `Worker.close`: this one stops the heartbeat, and
- while the scheduler is there (its stream open, no close from it: e.g. `docker stop` of the worker), lets the last
  heartbeat finish (it takes milliseconds; at most WAIT_S), so the scheduler's bookkeeping stays right;
- when the scheduler is going or gone (it sent "close", or its stream closed: the scheduler stopped), cancels it at
  once: such a heartbeat can only wait for its connect timeout and then fail, which over UCX and TLS stalled the
  close for WAIT_S and then logged tracebacks. The scheduler's "close" stops heartbeats at once (before the worker's
  own close starts), and no heartbeat starts once the stream to the scheduler is closed, so no connection attempts
  go to a scheduler that is shutting down.

Nanny: a worker that closes by itself (its scheduler told it to, or it was told to retire) first tells its nanny
(`close_gracefully`), then ends its process; that process's thread waiting for the nanny's stop message is cut off
after 2 s and distributed logs "Worker process died unexpectedly" with a TypeError traceback. The nanny now sends
that stop message as soon as it hears of the close, as its own close would: the thread ends with it, 2 s earlier.

Every role: the records of expected closes lose their tracebacks or go; each filter below says which and why.

Load it on every role (dask config `distributed.scheduler|worker|nanny.preload`, next to the guard).
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import traceback

from distributed import Nanny, Worker, WorkerPlugin
from distributed.comm.core import CommClosedError
from distributed.core import Status

logger = logging.getLogger("distributed.ucx_dask_gpu.quietclose")
NAME = "ucx-dask-gpu-quiet-close"
WAIT_S = 10.0
# How long a nanny gives a worker process that closes by itself before it ends it (as its own close would).
STOP_S = 30.0
# True inside a heartbeat, and inside every task it starts (tasks copy the context): a close the heartbeat itself
# began ("Scheduler was unaware of this worker") must not wait for that heartbeat, which is waiting for the close.
_in_heartbeat: contextvars.ContextVar[bool] = contextvars.ContextVar("ucx_dask_gpu_in_heartbeat", default=False)


class QuietClose(WorkerPlugin):
    name = NAME

    def __init__(self) -> None:
        self._beat: asyncio.Future | None = None
        self._scheduler_closing = False

    def setup(self, worker) -> None:
        pc = worker.periodic_callbacks.get("heartbeat")
        if pc is None:
            return
        beat = pc.callback

        async def heartbeat() -> None:
            if not self._scheduler_there(worker):
                return  # the worker is about to close: nothing to tell a scheduler that is gone
            token = _in_heartbeat.set(True)
            try:
                self._beat = running = asyncio.ensure_future(beat())  # a task of its own (this context): cancellable
            finally:
                _in_heartbeat.reset(token)
            try:
                await running
            except asyncio.CancelledError:
                if not running.cancelled():
                    raise  # the caller was cancelled, not the heartbeat

        pc.callback = heartbeat
        close = worker.stream_handlers.get("close")
        if close is not None:
            async def close_from_scheduler(*args, **kwargs):
                self._scheduler_closing = True
                self._stop_heartbeats(worker)
                return await close(*args, **kwargs)

            worker.stream_handlers["close"] = close_from_scheduler

    def _scheduler_there(self, worker) -> bool:
        stream = getattr(worker, "batched_stream", None)
        comm = getattr(stream, "comm", None)
        return not self._scheduler_closing and (stream is None or (comm is not None and not comm.closed()))

    def _stop_heartbeats(self, worker) -> None:
        pc = worker.periodic_callbacks.get("heartbeat")
        if pc is not None:
            pc.stop()
        if self._beat is not None and not self._beat.done() and not _in_heartbeat.get():
            self._beat.cancel()

    async def teardown(self, worker) -> None:
        pc = worker.periodic_callbacks.get("heartbeat")
        if pc is not None:
            pc.stop()
        beat = self._beat
        if beat is None or beat.done() or _in_heartbeat.get():
            return
        if self._scheduler_there(worker):
            try:
                await asyncio.wait_for(asyncio.shield(beat), WAIT_S)
                return
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass
            except Exception:  # the heartbeat's own failure: Worker.heartbeat has logged it
                return
        beat.cancel()
        await asyncio.wait({beat}, timeout=WAIT_S)  # let it unwind (its connect attempt closes); raises nothing


class ExpectedCloseFilter(logging.Filter):
    """Drops the traceback of "Batched Comm Closed" records whose exception is a CommClosedError (a peer's normal
    close, e.g. a worker stopped while the scheduler had a message on the way to it); keeps the line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CommClosedError) and str(record.msg).startswith("Batched Comm Closed"):
            record.exc_info = None
            record.exc_text = None
        return True


ABANDONED_HANDSHAKE = ("a peer opened a UCX connection and did not finish its handshake within the connect timeout "
                       "(it gave up or went away); the connection is dropped")


class AbandonedHandshakeFilter(logging.Filter):
    """A peer that opens a UCX connection and goes away before the handshake ends (a connect cancelled as its worker
    closes, a killed process) leaves UCXX's listener waiting for its info; after the connect timeout UCXX logs an
    error with the TimeoutError's traceback (seen on a scheduler at shutdown), formatted into the message itself
    (`"%s\\n%s" % (message, traceback text)`). Nothing is lost, that connection never carried anything: one warning
    line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        text = str(args[1]) if len(args) == 2 else ""
        if record.msg == "%s\n%s" and "exchange_peer_info" in text and text.rstrip().endswith("TimeoutError"):
            record.msg, record.args = ABANDONED_HANDSHAKE, ()
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_abandoned_handshakes() -> None:
    _add_once(logging.getLogger("ucx"), AbandonedHandshakeFilter)  # UCXX's logger, with a handler of its own


HANDSHAKE_TIMED_OUT = "a UCX handshake timed out (the peer was slow, loaded or going away)"


def _handshake_timeout(exc: BaseException | None) -> bool:
    """`exc`, or an exception it was raised from, is a TimeoutError that passed through UCXX's exchange_peer_info
    (its asyncio.wait_for(req.wait(), timeout=connect_timeout)), or the cancellation of that wait by distributed's own
    connect timeout around it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (TimeoutError, asyncio.CancelledError)) and any(
                f.f_code.co_name == "exchange_peer_info" for f, _ in traceback.walk_tb(exc.__traceback__)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class HandshakeTimeoutFilter(logging.Filter):
    """A record that carries such a timeout (a connect from this process to a peer that is closing, logged by
    distributed with the exception) becomes one warning line: its message and what happened, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and _handshake_timeout(record.exc_info[1]):
            record.msg, record.args = f"{record.getMessage()}: {HANDSHAKE_TIMED_OUT}", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_handshake_timeouts() -> None:
    """On the handlers every distributed record goes through (a logger's own filters miss its children's records)."""
    for logger in (logging.getLogger("distributed"), logging.getLogger()):
        for handler in logger.handlers:
            _add_once(handler, HandshakeTimeoutFilter)


FOREIGN_PEER = ("a peer connected that does not speak Dask's protocol over this listener's transport (e.g. a ucx:// "
                "worker or client given a tcp:// address); its connection is closed")


def _in_listener_handshake(walk) -> bool:
    """A new connection's first read on a distributed listener (BaseTCPListener._handle_stream) is on the stack
    `walk` (traceback.walk_stack or walk_tb)."""
    return any(f.f_code.co_name == "_handle_stream" and "distributed" in f.f_code.co_filename for f, _ in walk)


class ForeignPeerFilter(logging.Filter):
    """What answers a listener's handshake with bytes of another protocol (UCX's wire format at a tcp port): dask
    logs "Failed to deserialize" (CRITICAL) and then tornado the same error again, each with a traceback, at every
    retry of that peer. The first becomes one warning line saying what happened; the second goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "distributed.protocol.core" and record.msg == "Failed to deserialize" and \
                _in_listener_handshake(traceback.walk_stack(sys._getframe())):
            record.msg, record.args, record.exc_info, record.exc_text = FOREIGN_PEER, (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        elif record.name == "tornado.application" and record.exc_info:
            return not _in_listener_handshake(traceback.walk_tb(record.exc_info[2]))
        return True


def quiet_foreign_peers() -> None:
    for name in ("distributed.protocol.core", "tornado.application"):
        _add_once(logging.getLogger(name), ForeignPeerFilter)


def quiet_batched_close() -> None:
    _add_once(logging.getLogger("distributed.batched"), ExpectedCloseFilter)


def stop_worker_process_on_graceful_close(nanny) -> None:
    original = nanny.handlers["close_gracefully"]
    stopping: set[asyncio.Future] = set()

    async def close_gracefully(reason: str = "nanny-close-gracefully") -> None:
        original(reason=reason)
        process = nanny.process
        if process is not None and process.status == Status.running:
            task = asyncio.ensure_future(process.kill(timeout=STOP_S, reason=reason))
            stopping.add(task)
            task.add_done_callback(lambda t: (stopping.discard(t), t.cancelled() or t.exception()))
            await asyncio.sleep(0)  # the stop message is on its way before the worker hears back from us

    nanny.handlers["close_gracefully"] = close_gracefully


class UnretrievedUcxErrorFilter(logging.Filter):
    """A UCX request that failed because its connection closed (its peer stopped: "Message truncated", "Connection
    reset") after the coroutine waiting for it was cancelled by that same close: asyncio reports the future's
    exception as never retrieved when it is collected. The close itself is already handled and said (a worker's
    reconnect, a client's 'scheduler lost'): the record goes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (str(record.msg).startswith(("Future exception was never retrieved",
                                                "Task exception was never retrieved"))
                    and exc is not None and type(exc).__module__.split(".")[0] == "ucxx")


def quiet_unretrieved_ucx_errors() -> None:
    _add_once(logging.getLogger("asyncio"), UnretrievedUcxErrorFilter)


def _add_once(where: logging.Filterer, kind: type[logging.Filter]) -> None:
    """A `kind` filter on a logger or handler, once however often the preload runs in a process."""
    if not any(isinstance(f, kind) for f in where.filters):
        where.addFilter(kind())


async def dask_setup(server) -> None:
    quiet_unretrieved_ucx_errors()
    quiet_batched_close()
    quiet_abandoned_handshakes()
    quiet_handshake_timeouts()
    quiet_foreign_peers()
    if isinstance(server, Nanny):
        stop_worker_process_on_graceful_close(server)
    if isinstance(server, Worker):
        await server.plugin_add(QuietClose(), name=NAME)
