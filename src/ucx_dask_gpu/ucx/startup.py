"""Dask preload: every worker says at start-up, in one log line, which UCX transports it will use (and warns about
what keeps it from better ones) and which dask config is in force; the scheduler warns when two GPU workers of one
kernel cannot use cuda_ipc between them because their containers do not share IPC/PID namespaces; on every role it
applies our settings distributed has no config key for (gate/tuning.py: BatchedSend intervals, a worker's RMM pool)
and says in one line how UCXX waits (a warning when the process would keep a core busy while idle).

The shipped dask config loads it on every role (`distributed.{scheduler,worker,nanny,client}.preload`), next to the
guard. A worker's `dask_setup` runs after its listener started (UCX is loaded by then, so the line names the UCX the
worker really maps) and adds its boot id, namespaces and whether it would use cuda_ipc to what it registers with, for
the scheduler's SameHostCuda; a nanny makes its worker process load this module even when the launcher passed its
own preload list.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import dask.config
from distributed import Client, Nanny, Scheduler, Worker
from distributed.diagnostics.plugin import SchedulerPlugin

from ..gate import tuning
from ..gate.daskconfig import add_worker_preloads, in_force
from . import transports

# Under "distributed." so that dask's logging config (format, level, handler) applies to our lines too.
logger = logging.getLogger("distributed.ucx_dask_gpu.transports")
KEY = "ucx-dask-gpu-transports"


class SameHostCuda(SchedulerPlugin):
    """Warns about same-kernel GPU worker pairs whose cuda_ipc cannot reach each other."""

    name = "ucx-dask-gpu-same-host-cuda-ipc"

    def __init__(self) -> None:
        self.warned: set[frozenset[str]] = set()

    def add_worker(self, scheduler=None, worker=None, **kwargs) -> None:
        ws = scheduler.workers.get(worker)
        facts = (ws.extra or {}).get(KEY) if ws is not None else None
        if not facts:
            return
        for addr, other in list(scheduler.workers.items()):
            pair = frozenset((addr, worker))
            theirs = (other.extra or {}).get(KEY)
            if addr == worker or not theirs or pair in self.warned or not transports.cuda_ipc_blocked(facts, theirs):
                continue
            self.warned.add(pair)
            message = (f"ucx-dask-gpu transports: workers {addr} and {worker} run on one kernel (boot id "
                       f"{facts['boot_id'][:8]}) in different IPC/PID namespaces: UCX selects cuda_ipc between them "
                       "and it cannot work there; start the GPU containers of a host with shared namespaces "
                       "(docker --ipc container:NAME --pid container:NAME, or host; compose ipc/pid)")
            logger.warning("%s", message)
            scheduler.log_event(KEY, {"action": "cuda-ipc-blocked", "workers": sorted(pair), "message": message})


def config_line() -> str:
    """Which dask config this process has in force (files, the shipped tuned settings); never fails start-up."""
    try:
        return in_force(dask.config.config, dask.config.paths, os.environ).line()
    except Exception as e:  # an unreadable config file: dask itself has read what it could
        return f"dask config: cannot tell ({type(e).__name__}: {e})"


def ucxx_progress() -> tuple[str, bool] | None:
    """How UCXX progresses this process's event loop: (progress mode, whether an idle loop sleeps on UCX's events);
    None where this loop runs no UCXX (tcp, or before distributed-ucxx started it). Read, never started, from here."""
    core = sys.modules.get("ucxx.core")
    context = sys.modules.get("ucxx._lib_async.application_context")
    if core is None or context is None or core._ctx is None:
        return None
    try:
        task = context.ProgressTasks.get(asyncio.get_running_loop())
    except RuntimeError:
        return None
    if task is None:
        return None
    mode = core._ctx.progress_mode
    # Only the event-driven blocking mode (distributed-ucxx's default with UCXX patch 0010) sleeps while idle;
    # polling, blocking with polled requests (UCXPY_ENABLE_PYTHON_FUTURE=0, or an event loop without a selector such
    # as uvloop) and the thread modes' progress thread each keep a core busy.
    return mode, mode == "blocking" and bool(getattr(task, "event_driven", False))


def progress_check(role: str) -> None:
    """One line per process: how UCXX waits, and a warning when an idle process will keep a core busy."""
    progress = ucxx_progress()
    if progress is None:
        return
    mode, sleeps = progress
    if sleeps:
        logger.info("ucx-dask-gpu %s: UCXX progress %s, event driven (idle: sleeps)", role, mode)
    else:
        logger.warning("ucx-dask-gpu %s: UCXX progress %s polls: this process keeps a core busy even when idle "
                       "(UCXPY_PROGRESS_MODE=%s, UCXPY_ENABLE_PYTHON_FUTURE=%s, event loop %s)", role, mode,
                       os.environ.get("UCXPY_PROGRESS_MODE", "unset"),
                       os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE", "unset"),
                       type(asyncio.get_running_loop()).__module__)


def worker_setup(worker) -> None:
    plan, host, why = transports.observe(dask.config.config, os.environ)
    logger.info("ucx-dask-gpu %s; %s", transports.summary(plan, host), config_line())
    if why:
        logger.warning("ucx-dask-gpu transports: cannot list UCX's transports here: %s", why)
    for conflict in plan.settings.conflicts:
        logger.warning("ucx-dask-gpu transports: conflicting settings: %s", conflict)
    for warning in plan.warnings:
        logger.warning("ucx-dask-gpu transports: %s", warning)
    facts = transports.peer_facts(plan, host)
    worker.startup_information[KEY] = lambda _worker: facts


async def dask_setup(dask_object) -> None:
    if isinstance(dask_object, Scheduler):
        dask_object.add_plugin(SameHostCuda())
        logger.info("ucx-dask-gpu scheduler: %s", config_line())
    elif isinstance(dask_object, Worker):
        worker_setup(dask_object)
    elif isinstance(dask_object, Nanny):
        add_worker_preloads(dask_object, [__name__])
    if isinstance(dask_object, (Scheduler, Worker, Client)):
        progress_check(type(dask_object).__name__.lower())
        await tuning.apply(dask_object)
