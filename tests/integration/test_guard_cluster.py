"""The environment gate on real processes: a scheduler with stack id A, and workers / clients whose stack id (and
installed packages) differ, each in its own process with its own UCX_DASK_GPU_STACK_ID, all using the shipped
dask config (which loads ucx_dask_gpu.gate.guard on every role)."""
from __future__ import annotations

import json
import textwrap

import pytest

from ucx_dask_gpu.gate import identity


pytestmark = pytest.mark.integration

ID_A = "a1a1a1a1a1a1a1a1"
ID_B = "b2b2b2b2b2b2b2b2"

CLIENT = textwrap.dedent("""
    import json, sys
    from distributed import Client
    try:
        with Client(sys.argv[1] if len(sys.argv) > 1 else {address!r}, timeout=60) as c:
            if {wait_workers}:
                c.wait_for_workers({wait_workers}, timeout=90)
            info = c.scheduler_info(n_workers=-1)["workers"]
            out = {{"connected": True, "workers": sorted(w["name"] for w in info.values()),
                    "sum": c.submit(sum, range(10)).result() if info else None}}
    except Exception as e:
        out = {{"connected": False, "type": type(e).__name__, "message": str(e)}}
    print(json.dumps(out))
""")


def client_in_own_env(procs, address: str, env: dict, wait_workers: int = 0) -> dict:
    proc = procs.run_python(CLIENT.format(address=address, wait_workers=wait_workers), env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def scheduler_a(procs, tmp_path_factory, shipped_config):
    tmp = tmp_path_factory.mktemp("sched-a")
    proc, address = procs.start_scheduler(tmp, procs.env_for(tmp, shipped_config, ID_A))
    yield tmp, address, proc
    proc.stop()


def test_worker_with_other_stack_id_is_refused_and_exits(procs, scheduler_a, shipped_config, tmp_path):
    tmp, address, sched = scheduler_a
    probe = procs.fake_distribution(tmp_path / "site")
    env = procs.env_for(tmp_path, shipped_config, ID_B, probe)
    worker = procs.start_worker(tmp_path, env, address, "refused-worker")
    # Exits by itself (no retry loop): with its nanny, as the image runs it.
    rc = worker.wait(timeout=120)
    worker.stop()
    log = worker.text()
    assert rc != 0
    for text in (f"scheduler {ID_A} vs worker {ID_B}", "guard-probe: missing vs 9.9"):
        assert text in log, log[-3000:]
        assert text in sched.text()
    seen = client_in_own_env(procs, address, procs.env_for(tmp_path, shipped_config, ID_A))
    assert seen["connected"] and "refused-worker" not in seen["workers"], seen


def test_client_with_other_stack_id_gets_the_message_from_client_creation(procs, scheduler_a, shipped_config, tmp_path):
    _, address, _ = scheduler_a
    probe = procs.fake_distribution(tmp_path / "site")
    out = client_in_own_env(procs, address, procs.env_for(tmp_path, shipped_config, ID_B, probe))
    assert out["connected"] is False and out["type"] == "ImportError"
    assert f"scheduler {ID_A} vs client {ID_B}" in out["message"]
    assert "guard-probe: missing vs 9.9" in out["message"]


def test_client_without_the_guard_is_refused(procs, scheduler_a, tmp_path):
    _, address, _ = scheduler_a
    out = client_in_own_env(procs, address, procs.env_for(tmp_path, None, ID_A))  # no dask config: no preload
    assert out["connected"] is False and out["type"] == "ImportError"
    assert f"scheduler {ID_A} vs client none" in out["message"] and "ucx_dask_gpu.gate.guard" in out["message"]


def test_matching_stack_ids_are_accepted(procs, scheduler_a, shipped_config, tmp_path):
    _, address, _ = scheduler_a
    env = procs.env_for(tmp_path, shipped_config, ID_A)
    worker = procs.start_worker(tmp_path, env, address, "good-worker")
    try:
        out = client_in_own_env(procs, address, env, wait_workers=1)
    finally:
        worker.stop()
    assert out["connected"], out
    assert "good-worker" in out["workers"] and out["sum"] == 45


def test_scheduler_without_stack_id_warns_once_and_accepts_everyone(procs, shipped_config, tmp_path):
    if identity.STACK_ID_FILE.exists():
        pytest.skip(f"{identity.STACK_ID_FILE} exists here, so no process is without a stack id")
    sched, address = procs.start_scheduler(tmp_path, procs.env_for(tmp_path, shipped_config, None))
    worker = procs.start_worker(tmp_path, procs.env_for(tmp_path, shipped_config, ID_B), address, "any-worker")
    try:
        first = client_in_own_env(procs, address, procs.env_for(tmp_path, shipped_config, ID_B), wait_workers=1)
        second = client_in_own_env(procs, address, procs.env_for(tmp_path, None, None))
    finally:
        worker.stop()
        sched.stop()
    assert first["connected"] and "any-worker" in first["workers"]
    assert second["connected"]
    log = sched.text()
    assert log.count("this scheduler has no stack id") == 1, log[-3000:]
    assert "refused" not in log


def test_local_cuda_cluster_workers_carry_the_stack_id(procs, shipped_config, tmp_path):
    """LocalCUDACluster passes its own worker preloads (dask_cuda.initialize); its workers must still be accepted.

    dask-cuda's test switches let it start without a GPU; the scheduler has a stack id, so a worker without the
    guard would be refused and the cluster would never get a worker.
    """
    pytest.importorskip("dask_cuda")
    env = procs.env_for(tmp_path, shipped_config, ID_A)
    env.update(CUDA_VISIBLE_DEVICES="0", DASK_CUDA_TEST_SINGLE_GPU="1", DASK_CUDA_TEST_DISABLE_DEVICE_SPECIFIC="1")
    code = textwrap.dedent("""
        import json
        from dask_cuda import LocalCUDACluster
        from distributed import Client
        with LocalCUDACluster(protocol="tcp", dashboard_address=":0", device_memory_limit=None) as cluster, \\
                Client(cluster, timeout=60) as client:
            client.wait_for_workers(1, timeout=120)
            preloads = client.run(lambda dask_worker: [p.name for p in dask_worker.preloads])
            print(json.dumps({"sum": client.submit(sum, range(10)).result(), "preloads": list(preloads.values())}))
    """)
    proc = procs.run_python(code, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["sum"] == 45
    assert out["preloads"] == [["dask_cuda.initialize", "ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup"]]
    assert "refused" not in proc.stderr
