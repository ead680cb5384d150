# Source on a GPU host (bash): put this shell on OUR stack from the carried .whl/ (or $UCX_DASK_GPU_WHEELS) and
# build/ucx-prefix (benchmarks/gpu-host/fetch_wheels.sh made them): the wheels installed with --target into a private
# site directory (PYTHONPATH), our UCX's lib/ and the CUDA runtime wheel's lib/ (libcudart.so.13, which UCX's CUDA
# modules link) first on the loader path, NVLink multicast off. Prints which libucp UCXX loaded; returns non-zero if
# it is not ours.
_r=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export UCX_DASK_GPU_SITE=${UCX_DASK_GPU_SITE:-/tmp/ucx-dask-gpu-site}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ ! -f "$UCX_DASK_GPU_SITE/.installed" ]; then
  python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$UCX_DASK_GPU_SITE" "${UCX_DASK_GPU_WHEELS:-$_r/.whl}"/*.whl && touch "$UCX_DASK_GPU_SITE/.installed" || return 1
fi
export PYTHONPATH=$UCX_DASK_GPU_SITE:$_r/src${PYTHONPATH:+:$PYTHONPATH}
_cudart=$(python3 - <<'PY'
import glob, os, sys
for base in sys.path:
    for hit in glob.glob(os.path.join(base or ".", "nvidia", "cu13", "lib", "libcudart.so.13*")):
        print(os.path.dirname(hit)); raise SystemExit
PY
)
export LD_LIBRARY_PATH=$_r/build/ucx-prefix/lib${_cudart:+:$_cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
python3 - "$_r/build/ucx-prefix" <<'PY'
import os, sys
import ucxx  # noqa: F401  (loads libucxx, which links libucp)
ours = os.path.realpath(os.path.join(sys.argv[1], "lib"))
maps = [line.split()[-1] for line in open("/proc/self/maps") if "libucp.so" in line]
path = os.path.realpath(maps[0]) if maps else None
print(f"stack_env: ucxx {ucxx.__version__} on {path} (UCX {'.'.join(map(str, ucxx.get_ucx_version()))})")
sys.exit(0 if path and path.startswith(ours) else 1)
PY
