"""The dask config the image and the conda package ship: guard preloads, timeouts, shutdown, the UCX transports and
the measured settings; and which of it a process has in force.

`ucx-dask-gpu config install --dest DIR` writes them into a dask config directory, all or none (docs/environment-gate.md
says what each file holds). `auto` leaves the transports to UCX on every host (GPU or not), so a process that reads
only /etc/dask (Apptainer `exec`, a Kubernetes `command:`, a user's own DASK_CONFIG next to it) gets what the
entrypoint would give it.

Only the standard library at import and in `install`: the conda package's build script runs `config install`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Iterator, Mapping

from ..errors import USAGE, UserError
from ..fsutil import check_names_free, check_output_dir, write_output_dir

# The worker preload that lets a worker close without a heartbeat traceback (quietclose.py), as dask config names it.
QUIET_CLOSE = "ucx_dask_gpu.gate.quietclose"
# The preload that says a role's transports and config in force and applies our settings (ucx/startup.py).
STARTUP = "ucx_dask_gpu.ucx.startup"
COMMON = "ucx-dask-gpu.yaml"
TRANSPORTS = {"auto": "transports-auto.yaml", "cpu": "transports-cpu.yaml", "gpu": "transports-gpu.yaml"}
INSTALLED_TRANSPORTS = "ucx-dask-gpu-transports.yaml"
TUNED = "tuned-gpu.yaml"
INSTALLED_TUNED = "ucx-dask-gpu-tuned.yaml"


def packaged_text(name: str) -> str:
    return resources.files("ucx_dask_gpu").joinpath("config", name).read_text()


def short_sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:8]


def render(transports: str, tuned: bool = True) -> dict[str, str]:
    """Installed file name -> text, for a transports kind (auto|cpu|gpu), with or without the tuned settings."""
    if transports not in TRANSPORTS:
        raise UserError(f"unknown transports {transports!r} (expected auto, cpu or gpu)", USAGE)
    out = {COMMON: packaged_text(COMMON)}
    for installed, name in ((INSTALLED_TRANSPORTS, TRANSPORTS[transports]), (INSTALLED_TUNED, TUNED if tuned else None)):
        if name:
            body = packaged_text(name)
            out[installed] = f"# Installed by `ucx-dask-gpu config install` from {name}.\n" + body
    return out


def install(dest: str | os.PathLike, transports: str = "auto", tuned: bool = True) -> list[Path]:
    files = render(transports, tuned)
    # beside the host's own dask config: only the files an earlier install wrote are replaced (fsutil's manifest)
    check_output_dir(dest)  # the CLI checked it; the conda package's build script calls this directly
    check_names_free(dest, files)
    return write_output_dir(dest, files, what="the dask config")


def search_path_for(environ: Mapping[str, str]) -> list[str]:
    """dask's config search path in a process started with `environ` (its DASK_CONFIG instead of this process's)."""
    import dask.config  # heavy: only where another process's config is computed (entrypoint, doctor)

    own = os.environ.get("DASK_CONFIG")
    paths = [p for p in dask.config.paths if own is None or p != own]
    if environ.get("DASK_CONFIG"):
        paths.append(environ["DASK_CONFIG"])
    return paths


def collect_for(environ: Mapping[str, str]) -> dict:
    """The dask config a process started with `environ` will read: the YAML files of dask's search path (with
    environ's DASK_CONFIG instead of this process's) and environ's DASK_* variables."""
    import dask.config

    return dask.config.collect(paths=search_path_for(environ), env=dict(environ))


def flatten(tree: Mapping, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted key, value) for every leaf of a nested config (an empty mapping is a leaf)."""
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping) and v:
            yield from flatten(v, key)
        else:
            yield key, v


def shipped_settings() -> dict[str, object]:
    """The shipped tuned settings (tuned-gpu.yaml), dotted key -> value."""
    import yaml  # with dask: only where a config is compared

    return dict(flatten(yaml.safe_load(packaged_text(TUNED)) or {}))


@dataclass
class InForce:
    files: list[tuple[str, str]]      # (path, short sha256) of each YAML file dask reads, in the order it reads them
    env: list[str]                    # DASK_* variables
    tuned: str                        # the shipped tuned file and its short sha256: "tuned-gpu.yaml@1a2b3c4d"
    settings: int                     # how many settings it has
    differ: dict[str, tuple] = field(default_factory=dict)   # key -> (shipped value, value in force)

    def line(self) -> str:
        """One line: the tuned settings in force (or which are not) and the files they come from."""
        held = self.settings - len(self.differ)
        if not self.differ:
            head = f"{self.tuned} in force ({held} settings)"
        else:
            shown = [f"{k}={v!r} (shipped {s!r})" for k, (s, v) in list(self.differ.items())[:3]]
            more = f", +{len(self.differ) - 3} more" if len(self.differ) > 3 else ""
            head = f"{self.tuned}: {held} of {self.settings} settings in force; differs: {', '.join(shown)}{more}"
        files = ", ".join(f"{p}@{h}" for p, h in self.files) or "none"
        env = f"; {len(self.env)} DASK_* variable(s)" if self.env else ""
        return f"dask config {head}; files {files}{env}"

    def as_dict(self) -> dict:
        return {"tuned": self.tuned, "settings": self.settings, "in_force": self.settings - len(self.differ),
                "differ": {k: {"shipped": s, "in_force": v} for k, (s, v) in self.differ.items()},
                "files": [{"path": p, "sha256": h} for p, h in self.files], "env": self.env}


def in_force(config: Mapping, paths: list[str], environ: Mapping[str, str]) -> InForce:
    """Which YAML files of `paths` dask reads and how `config` (what a process has in force) holds the shipped tuned
    settings."""
    import dask.config

    files = [(str(p), short_sha(Path(p).read_bytes())) for p, _ in dask.config.collect_yaml(paths, return_paths=True)]
    missing = object()
    differ = {}
    shipped = shipped_settings()
    for key, value in shipped.items():
        have = dask.config.get(key, None if value is None else missing, config=config)  # unset reads as null
        if have is missing or have != value:
            differ[key] = (value, None if have is missing else have)
    tuned = f"{TUNED}@{short_sha(packaged_text(TUNED).encode())}"
    return InForce(files, sorted(k for k in environ if k.startswith("DASK_")), tuned, len(shipped), differ)


def configured_worker_preloads() -> list[str]:
    """distributed.worker.preload of this process's dask config, as a list."""
    import dask.config  # only in Dask processes, where dask is loaded anyway

    configured = dask.config.get("distributed.worker.preload", None) or []
    return [configured] if isinstance(configured, str) else list(configured)


def add_worker_preloads(nanny, modules: list[str]) -> None:
    """Make a nanny's worker process load `modules` too (in this order, after the launcher's own), even when the
    launcher passed its own preload list: `dask cuda worker` and LocalCUDACluster give the nanny
    preload=[..., "dask_cuda.initialize"], which replaces distributed.worker.preload from config."""
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
