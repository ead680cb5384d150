"""GPU and NVLink discovery through NVML (nvidia-ml-py), shared by doctor, verify-nvlink and topology.

Indices follow PCI bus order, like nvidia-smi; processes we start get CUDA_DEVICE_ORDER=PCI_BUS_ID so that a CUDA
device index means the same GPU as here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from .errors import NO_GPU, NVML_UNAVAILABLE, UserError

# NVML field ids (nvml.h). Throughput counters are cumulative KiB per link; scopeId selects the link.
FI_NVLINK_THROUGHPUT_DATA_TX = 138
FI_NVLINK_THROUGHPUT_DATA_RX = 139
FI_NVLINK_THROUGHPUT_RAW_TX = 140
FI_NVLINK_THROUGHPUT_RAW_RX = 141
FI_NVLINK_SPEED_MBPS_COMMON = 90
FI_NVLINK_GET_SPEED = 164
NVLINK_MAX_LINKS = 18


@dataclass
class Gpu:
    index: int
    uuid: str
    pci_bus_id: str  # normalised: lowercase, 8-hex-digit domain, e.g. 00000000:18:00.0
    name: str
    # peer pci_bus_id -> number of active NVLinks to it
    nvlink_peers: dict[str, int] = field(default_factory=dict)
    # per active link: its index and the peer it reaches
    links: dict[int, str] = field(default_factory=dict)
    link_speed_gbps: float | None = None  # per link, per direction (GB/s, 1e9 bytes/s)
    # CPUs and NUMA nodes close to the GPU as NVML reports them; None where the driver answers Not Supported
    # (e.g. in a Firecracker VM) -- topology.py then falls back to sysfs and says so.
    cpu_affinity: list[int] | None = None
    numa_nodes: list[int] | None = None
    # How link peers were identified: "remote-pci" (NVML named the peer's bus id) or "p2p-status" (NVML could not
    # name it -- seen in a Firecracker VM, where it answers ffffffff:ff:ff.0 -- and P2P status showed the only peer).
    link_attribution: str = "remote-pci"


def normalise_bus_id(bus_id: str | bytes) -> str:
    """'0000:18:00.0' / '00000000:18:00.0' -> '00000000:18:00.0' (NVML pads the domain to 8 digits)."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode()
    bus_id = bus_id.strip().lower()
    dom, _, rest = bus_id.partition(":")
    if not rest:
        return bus_id
    return f"{int(dom, 16):08x}:{rest}"


def _nvml():
    try:
        import pynvml  # optional (nvidia-ml-py): a host without it gets the one-line NVML_UNAVAILABLE error
    except ImportError:
        raise UserError("NVML unavailable: nvidia-ml-py is not installed", NVML_UNAVAILABLE) from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise UserError(f"NVML unavailable: {e} (no NVIDIA driver on this machine?)", NVML_UNAVAILABLE) from None
    return pynvml


def driver_version() -> str:
    n = _nvml()
    v = n.nvmlSystemGetDriverVersion()
    return v.decode() if isinstance(v, bytes) else v


def discover() -> list[Gpu]:
    """All GPUs in PCI order with their active NVLinks. Raises UserError when NVML is missing or no GPU exists."""
    n = _nvml()
    count = n.nvmlDeviceGetCount()
    if count == 0:
        raise UserError("no GPU: NVML reports 0 devices", NO_GPU)
    gpus = []
    for i in range(count):
        h = n.nvmlDeviceGetHandleByIndex(i)
        name = n.nvmlDeviceGetName(h)
        uuid = n.nvmlDeviceGetUUID(h)
        gpu = Gpu(
            index=i,
            uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
            pci_bus_id=normalise_bus_id(n.nvmlDeviceGetPciInfo(h).busId),
            name=name.decode() if isinstance(name, bytes) else name,
        )
        for link in range(NVLINK_MAX_LINKS):
            try:
                if n.nvmlDeviceGetNvLinkState(h, link) != n.NVML_FEATURE_ENABLED:
                    continue
                peer = normalise_bus_id(n.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
            except n.NVMLError:
                continue  # link index not present on this GPU / NVLink unsupported
            gpu.links[link] = peer
            gpu.nvlink_peers[peer] = gpu.nvlink_peers.get(peer, 0) + 1
        gpu.link_speed_gbps = _link_speed_gbps(n, h, min(gpu.links)) if gpu.links else None
        gpu.cpu_affinity, gpu.numa_nodes = _affinity(n, h)
        gpus.append(gpu)
    handles = {g.pci_bus_id: n.nvmlDeviceGetHandleByIndex(g.index) for g in gpus}
    attribute_unnamed_links(gpus, lambda a, b: _p2p_nvlink_ok(n, handles[a.pci_bus_id], handles[b.pci_bus_id]))
    return sorted(gpus, key=lambda g: g.pci_bus_id)


def _p2p_nvlink_ok(n, ha, hb) -> bool:
    try:
        return n.nvmlDeviceGetP2PStatus(ha, hb, n.NVML_P2P_CAPS_INDEX_NVLINK) == n.NVML_P2P_STATUS_OK
    except n.NVMLError:
        return False


def attribute_unnamed_links(gpus: list[Gpu], nvlink_p2p_ok) -> None:
    """Give links whose peer NVML could not name (a bus id that is no GPU here) to the peer P2P status points at. Only
    when exactly one other GPU is reachable over NVLink is the answer unambiguous; otherwise the links keep the unknown
    id (an NVSwitch, or a VM hiding several peers) and callers treat them as not attributable."""
    known = {g.pci_bus_id for g in gpus}
    for g in gpus:
        unnamed = [ln for ln, peer in g.links.items() if peer not in known]
        if not unnamed:
            continue
        candidates = [o for o in gpus if o is not g and nvlink_p2p_ok(g, o)]
        if len(candidates) != 1:
            continue
        peer = candidates[0].pci_bus_id
        for ln in unnamed:
            old = g.links[ln]
            g.links[ln] = peer
            g.nvlink_peers[old] -= 1
            if not g.nvlink_peers[old]:
                del g.nvlink_peers[old]
            g.nvlink_peers[peer] = g.nvlink_peers.get(peer, 0) + 1
        g.link_attribution = "p2p-status"


def _link_speed_gbps(n, handle, link: int = 0) -> float | None:
    """Per-link, per-direction speed from NVML (MB/s -> GB/s); None when the driver does not say. On H200 with driver
    580 the "common" speed field (90) answers NOT_SUPPORTED while the per-link NVLINK_GET_SPEED field (164, scopeId =
    link) works, so ask for that first."""
    for field_id, scope in ((FI_NVLINK_GET_SPEED, link), (FI_NVLINK_SPEED_MBPS_COMMON, 0)):
        try:
            (val,) = n.nvmlDeviceGetFieldValues(handle, [(field_id, scope)])
        except n.NVMLError:
            continue
        mbps = val.value.uiVal if val.nvmlReturn == 0 else 0
        if mbps:
            return mbps * 1e6 / 1e9
    return None


def unpack_mask(words) -> list[int]:
    """NVML affinity bitmask (array of 64-bit words, word 0 = ids 0..63) -> sorted ids."""
    return [w * 64 + bit for w, word in enumerate(words) for bit in range(64) if int(word) >> bit & 1]


NVML_AFFINITY_SCOPE_NODE = 0  # nvmlAffinityScope_t: NUMA node scope


def _affinity(n, handle) -> tuple[list[int] | None, list[int] | None]:
    """(CPU ids, NUMA node ids) close to the GPU from NVML; None for what the driver does not support."""
    words = max(1, ((os.cpu_count() or 1) + 63) // 64)
    try:
        cpus = unpack_mask(n.nvmlDeviceGetCpuAffinity(handle, words)) or None
    except (n.NVMLError, AttributeError):
        cpus = None
    try:
        nodes = unpack_mask(n.nvmlDeviceGetMemoryAffinity(handle, 4, NVML_AFFINITY_SCOPE_NODE)) or None
    except (n.NVMLError, AttributeError):
        nodes = None
    return cpus, nodes


def nvlink_count(a: Gpu, b: Gpu) -> int:
    """Active NVLinks between two GPUs as seen from `a`."""
    return a.nvlink_peers.get(b.pci_bus_id, 0)


# --- NVLink throughput counters and GPU processes (verify-nvlink) ---------------------------------------------------

# scopeId asking for the sum over all links (nvml.h: "A scopeId of UINT_MAX returns aggregate value summed up across
# all links for the specified counter type").
NVLINK_SCOPE_ALL_LINKS = 0xFFFFFFFF
THROUGHPUT_FIELDS = {
    "data_tx": FI_NVLINK_THROUGHPUT_DATA_TX,
    "data_rx": FI_NVLINK_THROUGHPUT_DATA_RX,
    "raw_tx": FI_NVLINK_THROUGHPUT_RAW_TX,
    "raw_rx": FI_NVLINK_THROUGHPUT_RAW_RX,
}
KIB = 1024  # the throughput fields count KiB


@dataclass
class NvlinkThroughput:
    """Cumulative NVLink throughput counters of one GPU, in BYTES (NVML counts KiB; converted here). `total` is the
    all-links aggregate (scopeId UINT_MAX), `links` the per-link values; a counter the driver does not answer is None.
    """

    uuid: str
    total: dict[str, int | None]
    links: dict[int, dict[str, int | None]] = field(default_factory=dict)


def field_value_int(value_type: int, value) -> int | float:
    """The number inside an nvmlValue_t union, by nvmlValueType_t (0 double, 1 uint, 2 ulong, 3 ullong, 4 sllong,
    5 sint, 6 ushort)."""
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}.get(value_type, "ullVal")
    return getattr(value, attr)


def throughput_from_field_values(uuid: str, answers) -> NvlinkThroughput:
    """Build a snapshot from (field_id, scope_id, nvml_return, value_kib) tuples: pure, so it is tested on values
    recorded from a driver. nvml_return != 0 (e.g. 3 NOT_SUPPORTED) leaves that counter None."""
    names = {fid: name for name, fid in THROUGHPUT_FIELDS.items()}
    out = NvlinkThroughput(uuid=uuid, total={k: None for k in THROUGHPUT_FIELDS})
    for fid, scope, ret, value in answers:
        name = names.get(fid)
        if name is None:
            continue
        v = int(value) * KIB if ret == 0 else None
        if scope == NVLINK_SCOPE_ALL_LINKS:
            out.total[name] = v
        else:
            out.links.setdefault(int(scope), {k: None for k in THROUGHPUT_FIELDS})[name] = v
    return out


def nvlink_throughput(gpus: list[Gpu]) -> dict[str, NvlinkThroughput]:
    """One snapshot of fields 138-141 (aggregate + each active link) for each GPU, keyed by UUID."""
    n = _nvml()
    snap = {}
    for g in gpus:
        h = n.nvmlDeviceGetHandleByUUID(g.uuid)
        scopes = [NVLINK_SCOPE_ALL_LINKS, *sorted(g.links)]
        ids = [(fid, s) for s in scopes for fid in THROUGHPUT_FIELDS.values()]
        try:
            vals = n.nvmlDeviceGetFieldValues(h, ids)
            answers = [(v.fieldId, v.scopeId, v.nvmlReturn, field_value_int(v.valueType, v.value)) for v in vals]
        except n.NVMLError:
            answers = []  # the whole call refused: every counter stays None
        snap[g.uuid] = throughput_from_field_values(g.uuid, answers)
    return snap


def compute_pids(gpus: list[Gpu]) -> dict[str, set[int]]:
    """PIDs with a compute context on each GPU (keyed by UUID), as the driver reports them. In a container without
    the host PID namespace these are host PIDs, so a caller must treat "not seen" as "unknown", never as "absent"."""
    n = _nvml()
    out: dict[str, set[int]] = {}
    for g in gpus:
        h = n.nvmlDeviceGetHandleByUUID(g.uuid)
        try:
            out[g.uuid] = {int(p.pid) for p in n.nvmlDeviceGetComputeRunningProcesses(h)}
        except n.NVMLError:
            out[g.uuid] = set()
    return out


# --- what a benchmark result records about its GPUs -----------------------------------------------------------------

def device_facts(index: int) -> dict:
    """One GPU as a benchmark records it: model, ids, and its SM / memory clocks in MHz (now, the applications
    setting, the maximum); what the driver does not answer is None."""
    n = _nvml()
    h = n.nvmlDeviceGetHandleByIndex(index)

    def ask(fn, *args):
        try:
            v = fn(h, *args)
        except n.NVMLError:
            return None
        return v.decode() if isinstance(v, bytes) else v

    out = {"index": index, "name": ask(n.nvmlDeviceGetName), "uuid": ask(n.nvmlDeviceGetUUID),
           "pci_bus_id": normalise_bus_id(n.nvmlDeviceGetPciInfo(h).busId)}
    for kind, clock in (("sm", n.NVML_CLOCK_SM), ("mem", n.NVML_CLOCK_MEM)):
        out[f"{kind}_clock_mhz"] = ask(n.nvmlDeviceGetClockInfo, clock)
        out[f"{kind}_clock_applications_mhz"] = ask(n.nvmlDeviceGetApplicationsClock, clock)
        out[f"{kind}_clock_max_mhz"] = ask(n.nvmlDeviceGetMaxClockInfo, clock)
    return out


def cuda_driver_version() -> str | None:
    """The CUDA version the driver supports, e.g. '13.0' (None where NVML does not say)."""
    n = _nvml()
    try:
        v = int(n.nvmlSystemGetCudaDriverVersion_v2())
    except (n.NVMLError, AttributeError):
        return None
    return f"{v // 1000}.{v % 1000 // 10}"
