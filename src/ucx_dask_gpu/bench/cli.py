"""`ucx-dask-gpu bench transpose|svd|render` (also `python -m ucx_dask_gpu.bench`): argument parsing and validation,
then the run (driver.py) and its report (render.py). Nothing heavy is imported before a run."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..cliutil import add_output
from ..errors import BENCH_CONFIG, USAGE, UserError
from ..report import command_line, write_report
from . import driver, render
from . import settings as st
from .workloads import WORKLOADS
from .workloads.base import Chunks, Workload, parse_chunks


def _arg_number(convert, what: str, ok, bound: str):
    """argparse type: `convert(text)` that must satisfy `ok`; one-line messages for both failures."""
    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {what} {bound}, got {text}")
        return v
    return parse


_positive_int = _arg_number(int, "an integer", lambda v: v >= 1, ">= 1")
_nonneg_int = _arg_number(int, "an integer", lambda v: v >= 0, ">= 0")
_seconds = _arg_number(float, "seconds", lambda v: v > 0, "> 0")


def add_arguments(p: argparse.ArgumentParser, w: Workload) -> None:
    d, c = w.gpu, w.cpu
    p.add_argument("--size", type=_positive_int,
                   help=f"rows (and columns for transpose); default {d.size} (GPU), {c.size} with --cpu")
    if w.second_size_help:
        p.add_argument("--second-size", type=_positive_int,
                       help=f"{w.second_size_help}; default {d.second_size} (GPU), {c.second_size} with --cpu")
    p.add_argument("--chunks",
                   help="auto (the config's array.chunk-size decides), a size like '128 MiB', or block edge(s) like "
                        f"4096 or 4096,4096; for svd the rows per block; default {d.chunks!r} (GPU), "
                        f"{c.chunks!r} with --cpu")
    p.add_argument("--protocols", default="ucx,tcp", help="comma-separated, each run side by side (default ucx,tcp); "
                   "the sweep uses the first")
    p.add_argument("--cpu", action="store_true",
                   help="numpy on a LocalCluster of --workers processes, ucx = UCX over TCP (no GPU needed)")
    p.add_argument("--workers", type=_positive_int, default=2, help="CPU mode: worker processes (default 2)")
    p.add_argument("--gpus", help="GPU indices, one worker each (default: all)")
    p.add_argument("--config", default="tuned",
                   help="dask config YAML: 'tuned' (the shipped tuned-gpu.yaml, default), 'none' (dask and dask-cuda "
                        "defaults) or a path")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE[;KEY=VALUE]",
                   help="a sweep variant: the config plus these settings (dask config key, ucx-dask-gpu.cluster.* "
                        "key, or ENV_VAR; empty value unsets a variable); repeat for more variants")
    p.add_argument("--runs", type=_positive_int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--knob-runs", type=_positive_int, help="timed repetitions of sweep variants (default: min(3, runs))")
    p.add_argument("--warmup", type=_nonneg_int, default=1, help="untimed repetitions first (default 1)")
    p.add_argument("--reference", action="store_true",
                   help="also run dask-cuda's local_cupy on the same sizes, per protocol, in this invocation")
    p.add_argument("--ignore-size", default="1 MiB", help="drop transfers smaller than this (default '1 MiB')")
    p.add_argument("--seed", type=_nonneg_int, default=0, help="random input seed (default 0)")
    add_output(p, "--out", kind="dir", help="write <name>.json/.md/.png and command.txt into this directory")
    p.add_argument("--name", help=f"report file stem (default {w.name}-<chunks> for transpose, svd for svd)")
    p.add_argument("--goal", action="append", default=[], metavar="METRIC<=VALUE",
                   help="a target to report as met / not met (never an error), e.g. wall_s<=0.1, "
                        "p2p_gbps_median>=60, ucx_tcp_wall_ratio>=35, speedup_vs_reference>=2")
    p.add_argument("--budget", type=_seconds, default=540.0,
                   help="seconds for the whole invocation; what no longer fits is skipped (default 540)")
    p.add_argument("--run-timeout", type=_seconds, default=300.0,
                   help="seconds one variant or reference may take before it is stopped (default 300)")
    p.add_argument("--no-proto-info", action="store_true",
                   help="GPU ucx runs: do not set UCX_PROTO_INFO=y (its protocol tables land in the JSON)")
    p.add_argument("--plan", action="store_true", help="print the variants (config, environment) and exit")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: the transpose workload and a tall-skinny SVD over UCX vs TCP",
                       description="Time a Dask workload on a dask-cuda cluster (one worker per GPU) over each "
                                   "protocol, with a tuned dask config, a knob sweep, and dask-cuda's own "
                                   "local_cupy beside it.")
    s = p.add_subparsers(dest="bench_workload", metavar="WORKLOAD", required=True)
    for w in WORKLOADS.values():
        sp = s.add_parser(w.name, help=w.help)
        add_arguments(sp, w)
        sp.set_defaults(func=_run, workload=w.name)
    r = s.add_parser("render", help="re-render a result's markdown and PNG from its JSON (e.g. where matplotlib is)")
    r.add_argument("json", help="a <name>.json written by bench transpose|svd")
    r.set_defaults(func=_render)


def options_from_args(args) -> driver.Options:
    """Validate everything a run needs before starting anything; UserError with one line otherwise."""
    from dask.utils import parse_bytes  # dask is heavy: imported once a run is asked for

    w = WORKLOADS[args.workload]
    d = w.defaults(args.cpu)
    size = args.size or d.size
    second = getattr(args, "second_size", None) or d.second_size
    w.validate(size, second)
    chunks = Chunks(args.chunks or d.chunks)
    parse_chunks(chunks.text)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    bad = [p for p in protocols if p not in driver.PROTOCOLS]
    if not protocols or bad or len(set(protocols)) != len(protocols):
        raise UserError(f"--protocols {args.protocols!r}: expected distinct names among "
                        f"{', '.join(driver.PROTOCOLS)}", USAGE)
    gpus = None
    if args.gpus is not None:
        if args.cpu:
            raise UserError("--gpus does not go with --cpu (use --workers)", USAGE)
        try:
            gpus = [int(g) for g in args.gpus.split(",")]
        except ValueError:
            raise UserError(f"--gpus {args.gpus!r}: expected GPU indices like 0,1", USAGE) from None
        if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
            raise UserError(f"--gpus {args.gpus!r}: expected distinct GPU indices", USAGE)
    try:
        ignore = parse_bytes(args.ignore_size)
    except (ValueError, TypeError):
        raise UserError(f"--ignore-size {args.ignore_size!r}: expected a size like '1 MiB'", USAGE) from None
    config = st.load_config(args.config)
    knobs = [st.parse_knob(k) for k in args.knob]
    if len({k.text for k in knobs}) != len(knobs):
        raise UserError("--knob: the same variant is given twice", USAGE)
    goals = [driver.parse_goal(g) for g in args.goal]
    name = args.name or w.report_name(chunks)
    if "/" in name or name.startswith(".") or not name:
        raise UserError(f"--name {name!r}: expected a file stem without '/'", USAGE)
    out = Path(args.out) if args.out else None
    return driver.Options(
        workload=w, size=size, second_size=second, chunks=chunks, protocols=protocols, cpu=args.cpu,
        workers=args.workers, gpus=gpus, config=config, knobs=knobs, runs=args.runs,
        knob_runs=args.knob_runs or min(3, args.runs), warmup=args.warmup, reference=args.reference,
        ignore_bytes=ignore, seed=args.seed, out=out, name=name, goals=goals, budget=args.budget,
        run_timeout=args.run_timeout, proto_info=not args.no_proto_info, plan_only=args.plan, quiet=args.quiet)


def plan_text(opts: driver.Options) -> str:
    import yaml  # third-party: only --plan prints the config trees

    w = opts.workload
    lines = []
    chunksize, numblocks = driver.resolve_chunks(opts, driver.plan(opts)[0].tree)
    lines.append(f"{w.name}: size {w.size_label(opts.size, opts.second_size)}, chunks {opts.chunks.text!r} -> "
                 f"{chunksize} ({numblocks} blocks), "
                 f"{'CPU, %d workers' % opts.workers if opts.cpu else 'GPUs ' + str(opts.gpus or 'all')}")
    for i, item in enumerate(driver.plan(opts)):
        if isinstance(item, driver.Variant):
            lines.append(f"[{i}] {item.protocol} {item.label}: {item.runs} runs, cluster {item.cluster}"
                         + (f", environment {item.env}" if item.env else "")
                         + (f", unset {item.unset}" if item.unset else "")
                         + (f", ignored in CPU mode: {item.ignored}" if item.ignored else ""))
            lines += ["    " + ln for ln in yaml.safe_dump(item.tree, sort_keys=True).splitlines()]
        else:
            lines.append(f"[{i}] {item.protocol} reference: python -m dask_cuda.benchmarks.local_cupy "
                         f"(chunk edge from the {item.protocol} base run)")
    return "\n".join(lines)


def _run(args) -> int:
    opts = options_from_args(args)
    if opts.plan_only:
        print(plan_text(opts))
        return 0
    driver.check_environment(opts)
    command = _command_line(command_line)
    payload = driver.execute(opts, command)
    print(render.stdout_text(payload))
    written = []
    if opts.out is not None:
        png = render.heatmap(payload)  # before the markdown: it may add a note
        written = write_report(opts.out, opts.name, payload, render.markdown(payload), png,
                               command=render.merged_command_txt(opts.out, command))
        print("wrote " + ", ".join(str(p) for p in written))
    sys.stdout.flush()
    failed = driver.failures(payload)
    if failed:
        code, line = failed
        where = f" (report: {opts.out / opts.name}.json)" if opts.out else ""
        raise UserError(line + where, code)
    return 0


def _command_line(generic) -> str:
    """The command as typed: `python -m ucx_dask_gpu.bench ...` stays that (report.command_line would drop 'bench')."""
    if sys.argv and sys.argv[0].replace("\\", "/").endswith("ucx_dask_gpu/bench/__main__.py"):
        return shlex.join(["python", "-m", "ucx_dask_gpu.bench", *sys.argv[1:]])
    return generic()


def _render(args) -> int:
    """Rewrite <name>.md and <name>.png beside <name>.json (the JSON is kept as it is, apart from stale notes)."""
    path = Path(args.json)
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable benchmark result: {e}", BENCH_CONFIG) from None
    if not isinstance(payload, dict) or not {"workload", "runs", "summary", "protocols"} <= set(payload):
        raise UserError(f"{path}: not a bench transpose|svd result (no workload/runs/summary)", BENCH_CONFIG)
    payload["notes"] = [n for n in payload.get("notes", []) if not n.startswith("no PNG heatmap")]
    if not payload["notes"]:
        payload.pop("notes")
    png = render.heatmap(payload)
    written = write_report(path.parent, path.stem, payload, render.markdown(payload), png)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
