"""The image's entrypoint (after tini): know the role, check what it needs, then exec the command (docs/image.md,
"Roles, and any other command", says what users see).

A Dask role comes in every spelling launchers emit (DASK_ROLES, LEGACY, PYTHON_MODULES). distributed no longer
installs `dask-scheduler` and `dask-worker`, so they are exec'd as `dask scheduler`/`dask worker`; the image's own
commands of those names (docker/Dockerfile writes them) come here through `legacy_main`, for launchers that bypass
the entrypoint. `dask worker` (any spelling) ignores distributed.nanny.preload, so the configured nanny preloads (the
guard first) are passed as --preload-nanny. A role started without this entrypoint comes here through the image's
start-up hook (rolehook.py); the process exec'd carries ROLE_CHECKED_ENV = its pid, so it is checked once.
"""
from __future__ import annotations

import ctypes
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import NO_GPU, NO_SUCH_COMMAND, TRANSPORT_CONFLICT, USAGE, UserError
from ..gate.daskconfig import collect_for
from ..gate.identity import GUARD
from ..gate.peer import parse_address
from ..ucx.transports import settings

# Canonical spellings: the words that start the command -> the role's kind.
DASK_ROLES = {
    ("dask", "scheduler"): "scheduler",
    ("dask", "worker"): "worker",
    ("dask", "cuda", "worker"): "cuda-worker",
    ("dask", "cuda", "config"): "cuda-config",
}
# Legacy launcher spellings -> the canonical words they are exec'd as.
LEGACY = {
    "dask-scheduler": ("dask", "scheduler"),
    "dask-worker": ("dask", "worker"),
    "dask-cuda-worker": ("dask", "cuda", "worker"),
    "dask-cuda-config": ("dask", "cuda", "config"),
}
# `python -m MODULE` forms (run unchanged).
PYTHON_MODULES = {
    "distributed.cli.dask_scheduler": "scheduler",
    "distributed.cli.dask_worker": "worker",
    "dask_cuda.cli": "cuda-worker",
}
PYTHONS = ("python", "python3")
# What a refusal lists: the roles, then examples of the commands the image has.
USAGE_LINE = ("dask scheduler | dask worker ADDRESS | dask cuda worker ADDRESS | dask cuda config | "
              "dask-scheduler | dask-worker | dask-cuda-worker | python -m distributed.cli.dask_scheduler|dask_worker "
              "| or a command the image has: ucx-dask-gpu COMMAND, python ..., ucx_info, ucx_perftest, bash")
DASK_KINDS = ("scheduler", "worker", "cuda-worker")
# Set to the pid of the process the entrypoint execs: that process is a checked role (rolehook.py). Not UCX_-prefixed
# (UCX warns about every UCX_* variable it does not know), not DASK_-prefixed (dask reads those as config).
ROLE_CHECKED_ENV = "UCXDASKGPU_ROLE_CHECKED_PID"


@dataclass(frozen=True)
class Role:
    kind: str              # scheduler | worker | cuda-worker | cuda-config | command (anything else, run as it is)
    argv: tuple[str, ...]  # what is exec'd
    words: int = 1         # how many words of argv name the role (`dask cuda worker`: 3; `python -m X`: 3)


def _is_python(word: str) -> bool:
    name = os.path.basename(word)
    return (name in PYTHONS or (name.startswith("python3.") and name[8:].isdigit())) and (
        word == name or os.path.isabs(word))


def classify(argv: list[str]) -> Role:
    """The role `argv` asks for and the command to exec: a Dask role in any spelling, else the command as it is;
    UserError(NO_SUCH_COMMAND) when there is no command at all."""
    if not argv or not argv[0]:
        raise UserError(f"no command given; run one of: {USAGE_LINE}", NO_SUCH_COMMAND)
    first = argv[0]
    if first in LEGACY:
        words = LEGACY[first]
        return Role(DASK_ROLES[words], (*words, *argv[1:]), len(words))
    if first == "dask":
        for words, kind in DASK_ROLES.items():
            if tuple(argv[:len(words)]) == words:
                return Role(kind, tuple(argv), len(words))
    if _is_python(first) and len(argv) > 2 and argv[1] == "-m" and argv[2] in PYTHON_MODULES:
        return Role(PYTHON_MODULES[argv[2]], tuple(argv), 3)
    return Role("command", tuple(argv))


def check_transports(config: dict, environ: dict) -> None:
    """Refuse transport settings that contradict each other (one line, TRANSPORT_CONFLICT)."""
    conflicts = settings(config, environ).conflicts
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise UserError(f"conflicting transport settings: {conflicts[0]}{more}", TRANSPORT_CONFLICT)


def missing_gpu(environ: dict, dev: str | os.PathLike = "/dev") -> str | None:
    """What keeps a GPU worker from seeing a GPU here (None when one is visible)."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None and cvd.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"CUDA_VISIBLE_DEVICES={cvd!r} hides every GPU"
    nvd = environ.get("NVIDIA_VISIBLE_DEVICES")
    devices = sorted(p.name for p in Path(dev).glob("nvidia[0-9]*"))
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        toolkit = "start the container with --gpus device=N (NVIDIA container toolkit), or run it on a GPU node"
        if nvd in ("void", "none", ""):
            return f"NVIDIA_VISIBLE_DEVICES={nvd!r} gives this container no GPU and no driver; {toolkit}"
        return (f"no NVIDIA driver in this container (libnvidia-ml.so.1 not found"
                f"{', no /dev/nvidia* devices' if not devices else ''}); {toolkit}")
    if not devices:
        return "the NVIDIA driver is here but no GPU device is (/dev/nvidia0, ... absent): --gpus device=N"
    return None


def check_gpu(role: Role, environ: dict) -> None:
    if role.kind != "cuda-worker" or "--help" in role.argv:
        return
    why = missing_gpu(environ)
    if why:
        raise UserError(f"{' '.join(role.argv[:3])} needs a GPU: {why}", NO_GPU)


def check_worker_address(role: Role, config: dict) -> None:
    """A worker's scheduler address as one line (USAGE) instead of dask's traceback: malformed right after the role's
    words (after options it is dask's to read, as documented), or none at all (`docker run IMAGE dask worker`, options
    only) and no scheduler-address in its dask config either (dask's answer: a 26-line ValueError traceback)."""
    words, rest = " ".join(role.argv[:role.words]), role.argv[role.words:]
    if role.kind not in ("worker", "cuda-worker"):
        return
    if rest and not rest[0].startswith("-"):
        parse_address(rest[0], "the scheduler address")
    elif "--help" not in rest and not (config.get("scheduler-address") or config.get("scheduler_address")) \
            and not (any(not w.startswith("-") for w in rest) and _address_among_options(role.kind, rest)):
        raise UserError(f"{words}: no scheduler address: give one, e.g. `{words} tcp://scheduler:8786`, or "
                        "--scheduler-file FILE", USAGE)


def _address_among_options(kind: str, rest: tuple[str, ...]) -> bool:
    """Whether the role's own command line parser finds an address or a scheduler file among `rest` (`--nthreads 2`
    takes a value, `--no-nanny` does not: only dask's parser knows which). Imported here, only for such a command
    line: every other role starts without loading dask's CLI first."""
    if kind == "cuda-worker":
        from dask_cuda.cli import worker as command
    else:
        from distributed.cli.dask_worker import main as command
    try:
        ctx = command.make_context(kind, list(rest), resilient_parsing=True)
    except Exception:  # dask's parser, run for real next, says what is wrong with the options in its own words
        return True
    return bool(ctx.params.get("scheduler") or ctx.params.get("scheduler_file"))


def nanny_preload_args(role: Role, config: dict) -> Role:
    """`dask worker` in any spelling (`dask-worker`, `python -m distributed.cli.dask_worker`) never reads
    distributed.nanny.preload: the configured nanny preloads (the guard first, always) as --preload-nanny options, so
    its nanny loads what `dask cuda worker`'s reads from the config (see the module docstring)."""
    if role.kind != "worker":
        return role
    configured = (config.get("distributed", {}).get("nanny", {}) or {}).get("preload") or []
    configured = [configured] if isinstance(configured, str) else list(configured)
    given = {role.argv[i + 1] for i, word in enumerate(role.argv[:-1]) if word == "--preload-nanny"}
    extra = [w for m in dict.fromkeys([GUARD, *configured]) if m not in given for w in ("--preload-nanny", m)]
    n = role.words
    return Role(role.kind, (*role.argv[:n], *extra, *role.argv[n:]), n)


def run(argv: list[str]) -> int:
    try:
        role = classify(argv)
        env = dict(os.environ)
        if role.kind in DASK_KINDS:
            config = collect_for(env)
            check_worker_address(role, config)
            role = nanny_preload_args(role, config)
            check_transports(config, env)
            check_gpu(role, env)
            env[ROLE_CHECKED_ENV] = str(os.getpid())  # execvpe keeps the pid
    except UserError as e:
        print(f"ucx-dask-gpu image: {e}", file=sys.stderr)
        return e.exit_code
    # `dask` of this Python's environment, also where its bin/ is not on PATH (a venv's dask-worker run by path).
    sibling = Path(sys.executable).parent / role.argv[0]
    exe = str(sibling) if role.argv[0] == "dask" and sibling.exists() else role.argv[0]
    try:
        os.execvpe(exe, list(role.argv), env)
    except FileNotFoundError:
        where = "no such file" if "/" in role.argv[0] else "not on PATH"
        print(f"ucx-dask-gpu image: no command {role.argv[0]!r} in this image ({where}); run one of: {USAGE_LINE}",
              file=sys.stderr)
    except OSError as e:
        print(f"ucx-dask-gpu image: cannot run {role.argv[0]!r}: {e.strerror}", file=sys.stderr)
    return NO_SUCH_COMMAND


def main(argv: list[str] | None = None) -> int:
    return run(sys.argv[1:] if argv is None else argv)


def legacy_main() -> int:
    """`dask-scheduler`, `dask-worker` (the image's commands): the same checks and exec as the entrypoint."""
    return run([os.path.basename(sys.argv[0]), *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
