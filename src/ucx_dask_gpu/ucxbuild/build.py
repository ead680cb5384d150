"""Build UCX from the first verified source into a relocatable prefix with share/ucx-dask-gpu/build-info.json
(ucx-src-build/README.md); nothing is built when --prefix already holds a build of the same inputs. Only the shipped
components are built (SUBDIRS): UCX's test/apps do not build with CUDA 13 headers against the 535 link libraries, and
nothing we ship needs them.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..errors import BUILD_FAILED, MISSING_CAPABILITY, OUTPUT_REFUSED, USAGE, UserError
from ..fsutil import atomic_path, atomic_write_text, claim_work_dir, first_of, sha256_file, unknown_entries
from ..stack import Stack
from ..ucx.install import BUILD_INFO, read_build_info
from . import cuda as cudamod
from . import relocate, repro
from .fetch import FetchedSource, default_cache_dir, fetch_source, say, warn

# In dependency order; `install-data-am` at the top level adds ucx.pc and share/ucx/perftest.
SUBDIRS = ("src/ucm", "src/ucs", "src/uct", "src/ucp", "src/tools/vfs", "src/tools/info", "src/tools/perf",
           "src/tools/profile", "cmake")
CAPABILITIES = ("ib", "cuda", "gdrcopy")
# Which lib/ucx modules prove a capability was built.
CAPABILITY_MODULES = {"ib": ("libuct_ib.so", "libuct_rdmacm.so"), "cuda": ("libuct_cuda.so", "libucm_cuda.so"),
                      "gdrcopy": ("libuct_cuda_gdrcopy.so",)}
HEADER_PROBES = {"verbs": "infiniband/verbs.h", "rdmacm": "rdma/rdma_cma.h", "numa": "numa.h"}
CONFIG_LOG_TAIL = 40
HEARTBEAT_S = 15.0
_COMPILE_LINE = re.compile(r"^\s+(CC|CXX|CCLD|CXXLD)\s+(\S+)")
_SUMMARY_LINE = re.compile(r"^(?:configure:)?\s*(UCT modules|UCM modules|UCS modules|Perf modules|IB modules|CUDA modules|"
                           r"ROCM modules|Transport modules)\s*:\s*(.*)$")


@dataclass
class BuildOptions:
    prefix: Path
    work_dir: Path | None = None
    cache: Path | None = None
    sources: list[Path] = field(default_factory=list)
    offline: bool = False
    cuda: str = "auto"
    cuda_link_dir: Path | None = None
    gdrcopy: Path | None = None
    jobs: int = 0
    require: frozenset[str] = frozenset()
    patches_root: Path | None = None
    keep_debug: bool = False
    stamp: Path | None = None  # gets the input key, rewritten only when it changes (make's prerequisite)


def parse_require(text: str | None) -> frozenset[str]:
    items = frozenset(x.strip() for x in (text or "").split(",") if x.strip())
    bad = sorted(items - set(CAPABILITIES))
    if bad:
        raise UserError(f"--require: unknown capability {', '.join(bad)} (choose from {', '.join(CAPABILITIES)})",
                        USAGE)
    return items


# --- small helpers -------------------------------------------------------------------------------------------------

def _fmt_s(s: float) -> str:
    return f"{int(s // 60)}m{s % 60:04.1f}s" if s >= 60 else f"{s:.1f}s"


def run_logged(cmd: list[str], cwd: Path, log: Path, env: dict, label: str) -> tuple[int, list[str]]:
    """Run cmd with output to `log`; print a heartbeat with the number of compiled files every HEARTBEAT_S."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = last = time.monotonic()
    compiled = 0
    tail: list[str] = []
    with open(log, "a") as lf:
        lf.write(f"$ (cd {cwd} && {shlex.join(cmd)})\n")
        lf.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
        assert proc.stdout is not None
        for line in proc.stdout:
            lf.write(line)
            tail = (tail + [line.rstrip("\n")])[-CONFIG_LOG_TAIL:]
            if _COMPILE_LINE.match(line):
                compiled += 1
            now = time.monotonic()
            if now - last >= HEARTBEAT_S:
                done = f"{compiled} files compiled, " if compiled else ""
                say(f"  {label}: running, {done}{_fmt_s(now - t0)}")
                last = now
        rc = proc.wait()
    return rc, tail


def _tail(path: Path, n: int = CONFIG_LOG_TAIL) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _print_tail(title: str, lines: list[str]) -> None:
    say(title)
    for line in lines:
        print(f"    | {line}", flush=True)


def compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


def header_available(header: str, cppflags: list[str]) -> bool:
    """Does the C preprocessor find <header> with these flags? (Respects $CC/$CPPFLAGS, e.g. a conda sysroot.)"""
    cmd = compiler() + ["-E", "-x", "c", "-", "-o", os.devnull] + shlex.split(os.environ.get("CPPFLAGS", "")) + cppflags
    try:
        proc = subprocess.run(cmd, input=f"#include <{header}>\n", capture_output=True, text=True)
    except OSError:
        raise UserError(f"C compiler {cmd[0]!r} not found (Debian: apt-get install build-essential)",
                        MISSING_CAPABILITY) from None
    return proc.returncode == 0


def check_tools(need_patch: bool) -> None:
    tools = ["make", "patchelf", compiler()[0], "autoreconf", "libtoolize", "automake"]
    tools += ["patch"] if need_patch else []
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise UserError(f"missing build tools: {', '.join(missing)} (Debian: see stack.toml [debian] "
                        f"ucx_build_packages)", MISSING_CAPABILITY)


# --- steps ---------------------------------------------------------------------------------------------------------

def unpack_tree(archive: Path, dest: Path) -> Path:
    """Extract into dest (emptied first); return the single top-level directory."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        cudamod.safe_extract(tar, dest)
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise UserError(f"{archive.name}: expected one top-level source directory", BUILD_FAILED)
    return tops[0]


def unpack(archive: Path, dest: Path) -> Path:
    src = unpack_tree(archive, dest)
    if not (src / "configure.ac").is_file():
        raise UserError(f"{archive.name}: not a UCX source tree (no configure.ac)", BUILD_FAILED)
    return src


def patches_for(version: str, root: Path) -> list[Path]:
    d = root / version
    return sorted(d.glob("*.patch")) if d.is_dir() else []


def apply_patches(src: Path, patches: list[Path], log: Path) -> list[dict]:
    applied = []
    for p in patches:
        with open(log, "a") as lf:
            lf.write(f"$ patch -p1 --forward --batch -i {p}\n")
            proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(p)], cwd=src, stdout=lf,
                                  stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise UserError(f"patch {p.parent.name}/{p.name} does not apply to this source (see {log})", BUILD_FAILED)
        say(f"  applied {p.parent.name}/{p.name}")
        applied.append({"name": f"{p.parent.name}/{p.name}", "sha256": sha256_file(p)})
    return applied


def autogen(src: Path, env: dict, log: Path) -> None:
    """A tag archive is the git tree: no ./configure. UCX's autogen.sh makes it (autoconf, automake, libtool)."""
    t0 = time.monotonic()
    say("autogen.sh (a tag archive has no ./configure)")
    rc, tail = run_logged(["./autogen.sh"], src, log, env, "autogen")
    if rc != 0:
        _print_tail(f"autogen.sh failed; last lines of {log}:", tail)
        raise UserError(f"autogen.sh failed (exit {rc}); log: {log}", BUILD_FAILED)
    say(f"  autogen.sh done in {_fmt_s(time.monotonic() - t0)}")


def detect_capabilities(cuda: cudamod.CudaSetup, opts: BuildOptions) -> dict:
    found = {k: header_available(h, cuda.cppflags()) for k, h in HEADER_PROBES.items()}
    caps = {"verbs": found["verbs"], "rdmacm": found["rdmacm"], "numa": found["numa"],
            "cuda": cuda.kind != "none", "gdrcopy": None}
    if opts.gdrcopy is not None:
        if not (opts.gdrcopy / "include" / "gdrapi.h").is_file():
            raise UserError(f"--gdrcopy {opts.gdrcopy}: no include/gdrapi.h there", MISSING_CAPABILITY)
        caps["gdrcopy"] = str(opts.gdrcopy)
    missing = []
    if "ib" in opts.require:
        missing += [f"{k} ({HEADER_PROBES[k]})" for k in ("verbs", "rdmacm") if not found[k]]
    if "cuda" in opts.require and not caps["cuda"]:
        missing.append("cuda (--cuda none)")
    if "gdrcopy" in opts.require and caps["gdrcopy"] is None:
        missing.append("gdrcopy (no --gdrcopy DIR)")
    if missing:
        raise UserError(f"required capability missing: {'; '.join(missing)} (Debian: libibverbs-dev librdmacm-dev; "
                        f"or drop it from --require)", MISSING_CAPABILITY)
    for k in ("verbs", "rdmacm"):
        if not found[k]:
            warn(f"{HEADER_PROBES[k]} not found: building UCX --without-{k} (InfiniBand unavailable)")
    return caps


def configure_command(stack: Stack, cuda: cudamod.CudaSetup, caps: dict, paths: repro.PathMap) -> list[str]:
    """contrib/configure-release + stack.toml [ucx.configure].flags + detected flags. The only place they meet.

    The prefix is always stack.toml [image].ucx_prefix: UCX compiles its prefix into libucs (fallback module
    directory, ucx.conf) and the whole line into ucx_info; the build installs a relocated copy wherever asked."""
    cmd = ["contrib/configure-release", f"--prefix={stack.image.ucx_prefix}", *stack.configure_flags]
    cmd.append(f"--with-cuda={cuda.home}" if cuda.kind != "none" else "--without-cuda")
    cmd += ["--with-verbs" if caps["verbs"] else "--without-verbs",
            "--with-rdmacm" if caps["rdmacm"] else "--without-rdmacm"]
    cmd.append(f"--with-gdrcopy={caps['gdrcopy']}" if caps["gdrcopy"] else "--without-gdrcopy")
    # Variables on the configure line replace the environment's, so keep what the caller set (conda's CFLAGS and
    # LDFLAGS carry its sysroot and rpath) and add ours. UCX's own -O3 -g -Wall -Werror come from BASE_CFLAGS.
    # The prefix maps keep the work directory out of debug info and __FILE__ (nvcc: for its host compiler).
    extra = {"CPPFLAGS": cuda.cppflags(), "CFLAGS": paths.compiler_flags(), "CXXFLAGS": paths.compiler_flags(),
             "NVCCFLAGS": paths.nvcc_flags(), "LDFLAGS": cuda.ldflags()}
    for var, ours in extra.items():
        value = " ".join(filter(None, [os.environ.get(var, "").strip(), *ours]))
        if value:
            cmd.append(f"{var}={value}")
    return cmd


def map_configure_line(src: Path, paths: repro.PathMap) -> None:
    """UCX compiles its configure line (config.h UCX_CONFIGURE_FLAGS; ucx_info -v and -b print it): the same line
    with the build's directories as their stand-ins, so the binaries do not depend on the work directory."""
    config_h = src / "config.h"
    text = config_h.read_text()
    new = re.sub(r'(?m)^(#define UCX_CONFIGURE_FLAGS )(".*")$', lambda m: m.group(1) + paths.text(m.group(2)), text)
    if new == text and paths.dirs and any(d in text for d in paths.dirs):
        raise UserError(f"{config_h}: no UCX_CONFIGURE_FLAGS line to map (unexpected UCX layout)", BUILD_FAILED)
    config_h.write_text(new)


def parse_configure_summary(lines: list[str]) -> dict[str, list[str] | str]:
    """`UCT modules:   < cuda ib rdmacm cma >` -> {"UCT modules": ["cma", "cuda", "ib", "rdmacm"]}."""
    out: dict[str, list[str] | str] = {}
    for line in lines:
        m = _SUMMARY_LINE.match(line)
        if not m:
            continue
        key, value = m.group(1), m.group(2).strip()
        if value.startswith("<") and value.endswith(">"):
            out[key] = sorted(value.strip("<> ").split())
        elif key.endswith("modules"):
            out[key] = sorted(value.split())
    return out


def configure(stack: Stack, src: Path, cmd: list[str], env: dict, log: Path) -> dict:
    t0 = time.monotonic()
    say("configure: " + shlex.join(cmd))
    rc, _ = run_logged(cmd, src, log, env, "configure")
    output = log.read_text(errors="replace").splitlines()
    if rc != 0:
        _print_tail(f"configure failed; last {CONFIG_LOG_TAIL} lines of {src / 'config.log'}:", _tail(src / "config.log"))
        errors = [ln for ln in output if "error:" in ln]
        why = errors[-1].split("error:", 1)[1].strip() if errors else f"exit {rc}"
        raise UserError(f"configure failed: {why} (config.log: {src / 'config.log'})", BUILD_FAILED)
    summary = parse_configure_summary(output)
    for k in ("UCT modules", "UCM modules", "Perf modules"):
        if k in summary:
            say(f"  {k}: < {' '.join(summary[k])} >")
    say(f"  configure done in {_fmt_s(time.monotonic() - t0)}")
    return summary


def make_and_install(src: Path, stage: Path, jobs: int, env: dict, logs: Path) -> None:
    missing = [d for d in SUBDIRS if not (src / d / "Makefile").is_file()]
    if missing:
        raise UserError(f"configured source lacks {', '.join(missing)}/Makefile (unexpected UCX layout)", BUILD_FAILED)
    steps = [(d, ["make", "-C", d, f"-j{jobs}", "V=0"], ["make", "-C", d, "install", f"DESTDIR={stage}"])
             for d in SUBDIRS]
    steps.append((".", None, ["make", "install-data-am", f"DESTDIR={stage}"]))
    t_all = time.monotonic()
    for i, (d, build_cmd, install_cmd) in enumerate(steps, 1):
        t0 = time.monotonic()
        log = logs / f"make-{d.replace('/', '_').strip('.') or 'top'}.log"
        for cmd in filter(None, (build_cmd, install_cmd)):
            rc, tail = run_logged(cmd, src, log, env, d)
            if rc != 0:
                _print_tail(f"`{shlex.join(cmd)}` failed; last lines of {log}:", tail)
                errs = [ln for ln in tail if "error" in ln.lower()]
                raise UserError(f"make failed in {d}: {(errs or [f'exit {rc}'])[0].strip()} (log: {log})",
                                BUILD_FAILED)
        say(f"[{i}/{len(steps)}] {d}: built and installed in {_fmt_s(time.monotonic() - t0)}")
    say(f"  make + install done in {_fmt_s(time.monotonic() - t_all)}")


def file_manifest(root: Path) -> dict[str, str]:
    """relative path -> sha256 (files) or '-> target' (symlinks): compares two builds byte for byte."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if rel == str(BUILD_INFO):
            continue
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_file():
            out[rel] = sha256_file(p)
    return out


def modules_in(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "lib" / "ucx").glob("*.so")) if (root / "lib" / "ucx").is_dir() else []


def check_required_modules(modules: list[str], require: frozenset[str], stack: Stack) -> list[str]:
    """Missing modules: fatal for required capabilities; for the rest of stack.toml's list, a warning."""
    fatal = sorted({m for cap in require for m in CAPABILITY_MODULES[cap] if m not in modules})
    if fatal:
        raise UserError(f"build finished without required modules {', '.join(fatal)} (see configure summary)",
                        MISSING_CAPABILITY)
    return [m for m in stack.required_modules if m not in modules]


def foreign_in_earlier_build(prefix: Path) -> list[str]:
    """The files in `prefix`, an earlier build of ours (its build info there), that its build info does not list:
    the user's, which replacing the prefix whole would delete. Empty where there is no earlier build."""
    if not (prefix / BUILD_INFO).is_file():
        return []
    try:
        listed = json.loads((prefix / BUILD_INFO).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = {}
    return unknown_entries(prefix, [*listed, BUILD_INFO.as_posix()])


def install_into_prefix(staged: Path, prefix: Path) -> str:
    """A new prefix or one of our earlier builds holding nothing else (checked before the build) is replaced whole;
    files are merged into anything else."""
    ours = (prefix / BUILD_INFO).is_file() and not foreign_in_earlier_build(prefix)
    if not prefix.exists() or ours or (prefix.is_dir() and not any(prefix.iterdir())):
        with atomic_path(prefix, replace_dir=True) as tmp:  # new, empty, or our own earlier build (checked above)
            shutil.copytree(staged, tmp, symlinks=True)
        return "replaced" if ours else "created"
    shutil.copytree(staged, prefix, symlinks=True, dirs_exist_ok=True)
    return "merged"


# --- the whole build -----------------------------------------------------------------------------------------------

def input_key(stack: Stack, opts: BuildOptions, patches: list[Path]) -> str:
    """Hash of everything the prefix's bytes depend on. Not the checkout, work directory or --prefix: the build maps
    those out of its output, so builds that differ only there give the same bytes."""
    cuda_choice: dict = {"spec": opts.cuda}
    home = Path(opts.cuda).resolve() if opts.cuda not in ("auto", "none") else \
        (cudamod.auto_toolkit() if opts.cuda == "auto" else None)
    if home is not None:
        inc = cudamod.include_dir_of(home)
        cuda_choice.update(toolkit=str(home), version=cudamod.cuda_version(inc) if inc else None)
    elif opts.cuda == "auto":
        cuda_choice["pinned"] = [[a.name, a.sha256] for a in (*stack.cuda_header_wheels, *stack.cuda_link_debs)]
    return repro.key_of({
        "source": [stack.ucx.name, stack.ucx.content_tree],
        "patches": [[p.name, sha256_file(p)] for p in patches],
        "configure_flags": list(stack.configure_flags),
        "configured_prefix": stack.image.ucx_prefix,
        "build_root": stack.build_root,
        "source_date_epoch": stack.source_date_epoch,
        "cuda": cuda_choice,
        "cuda_link_dir": str(opts.cuda_link_dir) if opts.cuda_link_dir else None,
        "gdrcopy": str(opts.gdrcopy) if opts.gdrcopy else None,
        "require": sorted(opts.require),
        "headers": {k: header_available(h, []) for k, h in sorted(HEADER_PROBES.items())},
        "keep_debug": opts.keep_debug,
        "tools": repro.tool_versions("cc", "c++", "ld", "strip", "patchelf", "autoconf", "automake", "libtool"),
        "caller_flags": repro.caller_flags(),
        "machine": os.uname().machine,
        "builder": repro.builder_code(),
    })


def up_to_date(prefix: Path, key: str) -> bool:
    """--prefix holds our build with this input key, every file as its build info records it."""
    info = read_build_info(prefix)
    if info is None:
        return False
    return info.get("input_key") == key and file_manifest(prefix) == info.get("files")


def build(stack: Stack, opts: BuildOptions) -> dict:
    """Run every step; --prefix is touched only at the very end (replaced when new or one of our earlier builds,
    otherwise merged into, e.g. a conda $PREFIX)."""
    with repro.fixed_umask():
        patches = patches_for(stack.ucx.version, opts.patches_root or stack.root / "ucx-src-build" / "patches")
        key = input_key(stack, opts, patches)
        prefix = opts.prefix.resolve()
        if up_to_date(prefix, key):
            say(f"{prefix}: UCX built from the same inputs already (input key {key}); nothing to do")
            repro.write_stamp(opts.stamp, key)
            return read_build_info(prefix)
        foreign = foreign_in_earlier_build(prefix)
        if foreign:  # replaced whole at the end, it would take the user's files with it: refused before the build
            raise UserError(f"--prefix {prefix}: an earlier build holding {first_of(foreign)}, which its build info "
                            "does not list; move it away, or give a new or empty prefix", OUTPUT_REFUSED)
        with build_work_dir(opts.work_dir, "ucx-build-") as work:
            info = _build(stack, opts, work, key, patches)
    repro.write_stamp(opts.stamp, key)
    return info


@contextlib.contextmanager
def build_work_dir(given: Path | None, temp_prefix: str, tell: Callable[[str], None] = warn) -> Iterator[Path]:
    """--work-dir, claimed (new, empty or claimed before), or a new temporary directory: removed afterwards unless a
    build step failed (then its logs are what the user needs, and the error names them)."""
    own = given is None
    work = Path(tempfile.mkdtemp(prefix=temp_prefix)) if own else claim_work_dir(given.resolve(), "--work-dir")
    try:
        yield work
    except UserError as e:
        if own and e.exit_code == BUILD_FAILED:
            tell(f"work directory kept for inspection: {work}")
        elif own:
            shutil.rmtree(work, ignore_errors=True)
        raise
    if own:
        shutil.rmtree(work, ignore_errors=True)


def fresh_logs(work: Path) -> Path:
    """<work>/logs, created empty: the logs of this run's build steps only."""
    logs = work / "logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    return logs


def _build(stack: Stack, opts: BuildOptions, work: Path, key: str, patches: list[Path]) -> dict:
    t_start = time.monotonic()
    prefix = opts.prefix.resolve()
    jobs = opts.jobs or (os.cpu_count() or 1) + 1
    logs = fresh_logs(work)
    env = repro.build_env(stack)
    # The work directory and this checkout as the compilers and the recorded configure line show them.
    paths = repro.PathMap.of({work: repro.stand_in(stack, "ucx"), stack.root: repro.stand_in(stack, "checkout")})
    fetch_kw = {"cache": (opts.cache or default_cache_dir(stack)).resolve(),
                "dirs": [p.resolve() for p in opts.sources], "offline": opts.offline}
    say(f"build: prefix {prefix}, work dir {work}, -j{jobs}")
    fetched, src, applied = _patched_source(stack, patches, work, env, logs, fetch_kw)
    cuda = cudamod.resolve(opts.cuda, stack, work, link_dir=opts.cuda_link_dir, fetch_kw=fetch_kw)
    if cuda.kind != "none":
        say(f"CUDA {cuda.version}: headers {cuda.include_dir}; link libraries from {cuda.link_source}")
    caps = detect_capabilities(cuda, opts)
    say("capabilities: " + ", ".join(f"{k}={'yes' if v else 'no'}" if not isinstance(v, str) else f"{k}={v}"
                                     for k, v in caps.items()))
    cmd = configure_command(stack, cuda, caps, paths)
    summary = configure(stack, src, cmd, env, logs / "configure.log")
    map_configure_line(src, paths)
    if "ib" in opts.require and not {"ib", "rdmacm"} <= set(summary.get("UCT modules", [])):
        raise UserError(f"configure did not enable ib+rdmacm (UCT modules: {summary.get('UCT modules')}); "
                        f"see {src / 'config.log'}", MISSING_CAPABILITY)

    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    make_and_install(src, stage, jobs, env, logs)
    root = stage / stack.image.ucx_prefix.lstrip("/")
    stripped = 0 if opts.keep_debug else relocate.strip_debug(root)
    reloc = relocate.make_relocatable(root, stack.image.ucx_prefix)
    modules = modules_in(root)
    not_built = check_required_modules(modules, opts.require, stack)
    for m in not_built:
        warn(f"{m} was not built (capability not available here and not --require'd)")

    info = _build_info(stack, opts, key, fetched, applied, paths.text(shlex.join(cmd)), summary,
                       {**caps, "cuda": paths.data(cuda.record()) if cuda.kind != "none" else None,
                        "required": sorted(opts.require)}, modules, not_built, reloc)
    info["files"] = file_manifest(root)
    leaks = repro.paths_in(root, paths.dirs + [str(prefix)])
    info["build_paths_found"] = leaks
    for rel, dirs in leaks.items():
        warn(f"{rel} still names {', '.join(dirs)}: this prefix depends on where it was built")
    atomic_write_text(root / BUILD_INFO, json.dumps(info, indent=2, sort_keys=True) + "\n")
    relocate.clamp_mtimes(root, stack.source_date_epoch)
    how = install_into_prefix(root, prefix)
    say(f"installed into {prefix} ({how}); {len(modules)} modules: {' '.join(modules)}")
    if stripped:
        say(f"  stripped debug info from {stripped} ELF files")
    say(f"done in {_fmt_s(time.monotonic() - t_start)}")
    return info


def _patched_source(stack: Stack, patches: list[Path], work: Path, env: dict[str, str], logs: Path,
                    fetch_kw: dict) -> tuple[FetchedSource, Path, list]:
    """UCX's source fetched, unpacked under <work>/src, patched and (from a git tree) autogen'd: (what was fetched,
    the tree, the patches applied)."""
    fetched: FetchedSource = fetch_source(stack.ucx, **fetch_kw)
    check_tools(bool(patches))

    say(f"unpack {fetched.path.name}")
    src = unpack(fetched.path, work / "src")
    # autogen/configure ask `git` for a revision; in a work dir inside another checkout (this repository) git would
    # find THAT repository and stamp its commit into UCX (ucx_info -v, version.h). Stop the search at the tree.
    env["GIT_CEILING_DIRECTORIES"] = str(src.parent)
    applied = apply_patches(src, patches, logs / "patch.log") if patches else []
    if not patches:
        say(f"  no patches for UCX {stack.ucx.version}")
    if not (src / "configure").is_file():
        autogen(src, env, logs / "autogen.log")
    return fetched, src, applied


def _build_info(stack: Stack, opts: BuildOptions, key: str, fetched: FetchedSource, applied: list, command: str,
                summary: dict, capabilities: dict, modules: list[str], not_built: list[str], reloc) -> dict:
    """The build info's record of the inputs and of what was built (the files are added once installed)."""
    return {
        "schema": 1,
        "input_key": key,
        "ucx_version": fetched.source.version,
        "source": fetched.record(),
        "patches": applied,
        "configure": {"command": command, "stack_flags": list(stack.configure_flags), "summary": summary},
        "capabilities": capabilities,
        "modules": modules,
        "modules_missing": not_built,
        "relocatable": reloc,
        "stripped": not opts.keep_debug,
        "source_date_epoch": stack.source_date_epoch,
        "compiler": repro.tool_versions("cc")["cc"],
        "stack": {"name": stack.name, "version": stack.version, "stack_toml_sha256": sha256_file(stack.path)},
        "build_prefix": stack.image.ucx_prefix,  # configured and compiled in; --prefix is a relocated copy of it
    }
