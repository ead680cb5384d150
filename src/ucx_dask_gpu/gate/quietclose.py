"""Worker and scheduler preload: a normal shutdown logs no traceback.

Worker: a worker that is asked to close waits for its in-flight heartbeat before closing its connections.

`Worker.close` stops the heartbeat callback but not a heartbeat already on the wire, then closes its connection
pool under it; the heartbeat fails ("ConnectionPool is closed") and the worker logs a traceback while shutting down
normally. Over UCX, where a heartbeat round trip takes longer, that happens on about every other `docker stop`.
Plugins are torn down at the start of `Worker.close`, while the scheduler still answers: this one stops the
heartbeat and lets the last one finish, so a normal shutdown logs no error.

Both: distributed logs a peer's normal close of a batched stream ("Batched Comm Closed", at INFO) with the
CommClosedError's traceback, e.g. in the scheduler's log when it had a message on the way to a worker being stopped.
The line stays; the traceback of that expected close goes.

Load it on workers (dask config `distributed.worker.preload`, next to the guard) and on the scheduler.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging

from distributed import Worker, WorkerPlugin
from distributed.comm.core import CommClosedError

logger = logging.getLogger("distributed.ucx_dask_gpu.quietclose")
NAME = "ucx-dask-gpu-quiet-close"
WAIT_S = 10.0
# True inside a heartbeat, and inside every task it starts (tasks copy the context): a close the heartbeat itself
# began ("Scheduler was unaware of this worker") must not wait for that heartbeat, which is waiting for the close.
_in_heartbeat: contextvars.ContextVar[bool] = contextvars.ContextVar("ucx_dask_gpu_in_heartbeat", default=False)


class QuietClose(WorkerPlugin):
    name = NAME

    def __init__(self) -> None:
        self._idle: asyncio.Event | None = None

    def setup(self, worker) -> None:
        pc = worker.periodic_callbacks.get("heartbeat")
        if pc is None:
            return
        self._idle = asyncio.Event()
        self._idle.set()
        beat = pc.callback

        async def heartbeat() -> None:
            self._idle.clear()
            token = _in_heartbeat.set(True)
            try:
                await beat()
            finally:
                _in_heartbeat.reset(token)
                self._idle.set()

        pc.callback = heartbeat

    async def teardown(self, worker) -> None:
        pc = worker.periodic_callbacks.get("heartbeat")
        if pc is not None:
            pc.stop()
        if self._idle is not None and not _in_heartbeat.get():
            try:
                await asyncio.wait_for(self._idle.wait(), WAIT_S)
            except asyncio.TimeoutError:
                logger.warning("ucx-dask-gpu: the last heartbeat did not finish within %.0f s of closing", WAIT_S)


class ExpectedCloseFilter(logging.Filter):
    """Drops the traceback of "Batched Comm Closed" records whose exception is a CommClosedError; keeps the line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, CommClosedError) and str(record.msg).startswith("Batched Comm Closed"):
            record.exc_info = None
            record.exc_text = None
        return True


def quiet_batched_close() -> None:
    batched = logging.getLogger("distributed.batched")
    if not any(isinstance(f, ExpectedCloseFilter) for f in batched.filters):
        batched.addFilter(ExpectedCloseFilter())


async def dask_setup(server) -> None:
    quiet_batched_close()
    if isinstance(server, Worker):
        await server.plugin_add(QuietClose(), name=NAME)
