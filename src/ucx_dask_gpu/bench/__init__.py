"""Benchmarks: `ucx-dask-gpu bench transpose|svd` (cli.py, driver.py).

Modules: cli (arguments), driver (plan, run within a budget, payload), runner (one variant in its own process),
workloads/ (one Workload per benchmarked computation), settings (--config / --knob), reference (dask-cuda's
local_cupy), stats, render, child (a child process and its output).
"""
