"""The image's start-up hook: a Dask role started without the image's entrypoint (Apptainer `exec`, a Kubernetes
`command:`, `--entrypoint ''`, dask-jobqueue's job scripts) still goes through it. Otherwise a GPU worker on a host
without a usable GPU dies in dask-cuda's 78-line pynvml traceback, and `dask worker` runs without the guard in its
nanny. ROLE_HOOK_PTH, in the image's site-packages, runs at every interpreter start: a Dask role not marked by the
entrypoint (ROLE_CHECKED_ENV = its pid) hands its command to it, which checks it and execs it as `docker run IMAGE
<role>` would. Interpreter options before `-m` are not carried over. Every other Python process pays one look at its
own command line.
"""
from __future__ import annotations

import os
import sys
import sysconfig
from pathlib import Path

from ..fsutil import write_output_dir
from .entrypoint import DASK_KINDS, LEGACY, PYTHON_MODULES, ROLE_CHECKED_ENV, classify, run

ROLE_HOOK_PTH = "ucx-dask-gpu-roles.pth"
# Interpreter options that take the next word as their value.
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")


def pth_line() -> str:
    """The .pth line (site runs lines that start with `import`): a cheap test first, our module only when it may
    matter. Never for `python -m ucx_dask_gpu...` (the entrypoint itself among them): importing this module (and so
    the entrypoint) before runpy runs one of ours would make runpy warn that it was imported twice."""
    return (f"import os, sys; argv = getattr(sys, 'orig_argv', ()); "
            f"os.environ.get({ROLE_CHECKED_ENV!r}) != str(os.getpid()) and any('dask' in a for a in argv) and "
            "not any(a.startswith('ucx_dask_gpu') for a in argv) and "
            f"__import__({__name__!r}, fromlist=['route']).route()\n")


def role_command(orig_argv: list[str]) -> list[str] | None:
    """The command this interpreter was started with, as the entrypoint reads roles, or None when it is not one of
    the spellings of a Dask role: `python [OPTIONS] -m MODULE ...` for the role modules and `python -m dask ...`, or
    `python [OPTIONS] SCRIPT ...` for the `dask` and legacy (`dask-cuda-worker`, ...) console scripts."""
    i = 1
    while i < len(orig_argv):
        word = orig_argv[i]
        if word == "-m":
            module, rest = (orig_argv[i + 1], orig_argv[i + 2:]) if i + 1 < len(orig_argv) else ("", [])
            if module == "dask":
                return ["dask", *rest]
            # This interpreter by its absolute path: the entrypoint execs exactly it again.
            return [sys.executable, "-m", module, *rest] if module in PYTHON_MODULES else None
        if word in ("-c", "-") or not word.startswith("-"):
            break
        i += 2 if word in _OPTIONS_WITH_VALUE else 1
    else:
        return None
    if word.startswith("-"):
        return None
    script = os.path.basename(word)
    return [script, *orig_argv[i + 1:]] if script == "dask" or script in LEGACY else None


def route() -> None:
    """At interpreter start-up: a Dask role not marked by the entrypoint goes through it (exec, or its one line and
    exit code); anything else returns at once."""
    argv = role_command(list(getattr(sys, "orig_argv", [])))
    if argv is None or os.environ.get(ROLE_CHECKED_ENV) == str(os.getpid()):
        return
    if classify(argv).kind not in DASK_KINDS:  # `dask info`, `dask --help`: not a role, nothing to check
        return
    code = run(argv)  # execs the role; returns only after its one line (a refusal) was printed
    sys.stderr.flush()
    # Still inside `site`: SystemExit here would be a fatal start-up error with a traceback.
    os._exit(code)


def install(dest: str | os.PathLike | None = None) -> Path:
    """Write ROLE_HOOK_PTH into `dest` (default: this Python's site-packages); nothing else there is touched."""
    [path] = write_output_dir(dest or sysconfig.get_paths()["purelib"], {ROLE_HOOK_PTH: pth_line()},
                              what="the hook line")
    return path
