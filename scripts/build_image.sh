#!/usr/bin/env bash
# Build the one image for client, scheduler and workers (docker/Dockerfile).
# Thin wrapper: `ucx-dask-gpu image build` fetches and verifies every input first (UCX sources, the wheelhouse of
# the hashed lock, the Debian bases), then runs `docker build --network none`, and prints the image id, size and
# stack id. Needs a running Docker engine (ci/start_dockerd.sh starts one as root). Arguments are passed on, e.g.
#   scripts/build_image.sh --tag ucx-dask-gpu:test --extra-wheel some.whl
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
if [ ! -x "$py" ]; then
  echo "build_image.sh: no .venv here; run \`make venv\` first" >&2
  exit 2
fi
exec "$py" -m ucx_dask_gpu image build "$@"
