"""Benchmarks: `ucx-dask-gpu bench transpose|svd|transfer` (docs/benchmarks.md).

One harness, shaped like dask-cuda's benchmarks: common (the Study interface, the command line, the driver that
interleaves variants within a budget), config (variants: protocol + dask config + environment), cluster (the
process that holds one cluster and answers the driver), stats, render (JSON, markdown, PNG), provenance, reference
(dask-cuda's local_cupy); one small module per study: transpose, svd, transfer (with trace: where one transfer's
time goes).
"""
