"""A dask-cuda LocalCUDACluster that applies a topology plan per worker, and its life as `ucx-dask-gpu cluster`.

dask-cuda 26.10 gives each worker its rotated CUDA_VISIBLE_DEVICES and pins it to NVML's CPU affinity (to every CPU,
with a warning, where NVML answers Not Supported -- as in a Firecracker VM); it sets no NIC and one UCX config for
all. `TopologyCUDACluster` keeps dask-cuda's worker (device/host spilling, RMM and pre-import plugins, the
`dask_cuda.initialize` preload) and replaces, per worker, what the plan measured: the CPUAffinity plugin (the plan's
cores, limited to what this process may use); `env`, which the Nanny applies before UCX starts and distributed-ucxx
lets win over dask config (UCX_TLS, CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER=PCI_BUS_ID, and UCX_NET_DEVICES only
with `net_devices=True`); `interface`, the nearest NIC's IP interface when it has an IPv4 address. The scheduler
listens on the first worker's interface; the client/scheduler UCX config comes from dask-cuda's flags (tcp, nvlink
when cuda_ipc is used, infiniband when rc is).

dask-cuda loads CUDA libraries and UCX when it is imported, so the class is made on first use (`cluster_class`):
`ucx-dask-gpu topology` and `cluster --dry-run` run where dask-cuda is not installed.
"""
from __future__ import annotations

import functools
import json
import signal
import sys
import threading
import time
from pathlib import Path

from ..errors import TOPOLOGY_CLUSTER_FAILED, UserError
from ..fsutil import write_output_file
from .machine import from_machine
from .plan import Plan, WorkerSettings, make_plan, worker_settings


@functools.cache
def cluster_class() -> type:
    """TopologyCUDACluster (a LocalCUDACluster subclass); ImportError where dask-cuda is missing."""
    from dask_cuda import LocalCUDACluster  # heavy and optional: see the module docstring
    from dask_cuda.plugins import CPUAffinity

    class TopologyCUDACluster(LocalCUDACluster):
        """LocalCUDACluster with one worker per planned GPU and the plan's per-worker settings."""

        def __init__(self, plan: Plan, *, pin_cpus: bool = True, settings: list[WorkerSettings] | None = None,
                     **kwargs):
            if not plan.workers:
                raise ValueError("the plan has no workers")
            self.topology_plan = plan
            self.settings = {s.name: s for s in (settings or worker_settings(plan, pin=pin_cpus))}
            protocol = kwargs.pop("protocol", plan.protocol)
            if protocol in ("ucx", "ucxx"):
                kwargs.setdefault("enable_tcp_over_ucx", True)
                kwargs.setdefault("enable_nvlink", plan.uses("cuda_ipc"))
                kwargs.setdefault("enable_infiniband", plan.uses("rc"))
            if "interface" not in kwargs and "host" not in kwargs:
                first = self.settings[plan.workers[0].name].interface
                if first:
                    kwargs["interface"] = first
            super().__init__(CUDA_VISIBLE_DEVICES=[w.gpu for w in plan.workers], protocol=protocol, **kwargs)

        def new_worker_spec(self):
            spec = super().new_worker_spec()
            ((name, worker),) = spec.items()
            s = self.settings[name]
            opts = worker["options"]
            opts["env"] = {**opts.get("env", {}), **s.env}
            plugins = {p for p in opts.get("plugins", ()) if not isinstance(p, CPUAffinity)}
            if s.cores:
                plugins.add(CPUAffinity(list(s.cores)))
            opts["plugins"] = plugins
            if s.interface:
                opts["interface"] = s.interface
                opts["host"] = None
            return spec

    TopologyCUDACluster.__module__ = __name__
    TopologyCUDACluster.__qualname__ = "TopologyCUDACluster"
    return TopologyCUDACluster


def __getattr__(name: str):
    """`from ucx_dask_gpu.topology.cluster import TopologyCUDACluster` makes the class then."""
    if name == "TopologyCUDACluster":
        return cluster_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def topology_cluster(gpus: str = "all", protocol: str = "ucx", net_devices: bool = False, topology=None,
                     pin_cpus: bool = True, **kwargs):
    """Plan from this machine (or the given `Topology`) and start the cluster: the Python entry point."""
    topo = topology if topology is not None else from_machine()
    plan = make_plan(topo, gpus=gpus, protocol=protocol, net_devices=net_devices)
    return cluster_class()(plan, pin_cpus=pin_cpus, **kwargs)


class _Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _root_cause(e: BaseException) -> BaseException:
    root = e
    for _ in range(20):
        nxt = root.__cause__ or root.__context__
        if nxt is None:
            break
        root = nxt
    return root


def serve(plan: Plan, settings: list[WorkerSettings], *, scheduler_file: str | None = None,
          dashboard: str | None = None, **kwargs) -> int:
    """Start the cluster, print its scheduler address (and write `scheduler_file`), run until SIGINT/SIGTERM, stop.
    UserError(TOPOLOGY_CLUSTER_FAILED) with one line when it cannot start (the root cause named), when a signal arrives
    while it starts, or when it stops on its own."""
    try:
        cls = cluster_class()
    except ImportError as e:
        raise UserError(f"cannot start the cluster: {e} (install dask-cuda and distributed-ucxx)",
                        TOPOLOGY_CLUSTER_FAILED) from None
    stop = threading.Event()
    received: list[int] = []
    started = threading.Event()

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()
        if not started.is_set():       # still starting: abort the start (distributed cleans up what it began)
            raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.monotonic()
    try:
        try:
            cluster = cls(plan, settings=settings, dashboard_address=dashboard, **kwargs)
        except _Interrupted as e:
            name = signal.Signals(e.signum).name
            raise UserError(f"{name} while the cluster was starting: stopped", TOPOLOGY_CLUSTER_FAILED) from None
        except Exception as e:  # dask raises many types; the user gets one line, with the root cause
            root = _root_cause(e)
            why = f" (root cause: {type(root).__name__}: {root})" if root is not e else ""
            raise UserError(f"cluster did not start: {type(e).__name__}: {e}{why}", TOPOLOGY_CLUSTER_FAILED) from None
        started.set()
        try:
            address = cluster.scheduler_address
            print(f"scheduler: {address}", flush=True)
            if dashboard:
                print(f"dashboard: {cluster.dashboard_link}", flush=True)
            print(f"{len(cluster.workers)} worker(s) up in {time.monotonic() - t0:.1f} s; "
                  "SIGINT/SIGTERM stops the cluster", flush=True)
            if scheduler_file:
                write_output_file(scheduler_file, json.dumps(
                    {"type": "Scheduler", "address": address, "workers": len(cluster.workers)}) + "\n")
            while not stop.wait(1.0):
                if cluster.status.name in ("closed", "closing", "failed"):
                    raise UserError(f"the cluster stopped on its own (status {cluster.status.name})",
                                    TOPOLOGY_CLUSTER_FAILED)
        finally:
            if scheduler_file:
                Path(scheduler_file).unlink(missing_ok=True)
            cluster.close(timeout=60)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    name = signal.Signals(received[0]).name if received else "signal"
    print(f"cluster stopped ({name})", file=sys.stderr)
    return 0
