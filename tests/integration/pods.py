"""Containers of the image on one internal Docker network, standing in for hosts, pods and job nodes.

- `Net.pod(name)`: a holder container owning a network and IPC namespace (what a Kubernetes pod's pause container
  owns; here it also stands for a host), reachable on the network under `name`;
- `Net.run(name, argv, pod=...)`: a role in a pod's namespaces (`--network container:POD --ipc container:POD`), or on
  its own on the network;
- everything carries the cluster label of `ucx-dask-gpu image remove-clusters`, and `stop()` removes it all and returns
  every log.
Plain `docker run`, as a user types it.
"""
from __future__ import annotations

import secrets
import subprocess

from ucx_dask_gpu.image.cluster import CLUSTER_LABEL, parse_json_output, stop_in_order
from ucx_dask_gpu.image.docker import container_logs, container_state, docker_bin, wait_until
from ucx_dask_gpu.image.gpuhost import HOLDER, HOLDER_ARGV


class Net:
    def __init__(self, image: str, kind: str):
        self.image = image
        self.name = f"udg-{kind}-{secrets.token_hex(3)}"
        self.containers: list[str] = []
        self.pods: list[str] = []
        subprocess.run([docker_bin(), "network", "create", "--internal", "--label", f"{CLUSTER_LABEL}={self.name}",
                        self.name], check=True, capture_output=True)

    def _base(self, name: str) -> list[str]:
        return [docker_bin(), "run", "--name", name, "--label", f"{CLUSTER_LABEL}={self.name}"]

    def pod(self, name: str) -> str:
        """A holder for a pod's (or host's) network and IPC namespaces, called `name` on the network."""
        full = f"{self.name}-{name}"
        subprocess.run([*self._base(full), "-d", "--network", self.name, "--network-alias", name, "--hostname", name,
                        *HOLDER.docker_args(), self.image, *HOLDER_ARGV], check=True, capture_output=True)
        self.containers.append(full)
        self.pods.append(full)
        return full

    def run_args(self, name: str, argv: list[str], pod: str | None = None, env: dict | None = None,
                 entrypoint: str | None = None, aliases: tuple[str, ...] = (), hostname: str | None = None,
                 volumes: tuple[str, ...] = (), detach: bool = True, flags: tuple[str, ...] = ()) -> list[str]:
        """`flags`: more `docker run` options as a runtime would give them (--read-only, --user, --tmpfs)."""
        args = [*self._base(name), "--shm-size", "1g", *flags] + (["-d"] if detach else ["--rm", "-i"])
        if pod:
            args += ["--network", f"container:{pod}", "--ipc", f"container:{pod}"]
        else:
            args += ["--network", self.name, "--hostname", hostname or name]
            for a in aliases:
                args += ["--network-alias", a]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        for v in volumes:
            args += ["-v", v]
        if entrypoint is not None:
            args += ["--entrypoint", entrypoint]
        return args + [self.image, *argv]

    def run(self, name: str, argv: list[str], **kw) -> str:
        full = f"{self.name}-{name}"
        proc = subprocess.run(self.run_args(full, argv, **kw), capture_output=True, text=True)
        assert proc.returncode == 0, f"docker run {full}: {proc.stderr.strip()[-500:]}"
        self.containers.append(full)
        return full

    def client(self, argv: list[str], timeout: float = 300, input: str | None = None,
               **kw) -> subprocess.CompletedProcess:
        """A foreground container (removed when it exits): its exit code and output."""
        name = f"{self.name}-client-{secrets.token_hex(2)}"
        return subprocess.run(self.run_args(name, argv, detach=False, **kw), capture_output=True, text=True,
                              timeout=timeout, input=input)

    def label(self) -> str:
        return f"{CLUSTER_LABEL}={self.name}"

    def workload(self, address: str, *args: str, **kw) -> dict:
        proc = self.client(["ucx-dask-gpu", "workload", "transpose", "--scheduler", address, "--json", *args], **kw)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return parse_json_output(proc.stdout)

    def logs(self, name: str) -> str:
        return container_logs(name)

    def wait_log(self, name: str, text: str, count: int = 1, timeout: float = 180) -> None:
        def seen():
            state = container_state(name) or {}
            assert state.get("Running"), f"{name} exited ({state.get('ExitCode')}): {self.logs(name)[-2000:]}"
            return self.logs(name).count(text) >= count

        assert wait_until(seen, timeout), f"{name}: {text!r} x{count} not logged within {timeout} s"

    def exited(self, name: str, timeout: float = 120) -> dict:
        state = wait_until(lambda: (s := container_state(name)) and not s["Running"] and s, timeout)
        assert state, f"{name} still runs"
        return state

    def stop(self) -> dict:
        """Stop workers and clients, then schedulers, then pods (their namespaces go last), as the cluster does;
        remove everything; every log and traceback."""
        schedulers = [c for c in self.containers if c.endswith("-scheduler")]
        report = stop_in_order([[c for c in self.containers if c not in self.pods and c not in schedulers],
                                schedulers, self.pods])
        if self.containers:
            subprocess.run([docker_bin(), "rm", "-f", *self.containers], capture_output=True)
        subprocess.run([docker_bin(), "network", "rm", self.name], capture_output=True)
        self.containers, self.pods = [], []
        return report
