#!/usr/bin/env bash
# On a GPU host, in one bounded run: doctor, `ucx verify` of the from-source prefix, the GPU tests, verify-nvlink
# for our UCX and the pip libucx side by side (plus UCX-setting variants), the deliberate trap, and a gcc 13 compile
# check of the 1.13.1 patches running alongside on spare cores. Everything lands in OUTDIR (a tarball + summaries).
# usage: verify.sh OUTDIR [UCX_PREFIX]   (needs: python3 with nvidia-ml-py, cupy, pytest; libucx wheel in .whl/)
set -uo pipefail
cd "$(dirname "$0")/../.."
R=$PWD
out=${1:?usage: verify.sh OUTDIR [UCX_PREFIX]}
P=$(realpath "${2:-build/ucx-prefix}")
W=$(mktemp -d /tmp/ucx-dask-gpu-verify.XXXXXX)
mkdir -p "$out" "$W/verify"
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1
if ! python3 -c 'import libucx' 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/libucx_cu13-*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$R/src${PYTHONPATH:+:$PYTHONPATH}
step() { echo "== $(date +%T) $*"; }

# gcc 13 check of the patches: CPU only, low priority, on half the cores, while the GPU steps run.
if [ -f build/gcc13-check/ucx-1.13.1-patched-autogen.tar.xz ]; then
  bash tools/gpu-host/gcc13_check.sh "$W" 12 &
  gcc_pid=$!
fi

export LD_LIBRARY_PATH=/usr/local/cuda/lib64
step doctor
python3 -m ucx_dask_gpu doctor --ucx-prefix "$P" > "$W/doctor.txt" 2>&1
python3 -m ucx_dask_gpu doctor --ucx-prefix "$P" --json > "$W/doctor.json" 2>>"$W/doctor.txt"
LD_LIBRARY_PATH=$P/lib:$LD_LIBRARY_PATH RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY=true \
  python3 -m ucx_dask_gpu doctor --json > "$W/doctor-ucxx-prefer-ours.json" 2>&1
step "ucx verify"
timeout 120 python3 -m ucx_dask_gpu ucx verify --prefix "$P" --keep-ld-library-path > "$W/ucx-verify.txt" 2>&1
echo "verify rc=$?" >> "$W/ucx-verify.txt"
"$P/bin/ucx_info" -v > "$W/ucx-1.13.1-source-h200-v.txt" 2>&1
"$P/bin/ucx_info" -d > "$W/ucx-1.13.1-source-h200-d.txt" 2>&1
step "GPU tests: UCX"
UCX_PREFIX=$P timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_ucx_gpu.py > "$W/pytest-gpu-ucx.txt" 2>&1
tail -3 "$W/pytest-gpu-ucx.txt"
unset LD_LIBRARY_PATH  # verify-nvlink sets the CUDA runtime path itself, per prefix

step "verify-nvlink: from-source vs pip libucx, with variants"
timeout 420 python3 -m ucx_dask_gpu.nvlink --ucx-prefix "$P" --ucx-prefix pip --keep-going \
  --variant UCX_RNDV_SCHEME=put_zcopy --variant UCX_MAX_RNDV_RAILS=1 --variant UCX_PROTO_ENABLE=y \
  --variant-sizes 1MiB,256MiB --variants-on first --raw-dir "$W/verify/raw" --out "$W/verify/verify-nvlink" \
  > "$W/verify-nvlink.txt" 2>&1
echo "verify-nvlink exit $?" | tee -a "$W/verify-nvlink.txt"
step "verify-nvlink: the trap (both GPUs visible to both processes) must be invalid"
timeout 100 python3 -m ucx_dask_gpu.nvlink --ucx-prefix "$P" --ucx-prefix pip --keep-going \
  --sizes 256MiB --unsafe-visible-devices --raw-dir "$W/verify/raw-trap" --out "$W/verify/trap" > "$W/trap.txt" 2>&1
echo "trap exit $? (must be 1)" | tee -a "$W/trap.txt"
step "GPU tests: verify-nvlink"
UCX_DASK_GPU_TEST_UCX_PREFIX=pip timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/gpu/test_verify_nvlink_gpu.py > "$W/pytest-gpu-verify.txt" 2>&1
tail -3 "$W/pytest-gpu-verify.txt"

if [ -n "${gcc_pid:-}" ]; then step "waiting for the gcc 13 check"; timeout 120 tail --pid="$gcc_pid" -f /dev/null; cat "$W/gcc13.txt"; fi
step done
tar czf "$out/verify-session.tgz" -C "$W" --exclude=./gcc13 .
cp "$W/verify-nvlink.txt" "$W/trap.txt" "$W/doctor.txt" "$out/" 2>/dev/null
