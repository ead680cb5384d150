"""What a container of the image needs on a GPU host, written once for `docker run` and for a compose file
(docs/gpu-hosts.md).

One worker container per GPU (`--gpus device=N`: `--gpus all` everywhere would put every worker on GPU 0 first), all
in the IPC and PID namespaces of a small holder container (`--ipc shareable`, like a pod's pause container): UCX
selects cuda_ipc for every process with the same boot id, and between containers with namespaces of their own it
fails or falls back to a slower path. RAPIDS' 64 MiB stack; on InfiniBand hosts the device, IPC_LOCK and unlimited
memlock (RDMA registers memory); SYS_PTRACE for cma; `--shm-size` for UCX's posix transport (64 MiB otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import USAGE, UserError

SHM_SIZE = "1g"
STACK_BYTES = 64 << 20               # RAPIDS' `--ulimit stack=67108864`


@dataclass(frozen=True)
class HostFlags:
    gpu: str | None = None          # the GPU this container drives (its index or UUID)
    ipc: str | None = None          # "shareable", "host", or "container:NAME"
    pid: str | None = None          # "host" or "container:NAME"
    infiniband: bool = False
    cma: bool = False

    def docker_args(self) -> list[str]:
        args = ["--shm-size", SHM_SIZE]
        if self.gpu is not None:
            args += ["--gpus", f"device={self.gpu}", "--ulimit", f"stack={STACK_BYTES}"]
        if self.ipc:
            args += ["--ipc", self.ipc]
        if self.pid:
            args += ["--pid", self.pid]
        if self.infiniband:
            args += ["--device", "/dev/infiniband", "--cap-add", "IPC_LOCK", "--ulimit", "memlock=-1"]
        if self.cma:
            args += ["--cap-add", "SYS_PTRACE"]
        return args

    def compose(self) -> dict:
        """The same, as keys of a compose service (names of other containers are service names there)."""
        svc: dict = {"shm_size": SHM_SIZE}
        ulimits = {}
        if self.gpu is not None:
            svc["deploy"] = {"resources": {"reservations": {"devices": [
                {"driver": "nvidia", "device_ids": [str(self.gpu)], "capabilities": ["gpu"]}]}}}
            ulimits["stack"] = STACK_BYTES
        for key, value in (("ipc", self.ipc), ("pid", self.pid)):
            if value:
                svc[key] = value.replace("container:", "service:")
        caps = []
        if self.infiniband:
            svc["devices"] = ["/dev/infiniband:/dev/infiniband"]
            ulimits["memlock"] = -1
            caps.append("IPC_LOCK")
        if self.cma:
            caps.append("SYS_PTRACE")
        if caps:
            svc["cap_add"] = caps
        if ulimits:
            svc["ulimits"] = ulimits
        return svc


# The namespace holder's command: sleeps until stopped (tini forwards the stop signal).
HOLDER_ARGV = ["bash", "-c", "exec sleep infinity"]
HOLDER = HostFlags(ipc="shareable")


def gpu_workers(gpus: list[str], holder: str, infiniband: bool = False, cma: bool = False) -> list[HostFlags]:
    """One worker per GPU on one host, each in the IPC and PID namespaces of the container `holder`."""
    return [HostFlags(gpu=gpu, ipc=f"container:{holder}", pid=f"container:{holder}", infiniband=infiniband, cma=cma)
            for gpu in gpus]


def parse_gpus(text: str) -> list[str]:
    """'0,1,2' -> ['0', '1', '2'] (indices or GPU UUIDs, as `--gpus device=` takes them)."""
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus or len(set(gpus)) != len(gpus):
        raise UserError(f"--gpus {text!r}: give distinct GPU indices or UUIDs, comma-separated", USAGE)
    return gpus
