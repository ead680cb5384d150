"""`ucx-dask-gpu workload transpose`: (x + x.T).sum() on the cluster, its input generated block by block by pure
tasks (each block its own generator stream), checked against the same expression computed with numpy on the client.
numpy, cupy and dask are imported inside functions: the CLI imports this module and starts without them.
"""
from __future__ import annotations

import time

from ..errors import USAGE, UserError
from .client import LOST_AFTER_S, RTOL, start_run, ucx_in_roles

# The sum combines up to 100 partial sums per task (dask's default 4): each is a scalar, so 5x5 or 10x10 blocks finish
# in one aggregate task, with fewer scheduler round trips. 0.725 [0.682, 0.769] of dask's default on one H200
# (benchmarks/results/h200-2026-12-02/harness-baseline/transpose.md, ucx/split). Here, not in the shipped config: dask
# applies that key to every reduction, also those whose partial results are whole blocks (100 of them in one task).
SPLIT_EVERY = 100


def _random_block(seed: int, i: int, j: int, shape: tuple[int, int]):
    """Block (i, j) of the input: its own generator stream, so any process can regenerate any block."""
    import numpy as np

    return np.random.default_rng([seed, i, j]).random(shape)


def _generate_block(seed: int, backend: str, block_info=None):
    info = block_info[None]
    i, j = info["chunk-location"]
    block = _random_block(seed, i, j, tuple(info["chunk-shape"]))
    if backend == "cupy":
        import cupy

        return cupy.asarray(block)
    return block


def _chunk_sizes(size: int, chunk: int) -> list[int]:
    return [min(chunk, size - start) for start in range(0, size, chunk)]


def transpose_expected(size: int, chunk: int, seed: int) -> float:
    """(x + x.T).sum() with numpy on the client, block pair by block pair (memory: two blocks). Block (i, j) of x + x.T
    is x[i, j] + x[j, i].T; blocks (i, j) and (j, i) of the result sum to the same value."""
    import numpy as np

    sizes = _chunk_sizes(size, chunk)
    total = 0.0
    for i, ri in enumerate(sizes):
        for j in range(i, len(sizes)):
            a = _random_block(seed, i, j, (ri, sizes[j]))
            b = a if i == j else _random_block(seed, j, i, (sizes[j], ri))
            s = float(np.sum(a + b.T))
            total += s if i == j else 2 * s
    return total


def transpose_sum(x):
    """(x + x.T).sum() with the workload's split_every, whatever the client's dask config says."""
    return (x + x.T).sum(split_every=SPLIT_EVERY)


def check_transpose_args(size: int, chunk: int, backend: str) -> None:
    """Validate before any cluster starts."""
    if size <= 0 or chunk <= 0:
        raise UserError(f"--size and --chunk must be positive (got {size}, {chunk})", USAGE)
    if backend not in ("numpy", "cupy"):
        raise UserError(f"unknown backend {backend!r} (expected numpy or cupy)", USAGE)


def _client_meta(backend: str):
    """A cupy meta when the client itself can make one; else None (workers still make cupy blocks at run time). Clients
    often run without a GPU; nothing on the client needs one: the result comes back as a Python float."""
    if backend != "cupy":
        return None
    try:
        import cupy

        return cupy.empty((0, 0))
    except Exception:  # no cupy / no CUDA driver here
        return None


def _array_module(block) -> str:
    return type(block).__module__.split(".")[0]


def run_transpose(client, size: int = 4000, chunk: int = 1000, seed: int = 0, backend: str = "numpy",
                  retries: int = 2, timeout: float = LOST_AFTER_S) -> dict:
    """The workload on `client`'s cluster; every wait bounded as proof/client.py's Watch says (`timeout`: how long
    it waits without any worker)."""
    import dask.array as da
    from distributed import futures_of

    check_transpose_args(size, chunk, backend)
    watch, run = start_run(client, "transpose", ("numpy", "dask.array") + (("cupy",) if backend == "cupy" else ()),
                           timeout)
    sizes = tuple(_chunk_sizes(size, chunk))
    x = da.map_blocks(_generate_block, seed, backend, chunks=(sizes, sizes), dtype="float64",
                      meta=_client_meta(backend), name=f"random-{seed}-{size}-{chunk}-{backend}")
    start = time.perf_counter()
    # Persist, then reduce: a worker that dies takes its blocks with it, and the scheduler regenerates them.
    x = watch.call(client.persist, x, retries=retries)
    total = watch.call(client.compute, transpose_sum(x), retries=retries)
    # Converted on a worker: a cupy scalar would need a GPU on the client to be deserialized.
    value = watch.result(client.submit(float, total, retries=retries, pure=False))
    wall = time.perf_counter() - start
    # What the workers really computed on (cupy on GPUs), read from a block where it lives.
    block_type = watch.result(client.submit(_array_module, futures_of(x)[0], pure=False))
    del x, total
    expected = transpose_expected(size, chunk, seed)
    rel = abs(value - expected) / max(abs(expected), 1e-300)
    return {
        "workload": "transpose", "expression": f"(x + x.T).sum(split_every={SPLIT_EVERY})", "size": size,
        "chunk": chunk, "blocks": len(sizes) ** 2, "backend": backend, "block_type": block_type, "seed": seed,
        **run, "workers_end": watch.workers(),
        "value": value, "expected": expected, "rel_error": rel, "ok": rel <= RTOL and block_type == backend,
        "wall_s": round(wall, 4), "ucx": ucx_in_roles(client, watch) if run["protocol"] == "ucx" else None,
    }
