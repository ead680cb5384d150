"""What the critical-path settings change on a CPU host (scheduling only; no GPU), variants interleaved in ONE cluster.

    python benchmarks/fastpath_cpu.py [--study batched-send|split-every|all] [--reps 20] [--inner 15]
                                      [--scheduler ADDR | --in-process] [--json FILE]

- batched-send: distributed's BatchedSend intervals (client 10 ms, scheduler->worker 5 ms, scheduler->client and
  worker 2 ms) against the shipped `ucx-dask-gpu.batched-send.*` values and 0, set at run time on every role's
  streams (gate/tuning.set_intervals) so that the variants run ABCABC... in one cluster. Per repetition: the median
  of `--inner` round trips of (a) submit -> result of a trivial task, back to back; (b) submit -> result of a task on
  worker A reading a fresh 8-byte block from worker B.
- split-every: `(x + x.T).sum()` over 5x5 and 10x10 blocks (64x64 float64 each: the block grids of 20000^2 and
  40000^2 in 4096^2 chunks, without their bytes), dask's default split_every (4) against 100, set per repetition
  in the client (split_every is read where the graph is built).
Effects: ratio of medians (variant / baseline) with a bootstrap 95 % interval over the repetitions. A LocalCluster over
TCP (2 worker processes, 1 thread each; --in-process: in this process) unless --scheduler names a running one. The
first repetition of each study is a warm-up and is not counted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client, LocalCluster, wait

from ucx_dask_gpu.gate import tuning

DISTRIBUTED = {"client-interval": 0.010, "scheduler-interval": 0.005, "scheduler-client-interval": 0.002,
               "worker-interval": 0.002}


def ratio_ci(variant: list[float], base: list[float], n: int = 4000, seed: int = 0) -> tuple[float, float, float]:
    """median(variant) / median(base) and its bootstrap 95 % interval (both samples resampled)."""
    rng = np.random.default_rng(seed)
    v, b = np.asarray(variant), np.asarray(base)
    boots = np.median(rng.choice(v, (n, v.size)), axis=1) / np.median(rng.choice(b, (n, b.size)), axis=1)
    return float(np.median(v) / np.median(b)), float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))


def interleave(variants: dict, reps: int, measure) -> dict[str, list[float]]:
    """variants: name -> set-up callable; measure() -> seconds. ABCABC..., the first round a warm-up."""
    out = {name: [] for name in variants}
    for rep in range(reps + 1):
        for name, setup in variants.items():
            setup()
            value = measure()
            if rep:
                out[name].append(value)
    return out


def set_everywhere(client: Client, seconds: dict[str, float]) -> None:
    client.run_on_scheduler(tuning.set_intervals, seconds)
    client.run(tuning.set_intervals, seconds)
    tuning.set_intervals(seconds, client=client)


def _inc(i):
    return i + 1


def _block(i):
    return np.int64(i)


def _read(x):
    return int(x) + 1


def round_trips(client: Client, inner: int, kind: str) -> float:
    a, b = sorted(client.scheduler_info(n_workers=-1)["workers"])[:2]
    times = []
    for i in range(inner):
        if kind == "trivial":
            t0 = time.perf_counter()
            client.submit(_inc, i, pure=False).result()
        else:
            x = client.submit(_block, i, workers=[b], pure=False)
            wait(x)
            t0 = time.perf_counter()
            client.submit(_read, x, workers=[a], pure=False).result()
            del x
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def study_batched_send(client: Client, reps: int, inner: int) -> list[dict]:
    with dask.config.set({f"{tuning.PREFIX}.{k}": v for k, v in tuning_values().items()}):
        shipped = {k: tuning.interval(k) for k in tuning.INTERVALS}
    variants = {"distributed": DISTRIBUTED, f"shipped ({shipped['client-interval'] * 1e3:g} ms)": shipped,
                "0 ms": dict.fromkeys(DISTRIBUTED, 0.0)}
    rows = []
    for kind in ("trivial", "8B-dependency"):
        got = interleave({n: (lambda s=s: set_everywhere(client, s)) for n, s in variants.items()}, reps,
                         lambda: round_trips(client, inner, kind))
        rows += summarise(f"submit->result, {kind}", got, "distributed")
    set_everywhere(client, DISTRIBUTED)
    return rows


def tuning_values() -> dict:
    """The intervals the shipped tuned-gpu.yaml sets."""
    from ucx_dask_gpu.gate.daskconfig import shipped_settings

    return {k.rsplit(".", 1)[1]: v for k, v in shipped_settings().items() if k.startswith(tuning.PREFIX + ".")}


def study_split_every(client: Client, reps: int) -> list[dict]:
    rows = []
    for blocks in (5, 10):
        x = da.random.random((64 * blocks, 64 * blocks), chunks=64).persist()
        wait(x)

        def run(split_every):
            with dask.config.set(split_every=split_every):
                expr = (x + x.T).sum()
            t0 = time.perf_counter()
            expr.compute()
            return time.perf_counter() - t0

        current = {}
        got = interleave({"4 (dask)": lambda: current.update(v=4), "100": lambda: current.update(v=100)}, reps,
                         lambda: run(current["v"]))
        rows += summarise(f"(x + x.T).sum(), {blocks}x{blocks} blocks", got, "4 (dask)")
        del x
    return rows


def summarise(what: str, got: dict[str, list[float]], base: str) -> list[dict]:
    rows = []
    for name, values in got.items():
        ratio, low, high = ratio_ci(values, got[base]) if name != base else (1.0, 1.0, 1.0)
        rows.append({"what": what, "variant": name, "n": len(values), "median_ms": statistics.median(values) * 1e3,
                     "ratio": ratio, "ci95": [low, high], "values_ms": [v * 1e3 for v in values]})
    return rows


def render(rows: list[dict]) -> str:
    lines = [f"{'measurement':<42} {'variant':<18} {'n':>3} {'median ms':>10}  ratio [95 % CI]"]
    for r in rows:
        lines.append(f"{r['what']:<42} {r['variant']:<18} {r['n']:>3} {r['median_ms']:>10.2f}  "
                     f"{r['ratio']:.3f} [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--study", choices=["batched-send", "split-every", "all"], default="all")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions per variant (default 20)")
    p.add_argument("--inner", type=int, default=15, help="round trips per repetition (batched-send; default 15)")
    p.add_argument("--scheduler", help="a running scheduler (default: a LocalCluster over TCP, 2 workers)")
    p.add_argument("--in-process", action="store_true",
                   help="the LocalCluster's workers in this process (threads, still over TCP): no other process to "
                        "wait for on a busy host")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    cluster = None if args.scheduler else LocalCluster(protocol="tcp", n_workers=2, threads_per_worker=1,
                                                       processes=not args.in_process, dashboard_address=":0")
    rows = []
    with Client(args.scheduler or cluster) as client:
        client.wait_for_workers(2)
        if args.study in ("batched-send", "all"):
            rows += study_batched_send(client, args.reps, args.inner)
        if args.study in ("split-every", "all"):
            rows += study_split_every(client, args.reps)
    if cluster is not None:
        cluster.close()
    print(render(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
