"""One short real cluster: `ucx-dask-gpu cluster` (dask-cuda's LocalCUDACluster through TopologyCUDACluster), run
as a process on a machine without GPUs, used through its scheduler file, and stopped with SIGTERM.

What cannot exist here is replaced at the edges only: the topology (no NVML) is built in the driver below from this
machine's real NIC and two of its cores, and dask-cuda's own test switches (DASK_CUDA_TEST_SINGLE_GPU,
DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC) let its workers start without a GPU. Everything the plan sets per worker --
CPU affinity, env, listen interface -- is read back from the live worker processes.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ucx_dask_gpu.topology.machine import discover_nics
from ucx_dask_gpu.topology.plan import interface_ipv4

pytestmark = pytest.mark.integration

DRIVER = textwrap.dedent('''
    import json, os, sys

    def run():
        from ucx_dask_gpu.cli import main
        from ucx_dask_gpu.topology import cli as topology_cli
        from ucx_dask_gpu.topology.model import GpuInfo, NicInfo, Topology
        spec = json.loads(os.environ["TOPO_TEST_SPEC"])
        nic = NicInfo(**spec["nic"])
        topo = Topology(
            source="integration test", nics=[nic],
            gpus=[GpuInfo(index=i, cpus=[c], cpus_source="test") for i, c in enumerate(spec["cores"])],
            gpu_links={(0, 1): "NV4", (1, 0): "NV4"}, gpu_nic={(0, nic.name): "PIX", (1, nic.name): "PIX"})
        topology_cli._topology = lambda args: topo      # no NVML here: the topology is given
        return main(sys.argv[1:])

    if __name__ == "__main__":
        sys.exit(run())
''')


def _nic_with_ipv4():
    nics, _ = discover_nics(Path("/"))
    for nic in nics:
        if nic.netdev and interface_ipv4(nic.netdev):
            return nic
    return None


def test_cluster_command_applies_the_plan_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("dask_cuda")
    from dataclasses import asdict

    from distributed import Client

    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs 2 usable CPUs to tell two workers' affinity apart, this process has {allowed}")
    nic = _nic_with_ipv4()
    if nic is None:
        pytest.skip("no NIC with an IPv4 address on this machine")
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    sched = tmp_path / "scheduler.json"
    env = dict(os.environ, DASK_CUDA_TEST_SINGLE_GPU="1", DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC="1",
               TOPO_TEST_SPEC=json.dumps({"nic": asdict(nic), "cores": allowed[:2]}))
    cmd = [sys.executable, str(driver), "cluster", "--protocol", "tcp", "--scheduler-port", "0",
           "--dashboard-address", "none", "--device-memory-limit", "0", "--scheduler-file", str(sched)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not sched.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sched.exists(), f"no scheduler file; rc={proc.poll()}"
        info = json.loads(sched.read_text())
        expected_ip = interface_ipv4(nic.netdev)
        assert info["address"].startswith(f"tcp://{expected_ip}:") and info["workers"] == 2
        with Client(scheduler_file=str(sched), timeout=30) as client:
            seen = client.run(lambda: (dict(os.environ), sorted(os.sched_getaffinity(0))))
            names = {i["name"]: addr for addr, i in client.scheduler_info()["workers"].items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-2000:]
    assert "cluster stopped (SIGTERM)" in err and not sched.exists()
    assert f"scheduler: {info['address']}" in out
    assert sorted(names) == [0, 1]
    for gpu, core in enumerate(allowed[:2]):
        env_seen, cpus = seen[names[gpu]]
        assert cpus == [core]                                         # the plan's core, not dask-cuda's default
        assert env_seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"           # set by the plan only
        assert env_seen["CUDA_VISIBLE_DEVICES"] == ("0,1" if gpu == 0 else "1,0")
        assert names[gpu].startswith(f"tcp://{expected_ip}:")          # listening on the NIC's interface
