"""`ucx-dask-gpu bench idle` (also `python -m ucx_dask_gpu.bench.idle`): the CPU each process of an idle cluster uses,
the cluster started with the launchers users run — `dask scheduler`, `dask cuda worker` (GPU: each worker on the GPU
it is given; `--shared-gpu I` puts them all on GPU I) or `dask worker` (`--cpu`: UCX over TCP), and a client process
holding a connected Client — one cluster per variant (bench/config.py variants: protocol, dask config, environment),
nothing submitted.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import textwrap
import time
from collections.abc import Mapping
from pathlib import Path

from ..cliutil import Parser, Progress, add_output, run_parsed
from ..errors import BENCH_FAILED, USAGE, UserError
from ..proof.launchers import DaskProcess, launch_cluster, stop_processes
from ..report import command_line, write_report
from . import config, provenance, render, stats

SCHEMA_VERSION = 1
say = Progress("bench idle: ")

# A client connected and doing nothing: what a notebook holding a Client is between computations.
# It says so through a file: UCX writes its own warnings to stdout.
IDLE_CLIENT = textwrap.dedent("""
    import pathlib, sys, time
    from distributed import Client
    with Client(scheduler_file=sys.argv[1], timeout=60) as c:
        c.wait_for_workers(int(sys.argv[2]), timeout=120)
        pathlib.Path(sys.argv[3]).write_text("ready")
        time.sleep(24 * 3600)
""")


# --- measuring ------------------------------------------------------------------------------------------------------

def _child_kind(process) -> str:
    """What a launcher's child is, from its command line (a nanny's worker process is multiprocessing's spawn)."""
    import psutil  # distributed's dependency: imported where processes are measured (the CLI starts without it)

    try:
        cmdline = " ".join(process.cmdline())
    except psutil.Error:
        return "child"
    for marker, kind in (("resource_tracker", "resource-tracker"), ("forkserver", "forkserver"),
                         ("spawn_main", "worker-process")):
        if marker in cmdline:
            return kind
    return "child"


def with_children(pids: Mapping[str, int]) -> dict[str, int]:
    """Each named process and its descendants (a nanny's worker process, multiprocessing's resource tracker), as
    `name/KIND[-N]`."""
    import psutil

    out = dict(pids)
    for name, pid in pids.items():
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for child in sorted(children, key=lambda c: c.pid):
            label, n = f"{name}/{_child_kind(child)}", 1
            while label in out:
                n += 1
                label = f"{name}/{_child_kind(child)}-{n}"
            out[label] = child.pid
    return out


def _cpu_seconds(process) -> float | None:
    import psutil

    try:
        t = process.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


def idle_shares(pids: Mapping[str, int], seconds: float) -> dict[str, float | None]:
    """{name: CPU seconds used per wall second over `seconds`} for each process (None: it went away meanwhile)."""
    import psutil

    processes = {name: psutil.Process(pid) for name, pid in pids.items()}
    before = {name: _cpu_seconds(p) for name, p in processes.items()}
    start = time.monotonic()
    time.sleep(seconds)
    after = {name: _cpu_seconds(p) for name, p in processes.items()}
    wall = time.monotonic() - start
    return {name: None if before[name] is None or after[name] is None else (after[name] - before[name]) / wall
            for name in processes}


# --- the clusters ---------------------------------------------------------------------------------------------------

class Launched:
    """One variant's cluster as its launchers start it: scheduler, workers, an idle client; every process in a
    session of its own, so that stopping it leaves nothing behind."""

    def __init__(self, variant: config.Variant, gpus: list[str] | None, workers: int, tmp: Path, python: str):
        self.variant, self.workers, self.python = variant, workers, python
        self.dir = tmp / variant.name.replace("/", "-")
        self.env = config.variant_env(self.dir / "dask-config", variant.tree, variant.env, variant.unset)
        envs = [{**self.env, "CUDA_VISIBLE_DEVICES": gpus[i % len(gpus)]} if gpus else self.env
                for i in range(workers)]
        self.procs = launch_cluster(python, self.env, envs, self.dir, protocol=variant.protocol, cuda=bool(gpus))
        self.sched_file = self.procs["scheduler"].scheduler_file

    def connect_client(self, timeout: float) -> None:
        """Once the scheduler is up, the idle client; returns when it sees every worker."""
        deadline = time.monotonic() + timeout
        try:
            self.procs["scheduler"].address(timeout)
        except (ChildProcessError, TimeoutError) as e:
            self.say_logs()
            raise UserError(f"{self.variant.name}: {str(e).splitlines()[0]}", BENCH_FAILED) from None
        ready = self.dir / "client.ready"
        self.procs["client"] = DaskProcess([self.python, "-c", IDLE_CLIENT, str(self.sched_file), str(self.workers),
                                            str(ready)], self.env, self.dir / "client.log")
        while not ready.exists():
            self._check_alive()
            if time.monotonic() > deadline:
                self.say_logs()
                raise UserError(f"{self.variant.name}: the client did not see {self.workers} workers within "
                                f"{timeout:.0f} s (its log and the cluster's above)", BENCH_FAILED)
            time.sleep(0.2)

    def _check_alive(self) -> None:
        dead = [n for n, p in self.procs.items() if p.popen.poll() is not None]
        if dead:
            self.say_logs()
            raise UserError(f"{self.variant.name}: {', '.join(dead)} exited (logs above)", BENCH_FAILED)

    def say_logs(self, lines: int = 15) -> None:
        """The last lines of every process's log, as progress lines: the cluster's directory goes with the run."""
        for name, proc in self.procs.items():
            for ln in proc.text().splitlines()[-lines:]:
                say(f"{self.variant.name} {name}: {ln}")

    def pids(self) -> dict[str, int]:
        self._check_alive()
        return with_children({n: p.popen.pid for n, p in self.procs.items()})

    def stop(self) -> None:
        """Clients and workers first, then the scheduler: SIGTERM to each process group, SIGKILL after 30 s."""
        stop_processes([p.popen for n, p in self.procs.items() if n != "scheduler"], 30)
        stop_processes([self.procs["scheduler"].popen], 30)


# --- the study ------------------------------------------------------------------------------------------------------

def measure(clusters: list[Launched], windows: int, window_s: float) -> dict[str, dict[str, list[float]]]:
    """{variant: {process: [share per window]}}, the clusters taking turns (ABC CBA ...)."""
    shares: dict[str, dict[str, list[float]]] = {c.variant.name: {} for c in clusters}
    for r in range(windows):
        for c in stats.round_order(clusters, r):
            for name, share in idle_shares(c.pids(), window_s).items():
                if share is not None:
                    shares[c.variant.name].setdefault(name, []).append(round(share, 5))
    return shares


def payload_of(args, clusters: list[Launched], shares: dict, command: str) -> dict:
    runs = []
    for c in clusters:
        v = c.variant
        procs = {n: {"shares": s, "median": stats.median(s), "max": max(s)} for n, s in shares[v.name].items()}
        runs.append({**v.report(), "processes": procs,
                     "busiest_median": max((p["median"] for p in procs.values()), default=None),
                     "progress_lines": [ln.strip() for p in c.procs.values() for ln in p.text().splitlines()
                                        if "UCXX progress" in ln]})
    return {"schema_version": SCHEMA_VERSION, "study": "idle", "mode": "cpu" if args.cpu else "gpu",
            "gpus": args.gpus, "workers": args.workers,
            "measurement": {"settle_s": args.settle, "windows": args.windows, "window_s": args.window,
                            "interleaving": "every round measures each cluster once; forwards on even rounds, "
                                            "backwards on odd",
                            "launchers": "dask scheduler; " + ("dask worker" if args.cpu else "dask cuda worker")
                                         + "; a client process holding a connected Client"},
            "runs": runs, "provenance": provenance.collect(command, None if args.cpu else
                                                           sorted({int(g) for g in args.gpus}))}


def markdown(p: dict) -> str:
    m = p["measurement"]
    md = [*render.header(p, f"idle: {p['mode']}, {p['workers']} workers"
                           + (f" on GPU {','.join(p['gpus'])}" if p["gpus"] else "")),
          f"Launchers: {m['launchers']}. After {m['settle_s']} s, {m['windows']} windows of {m['window_s']} s per "
          f"cluster, interleaved; share of one core per process: the median over the windows and the largest.", "",
          "| variant | process | median % of a core | max % |", "|---|---|---|---|"]
    for r in p["runs"]:
        for name, s in r["processes"].items():
            md.append(f"| {r['name']} | {name} | {100 * s['median']:.1f} | {100 * s['max']:.1f} |")
    for r in p["runs"]:
        if r["progress_lines"]:
            md += ["", f"{r['name']}, each role's start-up line:", ""] + [f"- `{ln}`" for ln in r["progress_lines"]]
    return "\n".join(md) + "\n"


def run(args, command: str) -> int:
    """The study; `command` is the command line that runs it again."""
    if args.cpu == bool(args.gpus):
        raise UserError("give --cpu or --gpus/--shared-gpu", USAGE)
    if args.workers < 1 or args.windows < 1 or args.window <= 0 or args.settle < 0:
        raise UserError("--workers and --windows must be >= 1, --window > 0, --settle >= 0", USAGE)
    variants = config.parse_variants(args.variant or ["ucx@shipped:shipped"], ["ucx"], args.cpu)
    clusters: list[Launched] = []
    with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-idle-") as tmp:
        try:
            for v in variants:
                say(f"starting {v.name}")
                clusters.append(Launched(v, args.gpus, args.workers, Path(tmp), args.python))
            for c in clusters:
                c.connect_client(args.start_timeout)
            say(f"{len(clusters)} clusters idle; measuring after {args.settle} s")
            time.sleep(args.settle)
            shares = measure(clusters, args.windows, args.window)
            payload = payload_of(args, clusters, shares, command)
        finally:
            for c in clusters:
                c.stop()
    for r in payload["runs"]:
        print(f"{r['name']}: busiest process {100 * r['busiest_median']:.1f} % of a core (median); "
              + ", ".join(f"{n} {100 * s['median']:.1f}" for n, s in r["processes"].items()))
    if args.out is not None:
        written = write_report(args.out, "idle", payload, markdown(payload), command=command)
        say("wrote " + ", ".join(str(w) for w in written))
    if args.json:
        print(json.dumps(payload))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("idle", help="CPU each process of an idle cluster uses (real launchers, per variant)",
                       description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cpu", action="store_true", help="dask worker, numpy, UCX over TCP")
    where.add_argument("--gpus", type=lambda s: [g.strip() for g in s.split(",") if g.strip()],
                       help="dask cuda worker i on GPU gpus[i %% len]: e.g. 0,1")
    where.add_argument("--shared-gpu", dest="gpus", type=lambda s: [s.strip()], help="every worker on this GPU")
    p.add_argument("--variant", action="append", help="[PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...] (docs/benchmarks.md);"
                                                      " default ucx@shipped:shipped")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--settle", type=float, default=10.0, help="seconds idle before measuring (default 10)")
    p.add_argument("--windows", type=int, default=15, help="windows per cluster (default 15)")
    p.add_argument("--window", type=float, default=1.0, help="seconds per window (default 1)")
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--python", default=sys.executable, help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help="print the result as one JSON line")
    add_output(p, "--out", kind="dir", help="write idle.json, idle.md and command.txt into this directory")
    p.set_defaults(func=lambda args: run(args, command_line()))


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m ucx_dask_gpu.bench.idle", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    register(sub)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(["idle", *argv])
    args.func = lambda a: run(a, shlex.join(["python", "-m", "ucx_dask_gpu.bench.idle", *argv]))
    return run_parsed(args, "ucx-dask-gpu bench idle")


if __name__ == "__main__":
    sys.exit(main())
