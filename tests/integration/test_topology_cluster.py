"""One short real cluster: dask-cuda's LocalCUDACluster through TopologyCUDACluster, on a machine without GPUs.

dask-cuda's own test switches (DASK_CUDA_TEST_SINGLE_GPU, DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC) let its workers
start without a GPU; everything the topology plan sets per worker -- CPU affinity, env (UCX_NET_DEVICES, UCX_TLS,
CUDA_VISIBLE_DEVICES), listen interface -- is then read back from the live worker processes.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ucx_dask_gpu import topology

pytestmark = pytest.mark.integration


def _nic_with_ipv4():
    nics, _ = topology.discover_nics(Path("/"))
    for nic in nics:
        if nic.netdev and topology.interface_ipv4(nic.netdev):
            return nic
    return None


def test_cluster_applies_the_plan_per_worker(monkeypatch):
    pytest.importorskip("dask_cuda")
    from distributed import Client

    from ucx_dask_gpu.cluster import TopologyCUDACluster

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 usable CPUs to tell two workers' affinity apart, this process has {allowed}")
    nic = _nic_with_ipv4()
    if nic is None:
        pytest.skip("no NIC with an IPv4 address on this machine")
    monkeypatch.setenv("DASK_CUDA_TEST_SINGLE_GPU", "1")
    monkeypatch.setenv("DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC", "1")

    # Two "GPUs" pinned to different cores, both nearest to this machine's real NIC.
    topo = topology.Topology(
        source="test", nics=[nic],
        gpus=[topology.GpuInfo(index=0, cpus=[allowed[0]], cpus_source="test"),
              topology.GpuInfo(index=1, cpus=[allowed[1]], cpus_source="test")],
        gpu_links={(0, 1): "NV4", (1, 0): "NV4"},
        gpu_nic={(0, nic.name): "PIX", (1, nic.name): "PIX"})
    plan = topology.make_plan(topo, gpus="all", protocol="ucx")
    expected_ip = topology.interface_ipv4(nic.netdev)

    t0 = time.monotonic()
    # tcp between the processes keeps this short and GPU-free; the plan's UCX env is still applied per worker
    with TopologyCUDACluster(plan, protocol="tcp", device_memory_limit=None, dashboard_address=None,
                             scheduler_port=0, silence_logs=50) as cluster:
        with Client(cluster) as client:
            seen = client.run(lambda: (dict(os.environ), sorted(os.sched_getaffinity(0))))
            by_name = {info["name"]: addr for addr, info in client.scheduler_info()["workers"].items()}
    assert time.monotonic() - t0 < 120
    assert sorted(by_name) == [0, 1]
    for w in plan.workers:
        addr = by_name[w.name]
        env, cpus = seen[addr]
        assert cpus == w.cpus                                    # the plan's core, not dask-cuda's NVML default
        for key in ("UCX_NET_DEVICES", "UCX_TLS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
            assert env[key] == w.env[key], key
        assert addr.startswith(f"tcp://{expected_ip}:")         # listening on the NIC's interface
    assert seen[by_name[0]][0]["UCX_NET_DEVICES"] == nic.netdev
