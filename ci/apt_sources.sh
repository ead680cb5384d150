#!/usr/bin/env bash
# The machine's apt sources list only `main` and no deb-src. libcuda1/libnvidia-ml1 live in non-free and
# `apt-get source ucx` needs a deb-src entry, so add both for stack.toml's [debian] suite and mirror (idempotent).
# The values are read with the package's stdlib-only loader, like ci/install_prereqs.sh does.
set -euo pipefail
cd "$(dirname "$0")/.."
target=/etc/apt/sources.list.d/ucx-dask-gpu.sources
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
