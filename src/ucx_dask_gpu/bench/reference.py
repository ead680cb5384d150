"""dask-cuda's own benchmark as the reference, run in the same invocation and read into our JSON.

`python -m dask_cuda.benchmarks.local_cupy` (transpose_sum or svd) with its defaults except what must match our run:
operation, protocol, size (and second size), chunk edge, devices, and the number of runs/warm-ups. On a GPU host it
starts its own LocalCUDACluster (RMM pool of half the GPU, 1 thread, automatic UCX transports, no other tuning).
Without GPUs local_cupy cannot start a cluster (it asks NVML for every device), so in CPU mode it runs with
`-t cpu --scheduler-address` against a plain LocalCluster that the benchmark starts with dask's defaults.

Its output is text (dask.utils.format_time / format_bytes: GiB/s, ms); parse_local_cupy() turns it into numbers.
What it prints per worker pair are quartiles of per-transfer bandwidth, so its p2p median is the median of the
per-pair medians (with 2 workers: the mean of the two), converted to GB/s (1e9 bytes/s).
"""
from __future__ import annotations

import ast
import re
from typing import Sequence

from .stats import GB, median
from .workloads import WORKLOADS

TOOL = "dask_cuda.benchmarks.local_cupy"

_BYTES = {"B": 1, "kiB": 2 ** 10, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30, "TiB": 2 ** 40, "PiB": 2 ** 50,
          "kB": 10 ** 3, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


class ReferenceOutputError(ValueError):
    """local_cupy's output does not look like what dask-cuda prints."""


def command(python: str, workload: str, protocol: str, size: int, chunk: int, runs: int, warmup: int,
            gpus: Sequence[int] | None = None, second_size: int | None = None,
            scheduler_address: str | None = None) -> list[str]:
    w = WORKLOADS[workload]
    cmd = [python, "-m", TOOL, "-o", w.reference_operation, "-p", protocol, "-s", str(size), "-c", str(chunk),
           "--runs", str(runs), "--warmup-runs", str(warmup), *w.reference_args(second_size)]
    if scheduler_address:
        cmd += ["-t", "cpu", "--scheduler-address", scheduler_address]
    else:
        cmd += ["-d", ",".join(str(g) for g in (gpus or [0]))]
    return cmd


def parse_bytes_text(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*", text)
    if not m or m.group(2) not in _BYTES:
        raise ReferenceOutputError(f"not a byte size: {text!r}")
    return float(m.group(1)) * _BYTES[m.group(2)]


def parse_rate(text: str) -> float:
    """'18.90 GiB/s' -> bytes per second."""
    t = text.strip()
    if not t.endswith("/s"):
        raise ReferenceOutputError(f"not a rate: {text!r}")
    return parse_bytes_text(t[:-2])


def parse_time_text(text: str) -> float:
    """dask.utils.format_time output -> seconds ('277.01 ms', '3.83 s', '11m 40s', '3hr 25m', '1d 2hr')."""
    t = text.strip()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(us|ms|s)", t)
    if m:
        return float(m.group(1)) * _TIME[m.group(2)]
    units = {"d": 86400, "hr": 3600, "m": 60, "s": 1}
    parts = re.findall(r"(\d+)(d|hr|m|s)\b", t)
    if parts and re.fullmatch(r"(\d+(d|hr|m|s)\s*)+", t):
        return float(sum(int(n) * units[u] for n, u in parts))
    raise ReferenceOutputError(f"not a duration: {text!r}")


def _kv(line: str) -> tuple[str, str] | None:
    if "|" not in line:
        return None
    key, _, value = line.partition("|")
    return key.strip(), value.strip()


def parse_local_cupy(text: str) -> dict:
    """Numbers from local_cupy's stdout (plain or --markdown). Raises ReferenceOutputError when it is not there."""
    lines = [ln.rstrip() for ln in text.splitlines()]
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == "Roundtrip benchmark")
    except StopIteration:
        raise ReferenceOutputError("no 'Roundtrip benchmark' block in the output") from None
    lines = lines[start + 1:]
    out: dict = {"wall_s": [], "throughput_bytes_per_s": [], "pairs": [], "worker_addresses": {}}
    fields = {
        "Operation": ("operation", str), "Array type": ("array_type", str), "User size": ("size", int),
        "User second size": ("second_size", int), "Compute shape": ("compute_shape", _tuple),
        "Compute chunk size": ("compute_chunk_size", _tuple), "Device(s)": ("devices", str),
        "Data processed": ("data_processed_bytes", parse_bytes_text), "RMM Pool": ("rmm_pool", _bool),
        "Protocol": ("protocol", str), "UCX transport selection": ("ucx_transport_selection", str),
        "Worker thread(s)": ("threads_per_worker", int), "Number of workers": ("workers", int),
    }
    section = "header"
    for ln in lines:
        s = ln.strip()
        if not s or s.startswith("```") or s.startswith("<details") or s.startswith("</details") \
                or s.startswith("<summary"):
            continue
        if re.fullmatch(r"[-=]+", s):
            if section in ("walls", "pairs", "workers") and s.startswith("="):
                section = "after"
            continue
        kv = _kv(s)
        if kv is None:
            continue
        key, value = kv
        if key == "Wall clock" and value == "Throughput":
            section = "walls"
            continue
        if key == "(w1,w2)":
            section = "pairs"
            continue
        if key == "Worker index" and value == "Worker address":
            section = "workers"
            continue
        if section == "walls":
            out["wall_s"].append(parse_time_text(key))
            out["throughput_bytes_per_s"].append(parse_rate(value))
        elif section == "pairs":
            m = re.fullmatch(r"\((\d+),\s*(\d+)\)", key)
            rate = r"([0-9]*\.?[0-9]+ ?[A-Za-z]+/s)"
            rates = re.fullmatch(rf"{rate}\s+{rate}\s+{rate}\s+\(([0-9]*\.?[0-9]+ ?[A-Za-z]+)\)", value)
            if not m or not rates:
                raise ReferenceOutputError(f"unreadable worker-pair line: {s!r}")
            q25, q50, q75 = (parse_rate(rates.group(i)) / GB for i in (1, 2, 3))
            out["pairs"].append({"src": int(m.group(1)), "dst": int(m.group(2)), "q25_gbps": round(q25, 4),
                                 "q50_gbps": round(q50, 4), "q75_gbps": round(q75, 4),
                                 "bytes": int(parse_bytes_text(rates.group(4)))})
        elif section == "workers":
            if key.isdigit():
                out["worker_addresses"][int(key)] = value
        elif key in fields:
            name, conv = fields[key]
            try:
                out[name] = conv(value)
            except (ValueError, SyntaxError):
                raise ReferenceOutputError(f"unreadable {key!r} value: {value!r}") from None
        elif key == "Bandwidth" and section == "after":
            m = re.fullmatch(r"(.+?/s)\s*\+/-\s*(.+?/s)", value)
            if m:
                out["bandwidth_hmean_gbps"] = round(parse_rate(m.group(1)) / GB, 4)
        elif key == "Throughput" and section == "after":
            m = re.fullmatch(r"(.+?/s)\s*\+/-\s*(.+?/s)", value)
            if m:
                out["throughput_hmean_bytes_per_s"] = parse_rate(m.group(1))
        elif key == "Wall clock" and section == "after":
            m = re.fullmatch(r"(.+?)\s*\+/-\s*(.+)", value)
            if m:
                out["wall_mean_s"] = parse_time_text(m.group(1))
    if not out["wall_s"]:
        raise ReferenceOutputError("no wall-clock rows in the output")
    q50s = [p["q50_gbps"] for p in out["pairs"]]
    out["p2p_gbps_median"] = round(median(q50s), 4) if q50s else None
    return out


def _tuple(value: str) -> list[int]:
    v = ast.literal_eval(value)
    if not isinstance(v, tuple) or not all(isinstance(i, int) for i in v):
        raise ValueError(value)
    return list(v)


def _bool(value: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(value)
    return value == "True"


TRACEBACK_RE = re.compile(r"^Traceback \(most recent call last\):")
EXCEPTION_RE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Timeout)\w*)\b")


def exceptions_in(lines: Sequence[str]) -> list[str]:
    """Exception class names that follow tracebacks in a log (e.g. ucxx's UCXXEndpointTimeoutError at teardown)."""
    names = []
    for ln in lines:
        m = EXCEPTION_RE.match(ln.strip())
        if m and ":" in ln:
            names.append(m.group(1).rsplit(".", 1)[-1])
    return sorted(set(names))
