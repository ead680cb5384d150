"""Run a recipe's build the way conda-build does (sources, environment contract, script, post-processing), minus conda.

conda-build's contract, kept here:
- sources: `url` archives are verified by sha256 and unpacked (a single top directory hoisted) into $SRC_DIR/<folder>;
  `path` sources are copied (here: the files git tracks or would track, not .venv or build outputs);
- the host prefix $PREFIX is a long placeholder path (`…/_h_env_placehold_placehold…`, 255 characters) so that
  installers can patch it, also inside binaries; $BUILD_PREFIX holds the build tools; the script runs with
  `bash -e` in $SRC_DIR with PREFIX, BUILD_PREFIX, SRC_DIR, RECIPE_DIR, CPU_COUNT, PKG_NAME, PKG_VERSION, PKG_BUILDNUM,
  PKG_BUILD_STRING, PKG_HASH, PYTHON, SHLIB_EXT, target_platform, the used variant keys and only the build/script_env
  variables of the caller's environment;
- the package holds the files the build added to $PREFIX; ELF RUNPATHs into $PREFIX become $ORIGIN-relative; files that
  contain $PREFIX are recorded (text or binary) for prefix replacement; every DT_NEEDED must be satisfied by the package
  itself, glibc, a whitelisted driver library or a declared requirement (conda-build's overlinking check).

Where this differs (no conda here): the build and host requirements are not installed from conda-forge. The build
machine's tools and -dev packages stand in for them (python for the build env is the system python3; a noarch python
recipe's host env is a venv at $PREFIX with its host requirements from PyPI). What stood in is recorded in the
package's about.json, and the package's depends are what its binaries really need here (`__glibc >=` the newest
GLIBC_ symbol version they use), not conda-forge's run_exports.
"""
from __future__ import annotations

import fnmatch
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BUILD_FAILED, HASH_MISMATCH, PACKAGE_INVALID, SOURCE_UNREACHABLE, UserError
from ..fsutil import ELF_MAGIC, is_elf, sha256_file
from .render import PLATFORM, Rendered

PREFIX_LENGTH = 255
GLIBC_SONAMES = {"libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libutil.so.1",
                 "libresolv.so.2", "libanl.so.1", "ld-linux-x86-64.so.2", "libmvec.so.1"}
# soname -> the conda-forge package that provides it, and the recipe requirements that bring that package in
# (directly, or through a compiler's run_exports).
SONAME_PACKAGES: dict[str, tuple[str, tuple[str, ...]]] = {
    "libstdc++.so.6": ("libstdcxx", ("gxx_linux-64", "libstdcxx", "libstdcxx-ng")),
    "libgcc_s.so.1": ("libgcc", ("gcc_linux-64", "gxx_linux-64", "libgcc", "libgcc-ng")),
    "libgomp.so.1": ("libgomp", ("gcc_linux-64", "libgomp")),
    "libibverbs.so.1": ("rdma-core", ("rdma-core",)),
    "librdmacm.so.1": ("rdma-core", ("rdma-core",)),
    "libmlx5.so.1": ("rdma-core", ("rdma-core",)),
    "libefa.so.1": ("rdma-core", ("rdma-core",)),
    "libnuma.so.1": ("libnuma", ("libnuma",)),
    "libcudart.so.12": ("cuda-cudart", ("cuda-cudart", "cuda-cudart-dev")),
    "libcudart.so.13": ("cuda-cudart", ("cuda-cudart", "cuda-cudart-dev")),
}
LOG_TAIL = 25


@dataclass
class BuiltPackage:
    rendered: Rendered
    prefix: Path  # the placeholder prefix the build installed into
    root: Path  # package payload root (== prefix for binary packages; a re-laid tree for noarch python)
    files: list[str]  # payload paths relative to root, sorted
    prefix_files: dict[str, str] = field(default_factory=dict)  # path -> "text" | "binary"
    depends: list[str] = field(default_factory=list)
    constrains: list[str] = field(default_factory=list)
    license_files: list[Path] = field(default_factory=list)
    src_dir: Path | None = None
    log: Path | None = None
    extra: dict = field(default_factory=dict)  # about.json "extra": how this was built


def placeholder_prefix(build_folder: Path) -> Path:
    """conda-build's host prefix: <build folder>/_h_env_placehold_placehold…, exactly PREFIX_LENGTH characters."""
    base = str(build_folder / "_h_env")
    if len(base) + 10 > PREFIX_LENGTH:
        raise UserError(f"work directory {build_folder} is too long for a {PREFIX_LENGTH}-character placeholder",
                        BUILD_FAILED)
    while len(base) < PREFIX_LENGTH:
        base += "_placehold"
    return Path(base[:PREFIX_LENGTH])


# --- sources ----------------------------------------------------------------------------------------------------------

def _extract(archive: Path, dest: Path) -> None:
    """Unpack like conda-build: into dest, hoisting a single top-level directory."""
    tmp = Path(tempfile.mkdtemp(prefix=".unpack-", dir=dest.parent))
    try:
        try:
            with tarfile.open(archive) as tf:
                tf.extractall(tmp, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise UserError(f"cannot unpack {archive.name}: {e}", BUILD_FAILED) from None
        entries = list(tmp.iterdir())
        top = entries[0] if len(entries) == 1 and entries[0].is_dir() else tmp
        dest.mkdir(parents=True, exist_ok=True)
        for entry in top.iterdir():
            shutil.move(str(entry), dest / entry.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tracked_files(root: Path) -> list[str] | None:
    """Files git tracks or would track under root (None when root is not in a git work tree)."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                              capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return sorted({f for f in proc.stdout.decode().split("\0") if f})


def _copy_path_source(src: Path, dest: Path) -> int:
    files = _tracked_files(src)
    if files is None:
        shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)
        return sum(1 for _ in dest.rglob("*"))
    n = 0
    for rel in files:
        s = src / rel
        if not (s.is_file() or s.is_symlink()):
            continue  # deleted in the work tree but still in the index
        d = dest / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.is_symlink():
            os.symlink(os.readlink(s), d)
        else:
            shutil.copy2(s, d)
        n += 1
    return n


def prepare_sources(r: Rendered, src_dir: Path, sources_dir: Path | None) -> list[str]:
    """Fill $SRC_DIR from the recipe's sources; returns one line per source for the build record."""
    notes = []
    for i, s in enumerate(r.sources()):
        folder = src_dir / str(s["folder"]) if s.get("folder") else src_dir
        if "url" in s:
            urls = s["url"] if isinstance(s["url"], list) else [s["url"]]
            fn = str(s.get("fn") or Path(str(urls[0])).name)
            archive = sources_dir / fn if sources_dir else None
            if archive is None or not archive.is_file():
                raise UserError(f"{r.recipe_dir.name}: url source {fn} is not in {sources_dir or '(no --sources)'}; "
                                f"this chain does not download (run `ucx-src-build/build.sh fetch --dest DIR`)",
                                SOURCE_UNREACHABLE)
            got = sha256_file(archive)
            if got != str(s.get("sha256")):
                raise UserError(f"{r.recipe_dir.name}: {archive} sha256 {got} != the recipe's {s.get('sha256')}",
                                HASH_MISMATCH)
            _extract(archive, folder)
            notes.append(f"url {urls[0]} ({fn}, sha256 verified) -> {folder.relative_to(src_dir)}")
        elif "path" in s:
            path = (r.recipe_dir / str(s["path"])).resolve()
            n = _copy_path_source(path, folder)
            notes.append(f"path {s['path']} ({n} files) -> {folder.relative_to(src_dir) if folder != src_dir else '.'}")
        else:
            raise UserError(f"{r.recipe_dir.name}: source[{i}] kind not supported here (url and path are)",
                            BUILD_FAILED)
    return notes


# --- environment ------------------------------------------------------------------------------------------------------

def _python_info(python: str) -> tuple[str, str]:
    out = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return out, f"lib/python{out}/site-packages"


def make_host_env(r: Rendered, prefix: Path, log) -> dict:
    """A host env for recipes that need python in host (a venv at $PREFIX + host requirements from PyPI)."""
    host = [spec.split()[0] for spec in r.requirements("host")]
    if "python" not in host:
        prefix.mkdir(parents=True)
        return {"host_env": "empty prefix; host requirements provided by the build machine's system packages",
                "host_requirements": r.requirements("host")}
    want = r.variant.get("python_min") or r.variant.get("python")
    py = sys.executable
    have, _ = _python_info(py)
    if want and have != want:
        raise UserError(f"{r.recipe_dir.name}: host needs python {want}, this machine runs {have}", BUILD_FAILED)
    _run_logged([py, "-m", "venv", str(prefix)], cwd=prefix.parent, env=os.environ.copy(), log=log, what="host venv")
    extra = [h for h in host if h not in ("python", "pip")]
    if extra:
        _run_logged([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     *extra], cwd=prefix.parent, env=os.environ.copy(), log=log, what="host requirements (PyPI)")
    return {"host_env": f"python {have} venv at $PREFIX; {', '.join(extra) or 'nothing'} from PyPI",
            "host_requirements": r.requirements("host")}


def make_build_env(build_prefix: Path) -> dict:
    """$BUILD_PREFIX/bin/python: the machine's python3 stands in for the build env's python."""
    (build_prefix / "bin").mkdir(parents=True)
    py3 = shutil.which("python3") or sys.executable
    os.symlink(py3, build_prefix / "bin" / "python")
    return {"build_env": f"build machine's tools on PATH; $BUILD_PREFIX/bin/python -> {py3}"}


def contract_env(r: Rendered, *, prefix: Path, build_prefix: Path, src_dir: Path, caller_env: dict[str, str],
                 python_site: str | None = None) -> dict[str, str]:
    env = {
        "PATH": f"{prefix}/bin:{build_prefix}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": caller_env.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "TMPDIR": caller_env.get("TMPDIR", "/tmp"),
        "PREFIX": str(prefix),
        "BUILD_PREFIX": str(build_prefix),
        "SRC_DIR": str(src_dir),
        "RECIPE_DIR": str(r.recipe_dir),
        "CPU_COUNT": str(os.cpu_count() or 1),
        "PKG_NAME": r.name,
        "PKG_VERSION": r.version,
        "PKG_BUILDNUM": str(r.build_number),
        "PKG_BUILD_STRING": r.build_string,
        "PKG_HASH": r.pkg_hash,
        "PYTHON": f"{prefix}/bin/python",
        "SHLIB_EXT": ".so",
        "CONDA_BUILD": "1",
        "CONDA_BUILD_STATE": "BUILD",
        "target_platform": PLATFORM,
        "build_platform": PLATFORM,
        "SUBDIR": PLATFORM,
        "ARCH": "64",
    }
    if python_site:
        env["SP_DIR"] = f"{prefix}/{python_site}"
    env.update(r.variant)
    for name in r.build.get("script_env") or []:
        name = str(name)
        if "=" in name:
            k, v = name.split("=", 1)
            env[k] = v
        elif name in caller_env:
            env[name] = caller_env[name]
    return env


def _run_logged(cmd: list[str], *, cwd: Path, env: dict, log, what: str) -> None:
    log.write(f"\n$ {shlex.join(cmd)}\n")
    log.flush()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise UserError(f"{what} failed (exit {proc.returncode}; log {log.name})", BUILD_FAILED)


def _tail(path: Path, n: int = LOG_TAIL) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def run_script(r: Rendered, env: dict[str, str], src_dir: Path, log_path: Path) -> None:
    script = r.recipe_dir / "build.sh"
    inline = r.build.get("script")
    if inline:
        body = "\n".join(map(str, inline)) if isinstance(inline, list) else str(inline)
        script = src_dir / "conda_build.sh"
        script.write_text(body + "\n")
    elif not script.is_file():
        raise UserError(f"{r.recipe_dir.name}: no build.sh and no build/script", BUILD_FAILED)
    with open(log_path, "a") as log:
        log.write(f"\n$ bash -e {script}  (cwd {src_dir})\n")
        log.flush()
        proc = subprocess.run(["bash", "-e", str(script)], cwd=src_dir, env=env, stdout=log,
                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = _tail(log_path)
        print(f"--- last lines of {log_path} ---", file=sys.stderr)
        for line in tail:
            print(f"  {line}", file=sys.stderr)
        errs = [ln.strip() for ln in tail if re.search(r"error", ln, re.I)]
        reason = errs[-1] if errs else (tail[-1].strip() if tail else "no output")
        raise UserError(f"{r.recipe_dir.name}/{script.name} failed (exit {proc.returncode}): {reason} "
                        f"(log: {log_path})", BUILD_FAILED)


# --- post-processing --------------------------------------------------------------------------------------------------

def snapshot(root: Path) -> set[str]:
    if not root.exists():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _patchelf(*args: str) -> str:
    try:
        proc = subprocess.run(["patchelf", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise UserError("patchelf not found (apt-get install patchelf)", BUILD_FAILED) from None
    if proc.returncode != 0:
        raise UserError(f"patchelf {' '.join(args[:-1])} {args[-1]}: {proc.stderr.strip()}", PACKAGE_INVALID)
    return proc.stdout.strip()


def relativize_rpaths(root: Path, files: list[str], prefix: Path) -> dict[str, str]:
    """conda-build's mk_relative: RUNPATH entries inside $PREFIX -> $ORIGIN-relative. Entries pointing anywhere else on
    the build machine cannot work after installation: PACKAGE_INVALID."""
    changed = {}
    for rel in files:
        p = root / rel
        if not is_elf(p):
            continue
        current = _patchelf("--print-rpath", str(p))
        if not current:
            continue
        new = []
        for entry in current.split(":"):
            if entry.startswith("$ORIGIN") or not entry:
                new.append(entry)
            elif entry == str(prefix) or entry.startswith(str(prefix) + "/"):
                relp = os.path.relpath(entry, (prefix / rel).parent)
                new.append("$ORIGIN" if relp == "." else f"$ORIGIN/{relp}")
            else:
                raise UserError(f"{rel} has RUNPATH {entry}, a build-machine path outside $PREFIX", PACKAGE_INVALID)
        joined = ":".join(dict.fromkeys(new))
        if joined != current:
            _patchelf("--set-rpath", joined, str(p))
            changed[rel] = joined
    return changed


def glibc_floor(root: Path, files: list[str]) -> str | None:
    """The newest GLIBC_x.y symbol version any ELF file needs (its __glibc floor)."""
    best: tuple[int, ...] | None = None
    for rel in files:
        p = root / rel
        if not is_elf(p):
            continue
        out = subprocess.run(["objdump", "-T", str(p)], capture_output=True, text=True).stdout
        for v in re.findall(r"\bGLIBC_(\d+(?:\.\d+)+)\b", out):
            t = tuple(int(x) for x in v.split("."))
            best = t if best is None or t > best else best
    return ".".join(map(str, best)) if best else None


def check_linkage(r: Rendered, root: Path, files: list[str]) -> dict[str, str]:
    """Every DT_NEEDED is satisfied by the package, glibc, a whitelisted DSO, or a requirement that provides it.
    Returns {soname: how it is satisfied} for the sonames from outside the package."""
    provided = {Path(f).name for f in files}
    reqs = {spec.split()[0] for kind in ("build", "host", "run") for spec in r.requirements(kind)}
    whitelist = [str(w) for w in r.build.get("missing_dso_whitelist") or []]
    external: dict[str, str] = {}
    problems = []
    for rel in files:
        p = root / rel
        if not is_elf(p):
            continue
        for soname in filter(None, _patchelf("--print-needed", str(p)).splitlines()):
            if soname in provided:
                continue
            if soname in GLIBC_SONAMES:
                external[soname] = "glibc (__glibc)"
            elif any(fnmatch.fnmatch(f"/{soname}", w) or fnmatch.fnmatch(soname, w) for w in whitelist):
                external[soname] = "host driver (missing_dso_whitelist)"
            elif soname in SONAME_PACKAGES and reqs & set(SONAME_PACKAGES[soname][1]):
                pkg, via = SONAME_PACKAGES[soname]
                external[soname] = f"{pkg} (via {', '.join(sorted(reqs & set(via)))})"
            else:
                problems.append(f"{rel} needs {soname}, which neither the package nor a requirement provides")
    if problems:
        raise UserError(f"{r.recipe_dir.name}: overlinking: {problems[0]}"
                        + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""), PACKAGE_INVALID)
    return dict(sorted(external.items()))


def detect_prefix_files(root: Path, files: list[str], prefix: Path) -> dict[str, str]:
    needle = str(prefix).encode()
    out = {}
    for rel in files:
        p = root / rel
        if p.is_symlink() or not p.is_file():
            continue
        data = p.read_bytes()
        if needle in data:
            out[rel] = "binary" if (b"\0" in data or data[:4] == ELF_MAGIC) else "text"
    return out


def noarch_python_layout(r: Rendered, prefix: Path, files: list[str], dest: Path, site: str) -> list[str]:
    """conda-build's noarch: python transform: site-packages/ and python-scripts/, entry points left to the installer."""
    eps = {str(e).split("=")[0].strip() for e in r.build.get("entry_points") or []}
    out = []
    for rel in files:
        parts = Path(rel).parts
        if "__pycache__" in parts or rel.endswith(".pyc") or rel.endswith(".dist-info/direct_url.json"):
            continue
        if rel.startswith(site + "/"):
            new = "site-packages/" + rel[len(site) + 1:]
        elif parts[0] == "bin":
            if parts[-1] in eps:
                continue
            new = "python-scripts/" + "/".join(parts[1:])
        else:
            raise UserError(f"{r.recipe_dir.name}: noarch python package installs {rel} outside site-packages/bin",
                            PACKAGE_INVALID)
        target = dest / new
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(prefix / rel, target, follow_symlinks=False)
        if new.endswith(".dist-info/INSTALLER"):
            target.write_text("conda\n")
        out.append(new)
    return sorted(out)


def find_license_files(r: Rendered, src_dir: Path) -> list[Path]:
    lf = (r.meta.get("about") or {}).get("license_file")
    out = []
    for f in (lf if isinstance(lf, list) else [lf] if lf else []):
        for base in (r.recipe_dir, src_dir):
            if (base / str(f)).is_file():
                out.append(base / str(f))
                break
        else:
            raise UserError(f"{r.recipe_dir.name}: about/license_file {f} not found in the recipe or $SRC_DIR",
                            PACKAGE_INVALID)
    return out


# --- the whole build --------------------------------------------------------------------------------------------------

def build(r: Rendered, *, croot: Path, sources_dir: Path | None, caller_env: dict[str, str],
          log_dir: Path) -> BuiltPackage:
    """Build one rendered recipe variant under conda-build's contract. Everything happens under croot."""
    build_folder = croot / f"{r.name}_{r.build_string}"
    shutil.rmtree(build_folder, ignore_errors=True)
    build_folder.mkdir(parents=True)
    src_dir = build_folder / "work"
    src_dir.mkdir()
    build_prefix = build_folder / "_build_env"
    prefix = placeholder_prefix(build_folder)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{r.dist}.log"
    log_path.write_text(f"# {r.dist}: conda-build contract, emulated by ucx-dask-gpu (no conda on this machine)\n")

    notes = prepare_sources(r, src_dir, sources_dir)
    extra: dict = {"sources": notes}
    extra.update(make_build_env(build_prefix))
    with open(log_path, "a") as log:
        extra.update(make_host_env(r, prefix, log))
    python_site = None
    if r.noarch == "python":
        python_site = _python_info(str(prefix / "bin" / "python"))[1]
    before = snapshot(prefix)
    env = contract_env(r, prefix=prefix, build_prefix=build_prefix, src_dir=src_dir, caller_env=caller_env,
                       python_site=python_site)
    print(f"[conda] building {r.dist} (log: {log_path})", flush=True)
    run_script(r, env, src_dir, log_path)
    new_files = sorted(f for f in snapshot(prefix) - before if not f.startswith("conda-meta/"))
    if not new_files:
        raise UserError(f"{r.recipe_dir.name}: the build installed nothing into $PREFIX", PACKAGE_INVALID)

    pkg = BuiltPackage(rendered=r, prefix=prefix, root=prefix, files=new_files, src_dir=src_dir, log=log_path)
    pkg.license_files = find_license_files(r, src_dir)
    pkg.constrains = r.requirements("run_constrained")
    if r.noarch == "python":
        payload = build_folder / "noarch_payload"
        pkg.root = payload
        pkg.files = noarch_python_layout(r, prefix, new_files, payload, python_site)
        leaked = detect_prefix_files(payload, pkg.files, prefix)
        if leaked:
            raise UserError(f"{r.recipe_dir.name}: noarch package file {next(iter(leaked))} contains the build prefix",
                            PACKAGE_INVALID)
        pkg.depends = r.requirements("run")
        extra["entry_points"] = [str(e) for e in r.build.get("entry_points") or []]
    else:
        extra["rpaths_rewritten"] = relativize_rpaths(prefix, new_files, prefix)
        extra["linked_outside_package"] = check_linkage(r, prefix, new_files)
        pkg.prefix_files = detect_prefix_files(prefix, new_files, prefix)
        floor = glibc_floor(prefix, new_files)
        pkg.depends = list(r.requirements("run")) + ([f"__glibc >={floor}"] if floor else [])
        extra["glibc_floor"] = floor
        extra["note"] = ("built on a machine without conda: build/host requirements were stood in for by the build "
                         "machine's system packages, so depends are what these binaries need here (__glibc from their "
                         "GLIBC_ symbol versions; the libraries in linked_outside_package from the host system), "
                         "not conda-forge's run_exports")
    pkg.extra = extra
    return pkg
