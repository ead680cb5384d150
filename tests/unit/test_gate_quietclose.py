"""QuietClose: a closing worker waits for the heartbeat on the wire while its scheduler is there, except when that
heartbeat is the one closing it; a scheduler that is going (its "close", its stream closed) gets no heartbeat and
the one on the wire is cancelled; and on every role distributed.batched's "Batched Comm Closed" keeps its line but loses the CommClosedError traceback
(any other record, and that message with another exception, are untouched)."""
import asyncio
import logging
from types import SimpleNamespace

from distributed.comm.core import CommClosedError

from ucx_dask_gpu.gate.quietclose import QuietClose, quiet_batched_close


class FakeCallback:
    def __init__(self, callback):
        self.callback = callback
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_close_waits_for_the_heartbeat_in_flight():
    async def main():
        events = []

        async def beat():
            events.append("beat-start")
            await asyncio.sleep(0.2)
            events.append("beat-end")

        worker = SimpleNamespace(periodic_callbacks={"heartbeat": FakeCallback(beat)}, stream_handlers={})
        plugin = QuietClose()
        plugin.setup(worker)
        running = asyncio.ensure_future(worker.periodic_callbacks["heartbeat"].callback())
        await asyncio.sleep(0.05)
        await plugin.teardown(worker)
        events.append("closed")
        await running
        return events, worker.periodic_callbacks["heartbeat"].stopped

    events, stopped = asyncio.run(main())
    assert events == ["beat-start", "beat-end", "closed"] and stopped


def test_a_heartbeat_that_closes_the_worker_does_not_wait_for_itself():
    async def main():
        worker = SimpleNamespace(periodic_callbacks={}, stream_handlers={})
        plugin = QuietClose()

        async def beat():  # like Worker.heartbeat on "missing": it closes the worker, whose close tears plugins down
            await asyncio.wait_for(asyncio.gather(plugin.teardown(worker)), 2)

        worker.periodic_callbacks["heartbeat"] = FakeCallback(beat)
        plugin.setup(worker)
        await worker.periodic_callbacks["heartbeat"].callback()

    asyncio.run(main())  # would time out (asyncio.TimeoutError) if the teardown waited for its own heartbeat


class FakeComm:
    def __init__(self, closed: bool):
        self._closed = closed

    def closed(self) -> bool:
        return self._closed


def _worker_with_endless_heartbeat(events: list, stream_closed: bool = False):
    """A heartbeat that would wait as long as a connect to a scheduler that is gone does."""
    async def beat():
        events.append("beat-start")
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            events.append("beat-cancelled")
            raise

    async def close(reason="worker-close"):
        events.append(f"close {reason}")

    return SimpleNamespace(periodic_callbacks={"heartbeat": FakeCallback(beat)}, stream_handlers={"close": close},
                           batched_stream=SimpleNamespace(comm=FakeComm(stream_closed)))


async def _heartbeat_on_the_wire(events: list):
    """A worker with QuietClose whose heartbeat has started and waits: (worker, plugin, the running heartbeat)."""
    worker = _worker_with_endless_heartbeat(events)
    plugin = QuietClose()
    plugin.setup(worker)
    running = asyncio.ensure_future(worker.periodic_callbacks["heartbeat"].callback())
    await asyncio.sleep(0.05)
    return worker, plugin, running


def test_a_scheduler_that_closes_gets_no_more_heartbeats_and_the_one_on_the_wire_ends():
    async def main():
        events = []
        worker, plugin, running = await _heartbeat_on_the_wire(events)
        # the scheduler's {"op": "close"} (distributed awaits stream handlers that are coroutine functions)
        await asyncio.wait_for(worker.stream_handlers["close"](reason="scheduler-close"), 5)
        await asyncio.wait_for(running, 5)  # ended quietly, no exception
        await worker.periodic_callbacks["heartbeat"].callback()  # a late tick: sends nothing
        await asyncio.wait_for(plugin.teardown(worker), 5)
        return events, worker.periodic_callbacks["heartbeat"].stopped

    events, stopped = asyncio.run(main())
    assert events[0] == "beat-start" and sorted(events[1:]) == ["beat-cancelled", "close scheduler-close"] and stopped


def test_a_closed_scheduler_stream_means_no_wait_at_close():
    """The scheduler's stream closed (it stopped, or died): the heartbeat on the wire is cancelled at teardown, not
    waited for."""
    async def main():
        events = []
        worker, plugin, running = await _heartbeat_on_the_wire(events)
        worker.batched_stream.comm._closed = True
        await asyncio.wait_for(plugin.teardown(worker), 5)
        await asyncio.wait_for(running, 5)
        await worker.periodic_callbacks["heartbeat"].callback()
        return events

    assert asyncio.run(main()) == ["beat-start", "beat-cancelled"]


def _log(logger: logging.Logger, msg: str, exc: BaseException) -> str:
    out: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            out.append(self.format(record))

    handler = Keep()
    logger.addHandler(handler)
    try:
        try:
            raise exc
        except BaseException:
            logger.info(msg, "<TLS (closed) Scheduler connection to worker>", exc_info=True)
    finally:
        logger.removeHandler(handler)
    return out[0]


def test_a_normal_batched_close_logs_its_line_without_the_traceback():
    batched = logging.getLogger("distributed.batched")
    batched.setLevel(logging.INFO)
    before = _log(batched, "Batched Comm Closed %r", CommClosedError("in <TLS (closed)>: Stream is closed"))
    assert "Traceback (most recent call last)" in before  # what distributed logs without the filter
    quiet_batched_close()
    quiet_batched_close()  # idempotent: one filter
    try:
        after = _log(batched, "Batched Comm Closed %r", CommClosedError("in <TLS (closed)>: Stream is closed"))
        assert after == "Batched Comm Closed '<TLS (closed) Scheduler connection to worker>'"
        other = _log(batched, "Batched Comm Closed %r", ValueError("not a close"))
        assert "Traceback (most recent call last)" in other
        elsewhere = _log(logging.getLogger("distributed.core"), "Batched Comm Closed %r", CommClosedError("x"))
        assert "Traceback (most recent call last)" in elsewhere
        assert len(batched.filters) == 1
    finally:
        batched.filters.clear()


def test_an_abandoned_ucx_handshake_is_one_warning_line():
    """UCXX's own error record (its listener's _log_exception, traceback formatted into the message) for a handshake
    that timed out; any other UCXX error keeps its traceback."""
    from ucxx._lib_async.listener import _log_exception

    from ucx_dask_gpu.gate.quietclose import ABANDONED_HANDSHAKE, quiet_abandoned_handshakes

    def exchange_peer_info():
        raise TimeoutError()

    def record_of(fn) -> logging.LogRecord:
        out: list[logging.LogRecord] = []

        class Keep(logging.Handler):
            def emit(self, record):
                out.append(record)

        ucx = logging.getLogger("ucx")
        handler = Keep()
        ucx.addHandler(handler)
        try:
            try:
                fn()
            except Exception:
                _log_exception("Unexpected error in listener handler coroutine")
        finally:
            ucx.removeHandler(handler)
        return out[0]

    def other():
        raise RuntimeError("Checksum invalid!")

    ucx = logging.getLogger("ucx")
    before = record_of(exchange_peer_info)
    assert before.levelname == "ERROR" and "Traceback" in before.getMessage()  # what UCXX logs by itself
    quiet_abandoned_handshakes()
    quiet_abandoned_handshakes()
    try:
        after = record_of(exchange_peer_info)
        assert after.levelname == "WARNING" and after.getMessage() == ABANDONED_HANDSHAKE
        kept = record_of(other)
        assert kept.levelname == "ERROR" and "Checksum invalid!" in kept.getMessage()
        assert len([f for f in ucx.filters if type(f).__name__ == "AbandonedHandshakeFilter"]) == 1
    finally:
        ucx.filters.clear()


def test_a_connect_whose_ucx_handshake_timed_out_is_one_warning_line():
    """distributed logs a failed connect with the exception it was raised from: a TimeoutError out of UCXX's
    exchange_peer_info (a peer closing while the cluster stops, a loaded host) loses its traceback, in every role."""
    import asyncio

    from ucx_dask_gpu.gate.quietclose import HANDSHAKE_TIMED_OUT, quiet_handshake_timeouts

    async def exchange_peer_info():
        await asyncio.wait_for(asyncio.sleep(1), timeout=0.01)

    def slow():
        async def exchange_peer_info():  # the name UCXX's frame has
            await asyncio.sleep(1)
        return exchange_peer_info()

    def connect(handshake=exchange_peer_info):
        try:
            asyncio.run(handshake())
        except TimeoutError as e:
            raise OSError("Timed out trying to connect to ucx://10.0.0.2:40000 after 30 s") from e

    def connect_timed_out_around_it():  # distributed's own wait_for cancels the handshake's wait
        connect(lambda: asyncio.wait_for(slow(), timeout=0.01))

    out: list[str] = []

    class Keep(logging.StreamHandler):
        def emit(self, record):
            out.append(f"{record.levelname} {self.format(record)}")

    log = logging.getLogger("distributed")
    handler = Keep()
    log.addHandler(handler)
    try:
        quiet_handshake_timeouts()
        quiet_handshake_timeouts()
        assert len(handler.filters) == 1
        for fn in (connect, connect_timed_out_around_it, lambda: (_ for _ in ()).throw(TimeoutError("other wait"))):
            try:
                fn()
            except Exception:
                logging.getLogger("distributed.core").exception("Failed to connect")
    finally:
        log.removeHandler(handler)
    assert out[:2] == [f"WARNING Failed to connect: {HANDSHAKE_TIMED_OUT}"] * 2
    assert out[2].startswith("ERROR Failed to connect\nTraceback"), "any other timeout keeps its traceback"


def test_a_ucx_error_nobody_retrieved_after_its_close_is_not_reported_again():
    """asyncio's 'Future exception was never retrieved' for UCXX's own error class (a receive cut by the peer's
    stop, its waiter cancelled by the same close) goes; any other exception's report stays."""
    from ucxx._lib.libucxx import UCXMessageTruncatedError

    from ucx_dask_gpu.gate.quietclose import UnretrievedUcxErrorFilter

    def record(exc):
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "Future exception was never retrieved\n"
                                 f"future: <Future finished exception={exc!r}>", None, (type(exc), exc, None))

    f = UnretrievedUcxErrorFilter()
    assert not f.filter(record(UCXMessageTruncatedError("Message truncated")))
    assert f.filter(record(ValueError("a task's own error")))
