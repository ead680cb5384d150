"""What every study shares (the model is dask-cuda's benchmarks/common.py): the Study interface, the command line,
and the driver that runs a study's variants honestly and writes the report.

The driver:
  1. groups the variants by the cluster they need (config.Variant.cluster_id) and starts one cluster process per group
     (cluster.py), all at once;
  2. runs `--warmup` untimed rounds, then timed rounds until every variant has `--runs` repetitions or `--budget`
     would run out: in each round every variant gets one repetition, in an order that alternates (stats.round_order),
     the same input seed for all, so a slow minute of the machine hits every variant alike;
  3. checks each variant's result on its cluster, runs dask-cuda's local_cupy beside it (parity, peer: reference.py),
     closes the clusters;
  4. reports every sample, the ratio of medians to the baseline variant with a seeded bootstrap interval and its
     verdict, bytes moved per repetition (flagged where variants differ), and the provenance (provenance.py).
dask is imported where a run needs it: `ucx-dask-gpu --help` and bad arguments need none of it.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .. import nvml
from ..cliutil import SIZE_HELP, Parser, Progress, add_output, parse_bytes, run_parsed
from ..errors import BENCH_DEPENDENCY, BENCH_FAILED, ONE_GPU, REFERENCE_FAILED, USAGE, UserError
from ..report import command_line
from . import cluster, config, provenance, reference, render, stats

SCHEMA_VERSION = 2
MIN_RUNS = 15
CLOSE_RESERVE_S = 45.0       # closing the clusters and writing the report, kept out of the rounds' budget
REFERENCE_GRACE_S = 30.0     # local_cupy printed everything: its teardown gets this long, then it is stopped
PROTO_ROW_RE = re.compile(r"\|.*\|")


class Study:
    """One benchmarked study (a module: transpose.py, svd.py, transfer.py). The driver-side half parses its arguments
    and describes it; the cluster-side half (prepare, repetition, check) runs in a cluster process."""

    name: str                    # `ucx-dask-gpu bench NAME`
    module: str                  # `python -m MODULE`
    help: str
    reference_operation: str | None = None   # local_cupy's -o, where it has one
    workers: int | None = None   # a fixed number of workers (the transfer study: 2)

    def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

    def params(self, args, cpu: bool) -> dict:
        """The study's parameters (JSON), validated; UserError USAGE otherwise."""
        raise NotImplementedError

    def describe(self, params: dict) -> dict:
        """Fields of the report's top level: workload, expression, size, shape, chunk, ..."""
        raise NotImplementedError

    def reference_args(self, params: dict, overlay: dict) -> tuple[int, int, list[str]]:
        """local_cupy's -s and -c under a variant's client-side config, and what else it needs for this study."""
        raise NotImplementedError

    def primary(self, params: dict) -> str:
        """The metric `wall_s` and `ratio_to_baseline` report."""
        return "wall_s"

    def prepare(self, client, params: dict, workers: list[str], gpu: bool):
        return {"params": params, "workers": workers, "gpu": gpu}

    def repetition(self, client, ctx, seed: int) -> dict:
        """One repetition: {"metrics": {name: seconds}, "bytes": moved, "transfers": [...]}."""
        raise NotImplementedError

    def check(self, client, ctx, seed: int) -> dict:
        return {"ok": True}


class ArrayStudy(Study):
    """A dask.array computation on a random float64 input pinned to the workers (cluster.pinned_array), timed as
    local_cupy times it: wait(client.persist(result)) + a device sync on every worker, a fresh input per repetition
    (created untimed): `wall_s`; then the same again on the resident input: `steady_s`. Subclasses say the shape,
    the graph and the identity that checks it."""

    second_size: bool = False
    gpu_defaults: tuple = ()     # (size, second size, chunks)
    cpu_defaults: tuple = ()

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g, c = self.gpu_defaults, self.cpu_defaults
        p.add_argument("--size", type=_number(int, 1, "an integer"), help=f"rows; default {g[0]} ({c[0]} with --cpu)")
        if self.second_size:
            p.add_argument("--second-size", type=_number(int, 1, "an integer"),
                           help=f"columns; default {g[1]} ({c[1]} with --cpu)")
        p.add_argument("--chunks", help=f"block edge(s) in elements (4096 or 4096,2048) or a size ('128 MiB'); "
                                        f"default {g[2]!r} ({c[2]!r} with --cpu); {SIZE_HELP}")

    def params(self, args, cpu: bool) -> dict:
        from dask.array.core import normalize_chunks

        size, second, text = self.cpu_defaults if cpu else self.gpu_defaults
        size, second = args.size or size, getattr(args, "second_size", None) or second
        shape = self.shape(size, second)
        text = args.chunks or text
        try:
            given = "auto" if text == "auto" else tuple(int(e) for e in text.split(",")) \
                if re.fullmatch(r"\d+(,\d+)?", text) else parse_bytes(text)
            chunks = self.chunks(given, shape)
            norm = normalize_chunks(chunks, shape, dtype="float64")
        except (ValueError, TypeError):
            raise UserError(f"--chunks {text!r}: expected auto, block edges like 4096 or 4096,2048, or a size like "
                            "'128 MiB'", USAGE) from None
        if second and second > size:
            raise UserError(f"--second-size {second} must not exceed --size {size} (tall-skinny)", USAGE)
        # "auto" is resolved per repetition under the variant's array.chunk-size; `chunk` is dask's default one
        return {"size": size, "second_size": second if self.second_size else None, "shape": list(shape),
                "chunks": chunks, "chunk": [norm[0][0], norm[1][0]], "blocks": [len(norm[0]), len(norm[1])]}

    def shape(self, size: int, second: int | None) -> tuple[int, int]:
        return (size, size)

    def chunks(self, given, shape):
        """--chunks as dask.array takes it for this input."""
        return given if not isinstance(given, tuple) or len(given) == 2 else given * 2

    def build(self, x) -> list:
        raise NotImplementedError

    def identity(self, client, x, outputs) -> tuple[float, float]:
        raise NotImplementedError

    def reference_args(self, params: dict, overlay: dict) -> tuple[int, int, list[str]]:
        import dask
        from dask.array.core import normalize_chunks

        with dask.config.set(overlay):  # the variant's array.chunk-size decides "auto"
            edge = normalize_chunks(_chunks(params), tuple(params["shape"]), dtype="float64")[0][0]
        return params["size"], edge, (["-2", str(params["second_size"])] if self.second_size else [])

    def repetition(self, client, ctx, seed: int) -> dict:
        p = ctx["params"]
        x, blocks = cluster.pinned_array(client, ctx["workers"], tuple(p["shape"]), _chunks(p), seed, ctx["gpu"])
        if ctx["gpu"]:
            client.run(cluster.sync_device)
        wall, futures, transfers = cluster.timed_persist(client, self.build(x), ctx["gpu"])
        # Steady state: the same graph again on the same, resident input once the first result is released. The
        # blocks a worker fetched stay there as replicas while x is held, so this moves next to nothing: what is left
        # is Dask's control path per task (`steady_s`, its bytes in `steady_bytes`).
        from distributed import futures_of

        keys = [f.key for f in futures_of(futures)]
        del futures
        cluster.wait_released(client, keys)
        steady, again, steady_transfers = cluster.timed_persist(client, self.build(x), ctx["gpu"])
        chunk = list(x.chunksize)
        del again, blocks, x
        return {"metrics": {"wall_s": wall, "steady_s": steady}, "bytes": sum(t["bytes"] for t in transfers),
                "steady_bytes": sum(t["bytes"] for t in steady_transfers), "chunk": chunk,
                "transfers": [{k: t[k] for k in ("src", "dst", "bytes", "duration")} for t in transfers]}

    def check(self, client, ctx, seed: int) -> dict:
        import math

        p = ctx["params"]
        x, blocks = cluster.pinned_array(client, ctx["workers"], tuple(p["shape"]), _chunks(p), seed, ctx["gpu"])
        value, expected = self.identity(client, x, self.build(x))
        del blocks, x
        rel = abs(value - expected) / max(abs(expected), 1e-300)
        return {"identity": self.identity_text, "value": value, "expected": expected, "rel_error": rel,
                "ok": bool(math.isfinite(value) and rel <= self.rtol)}


def _chunks(params: dict):
    c = params["chunks"]
    return tuple(tuple(e) if isinstance(e, list) else e for e in c) if isinstance(c, list) else c


def scalar(v) -> float:
    return float(v.get() if hasattr(v, "get") else v)  # a CuPy 0-d array comes back to the host


# --- child processes ------------------------------------------------------------------------------------------------

class Child:
    """A child process in its own session (it and the workers it spawns stop together); its progress lines forwarded,
    its answers queued, the rest of its output kept."""

    def __init__(self, cmd: list[str], env: dict, label: str, progress: Progress, stdin: bool = False):
        self.label, self.progress = label, progress
        self.stdout: deque[str] = deque(maxlen=5000)
        self.stderr: deque[str] = deque(maxlen=300)
        self.answers: queue.Queue = queue.Queue()
        self.tracebacks, self.proto_info = 0, []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.threads = [threading.Thread(target=self._read, args=(s, s is self.proc.stderr), daemon=True)
                        for s in (self.proc.stdout, self.proc.stderr)]
        for t in self.threads:
            t.start()

    def _read(self, stream, is_err: bool) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith(cluster.ANSWER):
                self.answers.put(json.loads(line[len(cluster.ANSWER):]))
                continue
            if line.startswith(cluster.PROGRESS):
                self.progress(f"[{self.label}] {line[len(cluster.PROGRESS):]}")
                continue
            self.tracebacks += bool(reference.TRACEBACK_RE.match(line))
            row = re.sub(r"^\s*\[[0-9.]+\]\s*\[[^\]]*\]\s*", "", line).strip()[:300]
            if PROTO_ROW_RE.search(line) and "cuda" in line.lower() and row not in self.proto_info \
                    and len(self.proto_info) < 80:
                self.proto_info.append(row)  # UCX_PROTO_INFO's protocol rows for device memory
            (self.stderr if is_err else self.stdout).append(line)
        if not is_err:
            self.answers.put(None)  # its stdout closed: no answer will come

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> dict | None:
        try:
            return self.answers.get(timeout=max(0.1, timeout))
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout:.0f} s") from None

    def kill(self, grace: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(timeout=grace)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


# --- options --------------------------------------------------------------------------------------------------------

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


def _number(convert, low, what):
    def parse(text):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {text}")
        return v
    return parse


def add_arguments(p: argparse.ArgumentParser, study: Study) -> None:
    study.add_arguments(p)
    g = p.add_argument_group("variants (the syntax below; docs/benchmarks.md)")
    g.add_argument("--variant", action="append", default=[], metavar="[PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...]",
                   help="a variant (repeatable); CONFIG none|shipped|tuned|PATH; default: ucx@defaults:none and "
                        "ucx,tcp@shipped:shipped, e.g. 'ucx@pool:shipped:ucx-dask-gpu.cluster.rmm-pool-size=8GiB'")
    g.add_argument("--protocols", default="ucx", help="protocols of a variant that names none (default ucx)")
    g.add_argument("--baseline", help="the variant ratios are taken against, PROTOCOL/LABEL or LABEL (default: first)")
    g.add_argument("--client-key", action="append", default=[], metavar="PREFIX",
                   help="a dask config key (or prefix) a running cluster can take: applied in the client per "
                        "repetition, so variants differing only in it share a cluster (array.*, dataframe.*, "
                        "optimization.*, tokenize.*, split_every always are)")
    w = p.add_argument_group("where")
    w.add_argument("--cpu", action="store_true", help="numpy on a LocalCluster, ucx = UCX over TCP (no GPU needed)")
    w.add_argument("--gpus", help="GPU indices, one worker each (default: every GPU)")
    w.add_argument("--shared-gpu", type=_number(int, 0, "a GPU index"), metavar="INDEX",
                   help="--workers dask-cuda workers sharing this one GPU (cuda_ipc between them)")
    w.add_argument("--workers", type=_number(int, 2, "an integer"), default=2,
                   help="worker processes with --cpu or --shared-gpu (default 2)")
    m = p.add_argument_group("measurement")
    m.add_argument("--runs", type=_number(int, 1, "an integer"), default=MIN_RUNS,
                   help=f"timed repetitions per variant (default and least {MIN_RUNS}, see --allow-few)")
    m.add_argument("--allow-few", action="store_true", help=f"accept --runs below {MIN_RUNS} (smoke tests)")
    m.add_argument("--warmup", type=_number(int, 0, "an integer"), default=2,
                   help="untimed rounds first, recorded apart (default 2)")
    m.add_argument("--budget", type=_number(float, 1, "seconds"), default=540.0,
                   help="seconds for the whole invocation: no round starts that would not end in time (default 540)")
    m.add_argument("--run-timeout", type=_number(float, 1, "seconds"), default=300.0,
                   help="seconds one cluster start, repetition or reference may take (default 300)")
    m.add_argument("--seed", type=_number(int, 0, "an integer"), default=0, help="input and bootstrap seed")
    m.add_argument("--resamples", type=_number(int, stats.RESAMPLES, "an integer"), default=stats.RESAMPLES,
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
    texts = args.variant or ["ucx@defaults:none", "ucx,tcp@shipped:shipped"]
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
    import importlib.util

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
    groups: dict[str, list] = {}
    for v in opts.variants:
        groups.setdefault(v.cluster_id(opts.client_keys), []).append(v)
    return list(groups.values())


# --- the run --------------------------------------------------------------------------------------------------------

class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


class Host:
    """The driver's handle on one cluster process and the variants it serves."""

    def __init__(self, index: int, variants: list, opts: Options, tmp: Path, progress: Progress):
        self.id, self.variants, self.facts, self.error, self.shutdown = f"c{index}", variants, None, None, None
        tree, _ = variants[0].split(opts.client_keys)
        d = tmp / self.id
        cfg = config.write_config(d / "dask-config", tree)
        keys = sorted({k for v in variants for k, _ in v.settings if not config.client_side(k, opts.client_keys)}
                      | {k for v in variants for k, _ in v.env})
        spec = {"protocol": variants[0].protocol, "mode": opts.mode, "gpus": opts.gpus, "workers": opts.workers,
                "params": opts.params, "probe_keys": keys, "local_directory": str(d / "scratch"),
                "start_timeout": opts.run_timeout}
        (d / "spec.json").write_text(json.dumps(spec))
        env = config.child_env(dict(os.environ), cfg, tmp / "empty", variants[0].env, variants[0].unset)
        if opts.proto_info:
            env["UCX_PROTO_INFO"] = "y"
        self.tree = tree
        self.child = Child([opts.python, "-m", opts.study.module, "--serve", str(d / "spec.json")], env,
                           f"{self.id} {variants[0].protocol}", progress, stdin=True)

    @property
    def alive(self) -> bool:
        return self.facts is not None and self.error is None

    def ready(self, timeout: float) -> None:
        try:
            ans = self.child.answer(timeout)
        except TimeoutError as e:
            ans = {"op": "error", "error": f"cluster did not start: {e}"}
        if ans and ans.get("op") == "ready":
            self.facts = ans
        else:
            self.fail((ans or {}).get("error") or f"exited with {self.child.proc.poll()} before it was up")

    def fail(self, why: str) -> None:
        self.error = self.error or why
        if self.child.proc.poll() is None and self.facts is None:
            self.child.kill()

    def request(self, req: dict, timeout: float) -> dict:
        try:
            self.child.send(req)
            ans = self.child.answer(timeout)
        except (OSError, TimeoutError) as e:
            ans = None
            self.error = f"{req['op']}: {e}"
            self.child.kill()
        if ans is None:
            self.error = self.error or f"the cluster process exited with {self.child.proc.poll()}"
            return {"ok": False, "error": self.error}
        return ans

    def begin_close(self) -> None:
        if self.child.proc.poll() is None:
            try:
                self.child.send({"op": "close"})
                self.child.proc.stdin.close()
            except OSError:
                pass

    def finish_close(self, deadline: float) -> None:
        """Wait for its shutdown record (every cluster closes at once: begin_close first)."""
        while self.shutdown is None and time.monotonic() < deadline:
            try:
                ans = self.child.answer(deadline - time.monotonic())
            except TimeoutError:
                break
            if ans is None:
                break
            if ans.get("op") == "closed":
                self.shutdown = ans["shutdown"]
        self.rc = self.child.wait(max(1.0, deadline - time.monotonic()))


@dataclass
class Record:
    """What one variant measured."""
    variant: object
    host: Host
    overlay: dict
    warmup: list = field(default_factory=list)
    reps: list = field(default_factory=list)
    error: str | None = None
    check: dict | None = None

    def metric(self, name: str) -> list[float]:
        return [r["metrics"][name] for r in self.reps if name in r["metrics"]]

    @property
    def active(self) -> bool:
        return self.error is None and self.host.alive


def one_round(records: dict[str, Record], index: int, warm: bool, opts: Options, budget: Budget,
              progress: Progress) -> None:
    seed = opts.seed * 1_000_000 + (index if warm else opts.warmup + index) * 1000
    for name in stats.round_order([n for n, r in records.items() if r.active], index):
        rec = records[name]
        # A repetition that hangs (a GPU out of memory, a lost peer) fails its variant within what the budget still
        # holds, so the other variants' results are still written.
        timeout = max(10.0, min(opts.run_timeout, budget.left() - CLOSE_RESERVE_S))
        ans = rec.host.request({"op": "rep", "overlay": rec.overlay, "seed": seed}, timeout)
        if not ans.get("ok"):
            rec.error = ans.get("error") or "failed"
            progress(f"[{name}] {'warm-up' if warm else 'round'} {index + 1} failed: {rec.error}")
            continue
        ans.pop("op", None)
        (rec.warmup if warm else rec.reps).append(ans)
        shown = " ".join(f"{k} {v * 1e3:.2f} ms" for k, v in list(ans["metrics"].items())[:4])
        progress(f"[{name}] {'warm-up' if warm else 'round'} {index + 1}: {shown}")


def reference_seconds(opts: Options, records: dict[str, Record], name: str | None) -> float:
    """What one local_cupy run is expected to take: its start plus as many repetitions as our variant `name` (the one
    it runs against; else the baseline) has, at the pace ours took (each of ours includes making the input too)."""
    rec = records.get(name) or records.get(opts.baseline)
    if rec is None:
        return 0.0
    pace = stats.median([r["total_s"] for r in rec.reps + rec.warmup]) or 1.0
    return 20.0 + 1.2 * (max(len(rec.reps), 1) + max(1, opts.warmup)) * pace


def run_rounds(records: dict[str, Record], opts: Options, budget: Budget, progress: Progress) -> list[str]:
    """Warm-up rounds, then timed rounds while the budget lasts. The first MIN_RUNS rounds keep time only for
    closing the clusters; later ones also for local_cupy's runs (which are skipped, said so, when they do not fit)."""
    notes, longest = [], 0.0
    for i in range(opts.warmup):
        t = time.monotonic()
        one_round(records, i, True, opts, budget, progress)
        longest = max(longest, time.monotonic() - t)
    later = ([opts.parity] if opts.parity else []) + ([None] if opts.peer else [])  # None: the peer, at our pace
    for i in range(opts.runs):
        need = longest + CLOSE_RESERVE_S + (sum(reference_seconds(opts, records, n) for n in later)
                                            if i >= MIN_RUNS else 0.0)
        if budget.left() < need:
            notes.append(f"budget: stopped after {i} of {opts.runs} timed rounds ({budget.left():.0f} s left, the "
                         f"next round and what follows it need ~{need:.0f} s)")
            progress(notes[-1])
            break
        if not any(r.active for r in records.values()):
            break
        t = time.monotonic()
        one_round(records, i, False, opts, budget, progress)
        longest = max(longest, time.monotonic() - t)
    return notes


def wait_printed(child: Child, timeout: float) -> str:
    deadline, printed = time.monotonic() + timeout, None
    while True:
        try:
            return f"exited with {child.proc.wait(timeout=0.5)}"
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            printed = printed or (now if reference.printed_everything(list(child.stdout)) else None)
            if printed and now - printed > REFERENCE_GRACE_S:
                return "stopped in its teardown (results complete)"
            if now > deadline:
                return f"timed out after {timeout:.0f} s"


def run_local_cupy(cmd: list[str], env: dict, timeout: float, progress: Progress, label: str) -> dict:
    """local_cupy to its end; once it has printed everything, its teardown gets a grace period, then it is stopped
    (its UCX teardown can sit in an endpoint timeout). Its numbers count once printed."""
    progress(f"[{label}] {shlex.join(cmd[1:])}")
    child = Child(cmd, env, label, progress)
    try:
        teardown = wait_printed(child, timeout)
    finally:
        child.kill()
    for t in child.threads:
        t.join(timeout=10)
    text = "\n".join(child.stdout)
    out = {"tool": reference.TOOL, "command": shlex.join(["python"] + cmd[1:]), "teardown": teardown,
           "tracebacks": child.tracebacks, "teardown_exceptions": reference.exceptions_in(list(child.stderr)),
           "stdout": text[-20000:]}
    try:
        out.update(reference.parse_local_cupy(text), status="ok")
    except reference.ReferenceOutputError as e:
        tail = [ln for ln in child.stderr if ln.strip()][-1:] or ["(no output)"]
        out.update(status="error", error=f"{teardown}: {e}; last stderr line: {tail[0][:200]}",
                   log_tail=list(child.stderr)[-40:])
    progress(f"[{label}] {out['status']}" + (f": {out.get('error')}" if out["status"] != "ok" else
                                             f", wall median {stats.median(out['wall_s']) * 1e3:.1f} ms"))
    return out


def references(opts: Options, records: dict[str, Record], tmp: Path, budget: Budget, progress: Progress,
               own_cluster: bool) -> list[dict]:
    """The parity and peer runs that go against a running cluster (own_cluster False), or the peer run that starts
    its own (own_cluster True, after our clusters are closed)."""
    out: list[dict] = []
    peer_own = opts.mode == "gpu" and len(opts.gpus) >= 2
    if opts.parity and not own_cluster:
        out.append(reference_run(opts, "parity", records[opts.parity], records, tmp, budget, progress))
    if opts.peer and own_cluster == peer_own:
        target = None if peer_own else next(
            (r for r in records.values() if r.variant.config == "none" and not r.variant.settings
             and not r.variant.env and not r.variant.unset and r.host.alive), None)
        if target is None and not peer_own:
            out.append({"tool": reference.TOOL, "kind": "peer", "status": "skipped",
                        "error": "local_cupy starts its own cluster only with one worker per GPU, 2 GPUs or more; "
                                 "no running variant has dask's and dask-cuda's defaults (CONFIG none, no settings) "
                                 "to run it against"})
        else:
            out.append(reference_run(opts, "peer", target, records, tmp, budget, progress))
    return out


def reference_run(opts: Options, kind: str, target: Record | None, records: dict[str, Record], tmp: Path,
                  budget: Budget, progress: Progress) -> dict:
    v = target.variant if target else None
    protocol = v.protocol if v else config.find_variant(opts.variants, opts.baseline, "--baseline").protocol
    if target is not None and not target.host.alive:
        return {"tool": reference.TOOL, "kind": kind, "status": "skipped", "error": f"{v.name}'s cluster is down"}
    need, left = reference_seconds(opts, records, v.name if v else None), budget.left() - (5 if v is None else
                                                                                          CLOSE_RESERVE_S)
    if need > left:
        return {"tool": reference.TOOL, "kind": kind, "status": "skipped",
                "error": f"not run: it needs ~{need:.0f} s, {left:.0f} s of --budget are left"}
    d = tmp / f"reference-{kind}"
    cfg = config.write_config(d, v.tree if kind == "parity" else {})
    env = config.child_env(dict(os.environ), cfg, tmp / "empty", v.env if kind == "parity" else (),
                           v.unset if kind == "parity" else ())
    size, chunk, extra = opts.study.reference_args(opts.params, target.overlay if target else {})
    cmd = reference.command(opts.python, opts.study.reference_operation, protocol, size, chunk,
                            len(target.reps) if target and target.reps else opts.runs, max(1, opts.warmup), extra,
                            gpus=opts.gpus, scheduler=target.host.facts["scheduler"] if target else None,
                            cpu=opts.mode == "cpu")
    res = run_local_cupy(cmd, env, min(opts.run_timeout * 2, max(10.0, left)), progress, f"{kind} local_cupy")
    res.update(kind=kind, protocol=protocol, against=v.name if target else "its own LocalCUDACluster",
               config=v.config if kind == "parity" else "none (local_cupy's defaults)")
    return res


def execute(opts: Options, command: str) -> dict:
    """Run everything; returns the report payload."""
    progress, budget = Progress(quiet=opts.quiet, timed=True), Budget(opts.budget)
    started = datetime.now(timezone.utc)
    prov = provenance.collect(command, opts.gpus if opts.mode != "cpu" else None)
    hosts: list[Host] = []
    with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-bench-") as tmpname:
        tmp = Path(tmpname)
        (tmp / "empty").mkdir()
        try:
            hosts += [Host(i, g, opts, tmp, progress) for i, g in enumerate(group_variants(opts))]
            progress(f"{opts.study.name}: {len(opts.variants)} variant(s) on {len(hosts)} cluster(s), budget "
                     f"{opts.budget:.0f} s")
            records, notes, refs = measure(opts, hosts, tmp, budget, progress, prov)
        finally:  # also when interrupted: a cluster process lives in its own session, nothing else would stop it
            for h in hosts:
                if h.child.proc.poll() is None:
                    h.child.kill()
    payload = render.assemble(opts, records, hosts, refs, notes, prov)
    payload.update(schema_version=SCHEMA_VERSION, date=started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                   duration_s=round(opts.budget - budget.left(), 1), command=command)
    return payload


def measure(opts: Options, hosts: list[Host], tmp: Path, budget: Budget, progress: Progress, prov: dict):
    for h in hosts:
        h.ready(min(opts.run_timeout, budget.left()))
    records = {v.name: Record(v, h, v.split(opts.client_keys)[1]) for h in hosts for v in h.variants}
    notes = run_rounds(records, opts, budget, progress)
    for rec in records.values():
        if rec.active:
            ans = rec.host.request({"op": "check", "overlay": rec.overlay, "seed": 1}, opts.run_timeout)
            rec.check = {k: v for k, v in ans.items() if k not in ("op", "traceback")}
    refs = references(opts, records, tmp, budget, progress, own_cluster=False)
    if opts.mode != "cpu":
        prov["clocks_after"] = provenance.gpu_facts(opts.gpus).get("gpus")
    for h in hosts:
        h.begin_close()
    deadline = time.monotonic() + max(20.0, min(90.0, budget.left()))
    for h in hosts:
        h.finish_close(deadline)
    refs += references(opts, records, tmp, budget, progress, own_cluster=True)
    return records, notes, refs


def failures(payload: dict) -> tuple[int, str] | None:
    bad = [r for r in payload["runs"] if r["status"] == "error"]
    if bad:
        return BENCH_FAILED, f"{bad[0]['name']}: {bad[0]['error']}"
    bad = [r for r in payload["references"] if r.get("status") == "error"]
    if bad:
        return REFERENCE_FAILED, f"{bad[0]['kind']} local_cupy: {bad[0].get('error')}"
    return None


def run(study: Study, args, command: str) -> int:
    opts = options(study, args)
    if args.plan:
        print(plan_text(opts))
        return 0
    check_environment(opts)
    payload = execute(opts, command)
    print(render.text(payload), flush=True)
    if opts.out is not None:
        print("wrote " + ", ".join(map(str, render.write(payload, opts.out, opts.name, command))), flush=True)
    failed = failures(payload)
    if failed:
        where = f" (report: {Path(opts.out) / opts.name}.json)" if opts.out else ""
        raise UserError(failed[1] + where, failed[0])
    return 0


def main(study: Study, argv: list[str] | None = None) -> int:
    """`python -m ucx_dask_gpu.bench.<study> ...`; `--serve SPEC` is a cluster process (cluster.serve)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"] and len(argv) == 2:
        return cluster.serve(study, argv[1])
    args = build_parser(study).parse_args(argv)
    command = shlex.join(["python", "-m", study.module, *argv])
    args.func = lambda a: run(study, a, command)
    return run_parsed(args, study.module)


def cli_run(study: Study):
    """The `ucx-dask-gpu bench STUDY` handler."""
    return lambda args: run(study, args, command_line())
