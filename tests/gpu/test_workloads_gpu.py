"""On a GPU host: the transpose workload with CuPy blocks on a dask-cuda cluster over UCX, with the shipped GPU dask
config and the guard active (a stack id set, so dask-cuda's workers must carry it to be accepted).

Skips, with the reason, without a GPU or the GPU stack. Runtime on 2xH200: ~40 s.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import json
    from dask_cuda import LocalCUDACluster
    from distributed import Client
    from ucx_dask_gpu.proof import transpose

    with LocalCUDACluster(protocol="ucx", dashboard_address=":0") as cluster, Client(cluster) as client:
        result = transpose.run_transpose(client, size=20000, chunk=2500, backend="cupy")
        result["gpus"] = len(cluster.workers)
    print(json.dumps(result))
""")


def _why_not() -> str | None:
    missing = [m for m in ("dask_cuda", "cupy", "ucxx", "distributed_ucxx") if importlib.util.find_spec(m) is None]
    if missing:
        return f"missing packages: {', '.join(missing)}"
    from ucx_dask_gpu import nvml
    from ucx_dask_gpu.errors import UserError

    try:
        nvml.discover()
    except UserError as e:
        return f"no GPU here: {e}"
    return None


def test_cupy_transpose_over_ucx_with_the_guard(tmp_path):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    from ucx_dask_gpu.gate import daskconfig

    daskconfig.install(tmp_path / "dask", "gpu")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    env.update(DASK_CONFIG=str(tmp_path / "dask"), DASK_ROOT_CONFIG=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["ok"] and result["block_type"] == "cupy" and result["protocol"] == "ucx"
    assert result["workers_start"] == result["gpus"] >= 1
    assert "refused" not in proc.stderr and "Traceback" not in proc.stderr
