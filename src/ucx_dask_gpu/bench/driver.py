"""`ucx-dask-gpu bench transpose|svd`: plan the variants, run each in its own process within a time budget, run
dask-cuda's local_cupy beside them, and write one report.

Order (most important first, so a short budget still yields the headline): for each protocol the base config and
then its reference; then the sweep (`--knob`, one variant each, on the first protocol). A variant that fails or
times out is recorded and the next one runs; variants that no longer fit the budget are recorded as skipped.

dask and yaml are imported where a run needs them: `ucx-dask-gpu bench --help` and bad arguments need neither.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import nvml
from ..errors import BENCH_DEPENDENCY, BENCH_FAILED, ONE_GPU, REFERENCE_FAILED, USAGE, UserError
from . import reference as ref
from . import settings as st
from . import stats
from .child import Child, Progress
from .workloads.base import Chunks, Workload

PROTOCOLS = ("ucx", "tcp")
METRICS = ("wall_s", "wall_s_min", "p2p_gbps_median", "ucx_tcp_wall_ratio", "speedup_vs_reference")
GOAL_RE = re.compile(r"^\s*([a-z0-9_]+)\s*(<=|>=|<|>)\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*$")
MIN_SECONDS_TO_START = 20.0


@dataclass(frozen=True)
class Goal:
    metric: str
    op: str
    value: float

    @property
    def text(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"

    def met(self, actual: float | None) -> bool | None:
        if actual is None:
            return None
        return {"<=": actual <= self.value, ">=": actual >= self.value, "<": actual < self.value,
                ">": actual > self.value}[self.op]


def parse_goal(text: str) -> Goal:
    m = GOAL_RE.match(text)
    if not m or m.group(1) not in METRICS:
        raise UserError(f"--goal {text!r}: expected METRIC<=VALUE or METRIC>=VALUE with METRIC one of "
                        f"{', '.join(METRICS)}", USAGE)
    return Goal(m.group(1), m.group(2), float(m.group(3)))


@dataclass
class Options:
    workload: Workload
    size: int
    second_size: int | None
    chunks: Chunks
    protocols: list[str]
    cpu: bool
    workers: int
    gpus: list[int] | None
    config: st.ConfigFile
    knobs: list[st.Knob]
    runs: int
    knob_runs: int
    warmup: int
    reference: bool
    ignore_bytes: int
    seed: int
    out: Path | None
    name: str
    goals: list[Goal]
    budget: float
    run_timeout: float
    proto_info: bool
    plan_only: bool = False
    quiet: bool = False
    python: str = sys.executable


@dataclass
class Variant:
    kind: str                       # "base" | "knob"
    protocol: str
    label: str
    tree: dict
    cluster: dict
    env: dict[str, str]
    unset: list[str]
    ignored: list[str]
    runs: int
    probe_keys: list[str]
    knob: st.Knob | None = None
    result: dict | None = None
    process: dict | None = None
    proto_info: list[str] = field(default_factory=list)
    log_tail: list[str] = field(default_factory=list)


@dataclass
class ReferenceItem:
    protocol: str
    result: dict | None = None


# --- planning -------------------------------------------------------------------------------------------------------

def probe_keys(tree: dict, knob: st.Knob | None) -> list[str]:
    keys: list[str] = []
    for key, value in st.leaves(tree):
        if key in (st.PRE_SPAWN, "distributed.nanny.environ") and isinstance(value, dict):
            keys += [str(k) for k in value]
        elif key == "distributed-ucxx.environment" and isinstance(value, dict):
            keys += [f"{key}.{k}" for k in value]
        elif key.startswith(f"{st.NAMESPACE}.unset-environ"):
            continue
        elif isinstance(value, dict):
            continue
        else:
            keys.append(key)
    if knob:
        keys += [s.key for s in knob.settings]
    return sorted(set(keys))


def make_variant(opts: Options, kind: str, protocol: str, tree: dict, knob: st.Knob | None) -> Variant:
    cluster, ignored = st.cluster_settings(tree, opts.cpu)
    env, unset = st.environment(tree)
    label = opts.config.name + (f" + {knob.text}" if knob else "")
    keys = probe_keys(tree, knob)
    if opts.cpu:  # nothing to ask a CPU worker about GPU memory
        keys = [k for k in keys if k not in [f"{st.CLUSTER_PREFIX}.{g}" for g in st.GPU_ONLY_CLUSTER_KEYS]]
    return Variant(kind=kind, protocol=protocol, label=label, tree=tree, cluster=cluster, env=env, unset=unset,
                   ignored=ignored, runs=opts.knob_runs if kind == "knob" else opts.runs, probe_keys=keys,
                   knob=knob)


def base_tree(opts: Options) -> dict:
    tree = opts.config.tree
    if opts.cpu:
        tree = st.deep_merge(tree, st.CPU_UCX_SETTINGS)
    return tree


def plan(opts: Options) -> list[Variant | ReferenceItem]:
    items: list[Variant | ReferenceItem] = []
    tree = base_tree(opts)
    for p in opts.protocols:
        items.append(make_variant(opts, "base", p, tree, None))
        if opts.reference:
            items.append(ReferenceItem(p))
    for knob in opts.knobs:
        items.append(make_variant(opts, "knob", opts.protocols[0], st.apply_settings(tree, knob.settings), knob))
    return items


def resolve_chunks(opts: Options, tree: dict) -> tuple[list[int], list[int]]:
    """(chunksize, numblocks) that dask will give the input under this config (array.chunk-size matters for auto)."""
    import dask
    from dask.array.core import normalize_chunks

    shape = opts.workload.shape(opts.size, opts.second_size)
    chunks = opts.workload.dask_chunks(opts.chunks, opts.second_size)
    cfg = {}
    limit = st.get_path(tree, "array.chunk-size")
    if limit is not None:
        cfg["array.chunk-size"] = limit
    with dask.config.set(cfg):
        norm = normalize_chunks(chunks, shape, dtype="float64")
    return [c[0] for c in norm], [len(c) for c in norm]


# --- running --------------------------------------------------------------------------------------------------------

def write_dask_config(directory: Path, tree: dict) -> None:
    import yaml

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ucx-dask-gpu-bench.yaml").write_text(
        "# Written by ucx-dask-gpu bench for one variant.\n" + yaml.safe_dump(tree, sort_keys=True))


def child_env(base: dict[str, str], config_dir: Path | None, env: dict[str, str], unset: list[str]) -> dict:
    out = dict(base)
    out["PYTHONUNBUFFERED"] = "1"
    # a crash inside UCX or a C extension leaves the Python stack of every thread in the log tail
    out["PYTHONFAULTHANDLER"] = "1"
    if config_dir is not None:
        out["DASK_CONFIG"] = str(config_dir)
    for k in unset:
        out.pop(k, None)
    out.update(env)
    return out


def runner_spec(opts: Options, v: Variant | None, cluster: dict, tmp: Path, runs: int) -> dict:
    return {
        "workload": opts.workload.name, "mode": "cpu" if opts.cpu else "gpu", "protocol": v.protocol if v else None,
        "label": v.label if v else "reference-cluster", "size": opts.size, "second_size": opts.second_size,
        "chunks": opts.chunks.text, "gpus": opts.gpus or [], "workers": opts.workers, "runs": runs,
        "warmup": opts.warmup, "seed": opts.seed, "cluster": cluster, "probe_keys": v.probe_keys if v else [],
        "local_directory": str(tmp / "dask-scratch"), "profile": True,
    }


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_variant(opts: Options, v: Variant, tmp: Path, budget: Budget, progress: Progress, index: int) -> None:
    d = tmp / f"variant-{index}"
    cfg = d / "dask-config"
    write_dask_config(cfg, v.tree)
    spec = runner_spec(opts, v, v.cluster, tmp, v.runs)
    spec_path, out_path = d / "spec.json", d / "result.json"
    spec_path.write_text(json.dumps(spec))
    env = child_env(dict(os.environ), cfg, v.env, v.unset)
    if opts.proto_info and v.protocol == "ucx" and not opts.cpu and "UCX_PROTO_INFO" not in v.env:
        env.setdefault("UCX_PROTO_INFO", "y")
    timeout = min(opts.run_timeout, budget.left())
    label = f"{v.protocol} {v.label}"
    progress(f"[{label}] start (limit {timeout:.0f} s)")
    child = Child([opts.python, "-m", "ucx_dask_gpu.bench.runner", str(spec_path), str(out_path)], env, label,
                  progress)
    rc, timed_out = child.wait(timeout)
    v.process = child.summary(rc, timed_out)
    v.proto_info = child.proto_info
    if out_path.exists():
        v.result = json.loads(out_path.read_text())
    else:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exited with {rc} before writing a result"
        v.result = {"status": "error", "error": why}
    if v.result.get("status") != "ok" or v.process["tracebacks"]:
        v.log_tail = list(child.stderr_tail)[-(300 if rc is not None and rc < 0 else 60):]
    status = v.result.get("status")
    progress(f"[{label}] {status}" + (f": {v.result.get('error')}" if status != "ok" else "")
             + f" ({child.elapsed:.0f} s)")


def run_reference(opts: Options, item: ReferenceItem, chunk_edge: int, tmp: Path, budget: Budget,
                  progress: Progress, index: int) -> None:
    label = f"{item.protocol} reference"
    timeout = min(opts.run_timeout, budget.left())
    base_env = dict(os.environ)
    serve = None
    cfg = None
    address = None
    try:
        if opts.cpu:
            # local_cupy cannot start a cluster without GPUs: give it a LocalCluster with dask's defaults.
            d = tmp / f"reference-{index}"
            cfg = d / "dask-config"
            write_dask_config(cfg, st.CPU_UCX_SETTINGS if item.protocol == "ucx" else {})
            cluster, _ = st.cluster_settings({}, True)
            spec = runner_spec(opts, None, cluster, tmp, 0)
            spec["protocol"] = item.protocol
            (d / "spec.json").write_text(json.dumps(spec))
            serve = Child([opts.python, "-m", "ucx_dask_gpu.bench.runner", "--serve", str(d / "spec.json")],
                          child_env(base_env, cfg, {}, []), f"{label} cluster", progress, stdin=True)
            if not serve.address_seen.wait(timeout=min(120.0, max(5.0, budget.left()))):
                raise RuntimeError("the LocalCluster for local_cupy did not start")
            address = serve.address
        cmd = ref.command(opts.python, opts.workload.name, item.protocol, opts.size, chunk_edge, opts.runs, opts.warmup,
                          gpus=opts.gpus, second_size=opts.second_size, scheduler_address=address)
        progress(f"[{label}] {' '.join(cmd[1:])}")
        child = Child(cmd, child_env(base_env, cfg, {}, []), label, progress)
        rc, timed_out, teardown = wait_reference(child, timeout, REFERENCE_TEARDOWN_GRACE, progress, label)
        text = "\n".join(child.stdout)
        result: dict[str, Any] = {"tool": ref.TOOL, "protocol": item.protocol,
                                  "command": " ".join(["python"] + cmd[1:]), "process": child.summary(rc, timed_out),
                                  "teardown": teardown,
                                  # verbatim, so a recorded GPU run can become a parser fixture
                                  "stdout": text[-20000:]}
        try:
            parsed = ref.parse_local_cupy(text)
            result.update(parsed)
            # Its numbers are complete once it printed them; how it then shut down is recorded, not a failure.
            result["status"] = "ok"
        except ref.ReferenceOutputError as e:
            result["status"] = "error"
            tail = [ln for ln in child.stderr_tail if ln.strip()][-1:] or ["(no output)"]
            result["error"] = (f"timed out after {timeout:.0f} s" if timed_out else
                               f"exited with {rc}: {e}; last stderr line: {tail[0][:200]}")
            result["log_tail"] = list(child.stderr_tail)[-40:]
        result["teardown_exceptions"] = ref.exceptions_in(list(child.stderr_tail))
        item.result = result
        progress(f"[{label}] {result['status']}" + (f": {result.get('error')}" if result["status"] != "ok" else
                                                     f": wall {_ms(stats.median(result['wall_s']))} ms"))
    except Exception as e:  # the reference failing must not lose our own results
        item.result = {"tool": ref.TOOL, "protocol": item.protocol, "status": "error", "error": str(e)}
        progress(f"[{label}] error: {e}")
    finally:
        if serve is not None:
            serve.close_stdin()
            serve.wait(60)


REFERENCE_TEARDOWN_GRACE = 30.0


def printed_everything(lines: list[str]) -> bool:
    """local_cupy's output ends with the worker table closed by a '=' rule (then it only shuts down)."""
    try:
        i = max(n for n, ln in enumerate(lines) if ln.startswith("Worker index"))
    except ValueError:
        return False
    return any(ln.startswith("=" * 20) for ln in lines[i + 2:])


def wait_reference(child: Child, timeout: float, grace: float, progress: Progress, label: str):
    """Wait for local_cupy; once it has printed all its results, give its teardown `grace` seconds, then stop it
    (its UCX teardown can sit in an endpoint timeout). Returns (rc, timed_out, teardown description)."""
    deadline = time.monotonic() + timeout
    printed_at = None
    while True:
        try:
            rc = child.proc.wait(timeout=0.5)
            rc, _ = child.wait(1)
            took = f" {time.monotonic() - printed_at:.1f} s after printing" if printed_at else ""
            return rc, False, f"exited with {rc}{took}"
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if printed_at is None and printed_everything(child.stdout):
            printed_at = now
        if printed_at is not None and now - printed_at > grace:
            progress(f"[{label}] results printed {grace:.0f} s ago and still shutting down: stopping it")
            child.kill()
            rc, _ = child.wait(1)
            return rc, False, f"stopped after {grace:.0f} s of teardown (results were complete)"
        if now > deadline:
            child.kill()
            rc, _ = child.wait(1)
            return rc, True, f"timed out after {timeout:.0f} s"


def _ms(v):
    return None if v is None else round(v * 1e3, 2)


# --- results --------------------------------------------------------------------------------------------------------

def run_entry(opts: Options, v: Variant) -> dict:
    r = v.result or {"status": "skipped", "error": "not run: time budget used up"}
    runs = r.get("runs") or []
    workers = r.get("workers") or []
    walls = [round(x["wall_s"], 6) for x in runs]
    p2p = stats.p2p(runs, workers, opts.ignore_bytes) if runs else None
    profiled = r.get("profiled") or {}
    transfers = stats.transfer_table(runs, workers)
    entry = {
        "protocol": v.protocol,
        "config": v.label,
        "kind": v.kind,
        "knob": v.knob.text if v.knob else None,
        "settings": st.knob_rows(v.knob.settings) if v.knob else {},
        "status": r.get("status", "error"),
        "error": r.get("error"),
        "wall_s": walls,
        "wall_s_median": stats.median(walls),
        "wall_s_min": min(walls) if walls else None,
        "p2p_gbps_median": p2p["gbps_median"] if p2p else None,
        "p2p": p2p,
        "submit_s": [round(x["submit_s"], 6) for x in runs],
        "input_s": [round(x["input_s"], 6) for x in runs],
        "input_seeds": [x.get("input_seed") for x in runs],
        "split_pairs": [x.get("split_pairs") for x in runs],
        "warmup_wall_s": [round(x, 6) for x in r.get("warmup_wall_s", [])],
        "chunk": (r.get("array") or {}).get("chunksize"),
        "array": r.get("array"),
        "workers": workers,
        "worker_devices": r.get("worker_devices"),
        "check": r.get("check"),
        "timings": r.get("timings"),
        "cluster": v.cluster,
        "ignored_in_cpu_mode": v.ignored,
        "applied": r.get("applied"),
        "applied_client": r.get("applied_client"),
        "shutdown": dict(r.get("shutdown") or {}, **(
            {"tracebacks": v.process["shutdown_tracebacks"], "clean": _clean(r, v.process)} if v.process else {})),
        "process": v.process,
        "breakdown": {
            "phases": stats.task_phases(profiled, workers),
            "digests": stats.digest_summary(r.get("digests") or {}, len(runs)),
            "size_classes": stats.size_classes(transfers),
        },
        "transfers": transfers,
        "task_stream": stats.compact_tasks(profiled, workers),
        "ucx_proto_info": v.proto_info if v.kind == "base" else v.proto_info[:40],
        "versions": r.get("versions"),
        "versions_identical": r.get("versions_identical"),
        "version_differences": r.get("version_differences"),
    }
    if v.log_tail:
        entry["log_tail"] = v.log_tail
    if r.get("traceback"):
        entry["traceback"] = r["traceback"]
    return entry


def _clean(r: dict, process: dict) -> bool:
    steps = (r.get("shutdown") or {}).get("steps") or []
    ok_steps = all(not s.endswith(("failed",)) and "failed:" not in s and "still registered" not in s
                   for s in steps)
    return bool(process and process["shutdown_tracebacks"] == 0 and not process["timed_out"] and ok_steps
                and steps)


def summarize(opts: Options, runs: list[dict], refs: list[dict]) -> dict:
    base = {e["protocol"]: e for e in runs if e["kind"] == "base" and e["status"] == "ok"}
    refs_ok = {r["protocol"]: r for r in refs if r.get("status") == "ok"}
    head = base.get(opts.protocols[0])
    out: dict[str, Any] = {"headline": f"{opts.protocols[0]} {opts.config.name}"}
    for p, e in base.items():
        out[f"{p}_wall_s_median"] = e["wall_s_median"]
    for p, r in refs_ok.items():
        out[f"reference_{p}_wall_s_median"] = stats.median(r["wall_s"])
    if "ucx" in base and "tcp" in base and base["ucx"]["wall_s_median"]:
        out["ucx_tcp_wall_ratio"] = round(base["tcp"]["wall_s_median"] / base["ucx"]["wall_s_median"], 2)
    if "ucx" in refs_ok and "tcp" in refs_ok:
        out["reference_ucx_tcp_wall_ratio"] = round(stats.median(refs_ok["tcp"]["wall_s"])
                                                    / stats.median(refs_ok["ucx"]["wall_s"]), 2)
    metrics = {
        "wall_s": head["wall_s_median"] if head else None,
        "wall_s_min": head["wall_s_min"] if head else None,
        "p2p_gbps_median": head["p2p_gbps_median"] if head else None,
        "ucx_tcp_wall_ratio": out.get("ucx_tcp_wall_ratio"),
        "speedup_vs_reference": None,
    }
    p0 = opts.protocols[0]
    if head and p0 in refs_ok and head["wall_s_median"]:
        metrics["speedup_vs_reference"] = round(stats.median(refs_ok[p0]["wall_s"]) / head["wall_s_median"], 2)
        out["reference_p2p_gbps_median"] = refs_ok[p0].get("p2p_gbps_median")
    out["metrics"] = metrics
    out["goals"] = [{"goal": g.text, "value": metrics.get(g.metric), "met": g.met(metrics.get(g.metric))}
                    for g in opts.goals]
    return out


def sweep_rows(runs: list[dict]) -> list[dict]:
    base = {e["protocol"]: e for e in runs if e["kind"] == "base"}
    rows = []
    for e in runs:
        if e["kind"] != "knob":
            continue
        b = base.get(e["protocol"])
        bw = b["wall_s_median"] if b and b["status"] == "ok" else None
        w = e["wall_s_median"]
        rows.append({"knob": e["knob"], "protocol": e["protocol"], "status": e["status"], "wall_s_median": w,
                     "wall_vs_base": round(w / bw, 3) if w and bw else None,
                     "p2p_gbps_median": e["p2p_gbps_median"],
                     "transfers_per_run": (e["p2p"] or {}).get("transfers_per_run"),
                     "error": e["error"]})
    return rows


def gpu_info(opts: Options) -> list[dict]:
    if opts.cpu:
        return []
    gpus = {g.index: g for g in nvml.discover()}
    out = []
    for i in opts.gpus or []:
        g = gpus.get(i)
        if g is None:
            continue
        peers = {other.index: nvml.nvlink_count(g, other) for other in gpus.values() if other.index != g.index}
        out.append({"index": g.index, "name": g.name, "pci_bus_id": g.pci_bus_id, "uuid": g.uuid,
                    "nvlinks_to": {str(k): v for k, v in peers.items()},
                    "nvlink_gbps_per_link": g.link_speed_gbps})
    return out


def execute(opts: Options, command: str) -> dict:
    """Run everything in the plan; returns the report payload."""
    progress = Progress(quiet=opts.quiet)
    items = plan(opts)
    budget = Budget(opts.budget)
    tree = base_tree(opts)
    chunksize, numblocks = resolve_chunks(opts, tree)
    started = datetime.now(timezone.utc)
    progress(f"bench {opts.workload.name}: {len([i for i in items if isinstance(i, Variant)])} variant(s)"
             f"{' + reference' if opts.reference else ''}, budget {opts.budget:.0f} s")
    with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-bench-") as tmpname:
        tmp = Path(tmpname)
        for i, item in enumerate(items):
            if budget.left() < MIN_SECONDS_TO_START:
                progress(f"time budget used up: skipping {_item_label(item)}")
                continue
            if isinstance(item, Variant):
                run_variant(opts, item, tmp, budget, progress, i)
            else:
                ok = [v for v in items if isinstance(v, Variant) and v.protocol == item.protocol
                      and v.kind == "base" and v.result and v.result.get("status") == "ok"]
                edge = ok[0].result["array"]["chunksize"][0] if ok else chunksize[0]
                run_reference(opts, item, edge, tmp, budget, progress, i)
    variants = [i for i in items if isinstance(i, Variant)]
    run_entries = [run_entry(opts, v) for v in variants]
    refs = [dict(i.result or {"tool": ref.TOOL, "protocol": i.protocol, "status": "skipped",
                              "error": "not run: time budget used up"})
            for i in items if isinstance(i, ReferenceItem)]
    for r in refs:
        r.setdefault("wall_s", [])
        r.setdefault("p2p_gbps_median", None)
    head_ref = next((r for r in refs if r["protocol"] == opts.protocols[0]), None)
    shape = list(opts.workload.shape(opts.size, opts.second_size))
    payload = {
        "workload": opts.workload.name,
        "expression": opts.workload.expression,
        "size": opts.size,
        "second_size": opts.second_size,
        "shape": shape,
        "dtype": "float64",
        "chunk": chunksize,
        "chunks_requested": opts.chunks.text,
        "blocks": numblocks,
        "gpus": gpu_info(opts),
        "mode": "cpu" if opts.cpu else "gpu",
        "workers": opts.workers if opts.cpu else len(opts.gpus or []),
        "protocols": opts.protocols,
        "config": {"name": opts.config.name, "path": opts.config.path, "tree": opts.config.tree},
        "runs": run_entries,
        "reference": head_ref,
        "references": refs,
        "sweep": sweep_rows(run_entries),
        "summary": summarize(opts, run_entries, refs),
        "measurement": {
            "repetitions": opts.runs, "knob_repetitions": opts.knob_runs, "warmup": opts.warmup,
            "ignore_bytes": opts.ignore_bytes, "seed": opts.seed,
            "timed": "wait(client.persist(result)) + device synchronisation on every worker (GPU), per repetition",
            "p2p": "Worker.transfer_incoming_log of the timed repetitions; transfers < ignore_bytes dropped; "
                   "GB/s = 1e9 bytes/s; distributed floors a transfer's duration at 1 ms",
            "reference_p2p": "median of local_cupy's per-pair medians (it prints quartiles per pair only), "
                             "over its warm-up and timed runs",
        },
        "host": socket.gethostname(),
        "date": started.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": round(opts.budget - budget.left(), 1),
        "command": command,
    }
    return payload


def _item_label(item) -> str:
    return f"{item.protocol} {item.label}" if isinstance(item, Variant) else f"{item.protocol} reference"


def failures(payload: dict) -> tuple[int, str] | None:
    """(exit code, one line) when a base run or the reference failed; None when all that matters worked."""
    bad = [e for e in payload["runs"] if e["kind"] == "base" and e["status"] != "ok"]
    if bad:
        e = bad[0]
        return BENCH_FAILED, f"{e['protocol']} {e['config']}: {e['error'] or e['status']}"
    bad_refs = [r for r in payload["references"] if r.get("status") != "ok"]
    if bad_refs:
        r = bad_refs[0]
        return REFERENCE_FAILED, f"reference {r['tool']} ({r['protocol']}): {r.get('error') or r.get('status')}"
    return None


# --- checks before anything runs -------------------------------------------------------------------------------------

def check_environment(opts: Options) -> None:
    """Fail fast, with one line, when this host cannot run what was asked."""
    need = ["dask", "distributed"]
    if "ucx" in opts.protocols:
        need += ["distributed_ucxx", "ucxx"]
    if not opts.cpu:
        need += ["dask_cuda", "cupy", "rmm", "pynvml"]
    if opts.reference:
        need += ["dask_cuda", "nvtx"]
    missing = sorted({n for n in need if importlib.util.find_spec(n) is None})
    if missing:
        raise UserError(f"missing Python packages for this benchmark: {', '.join(missing)}", BENCH_DEPENDENCY)
    if opts.cpu:
        return
    gpus = nvml.discover()  # UserError NVML_UNAVAILABLE / NO_GPU when there is none
    indices = [g.index for g in gpus]
    if opts.gpus is None:
        opts.gpus = indices
    unknown = [g for g in opts.gpus if g not in indices]
    if unknown:
        raise UserError(f"--gpus {','.join(map(str, unknown))}: no such GPU (have {','.join(map(str, indices))})",
                        USAGE)
    if len(opts.gpus) < 2:
        raise UserError(f"the benchmark measures GPU-to-GPU transfers and needs 2 GPUs or more; "
                        f"{len(opts.gpus)} selected", ONE_GPU)
