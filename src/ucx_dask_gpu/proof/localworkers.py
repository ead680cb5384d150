"""The worker processes of the LocalCluster a workload starts for itself (no --scheduler), and how it stops them.

A Ctrl-C at the terminal reaches every process of the foreground process group: without SparedWorker each worker
process would die mid-task with a KeyboardInterrupt traceback (4-7 of them, ~200 lines, after the one line). A worker
process ignores it from its first instruction on: its nanny spawns it with SIGINT blocked (exec keeps the mask), and
SparedWorker ignores SIGINT (dropping one already pending) before it unblocks it; ignoring it only once the Worker is
built would leave the child's start-up (site, imports, unpickling) to the traceback.

SparedWorker and SparedNanny subclass distributed's classes, so they are made when first asked for (PEP 562): the
command line starts on the standard library alone, and a worker process finds SparedWorker here by name.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from multiprocessing import resource_tracker


def __getattr__(name: str):
    if name not in ("SparedWorker", "SparedNanny"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from distributed import Nanny, Worker

    class SparedWorker(Worker):
        """A worker that ignores SIGINT: its nanny, in the workload's process, stops it when the workload ends."""

        def __init__(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():  # a worker process's loop runs there
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            super().__init__(*args, **kwargs)

    class SparedNanny(Nanny):
        """The nanny of a SparedWorker process (the nanny itself runs in the workload's process)."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("worker_class", SparedWorker)
            super().__init__(*args, **kwargs)

        async def instantiate(self):
            with sigint_blocked_in_children():
                return await super().instantiate()

    for cls in (SparedWorker, SparedNanny):
        cls.__qualname__ = cls.__name__  # pickled by reference: module + name
        globals()[cls.__name__] = cls
    return globals()[name]


_blocking = threading.local()


@contextlib.contextmanager
def sigint_blocked_in_children():
    """SIGINT blocked in this thread meanwhile, so in the threads it starts and in the processes they spawn (a
    nanny's worker process is spawned by a thread its AsyncProcess starts). Counted per thread: the nannies of one
    cluster start at once on one event loop, and the thread (an event loop's, which never runs Python's signal
    handlers) gets back the mask it had. Python's own resource tracker is started first: starting it unblocks SIGINT
    in the thread that starts it."""
    resource_tracker.ensure_running()
    depth = getattr(_blocking, "depth", 0)
    if depth == 0:
        _blocking.was_blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    _blocking.depth = depth + 1
    try:
        yield
    finally:
        _blocking.depth -= 1
        if _blocking.depth == 0 and not _blocking.was_blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@contextlib.contextmanager
def workers_log_critical_only():
    """Worker processes started meanwhile (they read the environment when they import distributed) log only CRITICAL
    unless this process logs DEBUG (--debug): their ERRORs when the run ends under them (a transfer cut, Ctrl-C) are
    tracebacks about the run's own end, and a task's failure reaches the client, whose one line says it."""
    key, before = "DASK_LOGGING__DISTRIBUTED", os.environ.get("DASK_LOGGING__DISTRIBUTED")
    if logging.getLogger("distributed").getEffectiveLevel() > logging.DEBUG:
        os.environ[key] = "critical"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def quiet_if_interrupted() -> None:
    """On the way out after Ctrl-C/SIGTERM: what distributed logs while the cluster is torn down under running tasks
    (tasks lost, comms cancelled, their tracebacks), and what asyncio reports of the tasks the interrupt left behind
    (a nanny still starting when its cluster closed: 'Task exception was never retrieved ... Nanny failed to start'),
    follows from the user's own interrupt, which the one line already says; --debug keeps it."""
    if isinstance(sys.exc_info()[1], KeyboardInterrupt) and \
            logging.getLogger("distributed").getEffectiveLevel() > logging.DEBUG:
        for name in ("distributed", "asyncio"):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


def close_half_started() -> None:
    """LocalCluster(...) was interrupted while it started: close what it had started, quietly. Left to distributed's
    exit hook, that close fails on the workers still starting and prints a traceback after our one line."""
    from distributed.deploy.spec import SpecCluster

    quiet_if_interrupted()
    instances = getattr(SpecCluster, "_instances", set())
    for cluster in list(instances):
        with contextlib.suppress(BaseException):
            cluster.close(timeout=10)
        instances.discard(cluster)
