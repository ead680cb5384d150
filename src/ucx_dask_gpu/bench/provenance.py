"""What a result was measured on, recorded in every JSON: the git commit (and whether the tree had changes), the
versions of the stack's packages, the GPU driver and CUDA, the GPU models and clocks (NVML), the host, its CPUs, and
the exact command. Each cluster's client and workers add the libucp they have mapped (cluster.process_facts).

Where the source is a copy of the tree (a GPU host reached without git, whose copy may carry a stale .git), the commit
is given in $UCX_DASK_GPU_COMMIT: a given commit wins over what git reports there, which is kept beside it.
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path

from .. import nvml
from ..errors import UserError

REPO = Path(__file__).resolve().parents[3]
COMMIT_ENV = "UCX_DASK_GPU_COMMIT"
# Distribution names; a suffixed build (rmm-cu13, cupy-cuda13x, ucxx-cu13) is found by its prefix.
PACKAGES = ("dask", "distributed", "dask-cuda", "ucxx", "distributed-ucxx", "libucxx", "rmm", "librmm", "cupy",
            "numpy", "nvtx", "ucx-dask-gpu")
SUFFIX_RE = re.compile(r"^-(cu|cuda)\d+x?$")


def git_state(root: Path = REPO) -> dict:
    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode == 0:
            dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
            seen = {"commit": head.stdout.strip(), "dirty": bool(dirty), "source": "git"}
        else:
            seen = {"commit": None, "dirty": None, "source": None,
                    "git": (head.stderr.strip().splitlines() or ["not a git checkout"])[-1]}
    except (OSError, subprocess.TimeoutExpired) as e:
        seen = {"commit": None, "dirty": None, "source": None, "git": f"git: {e}"}
    given = os.environ.get(COMMIT_ENV)
    if given:
        return {"commit": given, "dirty": None, "source": f"${COMMIT_ENV}", "git": seen}
    return seen


def versions() -> dict[str, str]:
    found = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        for p in PACKAGES:
            if name == p or (name.startswith(p) and SUFFIX_RE.match(name[len(p):])):
                found[name] = dist.version
    found["python"] = platform.python_version()
    return dict(sorted(found.items()))


def gpu_facts(indices: list[int]) -> dict:
    """Driver, CUDA and each used GPU's model and clocks; {"error": ...} where NVML is not there."""
    try:
        return {"driver": nvml.driver_version(), "cuda": nvml.cuda_driver_version(),
                "gpus": [nvml.device_facts(i) for i in indices]}
    except UserError as e:
        return {"error": str(e)}


def collect(command: str, gpu_indices: list[int] | None) -> dict:
    out = {"git": git_state(), "versions": versions(), "host": socket.gethostname(), "cpu_count": os.cpu_count(),
           "platform": platform.platform(), "python": sys.executable, "command": command}
    if gpu_indices is not None:
        out.update(gpu_facts(gpu_indices))
    return out
