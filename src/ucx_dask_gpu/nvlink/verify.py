"""`ucx-dask-gpu verify-nvlink`: prove, pair by pair, that NVLink delivers -- and cannot be fooled.

For every ordered GPU pair with NVLink (all pairs with --all-pairs), for each UCX under test (--ucx-prefix, repeatable)
and each settings variant (--variant), what docs/verify-nvlink.md names: `ucx_perftest -t tag_bw -m cuda` with each
process seeing ONLY its own GPU (CUDA_VISIBLE_DEVICES=<uuid>, CUDA_DEVICE_ORDER=PCI_BUS_ID); the NVLink counters of
every GPU before and after, which must account for what perftest moved ((iterations + warm-up) x size); the transport
UCX itself names (UCX_PROTO_INFO=used, else the protocol-v2 selection tables, else -- a UCX whose active protocol layer
prints nothing, 1.13's v1 -- the endpoint's lanes plus an ablation run without cuda_ipc); a cudaMemcpyPeer baseline;
and the visibility each process really had: as configured, as CUDA shows a probe process with the same environment,
as NVML lists the perftest PIDs per GPU, and the GPU UCX's tables name (`from cuda/GPU1`).

Decisions live in verdict.py (pure functions), the report in report.py; this module runs the measurements.
"""
from __future__ import annotations

import math
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import nvml
from ..cliutil import Progress, parse_size
from ..errors import NO_GPU, NO_NVLINK, ONE_GPU, PERFTEST_FAILED, USAGE, UserError
from ..fsutil import write_output_dir
from ..ucx import perftest as pt
from .gpuside import GpuSide
from .undertest import EVIDENCE_ENV, UcxUnderTest, child_env, evidence_mode
from .verdict import (PairInput, SizeMeasurement, Thresholds, TransportEvidence, Visibility, counter_deltas,
                      evaluate_pair, size_label, transport_from_lanes, transport_from_tables)

DEFAULT_SIZES = "1MiB,64MiB,256MiB"
DEFAULT_GOALS = "256MiB=0.97,1MiB=0.50"
# Never settable by --ucx-env/--variant: they are what makes the measurement honest.
RESERVED_ENV = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH"}


# --- argument helpers (pure) ----------------------------------------------------------------------------------------

def parse_sizes(text: str, option: str = "--sizes") -> list[int]:
    """'1MiB,64MiB,268435456' -> the distinct message sizes in bytes, smallest first (dask's units: 64MB = 64*10^6)."""
    sizes = sorted({parse_size(s, option) for s in text.split(",") if s.strip()})
    if not sizes:
        raise UserError(f"{option}: no size given", USAGE)
    return sizes


def parse_assignment(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UserError(f"{what}: expected KEY=VALUE, got {text!r}", USAGE)
    if key in RESERVED_ENV:
        raise UserError(f"{what}: {key} is set by verify-nvlink itself (it is what keeps the measurement honest)",
                        USAGE)
    return key, value


def parse_variant(text: str) -> dict[str, str]:
    """'UCX_RNDV_SCHEME=get_zcopy UCX_MAX_RNDV_RAILS=1' -> dict (whitespace separates; values may hold commas)."""
    items = text.split()
    if not items:
        raise UserError("--variant: empty", USAGE)
    return dict(parse_assignment(i, "--variant") for i in items)


def parse_goals(text: str) -> dict[int, float]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, _, v = item.partition("=")  # no '=': v is '', which float() refuses too
        try:
            out[parse_size(k, "--goals")] = float(v)
        except ValueError:
            raise UserError(f"--goals: expected SIZE=RATIO, got {item!r}", USAGE) from None
    return out


def iterations_for(size: int, target_bytes: int, fixed: int | None = None) -> tuple[int, int]:
    """(iterations, warm-up) for one run. A multiple of 10 makes perftest's warm-up exactly n/10 in every version
    (1.13 uses max_iter/10, newer ucs_div_round_up(max_iter, 10); both cap the -w we pass)."""
    n = fixed if fixed else max(20, min(200_000, target_bytes // size))
    n = max(10, int(math.ceil(n / 10.0)) * 10)
    return n, n // 10


def tls_without_cuda_ipc(value: str | None) -> str:
    """UCX_TLS for the ablation run: the same selection minus cuda_ipc."""
    if not value or value.strip() in ("all", "^"):
        return "^cuda_ipc"
    v = value.strip()
    if v.startswith("^"):
        items = [x for x in v[1:].split(",") if x]
        return "^" + ",".join(items + ([] if "cuda_ipc" in items else ["cuda_ipc"]))
    items = [x for x in v.split(",") if x and x != "cuda_ipc"]
    return ",".join(items) if items else "^cuda_ipc"


def select_pairs(gpus: list, all_pairs: bool = False, only: list[int] | None = None) -> list[tuple]:
    """Ordered (src, dst) pairs to measure; the bad-input exits for a machine that cannot be verified."""
    if not gpus:
        raise UserError("no GPU: NVML lists none", NO_GPU)
    if only:
        known = {g.index for g in gpus}
        missing = sorted(set(only) - known)
        if missing:
            raise UserError(f"--gpus: no GPU with index {', '.join(map(str, missing))} (have "
                            f"{', '.join(str(g.index) for g in gpus)})", USAGE)
        gpus = [g for g in gpus if g.index in set(only)]
    if len(gpus) < 2:
        raise UserError(f"only one GPU ({gpus[0].name}, {gpus[0].pci_bus_id}): NVLink needs two", ONE_GPU)
    pairs = [(a, b) for a in gpus for b in gpus if a is not b]
    linked = [(a, b) for a, b in pairs if nvml.nvlink_count(a, b) > 0]
    if not linked:
        raise UserError(f"no NVLink between any of the {len(gpus)} GPUs (NVML reports no active link to a peer GPU)",
                        NO_NVLINK)
    return pairs if all_pairs else linked


@dataclass
class RunSpec:
    inst: UcxUnderTest
    variant: dict[str, str] | None
    label: str = ""

    @property
    def counts_for_exit(self) -> bool:
        return self.variant is None


def _peer_links(a, b) -> list[int]:
    return sorted(ln for ln, peer in a.links.items() if peer == b.pci_bus_id)


class Verifier:
    def __init__(self, args, gpus: list, pairs: list[tuple], runs: list[RunSpec], sizes: list[int],
                 side: GpuSide, cuda_dirs: list[Path], base_env: dict[str, str], th: Thresholds):
        self.a, self.gpus, self.pairs, self.runs, self.sizes = args, gpus, pairs, runs, sizes
        # what perftest moves: always cuda, except when the orchestration itself is tested on a machine without GPUs
        self.mem = getattr(args, "memory_type", "cuda")
        self.side, self.cuda_dirs, self.base_env, self.th = side, cuda_dirs, base_env, th
        self.work = Path(tempfile.mkdtemp(prefix="verify-nvlink-"))
        self.raw = Path(args.raw_dir) if args.raw_dir else None
        self.baseline: dict[tuple[str, str], dict] = {}
        self.errors: list[str] = []
        self.variant_sizes = parse_sizes(args.variant_sizes, "--variant-sizes") \
            if getattr(args, "variant_sizes", None) else sizes
        live = [r for r in runs if not r.inst.preflight_error]
        n_meas = sum(len(pairs) * len(self.sizes_for(r)) for r in live)
        n_abl = sum(len(pairs) for r in live if evidence_mode(r.inst, self._env(r), args.transport_evidence) == "lanes")
        self.progress = Progress("verify-nvlink ", stream="stdout", quiet=args.quiet, total=len(pairs) + n_meas + n_abl)

    def _env(self, run: RunSpec) -> dict[str, str]:
        return child_env(run.inst, self.cuda_dirs, {**self.base_env, **(run.variant or {})})

    def visible_for(self, role_gpu) -> str:
        if self.a.unsafe_visible_devices:
            return ",".join(str(g.index) for g in sorted(self.gpus, key=lambda g: g.index))
        return role_gpu.uuid

    def declared(self, cuda_visible: str) -> list[str]:
        by_index = {str(g.index): g.uuid for g in self.gpus}
        return [by_index.get(x.strip(), x.strip()) for x in cuda_visible.split(",") if x.strip()]

    # baseline -------------------------------------------------------------------------------------------------------
    def measure_baseline(self, src, dst) -> None:
        before = self.side.snapshot()
        sizes = sorted(set(self.sizes) | set(self.variant_sizes))
        res, err = self.side.memcpy_peer(src, dst, sizes, self.a.memcpy_samples, self.a.timeout)
        after = self.side.stable_snapshot()
        entry: dict = {"error": err}
        if res:
            moved = sum(r["bytes_moved"] for r in res["results"])
            cs = counter_deltas(before[src.uuid], after[src.uuid], _peer_links(src, dst), origin=self.side.origin)
            cd = counter_deltas(before[dst.uuid], after[dst.uuid], _peer_links(dst, src), origin=self.side.origin)
            frac = (min(cs["data_tx"], cd["data_rx"]) / moved
                    if cs["data_tx"] is not None and cd["data_rx"] is not None and moved else None)
            entry = {"error": None, "peer_access": res["peer_access"], "results": res["results"],
                     "bytes_moved": moved, "nvlink_tx_bytes": cs["data_tx"], "nvlink_rx_bytes": cd["data_rx"],
                     "counter_fraction": frac}
            summary = ", ".join(f"{size_label(r['msg_bytes'])} {r['gbps']:.1f}" for r in res["results"])
            counted = f"{frac:.0%}" if frac is not None else "n/a"
            self.progress(f"cudaMemcpyPeer GPU{src.index}->GPU{dst.index}: {summary} GB/s "
                          f"(NVLink counters saw {counted} of the bytes)")
        else:
            self.progress(f"cudaMemcpyPeer GPU{src.index}->GPU{dst.index}: FAILED: {err}")
        self.baseline[(src.uuid, dst.uuid)] = entry

    # one perftest run -----------------------------------------------------------------------------------------------
    def perftest_once(self, run: RunSpec, env: dict, mode: str, src, dst, size: int, n: int, w: int,
                      tag: str) -> dict:
        sv, cv = self.visible_for(dst), self.visible_for(src)
        server_env = {**env, **EVIDENCE_ENV[mode], "CUDA_VISIBLE_DEVICES": sv}
        client_env = {**env, **EVIDENCE_ENV[mode], "CUDA_VISIBLE_DEVICES": cv}
        args = ["-t", "tag_bw", "-m", self.mem, "-s", str(size), "-n", str(n), "-w", str(w)]
        seen, poll = self.side.pids_sampler()
        before = self.side.snapshot()
        wd = self.work / tag
        perftest = run.inst.install.perftest
        out = pt.run_pair(perftest, args, server_env, client_env, wd, timeout=self.a.timeout, poll=poll)
        after = self.side.stable_snapshot()
        if self.raw:  # beside what the user keeps there: only these names, and only over an earlier run's
            write_output_dir(self.raw / tag, {
                "server.txt": out.server_out, "client.txt": out.client_out,
                "command.txt": f"server: CUDA_VISIBLE_DEVICES={sv} "
                               f"{' '.join(f'{k}={v}' for k, v in sorted(EVIDENCE_ENV[mode].items()))} "
                               f"{perftest} {' '.join(args)} -p PORT\nclient: CUDA_VISIBLE_DEVICES={cv} ... "
                               "127.0.0.1\n"}, what="the raw perftest output")
        res = pt.result_or_raise(out, f"{run.label}, GPU{src.index}->GPU{dst.index}, {size_label(size)}")
        cs = counter_deltas(before[src.uuid], after[src.uuid], _peer_links(src, dst), origin=self.side.origin)
        cd = counter_deltas(before[dst.uuid], after[dst.uuid], _peer_links(dst, src), origin=self.side.origin)
        by_pid = {pid: sorted(u) for pid, u in seen.items()}
        return {"result": res, "out": out, "counters_src": cs, "counters_dst": cd,
                "server_vis": sv, "client_vis": cv,
                "server_nvml": by_pid.get(out.server_pid), "client_nvml": by_pid.get(out.client_pid)}

    def sizes_for(self, run: RunSpec) -> list[int]:
        return self.sizes if run.variant is None else self.variant_sizes

    def measure_pair(self, run: RunSpec, src, dst) -> dict:
        env = self._env(run)
        mode = evidence_mode(run.inst, env, self.a.transport_evidence)
        sizes_out = []
        for size in self.sizes_for(run):
            n, w = iterations_for(size, self.a.target_bytes, self.a.iters)
            tag = f"{_slug(run.label)}/gpu{src.index}-gpu{dst.index}/{size}"
            r = self.perftest_once(run, env, mode, src, dst, size, n, w, tag)
            exp = (n + w) * size
            tx = r["counters_src"]["data_tx"]
            shown = f"{tx / exp:.0%}" if tx is not None else "n/a"
            self.progress(f"{run.label} GPU{src.index}->GPU{dst.index} {size_label(size)}: "
                          f"{r['result'].gbps:.1f} GB/s, NVLink counters {shown} of {exp / 1e9:.1f} GB "
                          f"({r['out'].wall_s:.1f}s)")
            sizes_out.append((size, n, w, r))
        ablation = None
        if mode == "lanes":
            big, n, w, r = sizes_out[-1]
            na, wa = iterations_for(big, self.a.target_bytes, max(20, n // 8))  # the slow path: fewer
            abl_env = {**env, "UCX_TLS": tls_without_cuda_ipc(env.get("UCX_TLS"))}
            try:
                ra = self.perftest_once(run, abl_env, "lanes", src, dst, big, na, wa,
                                        f"{_slug(run.label)}/gpu{src.index}-gpu{dst.index}/{big}-without-cuda_ipc")
                ablation = {"UCX_TLS": abl_env["UCX_TLS"], "msg_bytes": big, "ucx_gbps": ra["result"].gbps,
                            "iterations": na, "nvlink_tx_bytes": ra["counters_src"]["data_tx"],
                            "nvlink_rx_bytes": ra["counters_dst"]["data_rx"],
                            "lanes": pt.parse_lanes(ra["out"].client_out), "error": None}
                self.progress(f"{run.label} GPU{src.index}->GPU{dst.index} {size_label(big)} with "
                              f"UCX_TLS={abl_env['UCX_TLS']}: {ra['result'].gbps:.1f} GB/s (ablation)")
            except UserError as e:
                ablation = {"UCX_TLS": abl_env["UCX_TLS"], "msg_bytes": big, "ucx_gbps": None, "error": str(e)}
                self.progress(f"{run.label} GPU{src.index}->GPU{dst.index} ablation failed: {e}")
        return {"mode": mode, "sizes": sizes_out, "ablation": ablation}

    def pair_record(self, run: RunSpec, src, dst, m: dict) -> dict:
        first = m["sizes"][0][3]
        sprobe, serr = self.side.probe_visible(first["server_vis"])
        cprobe, cerr = self.side.probe_visible(first["client_vis"])
        vis = {"server_cuda_visible_devices": first["server_vis"], "client_cuda_visible_devices": first["client_vis"],
               "server_declared": self.declared(first["server_vis"]),
               "client_declared": self.declared(first["client_vis"]),
               "server_probed": sprobe, "client_probed": cprobe, "probe_errors": [e for e in (serr, cerr) if e]}
        baseline = self.baseline.get((src.uuid, dst.uuid), {})
        memcpy = {r["msg_bytes"]: r["gbps"] for r in baseline.get("results") or []}  # every size the baseline copied
        return pair_record(src, dst, m["mode"], m["sizes"], m["ablation"], baseline, vis, memcpy, self.th, self.mem)

    def run(self) -> list[dict]:
        try:
            return self._run()
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _run(self) -> list[dict]:
        for src, dst in self.pairs:
            self.measure_baseline(src, dst)
        out = []
        for run in self.runs:
            env = self._env(run)
            mode = evidence_mode(run.inst, env, self.a.transport_evidence)
            entry = {"label": run.label, "ucx": run.inst.describe(), "variant": run.variant,
                     "env": {**self.base_env, **(run.variant or {})}, "evidence_method": mode,
                     "counts_for_exit": run.counts_for_exit, "error": None, "pairs": []}
            try:
                if run.inst.preflight_error:
                    raise UserError(run.inst.preflight_error, PERFTEST_FAILED)
                for src, dst in self.pairs:
                    m = self.measure_pair(run, src, dst)
                    entry["pairs"].append(self.pair_record(run, src, dst, m))
            except UserError as e:
                # a settings study that breaks perftest (e.g. a value this UCX does not parse) is a result, not a stop
                if e.exit_code != PERFTEST_FAILED or (run.counts_for_exit and not self.a.keep_going):
                    raise
                entry["error"] = str(e)
                self.errors.append(str(e))
                why = "a study" if not run.counts_for_exit else "--keep-going"
                self.progress(f"{run.label}: {e} ({why}: next run)", step=False)
            out.append(entry)
        return out


def transport_evidence(mode: str, out: pt.PairOutput, size: int, ablation: dict | None,
                       default_big_gbps: float, factor: float, mem: str = "cuda") -> TransportEvidence:
    if mode in ("proto-used", "proto-selected"):
        return transport_from_tables(pt.parse_proto_tables(out.server_out), pt.parse_proto_tables(out.client_out),
                                     size, mem)
    lanes = pt.parse_lanes(out.client_out) + pt.parse_lanes(out.server_out)
    note = (f"without cuda_ipc (UCX_TLS={ablation['UCX_TLS']}) at {size_label(ablation['msg_bytes'])}"
            if ablation else "ablation")
    ev = transport_from_lanes(lanes, default_big_gbps, ablation.get("ucx_gbps") if ablation else None, note, factor)
    if ablation and ablation.get("error"):
        ev.detail.append(f"ablation run failed: {ablation['error']}")
    return ev


def ucx_named_gpus(measured: list[tuple], vis: dict, role: str) -> list[str] | None:
    """The GPUs `role`'s protocol tables say it used (`from cuda/GPU1`: a CUDA ordinal in that process), as UUIDs:
    the ordinal indexes the GPUs CUDA showed a probe with the same CUDA_VISIBLE_DEVICES (CUDA's own order), else the
    configured list. None when no table names a GPU (lanes evidence, host memory). Recorded on 2xH200 with both GPUs
    visible: the client printed `cuda/GPU1` -- it sent from the destination GPU."""
    order = vis.get(f"{role}_probed") or vis.get(f"{role}_declared") or []
    found = {t.local_gpu for *_, r in measured for t in pt.parse_proto_tables(getattr(r["out"], f"{role}_out"))
             if t.local_gpu is not None}
    if not found:
        return None
    return sorted({order[i] if i < len(order) else f"CUDA device {i} (of {len(order)} visible)" for i in found})


def pair_record(src, dst, mode: str, measured: list[tuple], ablation: dict | None, baseline: dict, vis: dict,
                memcpy: dict[int, float | None], th: Thresholds, mem: str = "cuda") -> dict:
    """One pair's JSON record and verdict from what was measured (pure: processes and probes already ran).

    measured: [(size, iterations, warmup, {"result", "out", "counters_src", "counters_dst", "server_nvml",
    "client_nvml"})] in increasing size; vis: the visibility evidence (configured / probed)."""
    big_gbps = measured[-1][3]["result"].gbps
    sizes, size_rows = [], []
    for size, n, w, r in measured:
        ev = transport_evidence(mode, r["out"], size, ablation, big_gbps, th.ablation_factor, mem)
        sm = SizeMeasurement(size, n, w, r["result"].gbps, memcpy.get(size), r["counters_src"], r["counters_dst"], ev)
        sizes.append(sm)
        size_rows.append({
            "msg_bytes": size, "iterations": n, "warmup": w, "expected_bytes": sm.expected_bytes,
            "ucx_gbps": _r(sm.ucx_gbps), "perftest_mb_s": r["result"].bw_overall_mbs,
            "memcpy_peer_gbps": _r(sm.memcpy_peer_gbps), "ratio": _r(sm.ratio, 4),
            "nvlink_tx_bytes": sm.nvlink_tx_bytes, "nvlink_rx_bytes": sm.nvlink_rx_bytes,
            "nvlink_tx_fraction": _frac(sm.nvlink_tx_bytes, sm.expected_bytes),
            "nvlink_rx_fraction": _frac(sm.nvlink_rx_bytes, sm.expected_bytes),
            "transport": ev.name, "transport_method": ev.method, "transport_detail": ev.detail,
            "counters": {"src": r["counters_src"], "dst": r["counters_dst"]},
            "processes": {"server_pid": r["out"].server_pid, "client_pid": r["out"].client_pid,
                          "server_gpus_nvml": r.get("server_nvml"), "client_gpus_nvml": r.get("client_nvml")},
            "wall_s": round(r["out"].wall_s, 2),
        })
    s_nvml = sorted({u for *_, r in measured for u in (r.get("server_nvml") or [])}) or None
    c_nvml = sorted({u for *_, r in measured for u in (r.get("client_nvml") or [])}) or None
    s_ucx, c_ucx = (ucx_named_gpus(measured, vis, role) for role in ("server", "client"))
    visibility = Visibility(vis["server_declared"], vis["client_declared"], vis.get("server_probed"),
                            vis.get("client_probed"), s_nvml, c_nvml, s_ucx, c_ucx)
    links = nvml.nvlink_count(src, dst)
    pin = PairInput(src.uuid, dst.uuid, links, src.link_speed_gbps, visibility, sizes, baseline.get("counter_fraction"))
    v = evaluate_pair(pin, th)
    big = sizes[-1]
    return {
        "src": src.index, "dst": dst.index, "msg_bytes": big.msg_bytes, "ucx_gbps": _r(big.ucx_gbps),
        "memcpy_peer_gbps": _r(big.memcpy_peer_gbps), "ratio": _r(big.ratio, 4),
        "nvlink_tx_bytes": big.nvlink_tx_bytes, "nvlink_rx_bytes": big.nvlink_rx_bytes,
        "link_capacity_gbps": _r(pin.capacity_gbps), "transport": big.transport.name, "verdict": v.verdict,
        "reasons": v.reasons, "measurement_verdict": v.measurement_verdict, "notes": v.notes,
        "src_uuid": src.uuid, "dst_uuid": dst.uuid, "nvlinks": links, "link_speed_gbps": src.link_speed_gbps,
        "transport_method": big.transport.method, "expected_bytes": big.expected_bytes,
        "sizes": size_rows,
        "evidence": {"visibility": {**vis, "server_nvml": s_nvml, "client_nvml": c_nvml, "server_ucx": s_ucx,
                                    "client_ucx": c_ucx}, "ablation": ablation,
                     "baseline_counter_fraction": baseline.get("counter_fraction")},
    }


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s).strip("_") or "run"


def _r(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def _frac(a, b):
    return None if a is None or not b else round(a / b, 4)
