"""Build a recipe variant with the real rattler-build where its build and host requirements cannot be installed.

No conda channel is reachable from these machines, so rattler-build cannot solve and install a recipe's build/host
requirements (conda-forge's compilers, sysroot, CUDA, rdma-core, python …). Everything else it can do offline, so
this module stands in for exactly that one step and hands the rest to rattler-build:

- it writes a stand-in copy of the recipe (info/recipe/recipe.yaml of the package; the original beside it as
  original-recipe.yaml) whose build and host requirements are empty, and whose sources point at verified local copies of
  the url sources (upstream first, then the source mirror; rattler-build checks the sha256 again);
- the machine's tools and libraries take the requirements' place: the system compiler, autotools and -dev packages
  (stack.toml [debian] ucx_build_packages), the pinned PyPI CUDA wheels + driver link libraries for `cuda-*-dev`
  (CPPFLAGS/LDFLAGS, as conda's compiler activation would point at $PREFIX), a venv for a noarch python recipe's host
  python;
- what the stood-in packages would have contributed is written in explicitly: `pin_compatible` of a host package is
  resolved from the variant (cuda-version), the sysroot's run export `__glibc >=<c_stdlib_version>` is added, and
  the sonames the declared requirements provide (rdma-core -> libibverbs …) are allowed in the overlinking check,
  every other soname stays an error (rattler-build's own check, `dynamic_linking.overlinking_behavior: error`);
- the build string is the one rattler-build rendered for the original recipe, so the package name matches.

Real rattler-build then does: rendering, source extraction and sha256 check, patches, the build environment contract
(PREFIX with its placeholder, BUILD_PREFIX, SRC_DIR, RECIPE_DIR, CPU_COUNT, PKG_*, variant keys), running the
recipe's build script, relinking (RUNPATH -> $ORIGIN), overlinking checks, prefix detection, packaging (info/,
run_exports, tests) and the .conda archive.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import BUILD_FAILED, PACKAGE_INVALID, RECIPE_INVALID, SOURCE_UNREACHABLE, UserError
from ..stack import Stack
from ..ucxbuild import cuda as cudamod
from ..ucxbuild.fetch import Unreachable, default_cache_dir, fetch_file, sha256_verifier
from .recipes import Variant

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
COMPILER_RE = re.compile(r'compiler\(\s*["\'](\w+)["\']\s*\)')
PIN_COMPATIBLE_RE = re.compile(r'^\$\{\{\s*pin_compatible\(\s*"([^"]+)"((?:\s*,\s*\w+\s*=\s*"[^"]*")*)\s*\)\s*\}\}$')
LOG_TAIL = 25


@dataclass
class StandinInputs:
    """What stands in for the requirements of one variant (recorded in the package's about.json extra)."""

    env: dict[str, str] = field(default_factory=dict)
    provided: dict[str, str] = field(default_factory=dict)  # soname -> declared requirement that provides it
    notes: list[str] = field(default_factory=list)
    python: Path | None = None  # a noarch python recipe's host python (a venv outside $PREFIX)


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


def standin_inputs(st: Stack, v: Variant, work: Path) -> StandinInputs:
    """The machine's stand-ins for the variant's build/host requirements."""
    inputs = StandinInputs()
    reqs = {r.split()[0] for r in v.requirements("build") + v.requirements("host")}
    compilers = set(COMPILER_RE.findall(v.template))
    declared = reqs | {f"{lang}_compiler" for lang in compilers} | \
        ({"c_stdlib"} if "stdlib(" in v.template else set())
    for soname, providers in SONAME_PROVIDERS.items():
        hit = [p for p in providers if p in declared]
        if hit:
            inputs.provided[soname] = hit[0]
    # Keep git from reading this repository when autogen/configure ask for a revision from inside our build tree.
    inputs.env["GIT_CEILING_DIRECTORIES"] = str(work)
    if reqs & {"cuda-cudart-dev", "cuda-driver-dev", "cuda-nvml-dev"}:
        want = str(v.variant.get("cuda_compiler_version", ""))
        fetch_kw = {"cache": default_cache_dir(st), "dirs": [], "offline": False}
        cuda = cudamod.resolve("auto", st, work / "cuda", link_dir=None, fetch_kw=fetch_kw)
        if (cuda.version or "").split(".")[:1] != want.split(".")[:1]:
            raise UserError(f"{v.dist}: the CUDA stand-in here is {cuda.version}, not {want}", BUILD_FAILED)
        inputs.env["CPPFLAGS"] = " ".join(cuda.cppflags())
        inputs.env["LDFLAGS"] = " ".join(cuda.ldflags())
        inputs.notes.append(f"cuda-*-dev: CUDA {cuda.version} headers and link libraries ({cuda.note}; "
                            f"{cuda.link_source})")
    if "python" in reqs and v.noarch == "python":
        inputs.python = host_python_venv(v, work / "host-python")
        inputs.notes.append(f"python + {', '.join(sorted(reqs - {'python'}))}: a venv of this machine's python "
                            f"{sys.version_info.major}.{sys.version_info.minor} (PyPI), installing into $PREFIX "
                            f"(PIP_PREFIX)")
    if compilers:
        cc = subprocess.run(["cc", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        inputs.notes.append(f"compilers {sorted(compilers)}: the machine's {cc[0] if cc else 'cc'}")
    others = sorted(reqs - {"cuda-cudart-dev", "cuda-driver-dev", "cuda-nvml-dev", "cuda-version"})
    if others and inputs.python is None:
        inputs.notes.append(f"{', '.join(others)}: the machine's packages (stack.toml [debian] ucx_build_packages)")
    return inputs


def host_python_venv(v: Variant, venv: Path) -> Path:
    """A venv with the recipe's python host requirements from PyPI, outside $PREFIX (nothing of it is packaged)."""
    want = v.variant.get("python_min") or v.variant.get("python")
    have = f"{sys.version_info.major}.{sys.version_info.minor}"
    if want and want != have:
        raise UserError(f"{v.dist}: host python {want} stands in as this machine's {have}: not the same", BUILD_FAILED)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True)
    extra = [s.split()[0] for s in v.requirements("host") if s.split()[0] not in ("python", "pip")]
    if extra:
        proc = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                               "--disable-pip-version-check", *extra], capture_output=True, text=True)
        if proc.returncode != 0:
            raise UserError(f"{v.dist}: installing host requirements {extra} from PyPI failed: "
                            f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}", BUILD_FAILED)
    return venv / "bin" / "python"


def _script(build: dict, env: dict[str, str]) -> dict:
    script = build.get("script")
    if script is None:
        return {"file": "build.sh", "env": env}
    if isinstance(script, str):
        key = "file" if re.match(r"^[\w./-]+\.(sh|bat)$", script.strip()) else "content"
        return {key: script, "env": env}
    if isinstance(script, dict):
        return {**script, "env": {**(script.get("env") or {}), **env}}
    return {"content": script, "env": env}


def standin_recipe(v: Variant, inputs: StandinInputs, local_sources: dict[str, Path], glibc: str | None) -> dict:
    """The recipe as rattler-build builds it here: build/host requirements emptied, see the module docstring."""
    raw = yaml.safe_load(v.recipe_path.read_text())
    out = dict(raw)
    out["source"] = []
    for src in v.sources:
        s = dict(src)
        if "url" in s:
            s["url"] = local_sources[str(s["url"])].resolve().as_uri()
        elif "path" in s:
            s["path"] = str((v.recipe_path.parent / str(s["path"])).resolve())
        out["source"].append(s)
    build = dict(raw.get("build") or {})
    build["string"] = v.build_string
    build["script"] = _script(build, inputs.env)
    if inputs.python is not None:
        content = build["script"].get("content")
        if not isinstance(content, str):
            raise UserError(f"{v.dist}: a noarch python recipe here needs an inline build script", BUILD_FAILED)
        build["script"]["content"] = (f'export PYTHON="{inputs.python}" PIP_PREFIX="$PREFIX"\n'
                                      + content.replace("${{ PYTHON }}", "$PYTHON"))
    linking = dict(build.get("dynamic_linking") or {})
    linking["missing_dso_allowlist"] = list(linking.get("missing_dso_allowlist") or []) + \
        [f"*{soname}" for soname in sorted(inputs.provided)]
    build["dynamic_linking"] = linking
    out["build"] = build
    req = dict(raw.get("requirements") or {})
    host = v.requirements("host")
    req["build"], req["host"] = [], []
    for kind in ("run", "run_constraints"):
        if req.get(kind):
            req[kind] = [resolve_pin_compatible(str(s), host) for s in req[kind]]
    if glibc and v.subdir != "noarch":
        req["run"] = list(req.get("run") or []) + [f"__glibc >={glibc}"]
    out["requirements"] = req
    extra = dict(raw.get("extra") or {})
    extra["standin"] = {"requirements_not_installed": {"build": v.requirements("build"), "host": host},
                        "stood_in_by": inputs.notes,
                        "sonames_left_to_the_system": inputs.provided}
    out["extra"] = extra
    return out


def build_variant(st: Stack, v: Variant, *, work: Path, output_dir: Path, mirror_dirs: list[Path],
                  log_dir: Path, channel: str, cache: Path | None = None, offline: bool = False) -> Path:
    """Build one variant with real rattler-build on its stand-in recipe; returns the .conda file. Url sources come
    from `cache` (default: the repository's download cache), their url (unless offline), then `mirror_dirs`."""
    from rattler_build import Stage0Recipe, VariantConfig
    from rattler_build._rattler_build import RattlerBuildError

    if v.outputs_in_recipe > 1:
        raise UserError(f"{v.dist}: multi-output recipes are rendered and checked here, not built", BUILD_FAILED)
    vdir = work / v.dist
    shutil.rmtree(vdir, ignore_errors=True)
    recipe_copy = vdir / "recipe"
    shutil.copytree(v.recipe_path.parent, recipe_copy)
    cache = cache or default_cache_dir(st)
    local = {str(s["url"]): fetch_url_source(st, str(s["url"]), str(s["sha256"]), cache=cache,
                                             mirror_dirs=mirror_dirs, offline=offline)
             for s in v.sources if "url" in s}
    inputs = standin_inputs(st, v, vdir)
    glibc = v.variant.get("c_stdlib_version") if "stdlib(" in v.template else None
    recipe = standin_recipe(v, inputs, local, glibc)
    standin_path = recipe_copy / "standin-recipe.yaml"
    # rattler-build stores the recipe it builds as info/recipe/recipe.yaml: keep the original beside it.
    (recipe_copy / "recipe.yaml").rename(recipe_copy / "original-recipe.yaml")
    standin_path.write_text("# The stand-in recipe ucx-dask-gpu built (src/ucx_dask_gpu/conda/standin.py) for the "
                            "recipe in original-recipe.yaml.\n" + yaml.safe_dump(recipe, sort_keys=False, width=120))
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{v.dist}.log"
    try:
        rendered = Stage0Recipe.from_file(standin_path).render(VariantConfig({k: [val] for k, val in
                                                                              v.variant.items()}),
                                                               v.render_config())
        mine = [r for r in rendered if r.recipe.package.name == v.name]
        progress = LogToFile(log)
        try:
            result = mine[0].run_build(output_dir=output_dir, channels=[channel], no_build_id=True,
                                       progress_callback=progress)
        finally:
            progress.file.close()
    except RattlerBuildError as e:
        raise UserError(f"{v.dist}: rattler-build: {_reason(str(e), log)} (log: {log})",
                        PACKAGE_INVALID if re.search(r"linking|package content", str(e), re.I) else BUILD_FAILED) \
            from None
    return Path(result.packages[0])


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
