"""Build the UCXX wheels (libucxx, ucxx, distributed-ucxx) from the pinned tag against a UCX prefix of ours, offline
(ucx-src-build/README.md, "UCXX wheels", gives each step). A finished build is kept by the hash of every input and
reused; each step runs in a network namespace with only loopback, so a download attempt fails and names its URL;
where it ran does not reach the bytes (repro.py). At run time libucxx.so (RUNPATH $ORIGIN only) needs our UCX's lib/
on the loader path: ld.so.conf in the image, `install-ucxx` (below) in a venv.

Standard library only, like the rest of ucxbuild: it runs before any venv of ours exists.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BUILD_FAILED, MISSING_CAPABILITY, OUTPUT_REFUSED, UCX_NOT_FOUND, UserError
from ..fsutil import ELF_MAGIC, atomic_path, atomic_write_text, sha256_file
from ..stack import Stack
from ..ucx.install import (BUILD_INFO, INSTALLED_UCXX_BUILD_INFO, PRELOAD_PTH, UCXX_BUILD_INFO, read_build_info,
                           read_ucxx_build_info)
from . import repro
from .build import _fmt_s, _print_tail, apply_patches, build_work_dir, fresh_logs, patches_for, run_logged, unpack_tree
from .fetch import default_cache_dir, fetch_sources, say


@dataclass
class UcxxOptions:
    ucx_prefix: Path
    out: Path
    work_dir: Path | None = None
    cache: Path | None = None  # verified source archives (default: the UCX build's)
    build_cache: Path | None = None  # finished builds by input hash (default: <cache>/../ucxx-builds)
    sources: list[Path] = field(default_factory=list)
    find_links: list[Path] = field(default_factory=list)  # wheelhouses for the build venv (offline)
    offline: bool = False
    jobs: int = 0
    patches_root: Path | None = None  # default: ucx-src-build/patches (UCXX's own under ucxx-<version>/)
    stamp: Path | None = None  # gets the input key, rewritten only when it changes (make's prerequisite)


# --- inputs ----------------------------------------------------------------------------------------------------

def python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def ucx_identity(ucx_info: dict) -> dict:
    """What of a UCX build the binding's wheels depend on: its source, patches and configure flags, not its prefix.
    Wheels built against one prefix serve every prefix with the same identity (e.g. the image's /opt/ucx)."""
    return {
        "version": ucx_info.get("ucx_version"),
        "content_tree": (ucx_info.get("source") or {}).get("content_tree"),
        "patches": ucx_info.get("patches", []),
        "stack_flags": (ucx_info.get("configure") or {}).get("stack_flags", []),
    }


def ucxx_patches(stack: Stack, root: Path | None = None) -> list[Path]:
    """The patches carried for the pinned UCXX: <root>/ucxx-<version>/*.patch, in the order they apply."""
    return patches_for(f"ucxx-{stack.ucxx.source.version}", root or stack.root / "ucx-src-build" / "patches")


def ucx_headers(ucx_info: dict) -> dict[str, str]:
    """sha256 of the UCX prefix's headers and CMake package files (its build info's file list): what the wheels
    compile and configure against."""
    return {path: digest for path, digest in sorted((ucx_info.get("files") or {}).items())
            if path.startswith(("include/", "lib/cmake/"))}


def input_key(stack: Stack, ucx_info: dict, patches: list[Path] | None = None) -> str:
    """Hash of everything the wheels' bytes depend on: two builds with the same key give the same bytes. Not where the
    build ran (mapped out of the wheels; `build_paths_found` proves it per build), so a cache shared by checkouts at
    different paths may hand one's build to another."""
    u = stack.ucxx
    return repro.key_of({
        "sources": [[a.name, a.content_tree] for a in (u.source, u.rapids_cmake, u.cpm)],
        "patches": [[p.name, sha256_file(p)] for p in (patches or [])],
        "build_lock": sha256_file(stack.root / u.lock),
        "matrix_entry": u.matrix_entry,
        "packages": [[p.name, p.path, list(p.cmake_args)] for p in u.packages],
        "ucx": ucx_identity(ucx_info),
        "ucx_headers": ucx_headers(ucx_info),
        "python": python_tag(),
        "machine": os.uname().machine,
        "tools": repro.tool_versions("cc", "c++", "ld"),
        "caller_flags": repro.caller_flags(),
        "source_date_epoch": stack.source_date_epoch,
        "build_root": stack.build_root,
        "builder": repro.builder_code(),
    })


# --- network isolation -------------------------------------------------------------------------------------------

def _only_loopback() -> bool:
    try:
        return {p.name for p in Path("/sys/class/net").iterdir()} <= {"lo"}
    except OSError:
        return False


def isolation_prefix() -> list[str]:
    """The command prefix that runs a build step in a new network namespace with only (down) loopback.

    Where no namespace can be made (an unprivileged container), a machine that already has only loopback (e.g.
    `docker build --network none`) is isolated enough; anything else is refused."""
    candidates = [["unshare", "--net", "--"]]
    if os.geteuid() != 0:
        candidates.insert(0, ["unshare", "--net", "--map-root-user", "--"])
    why = "unshare not found"
    for prefix in candidates:
        try:
            proc = subprocess.run(prefix + ["true"], capture_output=True, text=True)
        except OSError:
            break
        if proc.returncode == 0:
            return prefix
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    if _only_loopback():
        return []
    raise UserError(f"cannot build UCXX without network access: no network namespace ({why}) and this machine has "
                    f"interfaces besides loopback; run as root or where user namespaces are allowed",
                    MISSING_CAPABILITY)


# --- the build venv and CUDA toolkit ------------------------------------------------------------------------------

def make_build_venv(stack: Stack, venv: Path, wheels: Path, opts: UcxxOptions, logs: Path, env: dict) -> Path:
    """A venv with exactly the build lock, installed without an index (pip verifies every hash)."""
    lock = stack.root / stack.ucxx.lock
    if not lock.is_file():
        raise UserError(f"{stack.ucxx.lock}: missing (make lock)", UCX_NOT_FOUND)
    shutil.rmtree(venv, ignore_errors=True)
    py = venv / "bin" / "python"
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    if not opts.offline:
        steps.append([str(py), "-m", "pip", "download", "-q", "--disable-pip-version-check", "--require-hashes",
                      "--no-deps", "-r", str(lock), "-d", str(wheels)])
    links = [a for d in [wheels, *opts.find_links] for a in ("--find-links", str(d))]
    steps.append([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index", *links,
                  "--require-hashes", "--no-deps", "-r", str(lock)])
    t0 = time.monotonic()
    for cmd in steps:
        rc, tail = run_logged(cmd, venv.parent, logs / "build-venv.log", env, "build venv")
        if rc != 0:
            _print_tail(f"`{shlex.join(cmd[:4])} ...` failed; last lines:", tail)
            where = "" if opts.offline else "PyPI or "
            raise UserError(f"UCXX build environment: {cmd[3]} of {stack.ucxx.lock} failed (are its wheels in "
                            f"{where}--find-links?); log: {logs / 'build-venv.log'}", BUILD_FAILED)
    say(f"build venv from {stack.ucxx.lock} in {_fmt_s(time.monotonic() - t0)}")
    return py


def site_packages(py: Path) -> Path:
    out = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return Path(out)


def assemble_toolkit(stack: Stack, site: Path, dest: Path) -> Path:
    """CUDAToolkit_ROOT from the NVIDIA wheels: bin/ (nvcc), include/ (with CCCL), nvvm/, lib64/ (+ libcudart.so)."""
    cu = site / "nvidia" / f"cu{stack.cuda_major}"
    missing = [p for p in ("bin/nvcc", "include/cuda_runtime.h", "include/cccl") if not (cu / p).exists()]
    if missing:
        raise UserError(f"the UCXX build lock's NVIDIA wheels lack {', '.join(missing)} under {cu}",
                        MISSING_CAPABILITY)
    shutil.rmtree(dest, ignore_errors=True)
    (dest / "lib64").mkdir(parents=True)
    for d in ("bin", "include", "nvvm"):
        if (cu / d).exists():
            (dest / d).symlink_to(cu / d)
    for lib in sorted((cu / "lib").iterdir()):
        (dest / "lib64" / lib.name).symlink_to(lib)
    cudart = sorted((dest / "lib64").glob("libcudart.so.*"))
    if cudart:
        (dest / "lib64" / "libcudart.so").symlink_to(cudart[0].name)
    return dest


# --- wheels ------------------------------------------------------------------------------------------------------

def wheel_metadata(whl: Path) -> dict:
    with zipfile.ZipFile(whl) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    meta: dict = {"requires": []}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(": ")
        if key == "Name":
            meta["name"] = value
        elif key == "Version":
            meta["version"] = value
        elif key == "Requires-Dist" and "extra ==" not in value:
            meta["requires"].append(value)
    return meta


def wheel_elf_files(whl: Path) -> dict[str, str]:
    """path in the wheel -> sha256, for its shared libraries (doctor compares installed copies against these)."""
    out = {}
    with zipfile.ZipFile(whl) as z:
        for n in sorted(z.namelist()):
            if ".so" in Path(n).name:
                data = z.read(n)
                if data[:4] == ELF_MAGIC:
                    out[n] = hashlib.sha256(data).hexdigest()
    return out


def _needed(lib: Path) -> list[str]:
    proc = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True)
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", proc.stdout)


def check_wheels(stack: Stack, built: dict[str, Path]) -> list[dict]:
    major = stack.cuda_major
    records = []
    for pkg in stack.ucxx.packages:
        whl = built[pkg.name]
        meta = wheel_metadata(whl)
        want = f"{pkg.name}-cu{major}"
        problems = []
        if meta.get("name") != want:
            problems.append(f"named {meta.get('name')!r}, expected {want!r}")
        if any(re.match(r"libucx(-cu\d+)?\b", r) for r in meta["requires"]):
            problems.append("depends on the libucx wheel (its libucp would shadow ours)")
        if problems:
            raise UserError(f"{whl.name}: {'; '.join(problems)}", BUILD_FAILED)
        records.append({"package": pkg.name, "name": meta["name"], "version": meta["version"], "wheel": whl.name,
                        "sha256": sha256_file(whl), "requires": meta["requires"], "cmake_args": list(pkg.cmake_args),
                        "shared_libraries": wheel_elf_files(whl)})
    return records


def _check_links_ucp(site: Path) -> None:
    lib = site / "libucxx" / "lib64" / "libucxx.so"
    if not lib.is_file():
        raise UserError("the libucxx wheel has no libucxx/lib64/libucxx.so", BUILD_FAILED)
    if "libucp.so.0" not in _needed(lib):
        raise UserError("libucxx.so does not link libucp.so.0", BUILD_FAILED)


# --- the whole build -------------------------------------------------------------------------------------------

def build_ucxx(stack: Stack, opts: UcxxOptions) -> dict:
    if opts.out.exists() and not replaceable_output(opts.out):  # before anything: --out is replaced whole at the end
        raise UserError(f"--out {opts.out}: not empty and not UCXX wheels this command wrote (only {UCXX_BUILD_INFO} "
                        "and the wheels it lists); give a new or empty directory", OUTPUT_REFUSED)
    with repro.fixed_umask():
        info = _build_or_reuse(stack, opts)
    repro.write_stamp(opts.stamp, info["input_key"])
    return info


def _build_or_reuse(stack: Stack, opts: UcxxOptions) -> dict:
    prefix = opts.ucx_prefix.resolve()
    ucx_info = read_build_info(prefix)
    if ucx_info is None:
        raise UserError(f"--ucx-prefix {prefix}: no {BUILD_INFO} (build UCX first: ucx-src-build/build.sh build)",
                        UCX_NOT_FOUND)
    if ucx_info.get("ucx_version") != stack.ucx.version:
        raise UserError(f"--ucx-prefix {prefix} holds UCX {ucx_info.get('ucx_version')}, stack.toml pins "
                        f"{stack.ucx.version}: build that UCX first", UCX_NOT_FOUND)
    cache = (opts.cache or default_cache_dir(stack)).resolve()
    build_cache = (opts.build_cache or cache.parent / "ucxx-builds").resolve()
    patches = ucxx_patches(stack, opts.patches_root)
    key = input_key(stack, ucx_info, patches)
    out = opts.out.resolve()
    cached = build_cache / key
    if _complete(cached):
        _install_output(cached, out)
        say(f"UCXX {stack.ucxx.source.version} wheels: cached build {key} (same inputs) -> {out}")
        return read_ucxx_build_info(out)

    with build_work_dir(opts.work_dir, "ucxx-build-", say) as work:
        info = _build(stack, opts, work, prefix, ucx_info, cache, key, patches)
        with atomic_path(cached, replace_dir=True) as tmp:  # the build cache's own entry (incomplete, or none)
            shutil.copytree(work / "dist", tmp)
        _install_output(cached, out)
    say(f"UCXX wheels in {out}: {', '.join(p['wheel'] for p in info['packages'])}")
    return info


def _complete(d: Path) -> bool:
    info = read_ucxx_build_info(d)
    try:
        return info is not None and all(sha256_file(d / p["wheel"]) == p["sha256"] for p in info["packages"])
    except (OSError, ValueError, KeyError):
        return False


def replaceable_output(out: Path) -> bool:
    """An empty directory, or one holding only what _install_output puts there (the build info and its wheels)."""
    if not out.is_dir():
        return False
    names = {p.name for p in out.iterdir()}
    if not names:
        return True
    info = read_ucxx_build_info(out)
    try:
        return info is not None and names <= {UCXX_BUILD_INFO, *(p["wheel"] for p in info["packages"])}
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _install_output(src: Path, out: Path) -> None:
    with atomic_path(out, replace_dir=True) as tmp:  # new, empty, or our own earlier output (replaceable_output)
        shutil.copytree(src, tmp)


def _build(stack: Stack, opts: UcxxOptions, work: Path, prefix: Path, ucx_info: dict, cache: Path, key: str,
           patches: list[Path]) -> dict:
    t_start = time.monotonic()
    u = stack.ucxx
    logs = fresh_logs(work)
    say(f"UCXX {u.source.version}: against UCX {ucx_info['ucx_version']} at {prefix}, work dir {work}")
    fetched, src, rapids_cmake, cpm_file, applied = _sources(stack, opts, work, cache, patches, logs)
    paths, env = _path_map_and_env(stack, work, prefix)
    py = make_build_venv(stack, work / "venv", cache.parent / "wheels", opts, logs, env)
    site = site_packages(py)
    toolkit = assemble_toolkit(stack, site, work / "cuda-toolkit")
    common = _cmake_args(rapids_cmake, cpm_file, site, toolkit, prefix)
    env.update(PATH=os.pathsep.join([str(py.parent), str(toolkit / "bin"), env.get("PATH", "")]),
               CUDAToolkit_ROOT=str(toolkit), CUDA_HOME=str(toolkit), RAPIDS_MATRIX_ENTRY=u.matrix_entry,
               CMAKE_BUILD_PARALLEL_LEVEL=str(opts.jobs or (os.cpu_count() or 1) + 1))
    isolate = isolation_prefix()
    say("network: " + (f"each build step runs under `{' '.join(isolate[:-1])}` (loopback only)" if isolate
                       else "this machine has only loopback"))
    dist = work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir()
    built: dict[str, Path] = {}
    for i, pkg in enumerate(u.packages, 1):
        t0 = time.monotonic()
        built[pkg.name] = _build_wheel(pkg, src, work, dist, logs, env, common, isolate, py, site)
        say(f"[{i}/{len(u.packages)}] {built[pkg.name].name} in {_fmt_s(time.monotonic() - t0)}")
    packages = check_wheels(stack, built)
    leaks = {k: v for whl in built.values() for k, v in repro.paths_in(whl, paths.dirs).items()}
    for where, dirs in leaks.items():
        say(f"WARNING: {where} still names {', '.join(dirs)}: this wheel depends on where it was built")
    info = {
        "schema": 1,
        "input_key": key,
        "ucxx_version": u.source.version,
        "sources": {name: f.record() for name, f in fetched.items()},
        "patches": applied,
        "matrix_entry": u.matrix_entry,
        # The options with the build's directories as their stand-ins, as the compilers saw them.
        "cmake_args": [paths.text(a) for a in common],
        "build_lock": {"path": str(u.lock), "sha256": sha256_file(stack.root / u.lock)},
        "ucx": ucx_identity(ucx_info),
        "python": python_tag(),
        "compiler": repro.tool_versions("cc")["cc"],
        "network_isolation": " ".join(isolate[:-1]) or "only loopback",
        "packages": packages,
        "build_paths_found": leaks,
    }
    atomic_write_text(dist / UCXX_BUILD_INFO, json.dumps(info, indent=2, sort_keys=True) + "\n")
    say(f"UCXX wheels built in {_fmt_s(time.monotonic() - t_start)}")
    return info


def _path_map_and_env(stack: Stack, work: Path, prefix: Path) -> tuple[repro.PathMap, dict[str, str]]:
    """The build's directories and their stand-ins, and the environment of every build step."""
    # The work directory (sources, build venv with librmm's headers), the UCX prefix and this checkout, as the
    # compilers and the recorded options show them.
    paths = repro.PathMap.of({work: repro.stand_in(stack, "ucxx"), prefix: stack.image.ucx_prefix,
                              stack.root: repro.stand_in(stack, "checkout")})
    env = paths.flag_env(repro.build_env(stack))
    env.update(PIP_NO_INPUT="1", PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1",
               # rapids-build-backend records `git rev-parse HEAD`: not this repository's commit.
               GIT_CEILING_DIRECTORIES=str(work / "src"))
    for var in ("PIP_CONSTRAINT", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS",
                "SKBUILD_CMAKE_ARGS", "CMAKE_ARGS", "LD_LIBRARY_PATH"):
        env.pop(var, None)
    return paths, env


def _cmake_args(rapids_cmake: Path, cpm_file: Path, site: Path, toolkit: Path, prefix: Path) -> list[str]:
    """The CMake options every package's build gets: everything it would fetch is here already."""
    return [
        f"-DFETCHCONTENT_SOURCE_DIR_RAPIDS-CMAKE={rapids_cmake}",
        "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",
        f"-DCPM_DOWNLOAD_LOCATION={cpm_file}",
        f"-DCCCL_DIR={site / 'librmm' / 'lib64' / 'rapids' / 'cmake' / 'cccl'}",
        f"-DCUDAToolkit_ROOT={toolkit}",
        f"-Ducx_DIR={prefix / 'lib' / 'cmake' / 'ucx'}",
        f"-Ducxx_DIR={site / 'libucxx' / 'lib64' / 'cmake' / 'ucxx'}",
        *repro.CMAKE_ARGS,
    ]


def _sources(stack: Stack, opts: UcxxOptions, work: Path, cache: Path, patches: list[Path], logs: Path):
    """UCXX, rapids-cmake and CPM fetched and unpacked under <work>/src, UCXX patched: (the fetched sources by name,
    UCXX's tree, rapids-cmake's tree, CPM.cmake, the patches applied)."""
    u = stack.ucxx
    fetch_kw = {"cache": cache, "dirs": [p.resolve() for p in opts.sources], "offline": opts.offline}
    fetched = {f.source.name: f for f in fetch_sources((u.source, u.rapids_cmake, u.cpm), **fetch_kw)}
    trees = {name: unpack_tree(f.path, work / "src" / name) for name, f in fetched.items()}
    src = trees[u.source.name]
    if patches and shutil.which("patch") is None:
        raise UserError("`patch` is needed to apply the UCXX patches (apt-get install patch)", MISSING_CAPABILITY)
    applied = apply_patches(src, patches, logs / "patch.log") if patches else []
    cpm_file = trees[u.cpm.name] / "cmake" / "CPM.cmake"
    if not cpm_file.is_file():
        raise UserError(f"{u.cpm.archive}: no cmake/CPM.cmake", BUILD_FAILED)
    return fetched, src, trees[u.rapids_cmake.name], cpm_file, applied


def _build_wheel(pkg, src: Path, work: Path, dist: Path, logs: Path, env: dict[str, str], common: list[str],
                 isolate: list[str], py: Path, site: Path) -> Path:
    """One package's wheel built (without the network) and copied to `dist`; libucxx's is also installed into the
    build venv. The copy in `dist`."""
    pkg_dir = src / pkg.path
    shutil.rmtree(pkg_dir / "build", ignore_errors=True)
    out = work / "wheels" / pkg.name
    shutil.rmtree(out, ignore_errors=True)
    env["SKBUILD_CMAKE_ARGS"] = ";".join([*common, *pkg.cmake_args])
    cmd = isolate + [str(py), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-index", "--no-deps",
                     "-w", str(out), str(pkg_dir)]
    log = logs / f"{pkg.name}.log"
    rc, tail = run_logged(cmd, work, log, env, pkg.name)
    wheels = sorted(out.glob("*.whl"))
    if rc != 0 or len(wheels) != 1:
        _print_tail(f"building the {pkg.name} wheel failed; last lines of {log}:", tail)
        fetches = [ln.strip() for ln in log.read_text(errors="replace").splitlines()
                   if re.search(r"(https?://\S+)", ln) and re.search(r"(?i)download|fetch|resolv|connect", ln)]
        why = f"; it tried the network: {fetches[0][:200]}" if fetches else ""
        raise UserError(f"UCXX: the {pkg.name} wheel did not build (exit {rc}){why}; log: {log}", BUILD_FAILED)
    built = Path(shutil.copy2(wheels[0], dist / wheels[0].name))
    if pkg.name == "libucxx":  # ucxx's CMake finds libucxx in the build venv
        rc, tail = run_logged([str(py), "-m", "pip", "install", "-q", "--no-index", "--no-deps", str(built)],
                              work, log, env, pkg.name)
        if rc != 0:
            _print_tail(f"installing {wheels[0].name} into the build venv failed:", tail)
            raise UserError(f"UCXX: installing the libucxx wheel failed; log: {log}", BUILD_FAILED)
        _check_links_ucp(site)
    return built


# --- a venv on our UCX --------------------------------------------------------------------------------------------

def install_ucxx(python: Path, wheels_dir: Path, ucx_prefix: Path) -> Path:
    """Put a venv on our stack: our UCXX wheels --no-deps (their requirements come from the lock), their build info
    under <venv>/share/ucx-dask-gpu/, and a .pth line that loads our UCX's libucp.so.0 at interpreter start-up (the
    way the libucx wheel's loader loads its bundled copy), so libucxx.so's dependency is satisfied by OUR UCX without
    LD_LIBRARY_PATH. A prefix that has gone away fails loudly at every start, never silently."""
    lib = ucx_prefix.resolve() / "lib" / "libucp.so.0"
    if not lib.exists():
        raise UserError(f"--ucx-prefix {ucx_prefix}: no lib/libucp.so.0", UCX_NOT_FOUND)
    info = read_ucxx_build_info(wheels_dir)
    if info is None:
        raise UserError(f"{wheels_dir}: no {UCXX_BUILD_INFO} (build the wheels first: `build.sh ucxx`)",
                        UCX_NOT_FOUND)
    wheels = [wheels_dir / p["wheel"] for p in info["packages"]]
    for w, p in zip(wheels, info["packages"]):
        if not w.is_file() or sha256_file(w) != p["sha256"]:
            raise UserError(f"{w}: missing or not the wheel its build info records", BUILD_FAILED)
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index",
                           "--no-deps", "--force-reinstall", *map(str, wheels)], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise UserError(f"installing the UCXX wheels into {python} failed: {tail}", BUILD_FAILED)
    env_prefix = Path(subprocess.run([str(python), "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                     text=True, check=True).stdout.strip())
    dest = env_prefix / INSTALLED_UCXX_BUILD_INFO
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(wheels_dir / UCXX_BUILD_INFO, dest)
    pth = site_packages(python) / PRELOAD_PTH
    atomic_write_text(pth, f"import ctypes; ctypes.CDLL({str(lib)!r}, ctypes.RTLD_LOCAL)\n")
    return pth
