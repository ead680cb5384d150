"""Dask config keys of ours for what distributed and dask-cuda read from no config key, applied at start-up on each
role by the `ucx_dask_gpu.ucx.startup` preload (which the shipped dask config loads on every role):
`ucx-dask-gpu.batched-send.<stream>-interval` (INTERVALS: dask time strings; unset, distributed's own) and
`ucx-dask-gpu.cluster.rmm-*` (a dask-cuda worker's RMM pool).

BatchedSend: distributed batches the small control messages of a role's stream to its peer; after sending a batch
it sends the next one no sooner than `interval` later, so a message sent within `interval` of the previous batch
waits for the rest of it (a task's "compute" message to a worker, its "task-finished" back, the next submit of a
client that has just released keys). An interval of 0 sends each message as soon as the event loop gets to it;
messages queued while a write is in flight still go out together. The interval is read at every batch, so setting it
on the stream object after distributed made it is enough: no code of distributed's is replaced.

RMM pool: distributed-ucxx receives each GPU frame into `rmm.DeviceBuffer(size=n)`, from RMM's current resource. A
pool there spares every large receive a cudaMalloc, a fresh IPC handle opened by the sending peer and a
device-synchronising cudaFree. Each dask-cuda worker gets it from dask-cuda's own RMMSetup plugin, made as `dask cuda
worker --rmm-pool-size` makes it (`rmm_pool_plugin`; `why_no_pool`: which do not): one pool CuPy allocates from too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import dask.config
from dask.utils import parse_timedelta
from distributed import Client, Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin

logger = logging.getLogger("distributed.ucx_dask_gpu.tuning")
PREFIX = "ucx-dask-gpu.batched-send"
# Our key -> distributed's own interval for that stream (distributed 2026.7: client.py, scheduler.py, worker.py).
INTERVALS = {
    "client-interval": "10ms",
    "scheduler-interval": "5ms",
    "scheduler-client-interval": "2ms",
    "worker-interval": "2ms",
}
RMM_POOL_KEY = "ucx-dask-gpu.cluster.rmm-pool-size"
RMM_MAX_KEY = "ucx-dask-gpu.cluster.rmm-maximum-pool-size"
RMM_LIBS_KEY = "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list"


def interval(name: str) -> float | None:
    """Seconds, from dask config key `ucx-dask-gpu.batched-send.<name>`; None when unset (or unreadable: one warning
    line, and distributed's own interval stays)."""
    value = dask.config.get(f"{PREFIX}.{name}", None)
    if value is None:
        return None
    try:
        seconds = parse_timedelta(value, default="ms")
    except (ValueError, TypeError, KeyError):
        seconds = None
    if seconds is None or seconds < 0:
        logger.warning("ucx-dask-gpu: %s.%s=%r is not a duration (e.g. 1ms, 0): distributed's %s stays", PREFIX,
                       name, value, INTERVALS[name])
        return None
    return seconds


def _set(stream, seconds: float | None) -> None:
    if stream is None or seconds is None:
        return
    if not hasattr(stream, "interval"):
        # A distributed whose BatchedSend no longer reads `interval`: say so rather than set an attribute nobody reads.
        logger.warning("ucx-dask-gpu: %s has no `interval` in this distributed: %s.* cannot apply, distributed's own "
                       "intervals stay", type(stream).__name__, PREFIX)
        return
    stream.interval = seconds


class BatchedSendIntervals(SchedulerPlugin):
    """Sets the scheduler's streams to each worker and each client to the configured intervals."""

    name = "ucx-dask-gpu-batched-send"

    def __init__(self) -> None:
        self.to_worker = interval("scheduler-interval")
        self.to_client = interval("scheduler-client-interval")

    def add_worker(self, scheduler=None, worker=None, **kwargs) -> None:
        # distributed makes the worker's stream just before calling this hook
        _set(scheduler.stream_comms.get(worker), self.to_worker)

    def add_client(self, scheduler=None, client=None, **kwargs) -> None:
        # ... and the client's stream just after it, before the handler first awaits: the next loop turn sees it.
        if self.to_client is not None:
            scheduler.loop.add_callback(lambda: _set(scheduler.client_comms.get(client), self.to_client))


def set_intervals(seconds: dict[str, float], dask_worker=None, client=None) -> None:
    """Set every stream a role has now, by our keys' names (seconds; a name left out is left alone): how a benchmark
    measures interval variants in one running cluster (`client.run_on_scheduler(set_intervals, s)`,
    `client.run(set_intervals, s)`, `set_intervals(s, client=client)`). distributed passes the server that runs it
    as `dask_worker`, the scheduler included."""
    if isinstance(dask_worker, Scheduler):
        for stream in dask_worker.stream_comms.values():
            _set(stream, seconds.get("scheduler-interval"))
        for stream in dask_worker.client_comms.values():
            _set(stream, seconds.get("scheduler-client-interval"))
    elif isinstance(dask_worker, Worker):
        _set(dask_worker.batched_stream, seconds.get("worker-interval"))
    if client is not None:
        _set(client.scheduler_comm, seconds.get("client-interval"))


def intervals_in_force(dask_worker) -> dict[str, float]:
    """The interval (seconds) each BatchedSend of a role (client, worker or scheduler) uses now, by our key's name;
    also as `client.run(intervals_in_force)` / `client.run_on_scheduler(intervals_in_force)`."""
    role = dask_worker
    if isinstance(role, Client):
        return {"client-interval": role.scheduler_comm.interval} if role.scheduler_comm is not None else {}
    if isinstance(role, Worker):
        return {"worker-interval": role.batched_stream.interval}
    if isinstance(role, Scheduler):
        out = {f"scheduler-interval {addr}": s.interval for addr, s in role.stream_comms.items()}
        out.update({f"scheduler-client-interval {c}": s.interval for c, s in role.client_comms.items()
                    if hasattr(s, "interval")})
        return out
    return {}


@dataclass(frozen=True)
class RmmPool:
    """What a worker's start-up did about `ucx-dask-gpu.cluster.rmm-pool-size`: `applied` and why not."""
    size: str | None
    applied: bool
    why: str


def why_no_pool(worker) -> str | None:
    """Why this worker does not take the configured pool (None: it does). A GPU worker is a dask-cuda worker: dask-cuda
    hands it its RMMSetup as a plugin that runs after the preloads (Worker._pending_plugins, distributed 2026.7); a
    plain `dask worker` on a GPU host gets none (it may not use the GPU at all), and one whose RMMSetup sets up a pool,
    async or managed memory keeps what its launcher chose."""
    if not hasattr(worker, "_pending_plugins"):
        return "cannot tell: this distributed's Worker has no _pending_plugins (where dask-cuda's RMMSetup waits)"
    setups = [p for p in worker._pending_plugins or () if type(p).__name__ == "RMMSetup"]
    if not setups:
        return "not a dask-cuda worker"
    if any(getattr(p, "initial_pool_size", None) is not None or getattr(p, "async_alloc", False)
           or getattr(p, "managed_memory", False) for p in setups):
        return "the launcher configures RMM itself"
    return None


def rmm_pool_plugin(size, maximum=None, libs=None):
    """dask-cuda's RMMSetup exactly as `dask cuda worker --rmm-pool-size SIZE [--rmm-maximum-pool-size MAXIMUM]
    [--set-rmm-allocator-for-libs LIBS]` makes it (no other RMM flag)."""
    from dask_cuda.plugins import RMMSetup  # dask-cuda workers only: it loads CUDA libraries at import

    return RMMSetup(initial_pool_size=size, maximum_pool_size=maximum, managed_memory=False, async_alloc=False,
                    release_threshold=None, log_directory=None, track_allocations=False,
                    external_lib_list=list(libs) if libs else None)


async def apply_rmm_pool(worker) -> RmmPool:
    size = dask.config.get(RMM_POOL_KEY, None)
    if size is None:
        return RmmPool(None, False, "not set")
    why = why_no_pool(worker)
    if why:
        return RmmPool(str(size), False, why)
    maximum, libs = dask.config.get(RMM_MAX_KEY, None), dask.config.get(RMM_LIBS_KEY, None)
    if isinstance(libs, str):  # `--set-rmm-allocator-for-libs cupy,torch`, as the variable or the flag spells it
        libs = [lib.strip() for lib in libs.split(",") if lib.strip()]
    await worker.plugin_add(rmm_pool_plugin(size, maximum, libs), name="ucx-dask-gpu-rmm-pool", catch_errors=False)
    return RmmPool(f"{size}" + (f" (at most {maximum})" if maximum is not None else "")
                   + (f", {', '.join(libs)} on it" if libs else ""), True, "")


async def apply(dask_object) -> None:
    """Start-up on one role: the BatchedSend intervals (all roles) and the RMM pool (workers)."""
    if isinstance(dask_object, Scheduler):
        dask_object.add_plugin(BatchedSendIntervals())
    elif isinstance(dask_object, Worker):
        _set(dask_object.batched_stream, interval("worker-interval"))
        pool = await apply_rmm_pool(dask_object)
        if pool.size is not None:
            logger.info("ucx-dask-gpu: RMM pool %s: %s", pool.size, "applied" if pool.applied
                        else f"not applied: {pool.why}")
    elif isinstance(dask_object, Client):
        # The stream exists once the client is connected (client preloads run then). A reconnect makes a new one
        # with distributed's interval.
        _set(dask_object.scheduler_comm, interval("client-interval"))
