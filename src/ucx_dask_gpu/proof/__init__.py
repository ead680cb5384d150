"""Client workloads that prove a running cluster computes right (`ucx-dask-gpu workload`): the transpose sum checked
against numpy, and a projecting `dd.from_map` reader checked column by column."""
