"""The Docker CLI, called the same way from every image and cluster command.

Everything goes through the `docker` client binary (no SDK): Debian's docker.io 20.10 engine and newer clients
agree on the CLI. Failures become one-line `UserError`s: an engine that does not answer is NO_DOCKER (7), whatever
the command.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Sequence

from ..errors import NO_DOCKER, UserError

DOCKER_ENV = "UCX_DASK_GPU_DOCKER"      # the client binary to use (default: `docker` on PATH)


def docker_bin() -> str:
    exe = os.environ.get(DOCKER_ENV) or shutil.which("docker")
    if not exe:
        raise UserError("missing Docker engine: no `docker` client on PATH (run ci/start_dockerd.sh as root, or "
                        "install docker.io)", NO_DOCKER)
    return exe


def _engine_where() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def last_line(text: str) -> str:
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
        raise UserError(f"missing Docker engine at {_engine_where()} ({last_line(proc.stderr)}); start one with "
                        "ci/start_dockerd.sh (root)", NO_DOCKER)
    return version


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
            raise UserError(f"missing Docker engine at {_engine_where()} ({last_line(err)})", NO_DOCKER)
        raise UserError(f"{what or 'docker ' + ' '.join(args[:2])}: {last_line(err)}", code)
    return proc


def image_inspect(ref: str) -> dict | None:
    """`docker image inspect REF` as a dict, or None when there is no such image."""
    proc = subprocess.run([docker_bin(), "image", "inspect", ref], capture_output=True, text=True)
    if proc.returncode != 0:
        if "Cannot connect to the Docker daemon" in proc.stderr:
            raise UserError(f"missing Docker engine at {_engine_where()} ({last_line(proc.stderr)})", NO_DOCKER)
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
