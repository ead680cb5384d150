"""Numbers from measurements: quantiles, the ratio of medians against a baseline with a seeded bootstrap interval and
its verdict, the order variants take turns in, per-pair transfer bandwidth, bytes moved.

Pure Python over plain data (no dask, no numpy): tests feed it synthetic samples. Times are seconds; bandwidths GB/s
(1e9 bytes/s).
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Sequence

GB = 1e9
RESAMPLES = 2000
LEVEL = 0.95
BYTES_TOLERANCE = 0.01  # variants whose median bytes moved per repetition differ by more are flagged
SAME_WORK = 0.05  # beyond this difference in median bytes moved per repetition two variants did other work: no ratio
SAME_WORK_FLOOR = 64 << 10  # ... unless both moved next to nothing (a steady-state repeat's few hundred bytes)


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


def _r(v, digits=6):
    return None if v is None else round(v, digits)


def to_ms(seconds, digits=3):
    return None if seconds is None else round(seconds * 1e3, digits)


def summary(values: Sequence[float]) -> dict:
    return {"n": len(values), "median": _r(median(values)), "q25": _r(quantile(values, 0.25)),
            "q75": _r(quantile(values, 0.75)), "min": _r(min(values, default=None)),
            "max": _r(max(values, default=None))}


def verdict(lo: float, hi: float) -> str:
    """Of a ratio of times (variant / baseline): 'faster' when the whole interval is below 1.0, 'slower' when it is
    above, else 'noise' (no effect at this level)."""
    return "faster" if hi < 1.0 else "slower" if lo > 1.0 else "noise"


def same_work(moved: Sequence[int], baseline_moved: Sequence[int], tolerance: float = SAME_WORK) -> bool:
    """Whether two variants moved the same bytes between workers per repetition (medians within `tolerance`, or
both within SAME_WORK_FLOOR of each other): only then does a ratio of their times compare the same work."""
    a, b = median(moved), median(baseline_moved)
    if a is None or b is None:
        return a is None and b is None
    return abs(a - b) <= max(tolerance * max(a, b), SAME_WORK_FLOOR)


def different_work(moved: Sequence[int], baseline_moved: Sequence[int]) -> dict:
    """What stands where a ratio would: the variants moved other amounts of data, so their times are not compared."""
    return {"median": None, "ci95": None, "verdict": "different work",
            "bytes_moved_median": median(moved), "baseline_bytes_moved_median": median(baseline_moved)}


def bootstrap_ratio(samples: Sequence[float], baseline: Sequence[float], resamples: int = RESAMPLES, seed: int = 0,
                    level: float = LEVEL) -> dict | None:
    """median(samples) / median(baseline) with a percentile bootstrap interval: both groups resampled with
    replacement, independently, `resamples` times, from a seeded generator (the same data give the same interval)."""
    if not samples or not baseline or not median(baseline):
        return None
    rng = random.Random(seed)
    n, m = len(samples), len(baseline)
    ratios = []
    for _ in range(resamples):
        b = median([baseline[rng.randrange(m)] for _ in range(m)])
        a = median([samples[rng.randrange(n)] for _ in range(n)])
        ratios.append(a / b if b else math.inf)
    tail = (1.0 - level) / 2
    lo, hi = quantile(ratios, tail), quantile(ratios, 1.0 - tail)
    return {"median": _r(median(samples) / median(baseline), 4), "ci95": [_r(lo, 4), _r(hi, 4)],
            "verdict": verdict(lo, hi), "n": n, "n_baseline": m, "resamples": resamples, "seed": seed}


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """Variants take turns within every round, forwards on even rounds and backwards on odd ones (ABC CBA ABC ...):
    a drift of the machine hits every variant alike and no variant always runs right after the same other one."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def p2p(transfers: Sequence[dict], workers: Sequence[str], repetitions: int, ignore_bytes: int) -> dict:
    """Per ordered worker pair: quartiles of per-transfer bandwidth (bytes / distributed's duration, as local_cupy
    reads it); overall median and the transfers per repetition. Transfers below `ignore_bytes` are left out."""
    index = {w: i for i, w in enumerate(workers)}
    by_pair: dict[tuple[int, int], list[float]] = defaultdict(list)
    for t in transfers:
        if t["bytes"] >= ignore_bytes and t["duration"] > 0:
            by_pair[(index.get(t["src"], -1), index.get(t["dst"], -1))].append(t["bytes"] / t["duration"] / GB)
    pairs = [{"src": s, "dst": d, "transfers": len(v), "q25_gbps": _r(quantile(v, 0.25), 3),
              "q50_gbps": _r(median(v), 3), "q75_gbps": _r(quantile(v, 0.75), 3)}
             for (s, d), v in sorted(by_pair.items())]
    every = [g for v in by_pair.values() for g in v]
    return {"ignore_bytes": ignore_bytes, "pairs": pairs, "gbps_median": _r(median(every), 3),
            "transfers_per_repetition": _r(len(every) / max(1, repetitions), 2)}


def bytes_moved_notes(per_variant: dict[str, Sequence[int]], baseline: str,
                      tolerance: float = BYTES_TOLERANCE) -> list[str]:
    """Variants whose median bytes moved per repetition differ from the baseline's: they did not run the same work."""
    medians = {k: median(v) for k, v in per_variant.items() if v}
    ref = medians.get(baseline)
    notes = [f"{name} moved {m / 1e6:.1f} MB per repetition (median), the baseline {baseline} {ref / 1e6:.1f} MB: "
             "its ratio compares different work" for name, m in medians.items()
             if ref is not None and name != baseline and abs(m - ref) > tolerance * max(ref, 1)]
    spread = [f"{k} {min(v) / 1e6:.1f}-{max(v) / 1e6:.1f}" for k, v in per_variant.items()
              if v and max(v) - min(v) > tolerance * max(max(v), 1)]
    if spread:
        notes.append(f"bytes moved varied between repetitions ({', '.join(spread)} MB): the scheduler ran some "
                     "tasks whose inputs live on different workers on one worker or the other")
    return notes
