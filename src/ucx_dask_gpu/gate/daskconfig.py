"""The dask config the image ships: guard preloads, timeouts, shutdown, and the UCX transports.

`ucx-dask-gpu config install --dest /etc/dask [--transports auto|cpu|gpu]` writes two files into a dask config
directory, both or neither:
  ucx-dask-gpu.yaml             common to every host (src/ucx_dask_gpu/config/ucx-dask-gpu.yaml)
  ucx-dask-gpu-transports.yaml  transports-auto.yaml (default), transports-cpu.yaml or transports-gpu.yaml
`auto` leaves the transports to UCX on every host (GPU or not), so a process that reads only /etc/dask (Apptainer
`exec`, a Kubernetes `command:`, a user's own DASK_CONFIG next to it) gets what the entrypoint would give it; `cpu`
and `gpu` pin UCX_TLS and are opt-in. Other YAML files in the package's config folder (e.g. tuned-gpu.yaml, owned by
the benchmarks) are not installed by this command.
"""
from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Mapping

from ..errors import OUTPUT_REFUSED, USAGE, UserError
from ..fsutil import atomic_write_many

# The worker preload that lets a worker close without a heartbeat traceback (quietclose.py), as dask config names it.
QUIET_CLOSE = "ucx_dask_gpu.gate.quietclose"
COMMON = "ucx-dask-gpu.yaml"
TRANSPORTS = {"auto": "transports-auto.yaml", "cpu": "transports-cpu.yaml", "gpu": "transports-gpu.yaml"}
INSTALLED_TRANSPORTS = "ucx-dask-gpu-transports.yaml"


def packaged_text(name: str) -> str:
    return resources.files("ucx_dask_gpu").joinpath("config", name).read_text()


def render(transports: str) -> dict[str, str]:
    """Installed file name -> text, for a transports kind (auto|cpu|gpu)."""
    if transports not in TRANSPORTS:
        raise UserError(f"unknown transports {transports!r} (expected auto, cpu or gpu)", USAGE)
    body = packaged_text(TRANSPORTS[transports])
    header = f"# Installed by `ucx-dask-gpu config install` from {TRANSPORTS[transports]}.\n"
    return {COMMON: packaged_text(COMMON), INSTALLED_TRANSPORTS: header + body}


def install(dest: str | os.PathLike, transports: str = "auto") -> list[Path]:
    files = render(transports)
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} exists and is not a directory", OUTPUT_REFUSED)
    try:
        return atomic_write_many({dest / name: text for name, text in files.items()})
    except OSError as e:
        raise UserError(f"cannot write dask config into {dest}: {e.strerror}", OUTPUT_REFUSED) from None


def load_installed(dest: str | os.PathLike) -> dict:
    """The config dask would read from `dest` alone (merged YAML files), for checks and `config show`."""
    import dask.config  # heavy: only where the installed config is read back

    return dask.config.collect(paths=[str(dest)], env={})


def collect_for(environ: Mapping[str, str]) -> dict:
    """The dask config a process started with `environ` will read: the YAML files of dask's search path (with
    environ's DASK_CONFIG instead of this process's) and environ's DASK_* variables."""
    import dask.config  # heavy: only where another process's config is computed (entrypoint, doctor)

    own = os.environ.get("DASK_CONFIG")
    paths = [p for p in dask.config.paths if own is None or p != own]
    if environ.get("DASK_CONFIG"):
        paths.append(environ["DASK_CONFIG"])
    return dask.config.collect(paths=paths, env=dict(environ))


def configured_worker_preloads() -> list[str]:
    """distributed.worker.preload of this process's dask config, as a list."""
    import dask.config  # only in Dask processes, where dask is loaded anyway

    configured = dask.config.get("distributed.worker.preload", None) or []
    return [configured] if isinstance(configured, str) else list(configured)


def add_worker_preloads(nanny, modules: list[str]) -> None:
    """Make a nanny's worker process load `modules` too (in this order, after the launcher's own), even when the
    launcher passed its own preload list.

    `dask cuda worker` and LocalCUDACluster give the nanny preload=[..., "dask_cuda.initialize"], which replaces
    distributed.worker.preload from config.
    """
    preload = [nanny.preload] if isinstance(nanny.preload, str) else list(nanny.preload or [])
    if not preload:
        # `dask worker` without --preload gives the nanny an empty list, and its worker then reads
        # distributed.worker.preload: start from those, or the worker would load `modules` alone.
        preload = configured_worker_preloads()
    missing = [m for m in dict.fromkeys(modules) if m not in preload]
    argv = list(nanny.preload_argv or [])
    if missing and argv and not isinstance(argv[0], str):  # one argv list per preload: ours take none
        argv.extend([] for _ in missing)
    nanny.preload = preload + missing
    nanny.preload_argv = argv
