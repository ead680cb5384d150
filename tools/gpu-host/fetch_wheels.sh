#!/usr/bin/env bash
# Download the cp312 manylinux wheels that a bare GPU host lacks (no registry reachable there), at the versions
# of OUR lock (and the profiler stack.toml [gpu_host] pins), into .whl/ (git-ignored) so the run on the GPU host uses
# the same stack as the image. UCXX is not among them: our own wheels (build/ucxx-wheels, `make ucxx`) travel as they
# are.
# usage: fetch_wheels.sh [DEST]   (default .whl)
#   REHEARSAL=1 (default DEST build/whl-rehearsal): for THIS machine's python3 instead of the GPU host's 3.12, plus the
#   packages the GPU host already has, so a GPU-host run can be rehearsed on a CPU machine, e.g.
#   UCX_DASK_GPU_WHEELS=build/whl-rehearsal tools/gpu-host/bench_session.sh --cpu OUTDIR
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=${1:-.whl}
[ "${REHEARSAL:-0}" = 1 ] && dest=${1:-build/whl-rehearsal}
# Present on the H200 host's system Python already: numpy, cupy, cuda-core/bindings,
# nvidia-ml-py, pandas, pyarrow, psutil, msgpack, click, pyyaml, toolz, cloudpickle, jinja2, fsspec, packaging.
missing="dask distributed dask-cuda rapids-dask-dependency librmm-cu13 rmm-cu13 rapids-logger cuda-core nvtx zict tblib
         locket partd tornado sortedcontainers lazy-importer"
pyver=3.12
if [ "${REHEARSAL:-0}" = 1 ]; then
  pyver=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  missing="$missing numpy cupy-cuda13x cuda-bindings cuda-pathfinder nvidia-cuda-runtime nvidia-ml-py pandas pyarrow
           psutil msgpack click pyyaml toolz cloudpickle jinja2 markupsafe fsspec packaging python-dateutil tzdata
           importlib-metadata zipp matplotlib contourpy cycler fonttools kiwisolver pillow pyparsing"
fi
specs=$(PYTHONPATH=src python3 - $missing <<'PY'
import sys
from ucx_dask_gpu import stack
from ucx_dask_gpu.stack import lock
pins = lock.load_lock(stack.load().lock_path())
for name in sys.argv[1:]:
    pin = pins.get(lock.canonical(name))
    if pin is None:
        sys.exit(f"fetch_wheels: {name} is not in the lock")
    print(f"{name}=={pin.version}")
PY
)
# The per-task benchmark's profiler (benchmarks/pertask.py), pinned in stack.toml [gpu_host].
specs="$specs $(PYTHONPATH=src python3 -m ucx_dask_gpu stack get gpu_host.profiler)"
rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest.tmp" $specs
rm -rf "$dest" && mv "$dest.tmp" "$dest"
du -sh "$dest"
