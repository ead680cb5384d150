"""One per-transfer measurement variant in a fresh process: `python -m ucx_dask_gpu.bench.transfer_run SPEC RESULT`.

The driver (bench.transfer) starts one of these per protocol and configuration, with the variant's dask config in
$DASK_CONFIG and its environment variables set, so every process of the cluster (this one holds the scheduler and the
client; the two workers are its children) initialises dask and UCX with them.

What is measured, one transfer at a time with nothing else running:
  1. a block of N bytes is created on worker A (numpy, or CuPy on a GPU) and waited for (untimed);
  2. a task that depends on it is submitted to worker B and its (tiny) result fetched: the client's time from submit
     to result is the end-to-end fetch time; B's `transfer_incoming_log` entry for the block gives distributed's own
     transfer figure (stop - start, unfloored: distributed floors `duration` at 1 ms);
  3. both futures are released. Every sample has fresh keys; sizes are interleaved within each round, so a drift of
     the machine (other load) hits every size alike.
With `trace` set, a separate pass repeats this with the phase tracer (bench.transfer_trace) on both workers and a
transition tracer on the scheduler, and keeps every event of every sample for the breakdown.
With `transpose` set, the same cluster then runs the seed's workload (x + x.T).sum() (bench.workload: a fresh random
input per repetition, persisted untimed; timed: persist + wait + device sync) as a sanity check of the per-transfer
figures under load: wall times, the median transfer bandwidth, and the identity check of the result.

The result (JSON) holds the raw samples; bench.transfer_stats makes the numbers.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import dask
from dask_cuda import LocalCUDACluster
from distributed import Client, LocalCluster, wait

from . import transfer_trace as tt
from .workloads.base import Chunks, sync_device
from .workloads.transpose import TRANSPOSE
from .runner import one_line, progress, shutdown
from .stats import median

# --- run on the workers (module level: pickled by reference) -------------------------------------------------------


def make_block(nbytes: int, fill: int, gpu: bool):
    """A fresh block of `nbytes` bytes on this worker (device memory with `gpu`)."""
    if gpu:
        import cupy  # GPU runs only (a CPU host has no cupy); numpy below likewise only where a block is made

        block = cupy.full(nbytes, fill % 251, dtype="uint8")
        cupy.cuda.runtime.deviceSynchronize()
        return block
    import numpy

    return numpy.full(nbytes, fill % 251, dtype="uint8")


def read_block(block) -> tuple[int, int]:
    """(bytes, last byte) of the block that arrived: the fetching task reads what it received."""
    return int(block.nbytes), int(block[-1])


def pop_incoming(dask_worker=None) -> list[dict]:
    out = [{"who": e["who"], "keys": [str(k) for k in e["keys"]], "total": int(e["total"]),
            "start": float(e["start"]), "stop": float(e["stop"]), "duration": float(e["duration"])}
           for e in dask_worker.transfer_incoming_log]
    dask_worker.transfer_incoming_log.clear()
    return out


def worker_clock(dask_worker=None) -> dict:
    """time.time() and perf_counter() read together: maps the transfer log's wall times onto the tracer's clock."""
    return {"time": time.time(), "perf": time.perf_counter(), "scheduler_delay": dask_worker.scheduler_delay,
            "pid": os.getpid()}


def applied_settings(dask_worker=None) -> dict:
    out = {"UCXPY_PROGRESS_MODE": os.environ.get("UCXPY_PROGRESS_MODE"),
           "UCXPY_ENABLE_PYTHON_FUTURE": os.environ.get("UCXPY_ENABLE_PYTHON_FUTURE"),
           "transfer.message-bytes-limit": dask.config.get("distributed.worker.transfer.message-bytes-limit"),
           "comm.offload": dask.config.get("distributed.comm.offload")}
    try:
        import distributed_ucxx.ucxx as dux

        if dux.ucxx is not None:
            ctx = dux.ucxx.core._get_ctx()
            out["progress_mode"] = ctx.progress_mode
            out["python_future"] = bool(ctx.worker.enable_python_future)
            out["multi_buffer"] = dux.multi_buffer
            cfg = dux.ucxx.get_config()
            out["ucx"] = {k: cfg.get(k) for k in ("TLS", "RNDV_THRESH", "RNDV_SCHEME", "MAX_RNDV_RAILS") if k in cfg}
            out["ucx_version"] = ".".join(map(str, dux.ucxx.get_ucx_version()))
            if dux.device_array is not None:
                out["device_array"] = getattr(dux.device_array, "__qualname__", str(dux.device_array))
    except Exception as e:  # a probe must never fail the run
        out["probe_error"] = one_line(e)
    out["libucp"] = loaded_library("libucp.so")
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
        out["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
        try:
            import rmm

            out["rmm_resource"] = type(rmm.mr.get_current_device_resource()).__name__
            import cupy

            alloc = cupy.cuda.get_allocator()
            out["cupy_allocator"] = getattr(alloc, "__qualname__", None) or type(alloc).__name__
        except Exception as e:
            out["gpu_probe_error"] = one_line(e)
    return out


def loaded_library(name: str) -> str | None:
    """Path of the shared library `name` this process has mapped (which UCX a worker really runs on)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith(name):
                    return path
    except OSError:
        return None
    return None


# --- the run ----------------------------------------------------------------------------------------------------


class SharedGPUCluster(LocalCUDACluster):
    """dask-cuda's LocalCUDACluster with every worker on the first visible GPU.

    LocalCUDACluster names its workers after GPUs (one worker per GPU); here each new worker gets the spec dask-cuda
    makes for that first GPU (its CUDA_VISIBLE_DEVICES, RMM and device-memory settings) under the next free number,
    so two worker processes share one GPU and talk to each other over cuda_ipc."""

    def new_worker_spec(self):
        taken, self.worker_spec = self.worker_spec, {}
        try:
            ((_, spec),) = super().new_worker_spec().items()
        finally:
            self.worker_spec = taken
        return {max(taken, default=-1) + 1: spec}


def start_cluster(spec: dict) -> tuple[object, str]:
    """The cluster and what it is. GPU: dask-cuda workers sharing one GPU; should dask-cuda's cluster not come up,
    distributed's LocalCluster with that GPU visible to both workers (as tests/gpu/test_ucxx_gpu.py runs it), said so
    in the result (its RMM settings are then dask-cuda's alone and do not apply)."""
    common = dict(protocol=spec["protocol"], threads_per_worker=spec.get("threads_per_worker", 1),
                  dashboard_address=None, silence_logs=logging.WARNING, local_directory=spec.get("local_directory"))
    if spec["mode"] == "gpu":
        c = spec.get("cluster", {})
        gpu = str(spec.get("gpu", 0))
        try:
            return SharedGPUCluster(CUDA_VISIBLE_DEVICES=gpu, n_workers=2,
                                    rmm_pool_size=c.get("rmm-pool-size"), rmm_async=c.get("rmm-async", False),
                                    rmm_maximum_pool_size=c.get("rmm-maximum-pool-size"),
                                    rmm_allocator_external_lib_list=c.get("rmm-allocator-external-lib-list"),
                                    device_memory_limit=c.get("device-memory-limit", "default"),
                                    memory_limit=c.get("memory-limit", "auto"), **common), \
                f"dask-cuda, two workers on GPU {gpu}"
        except Exception as e:
            progress(f"dask-cuda's cluster did not start ({one_line(e)}): LocalCluster instead")
            return LocalCluster(n_workers=2, processes=True, host="127.0.0.1", env={"CUDA_VISIBLE_DEVICES": gpu},
                                **common), \
                f"LocalCluster, two workers on GPU {gpu} (dask-cuda's failed: {one_line(e)})"
    return LocalCluster(n_workers=2, processes=True, host="127.0.0.1", memory_limit=spec.get("memory_limit", "4GiB"),
                        **common), "LocalCluster, two CPU workers"


SAMPLE_TIMEOUT_S = 30.0  # one transfer that takes longer is a hang, not a measurement


def one_sample(client: Client, a: str, b: str, nbytes: int, fill: int, gpu: bool) -> dict:
    fa = client.submit(make_block, nbytes, fill, gpu, workers=[a], allow_other_workers=False, pure=False)
    wait(fa, timeout=SAMPLE_TIMEOUT_S)
    t0 = time.perf_counter()
    fb = client.submit(read_block, fa, workers=[b], allow_other_workers=False, pure=False)
    got = fb.result(timeout=SAMPLE_TIMEOUT_S)
    t1 = time.perf_counter()
    key, key_b = str(fa.key), str(fb.key)
    fa.release()
    fb.release()
    if got != (nbytes, fill % 251):
        raise RuntimeError(f"worker B read {got} from a block of {nbytes} bytes filled with {fill % 251}")
    return {"bytes": nbytes, "key": key, "key_b": key_b, "submit": t0, "result": t1, "e2e_s": t1 - t0}


def settle(client: Client, timeout: float = 10.0) -> None:
    """Wait until the scheduler has forgotten every released key (nothing else runs during the next sample)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not client.run_on_scheduler(lambda dask_scheduler: len(dask_scheduler.tasks)):
            return
        time.sleep(0.005)


def measure(client: Client, a: str, b: str, sizes: list[int], rounds: int, warmup: int, gpu: bool,
            traced: bool, deadline: float, seed: int) -> tuple[list[dict], int]:
    samples = []
    fill = seed
    done_rounds = 0
    for r in range(warmup + rounds):
        if time.monotonic() > deadline:
            break
        for n in sizes:  # a round is short (one transfer per size): the deadline is checked between rounds
            fill += 1
            s = one_sample(client, a, b, n, fill, gpu)
            s["round"] = r - warmup
            settle(client)
            if r >= warmup:
                samples.append(s)
        logs = client.run(pop_incoming, workers=[b])[b]
        if traced:
            events = client.run(tt.pop_events)
            transitions = client.run_on_scheduler(tt.pop_transitions)
        by_key = {k: e for e in logs for k in e["keys"]}
        for s in samples:
            if s["round"] == r - warmup and "transfer" not in s:
                e = by_key.get(s["key"])
                s["transfer"] = e
                if traced:
                    s["events"] = _window(events, s, a, b)
                    s["transitions"] = [t for t in transitions if t[2] in (s["key"], s["key_b"])
                                        and s["submit"] - 0.001 <= t[0] <= s["result"] + 0.001]
        if r >= warmup:
            done_rounds += 1
    return samples, done_rounds


def _window(events: dict, s: dict, a: str, b: str) -> dict:
    lo, hi = s["submit"] - 0.001, s["result"] + 0.001
    out = {}
    for role, addr in (("A", a), ("B", b)):
        evs = events.get(addr, {})
        out[role] = {"events": [e for e in evs.get("events", []) if lo <= e[0] <= hi],
                     "ep_owner": evs.get("ep_owner", {})}
    return out


def run_transpose(client: Client, tspec: dict, gpu: bool) -> dict:
    """(x + x.T).sum() on this cluster: warm-up + timed repetitions, each on a fresh persisted input."""
    chunks = Chunks(str(tspec.get("chunks", "4096")))
    walls, gbps = [], []
    state = {}
    for i in range(tspec.get("warmup", 1) + tspec.get("runs", 3)):
        state.clear()
        x = client.persist(TRANSPOSE.make_input(tspec["size"], None, chunks, gpu, 7000 + i))
        wait(x)
        if gpu:
            client.run(sync_device)
        client.run(pop_incoming)
        outs = TRANSPOSE.build(x)
        t0 = time.perf_counter()
        futs = client.persist(list(outs))
        wait(futs)
        if gpu:
            client.run(sync_device)
        wall = time.perf_counter() - t0
        logs = client.run(pop_incoming)
        state.update(x=x, outs=outs)
        if i >= tspec.get("warmup", 1):
            walls.append(wall)
            for entries in logs.values():
                for e in entries:
                    if e["total"] >= 1 << 20:
                        seconds = max(1e-9, e["stop"] - e["start"])
                        gbps.append(e["total"] / seconds / 1e9)
    check = TRANSPOSE.check(client, state["x"], state["outs"])
    state.clear()
    return {"size": tspec["size"], "chunks": chunks.text, "runs": len(walls),
            "wall_ms": [round(w * 1e3, 3) for w in walls], "wall_ms_median": round(median(walls) * 1e3, 3),
            "transfers_per_run": round(len(gbps) / max(1, len(walls)), 1),
            "p2p_gbps_median": round(median(gbps), 3) if gbps else None, "check_ok": check["ok"],
            "check_rel_error": check["rel_error"]}


def write_result(path: Path, res: dict) -> None:
    path.write_text(json.dumps(res, default=str))


def run(spec: dict, result: Path) -> dict:
    """Measure one variant; `result` is written before the cluster shuts down and again after, so a process that
    dies while tearing UCX down (seen once under heavy load: SIGSEGV) still leaves its measurements."""
    gpu = spec["mode"] == "gpu"
    res: dict = {"status": "error", "label": spec["label"], "protocol": spec["protocol"], "mode": spec["mode"],
                 "sizes": spec["sizes"], "timings": {}}
    cluster = client = None
    deadline = time.monotonic() + spec.get("seconds", 120)
    try:
        progress(f"starting cluster: {spec['protocol']}, 2 {'GPU' if gpu else 'CPU'} workers")
        t = time.perf_counter()
        cluster, res["cluster"] = start_cluster(spec)
        client = Client(cluster, timeout="60s")
        client.wait_for_workers(2, timeout=spec.get("start_timeout", 120))
        res["timings"]["cluster_start_s"] = round(time.perf_counter() - t, 3)
        a, b = sorted(client.scheduler_info()["workers"])
        res["workers"] = {"A": a, "B": b}
        res["applied"] = client.run(applied_settings)
        res["clocks"] = client.run(worker_clock)
        progress(f"cluster up in {res['timings']['cluster_start_s']:.1f} s")
        # Open the worker-worker connection in both directions and let UCX/CuPy set up before anything is counted
        for n in spec["sizes"]:
            one_sample(client, a, b, n, 0, gpu)
            one_sample(client, b, a, n, 0, gpu)
        settle(client)
        client.run(pop_incoming)
        t = time.perf_counter()
        res["samples"], res["rounds"] = measure(client, a, b, spec["sizes"], spec["rounds"], spec.get("warmup", 2),
                                                gpu, False, deadline, spec.get("seed", 1) * 1000)
        res["timings"]["measure_s"] = round(time.perf_counter() - t, 3)
        progress(f"{res['rounds']} rounds of {len(spec['sizes'])} sizes in {res['timings']['measure_s']:.1f} s")
        if spec.get("trace_rounds"):
            client.register_plugin(tt.PhaseTracer())
            client.register_plugin(tt.TransitionTracer())
            client.run(tt.pop_events)
            t = time.perf_counter()
            trace_deadline = time.monotonic() + spec.get("trace_seconds", 60)
            res["traced"], res["traced_rounds"] = measure(client, a, b, spec["sizes"], spec["trace_rounds"], 1, gpu,
                                                          True, trace_deadline, spec.get("seed", 1) * 1000 + 500)
            res["timings"]["trace_s"] = round(time.perf_counter() - t, 3)
            progress(f"{res['traced_rounds']} traced rounds in {res['timings']['trace_s']:.1f} s")
        if spec.get("transpose"):
            res["transpose"] = run_transpose(client, spec["transpose"], gpu)
            t = res["transpose"]
            progress(f"transpose {t['size']}^2 in {t['chunks']} chunks: wall median {t['wall_ms_median']:.1f} ms, "
                     f"transfers median {t['p2p_gbps_median']} GB/s, check {'ok' if t['check_ok'] else 'FAILED'}")
        res["status"] = "ok" if res["samples"] else "error"
        if not res["samples"]:
            res["error"] = "no sample within the time given"
    except Exception as e:
        res["error"] = one_line(e)
        res["traceback"] = traceback.format_exc()[-6000:]
        progress(f"failed: {res['error']}")
    finally:
        write_result(result, res)
        progress("shutting down")
        res["shutdown"] = shutdown(client, cluster, 2)
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m ucx_dask_gpu.bench.transfer_run SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    try:
        res = run(spec, Path(argv[1]))
    except BaseException as e:
        res = {"status": "error", "error": one_line(e), "traceback": traceback.format_exc()[-6000:]}
    write_result(Path(argv[1]), res)
    return 0 if res.get("status") == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
