"""Our settings distributed has no config key for, applied by the start-up preload in real Dask objects (in-process
scheduler, worker and client): the BatchedSend interval in force on each role's stream, distributed's own without
the keys, one warning for a value that is not a duration; a dask-cuda worker's RMM pool from the config key (never
on a plain `dask worker`, never over a launcher's own RMM settings)."""
from __future__ import annotations

import asyncio
import logging
import time

import dask
import pytest
from distributed import Client, Scheduler, Worker

from ucx_dask_gpu.gate import tuning

STARTUP = "ucx_dask_gpu.ucx.startup"
# distributed 2026.7's own intervals, in seconds
DISTRIBUTED = {"client-interval": 0.01, "scheduler-interval": 0.005, "scheduler-client-interval": 0.002,
               "worker-interval": 0.002}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _intervals() -> dict[str, float]:
    """The interval each role's stream uses once a worker and a client are connected: by our key's name."""
    async with Scheduler(port=0, dashboard_address=":0", preload=[STARTUP]) as s:
        async with Worker(s.address, preload=[STARTUP], dashboard_address=":0") as w:
            async with Client(s.address, asynchronous=True) as c:
                await asyncio.sleep(0.05)  # the scheduler's client stream is set on the loop turn after it is made
                out = {}
                for role in (c, w, s):
                    for key, value in tuning.intervals_in_force(role).items():
                        out[key.split()[0]] = value
                assert set(out) == set(tuning.INTERVALS)
                assert all(len([k for k in tuning.intervals_in_force(s) if k.startswith(n + " ")]) >= 1
                           for n in ("scheduler-interval", "scheduler-client-interval"))
                return out


def test_each_role_uses_the_configured_interval():
    settings = {f"{tuning.PREFIX}.{k}": v for k, v in
                {"client-interval": "1ms", "scheduler-interval": "0.5ms", "scheduler-client-interval": "250us",
                 "worker-interval": 0}.items()}
    with dask.config.set({**settings, "distributed.client.preload": [STARTUP]}):
        got = run(_intervals())
    assert got == {"client-interval": 0.001, "scheduler-interval": 0.0005, "scheduler-client-interval": 0.00025,
                   "worker-interval": 0.0}


def test_without_the_keys_distributed_keeps_its_own():
    assert tuning.INTERVALS == {k: f"{v * 1000:g}ms" for k, v in DISTRIBUTED.items()}
    with dask.config.set({"distributed.client.preload": [STARTUP]}):
        assert run(_intervals()) == DISTRIBUTED


async def _gap_after_a_batch(interval: float) -> float:
    """Seconds between two messages of one BatchedSend over a real comm, the second sent right after the first
    batch went out, with `interval` set on the stream after it was made (as the preload sets it)."""
    from distributed.batched import BatchedSend
    from distributed.comm import connect, listen

    arrived: asyncio.Queue = asyncio.Queue()

    async def handle(comm):
        while True:
            try:
                msgs = await comm.read()
            except Exception:  # the peer closed: this handler's work is done
                return
            for m in msgs:
                arrived.put_nowait((m, time.monotonic()))

    async with listen("inproc://", handle) as listener:
        comm = await connect(listener.contact_address)
        stream = BatchedSend(interval="10ms")
        stream.start(comm)
        stream.interval = interval
        stream.send("a")
        (_, first) = await arrived.get()
        stream.send("b")
        (_, second) = await arrived.get()
        await stream.close()
    return second - first


def test_distributed_waits_the_interval_set_on_the_stream():
    """The mechanism, not the attribute: a distributed that stopped reading `interval` would send the second message
    at once with 0.5 s set (a test reading the attribute back would not see that). Margins far above scheduling noise;
    no speed is asserted."""
    slow, fast = run(_gap_after_a_batch(0.5)), run(_gap_after_a_batch(0.0))
    assert slow >= 0.4, slow
    assert fast < 0.2, fast


def test_a_stream_without_interval_is_one_warning(caplog):
    class Stream:  # what a distributed whose BatchedSend dropped the attribute would hand over
        pass

    stream = Stream()
    with caplog.at_level(logging.WARNING, logger="distributed.ucx_dask_gpu.tuning"):
        tuning._set(stream, 0.001)
    assert not hasattr(stream, "interval")
    assert [r.getMessage() for r in caplog.records] == [
        f"ucx-dask-gpu: Stream has no `interval` in this distributed: {tuning.PREFIX}.* cannot apply, distributed's "
        "own intervals stay"]


def test_a_value_that_is_not_a_duration_is_one_warning_and_changes_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="distributed.ucx_dask_gpu.tuning"):
        with dask.config.set({f"{tuning.PREFIX}.worker-interval": "fast", f"{tuning.PREFIX}.client-interval": -1}):
            assert tuning.interval("worker-interval") is None and tuning.interval("client-interval") is None
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "worker-interval='fast' is not a duration" in lines[0] and "2ms stays" in lines[0]


def test_the_rmm_pool_key_leaves_a_plain_dask_worker_alone(caplog):
    """A worker no dask-cuda launcher made (here a plain Worker, as `dask worker` makes it) gets no pool, GPU or not."""
    async def main():
        async with Scheduler(port=0, dashboard_address=":0") as s:
            async with Worker(s.address, preload=[STARTUP], dashboard_address=":0") as w:
                return "ucx-dask-gpu-rmm-pool" in w.plugins

    with caplog.at_level(logging.INFO, logger="distributed.ucx_dask_gpu.tuning"):
        with dask.config.set({tuning.RMM_POOL_KEY: "1GiB"}):
            added = run(main())
    assert not added
    assert [r.getMessage() for r in caplog.records if "RMM pool" in r.getMessage()] == \
        ["ucx-dask-gpu: RMM pool 1GiB: not applied: not a dask-cuda worker"]


@pytest.mark.parametrize("launcher, why", [
    ({}, None),                                                  # dask cuda worker / LocalCUDACluster, no RMM flag
    ({"external_lib_list": ["cupy"]}, None),                     # only --set-rmm-allocator-for-libs cupy
    ({"initial_pool_size": "8GiB"}, "the launcher configures RMM itself"),  # --rmm-pool-size 8GiB
    ({"async_alloc": True}, "the launcher configures RMM itself"),          # --rmm-async
    (None, "not a dask-cuda worker"),                            # `dask worker`: no RMMSetup at all
])
def test_who_takes_the_pool(launcher, why):
    """dask-cuda's RMMSetup reaches the worker as a pending plugin, as LocalCUDACluster and `dask cuda worker` pass it
    (a Worker made, not started: the plugin would need a GPU)."""
    from dask_cuda.plugins import RMMSetup

    args = dict(initial_pool_size=None, maximum_pool_size=None, managed_memory=False, async_alloc=False,
                release_threshold=None, log_directory=None, track_allocations=False, external_lib_list=None)
    plugins = [RMMSetup(**(args | launcher))] if launcher is not None else []
    worker = Worker("tcp://127.0.0.1:1", plugins=plugins, dashboard_address=":0")
    assert tuning.why_no_pool(worker) == why
    ours = tuning.rmm_pool_plugin("8GiB")  # what the key makes: the same plugin as --rmm-pool-size 8GiB alone
    assert {k: getattr(ours, k) for k in ("initial_pool_size", "managed_memory", "async_alloc", "external_lib_list")} \
        == {"initial_pool_size": "8GiB", "managed_memory": False, "async_alloc": False, "external_lib_list": None}
    # ... and with the shipped bound and CuPy on it: --rmm-maximum-pool-size 0.9 --set-rmm-allocator-for-libs cupy
    bounded = tuning.rmm_pool_plugin(0.05, 0.9, ["cupy"])
    assert (bounded.initial_pool_size, bounded.maximum_pool_size, bounded.external_lib_list) == (0.05, 0.9, ["cupy"])


def test_a_worker_without_pending_plugins_says_it_cannot_tell():
    """distributed keeps dask-cuda's RMMSetup in the private Worker._pending_plugins until start: without that
    attribute the pool is not applied and the start-up line says why, instead of 'not a dask-cuda worker'."""
    worker = Worker("tcp://127.0.0.1:1", dashboard_address=":0")
    assert hasattr(worker, "_pending_plugins"), "this distributed keeps pending plugins elsewhere: see why_no_pool"
    del worker._pending_plugins
    assert tuning.why_no_pool(worker).startswith("cannot tell: this distributed's Worker has no _pending_plugins")
