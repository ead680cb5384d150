#!/usr/bin/env bash
# The machine's apt sources list only `main` and no deb-src. libcuda1/libnvidia-ml1 live in non-free and
# `apt-get source ucx` needs a deb-src entry, so add both for stack.toml's [debian] suite and mirror (idempotent).
# The values are read with the package's stdlib-only loader, like ci/install_prereqs.sh does.
# `--status` prints one line when the source is in place (what `make` says at its end); `--remove` takes it out again.
set -euo pipefail
cd "$(dirname "$0")/.."
target=/etc/apt/sources.list.d/ucx-dask-gpu.sources
case "${1:-}" in
  "") ;;
  --status)
    if [ -f "$target" ]; then
      echo "left in place: the apt source $target (Debian contrib, non-free and deb-src);" \
           "remove it: ci/apt_sources.sh --remove"
    fi
    exit 0 ;;
  --remove)
    [ "$(id -u)" = 0 ] || { echo "apt_sources.sh: needs root to remove $target" >&2; exit 1; }
    rm -f "$target"
    ci/wait_apt_lock.sh
    apt-get update -qq
    echo "removed $target"
    exit 0 ;;
  *) echo "usage: ci/apt_sources.sh [--status|--remove]" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "apt_sources.sh: needs root to write $target" >&2; exit 1; }
suite=$(PYTHONPATH=src python3 -m ucx_dask_gpu stack get debian.suite)
mirror=$(PYTHONPATH=src python3 -m ucx_dask_gpu stack get debian.mirror)
tmp=$(mktemp "$target.XXXXXX")
cat >"$tmp" <<SRC
Types: deb
URIs: $mirror
Suites: $suite $suite-updates
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: $mirror
Suites: $suite
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
chmod 644 "$tmp"
if cmp -s "$tmp" "$target" 2>/dev/null; then rm -f "$tmp"; else mv "$tmp" "$target"; fi
