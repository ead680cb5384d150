#!/usr/bin/env bash
# Prove, pair by pair, that NVLink delivers: thin wrapper around `ucx-dask-gpu verify-nvlink` (all logic is in the
# package; see `--help`). Works from a checkout (uses its .venv), inside the image (the installed CLI) and on a bare
# GPU host (python3 + this checkout's src/). Arguments are passed on, e.g.
#   scripts/verify_nvlink.sh --ucx-prefix /opt/ucx --ucx-prefix pip --out benchmarks/results/h200x2-$(date +%F)
# Exit status: 0 every pair passes, 1 some pair fails or is invalid, 10-15 bad input (docs/exit-codes.md).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
if [ -x "$here/.venv/bin/python" ]; then
  exec "$here/.venv/bin/python" -m ucx_dask_gpu.nvlink "$@"
elif command -v ucx-dask-gpu >/dev/null 2>&1; then
  exec ucx-dask-gpu verify-nvlink "$@"
elif [ -d "$here/src/ucx_dask_gpu" ] && command -v python3 >/dev/null 2>&1; then
  PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}" exec python3 -m ucx_dask_gpu.nvlink "$@"
fi
echo "verify_nvlink.sh: no ucx-dask-gpu: run \`make venv\`, or install the package, or use python3 with $here/src" >&2
exit 2
