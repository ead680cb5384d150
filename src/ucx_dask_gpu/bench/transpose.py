"""`ucx-dask-gpu bench transpose` / `python -m ucx_dask_gpu.bench.transpose`: (x + x.T).sum() on a square random
float64 array, the workload the project is proven on, over each variant (common.py runs it; `--help` lists it all).

Block (i, j) of x + x.T needs block (j, i): with the input's row blocks alternating between workers, every pair whose
rows differ in parity moves a block per repetition. Checked on the cluster by sum(x + x.T) == 2 sum(x).
"""
from __future__ import annotations

import sys

from ..proof.transpose import SPLIT_EVERY
from . import common, studies


class Transpose(studies.ArrayStudy):
    name = "transpose"
    module = "ucx_dask_gpu.bench.transpose"
    help = "(x + x.T).sum() on a square random array (the reference workload), variants interleaved"
    reference_operation = "transpose_sum"
    # `shipped` as the product's transpose workload runs it: its sum's split_every is the workload's, not the config's
    default_variants = ("ucx@defaults:none", f"ucx,tcp@shipped:shipped:split_every={SPLIT_EVERY}")
    identity_text = "sum(x + x.T) == 2 sum(x)"
    rtol = 1e-9
    expression, persisted, placement = "(x + x.T).sum()", "(x + x.T).sum()", "block (i, j)"
    gpu_defaults = (40000, None, "4096")   # 128 MiB blocks
    cpu_defaults = (4000, None, "1000")

    def build(self, x) -> list:
        return [(x + x.T).sum()]

    def identity(self, client, x, outputs) -> tuple[float, float]:
        value, half = client.compute([outputs[0], x.sum()], sync=True)
        return studies.scalar(value), 2 * studies.scalar(half)


STUDY = Transpose()

if __name__ == "__main__":
    from ucx_dask_gpu.bench import transpose  # this module by its name: what workers unpickle is importable

    sys.exit(common.main(transpose.STUDY))
