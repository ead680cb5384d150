"""Render the v1 recipes with the real rattler-build (py-rattler-build), for every variant, and check them.

The recipes are packed first (settings.pack), as a build or a feedstock takes them; rattler-build refuses what breaks
its schema (unknown keys, wrong types, bad Jinja) and renders every variant (variants.py) on PLATFORMS.
What rattler-build does not check and conda-smithy's linter would (about, maintainers, tests, checksums, `stdlib`
with compilers, CFEP-25 for noarch python, build strings) and what this project requires (no CPU-only variant, the
rendered recipes agree with stack.toml and the lock, the generated lines are up to date) is checked here, on
rattler-build's rendering.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import RECIPE_INVALID, UserError
from ..stack import Stack
from ..ucxbuild.fetch import local_dirs
from . import settings as cfg
from . import variants as vstack

PLATFORMS = ("linux-64", "linux-aarch64")
BUILD_PLATFORM = "linux-64"


@dataclass
class Variant:
    """One rendered output of one recipe for one variant and platform."""

    recipe_path: Path
    platform: str
    variant: dict[str, str]
    stage1: dict
    template: str
    stack: vstack.VariantStack | None = None

    @property
    def name(self) -> str:
        return str(self.stage1["package"]["name"])

    @property
    def version(self) -> str:
        return str(self.stage1["package"]["version"])

    @property
    def build(self) -> dict:
        return self.stage1.get("build") or {}

    @property
    def build_string(self) -> str:
        return str(self.build.get("string"))

    @property
    def noarch(self) -> str | None:
        return self.build.get("noarch")

    @property
    def subdir(self) -> str:
        return "noarch" if self.noarch else self.platform

    @property
    def dist(self) -> str:
        return f"{self.name}-{self.version}-{self.build_string}"

    @property
    def sources(self) -> list[dict]:
        return list(self.stage1.get("source") or [])

    @property
    def tests(self) -> list[dict]:
        return list(self.stage1.get("tests") or [])

    def requirements(self, kind: str) -> list[str]:
        return [spec_text(s) for s in (self.stage1.get("requirements") or {}).get(kind) or []]

    def run_exports(self) -> list[str]:
        exports = (self.stage1.get("requirements") or {}).get("run_exports") or {}
        items = exports.get("weak", []) if isinstance(exports, dict) else exports
        return [spec_text(s) for s in items]

    def render_config(self):
        from rattler_build import PlatformConfig, RenderConfig

        return RenderConfig(platform=PlatformConfig(target_platform=self.platform))


def spec_text(spec) -> str:
    """A rendered requirement: a string, or a pin (pin_subpackage / pin_compatible) as rattler-build leaves it."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, dict) and len(spec) == 1:
        (kind, pin), = spec.items()
        if kind in ("pin_subpackage", "pin_compatible") and isinstance(pin, dict):
            bounds = ", ".join(f'{k}="{pin[k]}"' for k in ("lower_bound", "upper_bound") if pin.get(k))
            exact = ", exact=True" if pin.get("exact") else ""
            return f'${{{{ {kind}("{pin["name"]}"{", " + bounds if bounds else ""}{exact}) }}}}'
    return str(spec)


PIN_RE = re.compile(r'^\$\{\{\s*pin_(?:subpackage|compatible)\(\s*"([^"]+)"')


def spec_name(spec: str) -> str:
    """The package a requirement names: `ucx 1.20.1.*` -> ucx, `${{ pin_subpackage("libucxx", ...) }}` -> libucxx."""
    m = PIN_RE.match(spec.strip())
    return m.group(1) if m else spec.split()[0]


def _not_skipped(stage0_dict: dict, config, render_config) -> set[str] | None:
    """Build strings of the variants a single-output recipe's `build.skip` keeps, or None for a multi-output recipe.

    py-rattler-build's render() drops skipped outputs of a multi-output recipe but returns every variant of a
    single-output one (the rattler-build CLI skips them): the same recipe as one output of a multi-output twin gives
    the same variants and build strings, with the skips applied."""
    from rattler_build import Stage0Recipe

    if "outputs" in stage0_dict:
        return None
    raw = stage0_dict
    twin = {k: raw[k] for k in ("schema_version", "context", "source", "build", "about", "extra") if k in raw}
    twin["recipe"] = {"name": f"{raw['package']['name']}-split", "version": raw["package"]["version"]}
    twin["outputs"] = [{k: raw[k] for k in ("package", "requirements", "tests", "about") if k in raw}]
    return {str(r.recipe.to_dict()["build"].get("string"))
            for r in Stage0Recipe.from_dict(twin).render(config, render_config)}


def render_recipe(recipes_dir: Path, recipe: str, platforms: tuple[str, ...] = PLATFORMS,
                  stack: vstack.VariantStack | None = None) -> list[Variant]:
    """Every rendered output of one (packed) recipe for every variant and platform (rattler-build), skipped
    variants left out; duplicates (a noarch output rendered once per variant of its siblings) once. `stack`: the
    variant stack (default: the fallback beside the recipes)."""
    from rattler_build import PlatformConfig, RenderConfig, Stage0Recipe
    from rattler_build._rattler_build import RattlerBuildError

    path = recipes_dir / recipe / "recipe.yaml"
    if not path.is_file():
        raise UserError(f"{path}: missing", RECIPE_INVALID)
    stack = stack or vstack.VariantStack(vstack.FALLBACK, (recipes_dir / vstack.CBC,))
    template = path.read_text()
    try:
        stage0 = Stage0Recipe.from_file(path)
        out: dict[tuple, Variant] = {}
        for platform in platforms:
            config = vstack.config(stack, platform, recipes_dir / recipe / vstack.CBC)
            render_config = RenderConfig(platform=PlatformConfig(target_platform=platform))
            kept = _not_skipped(stage0.to_dict(), config, render_config)
            rendered = stage0.render(config, render_config)
            for r in rendered:
                stage1 = r.recipe.to_dict()
                if kept is not None and str(stage1["build"].get("string")) not in kept:
                    continue
                v = Variant(path, platform, {k: str(x) for k, x in r.variant.items()}, stage1, template, stack)
                out.setdefault((v.subdir, v.dist), v)
    except (RattlerBuildError, ValueError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"recipes/{recipe}/recipe.yaml: rattler-build rejects it under {stack.kind} variants: "
                        f"{first}", RECIPE_INVALID) from None
    return list(out.values())


# --- checks rattler-build does not make ------------------------------------------------------------------------------

def lint(v: Variant) -> list[str]:
    """conda-smithy's rules that rattler-build's schema does not enforce, on one rendered output."""
    where = f"{v.recipe_path.parent.name}/{v.name}"
    out = []
    about = v.stage1.get("about") or {}
    for key in ("homepage", "license", "license_file", "summary"):
        if not about.get(key):
            out.append(f"{where}: about.{key} is missing")
    license_file = about.get("license_file") or []
    for f in license_file if isinstance(license_file, list) else [license_file]:
        if not (v.recipe_path.parent / str(f)).is_file() and not v.sources:
            out.append(f"{where}: about.license_file {f} is neither in the recipe folder nor in a source")
    if not (v.stage1.get("extra") or {}).get("recipe-maintainers"):
        out.append(f"{where}: extra.recipe-maintainers is missing")
    if not v.tests:
        out.append(f"{where}: no tests")
    for i, src in enumerate(v.sources):
        if "url" in src and not re.match(r"^[0-9a-f]{64}$", str(src.get("sha256", ""))):
            out.append(f"{where}: source[{i}] {src['url']} has no sha256")
        # A tag or branch can be moved upstream; a commit id cannot, and it hashes the content.
        if "git" in src and not re.match(r"^[0-9a-f]{40}$", str(src.get("rev", ""))):
            out.append(f"{where}: source[{i}] {src['git']} is not pinned to a commit (rev: <40 hex digits>)")
    build_reqs = v.requirements("build")
    if any(re.match(r"^(gcc|gxx|clang|clangxx|gfortran|cuda-nvcc)_", s) for s in build_reqs) and \
            not any(s.startswith("sysroot_") for s in build_reqs):
        out.append(f"{where}: compilers without ${{{{ stdlib(\"c\") }}}} in requirements.build")
    for kind in ("host", "run"):
        for s in v.requirements(kind):
            if re.match(r"^(gcc|gxx|clang|cuda-nvcc|sysroot)_linux", s):
                out.append(f"{where}: {s} belongs in requirements.build, not {kind}")
    if v.noarch == "python":
        pmin = v.variant.get("python_min")
        if not pmin:
            out.append(f"{where}: noarch python must use python_min (CFEP-25)")
        else:
            if f"python {pmin}.*" not in v.requirements("host"):
                out.append(f"{where}: requirements.host needs `python ${{{{ python_min }}}}.*` (CFEP-25)")
            if f"python >={pmin}" not in v.requirements("run"):
                out.append(f"{where}: requirements.run needs `python >=${{{{ python_min }}}}` (CFEP-25)")
            py_tests = [t["python"] for t in v.tests if "python" in t]
            if py_tests and not all(str(t.get("python_version", "")).startswith(pmin) for t in py_tests):
                out.append(f"{where}: python tests need `python_version: ${{{{ python_min }}}}.*` (CFEP-25)")
    return out


def same_spec(a: str | None, b: str) -> bool:
    """Two requirement specs mean the same (rattler's MatchSpec: `ucxx ==0.51.01` is `ucxx ==0.51.1`)."""
    from rattler import MatchSpec

    if a is None:
        return False
    try:
        return str(MatchSpec(a)) == str(MatchSpec(b))
    except Exception:  # rattler's InvalidMatchSpecError: not the same as a valid spec
        return a == b


def _by_name(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in specs:
        out.setdefault(s.split()[0], s)
    return out


def check_against_stack(v: Variant, st: Stack) -> list[str]:
    """The rendered recipe uses what stack.toml and the lock say (the generated context alone proves nothing if a
    recipe line bypasses it)."""
    ucx, u = st.ucx, st.ucxx
    where = f"{v.recipe_path.parent.name}/{v.name}"
    out = mirror_hashes_on_remote_urls(v, st)
    if v.name == "ucx":
        if v.version != ucx.version:
            out.append(f"{where}: version {v.version}, stack.toml [ucx.source] says {ucx.version}")
        out += _source_problems(v, st, where, "ucx", (ucx,))
        out += _ucx_recipe_problems(v, where)
    elif v.recipe_path.parent.name == "ucxx":
        if v.version != u.source.version:
            out.append(f"{where}: version {v.version}, stack.toml [ucxx.source] says {u.source.version}")
        out += _source_problems(v, st, where, "ucxx", (u.source, u.rapids_cmake, u.cpm))
        host = _by_name(v.requirements("host"))
        if v.name in ("libucxx", "ucxx"):
            rapids = cfg.rapids_version(st)
            if not same_spec(host.get("ucx"), f"ucx {ucx.version}.*"):
                out.append(f"{where}: host ucx is {host.get('ucx')!r}, expected this channel's `ucx {ucx.version}.*`")
            if not same_spec(host.get("librmm"), f"librmm {rapids}.*"):
                out.append(f"{where}: host librmm is {host.get('librmm')!r}, expected `librmm {rapids}.*`")
    elif v.name == st.name:
        if v.version != st.version:
            out.append(f"{where}: version {v.version}, stack.toml says {st.version}")
        out += _metapackage_problems(v, st, where)
    return out


def _source_problems(v: Variant, st: Stack, where: str, recipe: str, pinned: tuple) -> list[str]:
    """The recipe's sources are stack.toml's pinned git revisions, in order, the first with ucx-src-build's
    patches."""
    out = []
    for i, src in enumerate(pinned):
        if i >= len(v.sources):
            out.append(f"{where}: source[{i}] missing (stack.toml pins {src.name} {src.version})")
            continue
        got = v.sources[i]
        if str(got.get("git")) != src.git or str(got.get("rev")) != src.commit:
            shown = f"git {got['git']} rev {got.get('rev')}" if "git" in got else f"{got.get('url') or got}"
            out.append(f"{where}: source[{i}] is {shown}, stack.toml pins git {src.git} rev {src.commit}")
    want = [f"patches/{p.name}" for p in cfg.carried_patches(st, recipe)]
    got_patches = [str(p) for p in (v.sources[0].get("patches") or [])] if v.sources else []
    if got_patches != want:
        out.append(f"{where}: patches {got_patches}, ucx-src-build carries {want}")
    return out


def _ucx_recipe_problems(v: Variant, where: str) -> list[str]:
    """ucx's run_exports, ignored run_exports, run_constraints and overlinking as conda-forge's feedstock has them."""
    out = []
    exports = v.run_exports()
    if len(exports) != 1 or not exports[0].startswith('${{ pin_subpackage("ucx"') or \
            'upper_bound="x.x"' not in exports[0]:
        out.append(f"{where}: run_exports {exports}: expected pin_subpackage(ucx, upper_bound=x.x)")
    ignored = ((v.stage1.get("requirements") or {}).get("ignore_run_exports") or {}).get("from_package") or []
    if not any(str(x).startswith("cuda-nvcc_") for x in ignored) or "cuda-cudart-dev" not in ignored:
        out.append(f"{where}: ignore_run_exports.from_package must list the CUDA compiler and cuda-cudart-dev")
    constrained = sorted({spec_name(c) for c in v.requirements("run_constraints")})
    if constrained != sorted(UCX_FEEDSTOCK_RUN_CONSTRAINTS):
        out.append(f"{where}: requirements.run_constraints constrain {constrained}, conda-forge's ucx constrains "
                   f"{sorted(UCX_FEEDSTOCK_RUN_CONSTRAINTS)}")
    major = (v.variant.get("cuda_compiler_version") or "").split(".")[0]
    if major and f"cuda-cudart {major}.*" not in v.requirements("run_constraints"):
        out.append(f"{where}: requirements.run_constraints must hold cuda-cudart {major}.* (the runtime its CUDA "
                   f"modules load)")
    if (v.build.get("dynamic_linking") or {}).get("overlinking_behavior") != "error":
        out.append(f"{where}: build.dynamic_linking.overlinking_behavior must be error")
    return out


def _metapackage_problems(v: Variant, st: Stack, where: str) -> list[str]:
    """The metapackage's run requirements are exactly stack.toml [conda].metapackage, at the pinned versions."""
    out = []
    run = _by_name(v.requirements("run"))
    locked = cfg.lock_versions_by_conda_name(st)
    want = {"ucx": f"ucx {st.ucx.version}.*"}
    for name in st.conda.metapackage:
        want[name] = f"{name} =={st.ucxx.source.version}" if name in ("ucxx", "distributed-ucxx") else \
            f"{name} =={locked.get(name)}"
    for name, spec in want.items():
        if not same_spec(run.get(name), spec):
            out.append(f"{where}: run requirement {run.get(name)!r}, expected {spec!r}")
    extra = sorted(set(run) - set(want) - {"python"})
    if extra:
        out.append(f"{where}: run requirements not in stack.toml [conda].metapackage: {', '.join(extra)}")
    return out


def mirror_only_hashes(st: Stack) -> dict[str, str]:
    """sha256 -> file, of the source archives the mirrors hold (stack.toml's pinned archive files, and every file a
    mirror's MANIFEST.tsv lists): `git archive` copies, whose bytes no upstream URL serves."""
    out = {s.sha256: s.archive for s in st.source_archives()}
    for d in local_dirs(st):
        try:
            rows = (d / "MANIFEST.tsv").read_text().splitlines()
        except OSError:
            continue
        header = rows[0].split("\t") if rows else []
        if "sha256" in header and "file" in header:
            for row in rows[1:]:
                cells = dict(zip(header, row.split("\t")))
                out.setdefault(cells.get("sha256", ""), cells.get("file", ""))
    return out


def mirror_hashes_on_remote_urls(v: Variant, st: Stack) -> list[str]:
    """A source that pairs a remote URL with the sha256 of a mirror's copy: every build that downloads the URL stops
    at the hash check (GitHub's tag archive has the same files as `git archive`, other bytes)."""
    where = f"{v.recipe_path.parent.name}/{v.name}"
    known = mirror_only_hashes(st)
    return [f"{where}: source[{i}] pairs {src['url']} with the sha256 of the mirror's {known[str(src.get('sha256'))]}, "
            f"not of what that URL serves (pin a git commit instead: docs/conda.md \"Sources\")"
            for i, src in enumerate(v.sources)
            if re.match(r"^(https?|ftp)://", str(src.get("url", ""))) and str(src.get("sha256")) in known]


# What conda-forge's ucx (ucx-split-feedstock) constrains at run time: ours replaces it in a user's environment, so the
# packages built against it must find the same constraints (docs/conda.md "Beside conda-forge").
UCX_FEEDSTOCK_RUN_CONSTRAINTS = ("cuda-version", "cuda-cudart")


BUILD_STRING = re.compile(r"^[A-Za-z0-9_.]+$")


def check_variants(variants: list[Variant], st: Stack) -> list[str]:
    """Every CUDA version of stack.toml is rendered for the CUDA outputs on every platform, and nothing else (no
    CPU-only `cudaNone` variant); build strings are build strings; python outputs start at python_min; a noarch
    output is one package."""
    out = []
    want = set(st.conda.cuda_versions)
    for name in ("ucx", "libucxx", "ucxx"):
        for platform in PLATFORMS:
            got = {v.variant.get("cuda_compiler_version") for v in variants if v.name == name and v.platform == platform}
            if got != want:
                out.append(f"{name}: renders CUDA {sorted(map(str, got))} on {platform}, stack.toml lists "
                           f"{sorted(want)}")
    for v in variants:
        if not BUILD_STRING.match(v.build_string):
            out.append(f"{v.recipe_path.parent.name}/{v.name}: build string {v.build_string!r} is not one (letters, "
                       f"digits, _ and . only)")
        py = v.variant.get("python")
        pmin = st.conda.python_min
        if py and v.noarch is None and _version_key(py.split()[0].rstrip(".*")) < _version_key(pmin):
            out.append(f"{v.recipe_path.parent.name}/{v.name}: built for python {py}, below python_min {pmin}")
    noarch = [v.name for v in variants if v.subdir == "noarch"]
    for name in sorted({n for n in noarch if noarch.count(n) > 1}):
        out.append(f"{name}: noarch, yet rendered as {noarch.count(name)} packages (a variable of the other outputs' "
                   f"variants reaches it)")
    return out


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def check_all(st: Stack, recipes_dir: Path | None = None, *, mode: str = "auto",
              packed: Path | None = None) -> tuple[list[str], list[Variant]]:
    """Drift of the generated lines, then every recipe packed (into `packed`, default <repo>/build/conda-recipes),
    rendered by rattler-build under the variant stack `mode` chooses (variants.choose) and checked.
    Returns (problems, every rendered output)."""
    recipes_dir = (recipes_dir or st.root / "recipes").resolve()
    problems = [f"{p} is out of date with stack.toml; run `make regen`" for p in cfg.drift(st, recipes_dir)]
    stack = vstack.choose(st, recipes_dir, mode)
    packed = cfg.pack(st, (packed or st.root / "build" / "conda-recipes").resolve(), recipes_dir)
    if stack.kind == vstack.FALLBACK:
        stack = vstack.VariantStack(vstack.FALLBACK, (packed / vstack.CBC,))
    variants: list[Variant] = []
    for recipe in cfg.RECIPES:
        try:
            rendered = render_recipe(packed, recipe, stack=stack)
        except UserError as e:
            problems.append(str(e))
            continue
        variants += rendered
        for v in rendered:
            problems += lint(v) + check_against_stack(v, st)
    if variants:
        problems += check_variants(variants, st)
    problems += check_conda_forge_yml(st, recipes_dir)
    return list(dict.fromkeys(problems)), variants


# conda-forge's build images and their glibc (conda-forge.yml os_version).
OS_VERSION_GLIBC = {"cos7": "2.17", "alma8": "2.28", "alma9": "2.34", "ubi8": "2.28"}


def check_conda_forge_yml(st: Stack, recipes_dir: Path) -> list[str]:
    """conda-forge.yml: rattler-build is the build tool, and the build image's glibc is not older than the
    c_stdlib_version the recipes declare."""
    import yaml

    path = st.root / "conda-forge.yml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError:
        return [f"{path.name} is missing"]
    except yaml.YAMLError as e:
        return [f"{path.name}: not YAML: {e}"]
    out = []
    if data.get("conda_build_tool") != "rattler-build":
        out.append(f"{path.name}: conda_build_tool must be rattler-build (the recipes are v1 recipe.yaml)")
    image = (data.get("os_version") or {}).get("linux_64", "cos7")
    glibc = OS_VERSION_GLIBC.get(str(image))
    want = st.conda.c_stdlib_version
    if glibc is None:
        out.append(f"{path.name}: os_version linux_64 {image!r} is not one of {', '.join(OS_VERSION_GLIBC)}")
    elif tuple(map(int, glibc.split("."))) < tuple(map(int, want.split("."))):
        out.append(f"{path.name}: os_version linux_64 {image} has glibc {glibc}, older than c_stdlib_version {want}")
    return out
