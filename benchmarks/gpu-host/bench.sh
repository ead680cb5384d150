#!/usr/bin/env bash
# On the GPU host: ONE benchmark study per call, bounded by --budget, reports into OUTDIR (default $OUT).
#   bench.sh 128mib  OUTDIR  the transpose workload: 40000^2 float64 in 128 MiB (4096^2) chunks, ucx vs tcp, the tuned
#                            config, local_cupy beside it, and the knob sweep                     (~5 min, <= 9.5 min)
#   bench.sh auto    OUTDIR  chunks="auto" (the tuned config's array.chunk-size) + array.chunk-size sweep, ucx
#                                                                                                (~2 min, <= 7 min)
#   bench.sh svd     OUTDIR  tall-skinny SVD 200000x1000 in 10 row blocks, ucx vs tcp, local_cupy beside it
#                                                                                                (~1.5 min, <= 7 min)
#   bench.sh seed003 OUTDIR  GPU test: a CuPy chunk fetched over UCX goes GPU-to-GPU (NVLink counters, cuda_ipc)
#                                                                                                (~0.5 min, <= 5 min)
# Thin: all logic is in `python -m ucx_dask_gpu.bench` (see --help). No matplotlib on the host: the PNG is skipped
# (noted in the report); `ucx-dask-gpu bench render OUTDIR/<name>.json` draws it afterwards where matplotlib is.
set -uo pipefail
cd "$(dirname "$0")/../.."
what=${1:?usage: bench.sh 128mib|auto|svd|seed003 [OUTDIR]}
out=${2:-${OUT:?usage: bench.sh 128mib|auto|svd|seed003 OUTDIR}}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
# a venv on our stack from the carried .whl/, build/ucx-prefix and build/ucxx-wheels (fetch_wheels.sh, make ucx ucxx)
source benchmarks/gpu-host/stack_venv.sh || exit 1
bench="$py -m ucx_dask_gpu.bench"

case "$what" in
  128mib)
    exec $bench transpose --size 40000 --chunks '128 MiB' --protocols ucx,tcp --reference --runs 5 \
      --goal 'wall_s<=0.1' --goal 'p2p_gbps_median>=60' --goal 'ucx_tcp_wall_ratio>=35' \
      --knob UCXPY_PROGRESS_MODE=blocking \
      --knob distributed-ucxx.multi-buffer=true \
      --knob 'ucx-dask-gpu.cluster.rmm-pool-size=none;ucx-dask-gpu.cluster.rmm-allocator-external-lib-list=none' \
      --knob ucx-dask-gpu.cluster.threads-per-worker=2 \
      --knob distributed.comm.offload=10MiB \
      --knob distributed.worker.transfer.message-bytes-limit=1GiB \
      --knob distributed.scheduler.worker-saturation=inf \
      --out "$out" --budget 530 --run-timeout 150 ;;
  auto)
    exec $bench transpose --size 40000 --chunks auto --protocols ucx --reference --runs 5 \
      --goal 'wall_s<=0.04' \
      --knob array.chunk-size=512MiB --knob array.chunk-size=2GiB --knob array.chunk-size=4GiB \
      --out "$out" --budget 400 --run-timeout 150 ;;
  svd)
    exec $bench svd --protocols ucx,tcp --reference --runs 5 --out "$out" --budget 400 --run-timeout 150 ;;
  seed003)
    timeout 300 $py -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_bench_gpu.py -k device_to_device \
      2>&1 | tee "$out/pytest-bench-seed003.txt"
    exit "${PIPESTATUS[0]}" ;;
  *)
    echo "bench.sh: unknown study '$what' (128mib, auto, svd or seed003)" >&2
    exit 2 ;;
esac
