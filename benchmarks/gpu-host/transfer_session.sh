#!/usr/bin/env bash
# On ONE GPU (nvidia-h200), in one bounded call (~6-7 min; SESSION_SECONDS=450 s of work at most): what one Dask
# worker-to-worker transfer costs with two dask-cuda workers sharing GPU 0 (cuda_ipc between them), on OUR stack
# (UCX 1.20.1 + UCXX 0.51.01 built from source with ucx-src-build/patches/ucxx-*, carried), per block size (8 B,
# 1 MiB, 128 MiB CuPy blocks), UCX vs TCP, dask's defaults vs the shipped tuned-gpu.yaml vs each change on top:
# transfer_incoming_log (stop - start, unfloored) AND end-to-end fetch medians, a traced phase breakdown, and
# (x + x.T).sum() at 20000^2 in 128 MiB chunks on each UCX variant's cluster as a sanity check; all in ONE invocation
# of `python -m ucx_dask_gpu.bench.transfer`.
# usage: transfer_session.sh [OUTDIR]   (default $OUT; carry .whl build/ucx-prefix build/ucxx-wheels: fetch_wheels.sh
#        fills .whl, `make ucx ucxx` builds the other two)
#   TRANSFER_MODE=cpu: the same variants with numpy blocks and UCX over TCP (rehearsal on a machine without GPU).
# Writes OUTDIR/transfer.{json,md}, transfer-raw.json.gz, command.txt and session.txt (this script's output).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:?usage: transfer_session.sh OUTDIR}}
mkdir -p "$out"
deadline=$(( $(date +%s) + ${SESSION_SECONDS:-450} ))
exec > >(tee -a "$out/session.txt") 2>&1
echo "== $(date -u +%FT%TZ) transfer session on $(hostname)"
if [ "${TRANSFER_MODE:-gpu}" = cpu ]; then
  mode=(--sizes 8,1MiB,32MiB --transpose 2000 --transpose-chunks 500)
  title="rehearsal on CPU: numpy blocks, UCX over TCP"
else
  nvidia-smi -L || { echo "== no GPU"; exit 10; }
  mode=(--gpu 0 --sizes 8,1MiB,128MiB --transpose 20000 --transpose-chunks 4096)
  title="one GPU, two dask-cuda workers sharing it (cuda_ipc)"
fi
# shellcheck source=stack_venv.sh
source benchmarks/gpu-host/stack_venv.sh || { echo "== could not make the venv on our stack"; exit 1; }
python3 -m ucx_dask_gpu doctor 2>&1 | grep -E "UCX loaded|UCXX|CUDA|GPUs"
left=$(( deadline - $(date +%s) ))
# In the order they matter (--budget stops starting variants in time): dask's defaults and the shipped config over
# both protocols; the UCXX patch's event-driven waiting (UCXPY_ENABLE_PYTHON_FUTURE=1) on each, and with 200 us of
# polling before it blocks; receive buffers from an RMM pool on top.
python3 -m ucx_dask_gpu.bench.transfer "${mode[@]}" --rounds 30 --warmup 3 \
  --variant 'ucx,tcp@baseline:none' \
  --variant 'ucx@tuned+event:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1' \
  --variant 'ucx,tcp@tuned:tuned' \
  --variant 'ucx@baseline+event:none:UCXPY_ENABLE_PYTHON_FUTURE=1' \
  --variant 'ucx@tuned+event+spin:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1;UCXPY_BLOCKING_SPIN_US=200' \
  --variant 'ucx@tuned+event+rmm-async:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1;ucx-dask-gpu.cluster.rmm-async=true' \
  --variant 'ucx@tuned+event+rmm-pool:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1;ucx-dask-gpu.cluster.rmm-pool-size=8GiB' \
  --trace baseline,tuned+event --trace-rounds 10 --trace-seconds 20 --transpose-runs 3 --transpose-protocols ucx \
  --seconds 40 --overhead 45 --budget $(( left - 110 )) \
  --title "$title" --out "$out"
rc=$?
echo "== $(date -u +%FT%TZ) bench transfer exit $rc"
exit $rc
