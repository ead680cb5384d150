"""Numbers from per-transfer measurements (bench.transfer_run results): medians per size, fixed vs per-byte cost, and
where the time of one transfer goes (phases from the tracer's events).

Pure functions over plain data (no dask import): tests feed them synthetic samples and events.
Times are seconds in the data and milliseconds in reports; bandwidths GB/s (1e9 B/s).

A transfer's own time is distributed's `transfer_incoming_log` entry taken as `stop - start` (distributed floors the
`duration` field at 1 ms, which would hide everything below it); `duration_s` (floored) is kept beside it.
"""
from __future__ import annotations

import math
from typing import Sequence

from .stats import median, quantile

GB = 1e9


def _r(v, digits=6):
    return None if v is None else round(v, digits)


def transfer_seconds(sample: dict) -> float | None:
    t = sample.get("transfer")
    return None if not t else max(0.0, float(t["stop"]) - float(t["start"]))


def size_rows(samples: Sequence[dict], sizes: Sequence[int]) -> list[dict]:
    """Per block size: sample count, end-to-end and transfer medians and quartiles, distributed's floored duration."""
    rows = []
    for n in sizes:
        ss = [s for s in samples if s["bytes"] == n]
        e2e = [s["e2e_s"] for s in ss]
        xfer = [x for x in (transfer_seconds(s) for s in ss) if x is not None]
        floored = [float(s["transfer"]["duration"]) for s in ss if s.get("transfer")]
        med = median(xfer)
        rows.append({
            "bytes": n, "samples": len(ss), "missing_log": len(ss) - len(xfer),
            "e2e_ms_median": _ms(median(e2e)), "e2e_ms_q25": _ms(quantile(e2e, 0.25)),
            "e2e_ms_q75": _ms(quantile(e2e, 0.75)),
            "transfer_ms_median": _ms(med), "transfer_ms_q25": _ms(quantile(xfer, 0.25)),
            "transfer_ms_q75": _ms(quantile(xfer, 0.75)), "transfer_ms_min": _ms(min(xfer) if xfer else None),
            "duration_ms_median": _ms(median(floored)),
            "transfer_gbps_median": _r(n / med / GB, 4) if med else None,
        })
    return rows


def _ms(v):
    return None if v is None else round(v * 1e3, 4)


def fixed_and_per_byte(rows: Sequence[dict], field: str = "transfer_ms_median") -> dict:
    """Least-squares line through (bytes, median ms): intercept = fixed cost per transfer, slope = cost per byte
    (reported as the bandwidth it implies). Medians per size, not raw samples, so that noisy small sizes do not
    outweigh the large ones."""
    pts = [(r["bytes"], r[field]) for r in rows if r.get(field) is not None]
    if len(pts) < 2:
        return {"fixed_ms": None, "per_byte_gbps": None, "points": len(pts)}
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return {"fixed_ms": None, "per_byte_gbps": None, "points": n}
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx  # ms per byte
    intercept = my - slope * mx
    gbps = (1e3 / slope) / GB if slope > 0 else None  # slope: ms per byte
    return {"fixed_ms": _r(intercept, 4), "per_byte_gbps": _r(gbps, 4), "points": n,
            "smallest_ms": min(pts)[1]}


# --- phases of one traced transfer ---------------------------------------------------------------------------------
# Events: [t, name, edge, ident, size] per process ("A" sends, "B" fetches); edge "b"/"e" (begin/end) or "i".
# Milestones are found on a causal chain: B starts gather_dep, writes the request on the comm its pool gave it; A
# reads it and runs get_data on its own comm, writes the response; B reads it (first UCX recv of the response =
# its header arrived; from_frames = every frame is in), writes "OK", ends gather_dep, and executes the task.

MILESTONES = (
    ("submit", "client submits the dependent task"),
    ("B.compute_task", "worker B receives compute-task"),
    ("B.gather.b", "B starts gather_dep"),
    ("B.write_req.b", "B starts writing the get_data request"),
    ("B.req_frames.e", "B has serialised the request"),
    ("B.write_req.e", "B has written the request"),
    ("A.read_req.e", "A has read + deserialised the request"),
    ("A.get_data.b", "A's get_data handler starts"),
    ("A.write_resp.b", "A starts writing the response"),
    ("A.to_frames.e", "A has serialised the response"),
    ("A.write_resp.e", "A's response sends completed"),
    ("B.resp_first.e", "B's first recv of the response completed (header arrived)"),
    ("B.from_frames.b", "B has every frame of the response"),
    ("B.from_frames.e", "B has deserialised the response"),
    ("B.write_ok.e", "B has written 'OK'"),
    ("B.gather.e", "B ends gather_dep"),
    ("B.execute.b", "B starts the task"),
    ("B.execute.e", "B's task is done"),
    ("result", "client has the result"),
)

# Consecutive segments reported (start milestone, end milestone, what the time is).
SEGMENTS = (
    ("submit", "B.compute_task", "client -> scheduler -> B (compute-task)"),
    ("B.compute_task", "B.gather.b", "B: state machine schedules gather_dep"),
    ("B.gather.b", "B.write_req.b", "B: connection from the pool"),
    ("B.write_req.b", "B.req_frames.e", "B: serialise request"),
    ("B.req_frames.e", "B.write_req.e", "B: send request (until the write returns)"),
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


class _Stream:
    """One process's events, sorted by time, with lookups 'first event like this after t'."""

    def __init__(self, events: Sequence[Sequence], ep_owner: dict | None = None):
        self.ev = sorted((float(e[0]), str(e[1]), str(e[2]), int(e[3]), int(e[4]) if len(e) > 4 else -1)
                         for e in events)
        self.ep_owner = {int(k): int(v) for k, v in (ep_owner or {}).items()}

    def first(self, name: str, edge: str, after: float = -math.inf, before: float = math.inf,
              ident: int | None = None, idents: set | None = None):
        for e in self.ev:
            if e[0] < after or e[0] > before or e[1] != name or e[2] != edge:
                continue
            if ident is not None and e[3] != ident:
                continue
            if idents is not None and e[3] not in idents:
                continue
            return e
        return None

    def last(self, name: str, edge: str, before: float, ident: int | None = None):
        found = None
        for e in self.ev:
            if e[0] > before:
                break
            if e[1] == name and e[2] == edge and (ident is None or e[3] == ident):
                found = e
        return found

    def eps_of(self, comm: int) -> set[int]:
        return {ep for ep, c in self.ep_owner.items() if c == comm}


def _put(m: dict[str, float], name: str, event):
    """Record `event`'s time as milestone `name` (when there is one); return the event."""
    if event is not None:
        m[name] = event[0]
    return event


def milestones(sample: dict) -> dict[str, float]:
    """Milestone name -> time (s, the tracer's clock) for one traced sample; missing ones are left out."""
    ev = sample.get("events") or {}
    A = _Stream(ev.get("A", {}).get("events", []), ev.get("A", {}).get("ep_owner"))
    B = _Stream(ev.get("B", {}).get("events", []), ev.get("B", {}).get("ep_owner"))
    m: dict[str, float] = {"submit": float(sample["submit"]), "result": float(sample["result"])}
    g0 = _put(m, "B.gather.b", B.first("gather_dep", "b"))
    if g0 is None:
        return m
    _put(m, "B.compute_task", B.last("stimulus:ComputeTaskEvent", "i", g0[0]))
    g1 = _put(m, "B.gather.e", B.first("gather_dep", "e", g0[0]))
    x0 = _put(m, "B.execute.b", B.first("execute", "b", g1[0])) if g1 else None
    if x0:
        _put(m, "B.execute.e", B.first("execute", "e", x0[0]))
    conn = B.first("connect", "e", g0[0])
    if conn is None:
        return m
    cb = conn[3]  # the comm B's pool gave it: the request, response and "OK" travel on it
    wr0 = B.first("comm.write", "b", conn[0], ident=cb)
    wr1 = B.first("comm.write", "e", wr0[0], ident=cb) if wr0 else None
    if not (wr0 and wr1):
        return m
    m["B.write_req.b"], m["B.write_req.e"] = wr0[0], wr1[0]
    _put(m, "B.req_frames.e", B.first("to_frames", "e", wr0[0], wr1[0]))
    rd1 = B.first("comm.read", "e", wr1[0], ident=cb)
    eps = B.eps_of(cb)
    if eps:
        _put(m, "B.resp_first.e", B.first("ep.recv", "e", wr1[0], rd1[0] if rd1 else math.inf, idents=eps))
    if rd1:
        ff0 = B.first("from_frames", "b", wr1[0], rd1[0])
        ff1 = B.first("from_frames", "e", ff0[0], rd1[0]) if ff0 else None
        if ff0 and ff1:
            m["B.from_frames.b"], m["B.from_frames.e"] = ff0[0], ff1[0]
        ok0 = B.first("comm.write", "b", rd1[0], ident=cb)
        if ok0:
            _put(m, "B.write_ok.e", B.first("comm.write", "e", ok0[0], ident=cb))
    gd = _put(m, "A.get_data.b", A.first("get_data", "b", wr0[0]))
    if gd is None:
        return m
    ca = gd[3]  # A's side of the same connection
    rq = A.last("comm.read", "e", gd[0], ident=ca)
    if rq and rq[0] >= wr0[0]:
        m["A.read_req.e"] = rq[0]
    w0 = _put(m, "A.write_resp.b", A.first("comm.write", "b", gd[0], ident=ca))
    if w0:
        _put(m, "A.to_frames.e", A.first("to_frames", "e", w0[0]))
        _put(m, "A.write_resp.e", A.first("comm.write", "e", w0[0], ident=ca))
    return m


def op_counts(sample: dict) -> dict[str, int]:
    """UCX operations and buffer allocations on each side during the gather (how many awaits a transfer needs)."""
    ev = sample.get("events") or {}
    out: dict[str, int] = {}
    m = milestones(sample)
    lo, hi = m.get("B.gather.b"), m.get("B.gather.e")
    if lo is None or hi is None:
        return out
    for role in ("A", "B"):
        for e in ev.get(role, {}).get("events", []):
            if lo <= float(e[0]) <= hi and str(e[2]) == "b" and str(e[1]).split(".")[0] in ("ep", "alloc", "cuda"):
                key = f"{role}.{e[1]}"
                out[key] = out.get(key, 0) + 1
    return out


def op_durations(sample: dict) -> dict[str, dict[str, float]]:
    """Time inside each kind of low-level operation during the gather, per process: {"B.alloc.device": {"total_s",
    "max_s", "n"}, ...} (receive-buffer allocation, device syncs, each UCX send/recv). Begin and end events are paired
    per (operation, endpoint) in order; a UCX recv's time includes waiting for its message."""
    ev = sample.get("events") or {}
    m = milestones(sample)
    lo, hi = m.get("B.gather.b"), m.get("B.gather.e")
    out: dict[str, dict[str, float]] = {}
    if lo is None or hi is None:
        return out
    for role in ("A", "B"):
        open_: dict[tuple[str, int], list[float]] = {}
        for e in sorted(ev.get(role, {}).get("events", []), key=lambda x: float(x[0])):
            t, name, edge, ident = float(e[0]), str(e[1]), str(e[2]), int(e[3])
            if name.split(".")[0] not in ("ep", "alloc", "cuda") or not lo <= t <= hi:
                continue
            key = (name, ident)
            if edge == "b":
                open_.setdefault(key, []).append(t)
            elif edge == "e" and open_.get(key):
                d = t - open_[key].pop(0)
                agg = out.setdefault(f"{role}.{name}", {"total_s": 0.0, "max_s": 0.0, "n": 0})
                agg["total_s"] += d
                agg["max_s"] = max(agg["max_s"], d)
                agg["n"] += 1
    return out


def phase_table(traced: Sequence[dict], sizes: Sequence[int]) -> list[dict]:
    """Per size: the median of each segment over the traced samples (ms), and of the whole gather_dep / e2e."""
    rows = []
    for n in sizes:
        ms = [milestones(s) for s in traced if s["bytes"] == n]
        if not ms:
            continue
        segs = []
        for a, b, what in SEGMENTS:
            vals = [m[b] - m[a] for m in ms if a in m and b in m]
            if not vals:
                continue
            segs.append({"from": a, "to": b, "what": what, "n": len(vals), "ms_median": _ms(median(vals)),
                         "ms_q25": _ms(quantile(vals, 0.25)), "ms_q75": _ms(quantile(vals, 0.75))})
        gather = [m["B.gather.e"] - m["B.gather.b"] for m in ms if "B.gather.b" in m and "B.gather.e" in m]
        e2e = [m["result"] - m["submit"] for m in ms]
        ops = [op_counts(s) for s in traced if s["bytes"] == n]
        keys = sorted({k for o in ops for k in o})
        durs = [op_durations(s) for s in traced if s["bytes"] == n]
        dkeys = sorted({k for d in durs for k in d})
        rows.append({"bytes": n, "samples": len(ms), "gather_ms_median": _ms(median(gather)),
                     "e2e_ms_median": _ms(median(e2e)), "segments": segs,
                     "ops_median": {k: median([o.get(k, 0) for o in ops]) for k in keys},
                     "op_ms_median": {k: {"total": _ms(median([d[k]["total_s"] for d in durs if k in d])),
                                          "longest": _ms(median([d[k]["max_s"] for d in durs if k in d]))}
                                      for k in dkeys}})
    return rows


def variant_summary(result: dict) -> dict:
    """One variant's result -> its report entry (rows per size, fixed/per-byte fit, phases when traced)."""
    sizes = result.get("sizes", [])
    rows = size_rows(result.get("samples", []), sizes)
    out = {"label": result.get("label"), "protocol": result.get("protocol"), "status": result.get("status"),
           "error": result.get("error"), "rounds": result.get("rounds"), "rows": rows,
           "fit_transfer": fixed_and_per_byte(rows, "transfer_ms_median"),
           "fit_e2e": fixed_and_per_byte(rows, "e2e_ms_median"), "applied": _one_applied(result.get("applied")),
           "cluster": result.get("cluster")}
    if result.get("transpose"):
        out["transpose"] = result["transpose"]
    if result.get("proto_info"):
        out["proto_info"] = result["proto_info"]
    if result.get("traced"):
        out["phases"] = phase_table(result["traced"], sizes)
        out["traced_rounds"] = result.get("traced_rounds")
    return out


def _one_applied(applied: dict | None) -> dict | None:
    """The settings both workers report (they are started alike; the first one stands for both)."""
    if not applied:
        return None
    return next(iter(applied.values()))


def compare(variants: Sequence[dict], base_label: str, size: int, field: str = "transfer_ms_median") -> list[dict]:
    """Each variant's figure at one size against the base variant of the same protocol (ratio < 1 is faster)."""
    base = {v["protocol"]: _row(v, size) for v in variants if v["label"] == base_label}
    out = []
    for v in variants:
        row = _row(v, size)
        b = base.get(v["protocol"])
        val = row.get(field) if row else None
        ref = b.get(field) if b else None
        out.append({"label": v["label"], "protocol": v["protocol"], "bytes": size, field: val,
                    "ratio_to_base": _r(val / ref, 3) if val is not None and ref else None})
    return out


def _row(v: dict, size: int) -> dict | None:
    return next((r for r in v.get("rows", []) if r["bytes"] == size), None)


# --- markdown ------------------------------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def _f(v, fmt="{:.3f}"):
    return "–" if v is None else fmt.format(v)


def markdown(report: dict) -> str:
    lines = [f"# Per-transfer cost: {report.get('title', '')}".rstrip(), ""]
    if report.get("command"):
        lines += ["```", report["command"], "```", ""]
    for k in ("host", "mode", "note"):
        if report.get(k):
            lines.append(f"- {k}: {report[k]}")
    lines += ["", "One transfer at a time between two workers, fresh keys; medians over samples "
              "(transfer = distributed's transfer_incoming_log stop - start, unfloored; e2e = client submit -> "
              "result of a task on B that reads the block from A).", ""]
    variants = report.get("variants", [])
    sizes = report.get("sizes", [])
    head = "| protocol | variant | " + " | ".join(f"{human_bytes(n)} transfer ms (e2e)" for n in sizes) + \
        " | fixed ms | per-byte GB/s |"
    lines += [head, "|" + "---|" * (4 + len(sizes))]
    for v in variants:
        cells = []
        for n in sizes:
            r = _row(v, n)
            cells.append("failed" if r is None or r["samples"] == 0 else
                         f"{_f(r['transfer_ms_median'])} ({_f(r['e2e_ms_median'], '{:.2f}')})")
        fit = v.get("fit_transfer") or {}
        status = "" if v.get("status") == "ok" else f" **{v.get('status')}: {v.get('error')}**"
        lines.append(f"| {v['protocol']} | {v['label']}{status} | " + " | ".join(cells)
                     + f" | {_f(fit.get('fixed_ms'))} | {_f(fit.get('per_byte_gbps'), '{:.2f}')} |")
    tr = [v for v in variants if v.get("transpose")]
    if tr:
        t0 = tr[0]["transpose"]
        lines += ["", f"## Sanity check: (x + x.T).sum(), {t0['size']}^2 float64, chunks {t0['chunks']}, "
                  "on each variant's cluster", "",
                  "| protocol | variant | wall ms median (runs) | transfers/run | transfer GB/s median | check |",
                  "|---|---|---|---|---|---|"]
        for v in tr:
            t = v["transpose"]
            lines.append(f"| {v['protocol']} | {v['label']} | {_f(t['wall_ms_median'], '{:.1f}')} "
                         f"({', '.join(f'{w:.1f}' for w in t['wall_ms'])}) | {t['transfers_per_run']} | "
                         f"{_f(t['p2p_gbps_median'], '{:.2f}')} | {'ok' if t['check_ok'] else 'FAILED'} |")
    for v in variants:
        for ph in v.get("phases") or []:
            lines += ["", f"## Phases: {v['protocol']} {v['label']}, {human_bytes(ph['bytes'])} "
                      f"({ph['samples']} traced samples; gather_dep median {_f(ph['gather_ms_median'])} ms, "
                      f"e2e {_f(ph['e2e_ms_median'], '{:.2f}')} ms)", "",
                      "| phase | median ms | q25–q75 |", "|---|---|---|"]
            for s in ph["segments"]:
                lines.append(f"| {s['what']} | {_f(s['ms_median'])} | {_f(s['ms_q25'])}–{_f(s['ms_q75'])} |")
            if ph.get("ops_median"):
                lines.append("")
                lines.append("Operations during gather_dep (median count): " + ", ".join(
                    f"{k} {v:g}" for k, v in ph["ops_median"].items()))
            if ph.get("op_ms_median"):
                lines.append("")
                lines.append("Time inside them (median ms per transfer, total / longest one; a recv includes its "
                             "wait): " + ", ".join(f"{k} {_f(v['total'])} / {_f(v['longest'])}"
                                                   for k, v in ph["op_ms_median"].items()))
    proto = next((v for v in variants if v.get("proto_info")), None)
    if proto:
        lines += ["", f"## UCX's protocol choice ({proto['protocol']} {proto['label']}, UCX_PROTO_INFO=y), rows naming "
                  "CUDA memory", "", "```"]
        lines += [r for r in proto["proto_info"] if "cuda" in r.lower()][:40] or ["(none)"]
        lines.append("```")
    for v in variants:
        if v.get("applied"):
            lines += ["", f"- applied ({v['protocol']} {v['label']}; {v.get('cluster')}): `{v['applied']}`"]
    return "\n".join(lines) + "\n"


def summary_lines(report: dict) -> list[str]:
    """Compact stdout summary: one line per variant, transfer and e2e medians per size."""
    out = []
    sizes = report.get("sizes", [])
    for v in report.get("variants", []):
        parts = []
        for n in sizes:
            r = _row(v, n)
            if r is None or not r["samples"]:
                parts.append(f"{human_bytes(n)} –")
            else:
                parts.append(f"{human_bytes(n)} {_f(r['transfer_ms_median'])}/{_f(r['e2e_ms_median'], '{:.1f}')}")
        tag = "" if v.get("status") == "ok" else f" [{v.get('status')}: {v.get('error')}]"
        t = v.get("transpose")
        if t:
            tag += f"  transpose {_f(t['wall_ms_median'], '{:.1f}')} ms {'ok' if t['check_ok'] else 'FAILED'}"
        out.append(f"{v['protocol']:>3} {v['label']:<28} " + "  ".join(parts) + tag)
    return out
