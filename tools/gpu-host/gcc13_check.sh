#!/usr/bin/env bash
# Compile check of ucx-src-build/patches/<version> with the GPU host's gcc 13 (the image's Debian has gcc 12):
# builds the whole patched, autogen'd tree (test/apps included) with the host's CUDA, CPU only and at low priority
# so it can run beside GPU measurements. Summary to WORKDIR/gcc13.txt, logs beside it.
# usage: gcc13_check.sh WORKDIR [JOBS]   (needs build/gcc13-check/ucx-1.13.1-patched-autogen.tar.xz)
set -uo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
W=${1:?usage: gcc13_check.sh WORKDIR [JOBS]}; jobs=${2:-6}
src=build/gcc13-check/ucx-1.13.1-patched-autogen.tar.xz
[ -f "$src" ] || { echo "gcc13_check: $src missing (the patched, autogen'd 1.13.1 tree, tar -cJ)" >&2; exit 2; }
G=$W/gcc13; mkdir -p "$G"; tar -xJf "$src" -C "$G"; cd "$G"/ucx-1.13.1 || exit 2
{ gcc --version | head -1
  nice ./contrib/configure-release --prefix="$G/p" --with-cuda=/usr/local/cuda --without-verbs --without-rdmacm \
    --without-java --without-go --disable-static > "$W/gcc13-configure.log" 2>&1; echo "configure rc=$?"
  nice make -j"$jobs" > "$W/gcc13-make.log" 2>&1; echo "patched full make (incl. test/apps) rc=$?"
  grep -E -B3 -A3 "error|Error [0-9]" "$W/gcc13-make.log" | head -40
  ls -l test/apps/iodemo/io_demo test/apps/test_cuda_hook_dynamic test/apps/sockaddr/sa 2>&1
  # the patch is needed, not merely harmless: without 0001 gcc 13 must reject uct_md.c again
  patch -R -p1 < "$repo/ucx-src-build/patches/1.13.1/0001-uct-md-mem-advise-enum-type.patch"
  nice make -C src/uct > "$W/gcc13-without-0001.log" 2>&1; echo "without 0001: rc=$? (expect non-zero)"
  grep -m3 error "$W/gcc13-without-0001.log"; } > "$W/gcc13.txt" 2>&1
