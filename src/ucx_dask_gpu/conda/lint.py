"""Lint rendered recipes (a subset of conda-smithy's rules) and check them against stack.toml.

conda-smithy itself is not on PyPI (it is a conda package), so its rules that matter for these recipes are repeated
here: section order, about (home/license/license_file/summary), tests present, build number, sha256 on url sources,
`stdlib("c")` next to compilers, compilers only in build, noarch python per CFEP-25 (`python_min`), no selectors in
noarch recipes, selector comment form, recipe maintainers, requirement specs that parse as MatchSpecs.

The stack checks are this project's: the ucx recipe names exactly a [[ucx.sources]] entry (default: the production pin)
with its URLs, archive and sha256 and tests every required module; the metapackage carries stack.toml's name/version,
pins each package of [conda].metapackage to the lock's version (recomputed from the lock, not from environment.yml) and
pins `ucx` to the ucx recipe's version and build marker; conda_build_config.yaml matches what stack.toml generates.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

from ..stack import Stack
from ..stack.lock import canonical, load_lock
from .render import SEL_RE, RecipeError, Rendered, load_variant_config, render_variants
from .settings import CBC_PATH, render_conda_build_config, settings

SECTION_ORDER = ["package", "source", "build", "requirements", "test", "outputs", "about", "extra"]
UCX_MARKER = "_udg_"
SELECTOR_FORM = re.compile(r"\S(\s*)#(\s*)\[[^\[\]]+\]\s*$")


def _spec_problems(specs: list[str], where: str) -> list[str]:
    from rattler import MatchSpec

    out = []
    for s in specs:
        try:
            MatchSpec(s)
        except Exception as e:  # rattler's InvalidMatchSpecError
            out.append(f"{where}: {s!r} is not a valid MatchSpec ({e})")
    return out


def lint_recipe(r: Rendered) -> list[str]:
    """conda-smithy-style problems of one rendered recipe variant (empty: clean)."""
    where = str(r.recipe_dir.name)
    m = r.meta
    out: list[str] = []

    order = [k for k in m if k in SECTION_ORDER]
    if order != sorted(order, key=SECTION_ORDER.index):
        out.append(f"{where}: sections out of order: {', '.join(order)} (expected {', '.join(SECTION_ORDER)})")

    name = r.name
    if not re.match(r"^[a-z0-9_][a-z0-9_.-]*$", name):
        out.append(f"{where}: package name {name!r} must be lowercase letters, digits, '-', '_', '.'")

    about = m.get("about") or {}
    for key in ("home", "license", "summary"):
        if not about.get(key):
            out.append(f"{where}: about/{key} is missing")
    if str(about.get("license", "")).lower() in ("unknown", "none", ""):
        out.append(f"{where}: about/license must name the license (SPDX)")
    lf = about.get("license_file")
    if not lf:
        out.append(f"{where}: about/license_file is missing")
    else:
        out += [f"{where}: {p}" for p in _license_file_problems(r, lf)]

    test = m.get("test") or {}
    if not (test.get("commands") or test.get("imports") or (r.recipe_dir / "run_test.sh").is_file()
            or test.get("script")):
        out.append(f"{where}: no tests (test/commands, test/imports or run_test.sh)")

    build = r.build
    if "number" not in build or not str(build["number"]).isdigit():
        out.append(f"{where}: build/number is missing or not a non-negative integer")
    elif build.get("string") and not str(build["string"]).endswith(f"_{build['number']}"):
        out.append(f"{where}: build/string {build['string']!r} does not end with _<build number>")

    for i, src in enumerate(r.sources()):
        if "url" in src:
            if not src.get("sha256"):
                out.append(f"{where}: source[{i}] has a url but no sha256")
            elif not re.match(r"^[0-9a-f]{64}$", str(src["sha256"])):
                out.append(f"{where}: source[{i}] sha256 {src['sha256']!r} is not 64 lowercase hex digits")
        elif "path" not in src and "git_url" not in src:
            out.append(f"{where}: source[{i}] has neither url nor path")

    reqs = {k: r.requirements(k) for k in ("build", "host", "run", "run_constrained")}
    uses_compiler = "compiler(" in r.template
    if uses_compiler and "stdlib(" not in r.template:
        out.append(f"{where}: uses compiler(...) without {{{{ stdlib(\"c\") }}}} in requirements/build")
    compiler_specs = re.compile(r"^(gcc|gxx|gfortran|clang|clangxx|cuda-nvcc|cuda|sysroot)_linux-64\b")
    for kind in ("host", "run"):
        for spec in reqs[kind]:
            if compiler_specs.match(spec):
                out.append(f"{where}: compiler/stdlib {spec!r} belongs in requirements/build, not {kind}")
    for kind, specs in reqs.items():
        out += _spec_problems(specs, f"{where}: requirements/{kind}")
    out += _spec_problems([str(s) for s in build.get("run_exports") or []], f"{where}: build/run_exports")

    if r.noarch:
        if re.search(r"#\s*\[", r.template):
            out.append(f"{where}: noarch recipes cannot use selectors")
        if uses_compiler:
            out.append(f"{where}: noarch recipes cannot use compilers")
        if r.noarch == "python":
            pmin = r.variant.get("python_min")
            if not pmin:
                out.append(f"{where}: noarch python must use {{{{ python_min }}}} (CFEP-25)")
            else:
                if f"python {pmin}" not in reqs["host"]:
                    out.append(f"{where}: requirements/host needs 'python {{{{ python_min }}}}' (CFEP-25)")
                if f"python >={pmin}" not in reqs["run"]:
                    out.append(f"{where}: requirements/run needs 'python >={{{{ python_min }}}}' (CFEP-25)")
                if f"python {pmin}" not in [str(s) for s in test.get("requires") or []]:
                    out.append(f"{where}: test/requires needs 'python {{{{ python_min }}}}' (CFEP-25)")

    for lineno, line in enumerate(r.template.splitlines(), 1):
        sel = SELECTOR_FORM.search(line)
        if sel and not line.lstrip().startswith("#") and (sel.group(1) != "  " or sel.group(2) != " "):
            out.append(f"{where}/meta.yaml:{lineno}: selectors take the form '<two spaces># [expr]'")

    for lineno, line in enumerate(r.template.splitlines(), 1):
        sel = SEL_RE.match(line.rstrip())
        if sel and not line.lstrip().startswith("#") and sel.group(3).strip()[:1] in "'\"0123456789":
            out.append(f"{where}/meta.yaml:{lineno}: `#` then [{sel.group(3)}] on one line reads as a selector "
                       f"(always true) and cuts the line at the `#`")

    maintainers = (m.get("extra") or {}).get("recipe-maintainers")
    if not maintainers:
        out.append(f"{where}: extra/recipe-maintainers is missing")
    return out


def _license_file_problems(r: Rendered, lf) -> list[str]:
    """license_file is found in the recipe dir, a path source, or (checked at build time) a url source's folder."""
    out = []
    for f in lf if isinstance(lf, list) else [lf]:
        f = str(f)
        if (r.recipe_dir / f).is_file():
            continue
        found = False
        for src in r.sources():
            folder = str(src.get("folder") or "")
            rel = f[len(folder) + 1:] if folder and f.startswith(folder + "/") else (None if folder else f)
            if rel is None:
                continue
            if "url" in src:
                found = True  # inside the archive: the packager checks it after unpacking
            elif "path" in src and (r.recipe_dir / str(src["path"]) / rel).is_file():
                found = True
        if not found:
            out.append(f"about/license_file {f!r} is in neither the recipe directory nor a source")
    return out


# --- stack.toml ----------------------------------------------------------------------------------------------------

def lock_versions_by_conda_name(st: Stack) -> dict[str, str]:
    """conda name -> version in the lock, through [conda.names] (independently of environment.yml), and UCXX's
    packages at the version built from source."""
    pins = load_lock(st.lock_path())
    to_conda = {canonical(k): v for k, v in st.conda.names.items()}
    out = {}
    for pypi, pin in pins.items():
        conda = to_conda.get(pypi, pypi)
        if conda:
            out[conda] = pin.version
    for pkg in st.ucxx.packages:
        out[pkg.name] = st.ucxx.source.version
    return out


def check_ucx_recipe(r: Rendered, st: Stack, expected_version: str) -> list[str]:
    where = r.recipe_dir.name
    out = []
    src = st.ucx
    if r.version != expected_version:
        return out + [f"{where}: package version {r.version} but stack.toml wants {expected_version}"]
    urls = [s for s in r.sources() if "url" in s]
    if len(urls) != 1:
        return out + [f"{where}: expected exactly one url source (UCX), found {len(urls)}"]
    u = urls[0]
    got_urls = u["url"] if isinstance(u["url"], list) else [u["url"]]
    if list(map(str, got_urls)) != list(src.urls):
        out.append(f"{where}: source url {got_urls} differs from stack.toml's {list(src.urls)} for UCX {src.version}")
    if str(u.get("sha256")) != src.sha256:
        out.append(f"{where}: source sha256 {u.get('sha256')} differs from stack.toml's {src.sha256} "
                   f"for UCX {src.version}")
    if str(u.get("fn", "")) != src.archive:
        out.append(f"{where}: source fn {u.get('fn')!r} differs from stack.toml's archive {src.archive!r}")
    if not any("path" in s for s in r.sources()):
        out.append(f"{where}: the repository (ucx-src-build/) must be a `path:` source")
    tests = " ".join(str(c) for c in ((r.meta.get("test") or {}).get("commands") or []))
    for module in st.required_modules:
        if module not in tests:
            out.append(f"{where}: test/commands do not check required module {module}")
    if "ucx_info -v" not in tests:
        out.append(f"{where}: test/commands must run `ucx_info -v`")
    exports = [str(x) for x in r.build.get("run_exports") or []]
    if not any(x.startswith("ucx >=") and "," in x for x in exports):
        out.append(f"{where}: build/run_exports must pin ucx (pin_subpackage max_pin='x.x'), got {exports}")
    if UCX_MARKER not in r.build_string:
        out.append(f"{where}: build/string {r.build_string!r} lacks the {UCX_MARKER!r} marker the metapackage asks for")
    return out


def check_metapackage(r: Rendered, st: Stack, ucx_version: str) -> list[str]:
    where = r.recipe_dir.name
    out = []
    if r.name != st.name or r.version != st.version:
        out.append(f"{where}: package {r.name} {r.version} but stack.toml says {st.name} {st.version}")
    if r.noarch != "python":
        out.append(f"{where}: must be noarch: python")
    run = r.requirements("run")
    by_name: dict[str, str] = {}
    for spec in run:
        by_name.setdefault(spec.split()[0], spec)
    locked = lock_versions_by_conda_name(st)
    for name in settings(st).metapackage:
        want = f"{name} =={locked[name]}" if name in locked else None
        if want is None:
            out.append(f"{where}: {name} (stack.toml [conda].metapackage) is not in the lock {st.python.lock}")
        elif by_name.get(name) != want:
            out.append(f"{where}: run requirement for {name} is {by_name.get(name)!r}, the lock says {want!r}")
    want_ucx = f"ucx {ucx_version} *{UCX_MARKER}*"
    if by_name.get("ucx") != want_ucx:
        out.append(f"{where}: run requirement for ucx is {by_name.get('ucx')!r}, expected {want_ucx!r} (our recipe)")
    extra = sorted(set(by_name) - set(settings(st).metapackage) - {"ucx", "python"})
    if extra:
        out.append(f"{where}: run requirements not in stack.toml [conda].metapackage: {', '.join(extra)}")
    scripts = tomllib.loads((st.root / "pyproject.toml").read_text()).get("project", {}).get("scripts", {})
    want_eps = sorted(f"{k} = {v}" for k, v in scripts.items())
    if sorted(map(str, r.build.get("entry_points") or [])) != want_eps:
        out.append(f"{where}: build/entry_points {r.build.get('entry_points')} differ from pyproject's {want_eps}")
    return out


def check_cbc(st: Stack, recipes_dir: Path) -> list[str]:
    path = recipes_dir / Path(CBC_PATH).name
    want = render_conda_build_config(st)
    have = path.read_text() if path.is_file() else ""
    if have != want:
        return [f"{path.name} is out of date with stack.toml; run `ucx-dask-gpu stack conda-build-config`"]
    return []


# conda-forge's build images and their glibc (conda-forge.yml os_version).
OS_VERSION_GLIBC = {"cos7": "2.17", "alma8": "2.28", "alma9": "2.34", "ubi8": "2.28"}


def check_conda_forge_yml(st: Stack, recipes_dir: Path) -> list[str]:
    """conda-forge.yml (repository root): the recipe it names exists and its build image's glibc is not older than
    the c_stdlib_version the recipes declare."""
    import yaml

    path = st.root / "conda-forge.yml"
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError:
        return [f"{path.name} is missing"]
    except yaml.YAMLError as e:
        return [f"{path.name}: not YAML: {e}"]
    out = []
    recipe_dir = st.root / str(data.get("recipe_dir", "recipe"))
    if not (recipe_dir / "meta.yaml").is_file():
        out.append(f"{path.name}: recipe_dir {data.get('recipe_dir')!r} has no meta.yaml")
    image = (data.get("os_version") or {}).get("linux_64", "cos7")
    glibc = OS_VERSION_GLIBC.get(str(image))
    want = settings(st).c_stdlib_version
    if glibc is None:
        out.append(f"{path.name}: os_version linux_64 {image!r} is not one of {', '.join(OS_VERSION_GLIBC)}")
    elif tuple(map(int, glibc.split("."))) < tuple(map(int, want.split("."))):
        out.append(f"{path.name}: os_version linux_64 {image} has glibc {glibc}, older than c_stdlib_version {want}")
    return out


def lint_all(st: Stack, recipes_dir: Path) -> tuple[list[str], list[Rendered]]:
    """Render every recipe variant and collect every problem. Returns (problems, renderings used for the channel)."""
    problems = check_cbc(st, recipes_dir) + check_conda_forge_yml(st, recipes_dir)
    config = load_variant_config(recipes_dir / Path(CBC_PATH).name)
    rendered: list[Rendered] = []
    for recipe, checker in (("ucx", check_ucx_recipe), (st.name, check_metapackage)):
        recipe_dir = recipes_dir / recipe
        try:
            variants = render_variants(recipe_dir, config, environ={})
        except RecipeError as e:
            problems.append(str(e))
            continue
        if not variants:
            problems.append(f"{recipe}: every variant is skipped on linux-64")
        for r in variants:
            problems += lint_recipe(r)
            problems += checker(r, st, st.ucx.version)
        rendered += variants
    if {r.name for r in rendered} >= {"ucx"}:
        cuda = {r.variant.get("cuda_compiler_version") for r in rendered if r.name == "ucx"}
        if cuda != set(settings(st).cuda_versions):
            problems.append(f"ucx renders for CUDA {sorted(map(str, cuda))}, stack.toml lists "
                            f"{list(settings(st).cuda_versions)}")
    # Deduplicate (the same problem shows in every variant) while keeping order.
    return list(dict.fromkeys(problems)), rendered


