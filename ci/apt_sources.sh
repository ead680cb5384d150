#!/usr/bin/env bash
# The machine's apt sources list only `main` and no deb-src. libcuda1/libnvidia-ml1 live in non-free and
# `apt-get source ucx` needs a deb-src entry, so add both for bookworm (idempotent).
set -euo pipefail
target=/etc/apt/sources.list.d/ucx-dask-gpu.sources
[ "$(id -u)" = 0 ] || { echo "apt_sources.sh: needs root to write $target" >&2; exit 1; }
tmp=$(mktemp "$target.XXXXXX")
cat >"$tmp" <<'SRC'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: contrib non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
chmod 644 "$tmp"
if cmp -s "$tmp" "$target" 2>/dev/null; then rm -f "$tmp"; else mv "$tmp" "$target"; fi
