"""Render a conda-build recipe (meta.yaml) the way conda-build 3 does, without conda.

What conda-build does, and this module repeats:
- selectors: a line ending in `# [expr]` is kept only when `expr` is true in the platform/variant namespace
  (`linux`, `x86_64`, `unix`, `win`, `osx`, variant keys such as `cuda_compiler_version`), applied before and after
  Jinja; comment-only lines are dropped;
- Jinja2 with conda-build's context: `load_file_data` (json/yaml/toml, `from_recipe_dir=True` relative to the
  recipe), `load_file_regex`, `load_str_data`, `compiler`, `stdlib`, `cdt`, `pin_subpackage`, `pin_compatible`,
  `environ`, `os`, `PYTHON`, `PKG_HASH`, `PKG_BUILDNUM` and the variant keys; undefined names are errors (the final
  render pass of conda-build uses StrictUndefined);
- YAML with numbers kept as strings (conda-build's StringifyNumbersLoader: `version: 1.10` stays "1.10");
- variants: conda_build_config.yaml keys, expanded only over the keys a recipe uses (named in its text or read by
  `compiler`/`stdlib`), `zip_keys` honoured; the build hash `h<7 hex>` is derived from the used keys.

Not conda-build: `pin_compatible` without explicit bounds needs the solved host environment, which only conda can
produce; it is an error here. The hash has conda-build's shape, not its exact input.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import jinja2
import yaml

from ..errors import RECIPE_INVALID, UserError

PLATFORM = "linux-64"
DEFAULT_COMPILERS = {"c": "gcc", "cxx": "gxx", "fortran": "gfortran"}
TOP_LEVEL = ("package", "source", "build", "requirements", "test", "outputs", "about", "extra")
# conda-build's selector pattern: `# [expr]` at the end of a line (possibly inside a longer comment).
SEL_RE = re.compile(r"(.+?)\s*(#.*)?\[([^\[\]]+)\](?(2)[^\(\)]*)$")


class RecipeError(UserError):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}", RECIPE_INVALID)


class _StringifyNumbersLoader(yaml.SafeLoader):
    """SafeLoader that leaves ints and floats as strings, like conda-build's loader."""


_StringifyNumbersLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def yaml_load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_StringifyNumbersLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark else ""
        raise RecipeError(where, f"not valid YAML after rendering{at}: {getattr(e, 'problem', e)}") from None


# --- selectors -------------------------------------------------------------------------------------------------------

def namespace(variant: dict[str, str], platform: str = PLATFORM) -> dict[str, Any]:
    """What a selector expression can name (conda-build's ns_cfg for linux-64, plus the variant)."""
    ns: dict[str, Any] = {
        "linux": True, "linux64": True, "linux32": False, "x86": True, "x86_64": True, "unix": True,
        "win": False, "win32": False, "win64": False, "osx": False, "arm64": False, "aarch64": False,
        "ppc64le": False, "s390x": False, "armv7l": False,
        "build_platform": platform, "target_platform": platform, "py3k": True, "py2k": False,
        "os": os, "environ": os.environ,
    }
    py = variant.get("python") or variant.get("python_min")
    if py:
        major, minor = py.split(".")[:2]
        ns["py"] = int(major + minor)
    ns.update(variant)
    return ns


def select_lines(text: str, ns: dict[str, Any], where: str) -> str:
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.rstrip()
        if line.lstrip().startswith("#"):
            continue
        trailing_quote = line[-1] if line and line[-1] in "'\"" else ""
        m = SEL_RE.match(line)
        if not m:
            out.append(line)
            continue
        try:
            keep = eval(m.group(3), {"__builtins__": {}}, ns)  # noqa: S307 - conda-build evaluates selectors too
        except Exception as e:  # a NameError for an unknown key is the common case
            raise RecipeError(f"{where}:{lineno}", f"selector [{m.group(3)}] cannot be evaluated: {e}") from None
        if keep:
            out.append(m.group(1) + trailing_quote)
    return "\n".join(out) + "\n"


# --- pins --------------------------------------------------------------------------------------------------------------

def apply_pin_expressions(version: str, min_pin: str | None = "x.x.x.x.x.x", max_pin: str | None = "x") -> str:
    """conda-build's pin arithmetic for dotted numeric versions: ('1.20.0', 'x.x.x', 'x.x') -> '>=1.20.0,<1.21.0a0'."""
    parts = version.split(".")
    if not all(p.isdigit() for p in parts):
        raise RecipeError("pin", f"cannot pin non-numeric version {version!r}")
    out = []
    if min_pin:
        out.append(">=" + ".".join(parts[: len(min_pin.split("."))]))
    if max_pin:
        n = min(len(max_pin.split(".")), len(parts))
        upper = parts[:n]
        upper[-1] = str(int(upper[-1]) + 1)
        upper += ["0"] * (len(parts) - n)  # as conda-forge's repodata shows it: ucx >=1.20.0,<1.21.0a0
        out.append("<" + ".".join(upper) + "a0")
    return ",".join(out)


def ensure_valid_spec(spec: str) -> str:
    """conda-build: `name 12` means `name 12.*` (a bare version, no build string, gets a trailing wildcard)."""
    m = re.match(r"^([\w.\-]+)\s+([\w.\-]+)$", spec)
    if m and not re.search(r"[<>=!*|,]", m.group(2)):
        return f"{m.group(1)} {m.group(2)}.*"
    return spec


# --- rendering ---------------------------------------------------------------------------------------------------------

@dataclass
class Rendered:
    recipe_dir: Path
    template: str  # meta.yaml as written
    text: str  # after selectors + Jinja + selectors
    meta: dict
    variant: dict[str, str]  # the keys this recipe uses, with this variant's values
    pkg_hash: str
    environ: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.meta["package"]["name"])

    @property
    def version(self) -> str:
        return str(self.meta["package"]["version"])

    @property
    def build(self) -> dict:
        return self.meta.get("build") or {}

    @property
    def build_number(self) -> int:
        return int(self.build.get("number", 0))

    @property
    def build_string(self) -> str:
        return str(self.build.get("string") or f"{self.pkg_hash}_{self.build_number}")

    @property
    def noarch(self) -> str | None:
        return self.build.get("noarch")

    @property
    def subdir(self) -> str:
        return "noarch" if self.noarch else PLATFORM

    @property
    def skip(self) -> bool:
        return str(self.build.get("skip", "false")).lower() in ("true", "1", "yes")

    @property
    def dist(self) -> str:
        return f"{self.name}-{self.version}-{self.build_string}"

    def requirements(self, kind: str) -> list[str]:
        reqs = (self.meta.get("requirements") or {}).get(kind) or []
        return [str(r) for r in reqs if r is not None]

    def sources(self) -> list[dict]:
        src = self.meta.get("source") or []
        return [src] if isinstance(src, dict) else list(src)


class _Ctx:
    """conda-build's Jinja context functions, recording which variant keys they read."""

    def __init__(self, recipe_dir: Path, variant: dict[str, str], outputs: dict[str, str], strict: bool):
        self.recipe_dir = recipe_dir
        self.variant = variant
        self.outputs = outputs  # package name -> version, from the first pass
        self.strict = strict
        self.used: set[str] = set()
        self.loaded: list[Path] = []

    def _get(self, key: str):
        if key in self.variant:
            self.used.add(key)
        return self.variant.get(key)

    def _compiler_or_stdlib(self, language: str, kind: str) -> str:
        name = self._get(f"{language}_{kind}")
        if name is None:
            if kind == "stdlib":
                raise RecipeError(str(self.recipe_dir / "meta.yaml"),
                                  f"stdlib({language!r}) needs `{language}_stdlib` and `{language}_stdlib_version` "
                                  f"in the variant config (recipes/conda_build_config.yaml)")
            name = DEFAULT_COMPILERS.get(language, language)
        version = self._get(f"{language}_{kind}_version")
        spec = f"{name}_{PLATFORM}"
        return ensure_valid_spec(f"{spec} {version}") if version else spec

    def compiler(self, language: str) -> str:
        return self._compiler_or_stdlib(language, "compiler")

    def stdlib(self, language: str) -> str:
        return self._compiler_or_stdlib(language, "stdlib")

    def cdt(self, package_name: str) -> str:
        cdt_name = self._get("cdt_name") or "cos7"
        cdt_arch = self._get("cdt_arch") or "x86_64"
        name, _, rest = package_name.partition(" ")
        return f"{name}-{cdt_name}-{cdt_arch}" + (f" {rest}" if rest else "")

    def pin_subpackage(self, subpackage_name: str, min_pin: str = "x.x.x.x.x.x", max_pin: str = "x",
                       exact: bool = False, **_ignored) -> str:
        version = self.outputs.get(subpackage_name)
        if version is None:
            if self.strict:
                raise RecipeError(str(self.recipe_dir / "meta.yaml"),
                                  f"pin_subpackage({subpackage_name!r}): not a package of this recipe")
            return subpackage_name
        if exact:
            return f"{subpackage_name} {version}"
        return f"{subpackage_name} {apply_pin_expressions(version, min_pin, max_pin)}"

    def pin_compatible(self, package_name: str, lower_bound: str | None = None, upper_bound: str | None = None,
                       min_pin: str = "x.x.x.x.x.x", max_pin: str = "x", exact: bool = False, **_ignored) -> str:
        if lower_bound and upper_bound:
            return f"{package_name} >={lower_bound},<{upper_bound}"
        if lower_bound:
            return f"{package_name} {apply_pin_expressions(lower_bound, min_pin, max_pin)}"
        if not self.strict:
            return package_name
        raise RecipeError(str(self.recipe_dir / "meta.yaml"),
                          f"pin_compatible({package_name!r}) needs the solved host environment (conda-build only); "
                          f"give lower_bound= to render it here")

    def _find(self, filename: str, from_recipe_dir: bool) -> Path:
        p = Path(filename)
        if not p.is_absolute():
            if not from_recipe_dir:
                raise RecipeError(str(self.recipe_dir / "meta.yaml"),
                                  f"load_file_data({filename!r}) without from_recipe_dir=True reads from the work "
                                  f"directory, which only exists during conda-build; use from_recipe_dir=True")
            p = self.recipe_dir / p
        p = p.resolve()
        if not p.is_file():
            raise RecipeError(str(self.recipe_dir / "meta.yaml"), f"load_file_data: no such file {filename!r} ({p})")
        self.loaded.append(p)
        return p

    def load_file_data(self, filename: str, fmt: str | None = None, from_recipe_dir: bool = False, **_ignored):
        p = self._find(filename, from_recipe_dir)
        fmt = (fmt or p.suffix.lstrip(".")).lower()
        text = p.read_text()
        return load_str_data(text, fmt, where=str(p))

    def load_file_regex(self, load_file: str, regex_pattern: str, from_recipe_dir: bool = False, **_ignored):
        return re.search(regex_pattern, self._find(load_file, from_recipe_dir).read_text())


def load_str_data(string: str, fmt: str, where: str = "load_str_data"):
    try:
        if fmt == "json":
            return json.loads(string)
        if fmt in ("yaml", "yml"):
            return yaml.safe_load(string)
        if fmt == "toml":
            return tomllib.loads(string)
    except (ValueError, yaml.YAMLError) as e:
        raise RecipeError(where, f"cannot parse as {fmt}: {e}") from None
    raise RecipeError(where, f"unknown file format {fmt!r} (json, yaml, yml, toml)")


class _FilteredLoader(jinja2.BaseLoader):
    """Apply selectors to the template source before Jinja sees it (conda-build's FilteredLoader)."""

    def __init__(self, recipe_dir: Path, ns: dict):
        self.inner = jinja2.FileSystemLoader(str(recipe_dir))
        self.ns = ns

    def get_source(self, environment, template):
        contents, filename, uptodate = self.inner.get_source(environment, template)
        return select_lines(contents, self.ns, filename), filename, uptodate


def _render_pass(recipe_dir: Path, variant: dict[str, str], environ: dict[str, str], outputs: dict[str, str],
                 strict: bool, pkg_hash: str, prefix: str) -> tuple[str, _Ctx]:
    ctx = _Ctx(recipe_dir, variant, outputs, strict)
    ns = namespace(variant)
    env = jinja2.Environment(loader=_FilteredLoader(recipe_dir, ns),
                             undefined=jinja2.StrictUndefined if strict else jinja2.ChainableUndefined,
                             keep_trailing_newline=True)
    env.globals.update(ns)
    env.globals.update(
        environ=environ, os=os,
        load_file_data=ctx.load_file_data, load_file_regex=ctx.load_file_regex, load_str_data=load_str_data,
        compiler=ctx.compiler, stdlib=ctx.stdlib, cdt=ctx.cdt,
        pin_subpackage=ctx.pin_subpackage, pin_compatible=ctx.pin_compatible,
        PYTHON=f"{prefix}/bin/python", PREFIX=prefix, RECIPE_DIR=str(recipe_dir), PKG_HASH=pkg_hash,
        target_platform=PLATFORM, build_platform=PLATFORM,
    )
    where = str(recipe_dir / "meta.yaml")
    try:
        text = env.get_template("meta.yaml").render()
    except jinja2.TemplateNotFound:
        raise RecipeError(str(recipe_dir), "no meta.yaml") from None
    except jinja2.UndefinedError as e:
        raise RecipeError(where, f"Jinja: {e}") from None
    except jinja2.TemplateSyntaxError as e:
        raise RecipeError(f"{where}:{e.lineno}", f"Jinja syntax: {e.message}") from None
    except (TypeError, KeyError, IndexError, ValueError) as e:
        raise RecipeError(where, f"Jinja: {type(e).__name__}: {e}") from None
    return select_lines(text, ns, where), ctx


def used_keys_in_text(variant_keys, texts: list[str]) -> set[str]:
    """Variant keys named in the recipe or its scripts (conda-build's find_used_variables_in_text, simplified)."""
    used = set()
    for key in variant_keys:
        rx = re.compile(rf"(?<![\w.]){re.escape(key)}(?![\w])")
        if any(rx.search(t) for t in texts):
            used.add(key)
    return used


def build_hash(used_variant: dict[str, str]) -> str:
    return "h" + hashlib.sha1(json.dumps(used_variant, sort_keys=True).encode()).hexdigest()[:7]


def render(recipe_dir: str | os.PathLike, variant: dict[str, str] | None = None, *,
           environ: dict[str, str] | None = None, prefix: str = "$PREFIX") -> Rendered:
    """Render one variant of a recipe. `variant` holds the full variant config values (one value per key)."""
    recipe_dir = Path(recipe_dir).resolve()
    meta_path = recipe_dir / "meta.yaml"
    if not meta_path.is_file():
        raise RecipeError(str(recipe_dir), "no meta.yaml")
    variant = {k: str(v) for k, v in (variant or {}).items()}
    environ = dict(environ if environ is not None else os.environ)
    template = meta_path.read_text()

    # Pass 1: permissive, to learn the package name/version (for pin_subpackage) and which variant keys are read.
    text1, ctx1 = _render_pass(recipe_dir, variant, environ, {}, False, "h0000000", prefix)
    meta1 = yaml_load(text1, str(meta_path)) or {}
    pkg = meta1.get("package") if isinstance(meta1, dict) else None
    if not isinstance(pkg, dict) or not pkg.get("name") or not pkg.get("version"):
        _render_pass(recipe_dir, variant, environ, {}, True, "h0000000", prefix)  # names an undefined variable
        raise RecipeError(str(meta_path), "package: name and version are required")
    outputs = {str(pkg["name"]): str(pkg["version"])}
    scripts = [p.read_text(errors="replace") for p in sorted(recipe_dir.glob("*.sh"))]
    used = ctx1.used | used_keys_in_text(variant, [template] + scripts)
    used_variant = {k: variant[k] for k in sorted(used)}
    pkg_hash = build_hash(used_variant)

    # Pass 2: strict, with pins and the hash resolved.
    text, ctx = _render_pass(recipe_dir, variant, environ, outputs, True, pkg_hash, prefix)
    meta = yaml_load(text, str(meta_path))
    if not isinstance(meta, dict):
        raise RecipeError(str(meta_path), "rendered recipe is not a mapping")
    unknown = [k for k in meta if k not in TOP_LEVEL]
    if unknown:
        raise RecipeError(str(meta_path), f"unknown top-level section(s): {', '.join(map(str, unknown))}")
    used_variant = {k: variant[k] for k in sorted(ctx.used | used)}
    return Rendered(recipe_dir, template, text, meta, used_variant, pkg_hash, environ)


# --- variants ------------------------------------------------------------------------------------------------------

def load_variant_config(path: str | os.PathLike) -> dict[str, list[str]]:
    path = Path(path)
    try:
        raw = path.read_text()
    except OSError as e:
        raise RecipeError(str(path), f"cannot read: {e.strerror}") from None
    data = yaml_load(select_lines(raw, namespace({}), str(path)), str(path)) or {}
    if not isinstance(data, dict):
        raise RecipeError(str(path), "expected a mapping of variant keys to lists")
    out: dict[str, list[str]] = {}
    for k, v in data.items():
        if k in ("zip_keys", "pin_run_as_build", "extend_keys"):
            out[k] = v
            continue
        values = v if isinstance(v, list) else [v]
        out[str(k)] = [str(x) for x in values]
    return out


def expand_variants(config: dict[str, list], keys: set[str] | None = None) -> list[dict[str, str]]:
    """All combinations of the variant config over `keys` (all keys when None), zip_keys varying together."""
    values = {k: v for k, v in config.items() if k not in ("zip_keys", "pin_run_as_build", "extend_keys")}
    keys = set(values) if keys is None else {k for k in keys if k in values}
    groups: list[list[str]] = []
    zipped = set()
    for group in config.get("zip_keys") or []:
        g = [k for k in group if k in keys]
        if g:
            lengths = {len(values[k]) for k in g}
            if len(lengths) != 1:
                raise RecipeError("conda_build_config.yaml", f"zip_keys {group} have different lengths")
            groups.append(g)
            zipped.update(g)
    groups += [[k] for k in sorted(keys - zipped)]
    combos = []
    for choice in itertools.product(*[range(len(values[g[0]])) for g in groups]):
        variant = {}
        for g, i in zip(groups, choice):
            for k in g:
                variant[k] = values[k][i]
        combos.append(variant)
    return combos


def render_variants(recipe_dir: str | os.PathLike, config: dict[str, list], *,
                    environ: dict[str, str] | None = None) -> list[Rendered]:
    """Every distinct, non-skipped rendering of a recipe over the variant config (one per used-key combination)."""
    full = expand_variants(config)
    seen: dict[tuple, Rendered] = {}
    for variant in full:
        r = render(recipe_dir, variant, environ=environ)
        key = tuple(sorted(r.variant.items()))
        if key not in seen and not r.skip:
            seen[key] = r
    return list(seen.values())
