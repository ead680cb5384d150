"""Build the one image (docker/Dockerfile): fetch and verify every input, stage a context, `docker build --network none`.

Each step fails with one line and its own exit code before anything later starts; the context holds only verified
files, with stack.toml's mtimes and git's permission bits, so a checkout made under another umask gives the same
layers. The `ucx` stage builds in the background while the other inputs are fetched; its build info must match the
UCX the UCXX wheels were built against, and the stack id predicted from the lock and the wheels (gate/identity.py)
must be the one the image computes from what it installed.

The classic builder (DOCKER_BUILDKIT=0) is used on purpose: it is what Debian's docker.io 20.10 ships, it honours
`--network none` for every RUN, and the reproducible-image work builds on its layer format.
"""
from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cliutil import Progress
from ..errors import BUILD_FAILED, HASH_MISMATCH, UCX_NOT_FOUND, UserError
from ..fsutil import atomic_write_text, sha256_file
from ..gate import identity
from ..stack import STACK_ID_FILE, Stack
from ..stack.lock import canonical, load_lock
from ..ucx.install import BUILD_INFO, UCXX_BUILD_INFO, read_ucxx_build_info
from ..ucxbuild.ucxx import ucx_identity
from . import bases, leftovers, wheelhouse
from .docker import docker, docker_bin, engine_version, image_inspect, last_line
from .labels import build_labels
from .normalise import Timings, finish_build
from .paths import UCX_SOURCES, image_ref, stage_ref, work_dir

# Records in the image's /etc/ucx-dask-gpu of what was installed on top of the lock, by sha256.
EXTRA_LOCK_NAME = "extra-requirements.txt"
UCXX_LOCK_NAME = "ucxx-requirements.txt"


say = Progress("image: ")


@dataclass
class BuildResult:
    tag: str
    image_id: str
    size: int
    stack_id: str
    ucx_version: str
    ucxx_version: str
    timings: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


# --- inputs ------------------------------------------------------------------------------------------------------

def ucx_build_files(root: Path) -> list[Path]:
    """Files of this package the UCX build imports (closure over its imports), relative to `root`: only these go into
    the builder stage, so editing an unrelated module does not rebuild UCX in the image."""
    pkg_root = root / "src"
    start = sorted((pkg_root / "ucx_dask_gpu" / "ucxbuild").glob("*.py"))
    seen: set[Path] = set()
    todo = list(start)

    def module_file(parts: list[str]) -> Path | None:
        base = pkg_root.joinpath(*parts)
        for cand in (base.with_suffix(".py"), base / "__init__.py"):
            if cand.is_file():
                return cand
        return None

    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        rel_parts = list(f.relative_to(pkg_root).with_suffix("").parts)
        package = rel_parts[:-1]
        for i in range(1, len(package) + 1):  # every enclosing package's __init__.py runs first
            init = module_file(package[:i])
            if init:
                todo.append(init)
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets: list[list[str]] = []
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - (node.level - 1)] if node.level else []
                mod = base + (node.module.split(".") if node.module else [])
                if mod and mod[0] == "ucx_dask_gpu":
                    targets.append(mod)
                    targets += [mod + [a.name] for a in node.names]  # `from pkg import submodule`
            elif isinstance(node, ast.Import):
                targets += [a.name.split(".") for a in node.names if a.name.split(".")[0] == "ucx_dask_gpu"]
            for t in targets:
                found = module_file(t)
                if found:
                    todo.append(found)
    return sorted(p.relative_to(root) for p in seen)


def fetch_ucx_sources(st: Stack, dest: Path) -> Path:
    """`ucx-src-build/build.sh fetch --dest DEST`: the archive, CUDA wheels and link .debs, verified."""
    script = st.root / "ucx-src-build" / "build.sh"
    if not script.is_file():
        raise UserError(f"{script} is missing (the UCX build script)", BUILD_FAILED)
    say(f"fetching UCX sources into {dest}")
    proc = subprocess.run([str(script), "fetch", "--dest", str(dest)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHON": sys.executable})
    sys.stderr.write(proc.stderr)
    if proc.returncode != 0:
        # The script already said it in one line; carry its reason and its exit code (hash mismatch, unreachable).
        raise UserError(last_line(proc.stderr).split("error: ", 1)[-1], proc.returncode)
    return dest


def link_or_copy(src: Path, dst: Path) -> None:
    """A hard link where the file system allows one, else a copy."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _normalise_context(root: Path, epoch: int) -> None:
    """mtimes = SOURCE_DATE_EPOCH; directories 0755, files 0644 or (owner-executable) 0755, as git checks files out
    under umask 022: COPY keeps both, and neither may depend on when or under which umask a checkout was made."""
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                mode = os.stat(path).st_mode
                want = 0o755 if name in dirnames or mode & 0o100 else 0o644
                if mode & 0o7777 != want:   # files linked from a cache keep their inode untouched when right
                    os.chmod(path, want)
            os.utime(path, (epoch, epoch), follow_symlinks=False)
    os.chmod(root, 0o755)
    os.utime(root, (epoch, epoch))


def stage_ucx_context(st: Stack, ctx: Path, ucx_sources: Path) -> None:
    """Dockerfile + ucx/ (what the `ucx` stage copies)."""
    root = st.root
    _copy(root / "docker" / "Dockerfile", ctx / "Dockerfile")
    tree = ctx / "ucx" / "tree"
    for path in sorted((root / "ucx-src-build").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            _copy(path, tree / path.relative_to(root))
    for rel in ucx_build_files(root):
        _copy(root / rel, tree / rel)
    _copy(st.path, tree / "stack.toml")
    for path in sorted(ucx_sources.rglob("*")):
        if path.is_file() and not path.name.startswith("."):
            link_or_copy(path, ctx / "ucx" / "sources" / path.relative_to(ucx_sources))


def read_ucxx_wheels(st: Stack, directory: Path) -> tuple[list[Path], dict]:
    """The UCXX wheels of `ucx-src-build/build.sh ucxx --out DIR`, each checked against its build info."""
    info = read_ucxx_build_info(directory)
    if info is None:
        raise UserError(f"no UCXX wheels in {directory} (no {UCXX_BUILD_INFO}): build them first with `make ucxx` "
                        f"(ucx-src-build/build.sh ucxx --ucx-prefix <a UCX build> --out {directory})",
                        UCX_NOT_FOUND)
    if info.get("ucxx_version") != st.ucxx.source.version:
        raise UserError(f"{directory}: UCXX {info.get('ucxx_version')}, stack.toml pins {st.ucxx.source.version}: "
                        "rebuild with `make ucxx`", UCX_NOT_FOUND)
    wheels = []
    for pkg in info["packages"]:
        path = directory / pkg["wheel"]
        got = sha256_file(path) if path.is_file() else "missing"
        if got != pkg["sha256"]:
            raise UserError(f"{path}: sha256 {got} is not the {pkg['sha256']} its build info records",
                            HASH_MISMATCH)
        wheels.append(path)
    return wheels, info


def expected_stack_id(st: Stack, ucxx_info: dict, wheels: list[Path]) -> str:
    """The stack id an image installed from the lock, our UCXX wheels and `wheels` (our own, any extra ones, which
    replace the lock's version of their distribution) computes for itself: the hash of its contract terms."""
    versions = {name: pin.version for name, pin in load_lock(st.lock_path()).items()}
    versions.update({canonical(p["name"]): p["version"] for p in ucxx_info.get("packages") or []})
    for w in wheels:
        name, version = wheelhouse.parse_wheel_name(w.name)
        versions[name] = version
    return identity.contract_id(identity.contract(versions, st.python.version))


def wheel_file(path: Path, option: str) -> Path:
    """A wheel given on the command line (`option`), resolved; it must be one."""
    path = Path(path).resolve()
    if not path.is_file() or not path.name.endswith(".whl"):
        raise UserError(f"{option} {path}: not a wheel file", BUILD_FAILED)
    return path


def own_wheel_of(st: Stack, path: Path) -> Path:
    """A wheel given for our own package (`--own-wheel`): it must be one, of this package."""
    path = wheel_file(path, "--own-wheel")
    if wheelhouse.parse_wheel_name(path.name)[0] != canonical(st.name):
        raise UserError(f"--own-wheel {path.name}: not a wheel of {st.name}", BUILD_FAILED)
    return path


def check_ucxx_matches_ucx(ucxx_info: dict, ucx_info: dict) -> None:
    """The wheels must have been built against a UCX of the same source, patches and configure flags."""
    want, have = ucxx_info.get("ucx", {}), ucx_identity(ucx_info)
    differ = [k for k in have if want.get(k) != have[k]]
    if differ:
        raise UserError(f"the UCXX wheels were built against another UCX than the image's (differing: "
                        f"{', '.join(differ)}): rebuild them with `make ucxx`", BUILD_FAILED)


def _stage_hashed_wheels(ctx: Path, folder: str, wheels: list[Path], lock_name: str | None) -> None:
    """Wheels into <ctx>/<folder>/ with a --require-hashes requirements file naming them by their path in the build,
    and (lock_name) the same file in etc/, which the stack id hashes. No wheels: an empty requirements file."""
    (ctx / folder).mkdir(parents=True, exist_ok=True)
    for w in wheels:
        _copy(w, ctx / folder / w.name)
    text = wheelhouse.hashed_requirements(wheels, f"/build/{folder}") if wheels else ""
    (ctx / folder / "requirements.txt").write_text(text)
    if wheels and lock_name:
        (ctx / "etc").mkdir(parents=True, exist_ok=True)
        (ctx / "etc" / lock_name).write_text(text)


def stage_full_context(st: Stack, ctx: Path, ucx_sources: Path, wheels: Path, own_wheel: Path,
                       extra_wheels: list[Path], ucxx_dir: Path, ucxx_wheels: list[Path]) -> None:
    stage_ucx_context(st, ctx, ucx_sources)
    for path in sorted(wheels.glob("*.whl")):
        link_or_copy(path, ctx / "wheelhouse" / path.name)
    _copy(wheels / wheelhouse.LOCK_NAME, ctx / "wheelhouse" / "requirements.txt")
    _stage_hashed_wheels(ctx, "ucxx", ucxx_wheels, UCXX_LOCK_NAME)
    _copy(ucxx_dir / UCXX_BUILD_INFO, ctx / "ucxx" / UCXX_BUILD_INFO)
    _stage_hashed_wheels(ctx, "extra", extra_wheels, EXTRA_LOCK_NAME)
    _stage_hashed_wheels(ctx, "pkg", [own_wheel], None)
    _copy(st.path, ctx / "etc" / "stack.toml")
    _copy(st.lock_path(), ctx / "etc" / st.python.lock)


# --- docker build ------------------------------------------------------------------------------------------------

def build_args(st: Stack, base: str, builder: str) -> dict[str, str]:
    return {
        "BASE_IMAGE": base, "BUILDER_IMAGE": builder, "UCX_PREFIX": st.image.ucx_prefix, "VENV": st.image.venv,
        "IMAGE_USER": st.image.user, "IMAGE_UID": str(st.image.uid), "PYTHON_VERSION": st.python.version,
        "CUDA_MAJOR": str(st.cuda_major), "SOURCE_DATE_EPOCH": str(st.source_date_epoch),
    }


class DockerBuild:
    """Classic `docker build --network none` in the background: output kept in `log` and streamed as progress
    (prefixed), so the UCX stage can compile while the other inputs are fetched."""

    def __init__(self, ctx: Path, tag: str, args: dict[str, str], labels: dict[str, str], log: Path,
                 target: str | None = None, prefix: str = "  | ", no_cache: bool = False):
        cmd = [docker_bin(), "build", "--network", "none", "--force-rm", "-t", tag]
        if no_cache:
            cmd.append("--no-cache")
        if target:
            cmd += ["--target", target]
        for k, v in args.items():
            cmd += ["--build-arg", f"{k}={v}"]
        for k, v in sorted(labels.items()):
            cmd += ["--label", f"{k}={v}"]
        cmd.append(str(ctx))
        self.tag, self.log, self.prefix = tag, log, prefix
        self.last_step, self.tail = "", []
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "DOCKER_BUILDKIT": "0"})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._out.write(line)
            if line.startswith("Step "):
                self.last_step = line.strip()
            if "DEPRECATED: The legacy builder" in line or "BuildKit is currently disabled" in line:
                continue  # the classic builder is chosen on purpose (see the module docstring)
            sys.stderr.write(f"{self.prefix}{line}")
            if line.strip():
                self.tail = (self.tail + [line.strip()])[-5:]

    def wait(self) -> None:
        rc = self.proc.wait()
        self._reader.join()
        self._out.close()
        if rc != 0:
            if any("Cannot connect to the Docker daemon" in t for t in self.tail):
                engine_version()  # raises NO_DOCKER with the usual line
            reason = next((t for t in reversed(self.tail) if "returned a non-zero code" in t or "error" in t.lower()),
                          self.tail[-1] if self.tail else "no output")
            raise UserError(f"docker build {self.tag} failed at {self.last_step or 'start'}: {reason} "
                            f"(log: {self.log})", BUILD_FAILED)

    def cancel(self) -> None:
        """Stop the client; the classic builder then cancels the build and removes its container (--force-rm)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._reader.join(timeout=5)
        self._out.close()


def verify_ucx_stage(st: Stack, stage_tag: str) -> None:
    """`ucx-src-build/build.sh verify` on the built prefix, in a container of the ucx stage (no network); SYS_PTRACE
    lets UCX's cma transport (process_vm_readv) work, which Docker's default seccomp profile blocks."""
    script = "/build/tree/ucx-src-build/build.sh"
    proc = docker(["run", "--rm", "--network", "none", "--cap-add", "SYS_PTRACE", "--entrypoint", script, stage_tag,
                   "verify", "--prefix", st.image.ucx_prefix], code=BUILD_FAILED, what="verifying UCX in the image",
                  check=False, timeout=600)
    for line in proc.stdout.splitlines():
        sys.stderr.write(f"  ucx verify | {line}\n")
    if proc.returncode != 0:
        failed = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("FAIL")] or [last_line(proc.stderr)]
        raise UserError(f"UCX in the image failed verification: {failed[0]}", BUILD_FAILED)


def build_image(st: Stack, cache: Path, ucxx_dir: Path, tag: str | None = None,
                extra_wheels: list[Path] | None = None, base_from: str | None = None,
                normalise: bool = True, own_wheel: Path | None = None, no_cache: bool = False) -> BuildResult:
    """Build `tag` (the arguments are `image build`'s options); with `normalise`, `tag` then names the reproducible
    image with its SBOM, whose id depends on the inputs only."""
    extra_wheels = [wheel_file(w, "--extra-wheel") for w in extra_wheels or []]
    own_wheel = own_wheel_of(st, own_wheel) if own_wheel else None
    tag = tag or image_ref(st)
    cache = cache.resolve()
    timings = Timings()
    t_start = time.monotonic()
    say(f"Docker engine {timings.step('engine', engine_version)}")
    ucxx_dir = ucxx_dir.resolve()
    ucxx_wheels, ucxx_info = read_ucxx_wheels(st, ucxx_dir)
    ucx_sources = timings.step("ucx_sources", fetch_ucx_sources, st, cache / UCX_SOURCES)
    builder = _base(st, "builder", base_from, cache, timings)
    work = work_dir(cache, tag)
    full_ctx = work / "context"
    stage_tag = stage_ref(st, tag)
    t_ucx = time.monotonic()
    ucx_build = _start_ucx_stage(st, work, ucx_sources, stage_tag, builder, no_cache)
    try:
        wheels = timings.step("wheelhouse", wheelhouse.ensure_wheelhouse, st, cache)
        own = own_wheel or timings.step("own_wheel", wheelhouse.build_own_wheel, st, cache / "pkg")
        base = _base(st, "runtime", base_from, cache, timings)
        _fresh_context(st, full_ctx, stage_full_context, ucx_sources, wheels, own, extra_wheels, ucxx_dir,
                       ucxx_wheels)
        say("waiting for the ucx stage")
        ucx_build.wait()
    except BaseException:
        ucx_build.cancel()
        raise
    timings["docker_build_ucx"] = round(time.monotonic() - t_ucx, 1)
    timings.step("verify_ucx", verify_ucx_stage, st, stage_tag)

    info = _ucx_stage_info(st, stage_tag, work, ucxx_info)
    ucx_version = str(info.get("ucx_version", "0"))
    stack_id = expected_stack_id(st, ucxx_info, [own, *extra_wheels])
    labels = build_labels(st, stack_id, info, ucxx_info, base, extra_wheels)
    say(f"building {tag} (stack id {stack_id}) with --network none")
    timings.step("docker_build", lambda: DockerBuild(full_ctx, tag, build_args(st, base, builder), labels,
                                                     work / "logs" / "docker-build.log", no_cache=no_cache).wait())
    _check_stack_id_inside(tag, stack_id)
    _normalise_and_prune(st, tag, stage_tag, cache, work, extra_wheels + ([own_wheel] if own_wheel else []),
                         normalise, timings)
    timings["total"] = round(time.monotonic() - t_start, 1)
    meta = image_inspect(tag) or {}
    result = BuildResult(tag=tag, image_id=meta.get("Id", "?"), size=int(meta.get("Size", 0)), stack_id=stack_id,
                         ucx_version=ucx_version, ucxx_version=str(ucxx_info["ucxx_version"]), timings=dict(timings),
                         labels=labels)
    record = {**result.__dict__, "created_by": "ucx-dask-gpu image build"}
    atomic_write_text(work / "last-build.json", json.dumps(record, indent=2, sort_keys=True) + "\n")
    return result


def _fresh_context(st: Stack, ctx: Path, stage, *args) -> None:
    """A build context staged afresh by `stage(st, ctx, *args)`, then normalised."""
    shutil.rmtree(ctx, ignore_errors=True)
    stage(st, ctx, *args)
    _normalise_context(ctx, st.source_date_epoch)


def _ucx_stage_info(st: Stack, stage_tag: str, work: Path, ucxx_info: dict) -> dict:
    """The ucx stage's build info, copied into `work` byte for byte (the stack id hashes those bytes) and with their
    sha256, checked against the UCX the UCXX wheels were built against."""
    path = f"{st.image.ucx_prefix}/{BUILD_INFO}"
    proc = docker(["run", "--rm", "--network", "none", "--entrypoint", "cat", stage_tag, path], code=BUILD_FAILED,
                  what=f"reading {path} from the ucx stage")
    try:
        info = json.loads(proc.stdout)
    except ValueError:
        raise UserError(f"{path} in the ucx stage is not JSON", BUILD_FAILED) from None
    atomic_write_text(work / BUILD_INFO.name, proc.stdout)
    info["_sha256"] = sha256_file(work / BUILD_INFO.name)
    check_ucxx_matches_ucx(ucxx_info, info)
    say(f"UCX {info.get('ucx_version', '0')} + UCXX {ucxx_info['ucxx_version']} wheels built against the same UCX "
        "source and flags")
    return info


def _base(st: Stack, role: str, base_from: str | None, cache: Path, timings: Timings) -> str:
    """The `role` base image: derived from `base_from`, or debootstrapped (cached)."""
    if base_from:
        return timings.step(f"base_{role}", bases.base_from_image, st, role, base_from)
    return timings.step(f"base_{role}", bases.ensure_base, st, role, cache)


def _start_ucx_stage(st: Stack, work: Path, ucx_sources: Path, stage_tag: str, builder: str,
                     no_cache: bool) -> DockerBuild:
    """Stage the ucx stage's context and start its `docker build` in the background."""
    ucx_ctx = work / "context-ucx"
    _fresh_context(st, ucx_ctx, stage_ucx_context, ucx_sources)
    # The UCX stage only needs the builder base and the sources: it compiles (CPU) while the wheelhouse and the
    # runtime base are downloaded (network, disk).
    say(f"building the ucx stage ({stage_tag}) with --network none, in the background")
    return DockerBuild(ucx_ctx, stage_tag, build_args(st, "unused", builder), {},
                       work / "logs" / "docker-build-ucx.log", target="ucx", prefix="  ucx | ", no_cache=no_cache)


def _check_stack_id_inside(tag: str, stack_id: str) -> None:
    """The stack id the image computes from what it installed must be the one the build predicted."""
    inside = docker(["run", "--rm", "--network", "none", "--entrypoint", "cat", tag, str(STACK_ID_FILE)],
                    code=BUILD_FAILED, what="reading the image's stack id").stdout.strip()
    if inside != stack_id:
        raise UserError(f"{tag}: the image computed stack id {inside} from what it installed, the build predicted "
                        f"{stack_id} from the lock and the wheels: an installed version is not the one given (run "
                        f"`docker run --rm {tag} ucx-dask-gpu guard show`)", BUILD_FAILED)


def _normalise_and_prune(st: Stack, tag: str, stage_tag: str, cache: Path, work: Path, sbom_wheels: list[Path],
                         normalise: bool, timings: Timings) -> None:
    """Normalise the image (when asked), then remove the images earlier builds of `tag` made and this one does not
    use."""
    made = [i for log in ("docker-build-ucx.log", "docker-build.log")
            for i in leftovers.step_ids((work / "logs" / log).read_text(errors="replace"))]
    if normalise:
        norm = timings.step("normalise", finish_build, st, tag, cache, sbom_wheels)
        say(f"normalised {tag}: {norm.image_id} (docker build gave {norm.source_image_id[:19]})")
        made.append(norm.image_id)
    pruned = leftovers.record_and_prune(work, [tag, stage_tag], made)
    if pruned:
        say(f"removed {pruned} image(s) that earlier builds of {tag} made and this one no longer uses")
