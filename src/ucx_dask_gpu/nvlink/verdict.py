"""verify-nvlink's decisions, as pure functions of parsed measurements (no processes, no NVML, no CUDA here).

A pair's verdict is
- `invalid` when the measurement cannot have been an NVLink transfer between two distinct GPUs: a process could see
  more (or fewer) than one GPU, server and client shared a GPU, a process ran on the wrong GPU, or the bandwidth is
  above what the links can carry (links x per-link speed);
- `fail` when it was a fair measurement but NVLink is not proven or not delivering: the NVLink counters do not
  account for the bytes perftest moved, the transport is not (provably) cuda_ipc, or ucx/cudaMemcpyPeer is below the
  threshold at the largest size;
- `pass` otherwise; `no-nvlink` for a pair without NVLink measured with --all-pairs (informational).

`measurement_verdict` is the same decision with the visibility evidence left out: it shows whether the numbers alone
(counters, capacity) would have caught a misconfigured run.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from ..cliutil import format_bytes
from ..ucx.perftest import ProtoTable

PASS, FAIL, INVALID, NO_NVLINK = "pass", "fail", "invalid", "no-nvlink"
COUNTERS = ("data_tx", "data_rx", "raw_tx", "raw_rx")


@dataclass(frozen=True)
class Thresholds:
    min_ratio: float = 0.90          # ucx / cudaMemcpyPeer at the largest size
    counter_fraction: float = 0.90   # NVLink data bytes / bytes perftest moved
    ablation_factor: float = 0.5     # without cuda_ipc the bandwidth must fall below this x the default's


# --- counters ------------------------------------------------------------------------------------------------------

def counter_deltas(before, after, peer_links: list[int] | None = None, tolerance: float = 0.05,
                   origin: str = "NVML") -> dict:
    """Bytes counted between two nvml.NvlinkThroughput snapshots of one GPU: the per-link counters of the links to the
    peer (so traffic to other GPUs is not credited), else the all-links aggregate when per-link values are missing or
    every link repeats the GPU-wide total (some drivers answer each link with the aggregate; summing them would
    multiply the bytes by the link count); a 'note' when the two disagree."""
    agg = {k: _sub(after.total.get(k), before.total.get(k)) for k in COUNTERS}
    links = sorted(set(before.links) & set(after.links))
    per_link = {ln: {k: _sub(after.links[ln].get(k), before.links[ln].get(k)) for k in COUNTERS} for ln in links}
    out: dict = {"aggregate": agg}

    def close(a, b):
        return abs(a - b) <= tolerance * max(abs(b), 1) + (1 << 20)

    usable = bool(per_link) and all(v["data_tx"] is not None and v["data_rx"] is not None for v in per_link.values())
    if usable and len(per_link) > 1 and agg["data_tx"] is not None and agg["data_rx"] is not None \
            and (agg["data_tx"] or agg["data_rx"]) \
            and all(close(v[k], agg[k]) for v in per_link.values() for k in ("data_tx", "data_rx")):
        usable = False
        out["note"] = "every link reports the GPU-wide total: using the aggregate"
    if usable:
        want = [ln for ln in links if peer_links is None or ln in peer_links] or links
        chosen = {k: (sum(per_link[ln][k] for ln in want) if all(per_link[ln][k] is not None for ln in want)
                      else None) for k in COUNTERS}
        sums_all = {k: sum(v[k] or 0 for v in per_link.values()) for k in ("data_tx", "data_rx")}
        if any(agg[k] is not None and not close(sums_all[k], agg[k]) for k in sums_all):
            out["note"] = (f"per-link sum (tx {sums_all['data_tx']}, rx {sums_all['data_rx']}) differs from the "
                           f"aggregate (tx {agg['data_tx']}, rx {agg['data_rx']})")
        return {**out, **chosen, "source": f"{origin} per-link counters, links {_ranges(want)}"}
    if agg["data_tx"] is not None and agg["data_rx"] is not None:
        return {**out, **agg, "source": f"{origin} all-links aggregate (fields 138-141, scopeId UINT_MAX)"}
    return {**out, **{k: None for k in COUNTERS}, "source": "unavailable"}


def _sub(a, b):
    return None if a is None or b is None else a - b


def _ranges(xs: list[int]) -> str:
    """Sorted distinct link numbers as '0-5,8' (a run of consecutive numbers keeps one value of x - position)."""
    runs = [[x for _, x in run] for _, run in itertools.groupby(enumerate(xs), lambda ix: ix[1] - ix[0])]
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "-"


# --- transport -----------------------------------------------------------------------------------------------------

@dataclass
class TransportEvidence:
    method: str                       # proto-used | proto-selected | lanes+ablation | ablation
    transports: tuple[str, ...]       # transports the evidence names for the data path; () = could not be named
    detail: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return "+".join(self.transports) if self.transports else "unknown"


def transport_from_tables(server_tables: list[ProtoTable], client_tables: list[ProtoTable], msg_bytes: int,
                          mem: str = "cuda") -> TransportEvidence:
    """Name the transport from UCX_PROTO_INFO tables: the sender's (client) `ucp_tag_send` table and the receiver's
    (server) `rendezvous data fetch` table for `mem` memory, row covering `msg_bytes` -- plus the sender's
    `rendezvous data send` table where the data goes that way (ucx/perftest.py says what real runs print). With
    `used` tables only rows that were used (count > 0) count; a table printed twice is read once. Selection tables
    (no counts) list every possibility: there the `rendezvous data send` table counts only when the selected
    tag-send row names no transport of its own (the receiver asked for a put)."""
    def pick(tables, role, want):
        seen, out = set(), []
        for t in tables:
            key = (t.ep_cfg, t.operation, tuple(t.rows))
            if want(t) and key not in seen:
                seen.add(key)
                out.append((role, t))
        return out

    def tables_for(memory_ok):
        return (pick(client_tables, "client", lambda t: t.is_send and memory_ok(t)),
                pick(client_tables, "client", lambda t: t.is_rndv_send and memory_ok(t)),
                pick(server_tables, "server", lambda t: t.is_rndv_fetch and memory_ok(t)))

    sends, puts, fetches = tables_for(lambda t: t.mem_is(mem))
    note = None
    if not (sends or puts or fetches):  # a header format we do not know: every table (a host one never names cuda_ipc)
        sends, puts, fetches = tables_for(lambda t: True)
        if sends or puts or fetches:
            note = f"no table header names {mem} memory; used every send/fetch table"
    used = any(t.used for _, t in sends + puts + fetches)
    if not used:  # selection tables: bandwidth tests send with the "multi" flag; prefer those where printed
        sends = [c for c in sends if "(multi" in c[1].operation] or sends
        puts = [c for c in puts if "(multi" in c[1].operation] or puts
        if any(r.transports for _, t in sends for r in t.rows if r.covers(msg_bytes)):
            puts = []
    cands = sends + puts + fetches
    method = "proto-used" if used else "proto-selected"
    names: list[str] = []
    detail = []
    for who, t in cands:
        for r in t.rows:
            if not r.covers(msg_bytes) or (used and not r.count):
                continue
            hi = "inf" if r.hi is None else r.hi
            cnt = f", used {r.count}x" if r.count is not None else ""
            detail.append(f"{who}: {t.operation} [{r.lo}..{hi}]: {r.protocol} via {r.config or '-'}{cnt}")
            names += [tl for tl in r.transports if tl not in names]
    if not cands:
        detail.append(f"no protocol table for {mem} memory in the output")
    if note:
        detail.append(note)
    return TransportEvidence(method, tuple(names), detail)


def transport_from_lanes(lanes: list[dict], default_gbps: float | None, ablation_gbps: float | None,
                         ablation_note: str, factor: float) -> TransportEvidence:
    """UCX without protocol tables for its active protocol layer (1.13: v1 by default): cuda_ipc must be among the
    endpoint's tag lanes (UCX_LOG_LEVEL=info) AND removing it (UCX_TLS without cuda_ipc) must cut the bandwidth below
    `factor` x the default run's. A UCX that prints no lanes line at all is judged by the ablation alone (and says so)."""
    tls = list(dict.fromkeys(lane.split("/", 1)[0] for entry in lanes for lane in entry.get("tag", [])))
    printed = bool(lanes)
    method = "lanes+ablation" if printed else "ablation"
    detail = [f"tag lanes (UCX_LOG_LEVEL=info): {' '.join(tls) or 'none'}" if printed
              else "tag lanes: this UCX printed no ep_cfg line at UCX_LOG_LEVEL=info"]
    if ablation_gbps is not None and default_gbps:
        detail.append(f"{ablation_note}: {ablation_gbps:.1f} GB/s vs {default_gbps:.1f} GB/s with it "
                      f"({ablation_gbps / default_gbps:.2f}x; needs < {factor:.2f}x)")
    else:
        detail.append(f"{ablation_note}: not measured")
    if printed and "cuda_ipc" not in tls:
        # a cuda lane if there is one; else the lanes themselves: UCX 1.13.1 without cuda_ipc prints only
        # `tag(sysv/memory cma/memory)` for cuda memory (recorded, 2xH200) -- staged through host memory by them
        data = tuple(t for t in tls if t.startswith("cuda")) or tuple(tls)
        return TransportEvidence(method, data, detail + ["cuda_ipc is not among the lanes"])
    if ablation_gbps is None or not default_gbps:
        return TransportEvidence(method, (), detail)
    if ablation_gbps < factor * default_gbps:
        return TransportEvidence(method, ("cuda_ipc",), detail)
    return TransportEvidence(method, (), detail + ["bandwidth did not depend on cuda_ipc"])


# --- the verdict ---------------------------------------------------------------------------------------------------

@dataclass
class SizeMeasurement:
    msg_bytes: int
    iterations: int
    warmup: int
    ucx_gbps: float
    memcpy_peer_gbps: float | None
    counters_src: dict   # counter_deltas() of the sending GPU
    counters_dst: dict   # counter_deltas() of the receiving GPU
    transport: TransportEvidence

    @property
    def expected_bytes(self) -> int:
        return (self.iterations + self.warmup) * self.msg_bytes

    @property
    def nvlink_tx_bytes(self) -> int | None:
        return self.counters_src.get("data_tx")

    @property
    def nvlink_rx_bytes(self) -> int | None:
        return self.counters_dst.get("data_rx")

    @property
    def ratio(self) -> float | None:
        return self.ucx_gbps / self.memcpy_peer_gbps if self.memcpy_peer_gbps else None


@dataclass
class Visibility:
    """GPU UUIDs each process could see / used, by source; None = that source said nothing."""
    server_declared: list[str]
    client_declared: list[str]
    server_probed: list[str] | None = None   # what CUDA showed a probe process with the same environment
    client_probed: list[str] | None = None
    server_nvml: list[str] | None = None     # GPUs on which NVML listed the server's PID during the run
    client_nvml: list[str] | None = None
    server_ucx: list[str] | None = None      # the GPU UCX's protocol tables say the process used (`cuda/GPU<N>`)
    client_ucx: list[str] | None = None


@dataclass
class PairInput:
    src_uuid: str
    dst_uuid: str
    nvlinks: int
    link_speed_gbps: float | None
    visibility: Visibility
    sizes: list[SizeMeasurement]
    memcpy_counter_fraction: float | None = None  # NVLink bytes / bytes cudaMemcpyPeer moved during the baseline

    @property
    def capacity_gbps(self) -> float | None:
        return self.nvlinks * self.link_speed_gbps if self.nvlinks and self.link_speed_gbps else None


@dataclass
class PairVerdict:
    verdict: str
    reasons: list[str]
    measurement_verdict: str
    notes: list[str] = field(default_factory=list)


def size_label(n: int) -> str:
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def visibility_problems(p: PairInput, notes: list[str] | None = None) -> list[str]:
    """Why the processes' GPU visibility makes the run invalid ([] when it is clean).

    Configured and probed visibility, and the GPU UCX names in its protocol tables, must be exactly the process's
    own GPU. NVML's process lists are judged more carefully: a process that holds an IPC mapping of the peer's memory
    may be listed on the peer GPU too, so being seen on an extra GPU is only a note -- being seen, but NOT on its own
    GPU, is invalid."""
    v = p.visibility
    out = []
    for source, server, client in (("as configured", v.server_declared, v.client_declared),
                                   ("as CUDA showed it to a probe", v.server_probed, v.client_probed),
                                   ("as UCX's protocol tables named it", v.server_ucx, v.client_ucx)):
        for role, seen, want in (("server", server, p.dst_uuid), ("client", client, p.src_uuid)):
            if seen is None:
                continue
            if len(seen) != 1:
                verb = "used" if "UCX" in source else "could see"
                out.append(f"{role} process {verb} {len(seen)} GPUs {source} ({', '.join(seen) or 'none'}): "
                           f"each side must see only its own GPU")
            elif seen[0] != want:
                out.append(f"{role} process was on {seen[0]} {source}, not {want}")
        if server is not None and client is not None and set(server) & set(client):
            out.append(f"server and client could both use {', '.join(sorted(set(server) & set(client)))} {source}: "
                       f"a same-GPU copy, not an NVLink transfer")
    for role, seen, want in (("server", v.server_nvml, p.dst_uuid), ("client", v.client_nvml, p.src_uuid)):
        if not seen:
            continue  # not listed (e.g. another PID namespace): no evidence either way
        if want not in seen:
            out.append(f"{role} process ran on {', '.join(seen)} per NVML's process list, not on {want}")
        elif len(seen) > 1 and notes is not None:
            notes.append(f"{role} process was also listed on {', '.join(x for x in seen if x != want)} by NVML "
                         f"(an IPC mapping of the peer's memory?)")
    return out


def evaluate_pair(p: PairInput, th: Thresholds = Thresholds()) -> PairVerdict:
    notes: list[str] = []
    invalid_meas = _capacity_problems(p, notes)
    fails = _measurement_failures(p, th)
    if any("counters" in f for f in fails) and p.memcpy_counter_fraction is not None \
            and p.memcpy_counter_fraction < th.counter_fraction:
        notes.append(f"the counters also missed cudaMemcpyPeer's traffic ({p.memcpy_counter_fraction:.0%} counted): "
                     f"they cannot prove anything on this host")

    vis = visibility_problems(p, notes)
    meas_verdict = _decide(invalid_meas, fails, p.nvlinks)
    verdict = _decide(vis + invalid_meas, fails, p.nvlinks)
    reasons = vis + invalid_meas if verdict == INVALID else fails if verdict in (FAIL, NO_NVLINK) else []
    if verdict == INVALID:
        notes += [f"also: {f}" for f in fails]
    return PairVerdict(verdict, reasons, meas_verdict, notes)


def _capacity_problems(p: PairInput, notes: list[str]) -> list[str]:
    """What makes the measurement invalid: one GPU on both sides, a rate above what the links can carry."""
    invalid_meas: list[str] = []
    if p.src_uuid == p.dst_uuid:
        invalid_meas.append("source and destination are the same GPU")
    cap = p.capacity_gbps
    best_copy = max((s.memcpy_peer_gbps for s in p.sizes if s.memcpy_peer_gbps), default=None)
    if cap is not None and best_copy is not None and best_copy > 1.02 * cap:
        # the baseline is a real GPU-to-GPU copy: if it beats the "capacity", the link speed NVML gave is wrong
        notes.append(f"cudaMemcpyPeer reached {best_copy:.1f} GB/s, above the capacity {cap:.1f} GB/s computed from "
                     f"NVML's link speed ({p.link_speed_gbps} GB/s x {p.nvlinks}): capacity check skipped")
        cap = None
    elif cap is None and p.nvlinks:
        notes.append("link speed unknown: capacity check skipped")
    for s in p.sizes:
        if cap is not None and s.ucx_gbps > cap:
            invalid_meas.append(f"{size_label(s.msg_bytes)}: {s.ucx_gbps:.1f} GB/s is above the NVLink capacity "
                                f"{cap:.1f} GB/s ({p.nvlinks} links x {p.link_speed_gbps:.3f} GB/s): not a transfer "
                                "between GPUs")
    return invalid_meas


def _measurement_failures(p: PairInput, th: Thresholds) -> list[str]:
    """What fails the pair: no NVLink, bytes the counters did not see cross it, another transport, a low ratio."""
    fails: list[str] = []
    if not p.nvlinks:
        fails.append("no NVLink between these GPUs")
    for s in p.sizes:
        lbl = size_label(s.msg_bytes)
        exp = s.expected_bytes
        tx, rx = s.nvlink_tx_bytes, s.nvlink_rx_bytes
        if tx is None or rx is None:
            fails.append(f"{lbl}: NVLink throughput counters unavailable: cannot prove the bytes crossed NVLink")
        else:
            need = th.counter_fraction * exp
            if tx < need or rx < need:
                msg = (f"{lbl}: NVLink counters saw {format_bytes(tx)} sent by the source / {format_bytes(rx)} received "
                       f"by the destination of {format_bytes(exp)} perftest moved (need >= {th.counter_fraction:.0%})")
                rtx, rrx = s.counters_dst.get("data_tx"), s.counters_src.get("data_rx")
                if rtx is not None and rrx is not None and min(rtx, rrx) >= need:
                    msg += "; the bytes went the other way (dst -> src): sender/receiver roles reversed?"
                fails.append(msg)
        if s.transport.transports != ("cuda_ipc",):
            fails.append(f"{lbl}: transport {s.transport.name} ({s.transport.method}), not cuda_ipc")
    if p.sizes:
        big = max(p.sizes, key=lambda s: s.msg_bytes)
        lbl = size_label(big.msg_bytes)
        if big.ratio is None:
            fails.append(f"{lbl}: no cudaMemcpyPeer baseline to compare with")
        elif big.ratio < th.min_ratio:
            fails.append(f"{lbl}: ucx/cudaMemcpyPeer = {big.ratio:.2f} < {th.min_ratio:.2f} "
                         f"({big.ucx_gbps:.1f} vs {big.memcpy_peer_gbps:.1f} GB/s)")
    else:
        fails.append("nothing was measured")
    return fails


def _decide(invalid: list[str], fails: list[str], nvlinks: int) -> str:
    if invalid:
        return INVALID
    if not nvlinks:
        return NO_NVLINK
    return FAIL if fails else PASS


def goal_met(ratio: float | None, goal: float) -> bool | None:
    return None if ratio is None or math.isnan(ratio) else ratio >= goal
