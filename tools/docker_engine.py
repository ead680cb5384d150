"""A Docker engine that answers on this repository's build hosts: fresh Debian 12 hosts, run as root without systemd,
with a docker client but no engine (ci/start_dockerd.sh, `make`).

    python -m tools.docker_engine              # the running engine, else stack.toml's image_host_packages installed
                                               # where missing and Debian's dockerd started in the background
    python -m tools.docker_engine --no-start   # only check
    python -m tools.docker_engine --status     # name the engine this started, if it still runs (`make` ends with it)
    python -m tools.docker_engine --stop       # stop it

Without an engine and unable to start one: one line, NO_DOCKER (7).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ucx_dask_gpu.cliutil import Parser, run_parsed
from ucx_dask_gpu.errors import NO_DOCKER, UserError
from ucx_dask_gpu.image.docker import DOCKER_ENV, engine_version, last_line, wait_until
from ucx_dask_gpu.stack import load

PROG = "python -m tools.docker_engine"
ENGINE_LOG = "/var/log/ucx-dask-gpu-dockerd.log"


def ensure_engine(allow_start: bool = True, timeout: float = 90) -> str:
    """An engine that answers (its version): the running one, else Debian's dockerd started in the background
    (overlay2 works as root). Starting is refused (NO_DOCKER, one line) when not root, when DOCKER_HOST names another
    engine, or when `allow_start` is False. As root, the image's host packages that are missing are installed first."""
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
        tail = last_line(log.read_text(errors="replace")) if log.exists() else "no log"
        raise UserError(f"missing Docker engine: dockerd did not answer within {timeout:.0f} s (last log line: "
                        f"{tail[:200]})", NO_DOCKER)
    return version


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
    """apt-get install stack.toml [debian].image_host_packages that are missing (root, Debian); else a no-op."""
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
                            f"{last_line(proc.stderr or proc.stdout)}", NO_DOCKER)


def run(args) -> int:
    if args.stop:
        for pid in stop_started_engines():
            print(f"stopped dockerd (pid {pid})")
        left = started_engines()
        if left:
            raise UserError(f"dockerd (pid {', '.join(map(str, left))}) did not stop within 60 s", NO_DOCKER)
        return 0
    if args.status:
        for pid in started_engines():
            print(f"still running: the Docker engine started for this repository's builds (dockerd pid {pid}, "
                  f"log {ENGINE_LOG}); stop it: ci/start_dockerd.sh --stop")
        return 0
    print(f"Docker engine {ensure_engine(allow_start=not args.no_start)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-start", action="store_true", help="only check; never install or start an engine")
    parser.add_argument("--status", action="store_true",
                        help="say whether an engine this command started is still running (`make` ends with it)")
    parser.add_argument("--stop", action="store_true", help="stop the engine(s) this command started")
    parser.set_defaults(func=run)
    return run_parsed(parser.parse_args(argv), "docker_engine")


if __name__ == "__main__":
    sys.exit(main())
