#!/usr/bin/env bash
# The image's own bits on a GPU host that has no Docker and no network (tools/rootfs_runner; parts of
# `python -m tools.rootfs_runner export IMAGE DIR` copied there one batch at a time, each checked on arrival):
#   image_rootfs.sh receive BATCH_DIR [--parts DIR]    move the batch's part into the parts directory (stack.toml
#                                                      [gpu_host]), check its sha256, say which parts are missing
#   image_rootfs.sh run OUTDIR [--cpu] [--parts DIR] [--root DIR]
#                                                      as root: verify + unpack the parts, mount /proc /sys /dev, add
#                                                      the host driver's libraries, run scheduler + 2 workers sharing
#                                                      GPU 0 (UCX_PROTO_INFO=y) + the transpose client (cupy, ucx) from
#                                                      the image's filesystem (chroot, image user, entrypoint), check
#                                                      the answer, libucp in every role and cuda_ipc, stop everything,
#                                                      write OUTDIR/image-rootfs.tgz, OUTDIR/result.json, OUTDIR/run.log
# Also `image_rootfs.sh tools`: what this machine has for it (decoders, unshare, chroot, driver libraries).
# Where files reach such a host only in small pieces (an upload limit), export parts that fit one with the tree
# and copy one batch at a time (the parts directory must outlive the copies):
#   .venv/bin/python -m tools.rootfs_runner export ucx-dask-gpu:0.1.0 build/rootfs-export --part-size 56MiB
#   each batch k: copy build/rootfs-export/batch-0k, then
#                 bash tools/gpu-host/image_rootfs.sh receive build/rootfs-export/batch-0k
#   after the last one:
#                 bash tools/gpu-host/image_rootfs.sh run $OUT
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH=$PWD:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
py=$(command -v python3) || { echo "image_rootfs.sh: no python3 here" >&2; exit 2; }
case "${1:-}" in
  receive) shift; exec "$py" -m tools.rootfs_runner receive "$@" ;;
  run)
    shift
    [ -n "${1:-}" ] && [ "${1#-}" = "$1" ] || { echo "usage: image_rootfs.sh run OUTDIR [--cpu] ..." >&2; exit 2; }
    mkdir -p "$1"
    # the whole run's output also lands next to its results (OUTDIR/run.log); errors stay on stderr
    : > "$1/run.log"
    "$py" -m tools.rootfs_runner run "$@" 2> >(tee -a "$1/run.log" >&2) | tee -a "$1/run.log"
    rc=${PIPESTATUS[0]}
    wait
    exit "$rc" ;;
  tools)
    for t in xz zstd unshare chroot mount tar ldconfig nvidia-smi; do
      printf '%-10s %s\n' "$t" "$(command -v "$t" || echo MISSING)"; done
    "$py" -c 'import sys; print("python", sys.version.split()[0]); import lzma; print("lzma ok")'
    "$py" -c 'import zstandard; print("zstandard", zstandard.__version__)' 2>/dev/null || echo "zstandard MISSING"
    unshare --mount --propagation private true 2>/dev/null && echo "unshare --mount ok" || echo "unshare --mount FAILS"
    ldconfig -p | grep -E 'libcuda\.so|libnvidia-ml\.so' || echo "driver libraries: none in ldconfig -p"
    ls /usr/local/nvidia/lib64 2>/dev/null | grep -E '^lib(cuda|nvidia-ml)\.so' || true
    ;;
  *) echo "usage: image_rootfs.sh receive BATCH_DIR | run OUTDIR [--cpu] | tools" >&2; exit 2 ;;
esac
