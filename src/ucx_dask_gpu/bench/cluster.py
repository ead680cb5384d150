"""The cluster side of a benchmark: one process per cluster (`python -m ucx_dask_gpu.bench.<study> --serve SPEC.json`,
started by hosts.py with the cluster's dask config and environment), holding the scheduler and the client of ONE
LocalCUDACluster (or LocalCluster on CPU) and answering the driver one JSON line each way: a repetition, a check,
close. A process per cluster because UCX and UCXX read their settings once per process: a variant's config and
environment must be in force before its scheduler, client and workers start.

Also here: what runs on the workers, the input pinned to workers by a fixed map, and the timed persist. dask,
distributed and the GPU libraries are imported inside the functions that use them.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import sys
import time
import traceback

from ..cliutil import Progress
from ..gate.identity import compare_versions
from ..proof.client import close_workers, ucx_loaded, warm_up
from . import config

PROGRESS, ANSWER = "@@ ", "@@= "
SETTLE_S = 10.0


say = Progress(PROGRESS, stream="stdout")  # the driver forwards these lines as its own progress


def answer(obj: dict) -> None:
    print(ANSWER + json.dumps(obj, default=lambda o: o.item() if hasattr(o, "item") else str(o)), flush=True)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if text.startswith(type(e).__name__) else f"{type(e).__name__}: {text}"


# --- run on the workers (module level: pickled by reference) -------------------------------------------------------

def pop_transfer_log(dask_worker=None) -> list[dict]:
    """This worker's incoming transfers since the last call (and forget them)."""
    log = dask_worker.transfer_incoming_log
    out = [{"src": e["who"], "dst": dask_worker.address, "bytes": int(e["total"]), "start": float(e["start"]),
            "stop": float(e["stop"]), "duration": float(e["duration"]), "keys": [str(k) for k in e["keys"]]}
           for e in log]
    log.clear()
    return out


def sync_device() -> None:
    """Wait for queued GPU work, as local_cupy does after each repetition."""
    import cupy

    cupy.cuda.Device().synchronize()


def process_facts(keys: list[str], dask_worker=None) -> dict:
    """What this process really runs with: its libucp, GPU, allocator, UCX options, and the variant's keys."""
    import dask

    out = {"pid": os.getpid(), **ucx_loaded(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    if dask_worker is not None:
        out["nthreads"] = dask_worker.state.nthreads
    for key in keys:
        out[key] = os.environ.get(key) if config.ENV_RE.match(key) else dask.config.get(key, None)
    try:
        import distributed_ucxx.ucxx as dux

        if dux.ucxx is not None:
            cfg = dux.ucxx.get_config()
            out["ucx"] = {k: cfg.get(k) for k in ("TLS", "RNDV_SCHEME", "RNDV_THRESH", "MAX_RNDV_RAILS") if k in cfg}
            out["progress_mode"] = getattr(dux.ucxx.core._get_ctx(), "progress_mode", None)
    except Exception as e:  # a probe never fails the run
        out["ucx_probe"] = one_line(e)
    if dask_worker is not None and out["CUDA_VISIBLE_DEVICES"] is not None and "cupy" in sys.modules:
        try:
            import cupy
            import rmm

            out["rmm_resource"] = type(rmm.mr.get_current_device_resource()).__name__
            alloc = cupy.cuda.get_allocator()
            out["cupy_allocator"] = getattr(alloc, "__qualname__", None) or type(alloc).__name__
            out["cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        except Exception as e:
            out["gpu_probe"] = one_line(e)
    return out


async def quiesce(dask_worker=None, timeout: float = 5.0) -> int:
    """Ready a worker to be closed: no heartbeat in flight, no connection to another worker left open (a cluster
    closed with worker-worker UCX endpoints open makes the side closing last wait for a peer that is gone)."""
    pc = dask_worker.periodic_callbacks.get("heartbeat")
    if pc is not None:
        pc.stop()
    pool, comms = dask_worker.rpc, []
    for addr in set(pool.available) | set(pool.occupied):
        if addr != dask_worker.scheduler.address:
            comms += list(pool.available.get(addr, ())) + list(pool.occupied.get(addr, ()))
            pool.remove(addr)
    deadline = time.monotonic() + timeout
    while any(not c.closed() for c in comms) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # a heartbeat that had already started
    return len(comms)


def array_module(gpu: bool):
    """numpy, or CuPy on a GPU worker (whose work is queued: sync_device before it counts as done)."""
    return importlib.import_module("cupy" if gpu else "numpy")


def make_block(seed: int, shape: tuple, gpu: bool):
    """A random float64 block from its own seed (CuPy on a GPU worker)."""
    block = array_module(gpu).random.RandomState(seed).random_sample(shape)
    if gpu:
        sync_device()
    return block


# --- the cluster ----------------------------------------------------------------------------------------------------

def shared_gpu_cluster(**kwargs):
    """dask-cuda's LocalCUDACluster with every worker on the first visible GPU: LocalCUDACluster names its workers
    after GPUs; here each new worker gets the spec dask-cuda makes for that GPU under the next free number, so two
    worker processes share one GPU and talk over cuda_ipc."""
    from dask_cuda import LocalCUDACluster

    class SharedGPUCluster(LocalCUDACluster):
        def new_worker_spec(self):
            taken, self.worker_spec = self.worker_spec, {}
            try:
                ((_, spec),) = super().new_worker_spec().items()
            finally:
                self.worker_spec = taken
            return {max(taken, default=-1) + 1: spec}

    return SharedGPUCluster(**kwargs)


def start_cluster(spec: dict):
    """The cluster this process serves; its settings come from this process's dask config."""
    import dask

    c, _ = config.cluster_settings(dask.config.config, spec["mode"] == "cpu")
    common = dict(protocol=spec["protocol"], threads_per_worker=c["threads-per-worker"], dashboard_address=None,
                  silence_logs=logging.WARNING, local_directory=spec["local_directory"], memory_limit=c["memory-limit"])
    if spec["mode"] == "cpu":
        from distributed import LocalCluster

        return LocalCluster(n_workers=spec["workers"], processes=True, host="127.0.0.1", **common)
    gpu = dict(rmm_pool_size=c["rmm-pool-size"], rmm_maximum_pool_size=c["rmm-maximum-pool-size"],
               rmm_async=c["rmm-async"], rmm_allocator_external_lib_list=c["rmm-allocator-external-lib-list"],
               device_memory_limit=c["device-memory-limit"], **common)
    if spec["mode"] == "shared":
        return shared_gpu_cluster(CUDA_VISIBLE_DEVICES=str(spec["gpus"][0]), n_workers=spec["workers"], **gpu)
    from dask_cuda import LocalCUDACluster

    return LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(map(str, spec["gpus"])), n_workers=len(spec["gpus"]), **gpu)


def shutdown(client, cluster, timeout: float = 60.0) -> dict:
    """Quiesce the workers, close them through their nannies while the scheduler still serves them
    (proof.client.close_workers says why), then the client, then the scheduler; each step bounded."""
    start, steps = time.perf_counter(), []

    def step(what, fn, limit):
        try:
            steps.append(fn(max(1.0, min(limit, timeout - (time.perf_counter() - start)))) or what)
        except Exception as e:
            steps.append(f"{what} failed: {one_line(e)}")

    if client is not None:
        step("workers quiesced", lambda t: f"workers quiesced, {sum(client.run(quiesce, timeout=t).values())} "
                                           "worker-worker connections closed", 15)
        if cluster is not None:
            step("closing the workers", lambda t: close_workers(client, cluster, t), 30)
        step("client closed", lambda t: client.close(timeout=t), 15)
    if cluster is not None:
        step("cluster closed", lambda t: cluster.close(timeout=t), 45)
    return {"seconds": round(time.perf_counter() - start, 3), "steps": steps,
            "clean": bool(steps) and not any("failed" in s for s in steps)}


def _held(keys: list | None, dask_scheduler=None) -> bool:
    return any(k in dask_scheduler.tasks for k in keys) if keys is not None else bool(dask_scheduler.tasks)


def settle(client, keys: list | None = None, timeout: float = SETTLE_S) -> None:
    """Until the scheduler has forgotten `keys` (their futures dropped here; None: every key): nothing else runs
    during the next repetition, and the same graph computed again runs anew instead of returning what it holds."""
    deadline = time.monotonic() + timeout
    while client.run_on_scheduler(_held, keys) and time.monotonic() < deadline:
        time.sleep(0.002)


def pinned_array(client, workers: list[str], shape: tuple, chunks: tuple, seed: int, gpu: bool):
    """A random array whose block (i, j) lives on workers[i % len(workers)], created as futures under the array's own
    keys (so the graph built on it holds no extra tasks). A fixed map: every variant moves the same blocks."""
    import dask.array as da
    from dask.array.core import normalize_chunks

    norm = normalize_chunks(chunks, shape, dtype="float64")
    name = f"input-{seed}"
    futures = [client.submit(make_block, seed * 100_003 + i * len(norm[1]) + j, (rows, cols), gpu, key=(name, i, j),
                             workers=[workers[i % len(workers)]], allow_other_workers=False, pure=False)
               for i, rows in enumerate(norm[0]) for j, cols in enumerate(norm[1])]
    from distributed import wait

    wait(futures)
    meta = make_block(0, (0, 0), False)
    return da.Array({f.key: f for f in futures}, name, norm, dtype="float64", meta=meta), futures


def timed_persist(client, outputs: list, gpu: bool) -> tuple[float, list, list[dict]]:
    """wait(client.persist(outputs)) plus a device sync on every worker, timed as local_cupy times it; the transfers
    it caused, from the workers' transfer logs."""
    from distributed import wait

    client.run(pop_transfer_log)
    t0 = time.perf_counter()
    futures = client.persist(outputs)
    wait(futures)
    if gpu:
        client.run(sync_device)
    wall = time.perf_counter() - t0
    transfers = [t for log in client.run(pop_transfer_log).values() for t in log]
    return wall, futures, transfers


# --- serving the driver ---------------------------------------------------------------------------------------------

def open_cluster(spec: dict, study):
    from distributed import Client

    t = time.perf_counter()
    cluster = start_cluster(spec)
    client = Client(cluster, timeout="60s")
    client.wait_for_workers(spec["workers"], timeout=spec.get("start_timeout", 180))
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    warm_up(client, ("numpy", "dask.array") + (("cupy",) if spec["mode"] != "cpu" else ()))
    same = compare_versions(client.get_versions(check=False))
    facts = {"op": "ready", "workers": workers, "start_s": round(time.perf_counter() - t, 3),
             "worker_facts": client.run(process_facts, spec["probe_keys"]),
             "client_facts": process_facts(spec["probe_keys"]), "versions_identical": same["identical"],
             "version_differences": same["differences"], "scheduler": cluster.scheduler_address,
             "cluster_class": type(cluster).__name__}
    return cluster, client, study.prepare(client, spec["params"], workers, spec["mode"] != "cpu"), facts


def handle(study, client, ctx, request: dict) -> dict:
    import dask

    t = time.perf_counter()
    try:
        with dask.config.set(request.get("overlay") or {}):
            out = (study.repetition if request["op"] == "rep" else study.check)(client, ctx, request["seed"])
        settle(client)
        return {"op": request["op"], "ok": True, "total_s": round(time.perf_counter() - t, 4), **out}
    except Exception as e:
        return {"op": request["op"], "ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:]}


def serve(study, spec_path: str) -> int:
    """Start the cluster, answer requests until `close` (or the end of stdin), then shut it down."""
    with open(spec_path) as f:
        spec = json.load(f)
    cluster = client = None
    try:
        say(f"starting {spec['protocol']} cluster, {spec['workers']} workers ({spec['mode']})")
        cluster, client, ctx, facts = open_cluster(spec, study)
        say(f"cluster up in {facts['start_s']:.1f} s")
        answer(facts)
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "close":
                break
            answer(handle(study, client, ctx, request))
    except Exception as e:
        answer({"op": "error", "ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:]})
    finally:
        say("shutting down")
        answer({"op": "closed", "shutdown": shutdown(client, cluster)})
    return 0
