"""Where one UCX lives: a prefix (ours, built by ucx-src-build, or another), the libucx wheel of this Python, or the
UCX whose tools are on PATH -- its bin/ and lib/ directories and, for our builds, share/ucx-dask-gpu/build-info.json.

Every command that looks for a UCX (doctor, verify-nvlink, `ucx verify`, the image build, the conda build check)
resolves it here. Standard library only: the UCX build imports it with a bare python3.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ..errors import UCX_NOT_FOUND, UserError
from ..fsutil import read_json
from ..stack import Stack

# Our records below a prefix (a UCX prefix, a Python environment's).
SHARE = Path("share/ucx-dask-gpu")
# What our build writes into every prefix it makes (ucx-src-build); its presence is what makes a UCX "ours".
BUILD_INFO = SHARE / "build-info.json"
# What our UCXX build writes next to its wheels: which wheels, built from what, against which UCX (a file name).
UCXX_BUILD_INFO = "ucxx-build-info.json"
# Where `install-ucxx` puts that file below a Python environment's prefix.
INSTALLED_UCXX_BUILD_INFO = SHARE / UCXX_BUILD_INFO
PREFIX_ENV = "UCX_DASK_GPU_UCX_PREFIX"
# What a Python environment loads at start-up to put our UCX under UCXX (`ucx-src-build/build.sh install-ucxx`).
PRELOAD_PTH = "ucx-dask-gpu-ucx.pth"
LOADER = "loader search path"


def read_build_info(prefix: str | os.PathLike | None) -> dict | None:
    """The UCX prefix's build-info.json; None when there is none (not our build) or it is not JSON."""
    return None if prefix is None else read_json(Path(prefix) / BUILD_INFO)


def read_ucxx_build_info(directory: str | os.PathLike) -> dict | None:
    """The ucxx-build-info.json in `directory` (UCXX wheels our build made, or an environment's SHARE); None when
    there is none or it is not JSON."""
    return read_json(Path(directory) / UCXX_BUILD_INFO)


def prefix_of_library(path: str | None) -> Path | None:
    """<prefix>/lib/libucp.so.0 -> <prefix> (None when not in a lib/ directory)."""
    if not path:
        return None
    lib = Path(path).parent
    return lib.parent if lib.name in ("lib", "lib64") else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def ucxx_can_use(st: Stack, version: str) -> bool:
    """UCXX refuses an older UCX at import: only from stack.toml's [ucxx].min_ucx on may it use one."""
    return version_tuple(version) >= version_tuple(st.ucxx.min_ucx)


@dataclass(frozen=True)
class UcxInstall:
    prefix: Path
    kind: str                 # source (our build: it has build-info.json) | prefix | pip (the libucx wheel) | path
    spec: str                 # what was asked for: a directory, `pip`, `path`
    build_info: dict | None = None

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def lib_dirs(self) -> list[Path]:
        return [d for d in (self.prefix / "lib", self.prefix / "lib64") if d.is_dir()]

    def tool(self, name: str) -> Path | None:
        """bin/NAME when it is an executable file here."""
        exe = self.bin / name
        return exe if exe.is_file() and os.access(exe, os.X_OK) else None

    @property
    def ucx_info(self) -> Path | None:
        return self.tool("ucx_info")

    @property
    def perftest(self) -> Path | None:
        return self.tool("ucx_perftest")


def at(prefix: str | os.PathLike, kind: str = "prefix", spec: str | None = None) -> UcxInstall:
    """The UCX installed under `prefix` (kind `source` when our build-info.json is there, unless it is the wheel)."""
    prefix = Path(prefix)
    info = read_build_info(prefix)
    if info is not None and kind != "pip":
        kind = "source"
    return UcxInstall(prefix, kind, spec or str(prefix), info)


def pip_wheel_prefix() -> Path | None:
    """The directory of the libucx wheel (libucx-cu13) installed in this Python, if any."""
    spec = importlib.util.find_spec("libucx")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def preloaded_prefix(site: Path) -> Path | None:
    """The UCX prefix the environment of `site` (a site-packages directory) preloads at start-up, if any."""
    pth = site / PRELOAD_PTH
    m = re.search(r"CDLL\('([^']+)/lib/libucp\.so\.0'", pth.read_text()) if pth.is_file() else None
    return Path(m.group(1)) if m else None


def locate(spec: str, code: int = UCX_NOT_FOUND, tool: str = "ucx_perftest") -> UcxInstall:
    """`pip`: the libucx wheel of this Python; `path`: the UCX whose `tool` is on PATH; anything else: a prefix
    directory. UserError(`code`) with one line when there is none."""
    if spec == "pip":
        d = pip_wheel_prefix()
        if d is None:
            raise UserError("--ucx-prefix pip: the libucx wheel (libucx-cu13) is not installed in this Python", code)
        return at(d, "pip", spec)
    if spec == "path":
        exe = shutil.which(tool)
        if exe is None:
            raise UserError(f"--ucx-prefix path: no {tool} on PATH", code)
        return at(Path(exe).resolve().parent.parent, "path", spec)
    d = Path(spec).expanduser()
    if not d.is_dir():
        raise UserError(f"--ucx-prefix {spec}: no such directory", code)
    return at(d.resolve(), "prefix", spec)


def choose(arg: str | None, default: str | None) -> tuple[UcxInstall | None, str]:
    """The UCX this environment means, and how it was found: `arg` (--ucx-prefix), else $UCX_DASK_GPU_UCX_PREFIX,
    else the prefix this Python preloads at start-up, else `default` (the image's prefix, stack.toml
    [image].ucx_prefix) when it holds a lib/, else None: whatever the loader finds."""
    if arg:
        inst = locate(arg)
        if not (inst.prefix / "lib").is_dir():
            raise UserError(f"--ucx-prefix {arg}: no lib/ directory there", UCX_NOT_FOUND)
        return inst, "--ucx-prefix"
    env = os.environ.get(PREFIX_ENV)
    if env:
        return at(Path(env).resolve(), spec=env), f"${PREFIX_ENV}"
    preloaded = preloaded_prefix(Path(sysconfig.get_paths()["purelib"]))
    if preloaded is not None:
        return at(preloaded, spec=str(preloaded)), "this environment's start-up preload (install-ucxx)"
    if default and (Path(default) / "lib").is_dir():
        return at(Path(default).resolve(), spec=default), f"default {default}"
    where = f", no {default}" if default else ""
    return None, f"{LOADER} (no --ucx-prefix, no ${PREFIX_ENV}{where})"
