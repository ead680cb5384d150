"""QuietClose: a closing worker waits for the heartbeat on the wire, except when that heartbeat is the one closing it;
and on every role distributed.batched's "Batched Comm Closed" keeps its line but loses the CommClosedError traceback
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

        worker = SimpleNamespace(periodic_callbacks={"heartbeat": FakeCallback(beat)})
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
        worker = SimpleNamespace(periodic_callbacks={})
        plugin = QuietClose()

        async def beat():  # like Worker.heartbeat on "missing": it closes the worker, whose close tears plugins down
            await asyncio.wait_for(asyncio.gather(plugin.teardown(worker)), 2)

        worker.periodic_callbacks["heartbeat"] = FakeCallback(beat)
        plugin.setup(worker)
        await worker.periodic_callbacks["heartbeat"].callback()

    asyncio.run(main())  # would time out (asyncio.TimeoutError) if the teardown waited for its own heartbeat


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
