"""Benchmark settings: the dask config file a run uses (`--config`) and the one-at-a-time sweep (`--knob`).

A run's settings are ONE dask config tree (what a `DASK_CONFIG` directory would hold), made of
  1. the config file (`tuned` = the shipped src/ucx_dask_gpu/config/tuned-gpu.yaml, `none`, or a path),
  2. in CPU mode, the settings that make `ucx` mean UCX over TCP on a host without GPUs,
  3. the knob of a sweep variant (one or more KEY=VALUE applied together).
Keys are checked against dask's, distributed's and distributed-ucxx's own default config, so a typo fails at once
with one line instead of silently measuring the defaults.

Three kinds of key:
  - dask config keys (dotted, as in YAML): `distributed.scheduler.bandwidth=20GB`, `array.chunk-size=1GiB`,
    `distributed-ucxx.multi-buffer=true`, `distributed-ucxx.environment.rndv-scheme=get_zcopy` (-> UCX_RNDV_SCHEME);
  - cluster keys, ours, under `ucx-dask-gpu.cluster.` (arguments of LocalCUDACluster that dask config has no key
    for): threads-per-worker, rmm-pool-size, rmm-maximum-pool-size, rmm-async, rmm-allocator-external-lib-list,
    device-memory-limit, memory-limit;
  - environment variables (UPPER_CASE names), e.g. `UCXPY_PROGRESS_MODE=blocking`, `UCX_RNDV_THRESH=8192`:
    written into `distributed.nanny.pre-spawn-environ` (so workers get them, and the same config in an image gives
    them to workers too) and set in the benchmark process itself (the scheduler and the client live there in a
    LocalCluster). `NAME=` (empty) removes the variable.

PyYAML and dask are imported where a setting is read, not when the CLI starts.
"""
from __future__ import annotations

import copy
import importlib.util
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import BENCH_CONFIG, USAGE, UserError

NAMESPACE = "ucx-dask-gpu"
CLUSTER_PREFIX = f"{NAMESPACE}.cluster"
TUNED_NAME = "tuned-gpu.yaml"
ENV_KEY_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
DASK_KEY_RE = re.compile(r"^[a-z0-9_][a-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*$")
PRE_SPAWN = "distributed.nanny.pre-spawn-environ"
# Maps whose entries are free-form (environment variables, UCX options): any key is accepted below them.
UCX_ENV = "distributed-ucxx.environment"
FREEFORM = (UCX_ENV, "distributed.nanny.environ", PRE_SPAWN)

# Cluster keys (LocalCUDACluster / LocalCluster arguments) with their defaults = dask-cuda's own defaults.
CLUSTER_DEFAULTS: dict[str, Any] = {
    "threads-per-worker": 1,
    "rmm-pool-size": None,
    "rmm-maximum-pool-size": None,
    "rmm-async": False,
    "rmm-allocator-external-lib-list": None,
    "device-memory-limit": "default",
    "memory-limit": "auto",
}
# Only meaningful with GPUs; ignored (and reported) in CPU mode.
GPU_ONLY_CLUSTER_KEYS = ("rmm-pool-size", "rmm-maximum-pool-size", "rmm-async", "rmm-allocator-external-lib-list",
                         "device-memory-limit")

# CPU mode: `ucx` is UCX over TCP (no CUDA context, no CUDA transports); applied after the file, before knobs.
CPU_UCX_SETTINGS = {
    "distributed-ucxx": {"tcp": True, "nvlink": False, "infiniband": False, "rdmacm": False, "cuda-copy": False,
                         "create-cuda-context": False},
}


# --- small tree helpers ---------------------------------------------------------------------------------------------

def get_path(tree: dict, dotted: str, default=None):
    cur: Any = tree
    for part in _split(dotted):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


def set_path(tree: dict, dotted: str, value) -> None:
    parts = _split(dotted)
    cur = tree
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = cur[part] = {}
        cur = nxt
    cur[parts[-1]] = value


def del_path(tree: dict, dotted: str) -> None:
    parts = _split(dotted)
    cur = tree
    for part in parts[:-1]:
        cur = cur.get(part)
        if not isinstance(cur, dict):
            return
    cur.pop(parts[-1], None)


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _split(dotted: str) -> list[str]:
    # Free-form maps hold environment variable names, which never contain dots; plain split is exact.
    return dotted.split(".")


# --- the defaults that keys are checked against --------------------------------------------------------------------

_DEFAULTS: dict | None = None


def default_config() -> dict:
    """dask + distributed + distributed-ucxx default config trees, read from their YAML (nothing imported)."""
    global _DEFAULTS
    if _DEFAULTS is None:
        import yaml

        tree: dict = {}
        for pkg, name in (("dask", "dask.yaml"), ("distributed", "distributed.yaml"),
                          ("distributed_ucxx", "distributed-ucxx.yaml")):
            spec = importlib.util.find_spec(pkg)
            if spec is None or not spec.submodule_search_locations:
                continue  # not installed: its keys cannot be checked (and the run would fail on import anyway)
            path = Path(list(spec.submodule_search_locations)[0]) / name
            if path.is_file():
                tree = deep_merge(tree, yaml.safe_load(path.read_text()) or {})
        _DEFAULTS = tree
    return _DEFAULTS


def _canon(part: str) -> str:
    return part.replace("_", "-")


def _lookup_default(dotted: str) -> tuple[bool, Any]:
    """(found, default value) with dask's key rule: '-' and '_' are the same."""
    cur: Any = default_config()
    for part in _split(dotted):
        if not isinstance(cur, dict):
            return False, None
        match = next((k for k in cur if _canon(str(k)) == _canon(part)), None)
        if match is None:
            return False, None
        cur = cur[match]
    return True, cur


def _is_freeform(dotted: str) -> bool:
    return any(dotted == f or dotted.startswith(f + ".") for f in FREEFORM)


def check_key(dotted: str, where: str) -> str:
    """Validate one dask config key (a leaf); returns its kind: 'cluster', 'dask' or 'freeform'."""
    if not DASK_KEY_RE.match(dotted):
        raise UserError(f"{where}: {dotted!r} is not a dask config key (dotted lower-case) or an environment "
                        f"variable (UPPER_CASE)", BENCH_CONFIG)
    if dotted.startswith(CLUSTER_PREFIX + "."):
        name = dotted[len(CLUSTER_PREFIX) + 1:]
        if name not in CLUSTER_DEFAULTS:
            raise UserError(f"{where}: unknown cluster key {dotted!r} (known: "
                            f"{', '.join(sorted(CLUSTER_DEFAULTS))})", BENCH_CONFIG)
        return "cluster"
    if dotted == NAMESPACE or dotted.startswith(NAMESPACE + "."):
        return "freeform"  # other tools' keys in our namespace: passed through untouched
    if _is_freeform(dotted):
        return "freeform"
    found, _ = _lookup_default(dotted)
    if not found:
        top = dotted.split(".")[0]
        hint = "" if _lookup_default(top)[0] else f" (no config namespace {top!r})"
        raise UserError(f"{where}: unknown dask config key {dotted!r}{hint}", BENCH_CONFIG)
    return "dask"


def leaves(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) for every leaf; free-form maps and keys whose default is not a mapping are leaves."""
    out = []
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v and not _is_freeform(key):
            found, default = _lookup_default(key)
            ours = key == NAMESPACE or key == CLUSTER_PREFIX
            if ours or (found and isinstance(default, dict) and default):
                out += leaves(v, key)
                continue
        out.append((key, v))
    return out


# --- values ---------------------------------------------------------------------------------------------------------

def parse_value(text: str):
    """A knob value as YAML reads it (true -> bool, 0.5 -> float, 20GB -> str); none/null -> None."""
    import yaml

    if text.strip().lower() in ("none", "null", "~"):
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _bytes_or_fraction(value, name: str, where: str, allowed_words: tuple[str, ...] = ()) -> None:
    from dask.utils import parse_bytes

    if value is None or isinstance(value, bool):
        if isinstance(value, bool):
            raise UserError(f"{where}: {name} must be a size, a fraction or none, got {value!r}", BENCH_CONFIG)
        return
    if isinstance(value, (int, float)):
        if value < 0:
            raise UserError(f"{where}: {name} must not be negative, got {value!r}", BENCH_CONFIG)
        return
    if isinstance(value, str):
        if value in allowed_words:
            return
        try:
            parse_bytes(value)
            return
        except (ValueError, TypeError):
            pass
    raise UserError(f"{where}: {name} must be a size like 40GB, a fraction like 0.5 or none, got {value!r}",
                    BENCH_CONFIG)


def check_cluster_value(name: str, value, where: str) -> None:
    if name == "threads-per-worker":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UserError(f"{where}: threads-per-worker must be an integer >= 1, got {value!r}", BENCH_CONFIG)
    elif name == "rmm-async":
        if not isinstance(value, bool):
            raise UserError(f"{where}: rmm-async must be true or false, got {value!r}", BENCH_CONFIG)
    elif name == "rmm-allocator-external-lib-list":
        items = value.split(",") if isinstance(value, str) else value
        if value is not None and (not isinstance(items, list) or not all(
                isinstance(i, str) and i.strip() in ("cupy", "torch") for i in items)):
            raise UserError(f"{where}: rmm-allocator-external-lib-list must list cupy and/or torch, got {value!r}",
                            BENCH_CONFIG)
    elif name == "device-memory-limit":
        _bytes_or_fraction(value, name, where, ("default", "auto"))
    elif name == "memory-limit":
        _bytes_or_fraction(value, name, where, ("auto",))
    else:
        _bytes_or_fraction(value, name, where)


def check_tree(tree: dict, where: str) -> None:
    if not isinstance(tree, dict):
        raise UserError(f"{where}: a dask config file must be a YAML mapping, got {type(tree).__name__}",
                        BENCH_CONFIG)
    for key, value in leaves(tree):
        kind = check_key(key, where)
        if kind == "cluster":
            check_cluster_value(key.rsplit(".", 1)[1], value, where)
        elif _is_freeform(key) and key in FREEFORM and not isinstance(value, dict):
            raise UserError(f"{where}: {key} must be a mapping, got {value!r}", BENCH_CONFIG)
        elif key == UCX_ENV:
            bad = {k: v for k, v in value.items() if not isinstance(v, str)}
            if bad:
                k, v = next(iter(bad.items()))
                raise UserError(f"{where}: {UCX_ENV}.{k} must be a string (write {str(v).lower()!r} in quotes): "
                                f"distributed-ucxx copies these values into os.environ unchanged", BENCH_CONFIG)


# --- config files ---------------------------------------------------------------------------------------------------

def tuned_path() -> Path:
    return Path(str(resources.files("ucx_dask_gpu").joinpath("config", TUNED_NAME)))


@dataclass(frozen=True)
class ConfigFile:
    name: str          # label used in reports: "tuned-gpu", "defaults" or the file's stem
    path: str | None   # None for "none"
    tree: dict


def load_config(arg: str) -> ConfigFile:
    """`tuned` (the shipped file), `none` (dask's and dask-cuda's defaults) or a path to a dask config YAML."""
    import yaml

    if arg == "none":
        return ConfigFile("defaults", None, {})
    path = tuned_path() if arg == "tuned" else Path(arg)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"--config {arg}: cannot read {path}: {e.strerror or e}", BENCH_CONFIG) from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else "syntax error"
        raise UserError(f"--config {path}: not valid YAML: {first}", BENCH_CONFIG) from None
    tree = tree or {}
    check_tree(tree, f"--config {path.name}")
    return ConfigFile(path.stem, str(path), tree)


# --- knobs ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Setting:
    key: str
    value: Any
    kind: str  # "env", "cluster", "dask", "freeform"

    def text(self) -> str:
        v = self.value
        if v is None:
            shown = "" if self.kind == "env" else "none"
        elif isinstance(v, bool):
            shown = "true" if v else "false"
        else:
            shown = str(v)
        return f"{self.key}={shown}"


@dataclass(frozen=True)
class Knob:
    text: str
    settings: tuple[Setting, ...] = field(default_factory=tuple)


def parse_knob(text: str) -> Knob:
    """`KEY=VALUE[;KEY=VALUE...]`: one sweep variant (its settings applied together)."""
    settings = []
    parts = [p.strip() for p in text.split(";")]
    if not text.strip() or not all(parts):
        raise UserError(f"--knob {text!r}: expected KEY=VALUE[;KEY=VALUE...]", USAGE)
    seen = set()
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"--knob {text!r}: {part!r} is not KEY=VALUE", USAGE)
        if key in seen:
            raise UserError(f"--knob {text!r}: {key} given twice", USAGE)
        seen.add(key)
        where = f"--knob {part}"
        if ENV_KEY_RE.match(key):
            settings.append(Setting(key, raw if raw != "" else None, "env"))
            continue
        kind = check_key(key, where)
        # UCX options reach os.environ as they are: keep them text (UCX_MAX_RNDV_RAILS=1, not the integer 1).
        value = raw if key.startswith(UCX_ENV + ".") else parse_value(raw)
        if kind == "cluster":
            check_cluster_value(key.rsplit(".", 1)[1], value, where)
        elif key in FREEFORM:
            raise UserError(f"{where}: set one entry, e.g. {key}.NAME=VALUE", BENCH_CONFIG)
        settings.append(Setting(key, value, kind))
    return Knob(text.strip(), tuple(settings))


def apply_settings(tree: dict, settings: tuple[Setting, ...] | list[Setting]) -> dict:
    out = copy.deepcopy(tree)
    for s in settings:
        if s.kind == "env":
            if s.value is None:
                del_path(out, f"{PRE_SPAWN}.{s.key}")
                set_path(out, f"{NAMESPACE}.unset-environ.{s.key}", True)
            else:
                set_path(out, f"{PRE_SPAWN}.{s.key}", str(s.value))
                del_path(out, f"{NAMESPACE}.unset-environ.{s.key}")
        else:
            set_path(out, s.key, s.value)
    return out


# --- what a run gets ------------------------------------------------------------------------------------------------

def cluster_settings(tree: dict, cpu: bool) -> tuple[dict, list[str]]:
    """Resolved cluster keys (defaults filled in) and, in CPU mode, the GPU-only keys that were set but ignored."""
    given = get_path(tree, CLUSTER_PREFIX, {}) or {}
    out = dict(CLUSTER_DEFAULTS)
    ignored = []
    for k, v in given.items():
        if cpu and k in GPU_ONLY_CLUSTER_KEYS:
            if v != CLUSTER_DEFAULTS[k]:
                ignored.append(f"{CLUSTER_PREFIX}.{k}")
            continue
        out[k] = v
    return out, ignored


def environment(tree: dict) -> tuple[dict[str, str], list[str]]:
    """Environment variables to set (pre-spawn-environ entries the settings gave) and ones to remove."""
    env = {str(k): str(v) for k, v in (get_path(tree, PRE_SPAWN, {}) or {}).items()}
    unset = sorted((get_path(tree, f"{NAMESPACE}.unset-environ", {}) or {}).keys())
    return env, unset


def knob_rows(settings: tuple[Setting, ...]) -> dict[str, Any]:
    return {s.key: s.value for s in settings}
