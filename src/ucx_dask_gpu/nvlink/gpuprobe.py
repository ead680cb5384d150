"""CUDA-side helpers that verify-nvlink runs in a CHILD process, under the same CUDA_VISIBLE_DEVICES it gives
ucx_perftest, so that what they see is what perftest sees (and the parent never holds a CUDA context): `visible`
(the devices CUDA shows) and `memcpy-peer` (cudaMemcpyPeer device 0 -> device 1, timed with CUDA events). CuPy
(cupy-cuda13x, in the image's lock) is imported by each probe: it loads CUDA, which argument errors need not. One JSON
document on stdout; on error one line on stderr and exit 1.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys


SPIN_SRC = r"""
extern "C" __global__ void ucx_dask_gpu_spin(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}
"""


def _uuid_str(raw) -> str | None:
    if raw is None:
        return None
    b = bytes(raw)
    if len(b) != 16:
        return None
    h = b.hex()
    return f"GPU-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def visible() -> dict:
    import cupy as cp

    rt = cp.cuda.runtime
    out = []
    for i in range(rt.getDeviceCount()):
        p = rt.getDeviceProperties(i)
        bus = f"{p.get('pciDomainID', 0):08x}:{p.get('pciBusID', 0):02x}:{p.get('pciDeviceID', 0):02x}.0"
        out.append({"uuid": _uuid_str(p.get("uuid")), "pci_bus_id": bus})
    return {"devices": out}


def memcpy_peer(sizes: list[int], samples: int, warmup: int, min_sample_bytes: int, max_reps: int) -> dict:
    import cupy as cp

    rt = cp.cuda.runtime
    if rt.getDeviceCount() < 2:
        raise RuntimeError(f"memcpy-peer needs 2 visible GPUs, CUDA shows {rt.getDeviceCount()}")
    peer = bool(rt.deviceCanAccessPeer(0, 1))
    if peer:
        for dev, other in ((0, 1), (1, 0)):
            with cp.cuda.Device(dev), contextlib.suppress(cp.cuda.runtime.CUDARuntimeError):  # already enabled
                rt.deviceEnablePeerAccess(other)
    # Submitting thousands of small copies from Python can be slower than the GPU runs them, which would time the
    # submission, not the link. A spin kernel ahead of the start event holds the stream while the copies queue up.
    try:
        with cp.cuda.Device(0):
            spin = cp.RawKernel(SPIN_SRC, "ucx_dask_gpu_spin")
            spin((1,), (1,), (cp.int64(1000),))
    except Exception:  # noqa: BLE001 - no NVRTC: measure without it, and say so
        spin = None
    results = []
    for size in sizes:
        with cp.cuda.Device(0):
            src = cp.ones(size, dtype=cp.uint8)
            stream = cp.cuda.Stream(non_blocking=True)
            start, end = cp.cuda.Event(), cp.cuda.Event()
        with cp.cuda.Device(1):
            dst = cp.zeros(size, dtype=cp.uint8)
        reps = max(1, min(max_reps, math.ceil(min_sample_bytes / size)))
        times = []
        with cp.cuda.Device(0):
            for i in range(warmup + samples):
                if spin is not None:  # ~10 us of GPU time per queued copy covers the Python call for each
                    with stream:  # RawKernel launches on the current stream
                        spin((1,), (1,), (cp.int64(20_000 * reps),))
                start.record(stream)
                for _ in range(reps):
                    rt.memcpyPeerAsync(dst.data.ptr, 1, src.data.ptr, 0, size, stream.ptr)
                end.record(stream)
                end.synchronize()
                if i >= warmup:
                    times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
        with cp.cuda.Device(1):
            ok = bool((dst[:: max(1, size // 4096)] == 1).all())
        gb = [size * reps / t / 1e9 for t in times]
        results.append({"msg_bytes": size, "reps": reps, "samples": samples, "warmup": warmup,
                        "gbps": statistics.median(gb), "samples_gbps": [round(x, 3) for x in gb],
                        "bytes_moved": size * reps * (samples + warmup), "data_ok": ok,
                        "queued_ahead": spin is not None})
        del src, dst
        cp.get_default_memory_pool().free_all_blocks()
    return {"peer_access": peer, "results": results}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ucx_dask_gpu.nvlink.gpuprobe")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("visible")
    m = sub.add_parser("memcpy-peer")
    m.add_argument("--sizes", required=True)
    m.add_argument("--samples", type=int, default=21)
    m.add_argument("--warmup", type=int, default=3)
    m.add_argument("--min-sample-bytes", type=int, default=2 << 30)
    m.add_argument("--max-reps", type=int, default=4096)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "visible":
            out = visible()
        else:
            out = memcpy_peer([int(x) for x in a.sizes.split(",")], a.samples, a.warmup, a.min_sample_bytes,
                              a.max_reps)
    except Exception as e:  # noqa: BLE001 - the parent reports this line
        print(f"gpuprobe {a.cmd}: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
