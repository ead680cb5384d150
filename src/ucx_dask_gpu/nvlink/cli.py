"""`ucx-dask-gpu verify-nvlink` (also `python -m ucx_dask_gpu.nvlink`): prove, pair by pair, that NVLink delivers."""
from __future__ import annotations

import argparse
import socket
from pathlib import Path

from .. import nvml
from ..cliutil import SIZE_HELP, add_output, number_type, parse_bytes, size_type, standalone_main
from ..errors import PERFTEST_FAILED, USAGE, UserError
from ..report import command_line, format_table, write_report
from . import verify
from .gpuside import GpuSide
from .report import (STEM, TABLE_HEADERS, build_payload, recorded_command, render_markdown, render_png,
                     table_rows)
from .undertest import child_env, cuda_runtime_dirs, preflight, resolve_install
from .verdict import Thresholds, size_label
from .verify import (DEFAULT_GOALS, DEFAULT_SIZES, RunSpec, Verifier, parse_assignment, parse_goals, parse_sizes,
                     parse_variant, select_pairs)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify-nvlink", help="prove, pair by pair, that NVLink delivers (ucx_perftest + NVLink counters)",
        description=verify.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ucx-prefix", action="append", metavar="DIR|pip|path",
                   help="UCX to test (repeatable, compared side by side): a prefix with bin/ucx_perftest, 'pip' for "
                        "the libucx wheel of this Python, 'path' for ucx_perftest on PATH (default: PATH, then pip)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES}); {SIZE_HELP}")
    p.add_argument("--all-pairs", action="store_true", help="also measure pairs without NVLink (informational)")
    p.add_argument("--gpus", help="only these GPU indices (comma-separated, nvidia-smi numbering)")
    p.add_argument("--ucx-env", action="append", default=[], metavar="KEY=VAL", help="setting for every run")
    p.add_argument("--variant", action="append", default=[], metavar="'KEY=VAL [KEY=VAL]'",
                   help="an extra run per UCX with these settings (a study: reported, not counted in the exit status)")
    p.add_argument("--variant-sizes", metavar="SIZES", help="message sizes for the --variant runs (default: --sizes)")
    p.add_argument("--variants-on", choices=("all", "first"), default="all",
                   help="run the variants for every --ucx-prefix or only the first (default all)")
    p.add_argument("--min-ratio", type=float, default=0.90, help="ucx/cudaMemcpyPeer needed at the largest size")
    p.add_argument("--counter-fraction", type=float, default=0.90,
                   help="share of the bytes perftest moved that the NVLink counters must show")
    p.add_argument("--ablation-factor", type=float, default=0.5,
                   help="lanes evidence: bandwidth without cuda_ipc must fall below this x the default")
    p.add_argument("--transport-evidence", choices=("auto", "lanes"), default="auto",
                   help="auto: protocol tables where UCX prints them, lanes+ablation otherwise; lanes: always both")
    p.add_argument("--goals", default=DEFAULT_GOALS, help=f"benchmark goals SIZE=RATIO (default {DEFAULT_GOALS})")
    p.add_argument("--target-bytes", type=size_type(), default=parse_bytes("128GiB"),
                   help="bytes per perftest run, sets the iterations (default 128GiB)")
    p.add_argument("--iters", type=number_type(int, 10, "iterations"),
                   help="fixed iterations per run instead of --target-bytes")
    p.add_argument("--memcpy-samples", type=int, default=21, help="cudaMemcpyPeer samples per size (median)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per perftest run")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="DIR",
                   help="extra directory with libcudart.so for the UCX CUDA modules")
    p.add_argument("--unsafe-visible-devices", action="store_true",
                   help="TRAP: give both processes every GPU (as a careless run would); must come out invalid")
    p.add_argument("--keep-going", action="store_true",
                   help="when one UCX's perftest fails, record it and go on with the others (exit 14 at the end)")
    add_output(p, "--raw-dir", kind="dir", help="keep every perftest server/client output here (for fixtures / "
                                                "debugging)")
    add_output(p, "--out", kind="dir", help="write verify-nvlink.{json,md,png} + command.txt here (all or nothing)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("--memory-type", default="cuda", choices=("cuda", "host"), help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args) -> int:
    sizes = parse_sizes(args.sizes)
    goals = parse_goals(args.goals)
    base_env = dict(parse_assignment(e, "--ucx-env") for e in args.ucx_env)
    variants = [parse_variant(v) for v in args.variant]
    only = _check_options(args)
    installs = [resolve_install(s) for s in (args.ucx_prefix or ["auto"])]   # PERFTEST_MISSING
    gpus = nvml.discover()                                                      # NVML_UNAVAILABLE, NO_GPU
    pairs = select_pairs(gpus, args.all_pairs, only)                            # ONE_GPU, NO_NVLINK
    cuda_dirs = cuda_runtime_dirs(args.cuda_lib)
    for inst in installs:                                                       # PERFTEST_FAILED
        try:
            preflight(inst, child_env(inst, cuda_dirs, base_env))
        except UserError as e:
            if e.exit_code != PERFTEST_FAILED or not args.keep_going or len(installs) == 1:
                raise
            inst.preflight_error = str(e)
            print(f"verify-nvlink: {e} (--keep-going: its runs are reported as errors)", flush=True)
    runs = _run_specs(installs, variants, args.variants_on)
    th = Thresholds(args.min_ratio, args.counter_fraction, args.ablation_factor)
    side = GpuSide(gpus)
    ver = Verifier(args, gpus, pairs, runs, sizes, side, cuda_dirs, base_env, th)
    if not args.quiet:
        print(f"verify-nvlink: {len(gpus)} GPUs, {len(pairs)} pairs, sizes "
              f"{', '.join(size_label(s) for s in sizes)}; UCX: {', '.join(i.label for i in installs)}"
              + (f"; {len(variants)} variant(s)" if variants else "")
              + ("; UNSAFE visible devices (trap)" if args.unsafe_visible_devices else ""), flush=True)
    results = ver.run()
    try:
        driver = nvml.driver_version()
    except UserError:
        driver = None
    command = recorded_command(command_line())
    payload = build_payload(socket.gethostname(), driver, gpus, results, ver.baseline, sizes, th, goals, command,
                            args.unsafe_visible_devices)
    print(format_table(TABLE_HEADERS, table_rows(results)))
    for r in results:
        for p in r["pairs"]:
            for reason in p["reasons"]:
                print(f"  {r['label']} GPU{p['src']}->GPU{p['dst']} {p['verdict']}: {reason}")
    print(f"verdict: {payload['verdict']}")
    if args.out:
        md = render_markdown(payload, goals)
        png = render_png(payload)
        write_report(args.out, STEM, payload, md, png, command)
        print(f"report: {Path(args.out) / (STEM + '.json')}")
    return payload["exit_code"]


def _check_options(args) -> list[int] | None:
    """The options no parser type checks (USAGE before anything runs); the --gpus indices, or None."""
    if args.variant_sizes:
        parse_sizes(args.variant_sizes, "--variant-sizes")
    only = None
    if args.gpus:
        try:
            only = [int(x) for x in args.gpus.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--gpus: expected indices like 0,1, got {args.gpus!r}", USAGE) from None
    for name in ("min_ratio", "counter_fraction", "ablation_factor"):
        if not 0 < getattr(args, name) <= 10:
            raise UserError(f"--{name.replace('_', '-')}: out of range", USAGE)
    return only


def _run_specs(installs: list, variants: list[dict], variants_on: str) -> list[RunSpec]:
    """One run per UCX, each followed by its --variant runs (--variants-on first: the first UCX's only); labels
    unique."""
    seen: dict[str, int] = {}
    runs = []
    for k, inst in enumerate(installs):
        for var in [None, *(variants if k == 0 or variants_on == "all" else [])]:
            lbl = inst.label + ("" if var is None else " + " + " ".join(f"{key}={val}" for key, val in var.items()))
            seen[lbl] = seen.get(lbl, 0) + 1
            runs.append(RunSpec(inst, var, lbl if seen[lbl] == 1 else f"{lbl} #{seen[lbl]}"))
    return runs


def main(argv: list[str] | None = None) -> int:
    """`python -m ucx_dask_gpu.nvlink ...`: the same command without loading the other subcommands (a bare GPU host
    needs only this folder's dependencies)."""
    return standalone_main("verify-nvlink", register, argv)
