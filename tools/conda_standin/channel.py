"""The local channel: check -> build -> index -> install + test, all-or-nothing.

`build_channel` checks every recipe (generated lines up to date, every variant rendered by rattler-build under
conda-forge's pinning where present, else the fallback, and checked against stack.toml), then builds with
rattler-build on the stand-in recipe (standin.py) every output of one variant: stack.toml's CUDA major (the CUDA
stand-ins are the pinned CUDA wheels of that major), the image's python, linux-64 -- ucx, libucxx, ucxx,
distributed-ucxx and the metapackage, in that order, each built against the ones before it (rattler-build installs
this channel's ucx and libucxx into $PREFIX, with placeholders.py standing in for their conda-forge dependencies).
It indexes the channel with py-rattler (`linux-64/`, `noarch/`, a repodata.json in each) and runs the install check
before the channel directory appears. It is assembled next to the destination and renamed over it only when every
step passed, so a failure leaves the previous channel (or nothing) in place.

`install_test` is that last step on its own:
- each linux-64 package without a python dependency (ucx, libucxx): py-rattler solves it against the channel (+ the
  placeholders) with the virtual packages declared (`__glibc`, `__cuda`, `__linux`, `__unix`) and installs it into a
  fresh prefix (prefix replacement in text and binary files); no installed file may still hold the build placeholder,
  every library must resolve without LD_LIBRARY_PATH (except the GPU driver's and the CUDA runtime's, which the recipes
  allow absent); rattler-build runs the recipe's own tests (info/tests/tests.yaml) in a test environment it solves;
- the environment a user gets: py-rattler solves `ucx-dask-gpu cuda-version=<major>.0` (the README's install line)
  against the channel + placeholders and installs it into a fresh prefix that is a venv of this machine's python;
  the lock's wheels stand in for the conda-forge/rapidsai packages (placeholders.py says which); there the python
  packages' recipe tests run, `ucx_info -v` is the packaged UCX, and `import ucxx` maps the prefix's libucp.
"""
from __future__ import annotations

import asyncio
import json
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ucx_dask_gpu.cliutil import Progress
from ucx_dask_gpu.conda import publish, recipes
from ucx_dask_gpu.conda.recipes import BUILD_PLATFORM, Variant
from ucx_dask_gpu.errors import INSTALL_FAILED, OUTPUT_REFUSED, RECIPE_INVALID, UserError
from ucx_dask_gpu.fsutil import atomic_path, claim_work_dir, is_elf
from ucx_dask_gpu.stack import Stack
from ucx_dask_gpu.ucxbuild.fetch import local_dirs

from . import placeholders, standin

SUBDIRS = (BUILD_PLATFORM, "noarch")
# Loaded only where a GPU is: a CPU-only host has none of them; the recipe allows them absent.
GPU_SONAMES = ("libcuda.so.1", "libnvidia-ml.so.1", "libcudart.so.12", "libcudart.so.13")


@dataclass
class ChannelResult:
    channel: Path
    packages: list[Path] = field(default_factory=list)
    rendered_only: list[str] = field(default_factory=list)
    install: dict = field(default_factory=dict)
    variants: str = ""
    seconds: dict[str, float] = field(default_factory=dict)


say = Progress("[conda] ", stream="stdout")


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

def virtual_packages(glibc: str, cuda: str | None):
    from rattler import BuildString, GenericVirtualPackage, PackageName, Version

    def vp(name: str, version: str):
        return GenericVirtualPackage(PackageName(name), Version(version), BuildString("0"))

    out = [vp("__glibc", glibc), vp("__linux", _platform.release().split("-")[0]), vp("__unix", "0")]
    if cuda:
        out.append(vp("__cuda", cuda))
    return out


def _repodata(channels: list[Path]):
    from rattler import Channel, SparseRepoData

    out = []
    for channel in channels:
        ch = Channel(channel.resolve().as_uri())
        out += [SparseRepoData(ch, sub, channel / sub / "repodata.json") for sub in SUBDIRS
                if (channel / sub / "repodata.json").is_file()]
    return out


def solve(channels: list[Path], specs: list[str], vps) -> list:
    from rattler import solve_with_sparse_repodata

    try:
        # rattler's default channel priority is strict: as the README's install line asks of conda
        return asyncio.run(solve_with_sparse_repodata(specs, _repodata(channels), virtual_packages=vps))
    except Exception as e:  # rattler.exceptions.SolverError and friends
        first = str(e).strip().splitlines()
        raise UserError(f"cannot solve {' '.join(specs)} from {channels[0]}: {' '.join(first[:8])}",
                        INSTALL_FAILED) from None


def conda_files(prefix: Path, name: str) -> set[str]:
    """The files the conda package `name` installed in `prefix` (its conda-meta record), relative to it."""
    return {f for meta in prefix.glob(f"conda-meta/{name}-[0-9]*.json") for f in json.loads(meta.read_text())
            .get("files", [])}


def check_relocated(prefix: Path, placeholder: str | None, only: set[str] | None = None) -> dict:
    """No installed file may still hold the build placeholder; every ELF's libraries must resolve (ldd, no
    LD_LIBRARY_PATH), except the GPU libraries a GPU-less machine does not have. `only`: the files to check (those
    of the conda packages, in a prefix that holds others too)."""
    def ours(p: Path) -> bool:
        rel = p.relative_to(prefix)
        return "conda-meta" not in rel.parts and (only is None or str(rel) in only)

    leaked = []
    for p in prefix.rglob("*") if placeholder else []:
        if p.is_symlink() or not p.is_file() or not ours(p):
            continue
        if placeholder.encode() in p.read_bytes():
            leaked.append(str(p.relative_to(prefix)))
    if leaked:
        raise UserError(f"{len(leaked)} installed file(s) still contain the build prefix, e.g. {leaked[0]}",
                        INSTALL_FAILED)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    own = {p.name for p in prefix.rglob("*.so*") if ours(p)}
    unresolved, checked = [], 0
    for p in sorted(prefix.rglob("*")):
        if not is_elf(p) or not ours(p):
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


def _placeholder(pkg_file: Path, work: Path) -> str | None:
    """The build prefix rattler-build recorded for the package's relocatable files (None: it has none)."""
    import conda_package_handling.api as cph

    dest = work / f"info-{pkg_file.stem}"
    shutil.rmtree(dest, ignore_errors=True)
    cph.extract(str(pkg_file), dest_dir=str(dest), components="info")
    paths = json.loads((dest / "info" / "paths.json").read_text())["paths"]
    found = {p["prefix_placeholder"] for p in paths if p.get("prefix_placeholder")}
    return found.pop() if found else None


def run_recipe_tests(pkg_file: Path, channels: list[Path]) -> list[str]:
    """rattler-build runs the package's tests (info/tests/tests.yaml) in a test environment solved from
    `channels`."""
    from rattler_build import Package
    from rattler_build._rattler_build import RattlerBuildError

    pkg = Package.from_file(pkg_file)
    try:
        results = pkg.run_tests(channel=[c.resolve().as_uri() for c in channels])
    except RattlerBuildError as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "failed")
        raise UserError(f"{pkg_file.name}: rattler-build test: {first}", INSTALL_FAILED) from None
    failed = [r for r in results if not r.success]
    if failed:
        tail = [ln for ln in failed[0].output if ln.strip()][-1:] or ["no output"]
        raise UserError(f"{pkg_file.name}: recipe test {failed[0].test_index} failed: {tail[0]}", INSTALL_FAILED)
    return [f"test {r.test_index}: passed" for r in results]


def _install(records, prefix: Path, cache: Path) -> None:
    from rattler import install

    try:
        asyncio.run(install(records, target_prefix=prefix, cache_dir=cache, show_progress=False,
                            execute_link_scripts=False))
    except Exception as e:
        raise UserError(f"installing into {prefix} failed: {str(e).splitlines()[0]}", INSTALL_FAILED) from None


def check_binary_package(channels: list[Path], name: str, work: Path, vps) -> dict:
    records = solve(channels, [name], vps)
    rec = next(r for r in records if r.name.normalized == name)
    prefix = work / f"env-{name}"
    shutil.rmtree(prefix, ignore_errors=True)
    _install(records, prefix, work / "pkgs")
    pkg_file = channels[0] / rec.subdir / rec.file_name
    result = {"package": rec.file_name, "solved": [r.file_name for r in records], "prefix": str(prefix)}
    result.update(check_relocated(prefix, _placeholder(pkg_file, work)))
    result["recipe_tests"] = run_recipe_tests(pkg_file, channels)
    return result


# --- the environment a user gets -----------------------------------------------------------------------------------

def _env_vars(prefix: Path) -> dict[str, str]:
    """A conda environment's activation, as far as a test needs it: its bin/ first, no LD_LIBRARY_PATH."""
    return {"PATH": f"{prefix}/bin:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
            "LANG": "C.UTF-8", "PREFIX": str(prefix), "CONDA_PREFIX": str(prefix), "PYTHONNOUSERSITE": "1",
            "PYTHON": str(prefix / "bin" / "python")}


def make_environment(st: Stack, channels: list[Path], specs: list[str], prefix: Path, work: Path, vps) -> dict:
    """`specs` solved by py-rattler against `channels` and installed into `prefix`, a venv of this machine's python
    made first (the python placeholder's files), with the lock's wheels on top (the other placeholders' files)."""
    records = solve(channels, specs, vps)
    shutil.rmtree(prefix, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(prefix)], check=True, capture_output=True)
    _install(records, prefix, work / "pkgs")
    proc = subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "--no-deps", "--require-hashes", "-r", str(st.lock_path())], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise UserError(f"installing {st.python.lock} (the placeholders' files) into {prefix} failed: "
                        f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", INSTALL_FAILED)
    ours = {r.name.normalized: r.file_name for r in records if not str(r.build).startswith("placeholder")}
    stood_in = {r.name.normalized: f"{r.version}" for r in records if str(r.build).startswith("placeholder")}
    return {"prefix": str(prefix), "specs": specs, "from_channel": ours, "placeholders": stood_in}


def _tests_of(pkg_file: Path, work: Path) -> list[dict]:
    import conda_package_handling.api as cph

    dest = work / f"tests-{pkg_file.stem}"
    shutil.rmtree(dest, ignore_errors=True)
    cph.extract(str(pkg_file), dest_dir=str(dest), components="info")
    path = dest / "info" / "tests" / "tests.yaml"
    return (yaml.safe_load(path.read_text()) or []) if path.is_file() else []


def _test_lines(tests: list[dict]) -> list[str]:
    """A recipe's python, script and package_contents tests as shell lines for the environment."""
    lines = []
    for t in tests:
        py = t.get("python") or {}
        lines += [f'"$PYTHON" -c "import {mod}"' for mod in py.get("imports") or []]
        if py.get("pip_check", True) and py:
            lines.append('"$PYTHON" -m pip check')
        script = t.get("script")
        lines += [script] if isinstance(script, str) else list(script or [])
        for kind, globs in (t.get("package_contents") or {}).items():
            if isinstance(globs, dict):  # not_exists names the package's own files: rattler-build checked them
                globs = globs.get("exists") or []
            for g in globs if isinstance(globs, list) else []:
                where = {"lib": ['"$PREFIX"/lib/lib{g}.so'], "include": ['"$PREFIX"/include/{g}'],
                         "bin": ['"$PREFIX"/bin/{g}'], "files": ['"$PREFIX"/{g}']}.get(kind, [])
                lines += [f"ls {w.format(g=g)} >/dev/null" for w in where]
    return lines


def run_tests_in(prefix: Path, pkg_file: Path, work: Path) -> list[str]:
    """The package's recipe tests run in the environment at `prefix`."""
    lines = _test_lines(_tests_of(pkg_file, work))
    script = work / f"test-{pkg_file.stem}.sh"
    script.write_text("set -ex\n" + "\n".join(lines) + "\n")
    proc = subprocess.run(["bash", str(script)], cwd=work, env=_env_vars(prefix), capture_output=True, text=True,
                          stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        failed = [ln for ln in proc.stderr.splitlines() if ln.startswith("+ ")]
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(f"{pkg_file.name}: recipe test failed (exit {proc.returncode}) at "
                        f"`{failed[-1][2:] if failed else '?'}`: {tail}", INSTALL_FAILED)
    return lines


def check_environment(prefix: Path, ucx_version: str) -> dict:
    """In the environment: `ucx_info -v` is the packaged UCX, found on PATH in the prefix; `import ucxx` maps the
    prefix's libucp; the stack id."""
    env = _env_vars(prefix)
    info = subprocess.run(["ucx_info", "-v"], capture_output=True, text=True, env=env)
    where = shutil.which("ucx_info", path=env["PATH"])
    if info.returncode != 0 or f"Library version: {ucx_version}" not in info.stdout or \
            not str(where).startswith(str(prefix)):
        raise UserError(f"{prefix}: ucx_info -v ({where}) does not report UCX {ucx_version}: "
                        f"{(info.stdout + info.stderr).strip().splitlines()[:2]}", INSTALL_FAILED)
    code = ("import json, ucxx\nfrom ucx_dask_gpu.ucx.transports import mapped_libucp\n"
            "from ucx_dask_gpu.gate.identity import stack_id\n"
            "print(json.dumps({'libucp': mapped_libucp(), 'ucxx': ucxx.__file__, 'stack_id': stack_id()}))")
    proc = subprocess.run([env["PYTHON"], "-c", code], capture_output=True, text=True, env=env, cwd=prefix)
    if proc.returncode != 0:
        raise UserError(f"{prefix}: import ucxx failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}",
                        INSTALL_FAILED)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if not str(seen["libucp"]).startswith(str(prefix.resolve())):
        raise UserError(f"{prefix}: ucxx loaded {seen['libucp']}, not the prefix's libucp", INSTALL_FAILED)
    return {"ucx_info": info.stdout.strip().splitlines()[0], "ucx_info_path": str(where), **seen}


def install_test(st: Stack, channel: Path, *, work: Path, cuda: str, glibc: str | None = None) -> dict:
    """The install check (module docstring) of the channel at `channel`."""
    channel = channel.resolve()
    for sub in SUBDIRS:
        if not (channel / sub / "repodata.json").is_file():
            raise UserError(f"{channel} is not a channel: {sub}/repodata.json missing", INSTALL_FAILED)
    claim_work_dir(work, "--work")
    made = placeholders.write(st, channel, work / "placeholders", cuda)
    channels = [channel, work / "placeholders"]
    vps = virtual_packages(glibc or standin.host_glibc(), cuda)
    results = {"virtual_packages": [f"{v.name.normalized}={v.version}" for v in vps], "packages": {},
               "placeholders": {n: {"version": v, "real_files": note} for n, (v, _, note) in made.items()}}
    records = placeholders.channel_records(channel)
    if not records:
        raise UserError(f"{channel} holds no packages", INSTALL_FAILED)
    python_pkgs = []
    for rec in sorted(records, key=lambda r: (r["subdir"] != BUILD_PLATFORM, r["name"])):
        fn = f"{rec['name']}-{rec['version']}-{rec['build']}.conda"
        if rec["subdir"] == BUILD_PLATFORM and not any(d.split()[0] == "python" for d in rec.get("depends", [])):
            say(f"install test: {rec['subdir']}/{fn}")
            results["packages"][fn] = check_binary_package(channels, rec["name"], work, vps)
        else:
            python_pkgs.append(channel / rec["subdir"] / fn)
    meta = [r["name"] for r in records if r["name"] == st.name]
    if meta:
        specs = [st.name, f"cuda-version={cuda}"]
        say(f"install test: the environment of `{' '.join(specs)}`")
        prefix = work / "env"
        results["environment"] = make_environment(st, channels, specs, prefix, work, vps)
        for rec in records:  # each channel package's files, against its own build prefix
            pkg = channel / rec["subdir"] / f"{rec['name']}-{rec['version']}-{rec['build']}.conda"
            checked = check_relocated(prefix, _placeholder(pkg, work), only=conda_files(prefix, rec["name"]))
            results["environment"][f"elf_files_checked_{rec['name']}"] = checked["elf_files_checked"]
        for pkg in python_pkgs:
            results["packages"][pkg.name] = {"prefix": str(prefix), "recipe_tests": run_tests_in(prefix, pkg, work)}
        results["environment"].update(check_environment(prefix, st.ucx.version))
    return results


# --- the chain ------------------------------------------------------------------------------------------------------

def buildable(variants: list[Variant], st: Stack) -> tuple[list[Variant], list[str]]:
    """What this machine builds: for linux-64 (or noarch), stack.toml's CUDA major (the CUDA stand-ins are the pinned
    wheels of that major) and the image's python; in recipe order, a recipe's outputs in their order. The rest is
    rendered and checked."""
    build, skip = [], []
    for v in variants:
        cuda = str(v.variant.get("cuda_compiler_version", ""))
        py = str(v.variant.get("python", ""))
        ok = v.subdir in (BUILD_PLATFORM, "noarch") and \
            (not cuda or v.subdir == "noarch" or cuda.split(".")[0] == str(st.cuda_major)) and \
            (not py or v.subdir == "noarch" or py.split()[0].rstrip(".*") == st.python.version)
        (build if ok else skip).append(v)
    order = {name: i for i, name in enumerate(recipes.cfg.RECIPES)}
    build.sort(key=lambda v: (order[v.recipe_path.parent.name], _output_index(v)))
    for name in ("ucx",):
        if not any(v.name == name for v in build):
            raise UserError(f"no {name} variant for CUDA {st.cuda_major} (stack.toml [stack].cuda_major) renders for "
                            f"{BUILD_PLATFORM}", RECIPE_INVALID)
    return build, [f"{v.subdir}/{v.dist}" for v in skip]


def _output_index(v: Variant) -> int:
    names = re.findall(r"(?m)^  - package:\s*\n\s+name:\s*(\S+)", v.template)
    return names.index(v.name) if v.name in names else 0


def is_channel_or_empty(path: Path) -> bool:
    """An empty directory, or one that holds only conda subdirs, each with the repodata.json index_channel writes."""
    return path.is_dir() and all(p.is_dir() and (p / "repodata.json").is_file() for p in path.iterdir())


def build_channel(st: Stack, *, out: Path, recipes_dir: Path | None = None, mirror: list[Path] | None = None,
                  work: Path | None = None, run_install_test: bool = True, mode: str = "auto") -> ChannelResult:
    out = out.resolve()
    if out == (st.root / publish.PUBLISH_DIR).resolve():
        raise UserError(f"--out {out}: the directory an upload publishes from; a channel built with stand-ins goes "
                        f"elsewhere (make channel: build/standin-channel)", OUTPUT_REFUSED)
    if out.exists() and not is_channel_or_empty(out):  # replaced whole at the end: only what this command made
        raise UserError(f"--out {out}: not empty and not a channel this command made; give a new or empty directory",
                        OUTPUT_REFUSED)
    work = claim_work_dir((work or st.root / "build" / "conda-work").resolve(), "--work")
    mirror = local_dirs(st, [p.resolve() for p in mirror or []])
    t0 = time.monotonic()
    problems, variants = recipes.check_all(st, recipes_dir, mode=mode, packed=work / "recipes")
    if problems:
        raise UserError(f"{len(problems)} recipe problem(s): {problems[0]}", RECIPE_INVALID)
    to_build, rendered_only = buildable(variants, st)
    stack = variants[0].stack.describe() if variants[0].stack else "?"
    say(f"rendered + checked by rattler-build under {stack}: {len(variants)} outputs of "
        f"{', '.join(recipes.cfg.RECIPES)}")
    say(f"building here (rattler-build, stand-in requirements): {', '.join(v.dist for v in to_build)}")
    result = ChannelResult(channel=out, rendered_only=rendered_only, variants=stack)
    result.seconds["check"] = time.monotonic() - t0
    build_out = work / "rattler-build"
    shutil.rmtree(build_out, ignore_errors=True)
    cuda = f"{st.cuda_major}.0"
    try:
        with atomic_path(out, replace_dir=True) as staging:
            staging.mkdir()
            index_channel(staging)
            own: dict[str, Path] = {}
            for v in to_build:
                t1 = time.monotonic()
                placeholders.write(st, staging, work / "placeholders", cuda)
                siblings = {s.name: s for s in to_build if s.recipe_path == v.recipe_path and s is not v}
                say(f"building {v.dist} (log: {work / 'logs' / (v.dist + '.log')})")
                pkg = standin.build_variant(st, v, work=work / "standin", output_dir=build_out, mirror_dirs=mirror,
                                            log_dir=work / "logs", own=own, siblings=siblings,
                                            channels=[staging.as_uri(), (work / "placeholders").as_uri()])
                (staging / v.subdir).mkdir(exist_ok=True)
                own[v.name] = Path(shutil.copy2(pkg, staging / v.subdir / pkg.name))
                index_channel(staging)
                result.seconds[v.name] = time.monotonic() - t1
                say(f"built {v.subdir}/{pkg.name} ({pkg.stat().st_size / 1e6:.2f} MB) in "
                    f"{result.seconds[v.name]:.0f}s")
            if run_install_test:
                t1 = time.monotonic()
                result.install = install_test(st, staging, work=work / "install-test", cuda=cuda)
                result.seconds["install_test"] = time.monotonic() - t1
                (work / "install-check.json").write_text(json.dumps(result.install, indent=2, sort_keys=True))
        result.packages = sorted(out.rglob("*.conda"))
    finally:
        shutil.rmtree(build_out / "bld", ignore_errors=True)
    result.seconds["total"] = time.monotonic() - t0
    return result
