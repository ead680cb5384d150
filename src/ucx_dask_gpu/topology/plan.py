"""The Dask worker plan made from a Topology: one worker per GPU with its cores, NUMA node, nearest NIC, Dask
interface and `UCX_TLS` (and, asked for, `UCX_NET_DEVICES`); the GPU pairs without NVLink and the largest fully
NVLink-connected subset (`gpus="auto"` keeps to it, so Dask avoids the slow pairs); and what this host lets each
worker apply.

`UCX_NET_DEVICES` is left to UCX unless `net_devices=True` (`--net-devices`): UCX >= 1.11 pairs each GPU with its
nearest NIC itself, and dask-cuda deprecated setting the variable per worker (`ucx_net_devices="auto"`: it "can cause
hangs"). CPU affinity and the Dask interface stay in the plan.
"""
from __future__ import annotations

import itertools
import os
import socket
from dataclasses import asdict, dataclass

from ..errors import USAGE, UserError
from ..report import format_table
from .model import PCI_LEVELS, NicInfo, Topology, format_cpulist


# --- plan --------------------------------------------------------------------------------------------------------

@dataclass
class WorkerPlan:
    name: int                        # worker name = its GPU index (as dask-cuda names them)
    gpu: int
    cuda_visible_devices: str        # its GPU first, then the others (dask-cuda's rotation)
    cpus: list[int] | None
    cpus_source: str | None
    numa_nodes: list[int] | None
    nic: str | None
    nic_distance: str | None
    interface: str | None            # Dask listen interface (the NIC's IP interface)
    env: dict[str, str]


@dataclass
class Plan:
    topology: Topology
    protocol: str
    selection: str                   # "all", "auto" or the list given
    selected: list[int]
    selection_reason: str
    largest_nvlink_subset: list[int]
    workers: list[WorkerPlan]
    notes: list[str]

    def uses(self, transport: str) -> bool:
        """Whether a worker's UCX_TLS names `transport` (rc: InfiniBand, cuda_ipc: NVLink)."""
        return any(transport in w.env.get("UCX_TLS", "").split(",") for w in self.workers)

    def to_dict(self) -> dict:
        return {
            "topology": self.topology.to_dict(),
            "protocol": self.protocol,
            "selection": {"mode": self.selection, "gpus": self.selected, "reason": self.selection_reason},
            "pairs_without_nvlink": [{"gpus": [i, j], "connection": lvl}
                                     for i, j, lvl in self.topology.pairs_without_nvlink()],
            "largest_nvlink_subset": self.largest_nvlink_subset,
            "workers": [asdict(w) | {"cpus": format_cpulist(w.cpus), "numa_nodes": format_cpulist(w.numa_nodes)}
                        for w in self.workers],
            "notes": self.notes,
        }


def largest_nvlink_subset(topo: Topology) -> list[int]:
    """Largest set of GPUs in which every pair has NVLink; ties: most links, fewest NUMA nodes, lowest indices. Empty
    when no pair has NVLink. Exhaustive search: fine for the <= 16 GPUs of one host."""
    idx = sorted(g.index for g in topo.gpus)
    if len(idx) > 20:
        raise UserError(f"{len(idx)} GPUs: too many for the exhaustive NVLink subset search", USAGE)
    for size in range(len(idx), 1, -1):
        best = None
        for combo in itertools.combinations(idx, size):
            if all(topo.nvlinks(i, j) for i, j in itertools.combinations(combo, 2)):
                links = sum(topo.nvlinks(i, j) for i, j in itertools.combinations(combo, 2))
                numa = {tuple(topo.gpu(i).numa_nodes or ()) for i in combo}
                key = (-links, len(numa), combo)
                if best is None or key < best:
                    best = key
        if best is not None:
            return list(best[2])
    return []


def parse_gpu_selection(spec: str, topo: Topology) -> tuple[str, list[int] | None]:
    spec = spec.strip().lower()
    if spec in ("all", "auto"):
        return spec, None
    try:
        wanted = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--gpus: expected 'all', 'auto' or indices like 0,1,2, got {spec!r}", USAGE) from None
    known = {g.index for g in topo.gpus}
    unknown = [i for i in wanted if i not in known]
    if not wanted or unknown or len(set(wanted)) != len(wanted):
        raise UserError(f"--gpus {spec}: this host has GPUs {sorted(known)}"
                        + (f"; {unknown} not among them" if unknown else "; give each GPU once"), USAGE)
    return "list", wanted


def _nearest_nic(topo: Topology, gpu: int) -> tuple[NicInfo | None, str | None]:
    """RDMA NICs when there are any (UCX rc beats TCP at any PCIe distance), else Ethernet; nearest by PCIe level."""
    nics = [n for n in topo.nics if n.kind == "ib" and n.port_state in (None, "ACTIVE")] or \
        [n for n in topo.nics if n.kind == "eth"]
    if not nics:
        return None, None
    rank = {lvl: r for r, lvl in enumerate(PCI_LEVELS)}

    def key(n: NicInfo):
        lvl = topo.gpu_nic.get((gpu, n.name))
        return (rank.get(lvl, len(PCI_LEVELS)), n.name)

    best = min(nics, key=key)
    return best, topo.gpu_nic.get((gpu, best.name))


def make_plan(topo: Topology, gpus: str = "all", protocol: str = "ucx", net_devices: bool = False) -> Plan:
    if protocol not in ("ucx", "ucxx", "tcp"):
        raise UserError(f"protocol {protocol!r}: expected ucx or tcp", USAGE)
    mode, chosen = parse_gpu_selection(gpus, topo)
    subset = largest_nvlink_subset(topo)
    every = sorted(g.index for g in topo.gpus)
    missing = topo.pairs_without_nvlink()
    if mode == "list":
        selected, reason = chosen, "given"
    elif mode == "auto" and len(subset) >= 2:
        selected = subset
        reason = ("largest fully NVLink-connected subset" if len(subset) < len(every)
                  else "every GPU pair has NVLink")
    elif mode == "auto":
        selected, reason = every, "no GPU pair has NVLink: all GPUs"
    else:
        selected, reason = every, "all GPUs"
    notes = list(topo.notes)
    sel_missing = [(i, j, lvl) for i, j, lvl in missing if i in selected and j in selected]
    if sel_missing and len(subset) >= 2:
        notes.append(f"{len(sel_missing)} selected GPU pair(s) have no NVLink (PCIe/SMP, ~10x slower); "
                     f"--gpus auto keeps to {','.join(map(str, subset))}")
    workers = []
    for pos, gi in enumerate(selected):
        g = topo.gpu(gi)
        nic, dist = _nearest_nic(topo, gi)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, selected[pos:] + selected[:pos])),
               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        if protocol in ("ucx", "ucxx"):
            tls = (["rc"] if nic is not None and nic.kind == "ib" else []) + ["tcp", "cuda_copy"]
            if len(selected) > 1:
                tls.append("cuda_ipc")
            env["UCX_TLS"] = ",".join(tls)
            dev = nic.ucx_net_devices() if nic is not None else None
            if net_devices and dev:
                env["UCX_NET_DEVICES"] = dev
        workers.append(WorkerPlan(
            name=gi, gpu=gi, cuda_visible_devices=env["CUDA_VISIBLE_DEVICES"], cpus=g.cpus,
            cpus_source=g.cpus_source, numa_nodes=g.numa_nodes, nic=nic.name if nic else None, nic_distance=dist,
            interface=nic.netdev if nic else None, env=env))
    if protocol in ("ucx", "ucxx") and net_devices:
        if any(n.kind == "ib" and n.rdma_device is None for n in topo.nics if n.name in {w.nic for w in workers}):
            notes.append("the RDMA device behind an IPoIB interface is not named in the input: "
                         "UCX_NET_DEVICES left to UCX for those workers")
    if not topo.nics:
        notes.append("no NIC found: workers use UCX's default devices and Dask's default interface")
    return Plan(topology=topo, protocol=protocol, selection=mode if mode != "list" else gpus, selected=selected,
                selection_reason=reason, largest_nvlink_subset=subset, workers=workers, notes=notes)


@dataclass
class WorkerSettings:
    """What the cluster applies to one worker on THIS host (the plan, checked against what the host allows)."""
    name: int
    env: dict[str, str]
    cores: list[int] | None          # None: not pinned
    interface: str | None            # None: the cluster's default address
    notes: list[str]


def worker_settings(plan: Plan, allowed_cpus: set[int] | None = None, ipv4=None, pin: bool = True) -> list[WorkerSettings]:
    """Per worker: env, cores (the plan's cores this process may use) and interface (only if it has an IPv4 address).
    `allowed_cpus` defaults to this process's affinity; `ipv4(ifname) -> str | None` to a psutil lookup."""
    if allowed_cpus is None:
        allowed_cpus = set(os.sched_getaffinity(0))
    if ipv4 is None:
        ipv4 = interface_ipv4
    out = []
    for w in plan.workers:
        notes = []
        cores = None
        if pin and w.cpus:
            usable = sorted(set(w.cpus) & set(allowed_cpus))
            if usable:
                cores = usable
                if len(usable) < len(w.cpus):
                    notes.append(f"{len(w.cpus) - len(usable)} of its cores are outside this process's affinity")
            else:
                notes.append(f"none of cores {format_cpulist(w.cpus)} is usable here: not pinned")
        iface = None
        env = dict(w.env)
        if w.interface:
            if ipv4(w.interface):
                iface = w.interface
            else:
                notes.append(f"{w.interface} has no IPv4 address: Dask listens on the cluster's default address")
                # UCX's tcp transport cannot use an interface without an address: keep only the RDMA port
                devs = [d for d in env.get("UCX_NET_DEVICES", "").split(",") if d and d != w.interface]
                if devs:
                    env["UCX_NET_DEVICES"] = ",".join(devs)
                elif "UCX_NET_DEVICES" in env:
                    del env["UCX_NET_DEVICES"]
                    notes.append("UCX_NET_DEVICES not set")
        out.append(WorkerSettings(name=w.name, env=env, cores=cores, interface=iface, notes=notes))
    return out


def interface_ipv4(ifname: str) -> str | None:
    import psutil  # third-party (it comes with distributed): only where a plan is applied on this host

    for addr in psutil.net_if_addrs().get(ifname, []):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


def render_settings(settings: list[WorkerSettings]) -> str:
    rows = [[s.name, format_cpulist(s.cores) or "not pinned", s.interface or "(default)",
             " ".join(f"{k}={v}" for k, v in s.env.items()), "; ".join(s.notes) or "-"] for s in settings]
    return format_table(["worker", "affinity", "interface", "env", "notes"], rows)


# --- rendering ---------------------------------------------------------------------------------------------------

def render_plan(plan: Plan) -> str:
    topo = plan.topology
    idx = sorted(g.index for g in topo.gpus)
    out = [f"topology from {topo.source}: {len(idx)} GPU(s), {len(topo.nics)} NIC(s)", ""]
    heads = [""] + [f"GPU{j}" for j in idx] + [n.name for n in topo.nics] + ["CPU Affinity", "NUMA"]
    rows = []
    for i in idx:
        g = topo.gpu(i)
        rows.append([f"GPU{i}"] + [("X" if i == j else topo.gpu_links.get((i, j), "?")) for j in idx]
                    + [topo.gpu_nic.get((i, n.name)) or "?" for n in topo.nics]
                    + [format_cpulist(g.cpus) or "?", format_cpulist(g.numa_nodes) or "?"])
    out += [format_table(heads, rows), ""]
    missing = topo.pairs_without_nvlink()
    if missing:
        out.append(f"GPU pairs without NVLink ({len(missing)}): "
                   + ", ".join(f"{i}-{j} {lvl}" for i, j, lvl in missing))
    else:
        out.append("every GPU pair has NVLink" if len(idx) > 1 else "one GPU: no GPU pairs")
    subset = plan.largest_nvlink_subset
    if subset:
        links = sum(topo.nvlinks(i, j) for i, j in itertools.combinations(subset, 2))
        out.append(f"largest fully NVLink-connected subset: GPUs {','.join(map(str, subset))} "
                   f"({len(subset)} GPUs, {links} links)")
    out.append(f"selected: {','.join(map(str, plan.selected))} ({plan.selection}: {plan.selection_reason}); "
               f"protocol {plan.protocol}")
    out.append("")
    heads = ["worker", "GPU", "CUDA_VISIBLE_DEVICES", "cores", "from", "NUMA", "NIC", "dist", "interface"]
    ucx_vars = [v for v in ("UCX_NET_DEVICES", "UCX_TLS") if any(v in w.env for w in plan.workers)]
    heads += ucx_vars
    rows = []
    for w in plan.workers:
        row = [w.name, w.gpu, w.cuda_visible_devices, format_cpulist(w.cpus) or "-", w.cpus_source or "-",
               format_cpulist(w.numa_nodes) or "-", w.nic or "-", w.nic_distance or "-", w.interface or "-"]
        rows.append(row + [w.env.get(v, "-") for v in ucx_vars])
    out.append(format_table(heads, rows))
    for note in plan.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
