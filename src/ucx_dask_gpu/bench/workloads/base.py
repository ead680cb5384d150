"""What one benchmarked computation is, built the way dask-cuda's local_cupy builds it.

A `Workload` says everything the benchmark needs to know about one computation: its defaults (on GPUs and with
--cpu), the shape and chunking of its input, the lazy result one repetition times, the identity that checks the
result on the cluster, and dask-cuda's local_cupy operation that is its reference. A new workload is one module in
this folder with one Workload, listed in WORKLOADS (__init__.py).

The input comes from `da.random.RandomState(seed, RandomState=cupy|numpy.random.RandomState)`, local_cupy's own
generator, so both tools time the same kind of blocks. Each repetition gets a fresh input (another seed), so no
repetition can reuse the results or the fetched replicas of another.

The input generator is not the cluster proofs' (proof/transpose.py generates blocks on the host with numpy and
checks against a client-side numpy answer, which for 40000^2 would add minutes of CPU per repetition and differ
from local_cupy's); the runner does share their warm-up and the gate's version comparison. Here the check is an
identity computed on the cluster.

dask, numpy and cupy are imported where a computation is built: `ucx-dask-gpu bench --help` needs none of them.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ...errors import USAGE, UserError


@dataclass(frozen=True)
class Sizes:
    size: int
    second_size: int | None
    chunks: str


@dataclass(frozen=True)
class Chunks:
    """What --chunks asked for: 'auto', a byte size ('128 MiB'), or block edge(s) in elements ('4096', '4096,2048')."""

    text: str

    @property
    def parsed(self):
        return parse_chunks(self.text)

    @property
    def label(self) -> str:
        kind, value = self.parsed
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
    from dask.utils import parse_bytes  # dask is imported where it is needed (see the module docstring)

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


def scalar(v) -> float:
    if hasattr(v, "get"):  # cupy 0-d array
        v = v.get()
    return float(v)


def sync_device() -> None:
    """Run on every worker: wait for queued GPU work, like local_cupy does after each repetition."""
    import cupy

    cupy.cuda.Device().synchronize()


class Workload:
    """One benchmarked computation; subclasses set the attributes and override what differs from a square input."""

    name: str                          # the subcommand: `ucx-dask-gpu bench NAME`
    help: str                          # its line in `ucx-dask-gpu bench --help`
    expression: str                    # what one repetition times, as reports say it
    identity: str                      # what the check compares, as reports say it
    rtol: float                        # relative tolerance of that check
    gpu: Sizes                         # defaults on GPUs
    cpu: Sizes                         # defaults with --cpu
    reference_operation: str           # local_cupy's -o
    second_size_help: str | None = None  # the input has a second dimension of its own (--second-size)

    def defaults(self, cpu: bool) -> Sizes:
        return self.cpu if cpu else self.gpu

    def validate(self, size: int, second: int | None) -> None:
        """Refuse sizes this computation cannot take (UserError USAGE)."""

    def report_name(self, chunks: Chunks) -> str:
        """The report's file stem when --name is not given."""
        return self.name

    def shape(self, size: int, second: int | None) -> tuple[int, int]:
        return (size, size)

    def size_label(self, size: int, second: int | None) -> str:
        return "x".join(str(s) for s in self.shape(size, second)) if self.second_size_help else str(size)

    def dask_chunks(self, chunks: Chunks, second: int | None):
        """--chunks as dask.array takes it for this input."""
        return chunks.parsed[1]

    def make_input(self, size: int, second: int | None, chunks: Chunks, gpu: bool, seed: int):
        import dask.array as da

        xp = xp_module(gpu)
        rs = da.random.RandomState(seed, RandomState=xp.random.RandomState)
        return rs.random(self.shape(size, second), chunks=self.dask_chunks(chunks, second))

    def build(self, x) -> tuple:
        """The lazy result of one repetition: a tuple of dask arrays."""
        raise NotImplementedError

    def identity_values(self, client, x, outputs) -> tuple[float, float]:
        """(value, expected) of the identity, both computed on the cluster."""
        raise NotImplementedError

    def check(self, client, x, outputs) -> dict:
        """Compare one repetition's result with an identity computed separately on the cluster."""
        value, expected = self.identity_values(client, x, outputs)
        rel = abs(value - expected) / max(abs(expected), 1e-300)
        return {"value": value, "expected": expected, "identity": self.identity, "rel_error": rel,
                "rtol": self.rtol, "ok": bool(math.isfinite(value) and rel <= self.rtol)}

    def placement(self, owner: dict, numblocks: tuple[int, ...]) -> dict:
        """Facts about where the input's blocks live that decide how many must move (owner: block index -> worker)."""
        return {}

    def reference_args(self, second: int | None) -> list[str]:
        """local_cupy arguments beyond operation, protocol, size, chunk, runs and devices."""
        return []
