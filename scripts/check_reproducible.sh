#!/usr/bin/env bash
# Is the image reproducible? Two clean builds (Debian bases bootstrapped again, no Docker build cache; only the
# verified downloads are reused), each normalised (`ucx-dask-gpu repro`), must give the same image id and the same
# archive bytes. On a mismatch it names the first differing files per layer (and config keys), exit 30.
# Thin wrapper around `ucx-dask-gpu repro check`; arguments are passed on, e.g.
#   scripts/check_reproducible.sh --first ucx-dask-gpu:0.1.0   # reuse an image built already as the first build
#   scripts/check_reproducible.sh --json build/repro.json
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [ ! -x "$py" ]; then
  echo "check_reproducible.sh: no .venv here; run \`make venv\` first" >&2
  exit 2
fi
exec "$py" -m ucx_dask_gpu repro check "$@"
