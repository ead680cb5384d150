"""A Dask cluster of containers from the ONE image: scheduler + workers + client, on an internal Docker network.

Plain `docker run`, driven from here, needs no compose and lets a caller kill one worker, add one from another image
and read every log. The network is `--internal` (no route out); GPU workers share the IPC and PID namespaces of a
holder container so cuda_ipc works between them (gpuhost.py); a volume at /data on workers and clients holds the
files from-map's client writes. With TLS every role requires mutual TLS (make_tls_dir), so a plain-TCP client, or one
without a certificate of this cluster's CA, is refused.

Stop: workers, then the scheduler (then the namespace holder), with SIGTERM and a grace period. Workers are not
retired through the scheduler first: that races their heartbeats and logs more errors, not fewer.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cliutil import Progress, signals_deferred
from ..errors import CLUSTER_FAILED, USAGE, UserError
from ..gate import tls
from ..oci.archive import LABEL_PREFIX
from .docker import container_logs, container_state, docker, docker_bin, image_inspect, last_line, wait_until
from .gpuhost import HOLDER, HOLDER_ARGV, HostFlags, gpu_workers

PROTOCOLS = ("tcp", "ucx", "tls")
PORT = 8786
TLS_MOUNT = "/tls"
DATA_MOUNT = "/data"
STOP_GRACE_S = 30
# Every container, volume and network of a cluster carries this label (its value: the cluster's name).
CLUSTER_LABEL = LABEL_PREFIX + "cluster"


say = Progress("cluster: ", stream="stdout")


def has_traceback(log: str) -> bool:
    return "Traceback (most recent call last)" in log


@dataclass
class Cluster:
    image: str
    protocol: str = "tcp"
    n_workers: int = 2
    nthreads: int = 2
    memory_limit: str = "4GiB"
    gpu: bool = False
    gpus: tuple[str, ...] = ()      # GPU mode: one worker per GPU (default: GPUs 0..n_workers-1)
    infiniband: bool = False        # GPU mode: map /dev/infiniband, IPC_LOCK, unlimited memlock
    cma: bool = False               # GPU mode: SYS_PTRACE, for UCX's cma between the workers of a host
    name: str = field(default_factory=lambda: f"udg-{secrets.token_hex(3)}")
    containers: list[str] = field(default_factory=list)
    tls_dir: Path | None = None
    uid: int | None = None
    started: bool = False

    def __post_init__(self):
        if self.protocol not in PROTOCOLS:
            raise UserError(f"unknown protocol {self.protocol!r} (expected {', '.join(PROTOCOLS)})", USAGE)
        if self.gpu:
            self.gpus = tuple(self.gpus) or tuple(str(i) for i in range(self.n_workers))
            self.n_workers = len(self.gpus)
        elif self.gpus or self.infiniband or self.cma:
            raise UserError("gpus, infiniband and cma are GPU-host settings: use them with gpu=True", USAGE)

    # --- names and arguments ------------------------------------------------------------------------------------
    @property
    def network(self) -> str:
        return self.name

    @property
    def volume(self) -> str:
        return f"{self.name}-data"

    @property
    def scheduler_name(self) -> str:
        return f"{self.name}-scheduler"

    @property
    def address(self) -> str:
        return f"{self.protocol}://scheduler:{PORT}"

    def worker_name(self, i: int | str) -> str:
        return f"{self.name}-worker-{i}"

    @property
    def holder_name(self) -> str:
        return f"{self.name}-gpuhost"

    def host_flags(self, i: int | str | None = None, holder: str | None = None) -> HostFlags:
        """What container `i` (a worker index; None: scheduler or client) needs of the host; `holder` names the
        namespace holder (default: this cluster's container)."""
        if not self.gpu or not isinstance(i, int):
            return HostFlags()
        return gpu_workers([self.gpus[i]], holder or self.holder_name, self.infiniband, self.cma)[0]

    def _env(self, extra: dict | None = None) -> list[str]:
        env = dict(extra or {})
        if self.protocol == "tls":  # every container gets each role's certificate; it uses its own role's
            for role in tls.ROLES:
                env.update(tls.dask_env(TLS_MOUNT, role))
        return [a for k, v in sorted(env.items()) for a in ("-e", f"{k}={v}")]

    def _mounts(self, data: bool = True) -> list[str]:
        out = []
        if self.tls_dir is not None:
            out += ["-v", f"{self.tls_dir}:{TLS_MOUNT}:ro"]
        if data:
            out += ["-v", f"{self.volume}:{DATA_MOUNT}"]
        return out

    def run_args(self, name: str, argv: list[str], image: str | None = None, aliases: tuple[str, ...] = (),
                 data: bool = False, host: HostFlags | None = None) -> list[str]:
        """`docker run` arguments (without the `docker`) of one detached container of the cluster."""
        args = ["run", "-d", "--name", name, "--hostname", name, "--network", self.network,
                "--label", f"{CLUSTER_LABEL}={self.name}"]
        for a in aliases:
            args += ["--network-alias", a]
        args += (host or HostFlags()).docker_args()
        return args + self._env() + self._mounts(data) + [image or self.image, *argv]

    def _run_detached(self, name: str, argv: list[str], image: str | None = None, aliases: tuple[str, ...] = (),
                      data: bool = False, host: HostFlags | None = None) -> None:
        args = self.run_args(name, argv, image, aliases, data, host)
        docker(args, code=CLUSTER_FAILED, what=f"starting {name}")
        self.containers.append(name)

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 120) -> "Cluster":
        meta = image_inspect(self.image)
        if meta is None:
            raise UserError(f"no image {self.image} (build it: scripts/build_image.sh)", CLUSTER_FAILED)
        user = (meta.get("Config") or {}).get("User") or "0"
        self.uid = int(user.split(":")[0]) if user.split(":")[0].isdigit() else 0
        say(f"{self.name}: {self.protocol} cluster of {self.n_workers} workers from {self.image}")
        self.started = True
        try:
            docker(["network", "create", "--internal", "--label", f"{CLUSTER_LABEL}={self.name}",
                    self.network], code=CLUSTER_FAILED, what="creating the cluster network")
            docker(["volume", "create", "--label", f"{CLUSTER_LABEL}={self.name}", self.volume],
                   code=CLUSTER_FAILED, what="creating the data volume")
            if self.protocol == "tls":
                self.tls_dir = make_tls_dir(self.uid)
            self._run_detached(self.scheduler_name, self.scheduler_argv(), aliases=("scheduler",))
            if self.gpu:
                self._run_detached(self.holder_name, HOLDER_ARGV, host=HOLDER)
            self.wait_for_scheduler(timeout)
            for i in range(self.n_workers):
                self.add_worker(i)
            self.wait_for_workers(self.n_workers, timeout)
        except BaseException:
            self.stop(quiet=True)
            raise
        say(f"{self.name}: scheduler {self.address} with {self.n_workers} workers is up")
        return self

    def scheduler_argv(self) -> list[str]:
        # TLS certificates come from dask config (environment, see _env): the --tls-* flags would make the CLI
        # set host "tls://", which dask refuses together with --interface.
        return ["dask", "scheduler", "--protocol", self.protocol, "--port", str(PORT), "--no-dashboard",
                "--interface", "eth0"]

    def worker_argv(self, i: int | str) -> list[str]:
        cmd = ["dask", "cuda", "worker"] if self.gpu else ["dask", "worker"]
        argv = [*cmd, self.address, "--name", f"worker-{i}", "--no-dashboard", "--interface", "eth0",
                "--death-timeout", "60"]
        if not self.gpu:
            argv += ["--nthreads", str(self.nthreads), "--memory-limit", self.memory_limit]
        return argv

    def add_worker(self, i: int | str, image: str | None = None) -> str:
        name = self.worker_name(i)
        self._run_detached(name, self.worker_argv(i), image=image, data=True, host=self.host_flags(i))
        return name

    def _check_running(self, names: list[str]) -> None:
        for name in names:
            state = container_state(name) or {}
            if not state.get("Running"):
                raise UserError(f"{name} exited with code {state.get('ExitCode')}: "
                                f"{last_line(container_logs(name))[:300]}", CLUSTER_FAILED)

    def wait_for_scheduler(self, timeout: float) -> None:
        def ready():
            self._check_running([self.scheduler_name])
            return "Scheduler at:" in container_logs(self.scheduler_name)

        if not wait_until(ready, timeout):
            raise UserError(f"{self.scheduler_name} did not report 'Scheduler at:' within {timeout:.0f} s",
                            CLUSTER_FAILED)

    def registered_workers(self) -> int:
        log = container_logs(self.scheduler_name)
        return len(re.findall(r"Register worker", log)) - len(re.findall(r"Remove worker", log))

    def wait_for_workers(self, n: int, timeout: float) -> None:
        def ready():
            self._check_running([self.scheduler_name] + [c for c in self.containers if "-worker-" in c])
            return self.registered_workers() >= n

        if not wait_until(ready, timeout):
            raise UserError(f"only {self.registered_workers()} of {n} workers registered within {timeout:.0f} s",
                            CLUSTER_FAILED)

    def client_args(self, image: str | None = None, env: dict | None = None, interactive: bool = False) -> list[str]:
        """`docker run` arguments (without the command) for a client container on the cluster network."""
        args = [docker_bin(), "run", "--rm", "--network", self.network, *HostFlags().docker_args(),
                "--label", f"{CLUSTER_LABEL}={self.name}"]
        if interactive:
            args.append("-i")
        return args + self._env(env) + self._mounts(True) + [image or self.image]

    def run_client(self, argv: list[str], image: str | None = None, env: dict | None = None,
                   input: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        cmd = self.client_args(image, env, interactive=input is not None) + list(argv)
        try:
            return subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise UserError(f"client {' '.join(argv[:3])} did not finish within {timeout:.0f} s", CLUSTER_FAILED)

    def workload(self, kind: str, *args: str, image: str | None = None, timeout: float = 300) -> dict:
        """`ucx-dask-gpu workload KIND --scheduler ADDR --json ...` in a client container; its JSON result."""
        proc = self.run_client(["ucx-dask-gpu", "workload", kind, "--scheduler", self.address, "--json", *args],
                               image=image, timeout=timeout)
        if proc.returncode not in (0, 1):
            raise UserError(f"workload {kind} failed (exit {proc.returncode}): {last_line(proc.stderr)}",
                            CLUSTER_FAILED)
        try:
            return parse_json_output(proc.stdout)
        except ValueError:
            raise UserError(f"workload {kind}: no JSON result: {proc.stdout[-200:]!r}", CLUSTER_FAILED) from None

    def kill(self, name: str) -> None:
        docker(["kill", name], code=CLUSTER_FAILED, what=f"killing {name}")

    def stop(self, quiet: bool = False) -> dict:
        """Stop workers, then the scheduler (SIGTERM, grace period); remove everything. Returns a report. A signal
        meanwhile waits until all is removed (signals_deferred)."""
        with signals_deferred():
            return self._stop(quiet)

    def _stop(self, quiet: bool) -> dict:
        if not self.started:
            return stop_in_order([])
        last = (self.scheduler_name, self.holder_name)
        report = stop_in_order([[c for c in self.containers if c not in last],
                                *([c for c in self.containers if c == n] for n in last)])
        # Everything carrying this cluster's label, client containers too: an interrupted `docker run --rm` client
        # keeps running after its CLI is killed, and holds the network and the volume.
        remove_all_clusters(self.name)
        if self.tls_dir is not None:
            shutil.rmtree(self.tls_dir, ignore_errors=True)
        self.started = False
        if not quiet:
            clean = "clean" if not report["tracebacks"] else f"tracebacks in {', '.join(report['tracebacks'])}"
            say(f"{self.name}: stopped ({clean})")
        return report

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(quiet=True)


def stop_in_order(groups: list[list[str]]) -> dict:
    """Stop the containers group after group (SIGTERM, STOP_GRACE_S); every one's log and exit code, and the names of
    those whose log shows a traceback."""
    for group in groups:
        running = [c for c in group if (container_state(c) or {}).get("Running")]
        if running:
            subprocess.run([docker_bin(), "stop", "-t", str(STOP_GRACE_S), *running], capture_output=True)
    logs = {c: container_logs(c) for group in groups for c in group}
    return {"logs": logs, "exit_codes": {c: (container_state(c) or {}).get("ExitCode") for c in logs},
            "tracebacks": [c for c, log in logs.items() if has_traceback(log)]}


def parse_json_output(text: str) -> dict:
    """The JSON object a client printed on stdout, ignoring lines other libraries may print around it (UCX's log
    lines start with "[timestamp]", so only objects count)."""
    decoder = json.JSONDecoder()
    offset = 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("{"):
            try:
                value = decoder.raw_decode(text, offset + len(line) - len(line.lstrip()))[0]
            except ValueError:
                value = None
            if isinstance(value, dict):
                return value
        offset += len(line)
    raise ValueError("no JSON object in the output")


def make_tls_dir(uid: int | None) -> Path:
    """A throw-away CA and a certificate per role (gate/tls.py), readable by the image's user only; no CA key."""
    d = Path(tempfile.mkdtemp(prefix="udg-tls."))
    try:
        tls.init(d, ["scheduler", "localhost", "127.0.0.1"], days=2, cluster="ucx-dask-gpu test")
    except UserError as e:
        shutil.rmtree(d, ignore_errors=True)
        raise UserError(str(e), CLUSTER_FAILED) from None
    (d / tls.CA_KEY).unlink()
    # The containers run as the image's user: the keys are theirs (0600), the certificates world-readable.
    os.chmod(d, 0o755)
    for f in d.iterdir():
        if uid is not None and os.geteuid() == 0:
            os.chown(f, uid, uid)
    return d


def remove_all_clusters(name: str | None = None, passes: int = 4) -> int:
    """Remove every container, volume and network of cluster `name` (default: of every cluster of ours: what an
    interrupted run left); returns the count. Everything carries the CLUSTER_LABEL label; this also ends clusters that
    are running now. A `docker run` whose client was killed mid-request still creates its container a moment later:
    the sweep is repeated until a pass finds nothing."""
    label = f"label={CLUSTER_LABEL}" + (f"={name}" if name else "")
    removed = 0
    for n in range(passes):
        found = 0
        for kind, listing in (("container", ["ps", "-aq"]), ("volume", ["volume", "ls", "-q"]),
                              ("network", ["network", "ls", "-q"])):
            proc = subprocess.run([docker_bin(), *listing, "--filter", label], capture_output=True, text=True)
            ids = proc.stdout.split()
            found += len(ids)
            if ids:
                rm = ["rm", "-f"] if kind == "container" else [kind, "rm"]
                subprocess.run([docker_bin(), *rm, *ids], capture_output=True)
        removed += found
        if not found and n:
            break
        time.sleep(0.5 * n)
    return removed
