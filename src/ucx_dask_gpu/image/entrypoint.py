"""The image's entrypoint (after tini): check the role, pick the host's UCX transports, then exec the command.

    docker run IMAGE dask scheduler ...            scheduler
    docker run IMAGE dask worker ADDRESS ...       worker (CPU hosts)
    docker run IMAGE dask cuda worker ADDRESS ...  worker (GPU hosts, dask-cuda)
    docker run IMAGE ucx-dask-gpu COMMAND ...      client workloads, doctor, verify-nvlink, bench
    docker run IMAGE python ...                    any client script
    docker run IMAGE ucx_info|ucx_perftest ...     UCX tools
    docker run IMAGE bash|sh                       a shell, for debugging

Anything else ends with one line on stderr and exit code UNKNOWN_ROLE, before anything starts: a typo in a compose
file or a job script must not turn into a container that runs the wrong thing or idles.

Transports: the image's /etc/dask holds the CPU transports (works on every host); on a host where NVML sees a GPU
(or with UCX_DASK_GPU_TRANSPORTS=gpu) DASK_CONFIG points at the GPU transports, which dask reads after /etc/dask.

Workers also preload `ucx_dask_gpu.gate.quietclose` (after the configured preloads), so `docker stop` shuts them down
without a heartbeat traceback (see that module). `dask worker` ignores distributed.nanny.preload (its own
--preload-nanny always wins), so the entrypoint passes the guard there: a refused worker then ends in its nanny with
the scheduler's one-line reason and exit code ENV_MISMATCH, before any worker process starts (gate/guard.py).
"""
from __future__ import annotations

import os
import sys

from ..errors import UNKNOWN_ROLE, UserError
from ..gate.daskconfig import QUIET_CLOSE, detect_transports
from ..gate.identity import GUARD
from ..proof.peer import parse_address
from ..stack import STACK_ID_FILE

# first word -> allowed second words (None: anything may follow)
ROLES: dict[str, tuple[str, ...] | None] = {
    "dask": ("scheduler", "worker", "cuda"),
    "ucx-dask-gpu": None,
    "python": None,
    "python3": None,
    "ucx_info": None,
    "ucx_perftest": None,
    "bash": None,
    "sh": None,
}
USAGE_LINE = ("dask scheduler | dask worker ADDRESS | dask cuda worker ADDRESS | ucx-dask-gpu COMMAND | "
              "python ... | ucx_info | ucx_perftest | bash")
GPU_CONFIG_DIR = str(STACK_ID_FILE.parent / "dask-gpu")  # the image's /etc directory: next to its stack id
WORKER_PRELOAD_ENV = "DASK_DISTRIBUTED__WORKER__PRELOAD"
TRANSPORTS_ENV = "UCX_DASK_GPU_TRANSPORTS"


def resolve(argv: list[str]) -> list[str]:
    """The command to exec for `argv`, or UserError(UNKNOWN_ROLE) naming what was asked and what exists."""
    if not argv:
        raise UserError(f"no role given; run one of: {USAGE_LINE}", UNKNOWN_ROLE)
    first = argv[0]
    allowed = ROLES.get(first, ())
    if first not in ROLES:
        raise UserError(f"unknown role {first!r}; run one of: {USAGE_LINE}", UNKNOWN_ROLE)
    if allowed is not None:
        second = argv[1] if len(argv) > 1 else ""
        if second not in allowed:
            asked = " ".join(argv[:2])
            raise UserError(f"unknown role {asked!r}; run one of: {USAGE_LINE}", UNKNOWN_ROLE)
        if second == "cuda" and (len(argv) < 3 or argv[2] != "worker"):
            raise UserError(f"unknown role {' '.join(argv[:3])!r}; run one of: {USAGE_LINE}", UNKNOWN_ROLE)
    return list(argv)


def transports_env(environ: dict) -> dict:
    """Extra environment selecting the GPU transports config, when this host has a GPU (and nothing chose)."""
    if "DASK_CONFIG" in environ or not os.path.isdir(GPU_CONFIG_DIR):
        return {}
    kind = environ.get(TRANSPORTS_ENV, "auto")
    if kind == "auto":
        kind = detect_transports()
    return {"DASK_CONFIG": GPU_CONFIG_DIR} if kind == "gpu" else {}


def worker_preload_env(argv: list[str], environ: dict) -> dict:
    """For `dask worker`: the configured worker preloads plus QUIET_CLOSE, unless the operator set them."""
    if argv[:2] != ["dask", "worker"] or WORKER_PRELOAD_ENV in environ:
        return {}
    saved = dict(os.environ)
    os.environ.update(environ)  # dask reads its config (and DASK_CONFIG) from the environment at import
    try:
        import dask.config

        configured = list(dask.config.get("distributed.worker.preload", None) or [])
    finally:
        os.environ.clear()
        os.environ.update(saved)
    if QUIET_CLOSE in configured:
        return {}
    return {WORKER_PRELOAD_ENV: repr(configured + [QUIET_CLOSE])}


def check_worker_address(argv: list[str]) -> None:
    """`dask worker ADDRESS` / `dask cuda worker ADDRESS`: a malformed ADDRESS is one line (USAGE) here instead of
    dask's traceback (only when the address comes right after the role, as documented)."""
    n = 3 if argv[:3] == ["dask", "cuda", "worker"] else 2 if argv[:2] == ["dask", "worker"] else 0
    if n and len(argv) > n and not argv[n].startswith("-"):
        parse_address(argv[n], "the scheduler address")


def nanny_preload_args(argv: list[str]) -> list[str]:
    """For `dask worker`: the guard as a nanny preload too (see the module docstring)."""
    if argv[:2] != ["dask", "worker"] or GUARD in argv:
        return argv
    return argv[:2] + ["--preload-nanny", GUARD] + argv[2:]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cmd = resolve(argv)
        check_worker_address(cmd)
        cmd = nanny_preload_args(cmd)
    except UserError as e:
        print(f"ucx-dask-gpu image: {e}", file=sys.stderr)
        return e.exit_code
    env = dict(os.environ)
    env.update(transports_env(env))
    env.update(worker_preload_env(cmd, env))
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as e:
        print(f"ucx-dask-gpu image: cannot run {cmd[0]!r}: {e.strerror}", file=sys.stderr)
        return UNKNOWN_ROLE
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
