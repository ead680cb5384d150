"""`python -m ucx_dask_gpu.bench.transfer_profile`: where a worker's CPU goes while it fetches small blocks one after
another (or sits idle), sampled with py-spy from outside the process.

Starts a two-worker LocalCluster (the settings come from $DASK_CONFIG and the environment, as for bench.transfer),
then for --seconds keeps worker B fetching an 8-byte block from worker A, one transfer at a time (or, with --idle,
does nothing), while `py-spy record --idle --format raw` samples worker B's process. Writes the collapsed stacks and
a summary: the share of samples per thread state, and the functions that most samples of B's event-loop thread sit
in (self) or under (inclusive).

py-spy is a development tool, not part of the product's lock: `pip install py-spy`; it needs ptrace rights (root, or
kernel.yama.ptrace_scope=0).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import dask
from distributed import Client, LocalCluster, wait

from .settings import CPU_UCX_SETTINGS
from .transfer_run import make_block, read_block

EVENT_LOOP_THREAD = "main thread"  # a worker process runs its event loop in its main thread
TOP = 15


def thread_of(frames: list[str]) -> str:
    """A stack's thread: threads started by `threading` have Thread._bootstrap at the root, and are named here by the
    innermost function of their first frames that is not threading's own (e.g. `_worker (concurrent/futures/...)`)."""
    if not frames or not frames[0].startswith("Thread._bootstrap "):
        return EVENT_LOOP_THREAD
    for f in frames[1:]:
        if "threading.py" not in f:
            return "thread: " + _function(f)
    return "thread: ?"


def summarise(raw: str, top: int = TOP) -> dict:
    """py-spy's raw (collapsed) output -> samples per thread and the top self / inclusive functions of the main thread.

    A line is `frame;frame;... count`, frames outermost first, each `function (file:line)`."""
    per_thread: Counter = Counter()
    self_time: Counter = Counter()
    inclusive: Counter = Counter()
    main = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = thread_of(frames)
        per_thread[thread] += n
        if thread != EVENT_LOOP_THREAD:
            continue
        main += n
        funcs = [_function(f) for f in frames]
        if funcs:
            self_time[funcs[-1]] += n
        for f in set(funcs):
            inclusive[f] += n
    share = (lambda c: round(100.0 * c / main, 1)) if main else (lambda c: None)
    return {"samples": sum(per_thread.values()), "main_thread_samples": main,
            "threads": dict(per_thread.most_common()),
            "main_self_pct": [[f, share(c)] for f, c in self_time.most_common(top)],
            "main_inclusive_pct": [[f, share(c)] for f, c in inclusive.most_common(top)]}


def _function(frame: str) -> str:
    """`name (path/to/module.py:123)` -> `name (module.py)` (line numbers split one function into many)."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(Path(path).parts[-2:])})" if path else name


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ucx_dask_gpu.bench.transfer_profile",
                                description=__doc__.split("\n")[0])
    p.add_argument("--protocol", default="ucx", choices=("ucx", "tcp"))
    p.add_argument("--seconds", type=float, default=15.0, help="sampling time (default 15)")
    p.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    p.add_argument("--idle", action="store_true", help="sample an idle cluster (connections open, nothing running)")
    p.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too)")
    p.add_argument("--out", required=True, help="directory for <name>.txt (py-spy raw) and <name>.json (summary)")
    p.add_argument("--name", default="profile")
    args = p.parse_args(argv)
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(pyspy).exists():
        print("transfer_profile: py-spy not found (pip install py-spy)", file=sys.stderr)
        return 71
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dask.config.update(dask.config.config, CPU_UCX_SETTINGS, priority="old")
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, protocol=args.protocol, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        a, b = sorted(client.scheduler_info()["workers"])
        pid_b = client.run(os.getpid, workers=[b])[b]
        for i in range(5):  # connections open both ways, like a cluster that has been working
            client.submit(read_block, client.submit(make_block, 8, i, False, workers=[a], pure=False),
                          workers=[b], pure=False).result()
            client.submit(read_block, client.submit(make_block, 8, i, False, workers=[b], pure=False),
                          workers=[a], pure=False).result()
        cmd = [pyspy, "record", "--pid", str(pid_b), "--duration", str(int(args.seconds)), "--rate", str(args.rate),
               "--idle", "--format", "raw", "--output", str(out / f"{args.name}.txt"), "--nonblocking"]
        if args.native:
            cmd.append("--native")
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        transfers = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end and spy.poll() is None:
            if args.idle:
                time.sleep(0.2)
                continue
            fa = client.submit(make_block, 8, transfers, False, workers=[a], pure=False)
            wait(fa)
            client.submit(read_block, fa, workers=[b], pure=False).result()
            transfers += 1
        _, err = spy.communicate(timeout=args.seconds + 60)
        if spy.returncode != 0:
            print(f"transfer_profile: py-spy failed: {err.strip()[-500:]}", file=sys.stderr)
            return 1
        settings = {k: os.environ.get(k) for k in ("UCXPY_PROGRESS_MODE", "UCXPY_ENABLE_PYTHON_FUTURE")}
    summary = dict(summarise((out / f"{args.name}.txt").read_text()), protocol=args.protocol, idle=args.idle,
                   seconds=args.seconds, transfers=transfers, settings=settings,
                   command=" ".join(["python -m ucx_dask_gpu.bench.transfer_profile", *(argv or sys.argv[1:])]))
    (out / f"{args.name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("transfers", "threads", "main_self_pct")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
