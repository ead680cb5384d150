"""Benchmarks: `ucx-dask-gpu bench transpose|svd` (see bench.command, bench.driver).

Modules: command (CLI), driver (plan, run, report), runner (one variant in its own process), workload (the timed
computations), settings (--config / --knob), reference (dask-cuda's local_cupy), stats, render, child.
"""
