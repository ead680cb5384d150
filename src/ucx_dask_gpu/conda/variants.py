"""The variant config a recipe renders with, stacked as conda-smithy stacks a feedstock's (docs/conda.md, "Variants"):
the global pinning, the migrators the feedstocks opt into, then the recipe's own conda_build_config.yaml; where the
pinning is absent, recipes/conda_build_config.yaml (generated from stack.toml) stands in for pinning + migrators. A
migrator is not a plain variant file: for `operation: key_add` its values are APPENDED to the pinning's lists, and
the recipe's own file may override keys only keeping zipped lists the same length: rattler-build refuses anything
else (InvalidZipKeyLength), as conda-smithy does.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import RECIPE_INVALID, UserError
from ..stack import Stack

CUDA_ENABLED_VAR = "CF_CUDA_ENABLED"
PINNING_ENV = "UCX_DASK_GPU_CONDA_PINNING"
MIGRATOR_KEYS = ("__migrator", "migrator_ts")
CBC = "conda_build_config.yaml"
CONDA_FORGE = "conda-forge"
FALLBACK = "fallback"
MODES = ("auto", CONDA_FORGE, FALLBACK)


@dataclass(frozen=True)
class VariantStack:
    """Where a recipe's variants come from: `kind` is conda-forge (the real pinning + migrators) or fallback."""

    kind: str
    files: tuple[Path, ...]

    def describe(self) -> str:
        return f"{self.kind} ({', '.join(str(f) for f in self.files)})"


def pinning_location(st: Stack) -> Path:
    """Where conda-forge-pinning's recipe/ folder is looked for: $UCX_DASK_GPU_CONDA_PINNING, else stack.toml."""
    return Path(os.environ.get(PINNING_ENV) or st.root / st.conda.pinning).resolve()


def pinning_dir(st: Stack) -> Path | None:
    """conda-forge-pinning's recipe/ folder where a copy is at hand, else None."""
    d = pinning_location(st)
    return d if (d / CBC).is_file() else None


def choose(st: Stack, recipes_dir: Path, mode: str = "auto") -> VariantStack:
    """The variant stack to render with: the real pinning when asked for or (auto) present, else the fallback."""
    if mode not in MODES:
        raise UserError(f"variants {mode!r}: expected one of {', '.join(MODES)}", RECIPE_INVALID)
    pin = pinning_dir(st)
    if mode == CONDA_FORGE and pin is None:
        raise UserError(f"conda-forge's pinning is not at {pinning_location(st)} (${PINNING_ENV}, else stack.toml "
                        f"[conda].pinning)", RECIPE_INVALID)
    if pin is not None and mode != FALLBACK:
        migrations = [pin / "migrations" / f"{m}.yaml" for m in st.conda.migrations]
        for m in migrations:
            if not m.is_file():
                raise UserError(f"migrator {m.name} (stack.toml [conda].migrations) is not in {m.parent}",
                                RECIPE_INVALID)
        return VariantStack(CONDA_FORGE, (pin / CBC, *migrations))
    return VariantStack(FALLBACK, (recipes_dir / CBC,))


@contextlib.contextmanager
def _cuda_enabled():
    """Selectors see CF_CUDA_ENABLED=True, as on conda-forge's CUDA feedstocks (rattler-build reads the process
    environment)."""
    before = os.environ.get(CUDA_ENABLED_VAR)
    os.environ[CUDA_ENABLED_VAR] = "True"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CUDA_ENABLED_VAR, None)
        else:
            os.environ[CUDA_ENABLED_VAR] = before


def migrator_variants(path: Path) -> str:
    """A migrator's text as a variant file: its top-level `__migrator` and `migrator_ts` blocks removed (selector
    comments kept, for rattler-build's conda_build_config loader). Only key_add migrators are understood."""
    import yaml  # PyYAML: not at module load (every `ucx-dask-gpu` command starts with the standard library alone)

    try:
        text = path.read_text()
        meta = (yaml.safe_load(text) or {}).get("__migrator") or {}
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"migrator {path}: unreadable ({e})", RECIPE_INVALID) from None
    if meta.get("operation", "key_add") != "key_add":
        raise UserError(f"migrator {path.name}: operation {meta.get('operation')!r}, only key_add is applied here",
                        RECIPE_INVALID)
    out, dropping = [], False
    for line in text.splitlines(keepends=True):
        if line[:1] not in ("", " ", "\t", "#", "\n"):
            dropping = line.split(":", 1)[0].strip() in MIGRATOR_KEYS
        if not dropping:
            out.append(line)
    return "".join(out)


def _load_cbc(text_or_path: str | Path, jinja):
    """A conda_build_config.yaml through rattler-build's legacy loader (it evaluates `# [selector]` comments)."""
    from rattler_build import VariantConfig

    if isinstance(text_or_path, Path):
        return VariantConfig.from_conda_build_config(str(text_or_path), jinja)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / CBC  # the loader takes selectors only from files of this name
        path.write_text(text_or_path)
        return VariantConfig.from_conda_build_config(str(path), jinja)


def config(stack: VariantStack, platform: str, recipe_cbc: Path | None):
    """The VariantConfig for one platform: the stack's files, then the recipe's own conda_build_config.yaml."""
    from rattler_build import JinjaConfig, PlatformConfig, VariantConfig
    from rattler_build._rattler_build import RattlerBuildError

    jinja = JinjaConfig(platform=PlatformConfig(target_platform=platform))
    try:
        with _cuda_enabled():
            base = _load_cbc(stack.files[0], jinja)
            if stack.kind == CONDA_FORGE:
                values = base.to_dict()
                for migrator in stack.files[1:]:
                    for key, added in _load_cbc(migrator_variants(migrator), jinja).to_dict().items():
                        values[key] = list(values.get(key, [])) + list(added)
                # An empty key (`target_goexe:` off its platform) has no value rattler-build accepts back.
                values = {k: [x for x in v if x is not None] for k, v in values.items()}
                base = VariantConfig({k: v for k, v in values.items() if v}, zip_keys=base.zip_keys)
            if recipe_cbc is not None and recipe_cbc.is_file():
                base = base.merge(_load_cbc(recipe_cbc, jinja))
    except (RattlerBuildError, ValueError) as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"variant config {stack.describe()} + {recipe_cbc}: {first}", RECIPE_INVALID) from None
    return base


def as_variants_yaml(config, stack: VariantStack, platform: str, recipe: str, cuda: str | None = None) -> str:
    """One stacked config as a plain rattler-build variants file (`rattler-build build -m FILE`): what conda-smithy
    hands its build jobs, so the real CLI renders exactly what the project checks. `cuda`: one CUDA job's file (its
    entry of cuda_compiler_version and of every key zipped with it, as conda-smithy's .ci_support files hold)."""
    import yaml  # PyYAML: not at module load (see migrator_variants)

    values = config.to_dict()
    zips = [g for g in (config.zip_keys or []) if all(k in values for k in g)]
    if cuda is not None:
        have = [str(v) for v in values.get("cuda_compiler_version", [])]
        if cuda not in have:
            raise UserError(f"CUDA {cuda} is not one of this stack's cuda_compiler_version {have}", RECIPE_INVALID)
        i = have.index(cuda)
        group = next((g for g in zips if "cuda_compiler_version" in g), ["cuda_compiler_version"])
        values.update({k: [values[k][i]] for k in group})
    data = {k: values[k] for k in sorted(values)}
    if zips:
        data["zip_keys"] = zips
    head = (f"# The variant config of recipes/{recipe} for {platform}: {stack.describe()} + the recipe's own "
            f"{CBC},\n# stacked as conda-smithy does (ucx-dask-gpu conda variants). Use: rattler-build build -m "
            f"<this file> --ignore-recipe-variants\n")
    return head + yaml.safe_dump(data, sort_keys=False, width=120)
