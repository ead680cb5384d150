"""The dask config the image ships: guard preloads, timeouts, shutdown, and UCX transports per host kind.

`ucx-dask-gpu config install --dest /etc/dask [--transports auto|cpu|gpu]` writes two files into a dask config
directory, both or neither:
  ucx-dask-gpu.yaml             common to every host (src/ucx_dask_gpu/config/ucx-dask-gpu.yaml)
  ucx-dask-gpu-transports.yaml  transports-cpu.yaml or transports-gpu.yaml
`auto` picks gpu when NVML sees a GPU. Other YAML files in the package's config folder (e.g. tuned-gpu.yaml,
owned by the benchmarks) are not installed by this command.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from .. import nvml
from ..errors import CONFIG_DEST, USAGE, UserError
from ..fsutil import atomic_write_many

# The worker preload that lets a worker close without a heartbeat traceback (quietclose.py), as dask config names it.
QUIET_CLOSE = "ucx_dask_gpu.gate.quietclose"
COMMON = "ucx-dask-gpu.yaml"
TRANSPORTS = {"cpu": "transports-cpu.yaml", "gpu": "transports-gpu.yaml"}
INSTALLED_TRANSPORTS = "ucx-dask-gpu-transports.yaml"


def packaged_text(name: str) -> str:
    return resources.files("ucx_dask_gpu").joinpath("config", name).read_text()


def detect_transports() -> str:
    """gpu when NVML reports at least one GPU, else cpu."""
    try:
        return "gpu" if nvml.discover() else "cpu"
    except UserError:  # no driver / no GPU / no nvidia-ml-py: a CPU host
        return "cpu"


def render(transports: str) -> dict[str, str]:
    """Installed file name -> text, for a transports kind (cpu|gpu|auto)."""
    if transports == "auto":
        transports = detect_transports()
    if transports not in TRANSPORTS:
        raise UserError(f"unknown transports {transports!r} (expected auto, cpu or gpu)", USAGE)
    body = packaged_text(TRANSPORTS[transports])
    header = f"# Installed by `ucx-dask-gpu config install` from {TRANSPORTS[transports]}.\n"
    return {COMMON: packaged_text(COMMON), INSTALLED_TRANSPORTS: header + body}


def install(dest: str | os.PathLike, transports: str = "auto") -> list[Path]:
    files = render(transports)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} exists and is not a directory", CONFIG_DEST)
    try:
        return atomic_write_many({dest / name: text for name, text in files.items()})
    except OSError as e:
        raise UserError(f"cannot write dask config into {dest}: {e.strerror}", CONFIG_DEST) from None


def load_installed(dest: str | os.PathLike) -> dict:
    """The config dask would read from `dest` alone (merged YAML files), for checks and `config show`."""
    import dask.config  # heavy: only where the installed config is read back

    return dask.config.collect(paths=[str(dest)], env={})
