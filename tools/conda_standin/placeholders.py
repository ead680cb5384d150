"""Metadata-only packages standing in for the conda-forge and rapidsai packages this channel's packages depend on.

Where neither channel is reachable, rattler-build still must solve ucxx's host environment (libucxx needs cuda-version)
and py-rattler must solve `ucx-dask-gpu cuda-version=<major>.0` the way a user's conda does. For every dependency of
the channel's packages that the channel does not provide, a placeholder channel gets one empty package of that name:
at the version the Python lock pins it (by its conda name, stack.toml [conda.names]), python at this machine's
version (build string `*_cpython`, as conda-forge's), cuda-version at the CUDA version asked for. Each says in its
about.json what it stands in for and where the real files come from (the environment step of the install check
makes the prefix a venv of this machine's python and installs the lock's wheels into it). A dependency with no such
version is named in one line; the solve itself is real, so a pin of ours that the lock does not satisfy fails it.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ucx_dask_gpu.conda.settings import lock_versions_by_conda_name
from ucx_dask_gpu.errors import INSTALL_FAILED, UserError
from ucx_dask_gpu.stack import Stack

SUBDIR = "linux-64"
BUILD = "placeholder_0"
PYTHON_BUILD = "placeholder_0_cpython"


def channel_records(channel: Path) -> list[dict]:
    """Every package record of an indexed channel (all subdirs)."""
    out = []
    for repodata in sorted(channel.glob("*/repodata.json")):
        data = json.loads(repodata.read_text())
        out += list({**data.get("packages", {}), **data.get("packages.conda", {})}.values())
    return out


def needed(records: list[dict]) -> list[str]:
    """Names the records depend on that none of them provides (virtual packages aside)."""
    provided = {r["name"] for r in records}
    return sorted({d.split()[0] for r in records for d in r.get("depends", [])
                   if not d.startswith("__") and d.split()[0] not in provided})


def versions(st: Stack, names: list[str], cuda: str) -> dict[str, tuple[str, str, str]]:
    """name -> (version, build, what the real files are) for each placeholder."""
    locked = lock_versions_by_conda_name(st)
    py = ".".join(map(str, sys.version_info[:3]))
    out, missing = {}, []
    for name in names:
        if name == "python":
            out[name] = (py, PYTHON_BUILD, f"this machine's python {py}, as a venv at the prefix")
        elif name == "cuda-version":
            out[name] = (cuda, BUILD, "nothing (conda-forge's cuda-version carries constraints only)")
        elif name in locked:
            out[name] = (locked[name], BUILD, f"the PyPI wheel(s) of {st.python.lock} for it, installed by pip")
        else:
            missing.append(name)
    if missing:
        raise UserError(f"no stand-in version for {', '.join(missing)}: not python, cuda-version nor in "
                        f"{st.python.lock} under its conda name (stack.toml [conda.names])", INSTALL_FAILED)
    return out


def _package(dest: Path, name: str, version: str, build: str, note: str) -> Path:
    import conda_package_handling.api as cph

    with tempfile.TemporaryDirectory() as tmp:
        info = Path(tmp) / "info"
        info.mkdir()
        index = {"name": name, "version": version, "build": build, "build_number": 0, "depends": [],
                 "subdir": SUBDIR, "license": "placeholder", "timestamp": 0}
        (info / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
        (info / "paths.json").write_text(json.dumps({"paths": [], "paths_version": 1}))
        (info / "files").write_text("")
        (info / "about.json").write_text(json.dumps({
            "summary": f"placeholder for conda-forge/rapidsai {name} {version}: no files",
            "extra": {"placeholder_for": f"{name} {version}", "real_files_from": note}}, indent=1))
        fn = f"{name}-{version}-{build}.conda"
        cph.create(tmp, ["info/index.json", "info/paths.json", "info/files", "info/about.json"], fn,
                   out_folder=str(dest))
    return dest / fn


def write(st: Stack, channel: Path, dest: Path, cuda: str) -> dict[str, tuple[str, str, str]]:
    """The placeholder channel for `channel` at `dest` (replaced), indexed; returns what stands in for what."""
    from rattler.index import index_fs

    made = versions(st, needed(channel_records(channel)), cuda)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / SUBDIR).mkdir(parents=True)
    (dest / "noarch").mkdir()
    for name, (version, build, note) in made.items():
        _package(dest / SUBDIR, name, version, build, note)
    asyncio.run(index_fs(dest, write_zst=False, write_shards=False, force=True))
    shutil.rmtree(dest / ".tmp", ignore_errors=True)
    return made
