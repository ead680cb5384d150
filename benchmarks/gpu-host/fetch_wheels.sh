#!/usr/bin/env bash
# The wheels a bare GPU host lacks, for its Python 3.12, into .whl/ (git-ignored): OUR stack, as the venv runs it.
#   - UCXX (libucxx, ucxx, distributed-ucxx) built from source here against our UCX: build/ucxx-wheels (`make ucxx`);
#   - the rest at the versions of our lock (RAPIDS 26.08 runtime: rmm/librmm, dask-cuda, dask/distributed, ...).
# No libucx wheel: the device loads our UCX from the carried build/ucx-prefix (benchmarks/gpu-host/stack_env.sh puts
# it on the loader path). Carry `.whl` and `build/ucx-prefix` in the device call.
# usage: fetch_wheels.sh [DEST]   (default .whl)
#   REHEARSAL=1 (default DEST build/whl-rehearsal): for THIS machine's python3 instead of the GPU host's 3.12, and
#   also the packages the GPU host already has, so the device run can be rehearsed here:
#   UCX_DASK_GPU_WHEELS=build/whl-rehearsal TRANSFER_MODE=cpu benchmarks/gpu-host/transfer_session.sh OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
[ "${REHEARSAL:-0}" = 1 ] && dest=${1:-build/whl-rehearsal}
wheels=${UCXX_WHEELS:-build/ucxx-wheels}
[ -f "$wheels/ucxx-build-info.json" ] || { echo "fetch_wheels: no $wheels/ucxx-build-info.json (make ucxx)" >&2; exit 1; }
[ -f build/ucx-prefix/lib/libucp.so.0 ] || { echo "fetch_wheels: no build/ucx-prefix (make ucx)" >&2; exit 1; }
# Present on the lent H200 image already (see /work/.library/device/KINDS.md): numpy, cupy, cuda-core/bindings/
# pathfinder, nvidia-cuda-runtime, nvidia-ml-py, pandas, pyarrow, psutil, msgpack, click, pyyaml, toolz, cloudpickle,
# jinja2, fsspec, packaging, sortedcontainers.
missing="dask distributed dask-cuda rapids-dask-dependency librmm-cu13 rmm-cu13 rapids-logger nvtx zict tblib locket
         partd tornado"
pyver=3.12
if [ "${REHEARSAL:-0}" = 1 ]; then
  pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  missing="$missing numpy cupy-cuda13x cuda-core cuda-bindings cuda-pathfinder nvidia-cuda-runtime nvidia-ml-py pandas
           pyarrow psutil msgpack click pyyaml toolz cloudpickle jinja2 markupsafe fsspec packaging sortedcontainers
           python-dateutil tzdata importlib-metadata zipp lazy-importer"
fi
specs=$(PYTHONPATH=src python3 - $missing <<'PY'
import sys
from ucx_dask_gpu import stack, lockfile
pins = lockfile.load_lock(stack.load().lock_path())
for name in sys.argv[1:]:
    pin = pins.get(lockfile.canonical(name))
    if pin is None:
        sys.exit(f"fetch_wheels: {name} is not in the lock")
    print(f"{name}=={pin.version}")
PY
)
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest.tmp" $specs
cp "$wheels"/*.whl "$wheels/ucxx-build-info.json" "$dest.tmp/"
rm -rf "$dest" && mv "$dest.tmp" "$dest"
du -sh "$dest" build/ucx-prefix
