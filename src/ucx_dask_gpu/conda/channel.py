"""The local channel: check -> build -> index -> install + test, all-or-nothing.

`build_channel` checks every recipe (generated lines up to date, every variant rendered by rattler-build and checked
against stack.toml), builds what this machine can build with rattler-build on the stand-in recipe (standin.py): the
ucx variant for stack.toml's CUDA major (the CUDA stand-in is the pinned CUDA wheels of that major) and the noarch
metapackage; indexes the channel with py-rattler (`linux-64/`, `noarch/`, a repodata.json in each); installs and
tests before the channel directory appears. It is assembled next to the destination and renamed over it only when
every step passed, so a failure leaves the previous channel (or nothing) in place.

`install_test` is that last step on its own. For each linux-64 package: py-rattler solves it against the channel with
the virtual packages declared (`__glibc`, `__cuda`, `__linux`, `__unix`) and installs it into a fresh prefix (prefix
replacement in text and binary files); no installed file may still hold the build placeholder and every library must
resolve without LD_LIBRARY_PATH (except the GPU driver's and the CUDA runtime's, which the recipe allows to be absent);
then rattler-build runs the recipe's own tests (info/tests/tests.yaml) in a test environment it solves from the channel.
The noarch metapackage's dependencies (python, dask, ucxx …) live on conda-forge: its dependencies are parsed as
MatchSpecs, its `ucx` spec must select this channel's ucx, and its recipe tests (python imports, script) run against
its packed site-packages with the entry point written as conda writes it.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform as _platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import INSTALL_FAILED, OUTPUT_REFUSED, RECIPE_INVALID, UserError
from ..fsutil import atomic_path, claim_work_dir
from ..stack import Stack
from ..ucxbuild.fetch import local_dirs
from . import recipes, standin
from .recipes import BUILD_PLATFORM, Variant

SUBDIRS = (BUILD_PLATFORM, "noarch")
# Loaded only where a GPU is: a CPU-only host (and this machine) has none of them; the recipe allows them absent.
GPU_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1", "libcudart.so.12", "libcudart.so.13")
ELF_MAGIC = b"\x7fELF"
# What the channel build and the install test make in a --work directory (their own, replaced on every run:
# claim_work_dir refuses a directory holding more).
WORK_NAMES = ("logs", "standin", "rattler-build", "empty-channel", "install-test", "pkgs", "info-*", "env-*",
              "unpacked-*", "noarch-*", "test-*.sh")


@dataclass
class ChannelResult:
    channel: Path
    packages: list[Path] = field(default_factory=list)
    rendered_only: list[str] = field(default_factory=list)
    install: dict = field(default_factory=dict)


def say(msg: str) -> None:
    print(f"[conda] {msg}", flush=True)


# --- index ----------------------------------------------------------------------------------------------------------

def write_empty_channel(path: Path) -> Path:
    """A channel with no packages: what rattler-build solves the stand-in's empty build/host environments from."""
    for sub in SUBDIRS:
        (path / sub).mkdir(parents=True, exist_ok=True)
        (path / sub / "repodata.json").write_text(json.dumps({"info": {"subdir": sub}, "packages": {},
                                                              "packages.conda": {}}))
    return path


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


def is_elf(path: Path) -> bool:
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


def check_relocated(prefix: Path, placeholder: str) -> dict:
    """No installed file may still hold the build placeholder; every ELF's libraries must resolve (ldd, no
    LD_LIBRARY_PATH), except the GPU libraries a GPU-less machine does not have."""
    leaked = []
    for p in prefix.rglob("*"):
        if p.is_symlink() or not p.is_file() or "conda-meta" in p.relative_to(prefix).parts:
            continue
        if placeholder.encode() in p.read_bytes():
            leaked.append(str(p.relative_to(prefix)))
    if leaked:
        raise UserError(f"{len(leaked)} installed file(s) still contain the build prefix, e.g. {leaked[0]}",
                        INSTALL_FAILED)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    own = {p.name for p in prefix.rglob("*.so*") if "conda-meta" not in p.parts}
    unresolved, checked = [], 0
    for p in sorted(prefix.rglob("*")):
        if not is_elf(p):
            continue
        checked += 1
        out = subprocess.run(["ldd", str(p)], capture_output=True, text=True, env=env).stdout
        for line in out.splitlines():
            soname = line.split()[0] if line.split() else ""
            if "not found" in line and soname not in GPU_SONAMES:
                unresolved.append(f"{p.relative_to(prefix)}: {line.strip()}")
            elif "=>" in line and soname in own and str(prefix.resolve()) not in line:
                unresolved.append(f"{p.relative_to(prefix)}: {line.strip()} (the package's own library, resolved "
                                  f"outside the prefix)")
    if unresolved:
        raise UserError(f"after installation {unresolved[0]}", INSTALL_FAILED)
    return {"elf_files_checked": checked}


def _placeholder(pkg_file: Path, work: Path) -> str:
    import conda_package_handling.api as cph

    dest = work / f"info-{pkg_file.stem}"
    shutil.rmtree(dest, ignore_errors=True)
    cph.extract(str(pkg_file), dest_dir=str(dest), components="info")
    paths = json.loads((dest / "info" / "paths.json").read_text())["paths"]
    found = {p["prefix_placeholder"] for p in paths if p.get("prefix_placeholder")}
    return found.pop() if found else "host_env_placehold_placehold"


def run_recipe_tests(pkg_file: Path, channel: Path) -> list[str]:
    """rattler-build runs the package's tests (info/tests/tests.yaml) in a test environment solved from `channel`."""
    from rattler_build import Package
    from rattler_build._rattler_build import RattlerBuildError

    pkg = Package.from_file(pkg_file)
    try:
        results = pkg.run_tests(channel=[channel.resolve().as_uri()])
    except RattlerBuildError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "failed")
        raise UserError(f"{pkg_file.name}: rattler-build test: {first}", INSTALL_FAILED) from None
    failed = [r for r in results if not r.success]
    if failed:
        tail = [ln for ln in failed[0].output if ln.strip()][-1:] or ["no output"]
        raise UserError(f"{pkg_file.name}: recipe test {failed[0].test_index} failed: {tail[0]}", INSTALL_FAILED)
    return [f"test {r.test_index}: passed" for r in results]


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
    result = {"package": rec.file_name, "solved": [r.file_name for r in records], "prefix": str(prefix)}
    result.update(check_relocated(prefix, _placeholder(pkg_file, work)))
    result["recipe_tests"] = run_recipe_tests(pkg_file, channel)
    return result


def _noarch_test_lines(tests: list[dict]) -> list[str]:
    lines = []
    for t in tests:
        for mod in (t.get("python") or {}).get("imports") or []:
            lines.append(f'"$PYTHON" -c "import {mod}"')
        script = t.get("script")
        lines += [script] if isinstance(script, str) else list(script or [])
    return lines


def check_noarch_python_package(channel: Path, pkg_file: Path, work: Path, env_prefix: Path | None = None) -> dict:
    """What can be checked here of a noarch python package whose dependencies are on conda-forge (module docstring).

    It is linked the way conda links noarch python (site-packages + entry point scripts) into `env_prefix`, the prefix
    where the channel's ucx was installed, so its tests see that ucx as they would in one conda environment."""
    import conda_package_handling.api as cph
    from rattler import MatchSpec, PackageName

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
    channel_ucx = [r for sub in _repodata(channel) for r in sub.load_records(PackageName("ucx"))]
    if not ucx_specs or not channel_ucx or not any(s.matches(r) for s in ucx_specs for r in channel_ucx):
        raise UserError(f"{pkg_file.name}: its ucx requirement {[str(s) for s in ucx_specs]} matches none of the "
                        f"channel's ucx packages {[r.file_name for r in channel_ucx]}", INSTALL_FAILED)
    link = json.loads((dest / "info" / "link.json").read_text())
    if env_prefix is None:
        env_prefix = work / f"noarch-{index['name']}"
        shutil.rmtree(env_prefix, ignore_errors=True)
    (env_prefix / "bin").mkdir(parents=True, exist_ok=True)
    site = env_prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
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
    tests = yaml.safe_load((dest / "info" / "tests" / "tests.yaml").read_text()) or []
    script = work / f"test-{pkg_file.stem}.sh"
    script.write_text("set -ex\n" + "\n".join(_noarch_test_lines(tests)) + "\n")
    proc = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("+ ")]
        raise UserError(f"{pkg_file.name}: recipe test failed (exit {proc.returncode}) at "
                        f"`{failed[-1][2:] if failed else '?'}`", INSTALL_FAILED)
    return {"package": pkg_file.name, "depends": index.get("depends", []),
            "ucx_spec_matches": sorted(r.file_name for r in channel_ucx if any(s.matches(r) for s in ucx_specs)),
            "test_output_tail": (proc.stdout + proc.stderr).strip().splitlines()[-12:]}


def install_test(channel: Path, *, work: Path, cuda: str | None, glibc: str | None = None) -> dict:
    """Install every linux-64 package of the channel into a fresh prefix and test it; check the noarch ones."""
    channel = channel.resolve()
    for sub in SUBDIRS:
        if not (channel / sub / "repodata.json").is_file():
            raise UserError(f"{channel} is not a channel: {sub}/repodata.json missing", INSTALL_FAILED)
    vps = virtual_packages(glibc or host_glibc(), cuda)
    claim_work_dir(work, WORK_NAMES, "--work")
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

def buildable(variants: list[Variant], st: Stack) -> tuple[list[Variant], list[str]]:
    """What this machine builds: single-output recipes for linux-64 (or noarch) whose CUDA variant, if any, is
    stack.toml's CUDA major (the CUDA stand-in is the pinned wheels of that major). The rest is rendered and checked."""
    build, skip = [], []
    for v in variants:
        cuda = str(v.variant.get("cuda_compiler_version", ""))
        ok = v.outputs_in_recipe == 1 and v.platform == BUILD_PLATFORM and \
            (not cuda or v.subdir == "noarch" or cuda.split(".")[0] == str(st.cuda_major))
        (build if ok else skip).append(v)
    if not any(v.name == "ucx" for v in build):
        raise UserError(f"no ucx variant for CUDA {st.cuda_major} (stack.toml [stack].cuda_major) renders for "
                        f"{BUILD_PLATFORM}", RECIPE_INVALID)
    build.sort(key=lambda v: v.subdir != BUILD_PLATFORM)  # binary packages first
    return build, [f"{v.subdir}/{v.dist}" for v in skip]


def is_channel_or_empty(path: Path) -> bool:
    """An empty directory, or one that holds only conda subdirs, each with the repodata.json index_channel writes."""
    return path.is_dir() and all(p.is_dir() and (p / "repodata.json").is_file() for p in path.iterdir())


def build_channel(st: Stack, *, out: Path, recipes_dir: Path | None = None, mirror: list[Path] | None = None,
                  work: Path | None = None, run_install_test: bool = True) -> ChannelResult:
    out = out.resolve()
    if out.exists() and not is_channel_or_empty(out):  # replaced whole at the end: only what this command made
        raise UserError(f"--out {out}: not empty and not a channel this command made; give a new or empty directory",
                        OUTPUT_REFUSED)
    work = claim_work_dir((work or st.root / "build" / "conda-work").resolve(), WORK_NAMES, "--work")
    mirror = local_dirs(st, [p.resolve() for p in mirror or []])
    problems, variants = recipes.check_all(st, recipes_dir)
    if problems:
        raise UserError(f"{len(problems)} recipe problem(s): {problems[0]}", RECIPE_INVALID)
    to_build, rendered_only = buildable(variants, st)
    say(f"rendered + checked by rattler-build: {len(variants)} outputs of {', '.join(recipes.cfg.RECIPES)}")
    say(f"building here (rattler-build, stand-in requirements): {', '.join(v.dist for v in to_build)}")
    result = ChannelResult(channel=out, rendered_only=rendered_only)
    empty = write_empty_channel(work / "empty-channel")
    build_out = work / "rattler-build"
    shutil.rmtree(build_out, ignore_errors=True)
    try:
        with atomic_path(out, replace_dir=True) as staging:
            staging.mkdir()
            for v in to_build:
                say(f"building {v.dist} (log: {work / 'logs' / (v.dist + '.log')})")
                pkg = standin.build_variant(st, v, work=work / "standin", output_dir=build_out,
                                            mirror_dirs=mirror, log_dir=work / "logs", channel=empty.as_uri())
                (staging / v.subdir).mkdir(exist_ok=True)
                shutil.copy2(pkg, staging / v.subdir / pkg.name)
                say(f"built {v.subdir}/{pkg.name} ({pkg.stat().st_size / 1e6:.2f} MB)")
            index_channel(staging)
            if run_install_test:
                result.install = install_test(staging, work=work / "install-test", cuda=f"{st.cuda_major}.0")
        result.packages = sorted(out.rglob("*.conda"))
    finally:
        shutil.rmtree(build_out / "bld", ignore_errors=True)
        shutil.rmtree(work / "install-test", ignore_errors=True)
    return result
