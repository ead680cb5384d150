"""dask-cuda's own benchmark, `python -m dask_cuda.benchmarks.local_cupy`, beside ours: its command line, its runs
in chunks among our rounds (within what --budget leaves) and its output read into numbers.

  - parity: local_cupy with OUR variant's config against that variant's running cluster (`--scheduler-address`):
    only the measuring loop differs, so median(local_cupy) / median(ours) should be 1.00;
  - peer: local_cupy with its own defaults on a cluster of its own: its own LocalCUDACluster per chunk where it can
    start one (one worker per GPU, two GPUs or more), else a cluster started for it alone with dask's and dask-cuda's
    defaults, its RMM arguments applied by local_cupy itself (FORGET_RMM_SETUP).
local_cupy runs its own loop: `--runs k --warmup-runs w` per invocation, one chunk per block of our rounds, the walls
of every chunk merged. Its per-pair output is quartiles of per-transfer bandwidth: its p2p median is the median of the
per-pair (per-chunk) medians.
"""
from __future__ import annotations

import ast
import re
import shlex
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Sequence

from ..cliutil import Progress, parse_bytes
from . import config
from .hosts import Child, Host
from .options import Options
from .rounds import CLOSE_RESERVE_S, Budget, Record
from .stats import GB, median

TOOL = "dask_cuda.benchmarks.local_cupy"
EXCEPTION_RE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Timeout)\w*)\b")
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = r"([0-9]*\.?[0-9]+ ?[A-Za-z]+/s)"
GRACE_S = 30.0     # local_cupy printed everything: its teardown gets this long, then it is stopped


class ReferenceOutputError(ValueError):
    """local_cupy's output does not look like what dask-cuda prints."""


def command(python: str, operation: str, protocol: str, size: int, chunk: int, runs: int, warmup: int,
            extra: Sequence[str] = (), gpus: Sequence[int] | None = None, scheduler: str | None = None,
            cpu: bool = False) -> list[str]:
    cmd = [python, "-m", TOOL, "-o", operation, "-p", protocol, "-s", str(size), "-c", str(chunk), "--runs", str(runs),
           "--warmup-runs", str(warmup), *extra]
    if cpu:
        cmd += ["-t", "cpu"]
    return cmd + (["--scheduler-address", scheduler] if scheduler else ["-d", ",".join(map(str, gpus or [0]))])


def parse_bytes_text(text: str) -> int:
    try:
        return parse_bytes(text.strip())
    except (ValueError, TypeError):
        raise ReferenceOutputError(f"not a byte size: {text!r}") from None


def parse_rate(text: str) -> float:
    """'18.90 GiB/s' -> bytes per second."""
    t = text.strip()
    if not t.endswith("/s"):
        raise ReferenceOutputError(f"not a rate: {text!r}")
    return float(parse_bytes_text(t[:-2]))


def parse_time_text(text: str) -> float:
    """dask.utils.format_time output -> seconds ('277.01 ms', '3.83 s', '11m 40s', '3hr 25m', '1d 2hr')."""
    t = text.strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)", t)
    if m:
        return float(m.group(1)) * _TIME[m.group(2)]
    units = {"d": 86400, "hr": 3600, "m": 60, "s": 1}
    if re.fullmatch(r"(\d+(d|hr|m|s)\s*)+", t):
        return float(sum(int(n) * units[u] for n, u in re.findall(r"(\d+)(d|hr|m|s)\b", t)))
    raise ReferenceOutputError(f"not a duration: {text!r}")


def _tuple(value: str) -> list[int]:
    v = ast.literal_eval(value)
    if not isinstance(v, tuple) or not all(isinstance(i, int) for i in v):
        raise ValueError(value)
    return list(v)


def _bool(value: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(value)
    return value == "True"


FIELDS = {
    "Operation": ("operation", str), "Array type": ("array_type", str), "User size": ("size", int),
    "User second size": ("second_size", int), "Compute shape": ("compute_shape", _tuple),
    "Compute chunk size": ("compute_chunk_size", _tuple), "Device(s)": ("devices", str),
    "Data processed": ("data_processed_bytes", parse_bytes_text), "RMM Pool": ("rmm_pool", _bool),
    "Protocol": ("protocol", str), "UCX transport selection": ("ucx_transport_selection", str),
    "Worker thread(s)": ("threads_per_worker", int), "Number of workers": ("workers", int),
}
HEADER = {name for name, _ in FIELDS.values()} | {"worker_addresses", "cluster_rmm_kept"}
SECTIONS = {("Wall clock", "Throughput"): "walls", ("(w1,w2)", None): "pairs",
            ("Worker index", "Worker address"): "workers"}


def parse_local_cupy(text: str) -> dict:
    """Numbers from local_cupy's stdout (plain or --markdown). Raises ReferenceOutputError when they are not there."""
    lines = [ln.strip() for ln in text.splitlines()]
    try:
        start = lines.index("Roundtrip benchmark")
    except ValueError:
        raise ReferenceOutputError("no 'Roundtrip benchmark' block in the output") from None
    out: dict = {"wall_s": [], "throughput_bytes_per_s": [], "pairs": [], "worker_addresses": {}}
    section = "header"
    for s in lines[start + 1:]:
        if re.fullmatch(r"[-=]+", s):
            section = "after" if section in ("walls", "pairs", "workers") and s.startswith("=") else section
            continue
        if "|" not in s or s.startswith(("```", "<")):
            continue
        key, _, value = (p.strip() for p in s.partition("|"))
        marker = SECTIONS.get((key, value)) or SECTIONS.get((key, None))
        if marker:
            section = marker
            continue
        _parse_row(out, section, key, value, s)
    if not out["wall_s"]:
        raise ReferenceOutputError("no wall-clock rows in the output")
    q50s = [p["q50_gbps"] for p in out["pairs"]]
    out["p2p_gbps_median"] = round(median(q50s), 4) if q50s else None
    return out


def _parse_row(out: dict, section: str, key: str, value: str, line: str) -> None:
    if section == "walls":
        out["wall_s"].append(parse_time_text(key))
        out["throughput_bytes_per_s"].append(parse_rate(value))
    elif section == "pairs":
        m = re.fullmatch(r"\((\d+),\s*(\d+)\)", key)
        rates = re.fullmatch(rf"{_RATE}\s+{_RATE}\s+{_RATE}\s+\(([0-9]*\.?[0-9]+ ?[A-Za-z]+)\)", value)
        if not m or not rates:
            raise ReferenceOutputError(f"unreadable worker-pair line: {line!r}")
        q25, q50, q75 = (parse_rate(rates.group(i)) / GB for i in (1, 2, 3))
        out["pairs"].append({"src": int(m.group(1)), "dst": int(m.group(2)), "q25_gbps": round(q25, 4),
                             "q50_gbps": round(q50, 4), "q75_gbps": round(q75, 4),
                             "bytes": parse_bytes_text(rates.group(4))})
    elif section == "workers":
        if key.isdigit():
            out["worker_addresses"][int(key)] = value
    elif key in FIELDS:
        name, conv = FIELDS[key]
        try:
            out[name] = conv(value)
        except (ValueError, SyntaxError):
            raise ReferenceOutputError(f"unreadable {key!r} value: {value!r}") from None
    elif section == "after" and key in ("Bandwidth", "Wall clock"):
        m = re.fullmatch(r"(.+?)\s*\+/-\s*(.+)", value)
        if m and key == "Bandwidth":
            out["bandwidth_hmean_gbps"] = round(parse_rate(m.group(1)) / GB, 4)
        elif m:
            out["wall_mean_s"] = parse_time_text(m.group(1))


def printed_everything(lines: list[str]) -> bool:
    """local_cupy's output ends with the worker table closed by a '=' rule (then it only shuts down)."""
    starts = [n for n, ln in enumerate(lines) if ln.startswith("Worker index")]
    return bool(starts) and any(ln.startswith("=" * 20) for ln in lines[starts[-1] + 2:])


def exceptions_in(lines: Sequence[str]) -> list[str]:
    """Exception class names in a log (e.g. ucxx's UCXXEndpointTimeoutError at teardown)."""
    return sorted({m.group(1).rsplit(".", 1)[-1] for m in (EXCEPTION_RE.match(ln.strip()) for ln in lines)
                   if m and ":" in m.string})


# --- the runs -------------------------------------------------------------------------------------------------------

def wait_printed(child: Child, timeout: float) -> str:
    """How local_cupy ended: it exited, it was stopped GRACE_S after printing everything, or it timed out."""
    deadline, printed = time.monotonic() + timeout, None
    while True:
        try:
            return f"exited with {child.proc.wait(timeout=0.5)}"
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            printed = printed or (now if printed_everything(list(child.stdout)) else None)
            if printed and now - printed > GRACE_S:
                return "stopped in its teardown (results complete)"
            if now > deadline:
                return f"timed out after {timeout:.0f} s"


def run_local_cupy(cmd: list[str], env: dict, timeout: float, progress: Progress, label: str) -> dict:
    """local_cupy to its end; once it has printed everything, its teardown gets a grace period, then it is stopped
    (its UCX teardown can sit in an endpoint timeout). Its numbers count once printed."""
    progress(f"[{label}] {shlex.join(cmd[1:])}")
    child = Child(cmd, env, label, progress)
    try:
        teardown = wait_printed(child, timeout)
    finally:
        child.kill()
    for t in child.threads:
        t.join(timeout=10)
    text = "\n".join(child.stdout)
    # local_cupy's own words where it leaves an external cluster's memory setup as it is
    out = {"tool": TOOL, "command": shlex.join(["python"] + cmd[1:]), "teardown": teardown,
           "cluster_rmm_kept": "RMM already setup on external cluster" in text,
           "tracebacks": child.tracebacks, "teardown_exceptions": exceptions_in(list(child.stderr)),
           "stdout": text[-20000:]}
    try:
        out.update(parse_local_cupy(text), status="ok")
    except ReferenceOutputError as e:
        tail = [ln for ln in child.stderr if ln.strip()][-1:] or ["(no output)"]
        out.update(status="error", error=f"{teardown}: {e}; last stderr line: {tail[0][:200]}",
                   log_tail=list(child.stderr)[-40:])
    progress(f"[{label}] {out['status']}" + (f": {out.get('error')}" if out["status"] != "ok" else
                                             f", wall median {median(out['wall_s']) * 1e3:.1f} ms"))
    return out


# --- in chunks among our rounds -------------------------------------------------------------------------------------

RUNS_PER_CHUNK = 5    # local_cupy's timed runs per invocation: its start (imports, client, cluster) stays a small share
START_S = 20.0        # one invocation's start, reserved from --budget
PEER_LABEL = "local_cupy-peer"
# dask-cuda's workers carry its RMMSetup plugin, and local_cupy keeps the memory setup of an external cluster whose
# workers carry one (dask_cuda/benchmarks/utils.py setup_memory_pools). Without it, local_cupy applies its own RMM
# arguments to the peer's workers and scheduler as on a cluster it starts (its defaults: an RMM pool, CuPy on it).
FORGET_RMM_SETUP = textwrap.dedent("""
    import sys
    from distributed import Client
    def forget(dask_worker):
        names = [n for n in dask_worker.plugins if "RMMSetup" in n]
        for n in names:
            del dask_worker.plugins[n]
        return names
    with Client(sys.argv[1], timeout=60) as c:
        print(sum(bool(names) for names in c.run(forget).values()))
""")


def chunk_plan(runs: int, warmup: int, fresh: bool) -> list[dict]:
    """`runs` split evenly into chunks of at most RUNS_PER_CHUNK, each in the middle of its block of our rounds (after
    round `after_round`, 1-based); warm-up runs in the first chunk, or in each where each starts its own cluster."""
    n = -(-runs // RUNS_PER_CHUNK)
    sizes = [runs // n + (j < runs % n) for j in range(n)]
    return [{"index": j + 1, "after_round": sum(sizes[:j]) + (k + 1) // 2, "runs": k,
             "warmup_runs": warmup if j == 0 or fresh else 0, "status": "planned"} for j, k in enumerate(sizes)]


def peer_host(opts: Options, index: int, tmp: Path, progress: Progress) -> Host | None:
    """The peer's own cluster where local_cupy cannot start one (one GPU shared by two workers, or CPU): dask's and
    dask-cuda's defaults (CONFIG none, no settings), started as every variant's cluster is, used by the peer only."""
    if not opts.peer or opts.mode == "gpu":
        return None
    protocol = config.find_variant(opts.variants, opts.baseline, "--baseline").protocol
    return Host(index, config.parse_variant(f"{protocol}@{PEER_LABEL}:none", [protocol], opts.mode == "cpu"), opts,
                tmp, progress)


def beside(opts: Options, records: dict[str, Record], peer: Host | None, tmp: Path) -> list["Beside"]:
    out = [Beside("parity", opts, tmp, records[opts.parity])] if opts.parity else []
    target = Record(peer.variants[0], peer, {}) if peer else None
    return out + ([Beside("peer", opts, tmp, target)] if opts.peer else [])


class Beside:
    """One local_cupy reference, run in chunks among our rounds: parity (a variant's config, against its running
    cluster) or peer (its own cluster: `target` is the peer's Host, or None where local_cupy starts one per chunk)."""

    def __init__(self, kind: str, opts: Options, tmp: Path, target: Record | None):
        self.kind, self.opts, self.target, self.rmm_handed = kind, opts, target, None
        v = target.variant if target else None
        self.protocol = (v or config.find_variant(opts.variants, opts.baseline, "--baseline")).protocol
        self.pace = opts.parity if kind == "parity" else opts.baseline
        self.env = config.variant_env(tmp / f"reference-{kind}", *((v.tree, v.env, v.unset) if v else ({},)))
        self.args = opts.study.reference_args(opts.params, target.overlay if target else {})
        self.chunks = chunk_plan(opts.runs, max(1, opts.warmup), target is None)

    def seconds(self, records: dict[str, Record], chunk: dict) -> float:
        """A chunk's expected time: its start, then its runs at the pace of our repetitions (which make inputs too)."""
        rec = records.get(self.pace)
        pace = median([r["total_s"] for r in rec.reps + rec.warmup]) if rec else None
        return START_S + 1.2 * (chunk["runs"] + chunk["warmup_runs"]) * (pace or 1.0)

    def owed_seconds(self, records: dict[str, Record], rounds: int) -> float:
        """What a chunk of the timed runs local_cupy would owe once `rounds` of ours are over takes (0: none owed)."""
        owed = rounds - sum(c["runs"] for c in self.chunks if c["status"] == "ok")
        warmup = next((c["warmup_runs"] for c in self.chunks if c["status"] == "planned"), 0)
        return self.seconds(records, {"runs": owed, "warmup_runs": warmup}) if owed > 0 else 0.0

    def after_round(self, done: int, records: dict[str, Record], budget: Budget, progress: Progress,
                    ours: float = 0.0, final: bool = False) -> None:
        """The chunks due once `done` of our timed rounds are over (`ours`: seconds our rounds still need). `final`:
        every chunk left (our rounds stopped before its turn), trimmed to as many timed runs as our rounds."""
        for c in self.chunks:
            if c["status"] == "planned" and (final or c["after_round"] <= done):
                if final:
                    c["runs"] = min(c["runs"], done - sum(x["runs"] for x in self.chunks if x["status"] == "ok"))
                self.run_chunk(c, done, records, budget, progress, ours)

    def run_chunk(self, c: dict, done: int, records: dict[str, Record], budget: Budget, progress: Progress,
                  ours: float) -> None:
        left, need = budget.left() - CLOSE_RESERVE_S - ours, self.seconds(records, c)
        c["rounds_before"], t = done, self.target
        why = ("an earlier chunk failed" if any(x["status"] == "error" for x in self.chunks) else
               f"our timed rounds stopped after {done}" if c["runs"] < 1 else
               f"{t.variant.name}'s cluster ({t.host.id}) is down" if t and not t.host.alive else
               f"not run: it needs ~{need:.0f} s, {left:.0f} s of --budget are left" if need > left else None)
        if why is None and self.kind == "peer" and t and self.opts.mode == "shared" and self.rmm_handed is None:
            failed = self.hand_rmm_over(min(120.0, left))
            if failed:
                c.update(status="error", error=failed)
                return
        if why:
            c.update(status="skipped", error=why)
            return
        o, (size, edge, extra) = self.opts, self.args
        cmd = command(o.python, o.study.reference_operation, self.protocol, size, edge, c["runs"], c["warmup_runs"],
                      extra, gpus=o.gpus, scheduler=t.host.facts["scheduler"] if t else None, cpu=o.mode == "cpu")
        c["start_s"] = round(time.monotonic() - budget.start, 2)
        c.update(run_local_cupy(cmd, self.env, min(o.run_timeout * 2, max(10.0, left)), progress,
                                f"{self.kind} local_cupy {c['index']}/{len(self.chunks)}"),
                 end_s=round(time.monotonic() - budget.start, 2))

    def hand_rmm_over(self, timeout: float) -> str | None:
        """FORGET_RMM_SETUP on the peer's cluster, once (it prints how many workers had one); what went wrong, if
        anything."""
        cmd = [self.opts.python, "-c", FORGET_RMM_SETUP, self.target.host.facts["scheduler"]]
        try:
            proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"dask-cuda's RMMSetup stayed on the peer's workers: no answer within {timeout:.0f} s"
        self.rmm_handed = (proc.stdout.strip().splitlines() or [""])[-1]
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:200]
        return None if proc.returncode == 0 else f"dask-cuda's RMMSetup stayed on the peer's workers: {tail}"

    def report(self) -> dict:
        """Every chunk as it ran, and their walls, worker-pair rows and header merged into one reference entry."""
        ok = [c for c in self.chunks if c["status"] == "ok"]
        bad = next((c for c in self.chunks if c["status"] == "error"), None) or (
            None if ok else next((c for c in self.chunks if c["status"] != "ok"), None))
        after = [c["after_round"] for c in self.chunks]
        gaps = [b - a for a, b in zip(after, after[1:])]
        out = {"tool": TOOL, "kind": self.kind, "protocol": self.protocol, **self.against(),
               "command": next((c["command"] for c in self.chunks if "command" in c), None),
               "interleaving": {"chunks": len(self.chunks), "runs_per_chunk": [c["runs"] for c in self.chunks],
                                "after_rounds": after, "rounds_between_chunks": gaps,
                                "warmup_runs": [c["warmup_runs"] for c in self.chunks]},
               "chunks": self.chunks, "status": "error" if bad and bad["status"] == "error" else "ok" if ok else
               "skipped", "error": bad and f"chunk {bad['index']}/{len(self.chunks)}: {bad['error']}"}
        if ok:
            out.update({k: v for k, v in ok[0].items() if k in HEADER}, warmup_runs=sum(c["warmup_runs"] for c in ok),
                       wall_s=[w for c in ok for w in c["wall_s"]],
                       throughput_bytes_per_s=[x for c in ok for x in c["throughput_bytes_per_s"]],
                       pairs=[{**p, "chunk": c["index"]} for c in ok for p in c["pairs"]])
            q50s = [p["q50_gbps"] for p in out["pairs"]]
            out["p2p_gbps_median"] = round(median(q50s), 4) if q50s else None
        return out

    def against(self) -> dict:
        if self.kind == "parity":
            return {"against": self.target.variant.name, "config": self.target.variant.config,
                    "cluster": self.target.host.id}
        if self.target is None:
            return {"against": "its own LocalCUDACluster", "config": "none (local_cupy's defaults)", "cluster": None}
        rmm = "RMM: the cluster's (dask-cuda's RMMSetup stayed)" if self.rmm_handed is None else \
            f"local_cupy's RMM arguments (dask-cuda's RMMSetup removed from {self.rmm_handed} workers)"
        return {"against": f"its own cluster {self.target.host.id}", "cluster": self.target.host.id,
                "config": "none (dask's defaults)" if self.opts.mode == "cpu" else f"none (dask + dask-cuda), {rmm}"}
