"""Numbers from a runner's raw result: wall times, per-pair transfer bandwidth, and where the time went.

Pure functions over plain data (no dask import), so tests can feed them recorded or synthetic logs.
Bandwidths are GB/s = 1e9 bytes/s. Per-transfer bandwidth is distributed's own figure from
`Worker.transfer_incoming_log` (bytes / duration of one get_data message); distributed floors a transfer's duration
at 1 ms, so a 128 MiB message can never show more than 134 GB/s.
"""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable, Sequence

GB = 1e9
MIB = 1 << 20
DEFAULT_IGNORE_BYTES = MIB  # local_cupy's --ignore-size default ("1 MiB")


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default method)."""
    vals = sorted(values)
    if not vals:
        return None
    pos = q * (len(vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return quantile(values, 0.5)


def hmean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v > 0]
    return len(vals) / sum(1 / v for v in vals) if vals else None


def _r(v, digits=4):
    return None if v is None else round(v, digits)


def worker_index(workers: Sequence[str]) -> dict[str, int]:
    return {w: i for i, w in enumerate(workers)}


def p2p(runs: Sequence[dict], workers: Sequence[str], ignore_bytes: int = DEFAULT_IGNORE_BYTES) -> dict:
    """Per ordered worker pair (src -> dst): count, bytes, bandwidth quantiles; and overall figures.

    `runs` are the runner's timed repetitions, each with its `transfers` (src, dst, bytes, duration_s, bandwidth).
    Transfers smaller than `ignore_bytes` are dropped, as local_cupy does.
    """
    index = worker_index(workers)
    by_pair: dict[tuple[int, int], list[dict]] = defaultdict(list)
    kept = []
    dropped = 0
    for run in runs:
        for t in run.get("transfers", []):
            if t["bytes"] < ignore_bytes:
                dropped += 1
                continue
            src, dst = index.get(t["src"], -1), index.get(t["dst"], -1)
            by_pair[(src, dst)].append(t)
            kept.append(t)
    pairs = []
    for (src, dst), ts in sorted(by_pair.items()):
        bws = [t["bandwidth"] / GB for t in ts]
        seconds = sum(t["duration_s"] for t in ts)
        nbytes = sum(t["bytes"] for t in ts)
        pairs.append({
            "src": src, "dst": dst, "transfers": len(ts), "bytes": nbytes,
            "q25_gbps": _r(quantile(bws, 0.25)), "q50_gbps": _r(quantile(bws, 0.5)),
            "q75_gbps": _r(quantile(bws, 0.75)), "min_gbps": _r(min(bws)), "max_gbps": _r(max(bws)),
            "hmean_gbps": _r(hmean(bws)), "seconds": _r(seconds, 6),
            "bytes_per_second_gbps": _r(nbytes / seconds / GB) if seconds > 0 else None,
        })
    all_bws = [t["bandwidth"] / GB for t in kept]
    total_s = sum(t["duration_s"] for t in kept)
    total_b = sum(t["bytes"] for t in kept)
    n_runs = max(1, len(runs))
    return {
        "ignore_bytes": ignore_bytes,
        "workers": list(workers),
        "pairs": pairs,
        "transfers": len(kept),
        "transfers_dropped_small": dropped,
        "bytes": total_b,
        "transfers_per_run": _r(len(kept) / n_runs, 2),
        "bytes_per_run": int(total_b / n_runs),
        "gbps_median": _r(median(all_bws)),
        "gbps_q25": _r(quantile(all_bws, 0.25)),
        "gbps_q75": _r(quantile(all_bws, 0.75)),
        "gbps_weighted": _r(total_b / total_s / GB) if total_s > 0 else None,
    }


def pair_matrix(p2p_stats: dict, field: str = "q50_gbps") -> list[list[float | None]]:
    n = len(p2p_stats["workers"])
    m: list[list[float | None]] = [[None] * n for _ in range(n)]
    for p in p2p_stats["pairs"]:
        if 0 <= p["src"] < n and 0 <= p["dst"] < n:
            m[p["src"]][p["dst"]] = p[field]
    return m


def transfer_table(runs: Sequence[dict], workers: Sequence[str], ignore_bytes: int = 0) -> list[dict]:
    """Every transfer of the timed runs: run, src, dst (worker indices), bytes, start (s after the run started),
    duration and bandwidth: the raw material for 'duration vs bytes' plots."""
    index = worker_index(workers)
    out = []
    for i, run in enumerate(runs):
        for t in run.get("transfers", []):
            if t["bytes"] < ignore_bytes:
                continue
            out.append({"run": i, "src": index.get(t["src"], -1), "dst": index.get(t["dst"], -1),
                        "bytes": t["bytes"], "keys": t.get("keys"),
                        "start_s": _r(t["start"] - run["start"], 6), "duration_s": _r(t["duration_s"], 6),
                        "gbps": _r(t["bandwidth"] / GB)})
    return out


def size_classes(transfers: Iterable[dict]) -> list[dict]:
    """Transfers grouped by size (powers of two): how duration grows with bytes, i.e. fixed cost vs bandwidth."""
    groups: dict[int, list[dict]] = defaultdict(list)
    for t in transfers:
        if t["bytes"] > 0:
            groups[1 << max(0, int(math.log2(t["bytes"])))].append(t)
    rows = []
    for lo, ts in sorted(groups.items()):
        durs = [t["duration_s"] for t in ts]
        rows.append({"bytes_from": lo, "bytes_below": lo * 2, "transfers": len(ts),
                     "median_bytes": int(median([t["bytes"] for t in ts])),
                     "median_duration_s": _r(median(durs), 6), "median_gbps": _r(median([t["gbps"] for t in ts]))})
    return rows


def digest_summary(digests: dict[str, dict[str, float]], runs: int) -> dict:
    """distributed's fine performance metrics over the timed runs, summed over workers, per run.

    {"gather-dep": {"network": s, "deserialize": s, ...},      receiving side of transfers
     "get-data":   {"serialize": s, "network": s, ...},        sending side
     "execute":    {"<task prefix>": {"thread-cpu": s, "thread-noncpu": s, "executor": s, "other": s}},
     "transfer":   {"duration_s": s, "count": n}}
    Seconds are sums over workers (two workers busy for 10 ms each = 20 ms).
    """
    runs = max(1, runs)
    total: dict[str, float] = defaultdict(float)
    for per_worker in digests.values():
        for k, v in per_worker.items():
            total[k] += v
    out: dict = {"gather-dep": {}, "get-data": {}, "execute": {}, "transfer": {}}
    for k, v in sorted(total.items()):
        parts = k.split("|")
        if parts[0] in ("gather-dep", "get-data") and len(parts) == 3 and parts[2] == "seconds":
            out[parts[0]][parts[1]] = _r(v / runs, 6)
        elif parts[0] == "execute" and len(parts) == 4 and parts[3] == "seconds":
            out["execute"].setdefault(parts[1], {})[parts[2]] = _r(v / runs, 6)
        elif k == "transfer-duration":
            out["transfer"]["duration_s"] = _r(v / runs, 6)
    return out


def task_phases(profiled: dict, workers: Sequence[str]) -> dict:
    """From the untimed, profiled repetition's task stream: when tasks ran relative to the submit, and how busy each
    worker was computing vs receiving.

    wall = start_latency (submit, scheduling, first task starts) + active span + end_latency (last task done -> the
    client knows, plus the device sync)."""
    tasks = profiled.get("tasks") or []
    start, stop = profiled.get("start"), profiled.get("stop")
    if not tasks or start is None:
        return {}
    index = worker_index(workers)
    compute: dict[int, float] = defaultdict(float)
    transfer: dict[int, float] = defaultdict(float)
    per_prefix: dict[str, list[float]] = defaultdict(list)
    first, last = math.inf, -math.inf
    for t in tasks:
        w = index.get(t.get("worker"), -1)
        for s in t.get("startstops", []):
            d = (s["stop"] or 0) - (s["start"] or 0)
            if s["action"] == "compute":
                compute[w] += d
                per_prefix[t["prefix"]].append(d)
                first, last = min(first, s["start"]), max(last, s["stop"])
            elif s["action"] == "transfer":
                transfer[w] += d
    if first is math.inf:
        return {}
    return {
        "wall_s": _r(profiled.get("wall_s"), 6),
        "start_latency_s": _r(first - start, 6),
        "active_s": _r(last - first, 6),
        "end_latency_s": _r(stop - last, 6) if stop is not None else None,
        "tasks": len(tasks),
        "compute_s_per_worker": {str(k): _r(v, 6) for k, v in sorted(compute.items())},
        "transfer_s_per_worker": {str(k): _r(v, 6) for k, v in sorted(transfer.items())},
        "compute_by_prefix": {p: {"tasks": len(d), "total_s": _r(sum(d), 6), "median_s": _r(median(d), 6)}
                              for p, d in sorted(per_prefix.items())},
    }


def compact_tasks(profiled: dict, workers: Sequence[str]) -> list[list]:
    """The profiled repetition's task stream, compact: [prefix, worker, action, start_s, stop_s, source]."""
    index = worker_index(workers)
    start = profiled.get("start") or 0.0
    rows = []
    for t in profiled.get("tasks") or []:
        for s in t.get("startstops", []):
            rows.append([t["prefix"], index.get(t.get("worker"), -1), s["action"], _r(s["start"] - start, 6),
                         _r(s["stop"] - start, 6), index.get(s.get("source"), None) if s.get("source") else None])
    return sorted(rows, key=lambda r: (r[3], r[1]))
