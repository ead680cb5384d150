"""The client side shared by the cluster proofs: a Client to a scheduler (checked first: proof/peer.py) or to a
LocalCluster, waiting for its workers, the workers it sees, libraries imported on every worker before timing, and a
cluster's failure as one line.

Heavy imports (dask, distributed, the guard that imports them) stay inside functions so `ucx-dask-gpu --help` stays
fast.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
import time
from typing import Callable, Iterator

from ..errors import ENV_MISMATCH, NO_WORKERS, NOT_A_SCHEDULER, SCHEDULER_UNREACHABLE, WORKLOAD_FAILED, UserError
from ..gate.identity import GUARD
from ..gate.daskconfig import STARTUP
from ..ucx.transports import mapped_libucp
from .peer import DIAGNOSIS_S, check_scheduler, parse_address, what_answers

# Relative tolerance for float sums: dask and the client add the same numbers in a different order.
RTOL = 1e-9


def say(msg: str) -> None:
    print(f"workload: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def connect(scheduler: str | None, protocol: str = "tcp", n_workers: int = 2, threads_per_worker: int = 1,
            timeout: float = 30, min_workers: int = 1, wait_workers: float = 60) -> Iterator:
    """A Client to `scheduler`, or to a LocalCluster (worker processes) speaking `protocol` when None; returned once
    `min_workers` workers are there (waiting up to `wait_workers` seconds)."""
    import dask.config
    from distributed import Client, LocalCluster

    # The guard as a client preload: Client(...) imports it before connecting, so this client sends its environment
    # when it registers (gate/guard.py) and a scheduler that checks the contract can accept it, with or without a
    # dask config that says so; and the start-up preload, which applies the client's side of our settings
    # (ucx-dask-gpu.batched-send.client-interval) when the config has them.
    preload = dask.config.get("distributed.client.preload", None) or []
    preload = [preload] if isinstance(preload, str) else list(preload)
    missing = [m for m in (GUARD, STARTUP) if m not in preload]
    if missing:
        dask.config.set({"distributed.client.preload": preload + missing})

    cluster = None
    try:
        try:
            if scheduler:
                addr = parse_address(scheduler)
                start = time.monotonic()
                if check_scheduler(addr, timeout) is None:  # UCX: only reachable so far; the Client tries for real
                    client = _ucx_client(Client, addr, timeout)
                else:
                    client = Client(str(addr), timeout=max(timeout - (time.monotonic() - start), 5))
            else:
                cluster = LocalCluster(protocol=protocol, n_workers=n_workers,
                                       threads_per_worker=threads_per_worker, dashboard_address=":0")
                client = Client(cluster, timeout=timeout)
        except ImportError as e:  # distributed's way to refuse a client: our guard said the environments differ
            raise UserError(str(e), ENV_MISMATCH) from None
        except (OSError, TimeoutError) as e:
            where = scheduler or f"a local {protocol} cluster"
            raise UserError(f"cannot connect to {where}: {e}", SCHEDULER_UNREACHABLE) from None
        with client:
            wait_for_workers(client, min_workers, wait_workers)
            try:
                yield client
            finally:
                if cluster is not None:
                    with contextlib.suppress(Exception):  # best effort: cluster.close() below ends them anyway
                        close_workers(client, cluster, 30)
    finally:
        if cluster is not None:
            cluster.close()


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


def wait_for_workers(client, wanted: int, timeout: float, report: Callable[[str], None] = say,
                     every: float = 10) -> int:
    """Wait until `wanted` workers have joined, saying so every `every` seconds; NO_WORKERS after `timeout`."""
    start = time.monotonic()
    last = None
    while True:
        have = n_workers(client)
        waited = time.monotonic() - start
        if have >= wanted:
            if last is not None:
                report(f"{have} worker(s) joined after {waited:.0f} s")
            return have
        if waited >= timeout:
            raise UserError(f"{have} of {wanted} worker(s) joined the scheduler at {client.scheduler.address} within "
                            f"{timeout:.0f} s (--wait-workers): start workers with `dask worker "
                            f"{client.scheduler.address}`, or check their logs", NO_WORKERS)
        if last is None or time.monotonic() - last >= every:
            last = time.monotonic()
            report(f"waiting for workers at {client.scheduler.address}: {have} of {wanted} joined "
                   f"({waited:.0f} s of {timeout:.0f} s)")
        time.sleep(0.25)


def n_workers(client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


def warm_up(client, modules: tuple[str, ...]) -> None:
    """Import the workload's libraries on every worker first, so wall time measures the work, not imports.

    As tasks (worker threads), not `client.run` (the event loop), so heartbeats keep flowing during slow imports.
    """
    addresses = list(client.scheduler_info(n_workers=-1)["workers"])
    # allow_other_workers: a worker killed during warm-up must not leave its pinned task waiting forever.
    client.gather([client.submit(_import_all, modules, workers=[a], allow_other_workers=True, pure=False)
                   for a in addresses])


def _import_all(modules):
    for name in modules:
        importlib.import_module(name)


def ucx_loaded() -> dict:
    """Which UCX this process runs on: the libucp.so it has mapped and the version UCXX reports (None when no UCX)."""
    path = mapped_libucp()
    ucxx = sys.modules.get("ucxx")
    version = ".".join(map(str, ucxx.get_ucx_version())) if ucxx is not None else None
    return {"libucp": path, "ucx_version": version}


def ucx_in_roles(client) -> dict:
    """ucx_loaded() of the client, the scheduler and every worker."""
    return {"client": ucx_loaded(), "scheduler": client.run_on_scheduler(ucx_loaded),
            "workers": client.run(ucx_loaded)}


def scheme(address: str) -> str:
    return address.split("://", 1)[0] if "://" in address else "tcp"


def on_cluster(what: str, future, timeout: float | None = None):
    """A future's result; a computation that fails on the cluster is one line and its own exit code."""
    try:
        return future.result(timeout)
    except Exception as e:  # whatever the task raised, or KilledWorker after too many worker deaths
        raise UserError(f"{what} failed on the cluster: {type(e).__name__}: {e}", WORKLOAD_FAILED) from None
