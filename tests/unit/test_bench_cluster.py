"""bench/cluster.py starts each cluster with the launchers users run: every cluster setting reaches `dask worker` /
`dask cuda worker` as one of its own flags, read back here by the launchers' own command-line parsers (nothing is
started: the processes are recorded), each GPU mode gives its launchers the GPUs it names, and every launcher stays in
the cluster process's group (the driver's signal to that group stops them)."""
import logging

import dask
import pytest
from distributed.cli import dask_scheduler, dask_worker
from distributed.worker_memory import parse_memory_limit

from ucx_dask_gpu.bench import cluster, config
from ucx_dask_gpu.proof import launchers


def served(monkeypatch, tmp_path, mode: str, settings: dict, gpus=(), workers: int = 2):
    """Served's launchers for `settings` (ucx-dask-gpu.cluster.*): (the Served, [(argv, env, own session), ...])."""
    started = []

    class Recorded:
        pid = 0

        def __init__(self, argv, env, start_new_session, **_):
            started.append((argv, env, start_new_session))

    monkeypatch.setattr(launchers.subprocess, "Popen", Recorded)
    spec = {"protocol": "ucx", "mode": mode, "gpus": list(gpus), "workers": workers,
            "local_directory": str(tmp_path / "scratch")}
    with dask.config.set({config.CLUSTER: settings}):
        return cluster.Served(spec), started


def parsed(argv: list[str]) -> dict:
    """The launcher's parameters as its own click command reads `argv` (python -m dask ...)."""
    if argv[3:5] == ["cuda", "worker"]:
        from dask_cuda.cli import worker

        return worker.make_context("worker", argv[5:]).params
    command = {"worker": dask_worker.main, "scheduler": dask_scheduler.main}[argv[3]]
    return command.make_context(argv[3], argv[4:]).params


def test_cpu_workers_are_dask_workers_with_the_variants_threads_and_memory_limit(monkeypatch, tmp_path):
    s, started = served(monkeypatch, tmp_path, "cpu", {"threads-per-worker": 2, "memory-limit": None,
                                                       "rmm-pool-size": "1GiB"})
    (sched, *workers) = started
    assert [argv[3] for argv, _, _ in started] == ["scheduler", "worker", "worker"]
    assert not any(own_session for _, _, own_session in started)
    assert parsed(sched[0])["protocol"] == "ucx" and parsed(sched[0])["dashboard"] is False
    params = [parsed(argv) for argv, _, _ in workers]
    for p, (_, env, _) in zip(params, workers):
        assert p["nthreads"] == 2 and p["memory_limit"] == "0" and p["protocol"] == "ucx"  # None: no limit
        assert p["host"] == "127.0.0.1" and p["dashboard"] is False and p["scheduler_file"]
        assert env.get("CUDA_VISIBLE_DEVICES") is None
    assert params[0]["local_directory"] != params[1]["local_directory"]
    assert s.launchers == "launchers: dask scheduler + 2 dask worker"


def test_shared_gpu_workers_each_get_the_one_gpu_and_every_gpu_setting(monkeypatch, tmp_path):
    pytest.importorskip("dask_cuda.cli")
    s, started = served(monkeypatch, tmp_path, "shared", {"rmm-pool-size": "8GiB", "rmm-maximum-pool-size": "16GiB",
                                                          "rmm-allocator-external-lib-list": "cupy, torch",
                                                          "device-memory-limit": None}, gpus=[3])
    workers = started[1:]
    assert len(workers) == 2 and all(argv[3:5] == ["cuda", "worker"] for argv, _, _ in workers)
    for argv, env, _ in workers:
        p = parsed(argv)
        assert env["CUDA_VISIBLE_DEVICES"] == "3"
        assert p["rmm_pool_size"] == "8GiB" and p["rmm_maximum_pool_size"] == "16GiB" and p["rmm_async"] is False
        assert p["rmm_allocator_external_lib_list"] == ["cupy", "torch"] and p["device_memory_limit"] == "0"
        # "auto": the host's memory split between the two workers, as LocalCUDACluster split it
        assert p["memory_limit"] == str(parse_memory_limit("auto", 1, 2, logger=logging.getLogger()))
        assert p["nthreads"] == 1 and p["protocol"] == "ucx"
    assert s.launchers == "launchers: dask scheduler + 2 dask cuda worker (CUDA_VISIBLE_DEVICES=3)"


def test_gpu_mode_is_one_dask_cuda_worker_given_every_gpu(monkeypatch, tmp_path):
    pytest.importorskip("dask_cuda.cli")
    s, started = served(monkeypatch, tmp_path, "gpu", {"rmm-async": True, "device-memory-limit": "default"},
                        gpus=[0, 1])
    ((argv, env, _),) = started[1:]
    p = parsed(argv)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and p["rmm_async"] is True and p["rmm_pool_size"] is None
    assert p["device_memory_limit"] == "default" and p["rmm_allocator_external_lib_list"] is None
    assert s.launchers == "launchers: dask scheduler + 1 dask cuda worker (CUDA_VISIBLE_DEVICES=0,1)"
