"""The benchmarked computations, built the way dask-cuda's local_cupy builds them.

transpose: x = random (N, N), persisted; timed: (x + x.T).sum()
svd:       x = random (N, k) chunked by rows only (tall-skinny), persisted; timed: da.linalg.svd(x) -> (u, s, v)

The input comes from `da.random.RandomState(seed, RandomState=cupy|numpy.random.RandomState)`, local_cupy's own
generator, so both tools time the same kind of blocks. Each repetition gets a fresh input (another seed), so no
repetition can reuse the results or the fetched replicas of another.

The input generator is not the cluster-proof workloads' (ucx_dask_gpu.workloads generates blocks on the host with
numpy and checks against a client-side numpy answer, which for 40000^2 would add minutes of CPU per repetition and
differ from local_cupy's); the runner does share their compare_versions and warm_up. Here the check is an identity
computed on the cluster: sum(x + x.T) == 2 sum(x); for the SVD sum(s^2) == ||x||_F^2.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import USAGE, UserError

WORKLOADS = ("transpose", "svd")
CHECK_RTOL = 1e-9
SVD_CHECK_RTOL = 1e-8


@dataclass(frozen=True)
class Chunks:
    """What --chunks asked for: 'auto', a byte size ('128 MiB'), or block edge(s) in elements ('4096', '4096,2048')."""

    text: str

    def dask_chunks(self, workload: str, second: int):
        kind, value = parse_chunks(self.text)
        if workload == "svd":
            # rows only: one column block, as tsqr needs
            if kind == "shape":
                return (value[0], second)
            if kind == "bytes":
                from dask.utils import parse_bytes

                return (max(1, parse_bytes(value) // (8 * second)), second)  # float64 rows of `second` columns
            return ("auto", second)
        return value

    @property
    def label(self) -> str:
        kind, value = parse_chunks(self.text)
        if kind == "auto":
            return "auto"
        if kind == "bytes":
            return re.sub(r"\s+", "", self.text)
        return "x".join(str(v) for v in value)


def parse_chunks(text: str):
    """('auto', 'auto') | ('bytes', '128 MiB') | ('shape', (4096, 4096)). Raises UserError (USAGE) otherwise."""
    t = text.strip()
    if t == "auto":
        return "auto", "auto"
    if re.fullmatch(r"\d+(\s*,\s*\d+)?", t):
        parts = tuple(int(p) for p in t.split(","))
        if any(p <= 0 for p in parts):
            raise UserError(f"--chunks {text!r}: block edges must be positive", USAGE)
        return "shape", parts if len(parts) == 2 else (parts[0], parts[0])
    from dask.utils import parse_bytes

    try:
        n = parse_bytes(t)
    except (ValueError, TypeError):
        n = None
    if not n or n <= 0 or not re.search(r"[A-Za-z]", t):
        raise UserError(f"--chunks {text!r}: expected auto, a size like '128 MiB', or block edges like 4096 or "
                        f"4096,2048", USAGE)
    return "bytes", t


def xp_module(gpu: bool):
    if gpu:
        import cupy

        return cupy
    import numpy

    return numpy


def make_input(workload: str, size: int, second: int, chunks: Chunks, gpu: bool, seed: int):
    import dask.array as da

    xp = xp_module(gpu)
    rs = da.random.RandomState(seed, RandomState=xp.random.RandomState)
    shape = (size, size) if workload == "transpose" else (size, second)
    return rs.random(shape, chunks=chunks.dask_chunks(workload, second))


def build(workload: str, x):
    """The lazy result of one repetition: a tuple of dask arrays."""
    import dask.array as da

    if workload == "transpose":
        return ((x + x.T).sum(),)
    u, s, v = da.linalg.svd(x)
    return (u, s, v)


def expression(workload: str) -> str:
    return "(x + x.T).sum()" if workload == "transpose" else "da.linalg.svd(x) -> (u, s, v)"


def check(client, workload: str, x, outputs) -> dict:
    """Compare one repetition's result with an identity computed separately on the cluster."""
    import math

    if workload == "transpose":
        value, half = client.compute([outputs[0], x.sum()], sync=True)
        value, expected = _scalar(value), 2 * _scalar(half)
        rtol = CHECK_RTOL
    else:
        s = outputs[1]
        value, expected = client.compute([(s ** 2).sum(), (x ** 2).sum()], sync=True)
        value, expected = _scalar(value), _scalar(expected)
        rtol = SVD_CHECK_RTOL
    rel = abs(value - expected) / max(abs(expected), 1e-300)
    return {"value": value, "expected": expected, "identity": "sum(x + x.T) == 2*sum(x)" if workload == "transpose"
            else "sum(s**2) == sum(x**2)", "rel_error": rel, "rtol": rtol,
            "ok": bool(math.isfinite(value) and rel <= rtol)}


def _scalar(v) -> float:
    if hasattr(v, "get"):  # cupy 0-d array
        v = v.get()
    return float(v)


def sync_device() -> None:
    """Run on every worker: wait for queued GPU work, like local_cupy does after each repetition."""
    import cupy

    cupy.cuda.Device().synchronize()
