#!/usr/bin/env bash
# On a GPU host, in one run: a venv on our from-source stack, made the way `make venv` makes it (the copied UCXX
# wheels through `ucx-src-build/build.sh install-ucxx`, the lock's runtime wheels from .whl/), then what it runs on
# (ucx_info, doctor) and the GPU tests of UCX and UCXX (two Dask workers sharing GPU 0 exchange CuPy blocks).
# usage: ucxx_session.sh OUTDIR   (needs .whl/ build/ucx-prefix build/ucxx-wheels beside the tree; fetch_wheels.sh
#        fills .whl/)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?usage: ucxx_session.sh OUTDIR}
mkdir -p "$out"
# shellcheck source=stack_venv.sh
source tools/gpu-host/stack_venv.sh || exit 1   # makes and activates $venv
{ command -v python3; python3 -c 'import sys; print(sys.path)'; echo "cudart: $cudart"; } > "$out/host-python.txt" 2>&1
{
  build/ucx-prefix/bin/ucx_info -v
  build/ucx-prefix/bin/ucx_info -d | grep -E "Transport|Device" | paste - - | sort -u
  nvidia-smi -L
} > "$out/ucx-info.txt" 2>&1
"$venv/bin/python" -m ucx_dask_gpu doctor --json > "$out/doctor.json" 2> "$out/doctor.err"
"$venv/bin/python" -m ucx_dask_gpu doctor > "$out/doctor.txt" 2>&1
timeout 480 "$venv/bin/python" -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_ucx_gpu.py \
  tests/gpu/test_ucxx_gpu.py tests/gpu/test_workloads_gpu.py > "$out/pytest-gpu.txt" 2>&1
echo "pytest rc=$?" | tee -a "$out/pytest-gpu.txt"
tail -n 40 "$out/pytest-gpu.txt"; cat "$out/doctor.txt" "$out/ucx-info.txt"
