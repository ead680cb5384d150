"""One benchmark variant in a fresh process: `python -m ucx_dask_gpu.bench.runner SPEC.json RESULT.json`.

The driver (bench.driver) starts one of these per protocol and per sweep variant, with the variant's dask config in
$DASK_CONFIG and its environment variables already set, so every process of the cluster (this one holds the
scheduler and the client; the workers are its children) reads the same settings when it imports dask and
initialises UCX. A variant that hangs is killed by the driver without taking the others down.

Measurement, as dask-cuda's local_cupy does it: each repetition creates and persists a fresh random input (untimed),
then times `wait(client.persist(result))` plus a device synchronisation on every worker (GPU). Unlike local_cupy,
transfer logs are taken per repetition (warm-up transfers are not counted), the input's placement is recorded (it
decides how many blocks must move), and one extra, untimed repetition records the scheduler's task stream.

Lines starting with "@@ " on stdout are progress for the driver; the result is written as JSON to RESULT.json, also
when something failed (status "error" and one line saying what).

dask, distributed and the GPU libraries are imported inside the functions that use them: the CLI imports this module
(through bench.child) and starts without any of them, and a CPU run never loads cupy, rmm or dask-cuda.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from ..fsutil import atomic_write_text
from ..gate.identity import compare_versions
from ..proof.client import close_workers, warm_up
from .workloads import WORKLOADS
from .workloads.base import Chunks, sync_device

PROGRESS = "@@ "
INPUT_DIGEST = "execute|random_sample|"  # da.random's task prefix: the input, generated before each timer starts


def progress(msg: str) -> None:
    print(PROGRESS + msg, flush=True)


def one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return f"{type(e).__name__}: {text}" if not text.startswith(type(e).__name__) else text


# --- functions run on the workers (module-level so they pickle by reference) ---------------------------------------

def _pop_transfer_log(dask_worker=None):
    """This worker's incoming transfers since the last call (and forget them)."""
    log = dask_worker.transfer_incoming_log
    entries = [{"who": e["who"], "total": int(e["total"]), "start": float(e["start"]), "stop": float(e["stop"]),
                "duration": float(e["duration"]), "bandwidth": float(e["bandwidth"]), "keys": len(e["keys"])}
               for e in log]
    truncated = log.maxlen is not None and len(log) >= log.maxlen
    log.clear()
    return {"entries": entries, "truncated": truncated}


def _digests(dask_worker=None):
    """Fine performance metrics (distributed's Server.digests_total), span ids dropped."""
    out: dict[str, float] = {}
    for key, value in dask_worker.digests_total.items():
        if isinstance(key, tuple):
            parts = [str(p) for p in key]
            if parts and parts[0] == "execute" and len(parts) == 5:
                parts = [parts[0]] + parts[2:]  # ("execute", span, prefix, activity, unit)
            name = "|".join(parts)
        else:
            name = str(key)
        out[name] = out.get(name, 0.0) + float(value)
    return out


def _worker_device(dask_worker=None):
    return os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0]


async def _quiesce(dask_worker=None, timeout: float = 5.0):
    """Get a worker ready to be closed: no heartbeat in flight, no connections to other workers.

    Closing a worker while a heartbeat is in flight logs "ConnectionPool is closed" from that heartbeat; closing a
    cluster with worker<->worker UCX endpoints still open makes the side that closes last wait for a peer that is
    gone (local_cupy's UCXXEndpointTimeoutError at teardown). So: stop the heartbeat, let one in flight finish, and
    close the pooled peer connections while every peer is still alive. The scheduler connection is kept.
    """
    pc = dask_worker.periodic_callbacks.get("heartbeat")
    if pc is not None:
        pc.stop()
    pool = dask_worker.rpc
    scheduler = dask_worker.scheduler.address
    comms = []
    for addr in set(pool.available) | set(pool.occupied):
        if addr == scheduler:
            continue
        comms += list(pool.available.get(addr, ())) + list(pool.occupied.get(addr, ()))
        pool.remove(addr)
    deadline = time.monotonic() + timeout
    while any(not c.closed() for c in comms) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    # A heartbeat takes milliseconds; the interval is 0.5 s or more. Wait out one that had already started.
    await asyncio.sleep(0.3)
    return len(comms)


def _probe(keys, dask_worker=None):
    """What this worker really runs with, for each setting a knob or the config file changed."""
    import dask

    out = {}
    for key in keys:
        try:
            if key.isupper():
                out[key] = os.environ.get(key)
            elif key == "ucx-dask-gpu.cluster.threads-per-worker":
                out[key] = dask_worker.state.nthreads
            elif key == "ucx-dask-gpu.cluster.memory-limit":
                out[key] = dask_worker.memory_manager.memory_limit
            elif key == "ucx-dask-gpu.cluster.device-memory-limit":
                data = dask_worker.data
                out[key] = f"{type(data).__name__}({getattr(data, 'device_memory_limit', None)})"
            elif key in ("ucx-dask-gpu.cluster.rmm-pool-size", "ucx-dask-gpu.cluster.rmm-async",
                         "ucx-dask-gpu.cluster.rmm-maximum-pool-size"):
                import rmm

                out[key] = type(rmm.mr.get_current_device_resource()).__name__
            elif key == "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list":
                import cupy

                alloc = cupy.cuda.get_allocator()
                out[key] = getattr(alloc, "__qualname__", None) or type(alloc).__name__
            else:
                out[key] = dask.config.get(key, default=None)
        except Exception as e:  # a probe must never fail the run
            out[key] = f"<probe failed: {type(e).__name__}>"
    try:  # the UCX options UCX itself reports (only where this process initialised UCXX)
        import distributed_ucxx.ucxx as dux

        if dux.ucxx is not None:
            cfg = dux.ucxx.get_config()
            out["ucx"] = {k: cfg.get(k) for k in ("TLS", "RNDV_SCHEME", "RNDV_THRESH", "MAX_RNDV_RAILS",
                                                  "PROTO_ENABLE", "PROTO_INFO") if k in cfg}
            out["ucx_version"] = ".".join(map(str, dux.ucxx.get_ucx_version()))
            from distributed_ucxx.ucxx import multi_buffer

            out["multi_buffer"] = multi_buffer
            ctx = dux.ucxx.core._get_ctx()
            out["progress_mode"] = getattr(ctx, "progress_mode", None)
    except Exception:
        pass
    return out


# --- the run --------------------------------------------------------------------------------------------------------

def start_cluster(spec: dict):
    c = spec["cluster"]
    common = dict(protocol=spec["protocol"], threads_per_worker=c["threads-per-worker"], dashboard_address=None,
                  silence_logs=logging.WARNING, local_directory=spec.get("local_directory"),
                  memory_limit=c["memory-limit"])
    if spec["mode"] == "gpu":
        from dask_cuda import LocalCUDACluster

        return LocalCUDACluster(
            CUDA_VISIBLE_DEVICES=",".join(str(g) for g in spec["gpus"]), n_workers=len(spec["gpus"]),
            rmm_pool_size=c["rmm-pool-size"], rmm_maximum_pool_size=c["rmm-maximum-pool-size"],
            rmm_async=c["rmm-async"], rmm_allocator_external_lib_list=c["rmm-allocator-external-lib-list"],
            device_memory_limit=c["device-memory-limit"], **common)
    from distributed import LocalCluster

    return LocalCluster(n_workers=spec["workers"], processes=True, host="127.0.0.1", **common)


def shutdown(client, cluster, n_workers: int, timeout: float = 60.0) -> dict:
    """Quiesce the workers (no heartbeat in flight, no worker-worker connections), close the workers through their
    nannies while the scheduler still serves them (proof.client.close_workers says why), then the client, then the
    scheduler; each step bounded."""
    start = time.perf_counter()
    steps = []

    def left():
        return max(1.0, timeout - (time.perf_counter() - start))

    if client is not None:
        try:
            closed = client.run(_quiesce, timeout=min(15, left()))
            steps.append(f"workers quiesced, {sum(closed.values())} worker-worker connections closed")
        except Exception as e:
            steps.append(f"quiescing workers failed: {one_line(e)}")
        if cluster is not None:
            try:
                steps.append(close_workers(client, cluster, min(30, left())))
            except Exception as e:
                steps.append(f"closing the workers failed: {one_line(e)}")
        try:
            client.close(timeout=min(15, left()))
            steps.append("client closed")
        except Exception as e:
            steps.append(f"closing the client failed: {one_line(e)}")
    if cluster is not None:
        try:
            cluster.close(timeout=min(45, left()))
            steps.append("cluster closed")
        except Exception as e:
            steps.append(f"closing the cluster failed: {one_line(e)}")
    return {"seconds": round(time.perf_counter() - start, 3), "steps": steps}


def run(spec: dict) -> dict:
    import dask
    from distributed import Client, wait

    workload = WORKLOADS[spec["workload"]]
    gpu = spec["mode"] == "gpu"
    res: dict = {"status": "error", "error": None, "label": spec["label"], "protocol": spec["protocol"],
                 "mode": spec["mode"], "timings": {}}
    cluster = client = None
    n = len(spec["gpus"]) if gpu else spec["workers"]
    try:
        what = f"{n} GPU workers" if gpu else f"{n} CPU workers"
        progress(f"starting cluster: {spec['protocol']}, {what}")
        t = time.perf_counter()
        cluster = start_cluster(spec)
        client = Client(cluster, timeout="60s")
        client.wait_for_workers(n, timeout=spec.get("start_timeout", 180))
        res["timings"]["cluster_start_s"] = round(time.perf_counter() - t, 3)
        devices = client.run(_worker_device)
        workers = sorted(devices, key=lambda a: (devices[a] if devices[a] else "", a))
        res["workers"] = workers
        res["worker_devices"] = {a: devices[a] for a in workers}
        # As the cluster proofs do: one software stack everywhere, libraries imported before timing.
        same = compare_versions(client.get_versions(check=False))
        res["versions_identical"], res["version_differences"] = same["identical"], same["differences"]
        warm_up(client, ("numpy", "dask.array") + (("cupy",) if gpu else ()))
        res["applied"] = client.run(_probe, spec.get("probe_keys", []))
        # The scheduler and the client live in this process: what it runs with, for the same keys.
        res["applied_client"] = _probe([k for k in spec.get("probe_keys", []) if not k.startswith(
            "ucx-dask-gpu.cluster.")])
        progress(f"cluster up in {res['timings']['cluster_start_s']:.1f} s")

        # Every repetition gets a fresh input, persisted (untimed) before its timer starts, as local_cupy does:
        # re-using one input would let later repetitions read the replicas earlier ones fetched (distributed keeps
        # them until the active memory manager drops them), and measure no transfers at all.
        chunks = Chunks(spec["chunks"])
        seeds = iter(range(spec["seed"] * 100_000, spec["seed"] * 100_000 + 100_000))
        state: dict = {}

        def once(label):
            state.clear()  # release the previous input and result first
            t = time.perf_counter()
            seed = next(seeds)
            x = workload.make_input(spec["size"], spec["second_size"], chunks, gpu, seed)
            x = client.persist(x)
            wait(x)
            if gpu:
                client.run(sync_device)
            input_s = time.perf_counter() - t
            layout = _describe(client, workload, x, workers)
            outs = workload.build(x)
            w0 = time.time()
            t0 = time.perf_counter()
            futs = client.persist(list(outs))
            t_sub = time.perf_counter()
            wait(futs)
            if gpu:
                client.run(sync_device)
            t1 = time.perf_counter()
            w1 = time.time()
            state.update(x=x, outs=outs, seed=seed)
            del futs
            return {"wall_s": t1 - t0, "submit_s": t_sub - t0, "start": w0, "stop": w1, "input_s": input_s,
                    "input_seed": seed,
                    "split_pairs": layout.get("split_pairs"), "placement": layout["placement"]}, layout

        res["warmup_wall_s"] = []
        for i in range(spec["warmup"]):
            r, layout = once(f"warmup-{i}")
            res["warmup_wall_s"].append(r["wall_s"])
            if i == 0:
                res["array"] = layout
                progress(f"input {layout['shape']} in chunks {layout['chunksize']} ({layout['numblocks']} blocks), "
                         f"created and persisted in {r['input_s']:.2f} s")
            progress(f"warm-up {i + 1}/{spec['warmup']}: {r['wall_s'] * 1e3:.1f} ms")
        client.run(_pop_transfer_log)

        d0 = client.run(_digests)
        runs = []
        for i in range(spec["runs"]):
            r, layout = once(f"run-{i}")
            res.setdefault("array", layout)
            logs = client.run(_pop_transfer_log)
            r["transfers"] = _transfers(logs)
            r["log_truncated"] = any(v["truncated"] for v in logs.values())
            runs.append(r)
            progress(f"run {i + 1}/{spec['runs']}: {r['wall_s'] * 1e3:.1f} ms, {len(r['transfers'])} transfers"
                     + (f", {r['split_pairs']} split block pairs" if r.get("split_pairs") is not None else ""))
        d1 = client.run(_digests)
        res["runs"] = runs
        # The window also saw each repetition's (untimed) input being generated: leave those tasks out.
        res["digests"] = {w: {k: d1[w][k] - d0.get(w, {}).get(k, 0.0) for k in d1[w]
                              if d1[w][k] - d0.get(w, {}).get(k, 0.0) and not k.startswith(INPUT_DIGEST)}
                          for w in d1}

        # One more repetition, untimed, with the scheduler's task stream (which runs a plugin on every transition).
        if spec.get("profile", True):
            client.get_task_stream(start=time.time())  # installs the plugin
            r, _ = once("profiled")
            stream = client.get_task_stream(start=r["start"])
            xname = state["x"].name  # the input's creation may still be reported: keep the timed tasks only
            stream = [t for t in stream if not (isinstance(t.get("key"), tuple) and t["key"][0] == xname)]
            logs = client.run(_pop_transfer_log)
            r["transfers"] = _transfers(logs)
            r["tasks"] = _tasks(stream)
            res["profiled"] = r

        res["check"] = dict(workload.check(client, state["x"], state["outs"]), input_seed=state["seed"])
        progress(f"check: {res['check']['identity']}: rel. error {res['check']['rel_error']:.1e} "
                 f"({'ok' if res['check']['ok'] else 'MISMATCH'})")
        state.clear()
        res["versions"] = _versions()
        res["config"] = {k: dask.config.get(k, default=None) for k in spec.get("probe_keys", []) if not k.isupper()}
        res["status"] = "ok" if res["check"]["ok"] else "error"
        if not res["check"]["ok"]:
            res["error"] = (f"wrong result: {res['check']['value']!r} vs {res['check']['expected']!r} "
                            f"({res['check']['identity']})")
    except Exception as e:
        res["status"] = "error"
        res["error"] = one_line(e)
        res["traceback"] = traceback.format_exc()[-6000:]
        progress(f"failed: {res['error']}")
    finally:
        progress("shutting down")
        res["shutdown"] = shutdown(client, cluster, n)
        progress(f"shut down in {res['shutdown']['seconds']:.1f} s")
    return res


def _describe(client, workload, x, workers: list[str]) -> dict:
    """Shape, chunking, and where the blocks live (which fixes how many transfers the workload needs)."""
    from distributed import futures_of

    futs = futures_of(x)
    who = client.who_has(futs)
    owner = {}
    for key, addrs in who.items():
        k = key if isinstance(key, tuple) else tuple(key) if isinstance(key, list) else key
        owner[tuple(k[1:]) if isinstance(k, tuple) else k] = addrs[0] if addrs else None
    placement = {wk: sum(1 for a in owner.values() if a == wk) for wk in workers}
    out = {"shape": list(x.shape), "chunksize": list(x.chunksize), "numblocks": list(x.numblocks),
           "nbytes": int(x.nbytes), "chunk_bytes": int(x.dtype.itemsize) * int(_prod(x.chunksize)),
           "dtype": str(x.dtype), "placement": placement}
    out.update(workload.placement(owner, x.numblocks))
    return out


def _prod(t) -> int:
    p = 1
    for v in t:
        p *= int(v)
    return p


def _transfers(logs: dict) -> list[dict]:
    out = []
    for dst, v in logs.items():
        for e in v["entries"]:
            out.append({"src": e["who"], "dst": dst, "bytes": e["total"], "keys": e["keys"], "start": e["start"],
                        "stop": e["stop"], "duration_s": e["duration"], "bandwidth": e["bandwidth"]})
    return sorted(out, key=lambda e: e["start"])


def _tasks(stream: list[dict]) -> list[dict]:
    from dask.utils import key_split

    out = []
    for rec in stream:
        out.append({"key": str(rec.get("key")), "prefix": key_split(rec.get("key")), "worker": rec.get("worker"),
                    "nbytes": rec.get("nbytes"),
                    "startstops": [{"action": s.get("action"), "start": s.get("start"), "stop": s.get("stop"),
                                    **({"source": s["source"]} if "source" in s else {})}
                                   for s in rec.get("startstops", ())]})
    return out


def _versions() -> dict:
    out = {}
    for name in ("dask", "distributed", "dask-cuda", "distributed-ucxx-cu13", "ucxx-cu13", "libucx-cu13",
                 "cupy-cuda13x", "rmm-cu13", "numpy"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    out["python"] = sys.version.split()[0]
    return out


def serve(spec: dict) -> int:
    """Start the cluster, print its address, and keep it until stdin closes (the CPU-mode reference runs against it)."""
    from distributed import Client

    cluster = client = None
    n = len(spec["gpus"]) if spec["mode"] == "gpu" else spec["workers"]
    try:
        cluster = start_cluster(spec)
        client = Client(cluster, timeout="60s")
        client.wait_for_workers(n, timeout=spec.get("start_timeout", 180))
        progress(f"address {cluster.scheduler_address}")
        sys.stdin.read()
        return 0
    finally:
        info = shutdown(client, cluster, n)
        progress(f"shut down in {info['seconds']:.1f} s: {'; '.join(info['steps'])}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--serve":
        return serve(json.loads(Path(argv[1]).read_text()))
    if len(argv) != 2:
        print("usage: python -m ucx_dask_gpu.bench.runner SPEC.json RESULT.json | --serve SPEC.json",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    try:
        res = run(spec)
    except BaseException as e:  # even KeyboardInterrupt: leave a result saying so
        res = {"status": "error", "error": one_line(e), "traceback": traceback.format_exc()[-6000:]}
    atomic_write_text(argv[1], json.dumps(res, default=_json_default))
    return 0 if res.get("status") == "ok" else 1


def _json_default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
