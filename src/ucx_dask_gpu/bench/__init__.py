"""Benchmarks: `ucx-dask-gpu bench transpose|svd|transfer|idle` (docs/benchmarks.md).

One harness, shaped like dask-cuda's benchmarks: common (the runner every study shares), studies (the Study
interface), options (the command line), config (variants: protocol + dask config + environment), hosts (the driver's
cluster processes), rounds (variants interleaved within a budget), cluster (the process that holds one cluster and
answers the driver), stats, render (JSON, markdown, PNG), provenance, reference (dask-cuda's local_cupy beside ours);
one small module per study: transpose, svd, transfer (with trace: where one transfer's time goes), and idle (the CPU
an idle cluster uses, started with the real launchers).
"""
