#!/usr/bin/env bash
# One bounded run on ONE GPU of an H200 host: two dask-cuda workers sharing GPU 0 (cuda_ipc between them) on
# our from-source stack (UCX + UCXX, built here), the two studies of issue 21 with their variants interleaved on live
# clusters (ucx-dask-gpu bench, docs/benchmarks.md):
#   transfer   one 8 B / 1 MiB / 128 MiB CuPy block from worker A read by a task on worker B, one at a time: transfer
#              (transfer_incoming_log stop - start) and submit -> result, per size; then 5 traced, untimed rounds
#              (where one transfer's time goes)
#   transpose  (x + x.T).sum(), 20000^2 float64 in 4096^2 chunks, plus dask-cuda's local_cupy: parity (our
#              ucx/shipped config on that variant's cluster) and peer (its own defaults and RMM arguments, on a
#              cluster of its own: local_cupy cannot start two workers on one GPU itself), both in chunks of at most
#              five runs interleaved among our rounds
# Every variant that needs a cluster of its own adds two workers on GPU 0: keep it to about four clusters per study
# (nine at once exhausted the GPU's memory in the transpose and doubled every transfer's time).
# Default variants, in both studies: ucx@defaults:none (the baseline: dask's and dask-cuda's defaults),
# ucx,tcp@shipped:shipped:split_every=100 (what `ucx-dask-gpu config install` gives every role, the transpose summed
# as `ucx-dask-gpu workload transpose` sums it: SPLIT_EVERY in src/ucx_dask_gpu/proof/transpose.py; client-side, no
# cluster of its own, nothing in the transfer study). A variant on `shipped` carries split_every=100 too, so that it
# changes one thing against it.
#
# usage: bench_session.sh [--budget S] [--variant V]... [--transfer-variant V]... [--transpose-variant V]...
#                         [--no-default-variants] [--parity V | --no-references] [--transfer-runs N]
#                         [--transpose-runs N] [--cpu] [OUTDIR]
#   OUTDIR                 default $OUT; gets transfer.{json,md,png}, transpose.{json,md,png}, command.txt and
#                          session.txt (this script's output): 8 files, no folder
#   --budget S             seconds of work in all, the venv included (default 510); each study stops starting rounds
#                          in time and still writes its report
#   --variant V            one more variant in both studies, e.g.
#                          'ucx@pool:shipped:ucx-dask-gpu.cluster.rmm-pool-size=8GiB;split_every=100'
#                          ([PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...]: `python -m ucx_dask_gpu.bench.transpose --help`)
#   --transfer-variant V / --transpose-variant V   one more variant in one study, e.g.
#                          --transpose-variant 'ucx@split-4:shipped:split_every=4' (dask's default)
#   --no-default-variants  only the variants given (the first is the baseline)
#   --parity V / --no-references   local_cupy's parity run with variant V's config (default ucx/shipped, with --peer
#                          beside it), or neither
#   --transfer-runs N      timed rounds of the transfer study (default 30)
#   --transpose-runs N     timed rounds of the transpose study (default 20)
#   --cpu                  rehearsal without a GPU: numpy, UCX over TCP, small sizes (the same steps otherwise)
# Environment: UCX_DASK_GPU_COMMIT=<sha> records the commit (a copy of the tree without .git);
#   UCX_DASK_GPU_WHEELS / UCX_DASK_GPU_VENV as stack_venv.sh reads them.
# Needs on the host: .whl build/ucx-prefix build/ucxx-wheels (fetch_wheels.sh; `make ucx ucxx`), copied with the tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=510 cpu=0 defaults=1 transfer_runs=30 transpose_runs=20 out=${OUT:-}
both=() transfer_v=() transpose_v=() refs=(--parity ucx/shipped --peer)
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget=$2; shift 2 ;;
    --variant) both+=(--variant "$2"); shift 2 ;;
    --transfer-variant) transfer_v+=(--variant "$2"); shift 2 ;;
    --transpose-variant) transpose_v+=(--variant "$2"); shift 2 ;;
    --no-default-variants) defaults=0; shift ;;
    --parity) refs=(--parity "$2" --peer); shift 2 ;;
    --no-references) refs=(); shift ;;
    --transfer-runs) transfer_runs=$2; shift 2 ;;
    --transpose-runs) transpose_runs=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "bench_session.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
# shellcheck source=session_open.sh
source tools/gpu-host/session_open.sh
session_open bench_session.sh bench

if [ "$cpu" = 1 ]; then
  where=(--cpu) transfer_sizes=8,1MiB,32MiB transpose_size=(--size 2000 --chunks 500)
else
  nvidia-smi -L || { echo "== no GPU"; exit 10; }
  where=(--shared-gpu 0 --proto-info) transfer_sizes=8,1MiB,128MiB transpose_size=(--size 20000 --chunks 4096)
fi
# shellcheck source=stack_venv.sh
source tools/gpu-host/stack_venv.sh || { echo "== could not make the venv on our stack"; exit 1; }
python3 -m ucx_dask_gpu doctor 2>&1 | grep -E "UCX loaded|UCXX|CUDA|GPUs"
echo "== $(date -u +%T) venv ready, $(left) s left"
# The study's own defaults, restated because a variant given here replaces them: the workload's split_every read
# from the one place it is written.
split=$(python3 -c 'from ucx_dask_gpu.proof.transpose import SPLIT_EVERY; print(SPLIT_EVERY)') || exit 1
base=()
[ "$defaults" = 1 ] && base=(--variant 'ucx@defaults:none' --variant "ucx,tcp@shipped:shipped:split_every=$split")

# The transfer study takes a third of what is left (it needs little), the transpose study the rest. `timeout` is a
# backstop only: each study's --budget ends it earlier, report written.
t_budget=$(( $(left) / 3 ))
timeout $(( t_budget + 20 )) python3 -m ucx_dask_gpu.bench.transfer "${where[@]}" --sizes "$transfer_sizes" \
  --runs "$transfer_runs" --warmup 3 --trace 5 --run-timeout 60 "${base[@]}" "${both[@]}" "${transfer_v[@]}" --budget "$t_budget" --out "$out"
rc_transfer=$?
echo "== $(date -u +%T) transfer study exit $rc_transfer, $(left) s left"

p_budget=$(( $(left) - 30 ))
timeout $(( p_budget + 20 )) python3 -m ucx_dask_gpu.bench.transpose "${where[@]}" "${transpose_size[@]}" \
  --runs "$transpose_runs" --warmup 2 --run-timeout 60 "${base[@]}" "${both[@]}" "${transpose_v[@]}" "${refs[@]}" \
  --budget "$p_budget" --out "$out"
rc=$?
echo "== $(date -u +%T) transpose study exit $rc; session took $(( $(date +%s) - start )) s of $budget"
ls -l "$out"
[ "$rc" = 0 ] && exit "$rc_transfer"
exit "$rc"
