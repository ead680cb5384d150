"""`python -m ucx_dask_gpu.bench.transfer`: what ONE worker-to-worker transfer costs, per block size, per protocol and
per configuration, in one invocation; and, with --trace, where its time goes.

Each variant (protocol x configuration) runs in its own process (bench.transfer_run) with its own dask config
($DASK_CONFIG) and environment, as `ucx-dask-gpu bench` does: UCX and UCXX read their settings once per process.
A variant is `[PROTOCOLS@]LABEL:CONFIG[:KNOB]`: CONFIG is `none` (dask's and dask-cuda's defaults), `tuned` (the
shipped tuned-gpu.yaml) or a YAML path, KNOB the settings added on top (`KEY=VALUE;KEY=VALUE`, as bench's --knob).
--repeat runs the variant list several times in alternating order and pools the samples: on a shared machine a
slow minute then hits every variant alike.

Writes <out>/transfer.json (summary per variant), transfer.md, transfer-raw.json.gz (every sample, every traced
event) and command.txt; prints one line per variant (transfer / e2e median ms per size).
Exit codes: 0 every variant measured, 72 a variant failed (the report is still written), 2 bad arguments.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BENCH_FAILED, USAGE, UserError
from . import settings as st
from . import transfer_stats as ts
from .child import Child, Progress
from .driver import child_env, write_dask_config

DEFAULT_CPU_SIZES = "8,64KiB,1MiB,8MiB,32MiB"
DEFAULT_GPU_SIZES = "8,1MiB,128MiB"
MAX_PROTO_ROWS = 80
UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}


def parse_size(text: str) -> int:
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):] or "b"
    if not num or unit not in UNITS:
        raise UserError(f"--sizes: {text!r} is not a size like 8, 64KiB, 1MiB", USAGE)
    try:
        value = float(num) * UNITS[unit]
    except ValueError:
        raise UserError(f"--sizes: {text!r} is not a size like 8, 64KiB, 1MiB", USAGE) from None
    if value < 1 or value != int(value):
        raise UserError(f"--sizes: {text!r} must be a whole number of bytes >= 1", USAGE)
    return int(value)


@dataclass
class VariantSpec:
    label: str
    config: str
    knob: str | None
    protocols: list[str]


@dataclass
class Run:
    protocol: str
    spec: VariantSpec
    tree: dict
    cluster: dict
    env: dict
    unset: list
    results: list = field(default_factory=list)
    processes: list = field(default_factory=list)


def parse_variant(text: str, default_protocols: list[str]) -> VariantSpec:
    """`[PROTOCOLS@]LABEL:CONFIG[:KNOB]`, e.g. `baseline:none`, `ucx@event:tuned:UCXPY_PROGRESS_MODE=blocking`."""
    protocols = default_protocols
    rest = text
    if "@" in text.split(":", 1)[0]:
        head, rest = text.split("@", 1)
        protocols = [p.strip() for p in head.split(",") if p.strip()]
    parts = rest.split(":", 2)
    if len(parts) < 2 or not parts[0].strip() or not parts[1].strip():
        raise UserError(f"--variant {text!r}: expected [PROTOCOLS@]LABEL:CONFIG[:KNOB]", USAGE)
    for p in protocols:
        if p not in ("ucx", "tcp"):
            raise UserError(f"--variant {text!r}: protocol {p!r} is not ucx or tcp", USAGE)
    knob = parts[2].strip() if len(parts) == 3 and parts[2].strip() else None
    return VariantSpec(parts[0].strip(), parts[1].strip(), knob, protocols)


def make_runs(specs: list[VariantSpec], cpu: bool) -> list[Run]:
    runs = []
    labels = set()
    for spec in specs:
        if spec.label in labels:
            raise UserError(f"--variant: label {spec.label!r} given twice", USAGE)
        labels.add(spec.label)
        tree = st.load_config(spec.config).tree
        if cpu:
            tree = st.deep_merge(tree, st.CPU_UCX_SETTINGS)
        if spec.knob:
            tree = st.apply_settings(tree, st.parse_knob(spec.knob).settings)
        cluster, _ = st.cluster_settings(tree, cpu)
        env, unset = st.environment(tree)
        for p in spec.protocols:
            runs.append(Run(p, spec, tree, cluster, env, unset))
    return runs


def run_one(run: Run, args, tmp: Path, index: int, seconds: float, trace_rounds: int, progress: Progress) -> dict:
    d = tmp / f"{index:02d}-{run.protocol}-{run.spec.label}"
    cfg = d / "dask-config"
    write_dask_config(cfg, run.tree)
    spec = {"label": run.spec.label, "protocol": run.protocol, "mode": "cpu" if args.cpu else "gpu",
            "sizes": args.sizes, "rounds": args.rounds, "warmup": args.warmup, "trace_rounds": trace_rounds,
            "seconds": seconds, "trace_seconds": args.trace_seconds, "cluster": run.cluster, "gpu": args.gpu,
            "seed": index + 1, "local_directory": str(d / "scratch")}
    if args.transpose and run.protocol in args.transpose_protocols.split(",") and first_repeat(run):
        spec["transpose"] = {"size": args.transpose, "chunks": args.transpose_chunks, "runs": args.transpose_runs,
                             "warmup": 1}
    (d / "spec.json").write_text(json.dumps(spec))
    out = d / "result.json"
    env = child_env(dict(os.environ), cfg, run.env, run.unset)
    if not args.cpu and run.protocol == "ucx":
        env.setdefault("UCX_PROTO_INFO", "y")  # UCX's protocol choice (cuda_ipc or not) lands in the report
    label = f"{run.protocol} {run.spec.label}"
    timeout = seconds + (args.trace_seconds if trace_rounds else 0) + args.overhead
    child = Child([sys.executable, "-m", "ucx_dask_gpu.bench.transfer_run", str(d / "spec.json"), str(out)], env,
                  label, progress)
    rc, timed_out = child.wait(timeout)
    process = child.summary(rc, timed_out)
    if out.exists():
        res = json.loads(out.read_text())
        if "shutdown" not in res:  # measured, then died tearing the cluster down: keep the numbers, say so
            res["shutdown"] = {"error": f"timed out after {timeout:.0f} s" if timed_out else f"exited with {rc}"}
            progress(f"[{label}] {res['shutdown']['error']} while shutting down (its measurements are kept)")
    else:
        res = {"status": "error", "error": f"timed out after {timeout:.0f} s" if timed_out
               else f"exited with {rc} before writing a result"}
    res.setdefault("protocol", run.protocol)
    res.setdefault("label", run.spec.label)
    res["proto_info"] = child.proto_info[:MAX_PROTO_ROWS]
    if res.get("status") != "ok":
        res["log_tail"] = list(child.stderr_tail)[-40:]
    progress(f"[{label}] {res.get('status')}" + (f": {res.get('error')}" if res.get("status") != "ok" else ""))
    run.processes.append(process)
    return res


def first_repeat(run: Run) -> bool:
    """The transpose sanity check runs in a variant's first repeat only."""
    return not run.results


def merge_results(results: list[dict]) -> dict:
    """Pool the samples of one variant's repeats (each repeat its own cluster)."""
    ok = [r for r in results if r.get("status") == "ok"]
    if not ok:
        return results[-1] if results else {"status": "error", "error": "not run"}
    merged = dict(ok[0])
    merged["samples"] = [s for r in ok for s in r.get("samples", [])]
    merged["traced"] = [s for r in ok for s in r.get("traced", [])]
    merged["rounds"] = sum(r.get("rounds", 0) for r in ok)
    merged["traced_rounds"] = sum(r.get("traced_rounds", 0) or 0 for r in ok)
    merged["proto_info"] = next((r["proto_info"] for r in ok if r.get("proto_info")), [])
    merged["transpose"] = next((r["transpose"] for r in ok if r.get("transpose")), None)
    merged["repeats_ok"] = len(ok)
    merged["repeats_failed"] = [r.get("error") for r in results if r.get("status") != "ok"]
    return merged


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ucx_dask_gpu.bench.transfer", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", default=True,
                      help="numpy blocks on a LocalCluster, ucx = UCX over TCP (default)")
    mode.add_argument("--gpu", type=int, metavar="INDEX", default=None,
                      help="CuPy blocks, two dask-cuda workers sharing GPU INDEX (cuda_ipc between them)")
    p.add_argument("--protocols", default="ucx,tcp", help="default protocols of a variant (default ucx,tcp)")
    p.add_argument("--variant", action="append", default=[], metavar="[PROTOCOLS@]LABEL:CONFIG[:KNOB]",
                   help="a configuration to measure (repeatable); default: baseline:none and tuned:tuned")
    p.add_argument("--sizes", help=f"block sizes (default {DEFAULT_CPU_SIZES}; GPU {DEFAULT_GPU_SIZES})")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (one transfer of every size each; default 30)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--trace", default="", metavar="LABEL[,LABEL]|all",
                   help="variants that also get traced rounds (phase breakdown)")
    p.add_argument("--trace-rounds", type=int, default=10, help="traced rounds per traced variant (default 10)")
    p.add_argument("--trace-seconds", type=float, default=40.0, help="at most this long tracing per variant")
    p.add_argument("--transpose", type=int, default=0, metavar="N",
                   help="also run (x + x.T).sum() on an N x N float64 array on each variant's cluster (0: no)")
    p.add_argument("--transpose-chunks", default="4096", help="its chunks (default 4096, i.e. 128 MiB blocks)")
    p.add_argument("--transpose-runs", type=int, default=3, help="its timed repetitions (default 3)")
    p.add_argument("--transpose-protocols", default="ucx", help="protocols it runs over (default ucx)")
    p.add_argument("--repeat", type=int, default=1, help="run the variant list this many times, alternating order")
    p.add_argument("--seconds", type=float, default=60.0, help="at most this long measuring per variant and repeat")
    p.add_argument("--overhead", type=float, default=60.0,
                   help="seconds a variant may take beyond its measuring time (cluster start and stop)")
    p.add_argument("--budget", type=float, default=0.0, help="stop starting variants after this many seconds (0: none)")
    p.add_argument("--out", help="directory for transfer.json, transfer.md, transfer-raw.json.gz, command.txt")
    p.add_argument("--name", default="transfer", help="report file stem (default transfer)")
    p.add_argument("--title", default="", help="report title")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        return execute(args, shlex.join(["python", "-m", "ucx_dask_gpu.bench.transfer", *argv]))
    except UserError as e:
        print(f"bench transfer: {e}", file=sys.stderr)
        return e.exit_code


def execute(args, command: str) -> int:
    args.cpu = args.gpu is None
    args.sizes = [parse_size(s) for s in (args.sizes or (DEFAULT_CPU_SIZES if args.cpu else DEFAULT_GPU_SIZES))
                  .split(",")]
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    specs = [parse_variant(v, protocols) for v in (args.variant or ["baseline:none", "tuned:tuned"])]
    runs = make_runs(specs, args.cpu)
    traced = {r.spec.label for r in runs} if args.trace == "all" else {t for t in args.trace.split(",") if t}
    unknown = traced - {r.spec.label for r in runs}
    if unknown:
        raise UserError(f"--trace: no variant labelled {', '.join(sorted(unknown))}", USAGE)
    progress = Progress(quiet=args.quiet)
    start = time.monotonic()
    skipped = []
    with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-transfer-") as tmp:
        index = 0
        for rep in range(args.repeat):
            order = runs if rep % 2 == 0 else list(reversed(runs))
            for run in order:
                if args.budget and time.monotonic() - start > args.budget:
                    skipped.append(f"{run.protocol} {run.spec.label} (repeat {rep + 1})")
                    continue
                index += 1
                trace_rounds = args.trace_rounds if run.spec.label in traced and rep == 0 else 0
                progress(f"[{run.protocol} {run.spec.label}] repeat {rep + 1}/{args.repeat}")
                run.results.append(run_one(run, args, Path(tmp), index, args.seconds, trace_rounds, progress))
    merged = [(run, merge_results(run.results)) for run in runs]
    report = {
        "title": args.title or ("CPU (numpy), UCX over TCP vs TCP" if args.cpu else f"GPU {args.gpu}, two workers"),
        "command": command, "host": socket.gethostname(), "mode": "cpu" if args.cpu else f"gpu {args.gpu}",
        "sizes": args.sizes, "rounds": args.rounds, "repeat": args.repeat, "skipped": skipped,
        "seconds": round(time.monotonic() - start, 1),
        "variants": [dict(ts.variant_summary(res), config=run.spec.config, knob=run.spec.knob,
                          repeats_ok=res.get("repeats_ok"), repeats_failed=res.get("repeats_failed"),
                          processes=run.processes) for run, res in merged],
    }
    for line in ts.summary_lines(report):
        print(line, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.name}.json").write_text(json.dumps(report, indent=1, default=str))
        (out / f"{args.name}.md").write_text(ts.markdown(report))
        with gzip.open(out / f"{args.name}-raw.json.gz", "wt") as f:
            json.dump({"report": report["title"], "command": command,
                       "results": [{"protocol": run.protocol, "label": run.spec.label, "results": run.results}
                                   for run in runs]}, f, default=str)
        (out / "command.txt").write_text(command + "\n")
        print(f"report: {out / (args.name + '.md')}", flush=True)
    failed = [f"{v['protocol']} {v['label']}" for v in report["variants"] if v["status"] != "ok"]
    if failed:
        print(f"bench transfer: failed: {', '.join(failed)}", file=sys.stderr)
        return BENCH_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
