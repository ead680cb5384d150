"""transpose: x = random (N, N), persisted; timed: (x + x.T).sum(), the workload the project is proven on.

Checked by sum(x + x.T) == 2 sum(x). Block (i, j) of x + x.T needs block (j, i): every pair (i, j)/(j, i) whose
blocks live on different workers moves at least one block per repetition.
"""
from __future__ import annotations

from .base import Chunks, Sizes, Workload, scalar


class Transpose(Workload):
    name = "transpose"
    help = "(x + x.T).sum() on a square random array (the reference workload)"
    expression = "(x + x.T).sum()"
    identity = "sum(x + x.T) == 2*sum(x)"
    rtol = 1e-9
    # 40000^2 float64 in 128 MiB (4096^2) chunks.
    gpu = Sizes(size=40000, second_size=None, chunks="128 MiB")
    cpu = Sizes(size=4000, second_size=None, chunks="1000")
    reference_operation = "transpose_sum"

    def report_name(self, chunks: Chunks) -> str:
        return f"transpose-{chunks.label}"

    def build(self, x) -> tuple:
        return ((x + x.T).sum(),)

    def identity_values(self, client, x, outputs) -> tuple[float, float]:
        value, half = client.compute([outputs[0], x.sum()], sync=True)
        return scalar(value), 2 * scalar(half)

    def placement(self, owner: dict, numblocks: tuple[int, ...]) -> dict:
        nb = numblocks[0]
        pairs = [(i, j) for i in range(nb) for j in range(i + 1, nb)]
        return {"offdiagonal_pairs": len(pairs),
                "split_pairs": sum(1 for i, j in pairs if owner.get((i, j)) != owner.get((j, i)))}


TRANSPOSE = Transpose()
