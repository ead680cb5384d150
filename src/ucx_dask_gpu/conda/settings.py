"""The recipe files generated from stack.toml (`conda regen`), and the recipes packed for a build or a feedstock
(`conda pack`); docs/conda.md says which lines and files are generated and what pack adds.

stack.toml is the only place a version, URL or sha256 is written, yet a feedstock copies one recipe folder: so the
values are written INTO the recipes, between "Generated from stack.toml" and "End of generated lines" markers, and
into the files generated whole (`generated_files`). The carried patches stay in ucx-src-build/patches; `pack` copies
them in.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..errors import RECIPE_INVALID, UserError
from ..fsutil import atomic_write_bytes, replace_own_dir
from ..stack.lock import canonical, load_lock
from ..stack import Stack

RECIPES = ("ucx", "ucxx", "ucx-dask-gpu")
PINNING_PATH = Path("recipes/conda_build_config.yaml")
BEGIN = "Generated from stack.toml by `ucx-dask-gpu conda regen`"
END = "# End of generated lines."
GENERATED_HEADER = f"# {BEGIN} (make regen); do not edit by hand.\n"


def rapids_version(st: Stack) -> str:
    """RAPIDS release of the UCXX build (26.08 from rapids-cmake 26.08.00): librmm/rmm pins."""
    return ".".join(st.ucxx.rapids_cmake.version.split(".")[:2])


def lock_versions_by_conda_name(st: Stack) -> dict[str, str]:
    """conda name -> version in the lock, through [conda.names]."""
    pins = load_lock(st.lock_path())
    to_conda = {canonical(k): v for k, v in st.conda.names.items()}
    out = {}
    for pypi, pin in pins.items():
        conda = to_conda.get(pypi, pypi)
        if conda:
            out[conda] = pin.version
    return out


def context_key(package: str) -> str:
    """The recipe context variable that pins a package: dask-cuda -> dask_cuda_version."""
    return re.sub(r"[^a-z0-9]", "_", package) + "_version"


# The recipes whose main source carries ucx-src-build's patches, and the folder of ucx-src-build/patches they are in.
PATCHED_RECIPES = ("ucx", "ucxx")
# The recipes with python outputs: their conda_build_config.yaml sets python_min.
PYTHON_RECIPES = ("ucxx", "ucx-dask-gpu")
# The line of a recipe's source where `pack` lists the patches (same indentation as the source's keys).
PATCHES_MARKER = "# <conda pack: patches>"


def patch_folder(st: Stack, recipe: str) -> str:
    return st.ucx.version if recipe == "ucx" else f"ucxx-{st.ucxx.source.version}"


def carried_patches(st: Stack, recipe: str) -> list[Path]:
    """The patches the from-source build carries for the packaged version (ucx-src-build/patches/<folder>/): the
    recipe applies the same ones to the same source."""
    d = st.root / "ucx-src-build" / "patches" / patch_folder(st, recipe)
    return sorted(d.glob("*.patch")) if d.is_dir() else []


# --- what each generated region holds ------------------------------------------------------------------------------

def _yaml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def context_values(st: Stack, recipe: str) -> dict[str, str]:
    ucx, about, u = st.ucx, st.conda.about, st.ucxx
    # Sources are upstream's git repositories at the commit stack.toml records (docs/conda.md "Sources"): the commit
    # id hashes the content, so whoever builds the recipe verifies what upstream serves without trusting a sha256.
    if recipe == "ucx":
        return {"version": ucx.version, "git_url": ucx.git, "git_rev": ucx.commit, "home": about.ucx_home,
                "repository": about.ucx_dev_url}
    if recipe == "ucxx":
        return {"version": u.source.version, "git_url": u.source.git, "git_rev": u.source.commit,
                "rapids_cmake_git_url": u.rapids_cmake.git, "rapids_cmake_git_rev": u.rapids_cmake.commit,
                "cpm_git_url": u.cpm.git, "cpm_git_rev": u.cpm.commit,
                "rapids_version": rapids_version(st), "ucx_version": ucx.version, "home": about.ucxx_home}
    if recipe == st.name:
        locked = lock_versions_by_conda_name(st)
        values = {"version": st.version, "home": about.home, "ucx_version": ucx.version,
                  "ucxx_version": u.source.version}
        for name in st.conda.metapackage:
            if name in ("ucxx", "distributed-ucxx"):
                continue  # this channel's ucxx recipe: ucxx_version
            if name not in locked:
                raise UserError(f"{name} (stack.toml [conda].metapackage) is not in the lock {st.python.lock}",
                                RECIPE_INVALID)
            values[context_key(name)] = locked[name]
        return values
    raise KeyError(recipe)


def configure_lines(st: Stack) -> list[str]:
    flags = " ".join(st.configure_flags)
    return [f"configure_flags=({flags})"] if len(flags) < 90 else \
        ["configure_flags=("] + [f"    {f}" for f in st.configure_flags] + [")"]


def entry_point_lines(st: Stack) -> list[str]:
    """The metapackage's entry points: every command pyproject.toml's [project.scripts] installs."""
    import tomllib

    try:
        scripts = tomllib.loads((st.root / "pyproject.toml").read_text())["project"]["scripts"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"pyproject.toml: no [project.scripts] to declare as entry points ({e})", RECIPE_INVALID) \
            from None
    return [f"      - {name} = {target}" for name, target in scripts.items()]


def ucxx_cmake_lines(st: Stack, package: str) -> list[str]:
    """The CMake options of one [[ucxx.build.packages]] entry, as the from-source wheels use them, minus the
    CMAKE_INSTALL_* directories of the wheel layout (a conda package installs into $PREFIX/lib, include)."""
    (pkg,) = [p for p in st.ucxx.packages if p.name == package]
    args = [a for a in pkg.cmake_args if not a.startswith("-DCMAKE_INSTALL_")]
    return [f"wheel_cmake_args=({' '.join(args)})"]


def patch_lines(st: Stack, recipe: str, indent: str) -> list[str]:
    patches = carried_patches(st, recipe)
    return [f"{indent}patches:"] + [f"{indent}  - patches/{p.name}" for p in patches] if patches else []


def replace_region(text: str, lines: list[str], where: str, occurrence: int = 0) -> str:
    """Replace the lines between the n-th BEGIN marker line and the END line after it (markers kept)."""
    src = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(src) if BEGIN in line]
    if len(starts) <= occurrence:
        raise UserError(f"{where}: no '{BEGIN}' marker #{occurrence + 1} for the generated lines", RECIPE_INVALID)
    start = starts[occurrence]
    end = next((i for i in range(start + 1, len(src)) if src[i].strip() == END), None)
    if end is None:
        raise UserError(f"{where}: the generated lines after line {start + 1} lack their '{END}' line", RECIPE_INVALID)
    return "".join(src[: start + 1] + [ln + "\n" for ln in lines] + src[end:])


def _variants_yaml(keys: dict[str, list[str]], comment: str, zip_keys: list[list[str]] | None = None) -> str:
    out = [GENERATED_HEADER.rstrip(), comment]
    for key, values in keys.items():
        out.append(f"{key}:")
        out += [f"  - {_yaml_str(v)}" for v in values]
    if zip_keys:
        out.append("zip_keys:")
        out += [f"  - [{', '.join(group)}]" for group in zip_keys]
    return "\n".join(out) + "\n"


def pinning_fallback(st: Stack) -> str:
    """recipes/conda_build_config.yaml: what conda-forge's pinning + migrators give the keys these recipes read."""
    c = st.conda
    return _variants_yaml(
        {"c_stdlib": ["sysroot"], "c_stdlib_version": list(c.c_stdlib_versions), "cuda_compiler": ["cuda-nvcc"],
         "cuda_compiler_version": list(c.cuda_versions), "python": [f"{st.python.version}.* *_cpython"]},
        "# The fallback for conda-forge's global pinning (conda-forge-pinning) + the migrators the feedstocks opt into\n"
        "# (stack.toml [conda]), where conda-forge-pinning is absent: the keys recipes/*/recipe.yaml read, with the\n"
        "# values that stack gives them (CUDA versions zipped with their glibc floor; the image's python). Each\n"
        "# recipe's own conda_build_config.yaml applies on top of either.",
        zip_keys=[["c_stdlib_version", "cuda_compiler_version"]])


def recipe_variants(st: Stack) -> str:
    """A python recipe's conda_build_config.yaml: its python_min above conda-forge's floor (CFEP-25)."""
    return _variants_yaml(
        {"python_min": [st.conda.python_min]},
        "# What this feedstock overrides of conda-forge's pinning: python_min, UCXX's requires-python (CFEP-25).")


def generated_files(st: Stack, recipes_dir: Path | None = None) -> dict[Path, bytes]:
    """Every generated file (or file with generated lines) under recipes/, as it should be: path -> bytes."""
    recipes_dir = recipes_dir or st.root / "recipes"
    out: dict[Path, bytes] = {recipes_dir / PINNING_PATH.name: pinning_fallback(st).encode()}
    for recipe in RECIPES:
        rdir = recipes_dir / recipe
        path = rdir / "recipe.yaml"
        try:
            text = path.read_text()
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}", RECIPE_INVALID) from None
        context = [f"  {k}: {_yaml_str(v)}" for k, v in context_values(st, recipe).items()]
        text = replace_region(text, context, str(path))
        if recipe == st.name:
            text = replace_region(text, entry_point_lines(st), str(path), occurrence=1)
        out[path] = text.encode()
        if recipe == "ucx":
            build_sh = rdir / "build.sh"
            out[build_sh] = replace_region(build_sh.read_text(), configure_lines(st), str(build_sh)).encode()
        if recipe == "ucxx":
            for package, script in (("libucxx", "build_libucxx.sh"), ("ucxx", "build_ucxx.sh")):
                sh = rdir / script
                out[sh] = replace_region(sh.read_text(), ucxx_cmake_lines(st, package), str(sh)).encode()
        if recipe in PYTHON_RECIPES:
            out[rdir / "conda_build_config.yaml"] = recipe_variants(st).encode()
    return out


def drift(st: Stack, recipes_dir: Path | None = None) -> list[str]:
    """Generated files that differ from what stack.toml generates (empty: in sync)."""
    out = []
    for path, want in generated_files(st, recipes_dir).items():
        have = path.read_bytes() if path.is_file() else None
        if have != want:
            out.append(str(path.relative_to(st.root)) if path.is_relative_to(st.root) else str(path))
    return out


def regen(st: Stack, recipes_dir: Path | None = None) -> list[Path]:
    """Write every generated file that changed; returns the paths written."""
    changed = []
    for path, want in generated_files(st, recipes_dir).items():
        if not path.is_file() or path.read_bytes() != want:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, want, mode=0o755 if path.suffix == ".sh" else 0o644)
            changed.append(path)
    return changed


# --- packing ----------------------------------------------------------------------------------------------------

def _packed_recipe_text(st: Stack, recipe: str, text: str, origin: Path) -> str:
    """The recipe as packed: the patch list at its marker, a `path:` source made absolute (it names the folder the
    recipe came from; a feedstock gives the release archive instead, docs/conda.md)."""
    out = []
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        indent = line[: len(line) - len(line.lstrip())]
        if stripped == PATCHES_MARKER:
            if recipe not in PATCHED_RECIPES:
                raise UserError(f"recipes/{recipe}/recipe.yaml: a patches marker, but ucx-src-build carries no "
                                f"patches for it", RECIPE_INVALID)
            out += [ln + "\n" for ln in patch_lines(st, recipe, indent)]
            continue
        m = re.match(r"^(\s*(?:- )?path: )(\S+)\s*$", line)
        if m and not m.group(2).startswith(("/", "$")):
            line = f"{m.group(1)}{(origin / m.group(2)).resolve()}\n"
        out.append(line)
    if recipe in PATCHED_RECIPES and carried_patches(st, recipe) and \
            not any(ln.strip() == PATCHES_MARKER for ln in text.splitlines()):
        raise UserError(f"recipes/{recipe}/recipe.yaml: no '{PATCHES_MARKER}' line in its source, so the patches of "
                        f"ucx-src-build/patches/{patch_folder(st, recipe)}/ would not be applied", RECIPE_INVALID)
    return "".join(out)


def pack(st: Stack, dest: Path, recipes_dir: Path | None = None) -> Path:
    """Every recipe folder as a build or a feedstock takes it, into `dest` (what an earlier pack wrote there is
    replaced; anything else there is refused, fsutil.replace_own_dir): the committed folder, the patches of
    ucx-src-build copied into patches/ and listed, and the fallback variant config beside them."""
    recipes_dir = (recipes_dir or st.root / "recipes").resolve()
    with replace_own_dir(dest) as tmp:
        shutil.copy2(recipes_dir / PINNING_PATH.name, tmp / PINNING_PATH.name)
        for recipe in RECIPES:
            origin = recipes_dir / recipe
            if not (origin / "recipe.yaml").is_file():
                raise UserError(f"{origin / 'recipe.yaml'}: missing", RECIPE_INVALID)
            shutil.copytree(origin, tmp / recipe, ignore=shutil.ignore_patterns("patches"))
            text = (origin / "recipe.yaml").read_text()
            (tmp / recipe / "recipe.yaml").write_text(_packed_recipe_text(st, recipe, text, origin))
            if recipe in PATCHED_RECIPES:
                for patch in carried_patches(st, recipe):
                    (tmp / recipe / "patches").mkdir(exist_ok=True)
                    shutil.copy2(patch, tmp / recipe / "patches" / patch.name)
    return dest
