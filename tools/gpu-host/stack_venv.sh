# Source on a GPU host (bash): a venv on our from-source stack, made the way `make venv` makes it, and activated: the
# lock's runtime wheels from .whl/ (or $UCX_DASK_GPU_WHEELS; fetch_wheels.sh fills it), then the copied UCXX wheels
# (build/ucxx-wheels) through `ucx-src-build/build.sh install-ucxx`, which preloads the copied build/ucx-prefix's
# libucp at start-up. The host's own packages (cupy, numpy, pytest, ...) stay visible after the venv's. Also sets
# PYTHONPATH=src, LD_LIBRARY_PATH to the CUDA runtime wheel's lib (UCX's CUDA modules link libcudart.so.13; the image
# has it in ld.so.conf) and keeps NVLink multicast off. Needs .whl, build/ucx-prefix, build/ucxx-wheels beside the tree.
_r=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export NCCL_NVLS_ENABLE=0 CUDA_DEVICE_ORDER=PCI_BUS_ID PYTHONUNBUFFERED=1 PYTHONPATH=$_r/src
venv=${UCX_DASK_GPU_VENV:-/tmp/udg-venv}  # its path ($venv stays set for the caller)
# The host's python3, also where this was sourced before (a session script run from a shell that has the venv): the
# venv's own python would list the venv's site-packages as the host's and hide the host's packages.
host_python=$(PATH=$(printf %s "$PATH" | tr : '\n' | grep -vxF "$venv/bin" | paste -sd:) command -v python3) || return 1
"$host_python" -m venv "$venv" || return 1
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$host_python" -c 'import sys; print("\n".join(p for p in sys.path if p.startswith("/") and "site-packages" in p or "dist-packages" in p))' \
  > "$site/zz-host-packages.pth"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    "${UCX_DASK_GPU_WHEELS:-$_r/.whl}"/*.whl \
  && "$_r/ucx-src-build/build.sh" install-ucxx --python "$venv/bin/python" --wheels "$_r/build/ucxx-wheels" \
       --ucx-prefix "$_r/build/ucx-prefix" || return 1
cudart=$("$host_python" -c 'import glob, sys; print(next(iter(sorted(g for p in sys.path for g in glob.glob(p + "/nvidia/cu13/lib"))), ""))')
export LD_LIBRARY_PATH=${cudart}
export VIRTUAL_ENV=$venv PATH=$venv/bin:$PATH
