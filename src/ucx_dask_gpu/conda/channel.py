"""The local channel: render + lint -> build -> pack -> index -> install-test, all-or-nothing.

`build_channel` fetches (or takes) the verified sources, renders and lints every recipe variant against stack.toml,
builds the ucx variant this machine can build (the CUDA major of stack.toml's header wheels) and the noarch
metapackage under conda-build's contract, packs `.conda` archives, indexes the channel with py-rattler
(`linux-64/`, `noarch/`, a repodata.json in each) and installs `ucx` from it into a fresh prefix before the channel
directory appears: it is assembled in a temporary directory next to the destination and renamed over it only when
every step passed, so a failure leaves the previous channel (or nothing) in place.

`install_test` is that last step on its own: py-rattler solves `ucx` against the channel with the virtual packages
declared explicitly (`__glibc`, `__cuda`, `__linux`, `__unix`), installs it into a fresh prefix (prefix replacement
in text and binary files), runs the recipe's test commands from the package's info/test/run_test.sh without
LD_LIBRARY_PATH, and checks that no file still holds the build placeholder and every library resolves. The
metapackage cannot be installed here (python, dask, ucxx… live on conda-forge): its dependencies are parsed as
MatchSpecs, its `ucx` spec must select this channel's ucx, and its recipe tests run against its packed
site-packages with the CLI entry point written as conda writes it.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BUILD_FAILED, INSTALL_FAILED, RECIPE_INVALID, SOURCE_UNREACHABLE, UserError
from ..fsutil import atomic_path
from ..stack import Stack
from . import build as buildmod
from .lint import lint_all
from .package import pack
from .render import PLATFORM, Rendered
from .settings import CBC_PATH

SUBDIRS = (PLATFORM, "noarch")
DRIVER_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1")


@dataclass
class ChannelResult:
    channel: Path
    packages: list[Path] = field(default_factory=list)
    rendered_only: list[str] = field(default_factory=list)
    ucx_version: str = ""
    install: dict = field(default_factory=dict)


def say(msg: str) -> None:
    print(f"[conda] {msg}", flush=True)


# --- sources ------------------------------------------------------------------------------------------------------

def fetch_sources(st: Stack, dest: Path) -> None:
    """`ucx-src-build/build.sh fetch --dest DEST`: the verified UCX archive + CUDA inputs."""
    script = st.root / "ucx-src-build" / "build.sh"
    if not script.is_file():
        raise UserError(f"{script} missing (the UCX build script the recipe uses)", BUILD_FAILED)
    say(f"fetching sources with {script.relative_to(st.root)} fetch --dest {dest}")
    proc = subprocess.run([str(script), "fetch", "--dest", str(dest)], stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise UserError(f"ucx-src-build fetch failed (exit {proc.returncode})", proc.returncode or SOURCE_UNREACHABLE)


# --- index ----------------------------------------------------------------------------------------------------------

def index_channel(channel: Path) -> None:
    """py-rattler's indexer: one repodata.json per subdir (no .zst, no shards: the plain layout conda reads)."""
    from rattler.index import index_fs

    for sub in SUBDIRS:
        (channel / sub).mkdir(parents=True, exist_ok=True)
    asyncio.run(index_fs(channel, write_zst=False, write_shards=False, force=True))
    shutil.rmtree(channel / ".tmp", ignore_errors=True)  # the indexer's scratch directory
    for sub in SUBDIRS:
        if not (channel / sub / "repodata.json").is_file():
            raise UserError(f"indexing {channel} wrote no {sub}/repodata.json", INSTALL_FAILED)


# --- install test ---------------------------------------------------------------------------------------------------

def host_glibc() -> str:
    libc, version = _platform.libc_ver()
    if libc != "glibc" or not version:
        raise UserError("cannot determine this machine's glibc version for __glibc", INSTALL_FAILED)
    return version


def virtual_packages(glibc: str, cuda: str | None):
    from rattler import BuildString, GenericVirtualPackage, PackageName, Version

    def vp(name: str, version: str):
        return GenericVirtualPackage(PackageName(name), Version(version), BuildString("0"))

    out = [vp("__glibc", glibc), vp("__linux", _platform.release().split("-")[0]), vp("__unix", "0")]
    if cuda:
        out.append(vp("__cuda", cuda))
    return out


def _repodata(channel: Path):
    from rattler import Channel, SparseRepoData

    ch = Channel(channel.resolve().as_uri())
    return [SparseRepoData(ch, sub, channel / sub / "repodata.json") for sub in SUBDIRS]


def solve(channel: Path, specs: list[str], vps) -> list:
    from rattler import solve_with_sparse_repodata

    try:
        return asyncio.run(solve_with_sparse_repodata(specs, _repodata(channel), virtual_packages=vps))
    except Exception as e:  # rattler.exceptions.SolverError and friends
        first = str(e).strip().splitlines()
        raise UserError(f"cannot solve {' '.join(specs)} from {channel}: {' '.join(first[:8])}", INSTALL_FAILED) \
            from None


def _placeholders(pkg_file: Path, extract_to: Path) -> tuple[set[str], Path]:
    import conda_package_handling.api as cph

    cph.extract(str(pkg_file), dest_dir=str(extract_to), components="info")
    paths = json.loads((extract_to / "info" / "paths.json").read_text())["paths"]
    return {p["prefix_placeholder"] for p in paths if p.get("prefix_placeholder")}, extract_to / "info"


def _run_test_script(script: Path, env: dict, cwd: Path, what: str, skip_prefixes: tuple[str, ...] = ()) -> str:
    lines = script.read_text().splitlines()
    kept = [ln for ln in lines if not ln.strip().startswith(skip_prefixes)] if skip_prefixes else lines
    runnable = cwd / "run_test.sh"
    runnable.write_text("\n".join(kept) + "\n")
    proc = subprocess.run(["bash", str(runnable)], cwd=cwd, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("+ ")]
        print(out[-4000:], file=sys.stderr)
        raise UserError(f"{what}: recipe test failed (exit {proc.returncode}) at `{failed[-1][2:] if failed else '?'}`",
                        INSTALL_FAILED)
    return out


def check_relocated(prefix: Path, placeholders: set[str]) -> dict:
    """No installed file may still hold the build placeholder; every ELF's libraries must resolve (ldd, no
    LD_LIBRARY_PATH), except the GPU driver's, which a GPU-less machine does not have."""
    leaked = []
    for p in prefix.rglob("*"):
        if p.is_symlink() or not p.is_file() or "conda-meta" in p.relative_to(prefix).parts:
            continue
        data = p.read_bytes()
        if any(ph.encode() in data for ph in placeholders):
            leaked.append(str(p.relative_to(prefix)))
    if leaked:
        raise UserError(f"{len(leaked)} installed file(s) still contain the build prefix, e.g. {leaked[0]}",
                        INSTALL_FAILED)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    own = {p.name for p in prefix.rglob("*.so*") if "conda-meta" not in p.parts}
    unresolved, checked = [], 0
    for p in sorted(prefix.rglob("*")):
        if not buildmod.is_elf(p):
            continue
        checked += 1
        out = subprocess.run(["ldd", str(p)], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            soname = line.split()[0] if line.split() else ""
            if "not found" in line and soname not in DRIVER_SONAMES:
                unresolved.append(f"{p.relative_to(prefix)}: {line.strip()}")
            elif "=>" in line and soname in own and str(prefix.resolve()) not in line:
                unresolved.append(f"{p.relative_to(prefix)}: {line.strip()} (the package's own library, resolved "
                                  f"outside the prefix)")
    if unresolved:
        raise UserError(f"after installation {unresolved[0]}", INSTALL_FAILED)
    return {"elf_files_checked": checked, "placeholders_absent": sorted(placeholders)}


def check_binary_package(channel: Path, name: str, work: Path, vps) -> dict:
    from rattler import install

    records = solve(channel, [name], vps)
    rec = next(r for r in records if r.name.normalized == name)
    prefix = work / f"env-{name}"
    shutil.rmtree(prefix, ignore_errors=True)
    try:
        asyncio.run(install(records, target_prefix=prefix, cache_dir=work / "pkgs", show_progress=False,
                            execute_link_scripts=False))
    except Exception as e:
        raise UserError(f"installing {name} into {prefix} failed: {str(e).splitlines()[0]}", INSTALL_FAILED) from None
    pkg_file = channel / rec.subdir / rec.file_name
    placeholders, info = _placeholders(pkg_file, work / f"info-{name}")
    result = {"package": rec.file_name, "solved": [r.file_name for r in records], "prefix": str(prefix)}
    script = info / "test" / "run_test.sh"
    if script.is_file():
        env = {"PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
               "LANG": "C.UTF-8", "PREFIX": str(prefix), "SHLIB_EXT": ".so", "PKG_NAME": name,
               "PKG_VERSION": str(rec.version), "CONDA_PREFIX": str(prefix)}
        out = _run_test_script(script, env, work, f"{rec.file_name} installed in {prefix}")
        result["test_output_tail"] = out.strip().splitlines()[-12:]
    result.update(check_relocated(prefix, placeholders))
    return result


def check_noarch_python_package(channel: Path, pkg_file: Path, work: Path, env_prefix: Path | None = None) -> dict:
    """What can be checked here of a noarch python package whose deps are on conda-forge (see module docstring).

    It is linked the way conda links noarch python (site-packages + entry point scripts) into `env_prefix`, the prefix
    where the channel's ucx was installed, so its tests see that ucx as they would in one conda environment."""
    import conda_package_handling.api as cph
    from rattler import MatchSpec

    dest = work / f"unpacked-{pkg_file.stem}"
    shutil.rmtree(dest, ignore_errors=True)
    cph.extract(str(pkg_file), dest_dir=str(dest))
    index = json.loads((dest / "info" / "index.json").read_text())
    specs = []
    for dep in index.get("depends", []) + index.get("constrains", []):
        try:
            specs.append(MatchSpec(dep))
        except Exception as e:
            raise UserError(f"{pkg_file.name}: dependency {dep!r} is not a valid MatchSpec ({e})", INSTALL_FAILED) \
                from None
    ucx_specs = [s for s in specs if s.name.normalized == "ucx"]
    from rattler import PackageName

    channel_ucx = [r for sub in _repodata(channel) for r in sub.load_records(PackageName("ucx"))]
    if not ucx_specs or not channel_ucx or not any(s.matches(r) for s in ucx_specs for r in channel_ucx):
        raise UserError(f"{pkg_file.name}: its ucx requirement {[str(s) for s in ucx_specs]} matches none of the "
                        f"channel's ucx packages {[r.file_name for r in channel_ucx]}", INSTALL_FAILED)
    link = json.loads((dest / "info" / "link.json").read_text())
    if env_prefix is None:
        env_prefix = work / f"noarch-{index['name']}"
        shutil.rmtree(env_prefix, ignore_errors=True)
    (env_prefix / "bin").mkdir(parents=True, exist_ok=True)
    py_ver = "%d.%d" % sys.version_info[:2]
    site = env_prefix / "lib" / f"python{py_ver}" / "site-packages"
    shutil.copytree(dest / "site-packages", site, dirs_exist_ok=True)
    for ep in link["noarch"].get("entry_points", []):
        cmd, _, target = (x.strip() for x in ep.partition("="))
        module, _, func = target.partition(":")
        script = env_prefix / "bin" / cmd
        script.write_text(f"#!{sys.executable}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n"
                          f"from {module} import {func}\nif __name__ == '__main__':\n"
                          f"    sys.argv[0] = re.sub(r'(-script\\.pyw?|\\.exe)?$', '', sys.argv[0])\n"
                          f"    sys.exit({func}())\n")
        script.chmod(0o755)
    env = {"PATH": f"{env_prefix}/bin:{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
           "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8", "PYTHONPATH": str(site),
           "PYTHON": sys.executable, "PREFIX": str(env_prefix), "CONDA_PREFIX": str(env_prefix),
           "PYTHONNOUSERSITE": "1"}
    where = subprocess.run([sys.executable, "-c", "import ucx_dask_gpu; print(ucx_dask_gpu.__file__)"],
                           env=env, capture_output=True, text=True).stdout.strip()
    if not where.startswith(str(site)):
        raise UserError(f"{pkg_file.name}: ucx_dask_gpu imported from {where or '?'}, not from the package",
                        INSTALL_FAILED)
    result = {"package": pkg_file.name, "depends": index.get("depends", []),
              "ucx_spec_matches": sorted(r.file_name for r in channel_ucx if any(s.matches(r) for s in ucx_specs))}
    script = dest / "info" / "test" / "run_test.sh"
    if script.is_file():
        out = _run_test_script(script, env, work, pkg_file.name, skip_prefixes=("pip check",))
        result["test_output_tail"] = out.strip().splitlines()[-12:]
        result["skipped"] = ["pip check (needs the conda-forge run dependencies installed by conda)"]
    return result


def install_test(channel: Path, *, work: Path, cuda: str | None, glibc: str | None = None) -> dict:
    """Install every linux-64 package of the channel into a fresh prefix and test it; check the noarch ones."""
    channel = channel.resolve()
    for sub in SUBDIRS:
        if not (channel / sub / "repodata.json").is_file():
            raise UserError(f"{channel} is not a channel: {sub}/repodata.json missing", INSTALL_FAILED)
    vps = virtual_packages(glibc or host_glibc(), cuda)
    work.mkdir(parents=True, exist_ok=True)
    results = {"virtual_packages": [f"{v.name.normalized}={v.version}" for v in vps], "packages": {}}
    envs: dict[str, Path] = {}
    for sub in SUBDIRS:  # linux-64 first: the noarch packages are linked into the ucx environment
        repodata = json.loads((channel / sub / "repodata.json").read_text())
        for fn, rec in sorted({**repodata.get("packages", {}), **repodata.get("packages.conda", {})}.items()):
            say(f"install test: {sub}/{fn}")
            if sub == "noarch":
                results["packages"][fn] = check_noarch_python_package(channel, channel / sub / fn, work,
                                                                      envs.get("ucx"))
            else:
                results["packages"][fn] = check_binary_package(channel, rec["name"], work, vps)
                envs[rec["name"]] = Path(results["packages"][fn]["prefix"])
    if not results["packages"]:
        raise UserError(f"{channel} holds no packages", INSTALL_FAILED)
    return results


# --- the chain ------------------------------------------------------------------------------------------------------

def _buildable(rendered: list[Rendered], st: Stack) -> tuple[list[Rendered], list[str]]:
    """Which variants this machine can build: the noarch ones, and the ucx variant for stack.toml's CUDA major (its
    header wheels); the other CUDA variants need conda-forge's CUDA packages."""
    build, skip = [], []
    ucx = [r for r in rendered if r.name == "ucx"]
    mine = [r for r in ucx if str(r.variant.get("cuda_compiler_version", "")).split(".")[0] == str(st.cuda_major)]
    if not mine:
        raise UserError(f"no ucx variant for CUDA {st.cuda_major} (stack.toml [stack].cuda_major) in "
                        f"{CBC_PATH}", RECIPE_INVALID)
    build.append(mine[0])
    skip += [r.dist for r in ucx if r is not mine[0]]
    build += [r for r in rendered if r.name != "ucx"]
    return build, skip


def build_channel(st: Stack, *, out: Path, recipes_dir: Path | None = None, sources: Path | None = None,
                  work: Path | None = None, caller_env: dict[str, str] | None = None,
                  run_install_test: bool = True) -> ChannelResult:
    recipes_dir = (recipes_dir or st.root / "recipes").resolve()
    out = out.resolve()
    work = (work or st.root / "build" / "conda-work").resolve()
    caller_env = dict(os.environ if caller_env is None else caller_env)
    if sources is None:
        sources = (st.root / ".cache" / "sources").resolve()
        fetch_sources(st, sources)
    sources = sources.resolve()
    ucx_version = st.ucx.version
    problems, rendered = lint_all(st, recipes_dir)
    if problems:
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        raise UserError(f"{len(problems)} recipe problem(s): {problems[0]}", RECIPE_INVALID)
    to_build, rendered_only = _buildable(rendered, st)
    say(f"rendered + linted: {', '.join(r.dist for r in rendered)}")
    say(f"building here: {', '.join(r.dist for r in to_build)}; rendered only: {', '.join(rendered_only) or '-'}")

    cbc_text = (recipes_dir / Path(CBC_PATH).name).read_text()
    timestamp_ms = st.source_date_epoch * 1000
    croot = work / "croot"
    caller_env["UCX_DASK_GPU_SOURCE_MIRROR"] = str(sources)  # the recipe's script_env: build offline from the fetched dir
    result = ChannelResult(channel=out, rendered_only=rendered_only, ucx_version=ucx_version)
    try:
        with atomic_path(out) as staging:
            staging.mkdir()
            for r in to_build:
                t0 = time.monotonic()
                pkg = buildmod.build(r, croot=croot, sources_dir=sources, caller_env=caller_env,
                                     log_dir=work / "logs")
                path = pack(pkg, staging, timestamp_ms, cbc_text)
                say(f"packed {path.parent.name}/{path.name} ({path.stat().st_size / 1e6:.2f} MB, "
                    f"{len(pkg.files)} files, {len(pkg.prefix_files)} with the prefix) in {time.monotonic() - t0:.0f} s")
                shutil.rmtree(croot / f"{r.name}_{r.build_string}", ignore_errors=True)
            index_channel(staging)
            if run_install_test:
                result.install = install_test(staging, work=work / "install-test",
                                              cuda=f"{st.cuda_major}.0")
            result.packages = sorted(staging.rglob("*.conda"))
        result.packages = sorted(out.rglob("*.conda"))
    finally:
        shutil.rmtree(croot, ignore_errors=True)
        shutil.rmtree(work / "install-test", ignore_errors=True)
    return result
