"""The timed part of a run: the variants take turns, round after round (stats.round_order: forwards on even rounds,
backwards on odd), one repetition each per round with the same input seed, `--warmup` untimed rounds first, then timed
rounds while `--budget` holds what every round, local_cupy's chunks among them and closing the clusters need.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..cliutil import Progress
from . import stats
from .hosts import Host
from .options import MIN_RUNS, Options

CLOSE_RESERVE_S = 45.0       # closing the clusters and writing the report, kept out of the rounds' budget


class Budget:
    """What is left of --budget."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)


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
              progress: Progress) -> float:
    """Each active variant's repetition of round `index` (a warm-up one where `warm`); returns the round's seconds."""
    start, seed = time.monotonic(), opts.seed * 1_000_000 + (index if warm else opts.warmup + index) * 1000
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
    return time.monotonic() - start


def run_rounds(records: dict[str, Record], opts: Options, budget: Budget, progress: Progress,
               beside: Sequence = ()) -> list[str]:
    """Warm-up rounds, then timed rounds while the budget lasts, local_cupy's chunks among them (reference.Beside).
    The first MIN_RUNS rounds keep time only for closing the clusters (a chunk among them runs where it leaves them
    theirs); a later one also for the local_cupy runs it would owe (a chunk that does not fit is skipped, said so)."""
    notes, longest, done = [], 0.0, 0
    for i in range(opts.warmup):
        longest = max(longest, one_round(records, i, True, opts, budget, progress))
    for i in range(opts.runs):
        need = longest + CLOSE_RESERVE_S + (sum(b.owed_seconds(records, i + 1) for b in beside) if i >= MIN_RUNS
                                            else 0.0)
        if budget.left() < need:
            notes.append(f"budget: stopped after {i} of {opts.runs} timed rounds ({budget.left():.0f} s left, the "
                         f"next round and what follows it need ~{need:.0f} s)")
            progress(notes[-1])
            break
        if not any(r.active for r in records.values()):
            break
        longest = max(longest, one_round(records, i, False, opts, budget, progress))
        done = i + 1
        for b in beside:
            b.after_round(done, records, budget, progress, longest * max(0, min(MIN_RUNS, opts.runs) - done))
    for b in beside:  # chunks whose turn did not come
        b.after_round(done, records, budget, progress, final=True)
    return notes
