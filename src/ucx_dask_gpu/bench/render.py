"""The report of a run: the JSON payload assembled from what the clusters answered, the stdout table, the markdown
page, the PNG (every sample of every variant, per metric; matplotlib where installed, else a note says why there is
none), and writing them together with command.txt."""
from __future__ import annotations

import importlib.util
import io
from pathlib import Path

from ..report import format_table, markdown_table, write_report
from . import config, stats

MIB = 1 << 20
VERSIONS_SHOWN = ("dask", "distributed", "dask-cuda", "distributed-ucxx", "ucxx", "rmm", "cupy", "numpy", "python")


def _mb(v):
    return None if v is None else round(v / 1e6, 2)


# --- the JSON -------------------------------------------------------------------------------------------------------

def run_entry(opts, rec, base) -> dict:
    v, primary = rec.variant, opts.study.primary(opts.params)
    names = list(dict.fromkeys(m for r in rec.reps for m in r["metrics"]))
    samples = {m: [round(x, 6) for x in rec.metric(m)] for m in names}
    moved = [r["bytes"] for r in rec.reps]

    def ratio(m: str) -> dict | None:
        # A metric's own bytes where the repetition has them (`steady_s` -> `steady_bytes`), else the repetition's.
        field = f"{m.removesuffix('_s')}_bytes"
        mine, theirs = ([r.get(field, r["bytes"]) for r in reps] for reps in (rec.reps, base.reps))
        if not stats.same_work(mine, theirs):
            return stats.different_work(mine, theirs)
        return stats.bootstrap_ratio(rec.metric(m), base.metric(m), opts.resamples, opts.seed)

    ratios = {} if rec is base or not base.reps or not rec.reps else {m: ratio(m) for m in names}
    transfers = [t for r in rec.reps for t in r.get("transfers", [])]
    workers = (rec.host.facts or {}).get("workers", [])
    p2p = stats.p2p(transfers, workers, len(rec.reps), MIB) if transfers else None
    return {
        **v.report(), "client_side": rec.overlay, "cluster": rec.host.id,
        "status": "error" if rec.error or rec.host.error and not rec.reps else
                  "ok" if len(rec.reps) >= opts.runs else "short",
        "error": rec.error or (rec.host.error if not rec.reps else None),
        "wall_s": samples.get(primary, []), "wall_s_median": stats.median(samples.get(primary, [])),
        "warmup_s": [round(r["metrics"].get(primary, 0.0), 6) for r in rec.warmup],
        "samples": samples, "summary": {m: stats.summary(vals) for m, vals in samples.items()},
        "bytes_moved": {"per_repetition": moved, "median": stats.median(moved),
                        "steady_per_repetition": [r["steady_bytes"] for r in rec.reps if "steady_bytes" in r],
                        "from_1MiB_per_repetition": [sum(t["bytes"] for t in r.get("transfers", [])
                                                         if t["bytes"] >= MIB) for r in rec.reps]},
        "p2p_gbps_median": p2p["gbps_median"] if p2p else None, "p2p": p2p,
        "ratio_to_baseline": ratios.get(primary), "ratios": ratios, "check": rec.check,
        "repetition_s_median": stats.median([r["total_s"] for r in rec.reps]),
        "chunk": next((r["chunk"] for r in rec.reps if "chunk" in r), None),
    }


def cluster_entry(h) -> dict:
    f = h.facts or {}
    return {"id": h.id, "protocol": h.variants[0].protocol, "variants": [v.name for v in h.variants],
            "config": h.tree, "environment": dict(h.variants[0].env), "status": "error" if h.error else "ok",
            "error": h.error, "start_s": f.get("start_s"), "class": f.get("cluster_class"),
            "scheduler": f.get("scheduler"), "workers": f.get("workers"), "worker_facts": f.get("worker_facts"),
            "scheduler_facts": f.get("scheduler_facts"), "client_facts": f.get("client_facts"),
            "versions_identical": f.get("versions_identical"),
            "version_differences": f.get("version_differences"), "shutdown": h.shutdown,
            "rc": getattr(h, "rc", None), "tracebacks": h.child.tracebacks, "ucx_proto_info": h.child.proto_info,
            **({"log_tail": list(h.child.stderr)[-60:]} if h.error or h.child.tracebacks else {})}


def reference_ratios(refs: list[dict], records: dict, baseline: str, opts) -> None:
    """parity: local_cupy against ours on the same cluster and config; peer: against the baseline variant."""
    for r in refs:
        if r.get("status") != "ok":
            continue
        ours = records.get(r["against"]) if r["kind"] == "parity" else records.get(baseline)
        if ours is not None:
            r["compared_with"] = ours.variant.name
            r["ratio_to_ours"] = stats.bootstrap_ratio(r["wall_s"], ours.metric("wall_s"), opts.resamples, opts.seed)
        walls = len(r["wall_s"]) + r.get("warmup_runs", max(1, opts.warmup))
        r["bytes_moved_from_1MiB_per_repetition"] = int(sum(p["bytes"] for p in r.get("pairs", [])) / walls)


def assemble(opts, records: dict, hosts: list, refs: list[dict], notes: list[str], prov: dict) -> dict:
    base = records[opts.baseline]
    runs = [run_entry(opts, rec, base) for rec in records.values()]
    reference_ratios(refs, records, opts.baseline, opts)
    notes = list(notes) + stats.bytes_moved_notes(
        {r["name"]: r["bytes_moved"]["per_repetition"] for r in runs if r["bytes_moved"]["per_repetition"]},
        opts.baseline)
    notes += [f"{r['name']}: {r['status']}: " + (r["error"] or f"{len(r['wall_s'])} of {opts.runs} timed repetitions")
              for r in runs if r["status"] != "ok"]
    notes += [f"{r['kind']} local_cupy {r['status']}: {r.get('error')}" for r in refs if r.get("status") != "ok"]
    notes += [f"{r['kind']} local_cupy chunk {c['index']}: {c['error']}" for r in refs if r.get("status") == "ok"
              for c in r.get("chunks", []) if c["status"] != "ok"]
    if opts.mode == "cpu":
        ignored = {v.name: config.cluster_settings(v.tree, True)[1] for v in opts.variants}
        notes += [f"{name}: ignored without GPUs: {', '.join(keys)}" for name, keys in ignored.items() if keys]
    prov["libucp"] = {h.id: {"client": (h.facts or {}).get("client_facts", {}).get("libucp"),
                             "scheduler": ((h.facts or {}).get("scheduler_facts") or {}).get("libucp"),
                             "workers": {a: f.get("libucp") for a, f in ((h.facts or {}).get("worker_facts")
                                                                         or {}).items()}} for h in hosts}
    return {
        "workload": opts.study.name, **opts.study.describe(opts.params),
        "gpus": prov.get("gpus", []), "mode": opts.mode, "workers": opts.workers,
        "protocols": sorted({v.protocol for v in opts.variants}), "baseline": opts.baseline,
        "primary_metric": opts.study.primary(opts.params),
        "measurement": {"repetitions": opts.runs, "warmup_rounds": opts.warmup, "seed": opts.seed,
                        "bootstrap": {"resamples": opts.resamples, "level": stats.LEVEL, "seed": opts.seed},
                        "interleaving": "every round runs each variant once; order forwards on even rounds, "
                                        "backwards on odd; same input seed for all variants of a round",
                        "client_keys": list(opts.client_keys), "placement": "input block (i, j) on worker i mod n"},
        "runs": runs, "clusters": [cluster_entry(h) for h in hosts],
        "reference": next((r for r in refs if r.get("kind") == "parity"), None), "references": refs,
        "notes": notes, "provenance": prov, "host": prov.get("host"),
    }


# --- text -----------------------------------------------------------------------------------------------------------

def result_rows(payload: dict) -> tuple[list[str], list[list]]:
    headers = ["variant", "metric", "status", "n", "median ms", "q25-q75 ms", "x baseline", "95% interval", "verdict",
               "MB/rep"]
    rows = []
    for r in payload["runs"]:
        for m, s in r["summary"].items():
            ratio = r["ratios"].get(m) or {}
            rows.append([r["name"], m, r["status"], s["n"], stats.to_ms(s["median"]),
                         f"{stats.to_ms(s['q25'], 2)}-{stats.to_ms(s['q75'], 2)}", ratio.get("median"),
                         "-" if not ratio.get("ci95") else f"{ratio['ci95'][0]}-{ratio['ci95'][1]}",
                         ratio.get("verdict", "baseline" if r["name"] == payload["baseline"] else "-"),
                         _mb(r["bytes_moved"]["median"])])
        if not r["summary"]:
            rows.append([r["name"], payload["primary_metric"], r["status"], 0] + [None] * 6)
    return headers, rows


def reference_rows(payload: dict) -> tuple[list[str], list[list]]:
    headers = ["local_cupy", "against", "config", "status", "n", "median ms", "x ours", "95% interval", "MB/rep"]
    rows = []
    for r in payload["references"]:
        ratio = r.get("ratio_to_ours") or {}
        walls = r.get("wall_s") or []
        rows.append([r["kind"], r.get("against", "-"), r.get("config", "-"), r.get("status"), len(walls),
                     stats.to_ms(stats.median(walls)), ratio.get("median"),
                     "-" if not ratio else f"{ratio['ci95'][0]}-{ratio['ci95'][1]}",
                     _mb(r.get("bytes_moved_from_1MiB_per_repetition"))])
    return headers, rows


def title(payload: dict) -> str:
    where = {"cpu": f"{payload['workers']} CPU workers", "shared": f"{payload['workers']} workers sharing one GPU",
             "gpu": f"{payload['workers']} GPUs"}[payload["mode"]]
    gpus = sorted({g.get("name") or "?" for g in payload["gpus"]})
    return f"{payload['workload']}: {payload.get('expression', '')} ({where}{', ' + ', '.join(gpus) if gpus else ''})"


def text(payload: dict) -> str:
    out = [title(payload), format_table(*result_rows(payload))]
    if payload["references"]:
        out += ["", format_table(*reference_rows(payload))]
    return "\n".join(out + ([""] + [f"note: {n}" for n in payload["notes"]] if payload["notes"] else []))


# --- markdown -------------------------------------------------------------------------------------------------------

def header(payload: dict, heading: str) -> list[str]:
    """A report page's head: its title, where and with what it ran (provenance.collect), the command that runs it."""
    return [f"# {heading}", "", *provenance_lines(payload), "", f"```\n{payload['provenance']['command']}\n```", ""]


def provenance_lines(payload: dict) -> list[str]:
    p = payload["provenance"]
    git = p.get("git") or {}
    dirty = {True: " (with uncommitted changes)", False: "", None: ""}[git.get("dirty")]
    when = f", {payload['date']}, {payload.get('duration_s')} s" if payload.get("date") else ""
    lines = [f"- host `{p.get('host')}`, {p.get('cpu_count')} CPUs{when}; commit `{git.get('commit')}`{dirty}",
             "- " + ", ".join(f"{k} {v}" for k, v in p.get("versions", {}).items()
                              if k.split("-cu")[0] in VERSIONS_SHOWN)]
    if p.get("driver") or p.get("error"):
        lines.append(f"- driver {p.get('driver')}, CUDA {p.get('cuda')}" + (f" ({p['error']})" if p.get("error") else ""))
    for g in p.get("gpus", []):
        lines.append(f"- GPU {g['index']} {g['name']}: SM {g.get('sm_clock_mhz')} MHz (applications "
                     f"{g.get('sm_clock_applications_mhz')}, max {g.get('sm_clock_max_mhz')}), memory "
                     f"{g.get('mem_clock_mhz')} MHz")
    for cid, lib in (p.get("libucp") or {}).items():
        ws = sorted({str(v) for v in lib["workers"].values()})
        lines.append(f"- {cid} libucp: client `{lib['client']}`, workers `{', '.join(ws) or '-'}`")
    return lines


def markdown(payload: dict) -> str:
    md = [*header(payload, title(payload)),
          f"## Results (baseline {payload['baseline']})", "", markdown_table(*result_rows(payload)), "",
          payload.get("measured", ""), "",
          f"Each variant: {payload['measurement']['repetitions']} timed repetitions asked, after "
          f"{payload['measurement']['warmup_rounds']} untimed rounds; {payload['measurement']['interleaving']}. "
          "`x baseline` is the ratio of medians (< 1: faster), its interval a percentile bootstrap "
          f"({payload['measurement']['bootstrap']['resamples']} resamples, seed "
          f"{payload['measurement']['bootstrap']['seed']}); verdict `faster` / `slower` where the interval lies below / "
          "above 1.0, `noise` where it holds 1.0, `different work` (no ratio) where the variant's median bytes moved "
          f"per repetition differ from the baseline's by more than {stats.SAME_WORK:.0%}. "
          f"Input: {payload['measurement']['placement']}; MB/rep: bytes moved between workers per repetition "
          "(transfer logs).", ""]
    if payload["references"]:
        md += ["## dask-cuda's local_cupy beside it", "", markdown_table(*reference_rows(payload)), "",
               "parity: local_cupy with the variant's config on that variant's running cluster (`x ours` should be "
               "1.00 +- 0.05); peer: local_cupy with its own defaults on a cluster of its own, against the baseline. "
               "local_cupy places its input where the scheduler puts it; MB/rep counts its transfers >= 1 MiB.", "",
               *[f"- {r['kind']}: {interleaving_text(r)}" for r in payload["references"]], ""]
    md += phase_lines(payload)
    md += ["## Clusters", "", markdown_table(
        ["cluster", "protocol", "variants", "start s", "workers", "clean stop", "tracebacks"],
        [[c["id"], c["protocol"], ", ".join(c["variants"]), c["start_s"], len(c["workers"] or []),
          (c["shutdown"] or {}).get("clean"), c["tracebacks"]] for c in payload["clusters"]]), ""]
    md += [f"- note: {n}" for n in payload["notes"]]
    return "\n".join(md) + "\n"


def interleaving_text(r: dict) -> str:
    """Where a reference ran and after which of our rounds each of its chunks did (older reports: after them all)."""
    ran = ", ".join(f"{c['runs']} (+{c['warmup_runs']} warm-up) after round {c['rounds_before']}"
                    for c in r.get("chunks", []) if c["status"] == "ok")
    return f"against {r.get('against', '-')}, config {r.get('config', '-')}; timed runs {ran or 'after our rounds'}"


def phase_lines(payload: dict) -> list[str]:
    """The traced rounds (transfer --trace): each segment's median ms per block size, per variant."""
    md = []
    for r in payload["runs"]:
        phases = (r.get("check") or {}).get("phases")
        if not phases:
            continue
        whats = list(dict.fromkeys(s["what"] for ph in phases for s in ph["segments"]))
        cell = {(ph["bytes"], s["what"]): s["ms_median"] for ph in phases for s in ph["segments"]}
        md += [f"## Where one transfer's time goes: {r['name']} ({phases[0]['samples']} traced, untimed transfers "
               "per size)", "", markdown_table(["phase"] + [f"{ph['bytes']} B, ms" for ph in phases],
                                                [[w] + [cell.get((ph["bytes"], w)) for ph in phases] for w in whats]
                                                + [["gather_dep (all)"] + [ph["gather_ms_median"] for ph in phases],
                                                   ["submit -> result (all)"] + [ph["e2e_ms_median"] for ph in phases]]),
               ""]
        md += [f"- {ph['bytes']} B, operations during gather_dep (median count): "
               + (", ".join(f"{k} {v:g}" for k, v in ph["ops_median"].items()) or "none traced (TCP)")
               for ph in phases] + [""]
    return md


# --- the picture ----------------------------------------------------------------------------------------------------

def png(payload: dict) -> bytes | None:
    """Every timed sample of every variant, one panel per metric (ms); None without matplotlib (noted)."""
    if importlib.util.find_spec("matplotlib") is None:
        payload["notes"].append("no PNG: matplotlib is not installed (`ucx-dask-gpu bench render NAME.json` "
                                "draws it where it is)")
        return None
    import matplotlib  # heavy: only where a picture is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(m for r in payload["runs"] for m in r["samples"]))
    if not metrics:
        payload["notes"].append("no PNG: no timed sample")
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics) + 1, 4), dpi=110, squeeze=False)
    for ax, m in zip(axes[0], metrics):
        runs = [r for r in payload["runs"] if r["samples"].get(m)]
        for i, r in enumerate(runs):
            ys = [v * 1e3 for v in r["samples"][m]]
            ax.scatter([i + (k % 7 - 3) * 0.03 for k in range(len(ys))], ys, s=10, alpha=0.6)
            ax.hlines(stats.median(ys), i - 0.3, i + 0.3, color="black")
        ax.set_xticks(range(len(runs)), [r["name"] for r in runs], rotation=30, ha="right", fontsize=7)
        ax.set_title(m, fontsize=9)
        ax.set_ylabel("ms")
        ax.set_ylim(bottom=0)
    fig.suptitle(title(payload), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def merged_command_txt(outdir: Path, command: str) -> str:
    """command.txt keeps one line per command that wrote into this directory (several studies share it)."""
    try:
        lines = [ln for ln in (outdir / "command.txt").read_text().splitlines() if ln.strip()]
    except OSError:
        lines = []
    return "\n".join(lines + ([command] if command not in lines else [])) + "\n"


def write(payload: dict, out: str | Path, name: str, command: str | None) -> list[Path]:
    picture = png(payload)  # first: it may add a note
    return write_report(out, name, payload, markdown(payload), picture,
                        command=merged_command_txt(Path(out), command) if command else None)

