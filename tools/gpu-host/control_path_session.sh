#!/usr/bin/env bash
# One bounded run on ONE GPU of an H200 host, beside bench_session.sh (the transfer and transpose studies): what an
# idle cluster and one task cost, on our from-source stack (UCX + UCXX, built here), two dask-cuda workers sharing
# GPU 0 (cuda_ipc between them):
#   idle/      `ucx-dask-gpu bench idle`: every process of an idle cluster (dask scheduler, two dask cuda worker, a
#              client process), the shipped config over ucx and tcp and dask-cuda's defaults, clusters taking turns
#   pertask/   benchmarks/pertask.py: the steady-state transpose's task stream and py-spy on every process (the
#              profiler stack.toml [gpu_host] pins, from .whl/); skipped, saying so, without py-spy
#   gpu-tests.txt  `pytest tests/gpu` in what time is left (each GPU test that cannot run says why)
#
# usage: control_path_session.sh [--budget S] [--cpu] [OUTDIR]
#   OUTDIR     default $OUT; gets idle/, pertask/, gpu-tests.txt and session.txt (this script's output)
#   --budget S seconds in all, the venv included (default 540); every step is bounded by what is left
#   --cpu      rehearsal without a GPU: dask worker, numpy, UCX over TCP, small sizes; no GPU tests
# Environment: UCX_DASK_GPU_COMMIT=<sha> records the commit (a copy of the tree without .git);
#   UCX_DASK_GPU_WHEELS / UCX_DASK_GPU_VENV as stack_venv.sh reads them.
# Needs on the host: .whl build/ucx-prefix build/ucxx-wheels (fetch_wheels.sh; `make ucx ucxx`), copied with the tree.
set -uo pipefail
cd "$(dirname "$0")/../.."
start=$(date +%s)
budget=540 cpu=0 out=${OUT:-}
while [ $# -gt 0 ]; do
  case "$1" in
    --budget) budget=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "control_path_session.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out=$1; shift ;;
  esac
done
# shellcheck source=session_open.sh
source tools/gpu-host/session_open.sh
session_open control_path_session.sh control-path

if [ "$cpu" = 1 ]; then
  where=(--cpu) size=(--size 2000 --chunks 500)
else
  nvidia-smi -L || { echo "== no GPU"; exit 10; }
  where=(--shared-gpu 0) size=(--size 20000 --chunks 4096)
fi
# shellcheck source=stack_venv.sh
source tools/gpu-host/stack_venv.sh || { echo "== could not make the venv on our stack"; exit 1; }
echo "== $(date -u +%T) venv ready, $(left) s left"

# Four clusters of ~30 s each (start, 8 s settle, 15 windows of 1 s): the backstop leaves room for their stop.
timeout 240 python3 -m ucx_dask_gpu.bench.idle "${where[@]}" --settle 8 --variant 'ucx@shipped:shipped' \
  --variant 'ucx@defaults:none' --variant 'tcp@shipped:shipped' --out "$out/idle"
echo "== $(date -u +%T) idle study exit $?, $(left) s left"

if command -v py-spy > /dev/null; then
  timeout $(( $(left) > 200 ? 180 : $(left) / 2 )) python3 benchmarks/pertask.py "${where[@]}" "${size[@]}" \
    --runs 20 --profile-s 10 --out "$out/pertask"
  echo "== $(date -u +%T) per-task breakdown exit $?, $(left) s left"
else
  echo "== per-task breakdown skipped: py-spy not on PATH (tools/gpu-host/fetch_wheels.sh puts it in .whl/)"
fi

if [ "$cpu" = 0 ] && [ "$(left)" -gt 30 ]; then
  timeout $(( $(left) - 10 )) python3 -m pytest -q -rs -p no:cacheprovider tests/gpu > "$out/gpu-tests.txt" 2>&1
  echo "== $(date -u +%T) GPU tests exit $? ($(tail -1 "$out/gpu-tests.txt")), $(left) s left"
fi
echo "== session took $(( $(date +%s) - start )) s of $budget"
