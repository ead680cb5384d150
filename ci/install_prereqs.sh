#!/usr/bin/env bash
# Install what a fresh Debian 12 machine needs to build UCX and run the suite (root). Package names come from
# stack.toml ([debian] ucx_build_packages), read with the package's stdlib-only loader. When another apt or dpkg
# process holds their lock, each apt-get waits for it (ci/wait_apt_lock.sh: at most $UCX_DASK_GPU_APT_LOCK_WAIT
# seconds, default 300, saying so every 10 s; then one line and exit APT_LOCKED, 19).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then echo "install_prereqs.sh: run as root (or install: see stack.toml [debian])" >&2; exit 1; fi
ci/apt_sources.sh
# Read into a variable first: a failing command inside `< <(...)` would not stop the script (set -e does not see it).
listed=$(PYTHONPATH=src python3 -m ucx_dask_gpu stack get debian.ucx_build_packages --json)
mapfile -t pkgs < <(python3 -c 'import json,sys; print("\n".join(json.load(sys.stdin)))' <<<"$listed")
missing=()
for p in "${pkgs[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  echo "install_prereqs: apt-get install ${missing[*]}"
  ci/wait_apt_lock.sh
  apt-get update -qq
  ci/wait_apt_lock.sh
  # A lock taken between the check and apt-get: apt waits for the dpkg lock itself, as long.
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    -o DPkg::Lock::Timeout="${UCX_DASK_GPU_APT_LOCK_WAIT:-300}" "${missing[@]}" >/dev/null
fi
