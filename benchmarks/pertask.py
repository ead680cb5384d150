"""Where one task's time goes: the steady-state transpose `(x + x.T).sum()` (x persisted, every repeat moves only a
few bytes) on a cluster started with the real launchers (`dask scheduler`, two `dask cuda worker` sharing one GPU, or
two `dask worker` with --cpu; the shipped dask config), the client its own process.

Two views of the same cluster:
- Dask's task stream over --runs timed repeats: per repeat, submit -> first task start (client -> scheduler ->
  worker; split by the scheduler's update-graph metrics: GRAPH_PARTS), the tasks on the workers (compute vs. the gaps
  between them), last task stop -> result at the client (worker -> scheduler -> client); per task its compute time,
  and the dependency latency of the two tasks that wait for others (the aggregate for every block, finalize for the
  aggregate): the scheduler's round trip between tasks.
- py-spy (PyPI) sampling the scheduler, both worker processes and the client while the repeats run for --profile-s
  seconds: per process the share of the wall it was busy, and that busy time by the code it was in (innermost frame
  that names a part: scheduler transitions, the worker's state machine, UCXX, comm and (de)serialisation, the event
  loop, task execution).

usage: python benchmarks/pertask.py (--cpu | --shared-gpu I) [--size N --chunks C] [--runs N] [--profile-s S]
                                   [--variant V] --out DIR
       python benchmarks/pertask.py --render DIR   (the breakdown and pertask.md again from a recorded run)
Writes DIR/pertask.json, DIR/pertask.md and DIR/pertask-stream.json, all or none; a file of those names there that
it did not write is refused before the cluster starts (exit 9). Needs py-spy on PATH (the version stack.toml
[gpu_host].profiler pins; tools/gpu-host/fetch_wheels.sh fetches it for a GPU host) and ptrace rights over the
cluster's processes.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ucx_dask_gpu import fsutil
from ucx_dask_gpu.bench import config, idle, provenance, render
from ucx_dask_gpu.errors import UserError

# A sample whose innermost frame waits (the event loop's selector, a lock, an idle executor thread) is not busy,
# whatever py-spy's idle heuristic said of the thread.
WAITING = ("Selector.select", "Condition.wait", "Event.wait", "_worker (concurrent/futures/thread.py",
           "Thread._wait_for_tstate_lock", "sleep (")
CATEGORIES = [  # (name, substrings of a frame "function (file)"): the innermost frame that matches names the sample
    ("task execution", ("cupy/", "numpy/", "_execute_task", "apply_function", "execute_task")),
    ("ucxx", ("ucxx/", "distributed_ucxx/")),
    ("(de)serialisation", ("distributed/protocol/", "msgpack", "pickle", "cloudpickle")),
    ("scheduler transitions", ("distributed/scheduler.py",)),
    ("worker state machine", ("distributed/worker_state_machine.py", "distributed/worker.py")),
    ("comm and batched send", ("distributed/comm/", "distributed/batched.py", "distributed/core.py")),
    ("client", ("distributed/client.py",)),
    ("dask graph", ("dask/", "dask_expr")),
    ("event loop", ("asyncio/", "tornado/", "selectors.py")),
]

CLIENT = r"""
import json, sys, time
from pathlib import Path
import dask, dask.array as da
from distributed import Client, get_task_stream, wait
from ucx_dask_gpu.proof.transpose import transpose_sum
sched_file, workdir, size, chunks, runs, profile_s, cpu = sys.argv[1:8]
size, chunks, runs, profile_s, cpu = int(size), int(chunks), int(runs), float(profile_s), cpu == "1"
work = Path(workdir)
with Client(scheduler_file=sched_file, timeout=60) as c:
    c.wait_for_workers(2, timeout=120)
    rs = da.random.RandomState(0) if cpu else da.random.RandomState(0, RandomState=__import__("cupy").random.RandomState)
    x = rs.random_sample((size, size), chunks=chunks).persist()
    wait(x)
    expr = transpose_sum(x)  # as `ucx-dask-gpu workload transpose` sums
    for _ in range(5):
        expr.compute()
    walls = []
    with get_task_stream(client=c) as ts:
        for _ in range(runs):
            t0 = time.time()
            expr.compute()
            walls.append((t0, time.time()))
    (work / "profile-start").write_text("")
    time.sleep(1.0)  # py-spy attaches
    end, n = time.monotonic() + profile_s, 0
    while time.monotonic() < end:
        expr.compute()
        n += 1
    stream = [{"key": str(t["key"]), "worker": t["worker"],
               "startstops": [dict(s) for s in t["startstops"]]} for t in ts.data]
    # The scheduler's own account of each graph it received (its "update-graph" event on this client's topic).
    graphs = [e["metrics"] for _, e in c.get_events(c.id)
              if isinstance(e, dict) and e.get("action") == "update-graph" and "metrics" in e]
    json.dump({"walls": walls, "stream": stream, "graphs": graphs, "profile_runs": n,
               "workers": sorted(c.scheduler_info()["workers"])}, open(work / "client.json", "w"))
"""


def category(frame: str) -> str | None:
    return next((name for name, marks in CATEGORIES if any(m in frame for m in marks)), None)


def summarise_profile(raw: Path, seconds: float, rate: int) -> dict:
    """py-spy's raw output (collapsed stacks "frame;frame;...;leaf COUNT", idle threads left out): the busy share of
    the wall and the busy samples by category and by innermost function."""
    by_cat, by_leaf, total = collections.Counter(), collections.Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [f for f in stack.split(";") if f and not f.startswith("process ") and not f.startswith("thread ")]
        leaf = frames[-1] if frames else "?"
        if any(w in leaf for w in WAITING):
            continue
        total += n
        by_cat[next((c for f in reversed(frames) if (c := category(f))), "other")] += n
        by_leaf[leaf.split(" (")[0] + " (" + leaf.split(" (")[-1].split(":")[0].rstrip(")") + ")"] += n
    return {"busy_share": round(total / (seconds * rate), 4) if seconds else None, "samples": total,
            "by_category": {k: round(v / total, 4) for k, v in by_cat.most_common()} if total else {},
            "top_leaves": [[k, round(v / total, 4)] for k, v in by_leaf.most_common(12)] if total else []}


GRAPH_PARTS = {  # the parts of submit -> first task start, from the scheduler's update-graph metrics
    "to_update_graph_ms": "client: the graph built, optimised, packed and sent; the scheduler starts on it",
    "materialise_ms": "scheduler: the graph deserialised and materialised (in its offload thread)",
    "order_ms": "scheduler: dask.order (in its offload thread)",
    "task_states_ms": "scheduler: task states made, first transitions",
    "dispatch_ms": "scheduler -> worker: compute-task sent, received, handed to the executor thread, started",
}


def _graph_parts(graphs: list[dict], t0: float, first: float) -> dict:
    """The update-graph metrics of the graph the repeat submitted at `t0` (scheduler clock = client clock: one host)
    split into GRAPH_PARTS; {} where none started between `t0` and the repeat's first task. distributed 2026.7 reports
    the ordering and state durations as negative differences: their size is what counts."""
    m = next((g for g in graphs if t0 <= g.get("start_timestamp_seconds", 0) <= first), None)
    if m is None:
        return {}
    start, done = m["start_timestamp_seconds"], m["start_timestamp_seconds"] + m["duration_seconds"]
    return {"to_update_graph_ms": (start - t0) * 1e3, "materialise_ms": m["materialization_duration_seconds"] * 1e3,
            "order_ms": abs(m["ordering_duration_seconds"]) * 1e3,
            "task_states_ms": abs(m["state_initialization_duration_seconds"]) * 1e3,
            "dispatch_ms": (first - done) * 1e3}


def breakdown(data: dict) -> dict:
    """Per repeat and per task, from the task stream (times are the workers' and the client's clocks: one host)."""
    # Every repeat computes the same keys, and a record's startstops accumulate over the repeats of its key on that
    # worker: one event per distinct (key, compute start, stop), given to the repeat whose window holds its start.
    events = sorted({(t["key"], t["worker"], s["start"], s["stop"]) for t in data["stream"] for s in t["startstops"]
                     if s["action"] == "compute"}, key=lambda e: e[2])
    per_run = []
    for t0, t1 in data["walls"]:
        mine = {}
        for key, worker, start, stop in events:
            if t0 <= start <= t1 and key not in mine:
                mine[key] = {"start": start, "stop": stop, "worker": worker}
        if not mine:
            continue
        first, last = min(v["start"] for v in mine.values()), max(v["stop"] for v in mine.values())
        compute = sum(v["stop"] - v["start"] for v in mine.values())
        # The graph of the steady-state transpose: blocks (fused add + transpose + partial sum, inputs resident),
        # then `sum-aggregate-*` of every block's partial, then `finalize-*` of the aggregate; each of the last two
        # waits for the scheduler to learn that its inputs are done and to send it to a worker.
        blocks = [v for k, v in mine.items() if "aggregate" not in k and not k.startswith("finalize")]
        agg = [v for k, v in mine.items() if "aggregate" in k]
        fin = [v for k, v in mine.items() if k.startswith("finalize")]
        latency = ([agg[0]["start"] - max(b["stop"] for b in blocks)] if agg and blocks else []) + \
                  ([fin[0]["start"] - agg[0]["stop"]] if fin and agg else [])
        # Placement: a worker runs its blocks one after another (one thread each), so the worker with the most
        # blocks sets how long the blocks take, whatever the other one does.
        by_worker = collections.defaultdict(list)
        for b in blocks:
            by_worker[b["worker"]].append(b)
        busiest = max(by_worker.values(), key=len, default=[])
        per_run.append({**_graph_parts(data.get("graphs", []), t0, first),
                        "wall_ms": (t1 - t0) * 1e3, "tasks": len(mine), "submit_to_first_task_ms": (first - t0) * 1e3,
                        "on_workers_ms": (last - first) * 1e3, "compute_sum_ms": compute * 1e3,
                        "last_task_to_result_ms": (t1 - last) * 1e3,
                        "task_compute_ms": [(v["stop"] - v["start"]) * 1e3 for v in mine.values()],
                        "dependency_latency_ms": [x * 1e3 for x in latency],
                        "blocks_per_worker": sorted((len(v) for v in by_worker.values()), reverse=True)
                        + [0] * (len(data.get("workers", ())) - len(by_worker)),
                        "busiest_worker_blocks_ms": (max(b["stop"] for b in busiest) - min(b["start"] for b in busiest))
                        * 1e3 if busiest else None})
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    flat = lambda k: [x for r in per_run for x in r[k]]  # noqa: E731
    return {**{k: med([r[k] for r in per_run if k in r]) for k in GRAPH_PARTS},
            "repeats": len(per_run), "tasks_per_repeat": med([r["tasks"] for r in per_run]),
            "wall_ms": med([r["wall_ms"] for r in per_run]),
            "submit_to_first_task_ms": med([r["submit_to_first_task_ms"] for r in per_run]),
            "on_workers_ms": med([r["on_workers_ms"] for r in per_run]),
            "compute_sum_ms": med([r["compute_sum_ms"] for r in per_run]),
            "last_task_to_result_ms": med([r["last_task_to_result_ms"] for r in per_run]),
            "task_compute_ms": med(flat("task_compute_ms")),
            "dependency_latency_ms": med(flat("dependency_latency_ms")),
            "dependency_latency_q75_ms": round(statistics.quantiles(flat("dependency_latency_ms"), n=4)[2], 3)
            if len(flat("dependency_latency_ms")) > 3 else None,
            "blocks_per_worker": [med(list(c)) for c in zip(*(r["blocks_per_worker"] for r in per_run))],
            "busiest_worker_blocks_ms": med([r["busiest_worker_blocks_ms"] for r in per_run
                                             if r["busiest_worker_blocks_ms"] is not None])}


def markdown(p: dict) -> str:
    b = p["task_stream"]
    md = [*render.header(p, f"Per-task breakdown: steady-state (x + x.T).sum(), {p['size']}^2 in {p['chunks']}^2 "
                            f"chunks, {p['mode']}"),
          f"Launchers: dask scheduler + 2 {'dask worker' if p['mode'] == 'cpu' else 'dask cuda worker'} "
          f"({p.get('variant', 'ucx@shipped:shipped')}), client its own process.", "",
          f"## Task stream ({b['repeats']} repeats, medians)", "",
          "| part | ms |", "|---|---|",
          f"| wall, submit -> result at the client | {b['wall_ms']} |",
          f"| submit -> first task starts (client -> scheduler -> worker) | {b['submit_to_first_task_ms']} |",
          *[f"| - {what} | {b.get(k)} |" for k, what in GRAPH_PARTS.items()],
          f"| first task start -> last task stop (on the workers) | {b['on_workers_ms']} |",
          f"| of which compute, summed over both workers | {b['compute_sum_ms']} |",
          f"| blocks per worker, busiest first | {' / '.join(str(n) for n in b.get('blocks_per_worker', []))} |",
          f"| the busiest worker's blocks, its first start -> last stop | {b.get('busiest_worker_blocks_ms')} |",
          f"| last task stop -> result at the client (worker -> scheduler -> client) | {b['last_task_to_result_ms']} |",
          f"| tasks per repeat | {b['tasks_per_repeat']} |",
          f"| one task's compute | {b['task_compute_ms']} |",
          f"| dependency latency: the aggregate's start - the last block's stop, and finalize's start - the "
          f"aggregate's stop (q75 {b['dependency_latency_q75_ms']}) | {b['dependency_latency_ms']} |", "",
          f"## py-spy, {p['profile_s']} s of repeats ({p['profile_runs']} repeats), {p['rate']} samples/s", "",
          "| process | busy share of the wall | busy time by part |", "|---|---|---|"]
    for name, s in p["profiles"].items():
        parts = ", ".join(f"{k} {100 * v:.0f} %" for k, v in s.get("by_category", {}).items())
        md.append(f"| {name} | {100 * s['busy_share']:.0f} % | {parts} |" if s.get("busy_share") is not None
                  else f"| {name} | - | {s.get('error', '')} |")
    for name, s in p["profiles"].items():
        if s.get("top_leaves"):
            md += ["", f"{name}, innermost functions:", ""] + [f"- {k}: {100 * v:.1f} %" for k, v in s["top_leaves"]]
    return "\n".join(md) + "\n"


# What a run writes into --out: the breakdown, as a table, and the raw task stream it was computed from.
OUTPUTS = ("pertask.json", "pertask.md", "pertask-stream.json")


def render_again(out: Path) -> int:
    try:
        payload = json.loads((out / "pertask.json").read_text())
        payload["task_stream"] = breakdown(json.loads((out / "pertask-stream.json").read_text()))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"pertask: cannot render {out}: {e}")
    # The two files it was asked to draw again from: replacing them is what --render DIR means.
    write(out, {"pertask.json": json.dumps(payload, indent=2) + "\n", "pertask.md": markdown(payload)}, True)
    print(f"pertask: wrote {out / 'pertask.json'}, {out / 'pertask.md'}")
    return 0


def write(out: Path, files: dict[str, str], overwrite: bool = False) -> None:
    """All of them or none (a failed write keeps them and says where, exit 18)."""
    try:
        fsutil.write_output_dir(out, files, what="the breakdown", overwrite=overwrite)
    except UserError as e:
        print(f"pertask: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--cpu", action="store_true")
    where.add_argument("--shared-gpu")
    where.add_argument("--render", metavar="DIR", help="the task-stream breakdown and pertask.md again from DIR's "
                       "pertask-stream.json and pertask.json (profiles and provenance as recorded)")
    ap.add_argument("--size", type=int, default=20000)
    ap.add_argument("--chunks", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--profile-s", type=float, default=10.0)
    ap.add_argument("--rate", type=int, default=500)
    ap.add_argument("--out", help="required unless --render")
    ap.add_argument("--variant", default="ucx@shipped:shipped",
                    help="the cluster's variant, as `ucx-dask-gpu bench` writes one (default ucx@shipped:shipped)")
    args = ap.parse_args()
    if args.render:
        return render_again(Path(args.render))
    if not args.out:
        ap.error("--out DIR is required")
    try:  # before the cluster starts: a run whose breakdown could not be written is lost time
        fsutil.check_output_dir(args.out)
        fsutil.check_names_free(args.out, OUTPUTS, "--out")
    except UserError as e:
        ap.exit(e.exit_code, f"pertask: error: {e}\n")
    try:
        variants = config.parse_variants([args.variant], ["ucx"], args.cpu)
    except UserError as e:
        ap.error(str(e))
    if len(variants) != 1:
        ap.error("--variant: one protocol, one variant")
    (variant,) = variants
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        sys.exit("pertask: py-spy not on PATH (pip install py-spy)")
    command = "python benchmarks/pertask.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="pertask-") as tmp:
        tmp = Path(tmp)
        cluster = idle.Launched(variant, None if args.cpu else [args.shared_gpu], 2, tmp, sys.executable)
        try:
            cluster.connect_client(180)
            client = subprocess.Popen([sys.executable, "-c", CLIENT, str(cluster.sched_file), str(tmp), str(args.size),
                                       str(args.chunks), str(args.runs), str(args.profile_s), "1" if args.cpu else "0"],
                                      env=cluster.env, start_new_session=True)
            while not (tmp / "profile-start").exists():
                if client.poll() is not None:
                    sys.exit(f"pertask: the client exited ({client.returncode}) before profiling")
                time.sleep(0.05)
            pids = {n: p for n, p in cluster.pids().items() if n == "scheduler" or n.endswith("worker-process")}
            pids["client"] = client.pid
            spies = {n: subprocess.Popen([pyspy, "record", "-p", str(pid), "-r", str(args.rate), "-d",
                                          str(int(args.profile_s)), "-f", "raw", "-o", str(tmp / f"{n.replace('/', '-')}.txt"),
                                          "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                     for n, pid in pids.items()}
            errors = {n: s.communicate(timeout=args.profile_s + 60)[1].decode(errors="replace")[-300:]
                      for n, s in spies.items()}
            client.wait(args.profile_s + 120)
            stream = (tmp / "client.json").read_text()
            data = json.loads(stream)
        finally:
            cluster.stop()
        profiles = {}
        for n in pids:
            raw = tmp / f"{n.replace('/', '-')}.txt"
            profiles[n] = summarise_profile(raw, int(args.profile_s), args.rate) if raw.exists() and raw.stat().st_size \
                else {"error": errors[n].strip().splitlines()[-1] if errors[n].strip() else "no samples"}
    payload = {"schema_version": 1, "study": "pertask", "mode": "cpu" if args.cpu else "gpu", "variant": args.variant,
               "size": args.size,
               "chunks": args.chunks, "rate": args.rate, "profile_s": args.profile_s,
               "profile_runs": data["profile_runs"], "task_stream": breakdown(data), "profiles": profiles,
               "provenance": provenance.collect(command, None if args.cpu else [int(args.shared_gpu)])}
    write(Path(args.out), dict(zip(OUTPUTS, (json.dumps(payload, indent=2) + "\n", markdown(payload), stream))))
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
