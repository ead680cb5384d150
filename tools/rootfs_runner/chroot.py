"""Run the image's roles from its unpacked filesystem without Docker: what a container runtime does, by hand.

For a machine with GPUs but no container engine: `python -m tools.rootfs_runner run OUT` (as root, inside a
private mount namespace where one can be made: `unshare --mount --propagation private`)
- takes an unpacked root (rootfs.py `unpack`), mounts /proc, /sys and /dev (binds made slaves, a /dev/shm of its own)
  into it, writes /etc/hosts,
- adds the host driver's user-space libraries the way the NVIDIA container toolkit does for the `compute,utility`
  capabilities the image asks for (libcuda.so.1, libnvidia-ml.so.1, libnvidia-ptxjitcompiler, libnvidia-nvvm, ...,
  found through `ldconfig -p`, else the driver directories; copied into the root's library directory) and nvidia-smi,
  then runs `ldconfig` inside,
- starts every role with chroot + the image's user, Env and WorkingDir, through the image's Entrypoint: a scheduler,
  two workers (GPU mode: two `dask cuda worker` sharing GPU 0, UCX_PROTO_INFO=y; CPU mode: two `dask worker`), and a
  client running `ucx-dask-gpu workload transpose --json` over ucx,
- checks the answer, that every process of every role maps the root's /opt/ucx/lib/libucp.so (read from
  /proc/PID/maps outside the chroot), and which transports UCX's protocol tables name (GPU mode: cuda_ipc for CuPy
  blocks),
- stops every role (SIGTERM, then SIGKILL after a grace period), unmounts what it mounted, and writes
  OUT/image-rootfs.tgz (result.json, every role's log, the proto tables) and OUT/result.json.
"""
from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ucx_dask_gpu.cliutil import signals_deferred
from ucx_dask_gpu.errors import ROOTFS_INVALID, UserError
from ucx_dask_gpu.fsutil import atomic_write_text, write_output_dir
from ucx_dask_gpu.image.cluster import parse_json_output
from ucx_dask_gpu.ucx.perftest import free_port, parse_proto_tables
from ucx_dask_gpu.ucx.transports import mapped_libucp

# The driver's user-space libraries the toolkit mounts for the compute and utility capabilities
# (libnvidia-container's list), by file-name prefix.
DRIVER_LIBRARIES = ("libcuda.so", "libcudadebugger.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so",
                    "libnvidia-nvvm.so", "libnvidia-gpucomp.so", "libnvidia-allocator.so", "libnvidia-cfg.so",
                    "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so", "libnvidia-opencl.so")
DRIVER_DIRS = ("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib", "/usr/lib/x86_64-linux-gnu", "/usr/lib64",
               "/usr/lib")
DRIVER_BINARIES = ("nvidia-smi",)
LIB_DIR = "usr/lib/x86_64-linux-gnu"
STOP_GRACE_S = 30
# Variables of the host every role keeps, although each starts with the image's environment: a site's switches for
# NVLink multicast (NVLS), which some GPU hosts require off in every program.
PASS_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
_LDCONFIG_RE = re.compile(r"^\s*(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)\s*$")


# --- the root: mounts, hosts, driver --------------------------------------------------------------------------------

def _run(cmd: list[str], what: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"{what}: {' '.join(cmd)}: {(proc.stderr.strip().splitlines() or ['failed'])[-1]}",
                        ROOTFS_INVALID)
    return proc.stdout


def mount_system(root: Path, mounted: list[Path], private: bool = False) -> list[str]:
    """/proc, /sys, /dev (and a /dev/shm of its own) of this machine inside `root`; each mount point is appended to
    `mounted` as soon as it is mounted (`unmount_system(mounted)` undoes them, also after a failure half-way); returns
    notes on what could not be done but was not needed.

    Every bind is made a slave, so nothing mounted or unmounted under the root reaches this machine's own /dev or
    /sys. In a `private` mount namespace that is already so and a failure to make one a slave is only noted; outside
    one, a bind that cannot be made a slave stays mounted (unmounting it could reach the machine's own mounts) and
    ends the run. /sys is optional (CUDA needs /proc and /dev; UCX and NVML only read topology from /sys)."""
    notes = []
    for src, dest, args in (("proc", "proc", ["-t", "proc"]), ("/sys", "sys", ["--rbind"]),
                            ("/dev", "dev", ["--rbind"])):
        target = root / dest
        target.mkdir(exist_ok=True)
        if not os.path.ismount(target):
            try:
                _run(["mount", *args, src, str(target)], f"mounting {src}")
            except UserError as e:
                if dest != "sys":
                    raise
                notes.append(f"/sys not mounted ({e})")
                continue
            if "--rbind" in args:
                try:
                    _run(["mount", "--make-rslave", str(target)], f"isolating {target}")
                except UserError as e:
                    if not private:
                        raise
                    notes.append(str(e))
        mounted.append(target)
    shm = root / "dev" / "shm"
    if not os.path.ismount(shm) or not _own_tmpfs(shm):
        shm.mkdir(exist_ok=True)
        _run(["mount", "-t", "tmpfs", "-o", "mode=1777", "shm", str(shm)], "mounting /dev/shm")
    mounted.append(shm)
    return notes


def _own_tmpfs(path: Path) -> bool:
    """Whether the last mount on `path` is a tmpfs named `shm` (ours), not the machine's /dev/shm bound in."""
    mine = [ln.split() for ln in Path("/proc/self/mounts").read_text().splitlines()]
    on = [m for m in mine if len(m) > 2 and m[1] == str(path)]
    return bool(on) and on[-1][0] == "shm" and on[-1][2] == "tmpfs"


def unmount_system(mounted: list[Path]) -> list[str]:
    """Undo `mount_system` (deepest first, each recursively); what could not be unmounted."""
    left = []
    for target in reversed(mounted):
        if os.path.ismount(target):
            proc = subprocess.run(["umount", "-R", str(target)], capture_output=True, text=True)
            if proc.returncode != 0 and subprocess.run(["umount", "-R", "-l", str(target)],
                                                       capture_output=True).returncode != 0:
                left.append(str(target))
    return left


def write_network_files(root: Path) -> None:
    """What a runtime writes for a container on the host's network: /etc/hosts, /etc/hostname, /etc/resolv.conf."""
    host = socket.gethostname()
    (root / "etc" / "hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{host}\n")
    (root / "etc" / "hostname").write_text(host + "\n")
    resolv = Path("/etc/resolv.conf")
    (root / "etc" / "resolv.conf").write_text(resolv.read_text() if resolv.is_file() else "")


def parse_ldconfig(text: str) -> dict[str, str]:
    """`ldconfig -p` -> {soname: path} for x86-64 libraries."""
    out = {}
    for line in text.splitlines():
        m = _LDCONFIG_RE.match(line)
        if m and "x86-64" in m.group(2):
            out.setdefault(m.group(1), m.group(3))
    return out


def find_driver_libraries(ldconfig_text: str | None = None, extra_dirs: tuple[str, ...] = ()) -> dict[str, Path]:
    """The driver's libraries on this machine: soname -> the real file. From the loader cache first, then the driver
    directories (and LD_LIBRARY_PATH), as the toolkit looks."""
    if ldconfig_text is None:
        try:
            ldconfig_text = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        except OSError:
            ldconfig_text = ""
    found: dict[str, Path] = {}
    for soname, path in parse_ldconfig(ldconfig_text).items():
        if soname.startswith(DRIVER_LIBRARIES) and Path(path).exists():
            found[soname] = Path(path)
    dirs = [*extra_dirs, *os.environ.get("LD_LIBRARY_PATH", "").split(":"), *DRIVER_DIRS]
    for d in filter(None, dirs):
        for f in sorted(Path(d).glob("lib*.so.*")) if Path(d).is_dir() else []:
            # libcuda.so.1 (a soname: the driver's link to its versioned file) and libnvidia-gpucomp.so.580.x (a
            # versioned file that is its own soname); not the development link libcuda.so
            if f.name.startswith(DRIVER_LIBRARIES) and re.fullmatch(r".*\.so(\.\d+)+", f.name):
                found.setdefault(f.name, f)
    return {k: v.resolve() for k, v in sorted(found.items())}


def copy_driver_libraries(dest: Path, libraries: dict[str, Path]) -> list[str]:
    """Each real file once into `dest`, each soname a link to it (a versioned file that is its own soname stays the
    file); the sonames added."""
    dest.mkdir(parents=True, exist_ok=True)
    added = []
    for soname, real in libraries.items():
        target = dest / real.name
        if not target.exists():
            target.write_bytes(real.read_bytes())
            os.chmod(target, 0o755)
        link = dest / soname
        if link != target:
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(real.name)
        added.append(soname)
    return added


def add_driver(root: Path, libraries: dict[str, Path]) -> list[str]:
    """Copy the driver's libraries (and binaries) into `root` and refresh its loader cache; the names added."""
    added = copy_driver_libraries(root / LIB_DIR, libraries)
    for name in DRIVER_BINARIES:
        for d in os.environ.get("PATH", "").split(":") + ["/usr/local/nvidia/bin"]:
            exe = Path(d) / name
            if d and exe.is_file():
                (root / "usr" / "bin" / name).write_bytes(exe.read_bytes())
                os.chmod(root / "usr" / "bin" / name, 0o755)
                added.append(name)
                break
    _run(["chroot", str(root), "ldconfig"], "ldconfig in the root")
    return added


# --- roles -----------------------------------------------------------------------------------------------------------

@dataclass
class ImageUser:
    uid: int
    gid: int
    home: str


def image_user(root: Path, user: str | None) -> ImageUser:
    """The image's `User` (name or uid[:gid]) resolved in the root's /etc/passwd."""
    spec = (user or "0").split(":")
    entries = [line.split(":") for line in (root / "etc" / "passwd").read_text().splitlines() if line.count(":") >= 6]
    for e in entries:
        if spec[0] in (e[0], e[2]):
            gid = int(spec[1]) if len(spec) > 1 and spec[1].isdigit() else int(e[3])
            return ImageUser(int(e[2]), gid, e[5])
    if spec[0].isdigit():
        return ImageUser(int(spec[0]), int(spec[1]) if len(spec) > 1 else int(spec[0]), "/")
    raise UserError(f"the image's user {user!r} is not in {root}/etc/passwd", ROOTFS_INVALID)


@dataclass
class Role:
    name: str
    argv: list[str]
    env: dict = field(default_factory=dict)
    proc: subprocess.Popen | None = None
    log: Path | None = None


class Runner:
    """Starts roles chrooted into `root` as the image's user with the image's environment and entrypoint."""

    def __init__(self, root: Path, config: dict, logs: Path) -> None:
        self.root, self.config, self.logs = root, config, logs
        self.user = image_user(root, config.get("User"))
        self.roles: list[Role] = []

    def environment(self, extra: dict) -> dict:
        env = dict(e.split("=", 1) for e in self.config.get("Env") or [] if "=" in e)
        env.setdefault("HOME", self.user.home)
        env.update({k: os.environ[k] for k in PASS_ENV if k in os.environ})
        env.update(extra)
        return env

    def _enter(self) -> None:  # runs in the child between fork and exec
        os.chroot(self.root)
        os.chdir(self.config.get("WorkingDir") or "/")
        os.setgroups([])
        os.setgid(self.user.gid)
        os.setuid(self.user.uid)
        os.setsid()

    def start(self, name: str, argv: list[str], env: dict | None = None, stdout=None) -> Role:
        role = Role(name, [*(self.config.get("Entrypoint") or []), *argv], env or {})
        role.log = self.logs / f"{name}.log"
        with open(role.log, "wb") as log, signals_deferred():  # a role started is a role stop() knows of
            role.proc = subprocess.Popen(role.argv, env=self.environment(role.env), preexec_fn=self._enter,
                                         stdin=subprocess.DEVNULL, stdout=stdout or log, stderr=log)
            self.roles.append(role)
        return role

    def text(self, role: Role) -> str:
        return role.log.read_text(errors="replace") if role.log and role.log.exists() else ""

    def stop(self) -> dict:
        """SIGTERM every running role's session, wait, SIGKILL what is left; exit codes by role. A signal meanwhile
        waits until every role has ended."""
        with signals_deferred():
            return self._stop()

    def _stop(self) -> dict:
        # The scheduler last, as the product's cluster stops its containers: workers told to close by a scheduler
        # that is closing while their nannies take SIGTERM race each other's teardown.
        last = [r for r in self.roles if r.name == "scheduler"]
        for group in ([r for r in self.roles if r not in last], last):
            deadline = time.monotonic() + STOP_GRACE_S
            for r in group:
                if r.proc and r.proc.poll() is None:
                    _signal_session(r.proc.pid, signal.SIGTERM)
            for r in group:
                if r.proc:
                    try:
                        r.proc.wait(max(0.1, deadline - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
        for r in self.roles:
            if r.proc:
                _signal_session(r.proc.pid, signal.SIGKILL)
                r.proc.wait()
        return {r.name: r.proc.returncode for r in self.roles if r.proc}


def _signal_session(sid: int, sig: int) -> None:
    """Signal every process of session `sid` (a role and everything it started)."""
    for pid in _session_members(sid):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _session_members(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if os.getsid(int(d.name)) == sid:
                    out.append(int(d.name))
            except (ProcessLookupError, PermissionError):
                continue
    return out


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def role_libraries(role: Role) -> dict[str, str | None]:
    """pid -> the libucp.so each Python process of the role maps (seen from outside the root)."""
    return {f"{pid} {_comm(pid)}": mapped_libucp(pid) for pid in _session_members(role.proc.pid)
            if _comm(pid).startswith(("python", "dask", "ucx-dask-gpu")) and not _is_helper(pid)}


def _is_helper(pid: int) -> bool:
    """multiprocessing's resource tracker (started by dask's nanny): a Python process of the role that never loads
    UCX."""
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def wait_for(predicate, timeout: float, what: str, roles: list[Role]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        dead = [r for r in roles if r.proc and r.proc.poll() is not None]
        if dead:
            raise UserError(f"{dead[0].name} exited with code {dead[0].proc.returncode} while waiting for {what}",
                            ROOTFS_INVALID)
        if time.monotonic() > deadline:
            raise UserError(f"{what} did not happen within {timeout:.0f} s", ROOTFS_INVALID)
        time.sleep(0.5)


@dataclass(frozen=True)
class Proof:
    gpu: bool
    protocol: str = "ucx"
    size: int = 8000
    chunk: int = 2000
    start_timeout: float = 180
    client_timeout: float = 300


def run_proof(root: Path, config: dict, out: Path, proof: Proof, ucx_prefix: str, extra: dict | None = None) -> dict:
    """Scheduler + two workers + the transpose client from `root`; the checks; everything stopped. `extra` goes into
    the result as it is (what was done to the root, which export it is)."""
    work = Path(tempfile.mkdtemp(prefix="udg-rootfs-logs."))
    os.chmod(work, 0o755)
    runner = Runner(root, config, work)
    port = free_port()
    address = f"{proof.protocol}://127.0.0.1:{port}"
    result: dict = {"gpu": proof.gpu, "protocol": proof.protocol, "address": address, "checks": {}, **(extra or {})}
    try:
        sched = runner.start("scheduler", ["dask", "scheduler", "--protocol", proof.protocol, "--host", "127.0.0.1",
                                           "--port", str(port), "--no-dashboard"])
        wait_for(lambda: "Scheduler at:" in runner.text(sched), proof.start_timeout, "the scheduler", runner.roles)
        workers = []
        for name in ("worker-a", "worker-b"):
            if proof.gpu:
                argv = ["dask", "cuda", "worker", address, "--name", name, "--host", "127.0.0.1", "--no-dashboard"]
                env = {"CUDA_VISIBLE_DEVICES": "0", "UCX_PROTO_INFO": "y"}
            else:
                argv = ["dask", "worker", address, "--name", name, "--host", "127.0.0.1", "--no-dashboard",
                        "--nthreads", "2", "--memory-limit", "4GiB"]
                env = {"UCX_PROTO_INFO": "y"}
            workers.append(runner.start(name, argv, env))
        wait_for(lambda: runner.text(sched).count("Register worker") >= 2, proof.start_timeout, "two workers",
                 runner.roles)
        result["libraries"] = {r.name: role_libraries(r) for r in runner.roles}
        client_out = work / "client.json"
        with open(client_out, "wb") as stdout:
            client = runner.start("client", ["ucx-dask-gpu", "workload", "transpose", "--scheduler", address,
                                             "--backend", "cupy" if proof.gpu else "numpy", "--size", str(proof.size),
                                             "--chunk", str(proof.chunk), "--json"], stdout=stdout)
            try:
                client.proc.wait(proof.client_timeout)
            except subprocess.TimeoutExpired:
                raise UserError(f"the client did not finish within {proof.client_timeout:.0f} s", ROOTFS_INVALID)
        result["client_exit"] = client.proc.returncode
        try:
            result["workload"] = parse_json_output(client_out.read_text())
        except ValueError:
            result["workload"] = None
    except UserError as e:
        result["error"] = str(e)
    finally:
        result["exit_codes"] = runner.stop()
        result["proto"] = {r.name: summarise_proto(runner.text(r)) for r in runner.roles if r.name.startswith("worker")}
    result["checks"] = checks(result, proof, root, ucx_prefix)
    result["ok"] = bool(result["checks"]) and all(c["ok"] for c in result["checks"].values()) and "error" not in result
    text = json.dumps(result, indent=2, sort_keys=True) + "\n"
    atomic_write_text(work / "result.json", text)
    archive = io.BytesIO()  # role logs and result: a few MB
    with tarfile.open(fileobj=archive, mode="w:gz") as tar:
        tar.add(work, arcname="image-rootfs")
    write_output_dir(out, {"result.json": text, "image-rootfs.tgz": archive.getvalue()}, what="the proof's result")
    return result


def summarise_proto(log: str) -> dict:
    """The protocol tables a worker printed (UCX_PROTO_INFO=y): every transport named, and those named for CUDA
    memory."""
    tables = parse_proto_tables(log)
    cuda = [t for t in tables if t.mem_is("cuda") or t.local_gpu is not None]
    return {"tables": len(tables), "transports": sorted({x for t in tables for r in t.rows for x in r.transports}),
            "cuda_transports": sorted({x for t in cuda for r in t.rows for x in r.transports}),
            "cuda_operations": sorted({t.operation for t in cuda})[:10]}


def checks(result: dict, proof: Proof, root: Path, ucx_prefix: str) -> dict:
    """The answer, our libucp in every process (seen from outside the root: ROOT/opt/ucx/...; as each role reported
    it from inside: /opt/ucx/...), and the transports UCX's protocol tables name."""
    w = result.get("workload") or {}
    out = {"answer": {"ok": bool(w.get("ok")) and result.get("client_exit") == 0,
                      "value": w.get("value"), "expected": w.get("expected"), "workers": w.get("workers_start")}}
    inside = f"{ucx_prefix.rstrip('/')}/lib/libucp.so"
    outside = str(root).rstrip("/") + inside
    seen = {f"{role} {proc}": path for role, procs in (result.get("libraries") or {}).items()
            for proc, path in procs.items()}
    reported = {}
    for role, info in (w.get("ucx") or {}).items():
        for name, i in (info.items() if role == "workers" else [(role, info)]):
            reported[name] = (i or {}).get("libucp")
    ok = (len(seen) >= 3 and all(p and p.startswith(outside) for p in seen.values())
          and len(reported) >= 4 and all(p and p.startswith(inside) for p in reported.values()))
    out["libucp"] = {"ok": ok, "processes": seen, "reported_by_roles": reported, "expected": [outside, inside]}
    proto = result.get("proto") or {}
    if proof.gpu:
        named = sorted({t for p in proto.values() for t in p["cuda_transports"]})
        out["cuda_ipc"] = {"ok": "cuda_ipc" in named, "cuda_transports": named}
    else:
        named = sorted({t for p in proto.values() for t in p["transports"]})
        out["proto_info"] = {"ok": bool(named), "transports": named}
    return out
