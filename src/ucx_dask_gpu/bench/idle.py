"""Idle CPU of a cluster's processes: the share of one core each process used over a window in which nothing was
submitted. A Dask process whose UCX requests are polled runs at ~100 % of a core (or all the share a loaded host
gives it); one that waits on UCX's events, at a few percent (heartbeats, the event loop's tick)."""
from __future__ import annotations

import time
from collections.abc import Mapping

import psutil


def with_children(pids: Mapping[str, int]) -> dict[str, int]:
    """Each named process and its descendants (a nanny's worker process, a launcher's children), as `name/child-N`."""
    out = dict(pids)
    for name, pid in pids.items():
        try:
            children = psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        for i, child in enumerate(sorted(children, key=lambda c: c.pid)):
            out[f"{name}/child-{i}"] = child.pid
    return out


def _cpu_seconds(process: psutil.Process) -> float | None:
    try:
        t = process.cpu_times()
    except psutil.NoSuchProcess:
        return None
    return t.user + t.system


def idle_shares(pids: Mapping[str, int], seconds: float) -> dict[str, float | None]:
    """{name: CPU seconds used per wall second over `seconds`} for each process (None: it went away meanwhile)."""
    processes = {name: psutil.Process(pid) for name, pid in pids.items()}
    before = {name: _cpu_seconds(p) for name, p in processes.items()}
    start = time.monotonic()
    time.sleep(seconds)
    after = {name: _cpu_seconds(p) for name, p in processes.items()}
    wall = time.monotonic() - start
    return {name: None if before[name] is None or after[name] is None else (after[name] - before[name]) / wall
            for name in processes}
