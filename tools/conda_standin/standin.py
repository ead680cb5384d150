"""Build a recipe output with the real rattler-build where its build and host requirements cannot be installed.

No conda channel is reachable from these machines, so rattler-build cannot solve and install a recipe's build/host
requirements from conda-forge or rapidsai (compilers, sysroot, CUDA, rdma-core, librmm, python ...). Everything else
it can do offline, so this module stands in for exactly that and hands the rest to rattler-build:

- it writes a stand-in copy of the recipe (info/recipe/recipe.yaml of the package; the original beside it as
  original-recipe.yaml) whose build requirements are empty and whose host requirements keep only what this channel
  itself provides (ucx for libucxx, libucxx for ucxx: rattler-build installs those real packages into $PREFIX), and
  whose sources point at verified local copies: a url source's file by its sha256, a git source pinned to the commit
  of a stack.toml source by that source's archive, verified by its git tree id (content_tree) like every build here
  (upstream first, then the source mirrors; rattler-build checks the local file's sha256 again);
- the machine's tools and libraries take the other requirements' place: the system compiler, autotools and -dev
  packages (stack.toml [debian] ucx_build_packages); for ucx the pinned PyPI CUDA wheels + driver link libraries for
  `cuda-*-dev` (CPPFLAGS/LDFLAGS, as conda's compiler activation would point at $PREFIX); for libucxx and ucxx the
  UCXX build venv of the from-source wheels (stack.toml [ucxx.build].lock: cmake, ninja, Cython, scikit-build-core,
  rapids-build-backend, librmm's CCCL CMake package, the NVIDIA CUDA wheels as toolkit) through CMAKE_ARGS, PATH and
  PYTHON; a venv for a noarch python output's host python;
- what the stood-in packages would have contributed is written in explicitly: `pin_compatible` of a host package is
  resolved from the variant (cuda-version), `__glibc >=<this machine's glibc>` is added where the recipe declares
  `stdlib("c")` (the system compiler links against this machine's glibc, not the sysroot's older
  c_stdlib_version: the package needs what it was linked against, and check_glibc proves it needs no more), and
  the sonames the declared requirements provide (rdma-core -> libibverbs ...) are allowed in the overlinking check,
  every other soname stays an error (rattler-build's own check, `dynamic_linking.overlinking_behavior: error`);
- every output gets the build string rattler-build rendered for the original recipe + `_standin` (STANDIN_SUFFIX), the
  same for siblings, so a sibling's `pin_subpackage(..., exact=True)` finds the package built before it, and no
  stand-in package has a name a real build has (conda/publish.py refuses them).

Real rattler-build then does: rendering, source extraction and sha256 check, patches, solving and installing the host
packages this channel provides, the build environment contract (PREFIX with its placeholder, BUILD_PREFIX, SRC_DIR,
RECIPE_DIR, CPU_COUNT, PKG_*, variant keys), running the recipe's build script, relinking (RUNPATH -> $ORIGIN),
overlinking checks, prefix detection, packaging (info/, run_exports, tests) and the .conda archive.

A finished build is kept by the hash of everything it is made from (build_key) in <cache>/../conda-builds/, and taken
from there when nothing changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from ucx_dask_gpu.conda.publish import STANDIN_SUFFIX
from ucx_dask_gpu.conda.recipes import Variant, spec_name as req_name
from ucx_dask_gpu.errors import (BUILD_FAILED, INSTALL_FAILED, PACKAGE_INVALID, RECIPE_INVALID, SOURCE_UNREACHABLE,
                                 UserError)
from ucx_dask_gpu.fsutil import atomic_path, is_elf, sha256_file
from ucx_dask_gpu.stack import Stack
from ucx_dask_gpu.ucxbuild import cuda as cudamod
from ucx_dask_gpu.ucxbuild import ucxx as ucxxbuild
from ucx_dask_gpu.ucxbuild.fetch import Unreachable, default_cache_dir, fetch_file, fetch_source, sha256_verifier

# The sonames a conda-forge package in a recipe's build/host requirements provides at run time (directly or through
# its run_exports): what the stand-in may leave to the system because a declared requirement covers it.
SONAME_PROVIDERS: dict[str, tuple[str, ...]] = {
    **{glibc: ("c_stdlib",) for glibc in ("libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1",
                                          "libutil.so.1", "libresolv.so.2", "libanl.so.1", "libmvec.so.1",
                                          "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")},
    "libstdc++.so.6": ("cxx_compiler",),
    "libgcc_s.so.1": ("c_compiler", "cxx_compiler"),
    "libgomp.so.1": ("c_compiler",),
    "libibverbs.so.1": ("rdma-core",),
    "librdmacm.so.1": ("rdma-core",),
    "libmlx5.so.1": ("rdma-core",),
    "libefa.so.1": ("rdma-core",),
    "libnuma.so.1": ("libnuma",),
}
# What `${{ compiler(...) }}` and `${{ stdlib("c") }}` render to (gcc_linux-64 15.*, sysroot_linux-aarch64 2.28.*),
# by the requirement they stand for: per output, as rattler-build renders each output's own build requirements.
TOOLCHAIN = {"gcc": "c_compiler", "gxx": "cxx_compiler", "cuda-nvcc": "cuda_compiler", "gfortran": "fortran_compiler",
             "sysroot": "c_stdlib"}
TOOLCHAIN_RE = re.compile(r"^([a-z-]+)_linux-(?:64|aarch64)$")


def toolchain(v: Variant) -> dict[str, str]:
    """The output's rendered compiler and sysroot packages -> the requirement each stands for."""
    out = {}
    for spec in v.requirements("build"):
        m = TOOLCHAIN_RE.match(spec.split()[0])
        if m and m.group(1) in TOOLCHAIN:
            out[spec.split()[0]] = TOOLCHAIN[m.group(1)]
    return out


def glibc_floor(v: Variant) -> str | None:
    """The `__glibc` a stand-in build of an output that declares `stdlib("c")` needs: this machine's (its compiler
    links against it; the recipe's c_stdlib_version is what conda-forge's sysroot would give)."""
    return host_glibc() if "c_stdlib" in toolchain(v).values() else None


def host_glibc() -> str:
    libc, version = platform.libc_ver()
    if libc != "glibc" or not version:
        raise UserError("cannot determine this machine's glibc version for __glibc", INSTALL_FAILED)
    return version


GLIBC_SYMBOL_RE = re.compile(r"\bGLIBC_(\d+(?:\.\d+)+)\b")


def glibc_needed(root: Path) -> tuple[str | None, str | None]:
    """The newest GLIBC_x.y symbol version any ELF file under `root` requires (readelf's version-needs section), and
    the file that requires it."""
    newest: tuple[tuple[int, ...], str, str] | None = None
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and is_elf(p)):
        out = subprocess.run(["readelf", "--version-info", "--wide", str(f)], capture_output=True, text=True).stdout
        needs = out.split("Version needs section", 1)[1] if "Version needs section" in out else ""
        for version in GLIBC_SYMBOL_RE.findall(needs):
            key = tuple(int(x) for x in version.split("."))
            if newest is None or key > newest[0]:
                newest = (key, version, str(f.relative_to(root)))
    return (newest[1], newest[2]) if newest else (None, None)


def check_glibc(pkg: Path, declared: str, work: Path) -> None:
    """The package's ELF files need no glibc newer than the `__glibc` it declares (PACKAGE_INVALID otherwise)."""
    import conda_package_handling.api as cph

    dest = work / "glibc-check"
    shutil.rmtree(dest, ignore_errors=True)
    cph.extract(str(pkg), dest_dir=str(dest))
    try:
        needed, where = glibc_needed(dest)
    finally:
        shutil.rmtree(dest, ignore_errors=True)
    if needed and tuple(map(int, needed.split("."))) > tuple(map(int, declared.split("."))):
        raise UserError(f"{pkg.name}: {where} needs GLIBC_{needed}, the package declares __glibc >={declared}",
                        PACKAGE_INVALID)
PIN_COMPATIBLE_RE = re.compile(r'^\$\{\{\s*pin_compatible\(\s*"([^"]+)"((?:\s*,\s*\w+\s*=\s*"[^"]*")*)\s*\)\s*\}\}$')
PIN_SUBPACKAGE_RE = re.compile(r'^\$\{\{\s*pin_subpackage\(\s*"([^"]+)"')
LOG_TAIL = 25
# Host requirements the UCXX build venv stands in for (the from-source wheels' build environment).
UCXX_BUILD_REQS = {"librmm", "rmm", "cmake", "ninja", "cython", "scikit-build-core", "rapids-build-backend"}
CUDA_DEV_REQS = {"cuda-cudart-dev", "cuda-driver-dev", "cuda-nvml-dev"}


@dataclass
class StandinInputs:
    """What stands in for the requirements of one variant (recorded in the package's about.json extra)."""

    env: dict[str, str] = field(default_factory=dict)
    provided: dict[str, str] = field(default_factory=dict)  # soname -> declared requirement that provides it
    notes: list[str] = field(default_factory=list)
    python: Path | None = None  # the host python that stands in (a venv outside $PREFIX)
    # What makes the stand-ins exist (venvs, a toolkit directory): run only when the package is really built, not
    # when a kept build with the same inputs is taken.
    prepare: list[Callable[[], object]] = field(default_factory=list)


def _pin(version: str, lower: str | None, upper: str | None) -> str:
    """pin_compatible arithmetic for x-style bounds: ('12.9', 'x', 'x') -> '>=12,<13.0a0'."""
    parts = version.split(".")
    out = []
    if lower:
        out.append(">=" + ".".join(parts[: len(lower.split("."))]))
    if upper:
        n = min(len(upper.split(".")), len(parts))
        up = parts[:n]
        up[-1] = str(int(up[-1]) + 1)
        out.append("<" + ".".join(up + ["0"] * max(0, 2 - n)) + "a0")
    return ",".join(out)


def resolve_pin_compatible(spec: str, host: list[str]) -> str:
    """`${{ pin_compatible("cuda-version", lower_bound="x", upper_bound="x") }}` -> `cuda-version >=12,<13.0a0`,
    from the rendered host requirement `cuda-version 12.9.*` (what the solved host environment would hold)."""
    m = PIN_COMPATIBLE_RE.match(spec.strip())
    if not m:
        return spec
    name = m.group(1)
    kwargs = dict(re.findall(r'(\w+)\s*=\s*"([^"]*)"', m.group(2)))
    pinned = [h.split()[1].rstrip(".*") for h in host if h.split()[0] == name and len(h.split()) > 1]
    if not pinned or not re.match(r"^\d+(\.\d+)*$", pinned[0]):
        raise UserError(f"pin_compatible({name!r}) needs `{name} <version>` in the host requirements to stand in for "
                        f"the solved host environment", RECIPE_INVALID)
    return f"{name} {_pin(pinned[0], kwargs.get('lower_bound'), kwargs.get('upper_bound'))}"


def fetch_url_source(st: Stack, url: str, sha256: str, *, cache: Path, mirror_dirs: list[Path],
                     offline: bool = False) -> Path:
    """The recipe's url source, the exact file its sha256 names (rattler-build checks it again): from the url, then
    the source mirrors, then the cache. A source stack.toml pins is looked for under its archive name."""
    known = [s for s in st.source_archives() if s.sha256 == sha256]
    filename = known[0].archive if known else url.rsplit("/", 1)[-1]
    try:
        path, _, _ = fetch_file(filename, (url,), sha256_verifier(sha256, filename), filename, cache=cache,
                                dirs=mirror_dirs, offline=offline)
    except Unreachable as e:
        raise UserError(f"source {url} ({filename}, sha256 {sha256[:12]}…) not found: {e}", SOURCE_UNREACHABLE) \
            from None
    return path


def fetch_git_source(st: Stack, git: str, rev: str, *, cache: Path, mirror_dirs: list[Path],
                     offline: bool = False) -> Path:
    """The archive of a recipe's git source: the stack.toml source whose repository and commit it names, found and
    verified as every build here finds it (fetch_source: the upstream tag archive, then the mirrors, then the cache;
    sha256 of the pinned file or git tree id of its content). The recipe itself stays as a feedstock carries it."""
    pinned = [s for s in st.source_archives() if s.git == git and s.commit == rev]
    if not pinned:
        raise UserError(f"git source {git} rev {rev[:12]}: not a source stack.toml pins (no archive of it to build "
                        f"from without network)", RECIPE_INVALID)
    return fetch_source(pinned[0], cache=cache, dirs=mirror_dirs, offline=offline).path


def source_files(st: Stack, v: Variant, *, cache: Path, mirror_dirs: list[Path], offline: bool) -> dict[str, Path]:
    """A local file for every url and git source of `v`, keyed by its url or git repository."""
    out = {}
    for s in v.sources:
        if "url" in s:
            out[str(s["url"])] = fetch_url_source(st, str(s["url"]), str(s["sha256"]), cache=cache,
                                                  mirror_dirs=mirror_dirs, offline=offline)
        elif "git" in s:
            out[str(s["git"])] = fetch_git_source(st, str(s["git"]), str(s.get("rev")), cache=cache,
                                                  mirror_dirs=mirror_dirs, offline=offline)
    return out


def standin_inputs(st: Stack, v: Variant, work: Path, own: set[str] = frozenset()) -> StandinInputs:
    """The machine's stand-ins for the variant's build/host requirements (those not in `own`: this channel's
    packages, which rattler-build installs for real)."""
    inputs = StandinInputs()
    reqs = {req_name(r) for r in v.requirements("build") + v.requirements("host")} - set(own)
    tools = toolchain(v)
    declared = reqs | set(tools.values())
    for soname, providers in SONAME_PROVIDERS.items():
        hit = [p for p in providers if p in declared]
        if hit:
            inputs.provided[soname] = hit[0]
    # Keep git from reading this repository when autogen/configure ask for a revision from inside our build tree.
    inputs.env["GIT_CEILING_DIRECTORIES"] = str(work)
    want_cuda = str(v.variant.get("cuda_compiler_version", ""))
    stood_in: set[str] = set()
    if reqs & UCXX_BUILD_REQS and v.noarch is None:
        venv_dir = work.parent / "ucxx-build-venv"
        venv = venv_dir / "bin" / "python"
        site = venv_dir / "lib" / f"python{_have_python()}" / "site-packages"  # a venv's layout on Linux
        toolkit = work / "cuda-toolkit"
        inputs.prepare += [lambda: ucxx_build_venv(st, venv_dir),
                           lambda: ucxxbuild.assemble_toolkit(st, site, toolkit)]
        if str(st.cuda_major) != want_cuda.split(".")[0]:
            raise UserError(f"{v.dist}: the CUDA stand-in here is CUDA {st.cuda_major} (stack.toml "
                            f"[ucxx.build].lock), not {want_cuda}", BUILD_FAILED)
        cccl = site / "librmm" / "lib64" / "rapids" / "cmake" / "cccl"
        inputs.env.update(
            PATH=os.pathsep.join([str(venv.parent), str(toolkit / "bin"), os.environ.get("PATH", "")]),
            CMAKE_ARGS=f"-DCUDAToolkit_ROOT={toolkit} -DCCCL_DIR={cccl}", CUDA_HOME=str(toolkit),
            CUDAToolkit_ROOT=str(toolkit))
        stood_in |= reqs & (UCXX_BUILD_REQS | CUDA_DEV_REQS | {"python", "pip", "cuda-version"})
        if "python" in reqs and v.noarch is None:
            _same_python(v, v.variant.get("python"))
            inputs.python = venv
        inputs.notes.append(f"{', '.join(sorted(stood_in))}: the UCXX build venv of the from-source wheels "
                            f"({st.ucxx.lock}: librmm's CCCL CMake package, NVIDIA CUDA {st.cuda_major} wheels as "
                            f"toolkit, this machine's python {_have_python()})")
    elif reqs & CUDA_DEV_REQS:
        fetch_kw = {"cache": default_cache_dir(st), "dirs": [], "offline": False}
        cuda = cudamod.resolve("auto", st, work / "cuda", link_dir=None, fetch_kw=fetch_kw)
        if (cuda.version or "").split(".")[:1] != want_cuda.split(".")[:1]:
            raise UserError(f"{v.dist}: the CUDA stand-in here is {cuda.version}, not {want_cuda}", BUILD_FAILED)
        inputs.env["CPPFLAGS"] = " ".join(cuda.cppflags())
        inputs.env["LDFLAGS"] = " ".join(cuda.ldflags())
        stood_in |= reqs & (CUDA_DEV_REQS | {"cuda-version"})
        inputs.notes.append(f"{', '.join(sorted(stood_in))}: CUDA {cuda.version} headers and link libraries "
                            f"({cuda.note}; {cuda.link_source})")
    if "python" in reqs and v.noarch == "python":
        _same_python(v, v.variant.get("python_min") or v.variant.get("python"))
        inputs.python = work / "host-python" / "bin" / "python"
        inputs.prepare.append(lambda: host_python_venv(v, work / "host-python"))
        stood_in |= {r for r in reqs if r not in stood_in}
        inputs.notes.append(f"{', '.join(sorted(reqs))}: a venv of this machine's python {_have_python()} "
                            f"(PyPI), installing into $PREFIX (PIP_PREFIX)")
    if tools:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        inputs.notes.append(f"{', '.join(sorted(tools))}: the machine's {cc[0] if cc else 'cc'} and its glibc")
    others = sorted(reqs - stood_in - set(tools))
    if others:
        inputs.notes.append(f"{', '.join(others)}: the machine's packages (stack.toml [debian] ucx_build_packages)")
    return inputs


def _have_python() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _same_python(v: Variant, want: str | None) -> None:
    """The stand-in python is this machine's: the variant must be for the same minor version."""
    if want and want.split()[0].rstrip(".*") != _have_python():
        raise UserError(f"{v.dist}: host python {want} stands in as this machine's {_have_python()}: not the same",
                        BUILD_FAILED)


def ucxx_build_venv(st: Stack, venv: Path) -> Path:
    """The from-source wheels' build venv ([ucxx.build].lock, hash-checked), made once per channel build."""
    py = venv / "bin" / "python"
    lock = sha256_file(st.root / st.ucxx.lock)
    marker = venv / ".made-from-lock"
    if marker.is_file() and marker.read_text() == lock and py.is_file():
        return py
    logs = venv.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cache = default_cache_dir(st)
    opts = ucxxbuild.UcxxOptions(ucx_prefix=venv, out=venv)
    py = ucxxbuild.make_build_venv(st, venv, cache.parent / "wheels", opts, logs, dict(os.environ))
    marker.write_text(lock)
    return py


def _pip_spec(spec: str) -> str:
    """A conda requirement as pip reads it: `rapids-build-backend >=0.4.0,<0.5.0` -> `rapids-build-backend>=0.4.0,<0.5.0`."""
    name, _, rest = spec.strip().partition(" ")
    rest = rest.strip()
    if rest and rest[0] not in "<>=!~":
        rest = "==" + rest
    return name + rest.replace(" ", "")


def host_python_venv(v: Variant, venv: Path) -> Path:
    """A venv with the recipe's python host requirements from PyPI, outside $PREFIX (nothing of it is packaged)."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    extra = [_pip_spec(s) for s in v.requirements("host") if s.split()[0] not in ("python", "pip")]
    if extra:
        proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *extra], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"{v.dist}: installing host requirements {extra} from PyPI failed: "
                            f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", BUILD_FAILED)
    return venv / "bin" / "python"


def _script(build: dict, env: dict[str, str], python: Path | None) -> dict:
    """The output's build script with the stand-in environment; where a python stands in, $PYTHON is it and pip
    installs into $PREFIX (a preamble: rattler-build sets PYTHON itself)."""
    script = build.get("script")
    if script is None:
        script = {"file": "build.sh"}
    elif isinstance(script, str):
        key = "file" if re.match(r"^[\w./-]+\.(sh|bat)$", script.strip()) else "content"
        script = {key: script}
    elif not isinstance(script, dict):
        script = {"content": script}
    out = {**script, "env": {**(script.get("env") or {}), **env}}
    if python is not None:
        preamble = f'export PYTHON="{python}" PIP_PREFIX="$PREFIX"\n'
        # The stand-in pip's bytecode would hold the build prefix: with python in $PREFIX rattler-build compiles the
        # .pyc files itself.
        postlude = '\nfind "$PREFIX" -name __pycache__ -type d -prune -exec rm -rf {} +\n'
        if "file" in out:
            out["content"] = preamble + f'source "$RECIPE_DIR/{out.pop("file")}"' + postlude
        elif isinstance(out.get("content"), str):
            out["content"] = preamble + out["content"].replace("${{ PYTHON }}", "$PYTHON") + postlude
        else:
            raise UserError("a python stand-in needs the build script as a file or one inline string", BUILD_FAILED)
    return out


def _standin_output(raw: dict, v: Variant, own: set[str], glibc: str | None, inputs: StandinInputs | None) -> dict:
    """One output (or a single-output recipe) as built here: build requirements empty, host requirements only this
    channel's packages, pins of stood-in packages resolved, the rendered build string, the stand-in's script env
    (`inputs`: the output being built; None: a sibling only rendered for its pin)."""
    out = dict(raw)
    build = dict(raw.get("build") or {})
    build["string"] = v.build_string + STANDIN_SUFFIX
    if inputs is not None:
        build["script"] = _script(build, inputs.env, inputs.python)
        linking = dict(build.get("dynamic_linking") or {})
        linking["missing_dso_allowlist"] = list(linking.get("missing_dso_allowlist") or []) + \
            [f"*{soname}" for soname in sorted(inputs.provided)]
        build["dynamic_linking"] = linking
    out["build"] = build
    req = dict(raw.get("requirements") or {})
    host = v.requirements("host")
    req["build"] = []
    req["host"] = [s for s in req.get("host") or [] if req_name(str(s)) in own]
    for kind in ("run", "run_constraints"):
        if req.get(kind):
            req[kind] = [resolve_pin_compatible(str(s), host) if req_name(str(s)) not in own else s
                         for s in req[kind]]
    # A run requirement without a version gets its variant's value, as rattler-build gives it when the package is in
    # the host environment (`python` -> `python 3.11.* *_cpython`).
    req["run"] = [f"{s} {v.variant[s]}" if isinstance(s, str) and s in v.variant and s in
                  {req_name(h) for h in host} else s for s in req.get("run") or []]
    if glibc and v.subdir != "noarch":
        req["run"] = list(req.get("run") or []) + [f"__glibc >={glibc}"]
    out["requirements"] = req
    return out


def _pinned_siblings(raw_outputs: list[dict], name: str) -> set[str]:
    """The outputs `name` pins with pin_subpackage, transitively (they must be rendered with it)."""
    by_name = {str(o["package"]["name"]): o for o in raw_outputs}
    todo, found = [name], {name}
    while todo:
        o = by_name[todo.pop()]
        for kind in ("build", "host", "run", "run_constraints"):
            for s in (o.get("requirements") or {}).get(kind) or []:
                m = PIN_SUBPACKAGE_RE.match(str(s).strip())
                if m and m.group(1) in by_name and m.group(1) not in found:
                    found.add(m.group(1))
                    todo.append(m.group(1))
    return found


def standin_recipe(v: Variant, inputs: StandinInputs, local_sources: dict[str, Path], glibc: str | None,
                   own: set[str] = frozenset(), siblings: dict[str, Variant] | None = None) -> dict:
    """The recipe as rattler-build builds `v` here (see the module docstring). A multi-output recipe keeps `v`'s
    output and the siblings it pins (`siblings`: their rendered variants, same variant values)."""
    raw = yaml.safe_load(v.recipe_path.read_text())
    out = dict(raw)
    sources = []
    taken = []
    for src in v.sources:
        s = dict(src)
        if "url" in s:
            s["url"] = local_sources[str(s["url"])].resolve().as_uri()
        elif "git" in s:
            # The checkout of that commit, as its verified archive (fetch_git_source): same files, no network.
            local = local_sources[str(s["git"])]
            taken.append({"git": s["git"], "rev": s.get("rev"), "taken_from": local.name})
            for key in ("git", "rev", "tag", "branch", "depth", "lfs", "submodules"):
                s.pop(key, None)
            s = {"url": local.resolve().as_uri(), "sha256": sha256_file(local), **s}
        elif "path" in s:
            s["path"] = str((v.recipe_path.parent / str(s["path"])).resolve())
        sources.append(s)
    out["source"] = sources
    standin_note = {"requirements_not_installed": {"build": v.requirements("build"),
                                                   "host": [h for h in v.requirements("host")
                                                            if req_name(h) not in own]},
                    "stood_in_by": inputs.notes,
                    "git_sources_taken_from_archives": taken,
                    "sonames_left_to_the_system": inputs.provided}
    if "outputs" in raw:
        keep = _pinned_siblings(raw["outputs"], v.name)
        outputs = []
        for o in raw["outputs"]:
            name = str(o["package"]["name"])
            if name not in keep:
                continue
            if name == v.name:
                outputs.append(_standin_output(o, v, own, glibc, inputs))
            else:
                sib = (siblings or {}).get(name)
                if sib is None:
                    raise UserError(f"{v.dist}: pins {name}, which is not built with it here", BUILD_FAILED)
                outputs.append(_standin_output(o, sib, own, glibc_floor(sib), None))
        out["outputs"] = outputs
    else:
        out.update(_standin_output(raw, v, own, glibc, inputs))
        out["source"] = sources
    extra = dict(raw.get("extra") or {})
    extra["standin"] = standin_note
    out["extra"] = extra
    return out


def _without_local_paths(recipe: dict) -> dict:
    """The stand-in recipe without what only says where this checkout keeps things: the local copies of the url
    sources (their sha256 stays) and the stand-in's environment (its paths; `stood_in_by` names what it is)."""
    out = json.loads(json.dumps(recipe))
    for src in out.get("source") or []:
        if "url" in src:
            src["url"] = "<local copy>"
    for part in [out, *(out.get("outputs") or [])]:
        script = (part.get("build") or {}).get("script")
        if isinstance(script, dict):
            script.pop("env", None)
            if isinstance(script.get("content"), str):
                script["content"] = re.sub(r'PYTHON="[^"]*"', 'PYTHON="<stand-in>"', script["content"])
    return out


def build_key(recipe: dict, variant: dict, recipe_dir: Path, local_sources: dict[str, Path],
              host_packages: list[Path], inputs: StandinInputs, work: Path) -> str:
    """Hash of everything a stand-in build is made from: the stand-in recipe and variant, the recipe folder's files
    (scripts, patches), the sources, the packages rattler-build installs into $PREFIX, what stands in and the
    environment it sets, rattler-build's version; not where this checkout keeps them (`work`: a build is reused
    across checkouts of the same inputs)."""
    from rattler_build import rattler_build_version

    h = hashlib.sha256()
    payload = {
        "recipe": _without_local_paths(recipe),
        "variant": variant,
        "env": {k: v.replace(str(work), "<work>") for k, v in inputs.env.items() if k != "PATH"},
        "rattler_build": rattler_build_version(),
        "files": {str(p.relative_to(recipe_dir)): sha256_file(p) for p in sorted(recipe_dir.rglob("*"))
                  if p.is_file()},
        "sources": sorted(sha256_file(p) for p in local_sources.values()),
        "host_packages": sorted(sha256_file(p) for p in host_packages),
        "standin": inputs.notes,
        "machine": [platform.machine(), _have_python()],
    }
    h.update(json.dumps(payload, sort_keys=True).encode())
    return h.hexdigest()[:24]


def build_variant(st: Stack, v: Variant, *, work: Path, output_dir: Path, mirror_dirs: list[Path],
                  log_dir: Path, channels: list[str], own: dict[str, Path] | None = None,
                  siblings: dict[str, Variant] | None = None, cache: Path | None = None, offline: bool = False,
                  build_cache: Path | None = None) -> Path:
    """Build one output with real rattler-build on its stand-in recipe; returns the .conda file.

    Url and git sources come from `cache` (default: the repository's download cache), their upstream (unless
    offline), then `mirror_dirs` (source_files). `own`: the packages of this channel built so far (name -> .conda),
    which `channels` serve: a host requirement on one of them stays, and rattler-build installs it. `siblings`: the
    other outputs of a multi-output recipe rendered with the same variant values. A build with the same inputs
    (build_key) is taken from `build_cache` (default: <cache>/../conda-builds)."""
    from rattler_build import Stage0Recipe, VariantConfig
    from rattler_build._rattler_build import RattlerBuildError

    own = dict(own or {})
    names = set(own) | {v.name} | set(siblings or {})
    vdir = work / v.dist
    shutil.rmtree(vdir, ignore_errors=True)
    recipe_copy = vdir / "recipe"
    shutil.copytree(v.recipe_path.parent, recipe_copy)
    cache = cache or default_cache_dir(st)
    local = source_files(st, v, cache=cache, mirror_dirs=mirror_dirs, offline=offline)
    inputs = standin_inputs(st, v, vdir, names)
    glibc = glibc_floor(v)
    recipe = standin_recipe(v, inputs, local, glibc, names, siblings)
    standin_path = recipe_copy / "standin-recipe.yaml"
    # rattler-build stores the recipe it builds as info/recipe/recipe.yaml: keep the original beside it.
    (recipe_copy / "recipe.yaml").rename(recipe_copy / "original-recipe.yaml")
    text = ("# The stand-in recipe ucx-dask-gpu built (tools/conda_standin/standin.py) for the recipe in "
            "original-recipe.yaml.\n" + yaml.safe_dump(recipe, sort_keys=False, width=120))
    standin_path.write_text(text)
    host_names = {req_name(h) for h in v.requirements("host")}
    key = build_key(recipe, v.variant, v.recipe_path.parent, local, [p for n, p in own.items() if n in host_names],
                    inputs, work)
    # A `path:` source is a working tree (the metapackage's: this repository), not an archive with a sha256: built
    # every time (seconds), never kept.
    keep = not any("path" in s for s in v.sources)
    kept = (build_cache or cache.parent / "conda-builds") / key
    done = sorted(kept.glob("*.conda")) if keep and kept.is_dir() else []
    if len(done) == 1:
        (output_dir / v.subdir).mkdir(parents=True, exist_ok=True)
        return Path(shutil.copy2(done[0], output_dir / v.subdir / done[0].name))
    for step in inputs.prepare:
        step()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{v.dist}.log"
    try:
        # target_platform comes from the render config (the build platform): a noarch output's variant says
        # `noarch`, under which the recipe's `skip: not linux` would drop it.
        config = VariantConfig({k: [val] for k, val in v.variant.items() if k != "target_platform"})
        rendered = Stage0Recipe.from_file(standin_path).render(config, v.render_config())
        mine = [r for r in rendered if r.recipe.package.name == v.name]
        progress = LogToFile(log)
        try:
            result = mine[0].run_build(output_dir=output_dir, channels=channels, no_build_id=True,
                                       progress_callback=progress)
        finally:
            progress.file.close()
    except RattlerBuildError as e:
        raise UserError(f"{v.dist}: rattler-build: {_reason(str(e), log)} (log: {log})",
                        PACKAGE_INVALID if re.search(r"linking|package content", str(e), re.I) else BUILD_FAILED) \
            from None
    pkg = Path(result.packages[0])
    if glibc:
        check_glibc(pkg, glibc, vdir)
    if keep:
        with atomic_path(kept, replace_dir=True) as tmp:  # a cache entry of ours
            tmp.mkdir(parents=True)
            shutil.copy2(pkg, tmp / pkg.name)
    return pkg


class LogToFile:
    """rattler-build's progress callback: its build steps and log lines (the build script's output) into a file."""

    def __init__(self, path: Path):
        self.file = open(path, "w")

    def on_download_start(self, event) -> None:
        pass

    def on_download_progress(self, event) -> None:
        pass

    def on_download_complete(self, event) -> None:
        pass

    def on_build_step(self, event) -> None:
        self.file.write(f"## {event.step_name}: {event.message}\n")
        self.file.flush()

    def on_log(self, event) -> None:
        self.file.write(f"{event.message}\n" if event.level == "info" else f"[{event.level}] {event.message}\n")
        self.file.flush()


def _reason(message: str, log: Path) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL:] if log.is_file() else []
    errors = [ln.strip() for ln in tail if re.search(r"error|overlink", ln, re.I)]
    return (lines[0] if lines else "failed") + (f": {errors[-1]}" if errors else "")
