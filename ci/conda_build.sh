#!/usr/bin/env bash
# Build this project's conda channel with the real tools, where conda-forge and rapidsai are reachable
# (.github/workflows/conda.yml runs it; docs/conda.md). Usage:
#   ci/conda_build.sh PLATFORM CUDA PINNING_DIR
# PLATFORM: linux-64 | linux-aarch64, this machine's (rattler-build builds and tests natively); CUDA: one of
# stack.toml [conda].cuda_versions; PINNING_DIR: a checkout of conda-forge-pinning-feedstock's recipe/ folder
# (conda_build_config.yaml + migrations/). Needs on PATH: rattler-build, micromamba, python3 with py-rattler-build and
# pyyaml, conda-package-handling. Writes build/conda-recipes/ (the packed recipes), build/variants/ (the stacked variant
# configs), build/channel/ (the packages, indexed by rattler-build, their recipe tests passed: what
# ci/conda_upload.sh publishes) and build/conda-install-check/ (the install line's environment); build/channel/ and
# build/conda-install-check/ are this script's own, emptied at the start of every run.
set -euo pipefail
cd "$(dirname "$0")/.."

usage="usage: ci/conda_build.sh PLATFORM CUDA PINNING_DIR"
platform=${1:?$usage}
cuda=${2:?$usage}
export UCX_DASK_GPU_CONDA_PINNING=${3:?$usage}
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
udg=(python3 -m ucx_dask_gpu)
channel=$PWD/build/channel

# The generated lines match stack.toml; every recipe renders under conda-forge's pinning + the migrators stack.toml
# names, and passes the project's checks.
"${udg[@]}" conda regen --check
"${udg[@]}" conda lint --variants conda-forge --packed build/conda-recipes

# In build order: ucxx builds against the ucx just built (this channel first, strict priority), the metapackage
# pins both. Each recipe gets the variant config conda-smithy would give this job: pinning + migrators + the recipe's
# own conda_build_config.yaml, this CUDA version's entry of the zipped keys.
# Built afresh: no package from an earlier run (or a stand-in channel copied here) is kept in place of a build.
rm -rf "$channel"
mkdir -p "$channel" build/variants
for recipe in ucx ucxx ucx-dask-gpu; do
  variants=build/variants/$recipe-$platform-cuda$cuda.yaml
  "${udg[@]}" conda variants --variants conda-forge --recipe "$recipe" --platform "$platform" --cuda "$cuda" \
    --out "$variants"
  rattler-build build --recipe "build/conda-recipes/$recipe" --target-platform "$platform" \
    --variant-config "$variants" --ignore-recipe-variants \
    --channel "file://$channel" --channel rapidsai --channel conda-forge --channel-priority strict \
    --output-dir "$channel" --test native
done

# What a user runs (README's install line), from the packages just built: a fresh environment whose ucx_info is
# the packaged UCX and whose ucxx loads the environment's own libucp.
env=$PWD/build/conda-install-check
rm -rf "$env"
micromamba create --yes --prefix "$env" --channel "file://$channel" --channel rapidsai --channel conda-forge \
  --strict-channel-priority ucx-dask-gpu "cuda-version=$cuda"
"$env/bin/ucx_info" -v | tee /dev/stderr | grep -F "Library version: $("${udg[@]}" stack get ucx.source.version)"
"$env/bin/python" - "$env" <<'PY'
import sys

import ucxx  # noqa: F401  (loads libucxx, hence libucp)
from ucx_dask_gpu.ucx.transports import mapped_libucp

lib = mapped_libucp()
print(f"ucxx {ucxx.__version__} on {lib}")
sys.exit(0 if lib and lib.startswith(sys.argv[1]) else f"ucxx loaded {lib}, not the environment's libucp")
PY
"$env/bin/ucx-dask-gpu" guard id

# What an upload would send: refused (exit 63) if anything in the channel was built with stand-ins.
"${udg[@]}" conda publishable "$channel" >/dev/null
