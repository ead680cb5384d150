#!/usr/bin/env bash
# On a GPU host, in one bounded run (~9.5 min at most): the GPU-to-GPU chunk test (tests/gpu/test_bench_gpu.py), the
# topology plan + cluster helper, bench transpose with chunks="auto", bench svd, the workloads GPU test, and (on spare
# cores, CPU only) the gcc 13 compile check of the UCX patches.
# usage: dask_session.sh OUTDIR   (needs .whl/, build/ucx-prefix, build/ucxx-wheels, build/gcc13-check/ beside the tree)
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD
out=${1:?usage: dask_session.sh OUTDIR}
W=$(mktemp -d /tmp/ucx-dask-gpu-session.XXXXXX)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1 PYTHONPATH=$R/src
deadline=$(( $(date +%s) + ${SESSION_SECONDS:-570} ))
left() { local l=$(( deadline - $(date +%s) )); [ "$l" -gt "$1" ] && echo "$1" || echo $(( l > 5 ? l : 5 )); }
step() { echo "== $(date +%T) $*"; }
# a venv on our stack from the copied .whl/, build/ucx-prefix and build/ucxx-wheels (fetch_wheels.sh, make ucx ucxx)
source tools/gpu-host/stack_venv.sh || exit 1

if [ -f build/gcc13-check/ucx-1.13.1-patched-autogen.tar.xz ]; then
  bash tools/gpu-host/gcc13_check.sh "$W" 6 &
  gcc_pid=$!
fi
bench="python3 -m ucx_dask_gpu.bench"  # .transpose, .svd: each study alone (a bare host needs only what it imports)

step "CuPy chunks move GPU-to-GPU over UCX"
timeout "$(left 90)" python3 -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_bench_gpu.py -k device_to_device \
  > "$W/pytest-bench-seed003.txt" 2>&1; echo "seed003 rc=$?" | tee -a "$W/pytest-bench-seed003.txt"
step "topology plan + cluster helper running the transpose"
timeout "$(left 150)" bash tools/gpu-host/topology.sh "$W/topology" > "$W/topology.txt" 2>&1
echo "topology rc=$?" | tee -a "$W/topology.txt"
# a timeout above kills the script, not the cluster it started in the background: stop that before the next step
pkill -TERM -f "ucx_dask_gpu cluster" 2>/dev/null && sleep 3; pkill -KILL -f "ucx_dask_gpu cluster" 2>/dev/null
step "bench transpose chunks=auto: the tuned array.chunk-size against two others, interleaved on one cluster"
timeout "$(left 170)" $bench.transpose --size 40000 --chunks auto --variant 'ucx@tuned:tuned' \
  --variant 'ucx@c512:tuned:array.chunk-size=512MiB' --variant 'ucx@c2g:tuned:array.chunk-size=2GiB' \
  --parity ucx/tuned --out "$W/results" --name transpose-auto --budget 155 --run-timeout 60 \
  > "$W/bench-auto.txt" 2>&1; echo "auto rc=$?" | tee -a "$W/bench-auto.txt"
step "bench svd"
timeout "$(left 150)" $bench.svd --variant 'ucx,tcp@tuned:tuned' --parity ucx/tuned --peer --out "$W/results" \
  --budget 135 --run-timeout 50 > "$W/bench-svd.txt" 2>&1; echo "svd rc=$?" | tee -a "$W/bench-svd.txt"
step "workloads GPU test"
timeout "$(left 70)" python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_workloads_gpu.py \
  > "$W/pytest-workloads-gpu.txt" 2>&1; echo "workloads rc=$?" | tee -a "$W/pytest-workloads-gpu.txt"
if [ -n "${gcc_pid:-}" ]; then timeout "$(left 20)" tail --pid="$gcc_pid" -f /dev/null; cat "$W/gcc13.txt"; fi
step done
tail -n 30 "$W/bench-auto.txt" "$W/bench-svd.txt"
tar czf "$out/dask-session.tgz" -C "$W" --exclude=./gcc13 .
