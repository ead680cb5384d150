"""dask-cuda's own benchmark, `python -m dask_cuda.benchmarks.local_cupy`, beside ours: its command line, its runs
(within what --budget leaves) and its output read into numbers.

  - parity: local_cupy with OUR variant's config against that variant's running cluster (`--scheduler-address`):
    only the measuring loop differs, so median(local_cupy) / median(ours) should be 1.00;
  - peer: local_cupy with its own defaults: its own LocalCUDACluster where it can start one (one worker per GPU, two
    GPUs or more), else against a running variant with dask's and dask-cuda's defaults, or skipped with the reason.
Its per-pair output is quartiles of per-transfer bandwidth: its p2p median is the median of the per-pair medians.
"""
from __future__ import annotations

import ast
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Sequence

from ..cliutil import Progress, parse_bytes
from . import config
from .hosts import Child
from .options import Options
from .rounds import CLOSE_RESERVE_S, Budget, Record, reference_seconds
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
    out = {"tool": TOOL, "command": shlex.join(["python"] + cmd[1:]), "teardown": teardown,
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


def references(opts: Options, records: dict[str, Record], tmp: Path, budget: Budget, progress: Progress,
               own_cluster: bool) -> list[dict]:
    """The parity and peer runs that go against a running cluster (own_cluster False), or the peer run that starts
    its own (own_cluster True, after our clusters are closed)."""
    out: list[dict] = []
    peer_own = opts.mode == "gpu" and len(opts.gpus) >= 2
    if opts.parity and not own_cluster:
        out.append(reference_run(opts, "parity", records[opts.parity], records, tmp, budget, progress))
    if opts.peer and own_cluster == peer_own:
        target = None if peer_own else next(
            (r for r in records.values() if r.variant.config == "none" and not r.variant.settings
             and not r.variant.env and not r.variant.unset and r.host.alive), None)
        if target is None and not peer_own:
            out.append(skipped("peer", "local_cupy starts its own cluster only with one worker per GPU, 2 GPUs or "
                                       "more; no running variant has dask's and dask-cuda's defaults (CONFIG none, no "
                                       "settings) to run it against"))
        else:
            out.append(reference_run(opts, "peer", target, records, tmp, budget, progress))
    return out


def skipped(kind: str, why: str) -> dict:
    return {"tool": TOOL, "kind": kind, "status": "skipped", "error": why}


def reference_run(opts: Options, kind: str, target: Record | None, records: dict[str, Record], tmp: Path,
                  budget: Budget, progress: Progress) -> dict:
    """One local_cupy run, parity or peer, against `target`'s running cluster (None: its own), where --budget
    holds it."""
    v = target.variant if target else None
    protocol = v.protocol if v else config.find_variant(opts.variants, opts.baseline, "--baseline").protocol
    if target is not None and not target.host.alive:
        return skipped(kind, f"{v.name}'s cluster is down")
    need, left = reference_seconds(opts, records, v.name if v else None), budget.left() - (5 if v is None else
                                                                                          CLOSE_RESERVE_S)
    if need > left:
        return skipped(kind, f"not run: it needs ~{need:.0f} s, {left:.0f} s of --budget are left")
    parity = kind == "parity"
    env = config.variant_env(tmp / f"reference-{kind}", v.tree if parity else {}, v.env if parity else (),
                             v.unset if parity else ())
    size, chunk, extra = opts.study.reference_args(opts.params, target.overlay if target else {})
    cmd = command(opts.python, opts.study.reference_operation, protocol, size, chunk,
                  len(target.reps) if target and target.reps else opts.runs, max(1, opts.warmup), extra,
                  gpus=opts.gpus, scheduler=target.host.facts["scheduler"] if target else None, cpu=opts.mode == "cpu")
    res = run_local_cupy(cmd, env, min(opts.run_timeout * 2, max(10.0, left)), progress, f"{kind} local_cupy")
    res.update(kind=kind, protocol=protocol, against=v.name if target else "its own LocalCUDACluster",
               config=v.config if parity else "none (local_cupy's defaults)")
    return res
