"""verify-nvlink's report: the overall verdict and exit status, the JSON payload (field names as DESIGN.md gives
them), the stdout table, the markdown page and the PNG heatmap."""
from __future__ import annotations

import os
import shlex
import sys
from datetime import datetime, timezone

from ..errors import PERFTEST_FAILED, VERDICT_FAILED
from ..report import heatmap_png, markdown_table
from .verdict import FAIL, INVALID, PASS, Thresholds, goal_met, size_label

STEM = "verify-nvlink"
MODULE = "ucx_dask_gpu.nvlink"


def overall_verdict(runs: list[dict]) -> str:
    counted = [p["verdict"] for r in runs if r["counts_for_exit"] for p in r["pairs"]]
    if any(r["error"] for r in runs if r["counts_for_exit"]):
        return "error"
    if any(v == INVALID for v in counted):
        return INVALID
    if any(v == FAIL for v in counted) or not any(v == PASS for v in counted):
        return FAIL
    return PASS


def exit_code(runs: list[dict]) -> int:
    if any(r["error"] for r in runs if r["counts_for_exit"]):
        return PERFTEST_FAILED
    return 0 if overall_verdict(runs) == PASS else VERDICT_FAILED


def build_payload(host: str, driver: str | None, gpus: list, runs: list[dict], baseline: dict, sizes: list[int],
                  th: Thresholds, goals: dict[int, float], command: str, unsafe: bool) -> dict:
    primary = runs[0] if runs else {"pairs": [], "ucx": {}}
    return {
        "host": host,
        "gpus": [{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "name": g.name,
                  "nvlink_peers": g.nvlink_peers, "link_speed_gbps": g.link_speed_gbps} for g in gpus],
        "pairs": primary["pairs"],
        "ucx": {"version": primary["ucx"].get("version"), "source": primary["ucx"].get("source"),
                "prefix": primary["ucx"].get("prefix"), "label": primary.get("label")},
        "verdict": overall_verdict(runs),
        "exit_code": exit_code(runs),
        "runs": runs,
        "baseline": {"tool": "cudaMemcpyPeer (CuPy memcpyPeerAsync, CUDA events, median)",
                     "pairs": [{"src_uuid": s, "dst_uuid": d, **v} for (s, d), v in baseline.items()]},
        "sizes": sizes,
        "thresholds": {"min_ratio": th.min_ratio, "counter_fraction": th.counter_fraction,
                       "ablation_factor": th.ablation_factor},
        "goals": {str(k): v for k, v in goals.items()},
        "unsafe_visible_devices": unsafe,
        "inherited_ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "driver": driver,
        "command": command,
        "generated_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "units": "GB/s = 1e9 bytes/s; perftest prints MB/s meaning MiB/s (2^20), converted; NVLink bytes = bytes",
    }


TABLE_HEADERS = ["run", "pair", "size", "ucx GB/s", "memcpyPeer GB/s", "ratio", "NVLink tx", "NVLink rx",
                 "cap GB/s", "transport", "verdict"]


def table_rows(runs: list[dict]) -> list[list]:
    rows = []
    for r in runs:
        if r["error"]:
            rows.append([r["label"], "-", "-", None, None, None, "-", "-", None, "-", "error"])
        for p in r["pairs"]:
            for s in p["sizes"]:
                last = s["msg_bytes"] == p["msg_bytes"]
                rows.append([r["label"] + ("" if r["counts_for_exit"] else " (study)"),
                             f"GPU{p['src']}->GPU{p['dst']}", size_label(s["msg_bytes"]), s["ucx_gbps"],
                             s["memcpy_peer_gbps"], s["ratio"], _pct(s["nvlink_tx_fraction"]),
                             _pct(s["nvlink_rx_fraction"]), p["link_capacity_gbps"],
                             f"{s['transport']} ({s['transport_method']})", p["verdict"] if last else ""])
    return rows


def _pct(x):
    return "n/a" if x is None else f"{x:.0%}"


def render_markdown(payload: dict, goals: dict[int, float]) -> str:
    runs = payload["runs"]
    lines = [f"# verify-nvlink on {payload['host']}", "",
             f"Verdict: **{payload['verdict']}** (exit {payload['exit_code']}). Generated {payload['generated_utc']}, "
             f"driver {payload['driver'] or '?'}.", "", "```", payload["command"], "```", "",
             "## GPUs", "",
             markdown_table(["index", "name", "PCI bus", "UUID", "NVLinks to peers", "link GB/s"],
                            [[g["index"], g["name"], g["pci_bus_id"], g["uuid"],
                              ", ".join(f"{b}: {n}" for b, n in g["nvlink_peers"].items()) or "-",
                              g["link_speed_gbps"]] for g in payload["gpus"]]),
             "", "## Baseline: cudaMemcpyPeer", "", _baseline_table(payload["baseline"]), ""]
    lines += ["## Results", "", markdown_table(TABLE_HEADERS, table_rows(runs)), ""]
    lines += ["Runs marked *(study)* are `--variant` settings: reported, not counted in the exit status.", ""]
    for i, r in enumerate(runs):
        lines += _run_section(i, r)
    if goals:
        lines += ["## Benchmark goals (not verdicts)", "", _goals_table(runs, goals), ""]
    studies = [r for r in runs if not r["counts_for_exit"]]
    if studies:
        lines += ["## Settings studies (change vs the same UCX without the variant)", "",
                  _studies_table(runs, studies), ""]
    return "\n".join(lines + HOW_TO_READ)


HOW_TO_READ = [
    "## How to read this", "",
    "- `ucx GB/s`: ucx_perftest's overall bandwidth; perftest prints MB/s meaning MiB/s, converted to 1e9 B/s.",
    "- `NVLink tx/rx`: bytes the source GPU sent / the destination received on its NVLinks to the peer "
    "during the run, as a share of (iterations + warm-up) x size.",
    "- `cap GB/s`: active links x per-link speed (NVML); a result above it cannot be a transfer between GPUs.",
    "- transport evidence: `proto-used` = UCX_PROTO_INFO=used tables of the measured run; `proto-selected` = "
    "protocol-v2 selection tables; `lanes+ablation` = the endpoint's lanes (UCX_LOG_LEVEL=info) plus a run "
    "with UCX_TLS excluding cuda_ipc (UCX 1.13's default v1 protocols print no tables).", ""]


def _baseline_table(baseline: dict) -> str:
    brows = []
    for b in baseline["pairs"]:
        if b.get("error"):
            brows.append([b["src_uuid"][:12], b["dst_uuid"][:12], "-", "-", f"error: {b['error']}"])
        for r in b.get("results") or []:
            brows.append([b["src_uuid"][:12], b["dst_uuid"][:12], size_label(r["msg_bytes"]), r["gbps"],
                          _pct(b.get("counter_fraction"))])
    return markdown_table(["src", "dst", "size", "GB/s (median)", "NVLink counters saw"], brows)


def _run_section(i: int, r: dict) -> list[str]:
    """### R<i+1>: the run's UCX, settings, and every pair's verdict with its reasons and transport evidence."""
    lines = [f"### R{i + 1}: {r['label']}", "", f"- UCX: {r['ucx'].get('version')} -- {r['ucx'].get('source')} "
             f"({r['ucx'].get('prefix')})", f"- transport evidence: `{r['evidence_method']}`",
             f"- settings: {' '.join(f'{k}={v}' for k, v in r['env'].items()) or '(defaults)'}"]
    if r["error"]:
        lines.append(f"- **error**: {r['error']}")
    for p in r["pairs"]:
        lines.append(f"- GPU{p['src']}->GPU{p['dst']}: **{p['verdict']}** (measurement alone: "
                     f"{p['measurement_verdict']})")
        lines += [f"  - {x}" for x in p["reasons"]]
        lines += [f"  - note: {x}" for x in p["notes"]]
        for s in p["sizes"]:
            for d in s["transport_detail"]:
                lines.append(f"  - {size_label(s['msg_bytes'])} transport evidence: {d}")
    return lines + [""]


def _goals_table(runs: list[dict], goals: dict[int, float]) -> str:
    grows = []
    for r in runs:
        for p in r["pairs"]:
            cells = [r["label"], f"GPU{p['src']}->GPU{p['dst']}"]
            for size, goal in sorted(goals.items()):
                s = next((x for x in p["sizes"] if x["msg_bytes"] == size), None)
                met = goal_met(s["ratio"] if s else None, goal)
                cells.append("not measured" if s is None else
                             f"{s['ratio']:.2f} {'met' if met else 'NOT met'}" if s["ratio"] is not None else "n/a")
            grows.append(cells)
    return markdown_table(["run", "pair"] + [f"ratio @ {size_label(k)} >= {v}" for k, v in sorted(goals.items())],
                          grows)


def _studies_table(runs: list[dict], studies: list[dict]) -> str:
    """Each --variant run against the counted run of the same UCX: GB/s change per pair and size."""
    srows = []
    for r in studies:
        base = next((b for b in runs if b["counts_for_exit"] and b["ucx"].get("prefix") == r["ucx"].get("prefix")),
                    None)
        for p in r["pairs"]:
            bp = next((q for q in (base or {}).get("pairs", []) if q["src"] == p["src"] and q["dst"] == p["dst"]),
                      None)
            for s in p["sizes"]:
                bs = next((x for x in (bp or {}).get("sizes", []) if x["msg_bytes"] == s["msg_bytes"]), None)
                delta = (f"{(s['ucx_gbps'] / bs['ucx_gbps'] - 1):+.1%}" if bs and bs["ucx_gbps"] else "n/a")
                srows.append([r["label"], f"GPU{p['src']}->GPU{p['dst']}", size_label(s["msg_bytes"]),
                              bs["ucx_gbps"] if bs else None, s["ucx_gbps"], delta, s["ratio"]])
    return markdown_table(["variant", "pair", "size", "base GB/s", "variant GB/s", "change", "ratio"], srows)


def render_png(payload: dict) -> bytes | None:
    """GB/s at the largest size: GPU x GPU for one run; pairs x runs (R1.. as in the markdown) for several."""
    all_runs = payload["runs"]
    fits = len(all_runs) <= 3 and all(len(r["label"]) <= 18 for r in all_runs)
    labelled = [(r["label"] if fits else f"R{i + 1}", r) for i, r in enumerate(all_runs) if r["pairs"]]
    if not labelled:
        return None
    big = size_label(labelled[0][1]["pairs"][0]["msg_bytes"])
    if len(labelled) == 1:
        run = labelled[0][1]
        idx = [g["index"] for g in payload["gpus"]]
        mat = [[None for _ in idx] for _ in idx]
        for p in run["pairs"]:
            mat[idx.index(p["src"])][idx.index(p["dst"])] = p["ucx_gbps"]
        return heatmap_png(mat, [f"GPU{i}" for i in idx], [f"GPU{i}" for i in idx],
                           f"ucx_perftest tag_bw {big}, {run['label']}", "GB/s")
    pairs = sorted({(p["src"], p["dst"]) for _, r in labelled for p in r["pairs"]})
    mat = [[next((p["ucx_gbps"] for p in r["pairs"] if (p["src"], p["dst"]) == pr), None) for _, r in labelled]
           for pr in pairs]
    return heatmap_png(mat, [f"{s}->{d}" for s, d in pairs], [lbl for lbl, _ in labelled],
                       f"ucx_perftest tag_bw {big} (GB/s)", "GB/s", xlabel="UCX run (see verify-nvlink.md)",
                       ylabel="GPU pair")


def recorded_command(cli_line: str, argv0: str | None = None) -> str:
    """command.txt's line: as typed, with `python3 -m ucx_dask_gpu.nvlink` when run as a module."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    if argv0.replace("\\", "/").endswith(("ucx_dask_gpu/nvlink/__main__.py", MODULE)):
        return shlex.join(["python3", "-m", MODULE, *shlex.split(cli_line)[1:]])
    return cli_line
