"""This machine's topology: GPUs from NVML, affinity from NVML or sysfs (`local_cpulist`, `numa_node` where NVML
answers Not Supported, as in a Firecracker VM; the source is recorded per GPU), NICs (InfiniBand/RoCE RDMA devices
and Ethernet interfaces) and the PCIe distance of every GPU to every NIC from the PCI hierarchy (bridges resolved
through the /sys/bus/pci/devices symlinks). `record_sysfs` writes the part of sysfs read here as a text record that
`materialize_sysfs` turns back into a tree, so a GPU host's record is a fixture anywhere.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from pathlib import Path

from .. import nvml
from ..errors import BAD_TOPOLOGY, NO_GPU, SYSFS_UNREADABLE, UserError
from .model import ARPHRD_INFINIBAND, BDF_RE, PCI_ROOT_RE, GpuInfo, NicInfo, Topology, parse_cpulist


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


def _sysfs_dir(path: Path) -> Path:
    """`path`, a directory sysfs has; one line (SYSFS_UNREADABLE) when it is not there."""
    if not path.is_dir():
        raise UserError(f"cannot read {path}: not a directory (is sysfs mounted?)", SYSFS_UNREADABLE)
    return path


def _read_optional(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}", SYSFS_UNREADABLE) from None


def pci_location(root: Path, link: Path) -> PciLocation | None:
    """Resolve a sysfs device link (…/device, /sys/bus/pci/devices/X) to its PCI chain. Walks up from the resolved
    directory to the nearest PCI function (a virtio NIC resolves to …/0000:00:03.0/virtio2), then lists the bridges
    between it and the host bridge. None when the device is not on PCI (virtio-mmio, platform)."""
    devices = (root / "sys" / "devices").resolve()
    try:
        parts = Path(os.path.realpath(link, strict=True)).resolve().relative_to(devices).parts
    except (OSError, ValueError):  # a dangling link, or a device outside sys/devices
        return None
    if not parts or not PCI_ROOT_RE.match(parts[0]):
        return None
    chain = tuple(itertools.takewhile(BDF_RE.match, parts[1:]))
    return PciLocation(root=parts[0], chain=chain) if chain else None


def pci_level(a: PciLocation | None, b: PciLocation | None, numa_a: int | None, numa_b: int | None,
              single_numa: bool) -> str | None:
    """nvidia-smi's PCIe connection level between two devices from their PCI chains (None when either is not on PCI):
    PIX at most one switch between them (common bridge, at most one bridge below it on each side); PXB several bridges
    below the deepest common one; PHB same host bridge, no common bridge; NODE different host bridges in one NUMA node;
    SYS across NUMA nodes."""
    if a is None or b is None:
        return None
    if a.root != b.root:
        if single_numa or (numa_a is not None and numa_a == numa_b):
            return "NODE"
        return "SYS"
    common = sum(1 for _ in itertools.takewhile(lambda xy: xy[0] == xy[1], zip(a.bridges, b.bridges)))
    if common == 0:
        return "PHB"
    hops = (len(a.bridges) - common) + (len(b.bridges) - common)
    return "PIX" if hops <= 2 else "PXB"


def _cpulist(path: Path, text: str) -> list[int]:
    try:
        return parse_cpulist(text)
    except ValueError as e:
        raise UserError(f"{path}: {e}", SYSFS_UNREADABLE) from None


def numa_cpus(root: Path) -> dict[int, list[int]]:
    node_dir = root / "sys" / "devices" / "system" / "node"
    out: dict[int, list[int]] = {}
    if not node_dir.is_dir():
        return out
    for d in sorted(node_dir.glob("node[0-9]*")):
        text = _read_optional(d / "cpulist")
        if text is not None:
            out[int(d.name[4:])] = _cpulist(d / "cpulist", text)
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

    def found(nic: NicInfo, device: Path) -> None:
        loc = pci_location(root, device)
        if loc:
            nic.pci_bus_id, nic.numa_node, locs[nic.name] = loc.bdf, _numa_node(root, loc), loc
        nics.append(nic)

    rdma_netdevs: set[str] = set()
    ib_dir = root / "sys" / "class" / "infiniband"
    if ib_dir.is_dir():
        for dev in sorted(ib_dir.iterdir()):
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
            found(NicInfo(name=dev.name, kind="ib", netdev=netdevs[0] if netdevs else None, rdma_device=dev.name,
                          port=port, port_state=state, link_layer=layer), dev / "device")
    for nd in sorted(_sysfs_dir(root / "sys" / "class" / "net").iterdir()):
        if nd.name in rdma_netdevs or not (nd / "device").exists():
            continue   # IPoIB interface of an RDMA device above, or virtual (lo, bridges, ifb, docker0)
        nic = NicInfo(name=nd.name, kind="eth", netdev=nd.name)
        if _read_optional(nd / "type") == ARPHRD_INFINIBAND:
            nic.link_layer = "InfiniBand"   # IPoIB without a visible RDMA device: TCP over it only
        found(nic, nd / "device")
    return nics, locs


def from_machine(root: str | os.PathLike = "/") -> Topology:
    """GPUs from NVML, affinity from NVML or sysfs, NICs and PCI distances from sysfs under `root`."""
    _sysfs_dir(Path(root) / "sys" / "bus" / "pci" / "devices")
    return assemble(nvml.discover(), root)     # discover() raises NVML_UNAVAILABLE / NO_GPU with one line


def assemble(found, root: str | os.PathLike = "/") -> Topology:
    """Topology from NVML's GPUs (`nvml.Gpu` list) and the sysfs tree under `root` (the machine, or a record)."""
    root = Path(root)
    pci_dir = _sysfs_dir(root / "sys" / "bus" / "pci" / "devices")
    if not found:
        raise UserError("no GPU: NVML reports 0 devices", NO_GPU)
    nodes = numa_cpus(root)
    topo = Topology(source="NVML + sysfs", gpus=[])
    locs: dict[int, PciLocation] = {}
    for g in found:
        bdf = sysfs_bdf(g.pci_bus_id)
        loc = pci_location(root, pci_dir / bdf)
        if loc is None:
            raise UserError(f"GPU {g.index} ({bdf}): no PCI device at {pci_dir / bdf}", SYSFS_UNREADABLE)
        locs[g.index] = loc
        topo.gpus.append(_gpu_info(g, root, pci_dir / bdf, loc, nodes))
    single_numa = len(nodes) <= 1
    _gpu_links(topo, found, locs, single_numa)
    nics, nic_locs = discover_nics(root)
    topo.nics = nics
    for g in topo.gpus:
        for nic in nics:
            topo.gpu_nic[(g.index, nic.name)] = pci_level(locs[g.index], nic_locs.get(nic.name),
                                                          _one_numa_node(topo, g.index), nic.numa_node, single_numa)
    for g in topo.gpus:
        if g.cpus_source == "sysfs":
            topo.notes.append(f"GPU{g.index}: NVML has no CPU affinity here; cores from sysfs local_cpulist")
        elif g.cpus is None:
            topo.notes.append(f"GPU{g.index}: no CPU affinity from NVML or sysfs; worker is not pinned")
    return topo


def _gpu_info(g, root: Path, dev: Path, loc: PciLocation, nodes: dict[int, list[int]]) -> GpuInfo:
    """One GPU's CPU and NUMA affinity: NVML's, else sysfs's (its PCI device's, else the nodes holding its CPUs)."""
    info = GpuInfo(index=g.index, pci_bus_id=g.pci_bus_id, name=g.name)
    if g.cpu_affinity:
        info.cpus, info.cpus_source = list(g.cpu_affinity), "nvml"
    else:
        text = _read_optional(dev / "local_cpulist")
        if text:
            info.cpus, info.cpus_source = _cpulist(dev / "local_cpulist", text), "sysfs"
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
    return info


def _one_numa_node(topo: Topology, index: int) -> int | None:
    ns = topo.gpu(index).numa_nodes
    return ns[0] if ns and len(ns) == 1 else None


def _gpu_links(topo: Topology, found, locs: dict[int, PciLocation], single_numa: bool) -> None:
    """GPU x GPU: NV<links>, else the PCI level between the two."""
    # NVLink: peers are GPUs, or NVSwitches (then every pair of switch-attached GPUs is connected through them).
    by_bus = {g.pci_bus_id: g.index for g in found}
    switch_links = {g.index: sum(c for peer, c in g.nvlink_peers.items() if peer not in by_bus) for g in found}
    for a in found:
        for b in found:
            if a.index == b.index:
                continue
            n = a.nvlink_peers.get(b.pci_bus_id, 0)
            if not n and switch_links[a.index] and switch_links[b.index]:
                n = min(switch_links[a.index], switch_links[b.index])
            topo.gpu_links[(a.index, b.index)] = f"NV{n}" if n else (
                pci_level(locs[a.index], locs[b.index], _one_numa_node(topo, a.index), _one_numa_node(topo, b.index),
                          single_numa) or "SYS")
    if any(switch_links.values()):
        topo.notes.append("NVLink through NVSwitch: NV# counts the GPU's links to the switches")


SYSFS_RECORD_HEADER = "# ucx-dask-gpu sysfs record v1: L path<TAB>link target | D path | F path<TAB>content"
SYSFS_FILES = ("numa_node", "local_cpulist", "class", "vendor", "device", "type", "state", "link_layer", "cpulist")


def record_sysfs(root: str | os.PathLike = "/") -> str:
    """The part of sysfs that `from_machine` reads, as a text record (symlinks kept as they are). `materialize_sysfs()`
    turns a record back into a tree that `discover_nics` / `pci_location` read like the real thing, so a record taken on
    a GPU host is a fixture for tests anywhere."""
    rec = _SysfsRecord(Path(root))
    for cls in ("net", "infiniband"):
        rec.add_class(rec.root / "sys" / "class" / cls)
    pci = _sysfs_dir(rec.root / "sys" / "bus" / "pci" / "devices")
    rec.entries[rec.rel(pci)] = ("D",)
    for entry in sorted(pci.iterdir()):
        rec.add_chain(rec.add_link(entry) if entry.is_symlink() else entry)
    nodes = rec.root / "sys" / "devices" / "system" / "node"
    if nodes.is_dir():
        for d in sorted(nodes.glob("node[0-9]*")):
            rec.add_dir(d)
    lines = [SYSFS_RECORD_HEADER] + ["\t".join((e[0], path) + e[1:]) for path, e in sorted(rec.entries.items())]
    return "\n".join(lines) + "\n"


class _SysfsRecord:
    """The entries of a sysfs record being taken: path -> ("D",) | ("L", target) | ("F", content)."""

    def __init__(self, root: Path):
        self.root = root
        self.entries: dict[str, tuple[str, ...]] = {}

    def rel(self, p: Path) -> str:
        return str(p.relative_to(self.root))

    def add_link(self, src: Path) -> Path:
        self.entries[self.rel(src)] = ("L", os.readlink(src))
        return Path(os.path.realpath(src))

    def add_dir(self, d: Path) -> None:
        """The directory and those of its SYSFS_FILES that hold one line."""
        self.entries.setdefault(self.rel(d), ("D",))
        for name in SYSFS_FILES:
            f = d / name
            if f.is_file() and not f.is_symlink():
                try:
                    text = f.read_text().strip()
                except OSError:
                    continue
                if "\n" not in text:
                    self.entries[self.rel(f)] = ("F", text)

    def add_chain(self, real: Path) -> None:
        """A device and every parent of it under sys/devices (the PCI path `pci_location` walks)."""
        devices = self.root / "sys" / "devices"
        p = real
        while p != devices and devices in p.parents:
            self.add_dir(p)
            p = p.parent

    def add_class(self, d: Path) -> None:
        """sys/class/<cls>: every entry, its device's chain and net names, its ports."""
        if not d.is_dir():
            return
        self.entries[self.rel(d)] = ("D",)
        for entry in sorted(d.iterdir()):
            real = self.add_link(entry) if entry.is_symlink() else entry
            self.add_dir(real)
            dev = real / "device"
            if dev.is_symlink():
                self.add_link(dev)
                target = Path(os.path.realpath(dev))
                self.add_chain(target)
                if (target / "net").is_dir():
                    for nd in sorted((target / "net").iterdir()):
                        self.entries.setdefault(self.rel(nd), ("D",))
            if (real / "ports").is_dir():
                for port in sorted((real / "ports").iterdir()):
                    self.add_dir(port)


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
