"""A dask-cuda LocalCUDACluster that applies a topology plan per worker.

dask-cuda 26.10 gives each worker its rotated CUDA_VISIBLE_DEVICES and pins it to NVML's CPU affinity (to every CPU,
with a warning, where NVML answers Not Supported -- as in a Firecracker VM); it sets no NIC and one UCX config for
all. `TopologyCUDACluster` keeps dask-cuda's worker (device/host spilling, RMM and pre-import plugins, the
`dask_cuda.initialize` preload) and replaces, per worker, what the plan measured:

- the CPUAffinity plugin: the plan's cores (NVML, or sysfs local_cpulist), limited to what this process may use;
- `env` (the Nanny applies it in the worker process before UCX starts): UCX_NET_DEVICES (nearest NIC), UCX_TLS,
  CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER=PCI_BUS_ID; distributed-ucxx lets the environment win over dask config;
- `interface`: the nearest NIC's IP interface, when it has an IPv4 address.

The scheduler listens on the first worker's interface (127.0.0.1 when that has no address), and the client/scheduler
UCX config comes from dask-cuda's flags (tcp, nvlink when cuda_ipc is used, infiniband when rc is).
"""
from __future__ import annotations

from dask_cuda import LocalCUDACluster
from dask_cuda.plugins import CPUAffinity

from .topology import Plan, WorkerSettings, from_machine, make_plan, worker_settings


class TopologyCUDACluster(LocalCUDACluster):
    """LocalCUDACluster with one worker per planned GPU and the plan's per-worker settings.

    >>> plan = make_plan(from_machine(), gpus="auto")
    >>> cluster = TopologyCUDACluster(plan)          # protocol from the plan (ucx by default)
    """

    def __init__(self, plan: Plan, *, pin_cpus: bool = True, settings: list[WorkerSettings] | None = None,
                 **kwargs):
        if not plan.workers:
            raise ValueError("the plan has no workers")
        self.topology_plan = plan
        self.settings = {s.name: s for s in (settings or worker_settings(plan, pin=pin_cpus))}
        protocol = kwargs.pop("protocol", plan.protocol)
        if protocol in ("ucx", "ucxx"):
            kwargs.setdefault("enable_tcp_over_ucx", True)
            kwargs.setdefault("enable_nvlink", plan.uses_cuda_ipc)
            kwargs.setdefault("enable_infiniband", plan.uses_infiniband)
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


def topology_cluster(gpus: str = "all", protocol: str = "ucx", net_devices: bool = True, topology=None,
                     pin_cpus: bool = True, **kwargs) -> TopologyCUDACluster:
    """Plan from this machine (or the given `Topology`) and start the cluster: the Python entry point."""
    topo = topology if topology is not None else from_machine()
    plan = make_plan(topo, gpus=gpus, protocol=protocol, net_devices=net_devices)
    return TopologyCUDACluster(plan, pin_cpus=pin_cpus, **kwargs)
