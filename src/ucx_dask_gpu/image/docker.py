"""The Docker CLI, called the same way from every image and cluster command.

Everything goes through the `docker` client binary (no SDK): the build machines have Debian's docker.io 20.10
engine and a newer client, and the CLI is the interface both agree on. Failures become one-line `UserError`s:
an engine that does not answer is NO_DOCKER (7), whatever the command.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ..errors import NO_DOCKER, UserError
from ..stack import load

DOCKER_ENV = "UCX_DASK_GPU_DOCKER"      # the client binary to use (default: `docker` on PATH)


def docker_bin() -> str:
    exe = os.environ.get(DOCKER_ENV) or shutil.which("docker")
    if not exe:
        raise UserError("missing Docker engine: no `docker` client on PATH (run ci/start_dockerd.sh as root, or "
                        "install docker.io)", NO_DOCKER)
    return exe


def _engine_where() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def engine_version(timeout: float = 20) -> str:
    """The engine's version; NO_DOCKER with the client's reason when no engine answers."""
    try:
        proc = subprocess.run([docker_bin(), "version", "--format", "{{.Server.Version}}"], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UserError(f"missing Docker engine: {_engine_where()} did not answer within {timeout:.0f} s",
                        NO_DOCKER) from None
    version = proc.stdout.strip()
    if proc.returncode != 0 or not version:
        raise UserError(f"missing Docker engine at {_engine_where()} ({_last_line(proc.stderr)}); start one with "
                        "ci/start_dockerd.sh (root)", NO_DOCKER)
    return version


def ensure_engine(allow_start: bool = True, timeout: float = 90) -> str:
    """An engine that answers (its version): the running one, else Debian's dockerd started in the background.

    Build machines are fresh Debian 12 hosts run as root without systemd; dockerd with overlay2 works there.
    Starting is refused (NO_DOCKER, one line) when not root, when DOCKER_HOST names another engine, or when
    `allow_start` is False. As root, the image's host packages (stack.toml [debian].image_host_packages) that are
    missing are installed first.
    """
    root = os.geteuid() == 0
    if allow_start and root and not os.environ.get("DOCKER_HOST"):
        install_host_packages()
    try:
        if shutil.which("docker") or os.environ.get(DOCKER_ENV):
            return engine_version()
        reason = "missing Docker engine: no docker client"
    except UserError as e:
        reason = str(e)
    if not allow_start:
        raise UserError(f"{reason}; not allowed to start one (--no-start)", NO_DOCKER)
    if os.environ.get("DOCKER_HOST"):
        raise UserError(f"missing Docker engine at DOCKER_HOST={os.environ['DOCKER_HOST']} and not allowed to start "
                        "one there (unset DOCKER_HOST to use a local dockerd)", NO_DOCKER)
    if not root:
        raise UserError("missing Docker engine and not allowed to start one (dockerd needs root: run "
                        "ci/start_dockerd.sh as root, or ask for access to a running engine)", NO_DOCKER)
    dockerd = shutil.which("dockerd")
    if not dockerd:
        raise UserError("missing Docker engine and not able to start one: no dockerd after installing "
                        "stack.toml's image_host_packages", NO_DOCKER)
    log = Path(ENGINE_LOG)
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"starting dockerd in the background (log: {log})", flush=True)
    with open(log, "ab") as out:
        subprocess.Popen([dockerd], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                         start_new_session=True, close_fds=True)

    def answers():
        try:
            return engine_version(timeout=5)
        except UserError:
            return None

    version = wait_until(answers, timeout, interval=1)
    if not version:
        tail = _last_line(log.read_text(errors="replace")) if log.exists() else "no log"
        raise UserError(f"missing Docker engine: dockerd did not answer within {timeout:.0f} s (last log line: "
                        f"{tail[:200]})", NO_DOCKER)
    return version


ENGINE_LOG = "/var/log/ucx-dask-gpu-dockerd.log"


def started_engines(log: str = ENGINE_LOG) -> list[int]:
    """The dockerd processes ensure_engine started (their stdout is `log`), by pid: what `make` leaves running."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "comm").read_text().strip() == "dockerd" and \
                    os.readlink(d / "fd" / "1") == log:
                pids.append(int(d.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(pids)


def stop_started_engines(log: str = ENGINE_LOG, timeout: float = 60) -> list[int]:
    """SIGTERM the dockerd processes ensure_engine started and wait for them to end (dockerd stops its containers
    first); those still running after `timeout` stay. Returns the pids that ended."""
    pids = started_engines(log)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    wait_until(lambda: not set(pids) & set(started_engines(log)), timeout)
    return sorted(set(pids) - set(started_engines(log)))


def _installed(pkg: str) -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return proc.returncode == 0 and "ok installed" in proc.stdout


def install_host_packages() -> None:
    """apt-get install the image host packages that are missing (root, Debian); a no-op when all are there."""
    if not shutil.which("dpkg-query"):
        return
    missing = [p for p in load().debian.image_host_packages if not _installed(p)]
    if not missing:
        return
    print(f"installing {' '.join(missing)} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise UserError(f"missing Docker engine and not able to install one: {' '.join(cmd[:2])}: "
                            f"{_last_line(proc.stderr or proc.stdout)}", NO_DOCKER)


def docker(args: Sequence[str], *, code: int, what: str | None = None, input: str | bytes | None = None,
           timeout: float | None = None, env: dict | None = None, check: bool = True,
           capture: bool = True) -> subprocess.CompletedProcess:
    """Run `docker ARGS`; on failure raise UserError(`what` + docker's last stderr line, `code`)."""
    cmd = [docker_bin(), *args]
    text = not isinstance(input, bytes)
    try:
        proc = subprocess.run(cmd, input=input, capture_output=capture, text=text, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        raise UserError(f"{what or 'docker ' + args[0]}: timed out after {timeout:.0f} s", code) from None
    if check and proc.returncode != 0:
        err = proc.stderr if text else (proc.stderr or b"").decode(errors="replace")
        if "Cannot connect to the Docker daemon" in (err or "") or "docker daemon is not running" in (err or ""):
            raise UserError(f"missing Docker engine at {_engine_where()} ({_last_line(err)})", NO_DOCKER)
        raise UserError(f"{what or 'docker ' + ' '.join(args[:2])}: {_last_line(err)}", code)
    return proc


def image_inspect(ref: str) -> dict | None:
    """`docker image inspect REF` as a dict, or None when there is no such image."""
    proc = subprocess.run([docker_bin(), "image", "inspect", ref], capture_output=True, text=True)
    if proc.returncode != 0:
        if "Cannot connect to the Docker daemon" in proc.stderr:
            raise UserError(f"missing Docker engine at {_engine_where()} ({_last_line(proc.stderr)})", NO_DOCKER)
        return None
    return json.loads(proc.stdout)[0]


def labels_of(ref: str) -> dict[str, str]:
    info = image_inspect(ref)
    return dict(((info or {}).get("Config") or {}).get("Labels") or {})


def container_state(name: str) -> dict | None:
    proc = subprocess.run([docker_bin(), "inspect", "--type", "container", "--format", "{{json .State}}", name],
                          capture_output=True, text=True)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def container_logs(name: str) -> str:
    proc = subprocess.run([docker_bin(), "logs", name], capture_output=True, text=True)
    return proc.stdout + proc.stderr


def wait_until(predicate, timeout: float, interval: float = 0.5):
    """Poll `predicate()` until it returns a truthy value (returned) or `timeout` seconds pass (None)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(interval)
