"""The cluster side of a benchmark: one process per cluster (`python -m ucx_dask_gpu.bench.<study> --serve SPEC.json`,
started by hosts.py with the cluster's dask config and environment). It starts the cluster with the launchers users
run (`dask scheduler`; `dask worker`, or `dask cuda worker`), each a process of its own, and holds the client: the
measuring client is in no process of the cluster's, as a user's is not. It answers the driver one JSON line each way: a
repetition, a check, close. A process per cluster because UCX and UCXX read their settings once per process: a
variant's config and environment must be in force before its scheduler, client and workers start.

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
from pathlib import Path

from ..cliutil import Progress
from ..gate.identity import compare_versions
from ..proof.client import ucx_loaded, warm_up
from ..proof.launchers import launch_cluster, stop_processes
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


async def forget_workers(dask_scheduler=None, timeout: float = 5.0) -> int:
    """Remove every worker from the scheduler, not closing it (its launcher does next), as LocalCluster's scale(0)
    retires workers before their nannies close them. Workers that close while registered race the scheduler: each
    removal sends every other worker "remove-worker", and one closing at the same moment has its stream closed under
    that write (a CommClosedError traceback on the scheduler). Removed, a worker is sent nothing more; returns once
    the messages already queued to them are on their way."""
    sends, addrs = list(dask_scheduler.stream_comms.values()), list(dask_scheduler.workers)
    for addr in addrs:
        await dask_scheduler.remove_worker(addr, close=False, expected=True, stimulus_id=f"bench-close-{time.time()}")
    deadline = time.monotonic() + timeout
    while any(s.buffer for s in sends) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return len(addrs)


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

def worker_flags(c: dict, spec: dict) -> list[str]:
    """The cluster settings `c` as the worker launchers' own flags (`dask worker --help`, `dask cuda worker --help`),
    the workers on 127.0.0.1 without a dashboard as a LocalCluster starts them; a limit of None is their 0 (none)."""
    from distributed.worker_memory import parse_memory_limit

    gpu, memory = spec["mode"] != "cpu", c["memory-limit"]
    if gpu and memory == "auto":  # the host's memory split among all the workers, as LocalCUDACluster splits it;
        # a `dask cuda worker` splits it among its own GPUs (two sharing one GPU would each take all of it)
        memory = parse_memory_limit("auto", 1, spec["workers"], logger=logging.getLogger(__name__))
    flags = ["--protocol", spec["protocol"], "--host", "127.0.0.1", "--no-dashboard", "--memory-limit",
             str(memory or 0)]
    if gpu:
        flags += ["--device-memory-limit", str(c["device-memory-limit"] or 0)]
        flags += [f for k in ("rmm-pool-size", "rmm-maximum-pool-size") if c[k] is not None
                  for f in (f"--{k}", str(c[k]))]
        flags += ["--rmm-async"] if c["rmm-async"] else []
        libs = c["rmm-allocator-external-lib-list"]
        if libs:
            flags += ["--set-rmm-allocator-for-libs",
                      ",".join(x.strip() for x in (libs.split(",") if isinstance(libs, str) else libs))]
    return flags


def launchers_stopped(procs: list, limit: float, what: str) -> str:
    """SIGTERM to each launcher, SIGKILL to those not gone after `limit` s; RuntimeError unless each exited with 0."""
    killed = stop_processes([p.popen for p in procs], limit, groups=False)
    codes = [p.popen.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{what} exit codes {codes}, {len(killed)} SIGKILLed after {limit:.0f} s")
    return f"{what} exited"


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

class Served:
    """The cluster this process serves, launched attached to it (the driver's signal to its group stops them too; their
    output is its own: the driver counts their tracebacks and reads UCX_PROTO_INFO), and its Client of it. cpu: `dask
    worker`s; shared: `dask cuda worker`s each given the one GPU; gpu: one `dask cuda worker` given every GPU, as users
    run it on a node: a worker per GPU, each seeing every GPU with its own first, as LocalCUDACluster's did."""

    def __init__(self, spec: dict):
        import dask

        self.spec, self.client, self.started, mode, n = spec, None, time.perf_counter(), spec["mode"], spec["workers"]
        c, _ = config.cluster_settings(dask.config.config, mode == "cpu")
        visible = [None] * n if mode == "cpu" else [str(spec["gpus"][0])] * n if mode == "shared" \
            else [",".join(map(str, spec["gpus"]))]
        envs = [os.environ if v is None else {**os.environ, "CUDA_VISIBLE_DEVICES": v} for v in visible]
        self.procs = launch_cluster(sys.executable, os.environ, envs, Path(spec["local_directory"]),
                                    protocol=spec["protocol"], cuda=mode != "cpu", nthreads=c["threads-per-worker"],
                                    worker_flags=worker_flags(c, spec), scheduler_flags=["--no-dashboard"],
                                    attached=True)
        self.launchers = f"launchers: dask scheduler + {len(envs)} dask {'cuda ' * (mode != 'cpu')}worker" \
            + (f" (CUDA_VISIBLE_DEVICES={visible[0]})" if visible[0] else "")

    def wait_for_workers(self, timeout: float) -> None:
        """Until every worker has joined; ChildProcessError as soon as a launcher exits (its output went above)."""
        deadline, wanted = time.monotonic() + timeout, self.spec["workers"]
        while (have := len(self.client.scheduler_info(n_workers=-1)["workers"])) < wanted:
            exited = [f"{n} ({p.popen.returncode})" for n, p in self.procs.items() if p.popen.poll() is not None]
            if exited:
                raise ChildProcessError(f"{', '.join(exited)} exited before every worker joined")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{have} of {wanted} workers joined within {timeout:.0f} s")
            time.sleep(0.2)

    def open(self, study) -> tuple:
        """(the study's context, the facts the driver is told): once the cluster is up, checked and warmed up."""
        from distributed import Client

        spec, keys = self.spec, self.spec["probe_keys"]
        address = self.procs["scheduler"].address(spec.get("start_timeout", 180))
        self.client = client = Client(address, timeout="60s")
        self.wait_for_workers(spec.get("start_timeout", 180))
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        warm_up(client, ("numpy", "dask.array") + (("cupy",) if spec["mode"] != "cpu" else ()))
        same = compare_versions(client.get_versions(check=False))
        facts = {"op": "ready", "workers": workers, "start_s": round(time.perf_counter() - self.started, 3),
                 "worker_facts": client.run(process_facts, keys), "client_facts": process_facts(keys),
                 # a lambda: run_on_scheduler would hand process_facts the Scheduler as its dask_worker
                 "scheduler_facts": client.run_on_scheduler(lambda: process_facts(keys)), "scheduler": address,
                 "versions_identical": same["identical"], "version_differences": same["differences"],
                 "cluster_class": self.launchers}
        return study.prepare(client, spec["params"], workers, spec["mode"] != "cpu"), facts

    def shutdown(self, timeout: float = 60.0) -> dict:
        """Quiesce the workers; the scheduler forgets them (forget_workers); their nannies close them while the
        scheduler still runs (SIGTERM to their launchers, which exit before it stops; proof.client.close_workers says
        why not the scheduler first); the client; the scheduler; each step bounded."""
        start, steps, client = time.perf_counter(), [], self.client
        workers = [p for n, p in self.procs.items() if n != "scheduler"]

        def step(what, fn, limit):
            try:
                steps.append(fn(max(1.0, min(limit, timeout - (time.perf_counter() - start)))) or what)
            except Exception as e:
                steps.append(f"{what} failed: {one_line(e)}")

        if client is not None:
            step("workers quiesced", lambda t: f"workers quiesced, {sum(client.run(quiesce, timeout=t).values())} "
                                               "worker-worker connections closed", 15)
            step("workers removed", lambda t: f"{client.run_on_scheduler(forget_workers, timeout=t)} workers removed "
                                              "from the scheduler", 10)
        step("closing the workers", lambda t: launchers_stopped(workers, t, "worker launchers"), 30)
        if client is not None:
            step("client closed", lambda t: client.close(timeout=t), 15)
        step("closing the scheduler", lambda t: launchers_stopped([self.procs["scheduler"]], t, "scheduler"), 20)
        return {"seconds": round(time.perf_counter() - start, 3), "steps": steps,
                "clean": not any("failed" in s for s in steps)}


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
    served = None
    try:
        say(f"starting {spec['protocol']} cluster, {spec['workers']} workers ({spec['mode']})")
        served = Served(spec)
        ctx, facts = served.open(study)
        say(f"cluster up in {facts['start_s']:.1f} s")
        answer(facts)
        for line in sys.stdin:
            request = json.loads(line)
            if request["op"] == "close":
                break
            answer(handle(study, served.client, ctx, request))
    except Exception as e:
        answer({"op": "error", "ok": False, "error": one_line(e), "traceback": traceback.format_exc()[-4000:]})
    finally:
        say("shutting down")
        answer({"op": "closed", "shutdown": served.shutdown() if served else {"steps": [], "clean": False}})
    return 0
