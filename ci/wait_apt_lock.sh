#!/usr/bin/env bash
# Wait until no other process holds apt's or dpkg's locks (an unattended upgrade, another apt-get), so the apt-get
# that follows does not fail at once with exit 100. Bounded: UCX_DASK_GPU_APT_LOCK_WAIT seconds (default 300), a
# progress line every 10 s naming the holder; then one line and exit APT_LOCKED (src/ucx_dask_gpu/errors.py).
# The locks are only looked at (F_GETLK), never taken, so the other apt run is not disturbed. $UCX_DASK_GPU_APT_LOCKS
# (space-separated paths) replaces the list of lock files.
set -euo pipefail
cd "$(dirname "$0")/.."
limit=${UCX_DASK_GPU_APT_LOCK_WAIT:-300}
if ! [[ $limit =~ ^[0-9]+$ ]]; then
  echo "wait_apt_lock.sh: UCX_DASK_GPU_APT_LOCK_WAIT=$limit is not a number of seconds" >&2
  exit 2
fi
holder() {  # "LOCKFILE PID COMMAND" of the first held lock, nothing when all are free
  # shellcheck disable=SC2086
  python3 - ${UCX_DASK_GPU_APT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock \
    /var/cache/apt/archives/lock} <<'PY'
import fcntl, os, struct, sys
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        continue
    try:
        got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    finally:
        os.close(fd)
    kind, _, _, _, pid = struct.unpack("hhqqi", got)
    if kind != fcntl.F_UNLCK:
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            comm = "?"
        print(path, pid, comm)
        break
PY
}
start=$SECONDS
report=0
while held=$(holder) && [ -n "$held" ]; do
  read -r lock pid comm <<<"$held"
  waited=$((SECONDS - start))
  if [ "$waited" -ge "$limit" ]; then
    code=$(PYTHONPATH=src python3 -c 'from ucx_dask_gpu.errors import APT_LOCKED; print(APT_LOCKED)')
    echo "apt lock: $lock still held by pid $pid ($comm) after ${limit} s; let it finish (or stop it), then run" \
         "again (UCX_DASK_GPU_APT_LOCK_WAIT=SECONDS waits longer)" >&2
    exit "$code"
  fi
  if [ "$waited" -ge "$report" ]; then
    echo "apt lock: $lock is held by pid $pid ($comm); waiting (${waited} s of ${limit} s)"
    report=$((report + 10))
  fi
  sleep 1
done
