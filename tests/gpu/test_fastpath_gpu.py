"""On a GPU host (one GPU is enough): what the fast-path changes do with real GPU buffers.

- distributed-ucxx.cuda-sync (patch 0003): a CuPy frame written while a kernel of the same process keeps the default
  stream busy arrives intact in both modes, and only with `event` does the event loop keep running during the write
  (a ticker coroutine counts).
- distributed-ucxx.multi-buffer (patch 0005): a CuPy frame is received into an rmm.DeviceBuffer (cuda_ipc can map it;
  UCXX's own recv_multi used the stream-ordered default pool, which it cannot), and intact.
- ucx-dask-gpu.cluster.rmm-pool-size: `dask cuda worker` with the config key and `dask cuda worker --rmm-pool-size`
  give the worker the same RMM resource (a pool of that size) and leave CuPy on its own memory pool.

Skips, with the reason, without a GPU or the GPU stack.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu")]
GPU_MODULES = ("cupy", "rmm", "dask_cuda", "ucxx", "distributed_ucxx")
UCX_ON_GPU = {"DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT": "True", "CUDA_VISIBLE_DEVICES": "0"}


def _run(script: str, env: dict[str, str], *args: str, timeout: float = 300) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "UCX_"))}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=base | UCX_ON_GPU | env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SYNC = textwrap.dedent("""
    import asyncio, json
    import cupy
    from distributed.comm import connect, listen
    from distributed.protocol import to_serialize

    SPIN = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }''', "spin")

    async def main():
        got = asyncio.Queue()

        async def handle(comm):
            while True:
                try:
                    await got.put(await comm.read())
                except Exception:
                    return

        async with listen("ucx://127.0.0.1:0", handle) as listener:
            comm = await connect(listener.contact_address)
            x = cupy.arange(1 << 20, dtype="f8")
            await comm.write({"x": to_serialize(x)})  # warm-up: endpoints, IPC handles
            await got.get()
            ticks, stop = 0, False

            async def ticker():
                nonlocal ticks
                while not stop:
                    ticks += 1
                    await asyncio.sleep(0.001)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0.02)
            khz = cupy.cuda.runtime.getDeviceProperties(0)["clockRate"]
            # Load both kernels first: loading a module may wait for the GPU, which would drain the spin before
            # the write and leave nothing for either mode to wait for.
            SPIN((1,), (1,), (cupy.int64(1),))
            y = x * 2
            cupy.cuda.Device(0).synchronize()
            SPIN((1,), (1,), (cupy.int64(khz * 1000 * 0.3),))  # ~0.3 s on the default stream
            y = x * 2  # produced after the spin, on the same stream
            busy = not cupy.cuda.get_current_stream().done
            before = ticks
            await comm.write({"x": to_serialize(y)})
            during = ticks - before
            msg = await got.get()
            stop = True
            await task
            print(json.dumps({"ticks_during_write": during, "busy_at_write": busy,
                              "equal": bool((msg["x"] == y).all())}))
            await comm.close()

    asyncio.run(main())
""")


def test_cuda_sync_event_keeps_the_event_loop_running_while_the_gpu_is_busy():
    device = _run(SYNC, {"DASK_DISTRIBUTED_UCXX__CUDA_SYNC": "device"})
    event = _run(SYNC, {"DASK_DISTRIBUTED_UCXX__CUDA_SYNC": "event"})
    assert device["equal"] and event["equal"]
    assert device["busy_at_write"] and event["busy_at_write"], "the GPU was idle before the write: nothing to wait for"
    print(f"ticks of a 1 ms ticker during a write behind a ~0.3 s kernel: device {device['ticks_during_write']}, "
          f"event {event['ticks_during_write']}")
    assert device["ticks_during_write"] <= 2 < 20 <= event["ticks_during_write"]


MULTI = textwrap.dedent("""
    import asyncio, json
    import cupy, rmm
    from distributed.comm import connect, listen
    from distributed.protocol import to_serialize

    async def main():
        got = asyncio.Queue()

        async def handle(comm):
            await got.put(await comm._recv_multi())  # the raw frames of the next message

        async with listen("ucx://127.0.0.1:0", handle) as listener:
            comm = await connect(listener.contact_address)
            x = cupy.random.RandomState(0).random_sample(8 << 20)  # 64 MiB
            await comm.write({"x": to_serialize(x)})
            frames = await got.get()
            device = [f for f in frames if hasattr(f, "__cuda_array_interface__")]
            equal = len(device) == 1 and bool((cupy.asarray(device[0]).view("f8") == x).all())
            print(json.dumps({"types": sorted({type(f).__module__ + "." + type(f).__name__ for f in device}),
                              "equal": equal}))
            await comm.close()

    asyncio.run(main())
""")


def test_multi_buffer_receives_cupy_frames_into_rmm_buffers():
    out = _run(MULTI, {"DASK_DISTRIBUTED_UCXX__MULTI_BUFFER": "True"})
    assert out["equal"] and out["types"] and all(t.startswith("rmm.") and t.endswith("DeviceBuffer")
                                                 for t in out["types"]), out


POOL = textwrap.dedent("""
    import json, subprocess, sys
    from distributed import Client, LocalCluster

    def rmm_state():
        import cupy, rmm
        mr = rmm.mr.get_current_device_resource()
        alloc = cupy.cuda.get_allocator()
        return {"resource": type(mr).__name__, "pool_bytes": mr.pool_size() if hasattr(mr, "pool_size") else None,
                "cupy": type(getattr(alloc, "__self__", alloc)).__name__}

    if __name__ == "__main__":
        with LocalCluster(n_workers=0, protocol="tcp", host="127.0.0.1", dashboard_address=":0") as cluster:
            worker = subprocess.Popen([sys.executable, "-m", "dask", "cuda", "worker", cluster.scheduler_address,
                                       "--dashboard-address", ":0", *sys.argv[1:]])
            try:
                with Client(cluster) as client:
                    client.wait_for_workers(1, timeout=120)
                    print(json.dumps(list(client.run(rmm_state).values())[0]))
            finally:
                worker.terminate()
                worker.wait(60)
""")


def test_the_rmm_pool_keys_give_what_dask_cuda_worker_rmm_flags_give(tmp_path):
    """The shipped config's one bounded pool with CuPy on it, on a real `dask cuda worker`: the same RMM resource and
    CuPy allocator as the launcher's own flags give."""
    from ucx_dask_gpu.gate import daskconfig, tuning

    daskconfig.install(tmp_path / "dask")
    env = {"DASK_CONFIG": str(tmp_path / "dask"), "DASK_ROOT_CONFIG": str(tmp_path)}
    var = {k: "DASK_" + k.upper().replace(".", "__").replace("-", "_")
           for k in (tuning.RMM_POOL_KEY, tuning.RMM_MAX_KEY, tuning.RMM_LIBS_KEY)}
    by_key = _run(POOL, env | {var[tuning.RMM_POOL_KEY]: "1GiB", var[tuning.RMM_MAX_KEY]: "2GiB"})
    by_flag = _run(POOL, env | {var[tuning.RMM_POOL_KEY]: "None"}, "--rmm-pool-size", "1GiB",
                   "--rmm-maximum-pool-size", "2GiB", "--set-rmm-allocator-for-libs", "cupy")
    neither = _run(POOL, env | {var[tuning.RMM_POOL_KEY]: "None"})
    assert by_key == by_flag and by_key["resource"] == "PoolMemoryResource" and by_key["pool_bytes"] >= 1 << 30, \
        (by_key, by_flag)
    assert by_key["cupy"] != "MemoryPool", by_key  # CuPy allocates from the RMM pool, no second pool beside it
    assert neither["resource"] != "PoolMemoryResource" and neither["cupy"] == "MemoryPool", neither
