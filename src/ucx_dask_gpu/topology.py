"""The topology of one GPU host, and the Dask worker plan generated from it.

The seed hand-wrote a `DGX()` cluster: one worker per GPU, CPU affinity per socket, the InfiniBand card near each GPU,
UCX transports. Every new machine needed that table again, and the hand-written one disagreed with its own
`nvidia-smi topo -m` listing. Here the table is generated from what the machine reports:

- GPUs, NVLink peers and link counts, CPU affinity and NUMA node from NVML (`nvml.discover()`); where NVML answers
  Not Supported (a Firecracker VM does for affinity) from sysfs (`local_cpulist`, `numa_node`), and the source is
  recorded per GPU;
- NICs (InfiniBand/RoCE RDMA devices and Ethernet interfaces) and their PCI location from sysfs; the distance of
  every GPU to every NIC from the PCI hierarchy (bridges resolved through the /sys/bus/pci/devices symlinks);
- or all of the above from the text of `nvidia-smi topo -m` (hosts without NVML access, and tests).

`make_plan()` turns a `Topology` into one worker per GPU: cores, NUMA node, nearest NIC, Dask interface,
`UCX_NET_DEVICES` and `UCX_TLS`; it lists the GPU pairs without NVLink and the largest fully NVLink-connected subset
(`gpus="auto"` keeps to it: the seed's "teach Dask to avoid these communications").
"""
from __future__ import annotations

import itertools
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import BAD_TOPOLOGY, NO_GPU, SYSFS_UNREADABLE, USAGE, UserError

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

    @property
    def label(self) -> str:
        return f"GPU{self.index}"


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

def parse_cpulist(text: str) -> list[int]:
    """'0-19,40-59' -> [0..19, 40..59] (kernel cpulist format). Raises ValueError on anything else."""
    out: list[int] = []
    text = text.strip()
    if not text:
        return out
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"not a CPU list: {text!r}")
        out.extend(range(a, b + 1))
    return sorted(set(out))


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


# --- nvidia-smi topo -m text -------------------------------------------------------------------------------------

def _norm_level(cell: str) -> str | None:
    cell = LEVEL_ALIASES.get(cell, cell)
    if cell == "X" or cell in PCI_LEVELS or NV_RE.match(cell):
        return cell
    return None


def _classify_nic(name: str) -> NicInfo:
    if RDMA_NAME_RE.match(name):
        return NicInfo(name=name, kind="ib", rdma_device=name)
    if IPOIB_NAME_RE.match(name):
        return NicInfo(name=name, kind="ib", netdev=name)
    return NicInfo(name=name, kind="eth", netdev=name)


def _split_header(line: str) -> list[str]:
    if "\t" in line:
        return [c.strip() for c in line.split("\t")][1:]
    return [c for c in re.split(r"\s{2,}", line.strip()) if c]


def _split_row(line: str, ndev: int) -> tuple[str, list[str], list[str]]:
    """(label, device cells, trailing cells)."""
    if "\t" in line:
        cells = [c.strip() for c in line.split("\t")]
        return cells[0], cells[1:1 + ndev], cells[1 + ndev:]
    toks = line.split()
    return toks[0], toks[1:1 + ndev], toks[1 + ndev:]


def parse_topo_text(text: str, source: str = "nvidia-smi topo -m") -> Topology:
    """Parse `nvidia-smi topo -m` output (tab-separated as printed, or space-aligned as pasted).

    Handles the GPU x GPU matrix (X, NV#, PIX, PXB, PHB, NODE, SYS; SOC from old drivers), NIC columns and rows
    (mlx5_N / ibN / NICn with the "NIC Legend" block), the CPU Affinity / NUMA Affinity / GPU NUMA ID columns, a
    separate "CPU Affinity" block (as some listings print it), and ANSI escapes in the header.
    Raises UserError(BAD_TOPOLOGY) naming the line for anything it cannot read, UserError(NO_GPU) when no GPU row.
    """
    def bad(msg: str):
        return UserError(f"{source}: {msg}", BAD_TOPOLOGY)

    lines = [ANSI_RE.sub("", ln).rstrip("\r\n") for ln in text.splitlines()]
    # The matrix (and, in some listings, a separate CPU Affinity block) comes first; "Legend:" and
    # "NIC Legend:" (NIC0: mlx5_0, ...) close the listing.
    legend: dict[str, str] = {}
    body: list[str] = []
    in_legend = False
    for ln in lines:
        s = ln.strip()
        if s in ("Legend:", "NIC Legend:"):
            in_legend = True
        elif in_legend:
            m = re.match(r"^(NIC\d+):\s*(\S+)$", s)
            if m:
                legend[m.group(1)] = m.group(2)
        elif not (s.startswith("$") or "nvidia-smi" in s):   # the command line / prompt in pasted listings
            body.append(ln)

    # Blocks separated by blank lines; each starts with a header line (first cell empty, i.e. indented).
    blocks: list[list[str]] = []
    cur: list[str] = []
    for ln in body + [""]:
        if ln.strip():
            cur.append(ln)
        elif cur:
            blocks.append(cur)
            cur = []
    if not blocks:
        raise UserError(f"{source}: no topology matrix found", BAD_TOPOLOGY)

    devices: list[str] | None = None
    matrix: dict[str, dict[str, str]] = {}
    trailing: dict[str, dict[str, str]] = {}
    for block in blocks:
        header_line = block[0]
        if not header_line[:1].isspace():
            raise bad(f"expected a header line (starting with a tab or spaces), got {header_line.strip()!r}")
        header = _split_header(header_line)
        if not header:
            raise bad("empty header line")
        devcols = [h for h in header if h not in TRAILING_COLUMNS]
        trailcols = [h for h in header if h in TRAILING_COLUMNS]
        if header[:len(devcols)] != devcols:
            raise bad(f"device columns must come before {', '.join(trailcols)}: {header}")
        if devcols:
            if devices is not None:
                raise bad("two device matrices in one listing")
            devices = devcols
        for row in block[1:]:
            label, cells, trail = _split_row(row, len(devcols))
            if len(cells) != len(devcols):
                raise bad(f"row {label!r} has {len(cells)} matrix cells, the header names {len(devcols)}")
            if devcols:
                if label not in devcols:
                    raise bad(f"row {label!r} is not one of the columns {devcols}")
                levels = {}
                for col, cell in zip(devcols, cells):
                    lvl = _norm_level(cell)
                    if lvl is None:
                        raise bad(f"row {label!r}, column {col!r}: unknown connection {cell!r}")
                    if (lvl == "X") != (col == label):
                        raise bad(f"row {label!r}, column {col!r}: {cell!r} (X belongs on the diagonal only)")
                    levels[col] = lvl
                matrix[label] = levels
            # nvidia-smi prints an extra tab after the NUMA Affinity value: drop surplus empty cells.
            while len(trail) > len(trailcols) and "" in trail[1:]:
                trail.pop(trail.index("", 1))
            if len(trail) > len(trailcols):
                raise bad(f"row {label!r} has {len(trail)} cells after the matrix, the header names {trailcols}")
            trailing.setdefault(label, {}).update(
                {col: val for col, val in zip(trailcols, trail) if val and val != "N/A"})

    if devices is None:
        raise bad("no device columns (GPU0, GPU1, ...) in the header")
    gpu_labels = [d for d in devices if re.fullmatch(r"GPU\d+", d)]
    if not gpu_labels:
        raise UserError(f"{source}: no GPU in the topology (columns: {', '.join(devices)})", NO_GPU)
    missing = [d for d in devices if d not in matrix]
    if missing:
        raise bad(f"no row for {', '.join(missing)}")
    for a in gpu_labels:
        for b in gpu_labels:
            if matrix[a][b] != matrix[b][a]:
                raise bad(f"{a}->{b} is {matrix[a][b]} but {b}->{a} is {matrix[b][a]}")
    unknown_trailing = [lbl for lbl in trailing if lbl not in devices]
    if unknown_trailing:
        raise bad(f"affinity rows for unknown devices {unknown_trailing}")

    topo = Topology(source=source, gpus=[])
    for lbl in gpu_labels:
        idx = int(lbl[3:])
        t = trailing.get(lbl, {})
        g = GpuInfo(index=idx)
        try:
            if "CPU Affinity" in t:
                g.cpus, g.cpus_source = parse_cpulist(t["CPU Affinity"]), "topo-text"
            if "NUMA Affinity" in t:
                g.numa_nodes, g.numa_source = parse_cpulist(t["NUMA Affinity"]), "topo-text"
        except ValueError as e:
            raise bad(f"row {lbl!r}: {e}") from None
        topo.gpus.append(g)
    for a in gpu_labels:
        for b in gpu_labels:
            if a != b:
                topo.gpu_links[(int(a[3:]), int(b[3:]))] = matrix[a][b]
    for col in devices:
        if col in gpu_labels:
            continue
        name = legend.get(col, col)
        nic = _classify_nic(name)
        if nic.kind == "ib" and nic.rdma_device:
            nic.port = 1
        topo.nics.append(nic)
        for lbl in gpu_labels:
            topo.gpu_nic[(int(lbl[3:]), name)] = matrix[lbl][col]
    if any(n.rdma_device for n in topo.nics):
        topo.notes.append("RDMA port 1 assumed (topo -m text does not name ports)")
    return topo


# --- sysfs -------------------------------------------------------------------------------------------------------

def sysfs_bdf(bus_id: str) -> str:
    """NVML's '00000000:18:00.0' -> sysfs '0000:18:00.0'."""
    dom, _, rest = bus_id.lower().partition(":")
    return f"{int(dom, 16):04x}:{rest}"


@dataclass(frozen=True)
class PciLocation:
    root: str                 # host bridge, e.g. "pci0000:00"
    chain: tuple[str, ...]    # bridges from the root down, then the device itself (BDFs)

    @property
    def bdf(self) -> str:
        return self.chain[-1]

    @property
    def bridges(self) -> tuple[str, ...]:
        return self.chain[:-1]


def _read_optional(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}", SYSFS_UNREADABLE) from None


def pci_location(root: Path, link: Path) -> PciLocation | None:
    """Resolve a sysfs device link (…/device, /sys/bus/pci/devices/X) to its PCI chain.

    Walks up from the resolved directory to the nearest PCI function (a virtio NIC resolves to …/0000:00:03.0/virtio2),
    then lists the bridges between it and the host bridge. None when the device is not on PCI (virtio-mmio, platform).
    """
    devices = (root / "sys" / "devices").resolve()
    try:
        real = Path(os.path.realpath(link, strict=True)).resolve()
    except OSError:
        return None
    try:
        parts = real.relative_to(devices).parts
    except ValueError:
        return None
    if not parts or not PCI_ROOT_RE.match(parts[0]):
        return None
    chain: list[str] = []
    for p in parts[1:]:
        if BDF_RE.match(p):
            chain.append(p)
        else:
            break
    if not chain:
        return None
    return PciLocation(root=parts[0], chain=tuple(chain))


def pci_level(a: PciLocation | None, b: PciLocation | None, numa_a: int | None, numa_b: int | None,
              single_numa: bool) -> str | None:
    """nvidia-smi's PCIe connection level between two devices from their PCI chains.

    PIX: at most one switch between them (common bridge, at most one bridge below it on each side);
    PXB: several bridges below the deepest common one; PHB: same host bridge, no common bridge;
    NODE: different host bridges in one NUMA node; SYS: across NUMA nodes. None when either is not on PCI.
    """
    if a is None or b is None:
        return None
    if a.root != b.root:
        if single_numa or (numa_a is not None and numa_a == numa_b):
            return "NODE"
        return "SYS"
    common = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        common += 1
    if common == 0:
        return "PHB"
    hops = (len(a.bridges) - common) + (len(b.bridges) - common)
    return "PIX" if hops <= 2 else "PXB"


def numa_cpus(root: Path) -> dict[int, list[int]]:
    node_dir = root / "sys" / "devices" / "system" / "node"
    out: dict[int, list[int]] = {}
    if not node_dir.is_dir():
        return out
    for d in sorted(node_dir.glob("node[0-9]*")):
        text = _read_optional(d / "cpulist")
        if text is not None:
            out[int(d.name[4:])] = parse_cpulist(text)
    return out


def _numa_node(root: Path, loc: PciLocation) -> int | None:
    text = _read_optional(root / "sys" / "bus" / "pci" / "devices" / loc.bdf / "numa_node")
    try:
        node = int(text) if text is not None else -1
    except ValueError:
        node = -1
    return node if node >= 0 else None


def discover_nics(root: Path = Path("/")) -> tuple[list[NicInfo], dict[str, PciLocation]]:
    """RDMA devices from /sys/class/infiniband and NIC interfaces from /sys/class/net (virtual ones skipped)."""
    root = Path(root)
    nics: list[NicInfo] = []
    locs: dict[str, PciLocation] = {}
    rdma_netdevs: set[str] = set()
    ib_dir = root / "sys" / "class" / "infiniband"
    if ib_dir.is_dir():
        for dev in sorted(ib_dir.iterdir()):
            loc = pci_location(root, dev / "device")
            ports = []
            ports_dir = dev / "ports"
            if ports_dir.is_dir():
                for p in sorted(ports_dir.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 0):
                    state = (_read_optional(p / "state") or "").split(":")[-1].strip() or None
                    ports.append((int(p.name), state, _read_optional(p / "link_layer")))
            active = [p for p in ports if p[1] == "ACTIVE"]
            port, state, layer = (active or ports or [(1, None, None)])[0]
            net_dir = dev / "device" / "net"
            netdevs = sorted(os.listdir(net_dir)) if net_dir.is_dir() else []
            rdma_netdevs.update(netdevs)
            nic = NicInfo(name=dev.name, kind="ib", netdev=netdevs[0] if netdevs else None, rdma_device=dev.name,
                          port=port, port_state=state, link_layer=layer,
                          pci_bus_id=loc.bdf if loc else None, numa_node=_numa_node(root, loc) if loc else None)
            nics.append(nic)
            if loc:
                locs[nic.name] = loc
    net_dir = root / "sys" / "class" / "net"
    if not net_dir.is_dir():
        raise UserError(f"cannot read {net_dir}: not a directory (is sysfs mounted?)", SYSFS_UNREADABLE)
    for nd in sorted(net_dir.iterdir()):
        if nd.name in rdma_netdevs or not (nd / "device").exists():
            continue   # IPoIB interface of an RDMA device above, or virtual (lo, bridges, ifb, docker0)
        loc = pci_location(root, nd / "device")
        nic = NicInfo(name=nd.name, kind="eth", netdev=nd.name, pci_bus_id=loc.bdf if loc else None,
                      numa_node=_numa_node(root, loc) if loc else None)
        if _read_optional(nd / "type") == ARPHRD_INFINIBAND:
            nic.link_layer = "InfiniBand"   # IPoIB without a visible RDMA device: TCP over it only
        nics.append(nic)
        if loc:
            locs[nic.name] = loc
    return nics, locs


def from_machine(root: str | os.PathLike = "/") -> Topology:
    """GPUs from NVML, affinity from NVML or sysfs, NICs and PCI distances from sysfs under `root`."""
    from . import nvml

    pci_dir = Path(root) / "sys" / "bus" / "pci" / "devices"
    if not pci_dir.is_dir():
        raise UserError(f"cannot read {pci_dir}: not a directory (is sysfs mounted?)", SYSFS_UNREADABLE)
    return assemble(nvml.discover(), root)     # discover() raises NVML_UNAVAILABLE / NO_GPU with one line


def assemble(found, root: str | os.PathLike = "/") -> Topology:
    """Topology from NVML's GPUs (`nvml.Gpu` list) and the sysfs tree under `root` (the machine, or a record)."""
    root = Path(root)
    pci_dir = root / "sys" / "bus" / "pci" / "devices"
    if not pci_dir.is_dir():
        raise UserError(f"cannot read {pci_dir}: not a directory (is sysfs mounted?)", SYSFS_UNREADABLE)
    if not found:
        raise UserError("no GPU: NVML reports 0 devices", NO_GPU)
    nodes = numa_cpus(root)
    topo = Topology(source="NVML + sysfs", gpus=[])
    locs: dict[int, PciLocation] = {}
    for g in found:
        info = GpuInfo(index=g.index, pci_bus_id=g.pci_bus_id, name=g.name)
        bdf = sysfs_bdf(g.pci_bus_id)
        loc = pci_location(root, pci_dir / bdf)
        if loc is None:
            raise UserError(f"GPU {g.index} ({bdf}): no PCI device at {pci_dir / bdf}", SYSFS_UNREADABLE)
        locs[g.index] = loc
        dev = pci_dir / bdf
        if g.cpu_affinity:
            info.cpus, info.cpus_source = list(g.cpu_affinity), "nvml"
        else:
            text = _read_optional(dev / "local_cpulist")
            if text:
                info.cpus, info.cpus_source = parse_cpulist(text), "sysfs"
        if g.numa_nodes:
            info.numa_nodes, info.numa_source = list(g.numa_nodes), "nvml"
        else:
            node = _numa_node(root, loc)
            if node is not None:
                info.numa_nodes, info.numa_source = [node], "sysfs"
            elif info.cpus and nodes:
                near = [n for n, cpus in nodes.items() if set(info.cpus) & set(cpus)]
                if near:
                    info.numa_nodes, info.numa_source = near, "sysfs-cpus"
        topo.gpus.append(info)

    # NVLink: peers are GPUs, or NVSwitches (then every pair of switch-attached GPUs is connected through them).
    by_bus = {g.pci_bus_id: g.index for g in found}
    switch_links = {g.index: sum(c for peer, c in g.nvlink_peers.items() if peer not in by_bus) for g in found}
    single_numa = len(nodes) <= 1

    def numa(i):
        ns = topo.gpu(i).numa_nodes
        return ns[0] if ns and len(ns) == 1 else None

    for a in found:
        for b in found:
            if a.index == b.index:
                continue
            n = a.nvlink_peers.get(b.pci_bus_id, 0)
            if not n and switch_links[a.index] and switch_links[b.index]:
                n = min(switch_links[a.index], switch_links[b.index])
            topo.gpu_links[(a.index, b.index)] = f"NV{n}" if n else (
                pci_level(locs[a.index], locs[b.index], numa(a.index), numa(b.index), single_numa) or "SYS")
    if any(switch_links.values()):
        topo.notes.append("NVLink through NVSwitch: NV# counts the GPU's links to the switches")

    nics, nic_locs = discover_nics(root)
    topo.nics = nics
    for g in topo.gpus:
        for nic in nics:
            topo.gpu_nic[(g.index, nic.name)] = pci_level(locs[g.index], nic_locs.get(nic.name), numa(g.index),
                                                          nic.numa_node, single_numa)
    for g in topo.gpus:
        if g.cpus_source == "sysfs":
            topo.notes.append(f"GPU{g.index}: NVML has no CPU affinity here; cores from sysfs local_cpulist")
        elif g.cpus is None:
            topo.notes.append(f"GPU{g.index}: no CPU affinity from NVML or sysfs; worker is not pinned")
    return topo


SYSFS_RECORD_HEADER = "# ucx-dask-gpu sysfs record v1: L path<TAB>link target | D path | F path<TAB>content"
SYSFS_FILES = ("numa_node", "local_cpulist", "class", "vendor", "device", "type", "state", "link_layer", "cpulist")


def record_sysfs(root: str | os.PathLike = "/") -> str:
    """The part of sysfs that `from_machine` reads, as a text record (symlinks kept as they are).

    `materialize_sysfs()` turns a record back into a tree that `discover_nics` / `pci_location` read like the real
    thing, so a record taken on a GPU host is a fixture for tests anywhere.
    """
    root = Path(root)
    entries: dict[str, tuple[str, ...]] = {}   # path -> ("D",) | ("L", target) | ("F", content)

    def rel(p: Path) -> str:
        return str(p.relative_to(root))

    def add_link(src: Path) -> Path:
        entries[rel(src)] = ("L", os.readlink(src))
        return Path(os.path.realpath(src))

    def add_dir(d: Path):
        entries.setdefault(rel(d), ("D",))
        for name in SYSFS_FILES:
            f = d / name
            if f.is_file() and not f.is_symlink():
                try:
                    text = f.read_text().strip()
                except OSError:
                    continue
                if "\n" not in text:
                    entries[rel(f)] = ("F", text)

    def add_chain(real: Path):
        devices = root / "sys" / "devices"
        p = real
        while p != devices and devices in p.parents:
            add_dir(p)
            p = p.parent

    for cls in ("net", "infiniband"):
        d = root / "sys" / "class" / cls
        if not d.is_dir():
            continue
        entries[rel(d)] = ("D",)
        for entry in sorted(d.iterdir()):
            real = add_link(entry) if entry.is_symlink() else entry
            add_dir(real)
            dev = real / "device"
            if dev.is_symlink():
                add_link(dev)
                target = Path(os.path.realpath(dev))
                add_chain(target)
                if (target / "net").is_dir():
                    for nd in sorted((target / "net").iterdir()):
                        entries.setdefault(rel(nd), ("D",))
            if (real / "ports").is_dir():
                for port in sorted((real / "ports").iterdir()):
                    add_dir(port)
    pci = root / "sys" / "bus" / "pci" / "devices"
    if not pci.is_dir():
        raise UserError(f"cannot read {pci}: not a directory (is sysfs mounted?)", SYSFS_UNREADABLE)
    entries[rel(pci)] = ("D",)
    for entry in sorted(pci.iterdir()):
        add_chain(add_link(entry) if entry.is_symlink() else entry)
    nodes = root / "sys" / "devices" / "system" / "node"
    if nodes.is_dir():
        for d in sorted(nodes.glob("node[0-9]*")):
            add_dir(d)
    lines = [SYSFS_RECORD_HEADER] + ["\t".join((e[0], path) + e[1:]) for path, e in sorted(entries.items())]
    return "\n".join(lines) + "\n"


def materialize_sysfs(record: str, dest: str | os.PathLike) -> Path:
    """Recreate a `record_sysfs()` record as a directory tree under `dest` (which becomes a sysfs root)."""
    dest = Path(dest)
    lines = record.splitlines()
    if not lines or lines[0] != SYSFS_RECORD_HEADER:
        raise UserError("not a ucx-dask-gpu sysfs record (first line differs)", BAD_TOPOLOGY)
    for n, ln in enumerate(lines[1:], 2):
        parts = ln.split("\t")
        kind, path = parts[0], parts[1] if len(parts) > 1 else ""
        if not path or path.startswith("/") or ".." in Path(path).parts or kind not in ("L", "D", "F") \
                or (kind in ("L", "F") and len(parts) != 3):
            raise UserError(f"sysfs record line {n}: cannot read {ln!r}", BAD_TOPOLOGY)
        p = dest / path
        p.parent.mkdir(parents=True, exist_ok=True)
        if kind == "D":
            p.mkdir(exist_ok=True)
        elif kind == "L":
            os.symlink(parts[2], p)
        else:
            p.write_text(parts[2] + "\n")
    return dest


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

    @property
    def scheduler_interface(self) -> str | None:
        return self.workers[0].interface if self.workers else None

    @property
    def uses_infiniband(self) -> bool:
        return any("rc" in w.env.get("UCX_TLS", "").split(",") for w in self.workers)

    @property
    def uses_cuda_ipc(self) -> bool:
        return any("cuda_ipc" in w.env.get("UCX_TLS", "").split(",") for w in self.workers)

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
    """Largest set of GPUs in which every pair has NVLink; ties: most links, fewest NUMA nodes, lowest indices.

    Empty when no pair has NVLink. Exhaustive search: fine for the <= 16 GPUs of one host.
    """
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


def make_plan(topo: Topology, gpus: str = "all", protocol: str = "ucx", net_devices: bool = True) -> Plan:
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
    if protocol in ("ucx", "ucxx"):
        if any(n.kind == "ib" and n.rdma_device is None for n in topo.nics if n.name in {w.nic for w in workers}):
            notes.append("the RDMA device behind an IPoIB interface is not named in the input: "
                         "UCX_NET_DEVICES left to UCX for those workers")
        if not net_devices:
            notes.append("UCX_NET_DEVICES not set (--no-net-devices): UCX picks devices itself")
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

    `allowed_cpus` defaults to this process's affinity; `ipv4(ifname) -> str | None` to a psutil lookup.
    """
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
    import socket

    import psutil

    for addr in psutil.net_if_addrs().get(ifname, []):
        if addr.family == socket.AF_INET:
            return addr.address
    return None


def render_settings(settings: list[WorkerSettings]) -> str:
    from .report import format_table

    rows = [[s.name, format_cpulist(s.cores) or "not pinned", s.interface or "(default)",
             " ".join(f"{k}={v}" for k, v in s.env.items()), "; ".join(s.notes) or "-"] for s in settings]
    return format_table(["worker", "affinity", "interface", "env", "notes"], rows)


# --- rendering ---------------------------------------------------------------------------------------------------

def render_plan(plan: Plan) -> str:
    from .report import format_table

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
    ucx = plan.protocol in ("ucx", "ucxx")
    if ucx:
        heads += ["UCX_NET_DEVICES", "UCX_TLS"]
    rows = []
    for w in plan.workers:
        row = [w.name, w.gpu, w.cuda_visible_devices, format_cpulist(w.cpus) or "-", w.cpus_source or "-",
               format_cpulist(w.numa_nodes) or "-", w.nic or "-", w.nic_distance or "-", w.interface or "-"]
        if ucx:
            row += [w.env.get("UCX_NET_DEVICES", "-"), w.env.get("UCX_TLS", "-")]
        rows.append(row)
    out.append(format_table(heads, rows))
    for note in plan.notes:
        out.append(f"note: {note}")
    return "\n".join(out)


def read_topo_file(path: str) -> Topology:
    if path == "-":
        return parse_topo_text(sys.stdin.read(), source="nvidia-smi topo -m (stdin)")
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}", BAD_TOPOLOGY) from None
    return parse_topo_text(text, source=f"nvidia-smi topo -m text {path}")
