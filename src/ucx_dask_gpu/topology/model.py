"""The topology of one GPU host: its GPUs (CPU affinity, NUMA nodes), its NICs, and how each pair of devices is
connected (NVLink count, or the PCIe level `nvidia-smi topo -m` names), read from the machine (machine.py) or from
`nvidia-smi topo -m` text (topotext.py). CPU lists in the kernel's cpulist format.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import asdict, dataclass, field

# Connection levels of `nvidia-smi topo -m`, closest first. NV<n> (n bonded NVLinks) ranks above every PCIe level.
PCI_LEVELS = ("PIX", "PXB", "PHB", "NODE", "SYS")
LEVEL_ALIASES = {"SOC": "SYS"}  # drivers before ~R384 printed SOC ("SMP link between CPU sockets") for SYS
NV_RE = re.compile(r"^NV(\d+)$")
TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
PCI_ROOT_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
# RDMA device names (ibv_devices): Mellanox/NVIDIA mlx4/mlx5, Intel hfi1/irdma, Broadcom bnxt_re, QLogic qedr, AWS efa.
RDMA_NAME_RE = re.compile(r"^(mlx\d+|hfi\d+|irdma|bnxt_re|qedr|efa|rxe|siw|ocrdma|i40iw)_?\d+$")
IPOIB_NAME_RE = re.compile(r"^ib[0-9a-z]*\d$")
ARPHRD_INFINIBAND = "32"


# --- data --------------------------------------------------------------------------------------------------------


@dataclass
class GpuInfo:
    index: int
    pci_bus_id: str | None = None
    name: str | None = None
    cpus: list[int] | None = None
    cpus_source: str | None = None      # "nvml", "sysfs", "topo-text"
    numa_nodes: list[int] | None = None
    numa_source: str | None = None      # "nvml", "sysfs", "sysfs-cpus", "topo-text"


@dataclass
class NicInfo:
    name: str                        # as the machine names it: RDMA device (mlx5_0) or interface (eth0, ib0)
    kind: str                        # "ib" (RDMA: InfiniBand or RoCE, UCX `rc`) or "eth" (TCP only)
    netdev: str | None = None        # the IP interface Dask listens on (ib0 for IPoIB, eth0)
    rdma_device: str | None = None   # mlx5_0
    port: int | None = None          # RDMA port UCX uses (mlx5_0:1)
    port_state: str | None = None    # "ACTIVE", "DOWN", ... (sysfs)
    link_layer: str | None = None    # "InfiniBand" / "Ethernet" (RoCE)
    pci_bus_id: str | None = None
    numa_node: int | None = None

    def ucx_net_devices(self) -> str | None:
        """UCX_NET_DEVICES for this NIC: the RDMA port plus its IP interface (UCX's tcp and sockaddr need both)."""
        parts = []
        if self.rdma_device:
            parts.append(f"{self.rdma_device}:{self.port or 1}")
        if self.netdev and (self.rdma_device or self.kind == "eth"):
            parts.append(self.netdev)
        return ",".join(parts) or None


@dataclass
class Topology:
    source: str
    gpus: list[GpuInfo]
    nics: list[NicInfo] = field(default_factory=list)
    gpu_links: dict[tuple[int, int], str] = field(default_factory=dict)     # (i, j), i != j -> "NV2" / "SYS" / ...
    gpu_nic: dict[tuple[int, str], str | None] = field(default_factory=dict)  # (gpu, nic name) -> level or None
    notes: list[str] = field(default_factory=list)

    def gpu(self, index: int) -> GpuInfo:
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def nvlinks(self, i: int, j: int) -> int:
        m = NV_RE.match(self.gpu_links.get((i, j), ""))
        return int(m.group(1)) if m else 0

    def pairs_without_nvlink(self) -> list[tuple[int, int, str]]:
        idx = [g.index for g in self.gpus]
        return [(i, j, self.gpu_links.get((i, j), "?")) for i, j in itertools.combinations(idx, 2)
                if not self.nvlinks(i, j)]

    def to_dict(self) -> dict:
        idx = [g.index for g in self.gpus]
        return {
            "source": self.source,
            "gpus": [asdict(g) | {"cpus": format_cpulist(g.cpus), "numa_nodes": format_cpulist(g.numa_nodes)}
                     for g in self.gpus],
            "nics": [asdict(n) for n in self.nics],
            "gpu_matrix": {f"GPU{i}": {f"GPU{j}": ("X" if i == j else self.gpu_links.get((i, j))) for j in idx}
                           for i in idx},
            "gpu_nic": {f"GPU{i}": {n.name: self.gpu_nic.get((i, n.name)) for n in self.nics} for i in idx},
            "notes": list(self.notes),
        }


# --- CPU lists ---------------------------------------------------------------------------------------------------

# The largest CPU (or NUMA node) number a list may name: far above any kernel's NR_CPUS (8192 at most on x86-64 and
# arm64 today), so every real host passes, while a corrupt or hostile `0-3000000000` is refused before it is expanded.
MAX_CPU_ID = 65535


def parse_cpulist(text: str) -> list[int]:
    """'0-19,40-59' -> [0..19, 40..59] (kernel cpulist format). Raises ValueError on anything else, and on a number
    above MAX_CPU_ID (checked before any range is expanded: the result has at most MAX_CPU_ID + 1 entries)."""
    out: set[int] = set()
    text = text.strip()
    if not text:
        return []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text[:80]!r}")
        if any(len(n.lstrip("0")) > len(str(MAX_CPU_ID)) or int(n) > MAX_CPU_ID for n in (lo, hi) if n):
            raise ValueError(f"CPU number above {MAX_CPU_ID} in {text[:80]!r} (no host has that many)")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"not a CPU list: {text[:80]!r}")
        out.update(range(a, b + 1))
    return sorted(out)


def format_cpulist(cpus: list[int] | None) -> str | None:
    """[0..19, 40..59] -> '0-19,40-59'."""
    if cpus is None:
        return None
    cpus = sorted(set(cpus))
    ranges = []
    for _, grp in itertools.groupby(enumerate(cpus), key=lambda t: t[1] - t[0]):
        run = [c for _, c in grp]
        ranges.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(ranges)
