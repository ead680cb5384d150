#!/bin/sh
# Fetch, build and verify UCX from pinned, verified source: `build.sh fetch|build|verify ...` (see README.md here).
# Thin wrapper: the logic is the stdlib-only Python in src/ucx_dask_gpu/ucxbuild, so this runs unchanged in the
# image's builder stage, a conda-build environment and on bare metal with any python3 >= 3.11.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
PYTHONPATH="$here/../src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m ucx_dask_gpu.ucxbuild "$@"
