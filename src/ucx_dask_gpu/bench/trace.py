"""Where one worker-to-worker transfer's time goes (`bench transfer --trace N`): timestamps of every step, taken inside
the two worker processes, in untimed rounds after the timed ones (a wrapper costs about a microsecond per call).

`install` (run on each worker) wraps, in that process only, each step of the transfer path: the worker's side
(gather_dep, get_data, execute, stimuli, connect), the comms' read / write and framing, and UCXX's sends, receives,
buffer allocations and device syncs, each timed by perf_counter: CLOCK_MONOTONIC on Linux, one clock for every
process of a host and the client. `phase_table` turns each traced transfer's events into milestones along its causal
chain (SEGMENTS). distributed is imported where a worker installs the tracer: the CLI imports this module without it.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from collections import deque
from typing import Sequence

from .stats import median, quantile, to_ms

EVENTS: deque = deque(maxlen=200_000)
EP_OWNER: dict[int, int] = {}  # UCXX endpoint id -> the comm that uses it
_clock = time.perf_counter

SEGMENTS = (
    ("submit", "B.compute_task", "client -> scheduler -> B (compute-task)"),
    ("B.compute_task", "B.gather.b", "B: state machine schedules gather_dep"),
    ("B.gather.b", "B.write_req.b", "B: connection from the pool"),
    ("B.write_req.b", "B.req_frames.e", "B: serialise request"),
    ("B.req_frames.e", "A.read_req.e", "request: send + wire + A wakes, receives, deserialises"),
    ("A.read_req.e", "A.get_data.b", "A: dispatch to get_data"),
    ("A.get_data.b", "A.write_resp.b", "A: get_data before writing"),
    ("A.write_resp.b", "A.to_frames.e", "A: serialise response"),
    ("A.to_frames.e", "B.resp_first.e", "response header: send + wire + B wakes"),
    ("B.resp_first.e", "B.from_frames.b", "B: receive the frames (buffers, data)"),
    ("A.to_frames.e", "B.from_frames.b", "response: send + wire + receive (TCP: no finer split)"),
    ("B.from_frames.b", "B.from_frames.e", "B: deserialise response"),
    ("B.from_frames.e", "B.write_ok.e", "B: write 'OK'"),
    ("B.write_ok.e", "B.gather.e", "B: gather_dep epilogue"),
    ("B.gather.e", "B.execute.b", "B: state machine -> execute"),
    ("B.execute.b", "B.execute.e", "B: the task"),
    ("B.execute.e", "result", "B -> scheduler -> client (result)"),
)


# --- in the worker processes ----------------------------------------------------------------------------------------

def record(name: str, edge: str, ident: int = 0, size: int = -1) -> None:
    EVENTS.append((_clock(), name, edge, ident, size))


def wrap(fn, name: str, ident=None, size=None):
    """`fn` (a coroutine function or a plain one) with a begin and an end event around each call."""
    import inspect

    @contextlib.contextmanager
    def span(args, kwargs):
        i = ident(args, kwargs) if ident else 0
        record(name, "b", i, size(args, kwargs) if size else -1)
        try:
            yield
        finally:
            record(name, "e", i)

    async def traced_async(*args, **kwargs):
        with span(args, kwargs):
            return await fn(*args, **kwargs)

    def traced(*args, **kwargs):
        with span(args, kwargs):
            return fn(*args, **kwargs)

    out = functools.wraps(fn)(traced_async if inspect.iscoroutinefunction(fn) else traced)
    out.__traced__ = True
    return out


def _patch(owner, attr: str, name: str, ident=None, size=None) -> None:
    fn = getattr(owner, attr, None)
    if fn is not None and not getattr(fn, "__traced__", False):
        setattr(owner, attr, wrap(fn, name, ident, size))


def _comm(args, kwargs):
    comm = args[0] if args else kwargs.get("comm")
    if getattr(comm, "_ep", None) is not None:
        EP_OWNER[id(comm._ep)] = id(comm)
    return id(comm)


def _first(args, kwargs):
    return id(args[0]) if args else 0


def _patch_comm(module, comm) -> None:
    """A comm class's read and write, and its module's framing."""
    for attr in ("read", "write"):
        _patch(comm, attr, f"comm.{attr}", _comm)
    for name in ("to_frames", "from_frames"):
        _patch(module, name, name)


def install_comms() -> None:
    """Wrap this process's comm layer (once; the UCXX receive allocator as soon as UCXX has chosen it)."""
    import distributed.comm.tcp as tcp

    _patch_comm(tcp, tcp.TCP)
    try:
        import distributed_ucxx.ucxx as ux
        from ucxx._lib_async.endpoint import Endpoint
    except ImportError:
        return
    _patch_comm(ux, ux.UCXX)
    _patch(ux, "host_array", "alloc.host", size=lambda a, k: int(a[0]) if a else -1)
    _patch(ux, "synchronize_stream", "cuda.sync")
    if getattr(ux, "device_array", None) is not None:
        _patch(ux, "device_array", "alloc.device", size=lambda a, k: int(a[0]) if a else -1)
    for attr in ("send", "recv", "send_multi", "recv_multi"):
        _patch(Endpoint, attr, f"ep.{attr}", _first)


def install(dask_worker=None) -> None:
    """Run on each worker: its comm layer and this worker's own transfer path (instance attributes only)."""
    install_comms()
    if getattr(dask_worker, "_ucx_dask_gpu_traced", False):
        return
    for attr in ("gather_dep", "execute"):
        setattr(dask_worker, attr, wrap(getattr(dask_worker, attr), attr))
    dask_worker.handlers["get_data"] = wrap(dask_worker.handlers["get_data"], "get_data", _comm)
    stimulus, connect = dask_worker.handle_stimulus, dask_worker.rpc.connect

    def traced_stimulus(*stims):
        EVENTS.extend((_clock(), "stimulus:" + type(s).__name__, "i", 0, -1) for s in stims)
        return stimulus(*stims)

    async def traced_connect(addr, *args, **kwargs):
        record("connect", "b")
        comm = await connect(addr, *args, **kwargs)
        record("connect", "e", id(comm))
        return comm

    dask_worker.handle_stimulus, dask_worker.rpc.connect = traced_stimulus, traced_connect
    dask_worker._ucx_dask_gpu_traced = True


def pop_events(dask_worker=None) -> dict:
    install_comms()  # UCXX picks its device allocator when it first runs
    out = list(EVENTS)
    EVENTS.clear()
    return {"events": out, "ep_owner": dict(EP_OWNER)}


# --- the analysis ---------------------------------------------------------------------------------------------------

class Stream:
    """One process's events in time order, with 'the first / last event like this' lookups."""

    def __init__(self, side: dict):
        self.ev = sorted((float(e[0]), str(e[1]), str(e[2]), int(e[3])) for e in side.get("events", []))
        self.ep_owner = {int(k): int(v) for k, v in (side.get("ep_owner") or {}).items()}

    def first(self, name, edge, after=-math.inf, before=math.inf, ident=None, idents=None):
        return next((e for e in self.ev if after <= e[0] <= before and e[1] == name and e[2] == edge
                     and (ident is None or e[3] == ident) and (idents is None or e[3] in idents)), None)

    def last(self, name, edge, before, ident=None):
        hits = [e for e in self.ev if e[0] <= before and e[1] == name and e[2] == edge
                and (ident is None or e[3] == ident)]
        return hits[-1] if hits else None


def _put(m: dict, name: str, event):
    if event is not None:
        m[name] = event[0]
    return event


def milestones(sample: dict) -> dict[str, float]:
    """Milestone -> time for one traced transfer (those not found are left out)."""
    a, b = Stream(sample["events"]["A"]), Stream(sample["events"]["B"])
    m = {"submit": sample["submit"], "result": sample["result"]}
    g0 = _put(m, "B.gather.b", b.first("gather_dep", "b"))
    if g0 is None:
        return m
    _put(m, "B.compute_task", b.last("stimulus:ComputeTaskEvent", "i", g0[0]))
    g1 = _put(m, "B.gather.e", b.first("gather_dep", "e", g0[0]))
    if g1 and _put(m, "B.execute.b", b.first("execute", "b", g1[0])):
        _put(m, "B.execute.e", b.first("execute", "e", m["B.execute.b"]))
    conn = b.first("connect", "e", g0[0])
    wr0 = b.first("comm.write", "b", conn[0], ident=conn[3]) if conn else None
    wr1 = b.first("comm.write", "e", wr0[0], ident=conn[3]) if wr0 else None
    if not wr1:
        return m
    m["B.write_req.b"], cb = wr0[0], conn[3]  # the request, the response and "OK" travel on B's comm cb
    _put(m, "B.req_frames.e", b.first("to_frames", "e", wr0[0], wr1[0]))
    rd1 = b.first("comm.read", "e", wr1[0], ident=cb)
    eps = {ep for ep, c in b.ep_owner.items() if c == cb}
    if eps:
        _put(m, "B.resp_first.e", b.first("ep.recv", "e", wr1[0], rd1[0] if rd1 else math.inf, idents=eps))
    ff0 = b.first("from_frames", "b", wr1[0], rd1[0]) if rd1 else None
    if _put(m, "B.from_frames.b", ff0):
        _put(m, "B.from_frames.e", b.first("from_frames", "e", ff0[0], rd1[0]))
        ok0 = b.first("comm.write", "b", rd1[0], ident=cb)
        _put(m, "B.write_ok.e", b.first("comm.write", "e", ok0[0], ident=cb) if ok0 else None)
    gd = _put(m, "A.get_data.b", a.first("get_data", "b", wr0[0]))
    if gd is not None:
        rq = a.last("comm.read", "e", gd[0], ident=gd[3])
        _put(m, "A.read_req.e", rq if rq and rq[0] >= wr0[0] else None)
        w0 = _put(m, "A.write_resp.b", a.first("comm.write", "b", gd[0], ident=gd[3]))
        _put(m, "A.to_frames.e", a.first("to_frames", "e", w0[0]) if w0 else None)
    return m


def op_counts(sample: dict, m: dict) -> dict[str, int]:
    """UCX operations, buffer allocations and device syncs on each side during the gather: the awaits one needs."""
    lo, hi, out = m.get("B.gather.b"), m.get("B.gather.e"), {}
    if lo is None or hi is None:
        return out
    for role in ("A", "B"):
        for e in sample["events"][role].get("events", []):
            if lo <= float(e[0]) <= hi and e[2] == "b" and str(e[1]).split(".")[0] in ("ep", "alloc", "cuda"):
                out[f"{role}.{e[1]}"] = out.get(f"{role}.{e[1]}", 0) + 1
    return out


def phase_table(samples: Sequence[dict], sizes: Sequence[int]) -> list[dict]:
    """Per block size: each segment's median (and quartiles) in ms over the traced transfers, the whole gather_dep and
    submit -> result, and the median count of each low-level operation."""
    rows = []
    for n in sizes:
        mine = [s for s in samples if s["bytes"] == n]
        ms = [milestones(s) for s in mine]
        segs = [{"what": what, "n": len(v), "ms_median": to_ms(median(v), 4), "ms_q25": to_ms(quantile(v, 0.25), 4),
                 "ms_q75": to_ms(quantile(v, 0.75), 4)}
                for a, b, what in SEGMENTS for v in [[m[b] - m[a] for m in ms if a in m and b in m]] if v]
        ops = [op_counts(s, m) for s, m in zip(mine, ms)]
        rows.append({"bytes": n, "samples": len(ms), "segments": segs,
                     "gather_ms_median": to_ms(median([m["B.gather.e"] - m["B.gather.b"] for m in ms
                                                        if "B.gather.e" in m and "B.gather.b" in m]), 4),
                     "e2e_ms_median": to_ms(median([m["result"] - m["submit"] for m in ms]), 4),
                     "ops_median": {k: median([o.get(k, 0) for o in ops]) for k in sorted({k for o in ops for k in o})}})
    return rows
