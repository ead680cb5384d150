"""Benchmarks: `ucx-dask-gpu bench transpose|svd|transfer|idle` (docs/benchmarks.md). One harness shaped like
dask-cuda's benchmarks: one small module per study on a shared runner (common.py); docs/architecture.md names the
modules."""
