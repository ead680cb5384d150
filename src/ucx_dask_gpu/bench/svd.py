"""`ucx-dask-gpu bench svd` / `python -m ucx_dask_gpu.bench.svd`: da.linalg.svd of a tall-skinny random float64
array chunked by rows (tsqr), over each variant (common.py runs it). Checked by sum(s**2) == sum(x**2).
"""
from __future__ import annotations

import sys

from . import common, studies


class Svd(studies.ArrayStudy):
    name = "svd"
    module = "ucx_dask_gpu.bench.svd"
    help = "da.linalg.svd on a tall-skinny random array chunked by rows, variants interleaved"
    reference_operation = "svd"
    identity_text = "sum(s**2) == sum(x**2)"
    rtol = 1e-8
    second_size = True
    expression, persisted, placement = "da.linalg.svd(x) -> (u, s, v)", "[u, s, v]", "row block i"
    gpu_defaults = (200000, 1000, "20000")   # 1.6 GB in 10 row blocks
    cpu_defaults = (20000, 100, "2000")

    def shape(self, size: int, second: int | None) -> tuple[int, int]:
        return (size, second)

    def chunks(self, given, shape):
        if isinstance(given, tuple):
            return (given[0], shape[1])
        if given == "auto":
            return ("auto", shape[1])
        return (max(1, given // (8 * shape[1])), shape[1])  # a byte size: rows of float64

    def build(self, x) -> list:
        import dask.array as da  # dask is imported where a graph is built

        return list(da.linalg.svd(x))

    def identity(self, client, x, outputs) -> tuple[float, float]:
        value, expected = client.compute([(outputs[1] ** 2).sum(), (x ** 2).sum()], sync=True)
        return studies.scalar(value), studies.scalar(expected)


STUDY = Svd()

if __name__ == "__main__":
    from ucx_dask_gpu.bench import svd  # this module by its name: what workers unpickle is importable

    sys.exit(common.main(svd.STUDY))
