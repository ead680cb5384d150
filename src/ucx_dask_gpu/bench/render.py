"""The benchmark report as text: the stdout table, the markdown page, and the per-pair heatmap."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from ..report import format_table, heatmap_png, markdown_table
from . import stats


def _ms(v):
    return None if v is None else round(v * 1e3, 2)


def _gb(nbytes):
    return None if nbytes is None else round(nbytes / 1e9, 3)


def _check(e) -> str:
    c = e.get("check")
    if not c:
        return "-"
    return "ok" if c.get("ok") else "MISMATCH"


def summary_rows(payload: dict) -> tuple[list[str], list[list]]:
    headers = ["protocol", "config", "status", "wall med ms", "wall min ms", "p2p med GB/s", "xfers/run", "GB/run",
               "check", "clean stop"]
    rows = []
    for e in payload["runs"]:
        p2p = e.get("p2p") or {}
        rows.append([e["protocol"], e["config"], e["status"], _ms(e["wall_s_median"]), _ms(e["wall_s_min"]),
                     e["p2p_gbps_median"], p2p.get("transfers_per_run"), _gb(p2p.get("bytes_per_run")), _check(e),
                     _yes((e.get("shutdown") or {}).get("clean"))])
    for r in payload.get("references", []):
        walls = r.get("wall_s") or []
        rows.append([r["protocol"], "local_cupy (reference)", r.get("status"), _ms(stats.median(walls)),
                     _ms(min(walls) if walls else None), r.get("p2p_gbps_median"), None, None, "-",
                     _yes(not r.get("process", {}).get("tracebacks")) if r.get("process") else None])
    return headers, rows


def _yes(v):
    return None if v is None else ("yes" if v else "NO")


def summary_lines(payload: dict) -> list[str]:
    s = payload["summary"]
    out = []
    if s.get("ucx_tcp_wall_ratio") is not None:
        out.append(f"UCX/TCP wall ratio: {s['ucx_tcp_wall_ratio']}x"
                   + (f" (reference: {s['reference_ucx_tcp_wall_ratio']}x)"
                      if s.get("reference_ucx_tcp_wall_ratio") is not None else ""))
    sp = s["metrics"].get("speedup_vs_reference")
    if sp is not None:
        out.append(f"{s['headline']} vs local_cupy ({payload['protocols'][0]}): {sp}x faster wall time")
    for g in s.get("goals", []):
        verdict = {True: "met", False: "NOT met", None: "no value"}[g["met"]]
        out.append(f"goal {g['goal']}: {verdict} (value {g['value']})")
    return out


def stdout_text(payload: dict) -> str:
    headers, rows = summary_rows(payload)
    text = [_title(payload), format_table(headers, rows)]
    if payload.get("sweep"):
        text.append("")
        text.append(format_table(*sweep_table(payload)))
    lines = summary_lines(payload)
    if lines:
        text += [""] + lines
    return "\n".join(text)


def _title(payload: dict) -> str:
    shape = "x".join(str(s) for s in payload["shape"])
    chunk = "x".join(str(c) for c in payload["chunk"])
    where = (f"{payload['workers']} CPU workers" if payload["mode"] == "cpu"
             else f"{payload['workers']} GPUs ({', '.join(sorted({g['name'] for g in payload['gpus']}))})")
    return (f"{payload['workload']} {payload['expression']}: {shape} {payload['dtype']} in {chunk} chunks "
            f"(--chunks {payload['chunks_requested']}), {where}")


def sweep_table(payload: dict) -> tuple[list[str], list[list]]:
    headers = ["knob (one change vs base)", "status", "wall med ms", "x base", "p2p med GB/s", "xfers/run"]
    rows = [[r["knob"], r["status"], _ms(r["wall_s_median"]), r["wall_vs_base"], r["p2p_gbps_median"],
             r["transfers_per_run"]] for r in payload["sweep"]]
    return headers, rows


def headline(payload: dict) -> dict | None:
    p0 = payload["protocols"][0]
    return next((e for e in payload["runs"] if e["kind"] == "base" and e["protocol"] == p0), None)


def _labels(payload: dict, run: dict) -> list[str]:
    devs = run.get("worker_devices") or {}
    out = []
    for i, w in enumerate(run.get("workers") or []):
        d = devs.get(w)
        out.append(f"GPU{d}" if d not in (None, "") and payload["mode"] == "gpu" else f"w{i}")
    return out


def heatmap(payload: dict) -> bytes | None:
    """The headline run's per-pair median as PNG; None without pairs, or without matplotlib (the report says so)."""
    run = headline(payload)
    if not run or not run.get("p2p") or not run["p2p"]["pairs"]:
        return None
    if importlib.util.find_spec("matplotlib") is None:
        payload.setdefault("notes", []).append("no PNG heatmap: matplotlib is not installed")
        return None
    labels = _labels(payload, run)
    title = (f"{payload['workload']} {payload['chunks_requested']}, {run['protocol']}\n"
             f"median GB/s per transfer")
    return heatmap_png(stats.pair_matrix(run["p2p"]), labels, labels, title, "GB/s")


def markdown(payload: dict) -> str:
    md = [f"# {_title(payload)}", ""]
    md.append(f"Host `{payload['host']}`, {payload['date']}, {payload['duration_s']} s. "
              f"Command: `{payload['command']}`")
    head = headline(payload)
    if head and head.get("versions"):
        md.append("")
        md.append("Versions: " + ", ".join(f"{k} {v}" for k, v in head["versions"].items()))
    md += ["", "## Results", "", markdown_table(*summary_rows(payload)), ""]
    md += ["Wall time: `wait(client.persist(result))` plus a device synchronisation on every worker, per "
           "repetition, as local_cupy measures it. p2p: per-transfer bandwidth from each worker's "
           "`transfer_incoming_log` over the timed repetitions (transfers < "
           f"{payload['measurement']['ignore_bytes']} B dropped), GB/s = 1e9 B/s; the reference's p2p is the median "
           "of its per-pair medians. distributed floors a transfer's duration at 1 ms, which caps what a 128 MiB "
           "transfer can show at 134 GB/s.", ""]
    lines = summary_lines(payload)
    if lines:
        md += [f"- {ln}" for ln in lines] + [""]
    if payload.get("sweep"):
        base = headline(payload)
        md += ["## Knob sweep", "",
               f"Each row changes one thing against `{base['config'] if base else '?'}` ({payload['protocols'][0]}); "
               "`x base` < 1 is faster. The `applied` field of each run in the JSON shows what the workers really "
               "ran with.", "", markdown_table(*sweep_table(payload)), ""]
    if head and head.get("p2p"):
        p = head["p2p"]
        md += [f"## Per-pair bandwidth ({head['protocol']} {head['config']})", ""]
        labels = _labels(payload, head)
        rows = [[f"{_lab(labels, x['src'])} -> {_lab(labels, x['dst'])}", x["transfers"], _gb(x["bytes"]),
                 x["q25_gbps"], x["q50_gbps"], x["q75_gbps"], x["bytes_per_second_gbps"]] for x in p["pairs"]]
        md += [markdown_table(["pair", "transfers", "GB", "q25 GB/s", "median GB/s", "q75 GB/s",
                               "GB/s (bytes / summed durations)"], rows), ""]
        arr = head.get("array") or {}
        if arr.get("offdiagonal_pairs"):
            md += [f"Input placement: {arr.get('placement')}; {arr.get('split_pairs')} of "
                   f"{arr.get('offdiagonal_pairs')} block pairs (i,j)/(j,i) live on different workers, so at least "
                   f"that many blocks must move per repetition.", ""]
        md += where_time_goes(head)
    for r in payload.get("references", []):
        md += [f"## Reference ({r['protocol']}): {r['tool']}", ""]
        if r.get("status") != "ok":
            md += [f"Failed: {r.get('error')}", ""]
            continue
        md += [f"`{r.get('command')}`", "",
               f"Wall: {', '.join(f'{_ms(w)} ms' for w in r['wall_s'])}; p2p per pair (median GB/s): "
               + ", ".join(f"({p['src']},{p['dst']}) {p['q50_gbps']}" for p in r.get("pairs", [])),
               "", f"Teardown: {r.get('teardown')}; {r['process']['tracebacks']} traceback(s) "
               f"{('(' + ', '.join(r['teardown_exceptions']) + ')') if r.get('teardown_exceptions') else ''}", ""]
    for note in payload.get("notes", []):
        md += [f"Note: {note}", ""]
    md += ["## Configuration", "", f"`--config {payload['config']['path'] or 'none'}` ({payload['config']['name']}):",
           "", "```json", json.dumps(payload["config"]["tree"], indent=2), "```", ""]
    return "\n".join(md)


def _lab(labels, i):
    return labels[i] if 0 <= i < len(labels) else str(i)


def where_time_goes(run: dict) -> list[str]:
    b = run.get("breakdown") or {}
    md = [f"## Where the time goes ({run['protocol']} {run['config']})", ""]
    ph = b.get("phases") or {}
    if ph:
        md += [f"One extra, untimed repetition with the scheduler's task stream: wall {_ms(ph.get('wall_s'))} ms = "
               f"{_ms(ph.get('start_latency_s'))} ms until the first task starts (submit + scheduling) + "
               f"{_ms(ph.get('active_s'))} ms of tasks + {_ms(ph.get('end_latency_s'))} ms after the last one "
               f"(result notification, device sync). {ph.get('tasks')} tasks; compute seconds per worker "
               f"{ph.get('compute_s_per_worker')}, transfer seconds per worker {ph.get('transfer_s_per_worker')}.",
               ""]
    dg = b.get("digests") or {}
    rows = []
    for side in ("gather-dep", "get-data"):
        for k, v in sorted((dg.get(side) or {}).items()):
            rows.append([side, k, _ms(v)])
    for prefix, acts in sorted((dg.get("execute") or {}).items()):
        rows.append(["execute", f"{prefix}: " + ", ".join(f"{a} {_ms(s)}" for a, s in sorted(acts.items())), None])
    if rows:
        md += ["distributed's fine performance metrics per timed repetition, summed over workers (ms): "
               "gather-dep = receiving, get-data = sending.", "",
               markdown_table(["activity", "part", "ms per repetition"], rows), ""]
    sc = b.get("size_classes") or []
    if sc:
        md += ["Transfers by size (all sizes; duration vs bytes shows the fixed cost per message):", "",
               markdown_table(["bytes from", "below", "transfers", "median bytes", "median ms", "median GB/s"],
                              [[r["bytes_from"], r["bytes_below"], r["transfers"], r["median_bytes"],
                                _ms(r["median_duration_s"]), r["median_gbps"]] for r in sc]), ""]
    return md


def merged_command_txt(outdir: Path | None, command: str) -> str:
    """command.txt keeps one line per command that wrote into this directory (several reports share it)."""
    lines = []
    if outdir is not None:
        try:
            lines = [ln for ln in (Path(outdir) / "command.txt").read_text().splitlines() if ln.strip()]
        except OSError:
            lines = []
    if command not in lines:
        lines.append(command)
    return "\n".join(lines) + "\n"
