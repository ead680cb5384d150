"""The client side shared by the cluster proofs: a Client to a scheduler (checked first: gate/peer.py) or to a
LocalCluster, its workers waited for, libraries imported on every worker before timing, and every wait on the cluster
bounded (Watch). dask and distributed are imported inside functions: `ucx-dask-gpu --help` stays fast.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import logging
import sys
import time
from typing import Callable, Iterator

from ..cliutil import Progress
from ..errors import (ALL_WORKERS_LOST, BINDING_NOT_LOADABLE, ENV_MISMATCH, NO_WORKERS, NOT_A_SCHEDULER,
                      SCHEDULER_LOST, SCHEDULER_UNREACHABLE, WORKLOAD_FAILED, UserError)
from ..gate.daskconfig import QUIET_CLOSE, STARTUP
from ..gate.identity import GUARD, REFUSAL_PREFIX, compare_versions
from ..gate.peer import DIAGNOSIS_S, REPORT_EVERY_S, check_scheduler, parse_address, what_answers
from ..ucx.transports import mapped_libucp
from . import localworkers
from .localworkers import quiet_if_interrupted, workers_log_critical_only

# Relative tolerance for float sums: dask and the client add the same numbers in a different order.
RTOL = 1e-9
# What a cancel looks like: distributed cancels the futures of a lost scheduler (FutureCancelledError, a
# concurrent.futures.CancelledError), and what waits on it may see asyncio's.
CANCELLED = (asyncio.CancelledError, concurrent.futures.CancelledError)
# How often a wait on the cluster looks at it (scheduler still there? workers left?).
POLL_S = 1.0
# How long a run waits, without any worker left, for one to join (the workload CLI's --timeout).
LOST_AFTER_S = 30.0


say = Progress("workload: ")


@contextlib.contextmanager
def connect(scheduler: str | None, protocol: str = "tcp", n_workers: int = 2, threads_per_worker: int = 1,
            timeout: float = 30, min_workers: int = 1, wait_workers: float = 60) -> Iterator:
    """A Client to `scheduler`, or to a LocalCluster (worker processes) speaking `protocol` when None; returned once
    `min_workers` workers are there (waiting up to `wait_workers` seconds)."""
    from distributed import Client

    _add_client_preloads()
    cluster = None
    try:
        try:
            if scheduler is not None:
                client = _scheduler_client(Client, scheduler, timeout)
            else:
                cluster = _local_cluster(protocol, n_workers, threads_per_worker)
                client = Client(cluster, timeout=timeout)
        except ImportError as e:
            raise import_failure(e, scheduler, protocol) from None
        except (OSError, TimeoutError) as e:
            where = scheduler or f"a local {protocol} cluster"
            raise UserError(f"cannot connect to {where}: {e}", SCHEDULER_UNREACHABLE) from None
        try:
            wait_for_workers(client, min_workers, wait_workers)
            try:
                yield client
            except (Exception, *CANCELLED) as e:  # whatever a request raised once the scheduler went away
                watch = Watch(client, "workload", timeout)
                if not isinstance(e, UserError) and watch.scheduler_lost():
                    raise watch.lost() from None
                raise
            finally:
                quiet_if_interrupted()
                if cluster is not None:
                    with contextlib.suppress(Exception):  # best effort: cluster.close() below ends them anyway
                        close_workers(client, cluster, 30)
        finally:
            quiet_if_interrupted()
            close_client(client)
    finally:
        quiet_if_interrupted()
        if cluster is not None:
            cluster.close()


def _add_client_preloads() -> None:
    import dask.config

    # The guard as a client preload: Client(...) imports it before connecting, so this client sends its environment
    # when it registers (gate/guard.py) and a scheduler that checks the contract can accept it, with or without a
    # dask config that says so; and the start-up preload, which applies the client's side of our settings
    # (ucx-dask-gpu.batched-send.client-interval) when the config has them; quietclose, whose one line replaces the
    # traceback of a UCX handshake that timed out.
    preload = dask.config.get("distributed.client.preload", None) or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    missing = [m for m in (GUARD, STARTUP, QUIET_CLOSE) if m not in preload]
    if missing:
        dask.config.set({"distributed.client.preload": preload + missing})


def _scheduler_client(Client, scheduler: str, timeout: float):
    """A Client to the scheduler at `scheduler`, checked first (gate/peer.py)."""
    addr = parse_address(scheduler)
    start = time.monotonic()
    if check_scheduler(addr, timeout) is None:  # UCX: only reachable so far; the Client tries for real
        return _ucx_client(Client, addr, timeout)
    return Client(str(addr), timeout=max(timeout - (time.monotonic() - start), 5))


def _local_cluster(protocol: str, n_workers: int, threads_per_worker: int):
    """A LocalCluster of worker processes; the workers of one that failed to start are ended."""
    from distributed import LocalCluster

    try:
        with workers_log_critical_only():
            return LocalCluster(protocol=protocol, n_workers=n_workers, threads_per_worker=threads_per_worker,
                                dashboard_address=":0", worker_class=localworkers.SparedNanny)
    except BaseException:
        localworkers.close_half_started()
        raise


def close_client(client) -> None:
    """Close the Client, best effort: the run's outcome (its answer, or the one line saying why there is none) is
    already decided. Once the scheduler is gone distributed's close first tries to reconnect and raises what that
    connect raised, over UCX a UCXX error such as UCXXRejectedError ("rejected by remote peer"), not an OSError."""
    with contextlib.suppress(Exception, *CANCELLED):
        client.close()


def import_failure(e: ImportError, scheduler: str | None, protocol: str) -> UserError:
    """What an ImportError from Client(...) means: distributed's way to refuse a client (our guard's refusal, which
    says so itself: ENV_MISMATCH), or a library this process could not load (BINDING_NOT_LOADABLE)."""
    text = str(e)
    if text.startswith(REFUSAL_PREFIX):
        return UserError(text, ENV_MISMATCH)
    scheme_ = scheme(scheduler) if scheduler is not None else protocol
    if scheme_ in ("ucx", "ucxx"):
        return UserError(f"UCX binding not loadable: {type(e).__name__}: {text}; UCXX's libucxx.so needs our UCX's "
                         "libucp.so.0 loaded or on the loader path: set up this Python with `ucx-src-build/build.sh "
                         "install-ucxx --python PYTHON --wheels DIR --ucx-prefix DIR` (docs/environment-gate.md)",
                         BINDING_NOT_LOADABLE)
    return UserError(f"a library the client needs is not loadable: {type(e).__name__}: {text}", BINDING_NOT_LOADABLE)


def close_workers(client, cluster, timeout: float) -> str:
    """Close a local cluster's workers while its scheduler still serves them; the scheduler is closed after.

    A scheduler that closes with workers attached connects to each nanny to stop it while the nannies close: UCXX
    (0.51) then fails that connection's handshake in its listener handler, and the process holding the nannies and
    the scheduler may die of corrupted memory a moment later (SIGSEGV, about 1 in 40 teardowns on a loaded host)."""
    cluster.scale(0)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not cluster.workers and not client.scheduler_info(n_workers=-1)["workers"]:
            return "workers closed"
        time.sleep(0.05)
    raise TimeoutError(f"workers still registered after {timeout:.0f} s")


def _ucx_client(Client, addr, timeout: float):
    """A Client over UCX, or one line saying what answered instead (NOT_A_SCHEDULER)."""
    start = time.monotonic()
    diagnosis = min(DIAGNOSIS_S, timeout * 0.3)
    try:
        return Client(str(addr), timeout=max(timeout - diagnosis, 1))
    except (OSError, TimeoutError) as e:
        failed = str(e) or type(e).__name__
        kind, what = what_answers(addr, max(timeout - (time.monotonic() - start), 1))
        said = f"{what} within {time.monotonic() - start:.0f} s" if kind == "silent" else what
        raise UserError(f"no Dask scheduler over UCX at {addr}: {failed}; on that port, {said}",
                        NOT_A_SCHEDULER) from None


def wait_for_workers(client, wanted: int, timeout: float) -> int:
    """Wait until `wanted` workers have joined, saying so every REPORT_EVERY_S; NO_WORKERS after `timeout`."""
    start = time.monotonic()
    last = None
    watch = Watch(client, "wait for workers", timeout)
    while True:
        have = watch.workers()
        waited = time.monotonic() - start
        if have >= wanted:
            if last is not None:
                say(f"{have} worker(s) joined after {waited:.0f} s")
            return have
        if waited >= timeout:
            raise UserError(f"{have} of {wanted} worker(s) joined the scheduler at {client.scheduler.address} within "
                            f"{timeout:.0f} s (--wait-workers): start workers with `dask worker "
                            f"{client.scheduler.address}`, or check their logs", NO_WORKERS)
        if last is None or time.monotonic() - last >= REPORT_EVERY_S:
            last = time.monotonic()
            say(f"waiting for workers at {client.scheduler.address}: {have} of {wanted} joined "
                f"({waited:.0f} s of {timeout:.0f} s)")
        time.sleep(0.25)


def warm_up(client, modules: tuple[str, ...], watch: "Watch | None" = None) -> None:
    """Import the workload's libraries on every worker first, so wall time measures the work, not imports. As tasks
    (worker threads), not `client.run` (the event loop), so heartbeats keep flowing during slow imports."""
    watch = watch or Watch(client, "warm-up", LOST_AFTER_S)
    addresses = list(watch.call(client.scheduler_info, n_workers=-1)["workers"])
    # allow_other_workers: a worker killed during warm-up must not leave its pinned task waiting forever.
    watch.results([client.submit(_import_all, modules, workers=[a], allow_other_workers=True, pure=False)
                   for a in addresses])


def start_run(client, what: str, modules: tuple[str, ...], timeout: float) -> tuple["Watch", dict]:
    """A workload's Watch (`timeout`: how long it waits without any worker), once every role's versions are compared
    and `modules` imported on every worker; the fields of the result every workload reports."""
    watch = Watch(client, what, timeout)
    versions = compare_versions(watch.call(client.get_versions, check=False))
    warm_up(client, modules, watch)
    return watch, {"protocol": scheme(client.scheduler.address), "scheduler": client.scheduler.address,
                   "workers_start": watch.workers(), "versions_identical": versions["identical"],
                   "version_differences": versions["differences"]}


def _import_all(modules):
    for name in modules:
        importlib.import_module(name)


def ucx_loaded() -> dict:
    """Which UCX this process runs on: the libucp.so it has mapped and the version UCXX reports (None when no UCX)."""
    path = mapped_libucp()
    ucxx = sys.modules.get("ucxx")
    version = ".".join(map(str, ucxx.get_ucx_version())) if ucxx is not None else None
    return {"libucp": path, "ucx_version": version}


def ucx_in_roles(client, watch: "Watch") -> dict:
    """ucx_loaded() of the client, the scheduler and every worker."""
    return {"client": ucx_loaded(), "scheduler": watch.call(client.run_on_scheduler, ucx_loaded),
            "workers": watch.call(client.run, ucx_loaded)}


def scheme(address: str) -> str:
    return address.split("://", 1)[0] if "://" in address else "tcp"


class Watch:
    """Every wait of a workload on the cluster, bounded, and saying every REPORT_EVERY_S that it still waits: the
    scheduler lost (its connection closed: stopped, killed, unreachable) is SCHEDULER_LOST at once; no worker left
    (all died mid-run) and none joined within `timeout` seconds, ALL_WORKERS_LOST; a task that raised,
    WORKLOAD_FAILED. A computation that still has workers may take as long as it takes: it is not a hang, and it says
    so."""

    def __init__(self, client, what: str, timeout: float):
        self.client, self.what, self.timeout = client, what, timeout
        self.start = time.monotonic()
        self._reported = self.start
        self._no_workers_since: float | None = None

    def scheduler_lost(self) -> bool:
        comm = getattr(self.client, "scheduler_comm", None)
        return self.client.status != "running" or comm is None or comm.comm.closed()

    def lost(self) -> UserError:
        # The client's reconnect attempts end in a logged traceback when the client closes under them: our line says
        # what happened (still shown with --debug).
        if logging.getLogger("distributed").getEffectiveLevel() > logging.DEBUG:
            logging.getLogger("distributed.client").setLevel(logging.CRITICAL)
        return UserError(f"scheduler lost: the connection to {self.client.scheduler.address} closed during the "
                         f"{self.what} (the scheduler stopped, or its host is unreachable)", SCHEDULER_LOST)

    def workers(self) -> int:
        """Workers the scheduler has now (asked, not the client's cached view); SCHEDULER_LOST when it cannot say."""
        if self.scheduler_lost():
            raise self.lost()
        try:
            info = self.client.sync(self.client.scheduler.identity, n_workers=-1,
                                    callback_timeout=max(min(self.timeout, 10), 1))
        except (OSError, TimeoutError, *CANCELLED) as e:  # the client cancels what waits on a lost scheduler
            if self.scheduler_lost():
                raise self.lost() from None
            raise UserError(f"scheduler lost: {self.client.scheduler.address} did not answer during the "
                            f"{self.what} ({type(e).__name__}: {e})", SCHEDULER_LOST) from None
        return len(info.get("workers") or {})

    def check(self) -> None:
        """One look at the cluster: raises when the wait must end, reports progress when it is time."""
        have = self.workers()
        now = time.monotonic()
        if have:
            self._no_workers_since = None
        elif self._no_workers_since is None:
            self._no_workers_since = now
        elif now - self._no_workers_since >= self.timeout:
            raise UserError(f"all workers lost: the scheduler at {self.client.scheduler.address} has had no worker "
                            f"for {now - self._no_workers_since:.0f} s (--timeout {self.timeout:g} s) during the "
                            f"{self.what}", ALL_WORKERS_LOST)
        if now - self._reported >= REPORT_EVERY_S:
            self._reported = now
            if have:
                say(f"{self.what}: still running after {now - self.start:.0f} s on {have} worker(s)")
            else:
                say(f"{self.what}: no worker left at {self.client.scheduler.address} for "
                    f"{now - self._no_workers_since:.0f} s; waiting up to {self.timeout:g} s (--timeout) for one to "
                    "join")

    def call(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), a request to the scheduler: not sent once the scheduler is lost (dask would retry
        connecting for its whole connect timeout), and its failure then is SCHEDULER_LOST."""
        if self.scheduler_lost():
            raise self.lost()
        try:
            return fn(*args, **kwargs)
        except (OSError, *CANCELLED):  # CommClosedError included; the client cancels what waits on a lost one
            if self.scheduler_lost():
                raise self.lost() from None
            raise

    def results(self, futures: list) -> list:
        """The futures' results, waiting as the class says."""
        from distributed import wait  # heavy: only where a workload runs

        pending = list(futures)
        while True:
            try:
                wait(pending, timeout=POLL_S)
                return [self._value(f) for f in pending]
            except TimeoutError:
                pass
            except CANCELLED:  # distributed's FuturesCancelledError: the client cancelled them
                return [self._value(f) for f in pending]
            self.check()

    def result(self, future):
        return self.results([future])[0]

    def _value(self, future):
        try:
            return future.result()
        except BaseException as e:  # what the task raised, KilledWorker, or a cancel (a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            if self.scheduler_lost() or "scheduler-connection-lost" in str(e):
                raise self.lost() from None
            raise UserError(f"{self.what} failed on the cluster: {type(e).__name__}: {e}", WORKLOAD_FAILED) from None
