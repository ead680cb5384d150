"""The client side shared by the cluster proofs: a Client to a scheduler or to a LocalCluster, the workers it sees,
libraries imported on every worker before timing, and a cluster's failure as one line.

Heavy imports (dask, distributed) stay inside functions so `ucx-dask-gpu --help` stays fast.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

from ..errors import ENV_MISMATCH, SCHEDULER_UNREACHABLE, WORKLOAD_FAILED, UserError

# Relative tolerance for float sums: dask and the client add the same numbers in a different order.
RTOL = 1e-9


@contextlib.contextmanager
def connect(scheduler: str | None, protocol: str = "tcp", n_workers: int = 2,
            threads_per_worker: int = 1, timeout: float = 30) -> Iterator:
    """A Client to `scheduler`, or to a LocalCluster (worker processes) speaking `protocol` when None."""
    from distributed import Client, LocalCluster

    cluster = None
    try:
        try:
            if scheduler:
                client = Client(scheduler, timeout=timeout)
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
            yield client
    finally:
        if cluster is not None:
            cluster.close()


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
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libucp.so" in line), None)
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
