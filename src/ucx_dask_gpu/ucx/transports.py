"""Which UCX transports a Dask process will really use here, why not others, and settings that contradict each other
(what `doctor` and each worker's start-up line say: docs/environment-gate.md). Three inputs, each read where it lives:
the transport settings, resolved with distributed-ucxx's own precedence (distributed_ucxx.ucxx._prepare_ucx_config
and init_once: `UCX_TLS` in the environment, then the `distributed-ucxx.*` flags, legacy `distributed.comm.ucx.*`,
then `distributed-ucxx.environment.tls`; none: UCX selects itself, what the image ships); the transports this UCX
offers here (`ucx_info -d`); the host as this process sees it (its boot id and IPC/PID namespaces: UCX's cuda_ipc
treats every process with the same boot id as reachable, whatever its namespaces; InfiniBand devices in /sys versus
/dev/infiniband; the memlock limit RDMA needs).

Pure functions over those inputs (tested on recorded `ucx_info -d` output and fake /sys, /dev and /proc trees);
`doctor` and the workers' start-up line (ucx/startup.py) read the real ones.
"""
from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ..errors import UserError
from ..fsutil import mapped_library
from . import info as ucxinfo
from .info import UcxDevices
from .install import at, prefix_of_library

# distributed-ucxx's high-level flags, in the order it reads them.
FLAGS = ("tcp", "nvlink", "infiniband", "rdmacm", "cuda-copy")
# Initial-namespace inode numbers (include/linux/proc_ns.h); UCX's ucs_sys_ns_is_default compares with the same.
HOST_IPC_NS = 0xEFFFFFFF
HOST_PID_NS = 0xEFFFFFFC

# UCX_TLS aliases (ucp_context.c ucp_tl_aliases, UCX 1.20); auxiliary transports are left out.
ALIASES = {
    "mm": ("posix", "sysv", "xpmem"),
    "sm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "shm": ("posix", "sysv", "xpmem", "knem", "cma"),
    "ib": ("rc_verbs", "ud_verbs", "rc_mlx5", "ud_mlx5", "dc_mlx5", "gga_mlx5", "srd"),
    "ud_v": ("ud_verbs",), "ud_x": ("ud_mlx5",), "ud": ("ud_mlx5", "ud_verbs"),
    "rc_v": ("rc_verbs",), "rc_x": ("rc_mlx5",), "rc": ("rc_mlx5", "rc_verbs"),
    "dc": ("dc_mlx5",), "dc_x": ("dc_mlx5",), "gga": ("gga_mlx5",),
    "cuda": ("cuda_copy", "cuda_ipc", "gdr_copy"),
}
SHARED_MEMORY = ("posix", "sysv", "cma", "xpmem", "knem")
RDMA = ("rc_mlx5", "rc_verbs", "dc_mlx5", "ud_mlx5", "ud_verbs", "srd", "gga_mlx5")


# --- settings ----------------------------------------------------------------------------------------------------

def _get(config: Mapping, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping):
            return None
        node = node.get(part, node.get(part.replace("-", "_")))
    return node


def _flag(config: Mapping, name: str):
    value = _get(config, f"distributed-ucxx.{name}")
    return value if value is not None else _get(config, f"distributed.comm.ucx.{name}")


@dataclass(frozen=True)
class Settings:
    """The UCX_TLS a process will run with (None: UCX's automatic selection) and where it comes from."""

    tls: str | None
    source: str
    flags: Mapping[str, object]
    conflicts: tuple[str, ...] = ()

    @property
    def automatic(self) -> bool:
        return self.tls is None


def flags_tls(flags: Mapping[str, object]) -> str | None:
    """distributed-ucxx's translation of its flags into UCX_TLS (None when it leaves UCX to choose)."""
    if not any(flags.get(k) for k in ("tcp", "nvlink", "infiniband")):
        return None
    tls = "tcp"
    if flags.get("nvlink") or flags.get("cuda-copy"):
        tls += ",cuda_copy"
    if flags.get("infiniband"):
        tls = "rc," + tls
    if flags.get("nvlink"):
        tls += ",cuda_ipc"
    return tls


def settings(config: Mapping, environ: Mapping[str, str]) -> Settings:
    """Resolve the transports of a process with dask config `config` and environment `environ`."""
    flags = {k: _flag(config, k) for k in FLAGS}
    env_cfg = _get(config, "distributed-ucxx.environment") or {}
    env_tls = next((str(v) for k, v in env_cfg.items() if str(k).lower() == "tls"), None)
    from_flags = flags_tls(flags)
    conflicts = []
    set_flags = ", ".join(f"{k}={v}" for k, v in flags.items() if v is not None)
    if environ.get("UCX_TLS") is not None and set_flags:
        conflicts.append(f"UCX_TLS={environ['UCX_TLS']} in the environment overrides the dask config's "
                         f"distributed-ucxx {set_flags}: set transports in one place only")
    if from_flags is not None and env_tls is not None:
        conflicts.append(f"distributed-ucxx.environment.tls={env_tls} is ignored in favour of the flags "
                         f"distributed-ucxx {set_flags}: set transports in one place only")
    if environ.get("UCX_TLS") is not None and env_tls is not None and from_flags is None:
        conflicts.append(f"UCX_TLS={environ['UCX_TLS']} in the environment overrides "
                         f"distributed-ucxx.environment.tls={env_tls}: set transports in one place only")
    if flags.get("rdmacm") and not flags.get("infiniband"):
        conflicts.append("distributed-ucxx.rdmacm=True needs distributed-ucxx.infiniband=True (rdmacm connects "
                         "InfiniBand endpoints)")
    if from_flags is None and any(flags.get(k) for k in ("rdmacm", "cuda-copy")):
        on = ", ".join(k for k in ("rdmacm", "cuda-copy") if flags.get(k))
        conflicts.append(f"distributed-ucxx {on}=True has no effect without tcp, nvlink or infiniband set: "
                         "distributed-ucxx then leaves every transport to UCX")
    for k in FLAGS:
        new, old = _get(config, f"distributed-ucxx.{k}"), _get(config, f"distributed.comm.ucx.{k}")
        if new is not None and old is not None and bool(new) != bool(old):
            conflicts.append(f"distributed-ucxx.{k}={new} and the legacy distributed.comm.ucx.{k}={old} disagree")
    if environ.get("UCX_TLS") is not None:
        tls, source = environ["UCX_TLS"], "UCX_TLS in the environment"
    elif from_flags is not None:
        tls, source = from_flags, f"dask config distributed-ucxx {set_flags}"
    elif env_tls is not None:
        tls, source = env_tls, "dask config distributed-ucxx.environment.tls"
    else:
        tls, source = None, "nothing sets UCX_TLS or distributed-ucxx transport flags"
    return Settings(tls=tls, source=source, flags=flags, conflicts=tuple(conflicts))


def enabled(transport: str, tls: str | None) -> bool:
    """Does UCX_TLS=`tls` (None: not set, i.e. all) let UCX use `transport`?"""
    if tls is None:
        return True
    spec = tls.strip()
    negate = spec.startswith("^")
    names = set()
    for item in spec.lstrip("^").split(","):
        item = item.strip().split(":")[0]
        if item.startswith("\\"):
            names.add(item[1:])
        elif item == "all":
            names.add("all")
        else:
            names.update(ALIASES.get(item, (item,)))
    listed = "all" in names or transport in names
    return not listed if negate else listed


# --- the host ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostFacts:
    boot_id: str | None
    ipc_ns: int | None
    pid_ns: int | None
    ib_devices: tuple[str, ...]          # /sys/class/infiniband
    uverbs: tuple[str, ...]              # /dev/infiniband/uverbs*
    memlock: int | None                  # soft RLIMIT_MEMLOCK in bytes; None = unlimited

    @property
    def private_ipc(self) -> bool:
        return self.ipc_ns is not None and self.ipc_ns != HOST_IPC_NS

    @property
    def private_pid(self) -> bool:
        return self.pid_ns is not None and self.pid_ns != HOST_PID_NS

    def as_dict(self) -> dict:
        return {"boot_id": self.boot_id, "ipc_ns": self.ipc_ns, "pid_ns": self.pid_ns,
                "ib_devices": list(self.ib_devices), "uverbs": list(self.uverbs), "memlock": self.memlock}


def _ns_inode(proc: Path, kind: str) -> int | None:
    try:
        return os.stat(proc / "self" / "ns" / kind).st_ino
    except OSError:
        return None


def host_facts(root: str | os.PathLike = "/") -> HostFacts:
    """What this process sees of its host (its files under `root`: a recorded tree in tests)."""
    root = Path(root)
    try:
        boot_id = (root / "proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        boot_id = None
    try:
        ib = tuple(sorted(p.name for p in (root / "sys/class/infiniband").iterdir()))
    except OSError:
        ib = ()
    uverbs = tuple(sorted(p.name for p in (root / "dev/infiniband").glob("uverbs*")))
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]  # this process's, whatever the tree
    memlock = None if soft == resource.RLIM_INFINITY else soft
    return HostFacts(boot_id=boot_id, ipc_ns=_ns_inode(root / "proc", "ipc"), pid_ns=_ns_inode(root / "proc", "pid"),
                     ib_devices=ib, uverbs=uverbs, memlock=memlock)


# --- what is used --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    """Per kind of peer, the transports UCX can choose from (available here and allowed by UCX_TLS)."""

    settings: Settings
    gpu: bool                                      # UCX sees a GPU here (its cuda transports have a device)
    gpu_peers: list[str] = field(default_factory=list)        # GPU buffers to processes on this host
    same_host: list[str] = field(default_factory=list)        # host buffers to processes on this host
    other_hosts: list[str] = field(default_factory=list)      # anything to other hosts
    off: list[str] = field(default_factory=list)              # available here, left out by UCX_TLS
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        s = self.settings
        return {"ucx_tls": s.tls, "automatic": s.automatic, "source": s.source, "conflicts": list(s.conflicts),
                "gpu": self.gpu, "gpu_peers": self.gpu_peers, "same_host": self.same_host,
                "other_hosts": self.other_hosts, "off": self.off, "warnings": self.warnings}


def _with_devices(devs: UcxDevices, names) -> list[str]:
    out = []
    for t in names:
        d = [x for x in devs.devices(t) if x not in ("memory", "memory0", "cuda")]
        out.append(f"{t} ({', '.join(d)})" if d else t)
    return out


def plan(s: Settings, devs: UcxDevices, host: HostFacts) -> Plan:
    have = set(devs.transports)
    use = {t for t in have if enabled(t, s.tls)}
    p = Plan(settings=s, gpu=bool({"cuda_copy", "cuda_ipc"} & have))
    p.off = sorted(have - use - {"self"})
    tls_said = f"UCX_TLS={s.tls} ({s.source})"
    if p.gpu:
        if "cuda_ipc" in use:
            p.gpu_peers = ["cuda_ipc"]
        elif "cuda_copy" in use:
            p.gpu_peers = ["cuda_copy + host memory"]
        if "cuda_ipc" in have and "cuda_ipc" not in use:
            p.warnings.append(f"{tls_said} leaves out cuda_ipc: GPU buffers to GPUs of this host are staged "
                              "through host memory")
        if "cuda_copy" in have and "cuda_copy" not in use:
            p.warnings.append(f"{tls_said} leaves out cuda_copy: UCX cannot send GPU buffers at all")
        if "cuda_ipc" in use and (host.private_ipc or host.private_pid):
            which = " and ".join(n for n, private in (("IPC", host.private_ipc), ("PID", host.private_pid))
                                 if private)
            p.warnings.append(f"this process has a private {which} namespace (a container): cuda_ipc works only with "
                              "GPU processes in the same namespaces, yet UCX selects it for every process of this "
                              f"kernel (boot id {host.boot_id}); give every GPU container of a host the same IPC and "
                              "PID namespaces (docker --ipc/--pid container:NAME or host; compose ipc/pid)")
    p.same_host = _with_devices(devs, [t for t in SHARED_MEMORY if t in use]) or \
        _with_devices(devs, [t for t in ("tcp", *RDMA) if t in use])
    rdma = [t for t in RDMA if t in use]
    p.other_hosts = _with_devices(devs, rdma + (["tcp"] if "tcp" in use else []))
    rdma_here = [t for t in RDMA if t in have]
    if rdma_here and not rdma:
        p.warnings.append(f"{tls_said} leaves out InfiniBand ({', '.join(rdma_here)}): other hosts are reached over "
                          "TCP")
    if host.ib_devices and not host.uverbs:
        p.warnings.append(f"InfiniBand devices {', '.join(host.ib_devices)} exist on this host but /dev/infiniband is "
                          "not mapped here: UCX cannot use them (docker run --device /dev/infiniband --cap-add "
                          "IPC_LOCK --ulimit memlock=-1)")
    if (host.ib_devices or rdma_here) and host.memlock is not None:
        p.warnings.append(f"memlock limit {host.memlock // 1024} KiB: RDMA registration of large buffers fails "
                          "(docker run --ulimit memlock=-1; limits.conf memlock unlimited)")
    return p


def summary(p: Plan, host: HostFacts) -> str:
    """One line: where the settings come from and what each kind of peer gets."""
    s = p.settings
    tls = "automatic (UCX selects; nothing sets UCX_TLS)" if s.automatic else f"UCX_TLS={s.tls} from {s.source}"
    parts = [f"transports {tls}"]
    if p.gpu:
        parts.append(f"GPU buffers to this host: {', '.join(p.gpu_peers) or 'none'}")
    else:
        parts.append("no GPU seen by UCX")
    parts.append(f"host buffers to this host: {', '.join(p.same_host) or 'none'}")
    parts.append(f"other hosts: {', '.join(p.other_hosts) or 'none'}")
    ns = "host" if not (host.private_ipc or host.private_pid) else \
        f"IPC {'private' if host.private_ipc else 'host'}, PID {'private' if host.private_pid else 'host'}"
    parts.append(f"namespaces {ns}, boot id {(host.boot_id or '?')[:8]}")
    return "; ".join(parts)


def cuda_ipc_blocked(a: Mapping, b: Mapping) -> bool:
    """Two processes (their `peer_facts`) on one kernel whose cuda_ipc cannot reach each other: UCX picks cuda_ipc
    (same boot id) but their IPC or PID namespaces differ."""
    return (bool(a.get("cuda_ipc")) and bool(b.get("cuda_ipc")) and a.get("boot_id") is not None
            and a.get("boot_id") == b.get("boot_id")
            and (a.get("ipc_ns") != b.get("ipc_ns") or a.get("pid_ns") != b.get("pid_ns")))


def peer_facts(p: Plan, host: HostFacts) -> dict:
    """What a worker tells the scheduler so that it can compare workers of one host."""
    return {"boot_id": host.boot_id, "ipc_ns": host.ipc_ns, "pid_ns": host.pid_ns,
            "cuda_ipc": p.gpu_peers == ["cuda_ipc"]}


def mapped_libucp(pid: int | str = "self") -> str | None:
    """The libucp.so a process (this one by default) has mapped (None before UCX is loaded, or when it is gone)."""
    return mapped_library("libucp.so", pid)


def observe(config: Mapping, environ: Mapping[str, str], ucx_prefix: str | os.PathLike | None = None,
            root: str | os.PathLike = "/") -> tuple[Plan, HostFacts, str | None]:
    """The plan of a process with this dask config and environment, from this machine's `ucx_info -d` (of
    `ucx_prefix`, else of the UCX this process has mapped, else the one on PATH). The third value says why no
    transports could be listed (None when they could)."""
    host = host_facts(root)
    prefix = ucx_prefix or prefix_of_library(mapped_libucp())
    exe = at(prefix).ucx_info if prefix else None
    why = None
    try:
        devs = ucxinfo.devices(exe or ucxinfo.find_ucx_info())
    except UserError as e:
        devs, why = UcxDevices(), str(e)
    return plan(settings(config, environ), devs, host), host, why
