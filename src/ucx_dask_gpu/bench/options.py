"""A study's command line, shared by every study (`ucx-dask-gpu bench STUDY` and `python -m ucx_dask_gpu.bench.STUDY`):
its arguments, the Options a run is made of (validated before anything starts), what this host must have for it, and
--plan's account of which variants share a cluster. Standard library only at import: `--help` and bad arguments need
neither dask nor a GPU.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from dataclasses import dataclass

from .. import nvml
from ..cliutil import Parser, add_output, number_type
from ..errors import BENCH_DEPENDENCY, ONE_GPU, USAGE, UserError
from . import config, stats
from .studies import Study

MIN_RUNS = 15


@dataclass
class Options:
    study: Study
    params: dict
    variants: list
    baseline: str
    client_keys: tuple
    mode: str                    # cpu | gpu | shared
    gpus: list[int]
    workers: int
    runs: int
    warmup: int
    budget: float
    run_timeout: float
    seed: int
    resamples: int
    parity: str | None
    peer: bool
    out: str | None              # cliutil.add_output's OutputDir: checked before the run, written with its label
    name: str
    proto_info: bool
    quiet: bool
    python: str = sys.executable


def add_arguments(p: argparse.ArgumentParser, study: Study) -> None:
    study.add_arguments(p)
    g = p.add_argument_group("variants (the syntax below; docs/benchmarks.md)")
    g.add_argument("--variant", action="append", default=[], metavar="[PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...]",
                   help="a variant (repeatable); CONFIG none|shipped|tuned|PATH; default: "
                        f"{' and '.join(study.default_variants)}, e.g. "
                        "'ucx@pool:shipped:ucx-dask-gpu.cluster.rmm-pool-size=8GiB'")
    g.add_argument("--protocols", default="ucx", help="protocols of a variant that names none (default ucx)")
    g.add_argument("--baseline", help="the variant ratios are taken against, PROTOCOL/LABEL or LABEL (default: first)")
    g.add_argument("--client-key", action="append", default=[], metavar="PREFIX",
                   help="a dask config key (or prefix) a running cluster can take: applied in the client per "
                        "repetition, so variants differing only in it share a cluster (array.*, dataframe.*, "
                        "optimization.*, tokenize.*, split_every always are)")
    w = p.add_argument_group("where")
    w.add_argument("--cpu", action="store_true", help="numpy on dask workers, ucx = UCX over TCP (no GPU needed)")
    w.add_argument("--gpus", help="GPU indices, one worker each (default: every GPU)")
    w.add_argument("--shared-gpu", type=number_type(int, 0, "a GPU index"), metavar="INDEX",
                   help="--workers dask-cuda workers sharing this one GPU (cuda_ipc between them)")
    w.add_argument("--workers", type=number_type(int, 2, "an integer"), default=2,
                   help="worker processes with --cpu or --shared-gpu (default 2)")
    m = p.add_argument_group("measurement")
    m.add_argument("--runs", type=number_type(int, 1, "an integer"), default=MIN_RUNS,
                   help=f"timed repetitions per variant (default and least {MIN_RUNS}, see --allow-few)")
    m.add_argument("--allow-few", action="store_true", help=f"accept --runs below {MIN_RUNS} (smoke tests)")
    m.add_argument("--warmup", type=number_type(int, 0, "an integer"), default=2,
                   help="untimed rounds first, recorded apart (default 2)")
    m.add_argument("--budget", type=number_type(float, 1, "seconds"), default=540.0,
                   help="seconds for the whole invocation: no round starts that would not end in time (default 540)")
    m.add_argument("--run-timeout", type=number_type(float, 1, "seconds"), default=300.0,
                   help="seconds one cluster start, repetition or reference may take (default 300)")
    m.add_argument("--seed", type=number_type(int, 0, "an integer"), default=0, help="input and bootstrap seed")
    m.add_argument("--resamples", type=number_type(int, stats.RESAMPLES, "an integer"), default=stats.RESAMPLES,
                   help=f"bootstrap resamples (default {stats.RESAMPLES})")
    r = p.add_argument_group("dask-cuda's local_cupy beside it (transpose, svd)")
    r.add_argument("--parity", metavar="VARIANT", help="run local_cupy with this variant's config on its cluster")
    r.add_argument("--peer", action="store_true", help="run local_cupy with its own defaults")
    o = p.add_argument_group("output")
    add_output(o, "--out", kind="dir", help="write NAME.json, NAME.md, NAME.png and command.txt into this directory")
    o.add_argument("--name", help=f"report file stem (default {study.name})")
    o.add_argument("--proto-info", action="store_true", help="UCX_PROTO_INFO=y in every cluster (UCX's choices)")
    o.add_argument("--plan", action="store_true", help="print the clusters and variants, run nothing")
    o.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def build_parser(study: Study) -> argparse.ArgumentParser:
    p = Parser(prog=f"python -m {study.module}", description=study.help,
               epilog="Variants: " + config.__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    add_arguments(p, study)
    return p


def options(study: Study, args) -> Options:
    """Everything a run needs, validated before anything starts; UserError with one line otherwise."""
    mode = "cpu" if args.cpu else "shared" if args.shared_gpu is not None else "gpu"
    if args.cpu and (args.gpus or args.shared_gpu is not None) or args.gpus and args.shared_gpu is not None:
        raise UserError("--cpu, --gpus and --shared-gpu exclude each other", USAGE)
    if args.runs < MIN_RUNS and not args.allow_few:
        raise UserError(f"--runs {args.runs}: fewer than {MIN_RUNS} timed repetitions cannot resolve effects below "
                        "~1.15x; add --allow-few for a smoke test", USAGE)
    gpus = _gpu_list(args.gpus) if mode == "gpu" else [args.shared_gpu] if mode == "shared" else []
    workers = study.workers or args.workers
    if mode != "gpu" and study.workers and args.workers != study.workers:
        raise UserError(f"{study.name} runs on {study.workers} workers", USAGE)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    texts = args.variant or list(study.default_variants)
    variants = config.parse_variants(texts, protocols, mode == "cpu")
    baseline = config.find_variant(variants, args.baseline, "--baseline") if args.baseline else variants[0]
    parity = config.find_variant(variants, args.parity, "--parity").name if args.parity else None
    if (parity or args.peer) and not study.reference_operation:
        raise UserError(f"--parity/--peer: local_cupy has no {study.name} operation", USAGE)
    name = args.name or study.name
    if not config.LABEL_RE.match(name):
        raise UserError(f"--name {name!r}: expected a file stem of letters, digits, '.', '_', '-'", USAGE)
    return Options(study, study.params(args, mode == "cpu"), variants, baseline.name, tuple(args.client_key), mode,
                   gpus, workers, args.runs, args.warmup, args.budget, args.run_timeout, args.seed, args.resamples,
                   parity, args.peer, args.out, name, args.proto_info, args.quiet)


def _gpu_list(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        gpus = [int(g) for g in text.split(",")]
    except ValueError:
        raise UserError(f"--gpus {text!r}: expected GPU indices like 0,1", USAGE) from None
    if len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise UserError(f"--gpus {text!r}: expected distinct GPU indices", USAGE)
    return gpus


def check_environment(opts: Options) -> None:
    """Fail fast, with one line, where this host cannot run what was asked."""
    need = ["dask", "distributed"] + (["distributed_ucxx", "ucxx"] if any(v.protocol == "ucx" for v in opts.variants)
                                      else [])
    need += ["dask_cuda", "cupy", "rmm"] if opts.mode != "cpu" else []
    need += ["dask_cuda", "nvtx", "pandas"] if opts.parity or opts.peer else []
    missing = sorted({n for n in need if importlib.util.find_spec(n) is None})
    if missing:
        raise UserError(f"missing Python packages for this benchmark: {', '.join(missing)}", BENCH_DEPENDENCY)
    if opts.mode == "cpu":
        return
    have = [g.index for g in nvml.discover()]  # UserError NVML_UNAVAILABLE / NO_GPU where there is none
    opts.gpus = have if opts.gpus is None else opts.gpus
    unknown = [g for g in opts.gpus if g not in have]
    if unknown:
        raise UserError(f"GPU {','.join(map(str, unknown))}: no such GPU (have {','.join(map(str, have))})", USAGE)
    if opts.mode == "gpu":
        if len(opts.gpus) < 2 or (opts.study.workers and len(opts.gpus) != opts.study.workers):
            raise UserError(f"{len(opts.gpus)} GPU(s) selected: workers on different GPUs need 2 or more (use "
                            "--shared-gpu INDEX for workers sharing one GPU)", ONE_GPU)
        opts.workers = len(opts.gpus)


def plan_text(opts: Options) -> str:
    lines = [f"{opts.study.name} {json.dumps(opts.params)}: {opts.mode}, {opts.workers} workers, baseline "
             f"{opts.baseline}, {opts.runs} timed rounds after {opts.warmup} warm-up"]
    for i, group in enumerate(group_variants(opts)):
        tree, _ = group[0].split(opts.client_keys)
        lines.append(f"cluster c{i} {group[0].protocol}: environment {dict(group[0].env)}"
                     + (f", unset {list(group[0].unset)}" if group[0].unset else "") + f", config {json.dumps(tree)}")
        lines += [f"  {v.name}: {v.config} {dict(v.settings)} client-side {v.split(opts.client_keys)[1]}"
                  for v in group]
    return "\n".join(lines)


def group_variants(opts: Options) -> list[list]:
    """The variants by the cluster they run on (config.Variant.cluster_id)."""
    groups: dict[str, list] = {}
    for v in opts.variants:
        groups.setdefault(v.cluster_id(opts.client_keys), []).append(v)
    return list(groups.values())
