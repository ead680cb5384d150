"""On a GPU host: CuPy chunks move GPU-to-GPU over UCX with the shipped tuned config, and a
small `bench transpose` runs end to end. Skips, with the reason printed, without 2 NVLinked GPUs and the stack.

Runtime on 2xH200: test_cupy_chunk_moves_device_to_device ~30 s, test_bench_smoke ~90 s, test_bench_peer_on_one_gpu
~90 s (not yet measured).
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

PAYLOAD = 1 << 30  # 1 GiB: far above anything else crossing the links during the test


def _pair() -> tuple[int, int] | str:
    from ucx_dask_gpu import nvml
    from ucx_dask_gpu.errors import UserError

    missing = [m for m in ("dask_cuda", "cupy", "rmm", "ucxx", "distributed_ucxx", "psutil")
               if importlib.util.find_spec(m) is None]
    if missing:
        return f"missing packages: {', '.join(missing)}"
    try:
        gpus = nvml.discover()
    except UserError as e:
        return f"no GPU here: {e}"
    for a in gpus:
        for b in gpus:
            if a.index != b.index and nvml.nvlink_count(a, b) > 0:
                return a.index, b.index
    return f"no NVLinked GPU pair among {len(gpus)} GPU(s)"


PAIR = _pair()
if isinstance(PAIR, str):
    print(f"SKIP reason: {PAIR}")
    pytest.skip(f"bench GPU tests: {PAIR}", allow_module_level=True)

# Runs in its own process: UCX reads UCX_PROTO_INFO (and the config's UCX options) once, at ucxx.init.
SCRIPT = textwrap.dedent("""
    import json, os, resource, sys
    if __name__ == "__main__":
        from dask_cuda import LocalCUDACluster
        from distributed import Client, wait
        from ucx_dask_gpu import nvml
        from ucx_dask_gpu.bench import config

        src, dst, nbytes = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
        gpus = {g.index: g for g in nvml.discover()}
        c, _ = config.cluster_settings(config.load_config("tuned", False), cpu=False)

        def make(n):
            import cupy
            a = cupy.arange(n // 8, dtype="float64")
            cupy.cuda.Device().synchronize()
            return a

        def consume(a):
            import cupy
            return {"module": type(a).__module__, "sum": float(a.sum()), "device": int(a.device.id),
                    "nbytes": int(a.nbytes)}

        def peak_rss():
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        with LocalCUDACluster(CUDA_VISIBLE_DEVICES=f"{src},{dst}", protocol="ucx", dashboard_address=None,
                              threads_per_worker=c["threads-per-worker"], rmm_pool_size="4GiB",
                              rmm_allocator_external_lib_list=c["rmm-allocator-external-lib-list"]) as cluster, \\
                Client(cluster) as client:
            dev = client.run(lambda: int(os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]))
            w_src = next(a for a, d in dev.items() if d == src)
            w_dst = next(a for a, d in dev.items() if d == dst)
            # Wire up the endpoint with a small transfer first, so the measured one is the data alone.
            small = client.submit(make, 8 << 20, workers=[w_src], pure=False)
            client.submit(consume, small, workers=[w_dst], pure=False).result()
            del small
            big = client.submit(make, nbytes, workers=[w_src], pure=False)
            wait(big)
            rss0 = client.run(peak_rss, workers=[w_dst])[w_dst]
            before = nvml.nvlink_throughput([gpus[src], gpus[dst]])
            got = client.submit(consume, big, workers=[w_dst], pure=False).result()
            after = nvml.nvlink_throughput([gpus[src], gpus[dst]])
            rss1 = client.run(peak_rss, workers=[w_dst])[w_dst]
            log = client.run(lambda dask_worker: [e["total"] for e in dask_worker.transfer_incoming_log],
                             workers=[w_dst])[w_dst]

            def delta(g, name):
                a, b = after[gpus[g].uuid].total.get(name), before[gpus[g].uuid].total.get(name)
                return None if a is None or b is None else a - b

            print("RESULT " + json.dumps({
                "got": got, "transfers": log, "peak_rss_growth": rss1 - rss0,
                "src_data_tx": delta(src, "data_tx"), "dst_data_rx": delta(dst, "data_rx"),
                "src_data_rx": delta(src, "data_rx"), "dst_data_tx": delta(dst, "data_tx")}), flush=True)
""")


def test_cupy_chunk_moves_device_to_device(tmp_path):
    """A CuPy chunk fetched by another GPU's worker over UCX must go GPU-to-GPU, not through host memory.

    Signals, each able to fail:
      1. the consumer receives a cupy.ndarray on ITS device with the right sum: the data arrived as device memory
         (the "cuda" serializer was used; a pickled host copy would also arrive, but only after a host round trip);
      2. NVML's NVLink data counters (fields 138/139, what verify-nvlink reads) move by at least 90% of the payload
         between the two GPUs during the fetch: the bytes crossed NVLink. Host staging (cuda_copy through pinned
         bounce buffers, or a pickled host copy) goes over PCIe and leaves these counters where they were;
      3. UCX_PROTO_INFO=y, set for this process tree, prints UCX's protocol choice: it must name cuda_ipc.
    The peak host RSS growth of the receiving worker is printed for the record (a full host copy of the 1 GiB
    payload would show up there) but not asserted: a process's peak depends on what it did before.
    Uses the shipped tuned-gpu.yaml (DASK_CONFIG) for the UCX options the image ships; this test sets its own
    UCXPY_PROGRESS_MODE.
    """
    from ucx_dask_gpu.gate import daskconfig

    src, dst = PAIR
    cfg = tmp_path / "dask"
    cfg.mkdir()
    (cfg / "tuned-gpu.yaml").write_text(daskconfig.packaged_text("tuned-gpu.yaml"))
    (tmp_path / "seed003.py").write_text(SCRIPT)
    env = dict(os.environ, DASK_CONFIG=str(cfg), UCX_PROTO_INFO="y", PYTHONUNBUFFERED="1",
               UCXPY_PROGRESS_MODE="thread")
    proc = subprocess.run([sys.executable, str(tmp_path / "seed003.py"), str(src), str(dst), str(PAYLOAD)], env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    print(json.dumps(r, indent=1))

    n = PAYLOAD // 8
    assert r["got"]["module"].startswith("cupy") and r["got"]["nbytes"] == PAYLOAD
    assert r["got"]["sum"] == pytest.approx(n * (n - 1) / 2, rel=1e-12)
    assert PAYLOAD in r["transfers"] or any(t >= PAYLOAD for t in r["transfers"]), r["transfers"]

    moved = [v for v in (r["src_data_tx"], r["dst_data_rx"]) if v is not None]
    if not moved:
        pytest.fail("NVML does not report NVLink data counters (fields 138/139) on this driver: cannot prove the "
                    "path; run `ucx-dask-gpu verify-nvlink` to see what the driver answers")
    assert max(moved) >= 0.9 * PAYLOAD, f"NVLink counters moved {moved} bytes for a {PAYLOAD}-byte transfer"

    proto = [ln for ln in output.splitlines() if "|" in ln]
    assert any("cuda_ipc" in ln for ln in proto), "UCX_PROTO_INFO never names cuda_ipc:\n" + "\n".join(proto[:60])


def test_bench_smoke(tmp_path):
    """`bench transpose` end to end on the GPUs, small: ucx with a setting and tcp interleaved, local_cupy's parity and
    peer runs beside them, every variant checked, every cluster closed cleanly, cuda_ipc in UCX's choices."""
    src, dst = PAIR
    proc = subprocess.run(
        [sys.executable, "-m", "ucx_dask_gpu", "bench", "transpose", "--gpus", f"{src},{dst}", "--size", "16384",
         "--chunks", "4096", "--runs", "3", "--allow-few", "--variant", "ucx@thread:tuned:UCXPY_PROGRESS_MODE=thread",
         "--variant", "tcp@tuned:tuned", "--parity", "ucx/thread", "--peer", "--proto-info", "--out", str(tmp_path),
         "--budget", "400"], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    p = json.loads((tmp_path / "transpose.json").read_text())
    assert [g["index"] for g in p["gpus"]] == [src, dst] and p["provenance"]["driver"]
    for r in p["runs"]:
        assert r["status"] == "ok" and r["check"]["ok"], r.get("error")
    ucx = p["clusters"][0]
    assert all(c["shutdown"]["clean"] for c in p["clusters"])
    assert any("cuda_ipc" in ln for ln in ucx["ucx_proto_info"]), ucx["ucx_proto_info"][:40]
    assert all(f["progress_mode"] == "thread" for f in ucx["worker_facts"].values())
    assert p["runs"][0]["p2p"]["transfers_per_repetition"] > 0
    parity, peer = p["references"]
    assert parity["status"] == "ok" and parity["array_type"] == "cupy" and parity["against"] == "ucx/thread"
    assert peer["status"] == "ok" and peer["against"] == "its own LocalCUDACluster"
    # each in one chunk between our rounds 2 and 3; local_cupy keeps the parity cluster's memory setup (its dask-cuda
    # workers carry RMMSetup) and applies its own RMM arguments on the LocalCUDACluster it starts for the peer
    assert all([c["rounds_before"] for c in r["chunks"]] == [2] and len(r["wall_s"]) == 3 for r in (parity, peer))
    assert parity["cluster_rmm_kept"] and not peer["cluster_rmm_kept"]


def test_bench_peer_on_one_gpu(tmp_path):
    """On one GPU shared by two workers local_cupy's peer runs on a cluster started for it alone (dask's and
    dask-cuda's defaults), dask-cuda's RMMSetup removed from its workers so that local_cupy applies its own RMM
    arguments, in two chunks between our rounds."""
    gpu, _ = PAIR
    proc = subprocess.run(
        [sys.executable, "-m", "ucx_dask_gpu", "bench", "transpose", "--shared-gpu", str(gpu), "--size", "16384",
         "--chunks", "4096", "--runs", "6", "--allow-few", "--variant", "ucx@defaults:none", "--peer", "--out",
         str(tmp_path), "--budget", "400"], capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    p = json.loads((tmp_path / "transpose.json").read_text())
    (peer,) = p["references"]
    own = next(c for c in p["clusters"] if c["id"] == peer["cluster"])
    assert peer["status"] == "ok" and peer["array_type"] == "cupy" and own["variants"] == ["ucx/local_cupy-peer"]
    assert peer["config"].endswith("local_cupy's RMM arguments (dask-cuda's RMMSetup removed from 2 workers)")
    assert not any(c["cluster_rmm_kept"] for c in peer["chunks"])
    assert [c["rounds_before"] for c in peer["chunks"]] == [2, 5] and len(peer["wall_s"]) == 6
    assert sorted(peer["worker_addresses"].values()) == sorted(own["workers"])
    assert all(c["shutdown"]["clean"] for c in p["clusters"])
