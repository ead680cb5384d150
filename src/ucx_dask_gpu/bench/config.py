"""What one benchmark variant is: a protocol, a dask config (a named base merged with KEY=VALUE settings through
`dask.config`) and environment variables; and which variants can share one running cluster.

A variant is written `[PROTOCOLS@]LABEL:CONFIG[:SETTINGS]`:
  PROTOCOLS  ucx, tcp or both (`ucx,tcp`: one variant per protocol); default: the study's --protocols
  LABEL      its name in the report (letters, digits, `.`, `_`, `+`, `-`: `event+concurrent` names a combination); the variant is called PROTOCOL/LABEL
  CONFIG     `none` (dask's and dask-cuda's defaults), `shipped` (what `ucx-dask-gpu config install` gives every role),
             `tuned` (src/ucx_dask_gpu/config/tuned-gpu.yaml) or the path of a dask config YAML file
  SETTINGS   `KEY=VALUE[;KEY=VALUE...]` merged on top, each one of
             - a dask config key, dotted as in YAML (`distributed.scheduler.worker-saturation=inf`, `split_every=8`);
               values are read as dask reads DASK_* variables (true, 0.5, none, 20GB);
             - an `ucx-dask-gpu.cluster.*` key: a worker launcher's flag dask config has no key for
               (threads-per-worker, rmm-pool-size, rmm-maximum-pool-size, rmm-async, rmm-allocator-external-lib-list,
               device-memory-limit, memory-limit); other `ucx-dask-gpu.*` keys pass through unchecked;
             - an environment variable (UPPER_CASE): set in every process of the cluster (and written into
               distributed.nanny.pre-spawn-environ); `NAME=` (empty) removes it.
e.g. `ucx@pool:shipped:ucx-dask-gpu.cluster.rmm-pool-size=8GiB`, `ucx,tcp@defaults:none`.

Dask config keys are checked against dask's, distributed's and distributed-ucxx's defaults (a typo fails at once).
Client-side keys (CLIENT_SIDE: read only where a graph is built; and any --client-key prefix) are applied per
repetition in the client, so variants that differ only in them share one running cluster (docs/benchmarks.md).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..cliutil import parse_bytes
from ..errors import BENCH_CONFIG, USAGE, UserError
from ..gate import daskconfig

PROTOCOLS = ("ucx", "tcp")
NAMESPACE = "ucx-dask-gpu"
CLUSTER = "ucx-dask-gpu.cluster"
# The worker launchers' settings (cluster.worker_flags), with dask-cuda's defaults.
CLUSTER_DEFAULTS = {"threads-per-worker": 1, "rmm-pool-size": None, "rmm-maximum-pool-size": None, "rmm-async": False,
                    "rmm-allocator-external-lib-list": None, "device-memory-limit": "default", "memory-limit": "auto"}
GPU_ONLY = ("rmm-pool-size", "rmm-maximum-pool-size", "rmm-async", "rmm-allocator-external-lib-list",
            "device-memory-limit")
TUNED = "tuned-gpu.yaml"
PRE_SPAWN = "distributed.nanny.pre-spawn-environ"
FREEFORM = ("distributed-ucxx.environment", "distributed.nanny.environ", PRE_SPAWN)
# Keys dask reads with a default of its own instead of one in its YAML.
UNDECLARED = ("split_every",)
CLIENT_SIDE = ("array", "dataframe", "optimization", "tokenize", "split_every")
# CPU mode: `ucx` is UCX over TCP (no CUDA context, no CUDA transports).
CPU_UCX = {"distributed-ucxx": {"tcp": True, "nvlink": False, "infiniband": False, "rdmacm": False,
                                "cuda-copy": False, "create-cuda-context": False}}
ENV_RE = re.compile(r"^[A-Z_][A-Z0-9_]*$")
KEY_RE = re.compile(r"^[a-z0-9_][a-z0-9_-]*(\.[A-Za-z0-9_][A-Za-z0-9_-]*)*$")
LABEL_RE = re.compile(r"^[A-Za-z0-9._+-]+$")


@dataclass(frozen=True)
class Variant:
    label: str
    protocol: str
    config: str                   # none | shipped | tuned | a path
    settings: tuple               # ((key, value), ...) as given
    tree: dict                    # the dask config of every process of its cluster (and of its client)
    env: tuple                    # ((NAME, value), ...) set in every process
    unset: tuple                  # names removed from the environment

    @property
    def name(self) -> str:
        return f"{self.protocol}/{self.label}"

    def report(self) -> dict:
        """What a result says of the variant."""
        return {"name": self.name, "label": self.label, "protocol": self.protocol, "config": self.config,
                "settings": dict(self.settings), "environment": dict(self.env), "unset": list(self.unset)}

    def split(self, client_keys: tuple[str, ...]) -> tuple[dict, dict]:
        """(the cluster's config without client-side keys, those keys flattened: what dask.config.set takes)."""
        import dask.config  # dask is imported where a config is handled, not when the CLI starts

        cluster = json.loads(json.dumps(self.tree))
        overlay = {}
        for prefix in CLIENT_SIDE + tuple(client_keys):
            value = dask.config.pop(prefix, None, config=cluster)
            if value is not None:
                overlay.update(flatten(value, prefix))
        return cluster, overlay

    def cluster_id(self, client_keys: tuple[str, ...]) -> str:
        """Equal for variants that can share one running cluster."""
        cluster, _ = self.split(client_keys)
        return json.dumps([self.protocol, cluster, sorted(self.env), sorted(self.unset)], sort_keys=True, default=str)


def client_side(key: str, client_keys: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in CLIENT_SIDE + tuple(client_keys))


def flatten(value, prefix: str) -> dict:
    if not isinstance(value, dict) or not value or any(prefix == f or prefix.startswith(f + ".") for f in FREEFORM):
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(flatten(v, f"{prefix}.{k}"))
    return out


# --- the defaults keys are checked against --------------------------------------------------------------------------

@functools.cache
def defaults() -> dict:
    """dask + distributed + distributed-ucxx defaults, read from their YAML files (nothing imported)."""
    import dask.config
    import yaml

    trees = []
    for pkg, name in (("dask", "dask.yaml"), ("distributed", "distributed.yaml"),
                      ("distributed_ucxx", "distributed-ucxx.yaml")):
        spec = importlib.util.find_spec(pkg)
        path = Path(list(spec.submodule_search_locations)[0]) / name if spec and spec.origin else None
        if path is not None and path.is_file():
            trees.append(yaml.safe_load(path.read_text()) or {})
    return dask.config.merge(*trees)


def check_key(key: str, value, where: str) -> None:
    """A dask config key (a leaf) and its value; UserError BENCH_CONFIG with one line otherwise."""
    import dask.config

    if not KEY_RE.match(key):
        raise UserError(f"{where}: {key!r} is neither a dask config key (dotted lower-case) nor an environment "
                        "variable (UPPER_CASE)", BENCH_CONFIG)
    if key.startswith(CLUSTER + "."):
        return check_cluster_value(key[len(CLUSTER) + 1:], value, where)
    freeform = next((f for f in FREEFORM if key == f or key.startswith(f + ".")), None)
    if key.startswith(NAMESPACE + ".") or key in UNDECLARED:
        return
    if freeform:
        if key == freeform and not isinstance(value, dict):
            raise UserError(f"{where}: {key} is a mapping: set one entry, e.g. {key}.NAME=VALUE", BENCH_CONFIG)
        if freeform == FREEFORM[0] and any(not isinstance(v, str)
                                           for v in (value.values() if isinstance(value, dict) else [value])):
            raise UserError(f"{where}: {key} values must be strings (distributed-ucxx copies them into the "
                            "environment as they are)", BENCH_CONFIG)
        return
    try:
        dask.config.get(key, config=defaults())
    except (KeyError, TypeError):
        raise UserError(f"{where}: unknown dask config key {key!r}", BENCH_CONFIG) from None


def check_cluster_value(name: str, value, where: str) -> None:
    if name not in CLUSTER_DEFAULTS:
        raise UserError(f"{where}: unknown cluster key {CLUSTER}.{name} (known: {', '.join(CLUSTER_DEFAULTS)})",
                        BENCH_CONFIG)
    if name == "threads-per-worker":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    elif name == "rmm-async":
        ok = isinstance(value, bool)
    elif name == "rmm-allocator-external-lib-list":
        items = value.split(",") if isinstance(value, str) else value
        ok = value is None or (isinstance(items, list) and all(str(i).strip() in ("cupy", "torch") for i in items))
    else:
        words = {"device-memory-limit": ("default", "auto"), "memory-limit": ("auto",)}.get(name, ())
        ok = value is None or value in words or _size_or_fraction(value)
    if not ok:
        raise UserError(f"{where}: {CLUSTER}.{name} cannot be {value!r}", BENCH_CONFIG)


def _size_or_fraction(value) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value >= 0
    try:
        return isinstance(value, str) and parse_bytes(value) >= 0
    except (ValueError, TypeError):
        return False


def check_tree(tree, where: str, prefix: str = "") -> None:
    """Every leaf of a config file: a mapping is a leaf where the defaults have none (or it is free-form)."""
    import dask.config

    if not isinstance(tree, dict):
        raise UserError(f"{where}: a dask config file must be a YAML mapping", BENCH_CONFIG)
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        nested = isinstance(v, dict) and v and not any(key == f for f in FREEFORM)
        default = dask.config.get(key, None, config=defaults()) if nested else None
        if nested and (isinstance(default, dict) or key in (NAMESPACE, CLUSTER)):
            check_tree(v, where, key)
        else:
            check_key(key, v, where)


# --- config files ---------------------------------------------------------------------------------------------------

def load_config(name: str, cpu: bool) -> dict:
    """The dask config tree a variant starts from."""
    import dask.config
    import yaml

    if name == "none":
        return {}
    if name == "shipped":
        texts = daskconfig.render("cpu" if cpu else "auto").values()
        return dask.config.merge(*(yaml.safe_load(t) or {} for t in texts))
    path = Path(name if name != "tuned" else "tuned-gpu.yaml")
    try:
        tree = yaml.safe_load(daskconfig.packaged_text(TUNED) if name == "tuned" else path.read_text()) or {}
    except OSError as e:
        raise UserError(f"config {name}: cannot read {path}: {e.strerror or e}", BENCH_CONFIG) from None
    except yaml.YAMLError as e:
        raise UserError(f"config {path}: not valid YAML: {str(e).splitlines()[0]}", BENCH_CONFIG) from None
    check_tree(tree, f"config {path.name}")
    return tree


def write_config(directory: Path, tree: dict) -> Path:
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ucx-dask-gpu-bench.yaml").write_text(
        "# Written by ucx-dask-gpu bench for one cluster.\n" + yaml.safe_dump(tree, sort_keys=True))
    return directory


# --- variants -------------------------------------------------------------------------------------------------------

def parse_settings(text: str, where: str) -> tuple[tuple, tuple, tuple]:
    """`KEY=VALUE;...` -> (dask settings, environment, unset), each ((key, value), ...)."""
    import dask.config

    settings, env, unset, seen = [], [], [], set()
    for part in (p.strip() for p in text.split(";")):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UserError(f"{where}: {part!r} is not KEY=VALUE", USAGE)
        if key in seen:
            raise UserError(f"{where}: {key} is set twice", USAGE)
        seen.add(key)
        if ENV_RE.match(key):
            (env.append((key, raw)) if raw != "" else unset.append(key))
            continue
        # distributed-ucxx copies its environment entries into os.environ: they stay text
        value = raw if key.startswith(FREEFORM[0] + ".") else dask.config.interpret_value(raw)
        check_key(key, value, f"{where} ({part})")
        settings.append((key, value))
    return tuple(settings), tuple(env), tuple(unset)


def parse_variant(text: str, default_protocols: list[str], cpu: bool) -> list[Variant]:
    """`[PROTOCOLS@]LABEL:CONFIG[:SETTINGS]` -> one Variant per protocol."""
    import dask.config

    where = f"--variant {text!r}"
    head, at, rest = text.partition("@")
    if not at or ":" in head:
        head, rest = "", text
    protocols = [p.strip() for p in head.split(",") if p.strip()] or list(default_protocols)
    label, _, rest = rest.partition(":")
    config, _, settings_text = rest.partition(":")
    if not LABEL_RE.match(label.strip()) or not config.strip():
        raise UserError(f"{where}: expected [PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...] with LABEL of letters, "
                        "digits, '.', '_', '+', '-'", USAGE)
    bad = [p for p in protocols if p not in PROTOCOLS]
    if bad or len(set(protocols)) != len(protocols):
        raise UserError(f"{where}: protocols must be distinct names among {', '.join(PROTOCOLS)}", USAGE)
    settings, env, unset = parse_settings(settings_text, where) if settings_text.strip() else ((), (), ())
    tree = load_config(config.strip(), cpu)
    if cpu:
        tree = dask.config.merge(tree, CPU_UCX)
    for key, value in settings:
        dask.config.set({key: value}, config=tree)
    base_env = dask.config.get(PRE_SPAWN, None, config=tree) or {}
    full_env = {**{str(k): str(v) for k, v in base_env.items() if k not in unset}, **dict(env)}
    if full_env or base_env:
        dask.config.set({PRE_SPAWN: full_env}, config=tree)
    return [Variant(label.strip(), p, config.strip(), settings, tree, tuple(sorted(full_env.items())), unset)
            for p in protocols]


def parse_variants(texts: list[str], default_protocols: list[str], cpu: bool) -> list[Variant]:
    variants = [v for t in texts for v in parse_variant(t, default_protocols, cpu)]
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"--variant: {', '.join(dup)} given twice", USAGE)
    return variants


def find_variant(variants: list[Variant], name: str, option: str) -> Variant:
    """By PROTOCOL/LABEL, or by LABEL where only one protocol has it."""
    hits = [v for v in variants if v.name == name] or [v for v in variants if v.label == name]
    if len(hits) != 1:
        raise UserError(f"{option} {name!r}: expected one of {', '.join(v.name for v in variants)}", USAGE)
    return hits[0]


def cluster_settings(tree: dict, cpu: bool) -> tuple[dict, list[str]]:
    """The cluster keys in force (dask-cuda's defaults filled in) and, in CPU mode, the GPU-only ones ignored."""
    import dask.config

    given = dask.config.get(CLUSTER, None, config=tree) or {}
    out, ignored = dict(CLUSTER_DEFAULTS), []
    for k, v in given.items():
        if cpu and k in GPU_ONLY:
            if v != CLUSTER_DEFAULTS[k]:
                ignored.append(f"{CLUSTER}.{k}")
            continue
        out[k] = v
    return out, ignored


def child_env(base: dict, config_dir: Path, root_dir: Path, env: tuple, unset: tuple) -> dict:
    """A process's environment: its own dask config only (no /etc/dask, no DASK_* of the caller), the variant's
    variables set and removed."""
    out = {k: v for k, v in base.items() if not k.startswith("DASK_") and k not in unset}
    out.update(PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1", DASK_CONFIG=str(config_dir),
               DASK_ROOT_CONFIG=str(root_dir), **dict(env))
    return out


def variant_env(config_dir: Path, tree: dict, env: tuple = (), unset: tuple = ()) -> dict:
    """The environment of a process that runs with `tree` (written into config_dir) as its whole dask config, an
    empty directory beside it standing for /etc/dask, and these variables set and removed."""
    root = config_dir.parent / "no-root-config"
    root.mkdir(parents=True, exist_ok=True)
    return child_env(dict(os.environ), write_config(config_dir, tree), root, env, unset)
