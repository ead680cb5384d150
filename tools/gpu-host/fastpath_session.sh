#!/usr/bin/env bash
# One bounded run on ONE GPU (two dask-cuda workers sharing GPU 0): the changes of the fast-path work measured
# against the shipped config in three invocations of at most four clusters each (more distort one another: see
# bench_session.sh), variants taken by label from fastpath-variants.txt:
#   transfer     shipped | defaults | bs-distributed | event+concurrent          (8 B, 1 MiB, 128 MiB; submit->result)
#   transpose    shipped | defaults | bs-distributed | event+concurrent | split-4, parity and peer local_cupy
#   transpose-b  shipped | pending-reverted | multi-buffer+event | tcp/shipped
# usage: fastpath_session.sh [OUTDIR]  (default $OUT; needs .whl build/ucx-prefix build/ucxx-wheels beside the tree)
#   FASTPATH_CPU=1: rehearsal without a GPU in the checkout's own venv (numpy, UCX over TCP, small sizes, few rounds)
# Writes transfer/transpose/transpose-b .json + .md, command.txt, session.txt (PNGs: `ucx-dask-gpu bench render`).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:?usage: fastpath_session.sh OUTDIR}}
mkdir -p "$out"
exec > >(tee -a "$out/session.txt") 2>&1
if [ "${FASTPATH_CPU:-0}" = 1 ]; then
  py=.venv/bin/python where=(--cpu --allow-few) sizes=8,1MiB transfer_runs=5 size=(--size 2000 --chunks 500) runs=5
else
  nvidia-smi -L || { echo "== no GPU"; exit 10; }
  # shellcheck source=stack_venv.sh
  source tools/gpu-host/stack_venv.sh || { echo "== could not make the venv on our stack"; exit 1; }
  py=python3 where=(--shared-gpu 0) sizes=8,1MiB,128MiB transfer_runs=30 size=(--size 20000 --chunks 4096) runs=20
fi
f=tools/gpu-host/fastpath-variants.txt
# pick ARRAY LABEL...: the variants of those labels appended to ARRAY (in this shell: an unknown label ends the run).
pick() {
  local -n into=$1
  local l v
  shift
  for l in "$@"; do
    v=$(grep -v '^#' "$f" | grep -F "@$l:") || { echo "== no variant $l in $f" >&2; exit 2; }
    into+=(--variant "${v//\$SPLIT_EVERY/$split}")
  done
}
# The shipped config plus the transpose workload's split_every, read from the one place it is written, as
# fastpath-variants.txt says (client-side; the transfer study has no reduction).
split=$($py -c 'from ucx_dask_gpu.proof.transpose import SPLIT_EVERY; print(SPLIT_EVERY)') || exit 1
base=(--variant "ucx@shipped:shipped:split_every=$split")
tv=() pv=() bv=()
pick tv defaults bs-distributed event+concurrent
pick pv defaults bs-distributed event+concurrent split-4
pick bv pending-reverted multi-buffer+event
common=("${where[@]}" --run-timeout 60 --out "$out")
keep() { cat "$out/command.txt" >> "$out/commands.tmp"; }
$py -m ucx_dask_gpu.bench.transfer "${common[@]}" --sizes $sizes --runs $transfer_runs --warmup 3 --trace 3 \
  --budget 110 "${base[@]}" "${tv[@]}"; keep
$py -m ucx_dask_gpu.bench.transpose "${common[@]}" "${size[@]}" --runs $runs --warmup 2 \
  --parity ucx/shipped --peer --budget 150 "${base[@]}" "${pv[@]}"; keep
$py -m ucx_dask_gpu.bench.transpose "${common[@]}" "${size[@]}" --runs $runs --warmup 2 \
  --name transpose-b --budget 120 "${base[@]}" "${bv[@]}" --variant "tcp@shipped:shipped:split_every=$split"; keep
mv "$out/commands.tmp" "$out/command.txt"
rm -f "$out"/*.png
ls -l "$out"
