#!/usr/bin/env bash
# conda-build script for `ucx`: build UCX with ucx-src-build/ (the script the image and bare-metal hosts use too) into
# $PREFIX, then check the result is the package meta.yaml names. Logic lives in the Python package; this only wires
# conda-build's environment ($PREFIX, $SRC_DIR, $CPU_COUNT, $BUILD_PREFIX, $PKG_VERSION) to it.
set -euo pipefail
repo="$SRC_DIR/ucx-dask-gpu"   # the repository, the recipe's `path:` source
# ucx-src-build is stdlib Python; it runs on the build env's python ($PYTHON points at the host env, which has none).
export PYTHON="$BUILD_PREFIX/bin/python"
args=(build --prefix "$PREFIX" --jobs "${CPU_COUNT:-1}" --require ib,cuda)
# CUDA: conda's cuda-cudart-dev / cuda-nvml-dev / cuda-driver-dev in the host env (targets/ layout, lib/stubs);
# where there is no conda CUDA, ucx-src-build's `auto` uses the pinned PyPI header wheels and link-only .debs.
if [ -f "$PREFIX/targets/x86_64-linux/include/cuda.h" ]; then args+=(--cuda "$PREFIX"); else args+=(--cuda auto); fi
# A pre-fetched directory (`ucx-src-build/build.sh fetch --dest DIR`, an air-gapped mirror): build from it, offline.
if [ -n "${UCX_DASK_GPU_SOURCE_MIRROR:-}" ]; then args+=(--sources "$UCX_DASK_GPU_SOURCE_MIRROR" --offline); fi
"$repo/ucx-src-build/build.sh" "${args[@]}"
# The package must hold the UCX its name says: build-info.json's version/sha256 against $PKG_VERSION and stack.toml.
PYTHONPATH="$repo/src" "$PYTHON" -m ucx_dask_gpu.conda.buildcheck "$PREFIX"
