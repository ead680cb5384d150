"""QuietClose: a closing worker waits for the heartbeat on the wire, except when that heartbeat is the one closing it."""
import asyncio
from types import SimpleNamespace

from ucx_dask_gpu.gate.quietclose import QuietClose


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
