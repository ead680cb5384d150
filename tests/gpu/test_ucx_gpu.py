"""On a GPU host: doctor's GPU/NVLink view agrees with NVML, and our UCX build's CUDA modules load against the host
driver (they were linked against the pinned 535 driver .debs on a CPU machine). Skips, with the reason, elsewhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu import nvml
from ucx_dask_gpu.ucx import info as ucxinfo
from ucx_dask_gpu.errors import UserError
from ucx_dask_gpu.ucxbuild import verify
from ucx_dask_gpu.ucx.install import BUILD_INFO

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(os.environ.get("UCX_PREFIX", REPO / "build" / "ucx-prefix")).resolve()


@pytest.fixture(scope="module")
def gpus() -> list[nvml.Gpu]:
    try:
        return nvml.discover()
    except UserError as e:
        pytest.skip(f"no GPU here: {e}")


@pytest.fixture(scope="module")
def prefix(gpus) -> Path:
    if not (PREFIX / BUILD_INFO).is_file():
        pytest.skip(f"no UCX build at {PREFIX}: run `make ucx` or set UCX_PREFIX")
    return PREFIX


def test_doctor_matches_nvml(gpus):
    r = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "doctor", "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert [g["pci_bus_id"] for g in rep["gpu"]["gpus"]] == [g.pci_bus_id for g in gpus]
    assert [g["nvlink_links"] for g in rep["gpu"]["gpus"]] == [len(g.links) for g in gpus]
    assert rep["gpu"]["driver"] and rep["cuda"]["driver_api"]
    print(f"doctor: {rep['gpu']['status']}, driver {rep['gpu']['driver']}, CUDA driver API {rep['cuda']['driver_api']}, "
          f"NVLinks per GPU {[g['nvlink_links'] for g in rep['gpu']['gpus']]}")


def test_cuda_transports_load_against_the_host_driver(prefix):
    d = ucxinfo.devices(ucxinfo.find_ucx_info(prefix), env=verify.clean_env(keep_ld_library_path=True))
    assert "cuda_copy" in d.transports, d.transports
    assert "cuda_ipc" in d.transports, d.transports


def test_cuda_memory_perftest_on_one_gpu(prefix):
    env = verify.clean_env({"CUDA_VISIBLE_DEVICES": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, keep_ld_library_path=True)
    res, out = verify.perftest_loopback(prefix, env=env, memory="cuda", iterations=200)
    print(f"ucx_perftest tag_bw cuda, one GPU, two processes: {res.gbps:.1f} GB/s")
    assert res.bw_overall_mbs > 0
