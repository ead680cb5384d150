"""svd: x = random (N, k) chunked by rows only (tall-skinny), persisted; timed: da.linalg.svd(x) -> (u, s, v).

Checked by sum(s^2) == ||x||_F^2. One column block, as tsqr needs: --chunks sets the rows per block.
"""
from __future__ import annotations

from ...errors import USAGE, UserError
from .base import Chunks, Sizes, Workload, scalar


class Svd(Workload):
    name = "svd"
    help = "da.linalg.svd on a tall-skinny random array chunked by rows"
    expression = "da.linalg.svd(x) -> (u, s, v)"
    identity = "sum(s**2) == sum(x**2)"
    rtol = 1e-8
    # 200000 x 1000 float64 (1.6 GB) in 10 row blocks.
    gpu = Sizes(size=200000, second_size=1000, chunks="20000")
    cpu = Sizes(size=20000, second_size=100, chunks="2000")
    reference_operation = "svd"
    second_size_help = "columns of the tall-skinny input"

    def validate(self, size: int, second: int | None) -> None:
        if second > size:
            raise UserError(f"--second-size {second} must not exceed --size {size} (tall-skinny)", USAGE)

    def shape(self, size: int, second: int | None) -> tuple[int, int]:
        return (size, second)

    def dask_chunks(self, chunks: Chunks, second: int | None):
        kind, value = chunks.parsed
        if kind == "shape":
            return (value[0], second)
        if kind == "bytes":
            from dask.utils import parse_bytes  # dask is imported where it is needed

            return (max(1, parse_bytes(value) // (8 * second)), second)  # float64 rows of `second` columns
        return ("auto", second)

    def build(self, x) -> tuple:
        import dask.array as da

        u, s, v = da.linalg.svd(x)
        return (u, s, v)

    def identity_values(self, client, x, outputs) -> tuple[float, float]:
        s = outputs[1]
        value, expected = client.compute([(s ** 2).sum(), (x ** 2).sum()], sync=True)
        return scalar(value), scalar(expected)

    def reference_args(self, second: int | None) -> list[str]:
        return ["-2", str(second)]


SVD = Svd()
