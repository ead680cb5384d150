#!/usr/bin/env bash
# On the GPU host: the topology plan (+ a sysfs record for unit tests), the GPU tests, and `ucx-dask-gpu cluster`
# (the plan applied by TopologyCUDACluster, protocol ucx) running the transpose workload, stopped with SIGTERM.
# Everything lands in $1 (default $OUT). Bounded: about 2 minutes normally, under 9 minutes at worst.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:?usage: topology.sh OUTDIR}}
mkdir -p "$out"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
cli="$py -m ucx_dask_gpu"
rc=0
step() { echo "== $*"; }

# a venv on our stack from the copied .whl/, build/ucx-prefix and build/ucxx-wheels (fetch_wheels.sh, make ucx ucxx)
source tools/gpu-host/stack_venv.sh || exit 1

step "nvidia-smi topo -m"
nvidia-smi topo -m | tee "$out/nvidia-smi-topo-m.txt"
step "ucx-dask-gpu topology"
$cli topology --record-sysfs "$out/sysfs-record.txt" | tee "$out/topology.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
$cli topology --json > "$out/topology.json" || rc=1
$cli topology --from-topo "$out/nvidia-smi-topo-m.txt" > "$out/topology-from-text.txt" || rc=1
# the unit test that replays a recorded GPU-host sysfs runs here too (this copy of the tree only)
[ -s "$out/sysfs-record.txt" ] && cp "$out/sysfs-record.txt" tests/fixtures/h200x2/sysfs-record.txt

step "pytest (GPU tests + topology unit tests)"
timeout 240 $py -m pytest -q -rs -s -p no:cacheprovider tests/gpu/test_topology_gpu.py tests/unit/test_topology.py \
  2>&1 | tee "$out/pytest.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1

step "ucx-dask-gpu cluster --gpus auto (ucx) + workload transpose (cupy)"
sched=$(mktemp -u /tmp/ucx-dask-gpu-sched.XXXXXX.json)
$cli cluster --gpus auto --protocol ucx --scheduler-port 0 --dashboard-address none --scheduler-file "$sched" \
  > "$out/cluster.out" 2> "$out/cluster.err" &
cpid=$!
for _ in $(seq 120); do { [ -f "$sched" ] || ! kill -0 "$cpid" 2>/dev/null; } && break; sleep 1; done
if [ -f "$sched" ]; then
  addr=$($py -c 'import json, sys; print(json.load(open(sys.argv[1]))["address"])' "$sched")
  timeout 150 $cli workload transpose --scheduler "$addr" --backend cupy --size 20000 --chunk 4000 --json \
    --output "$out/transpose-ucx.json" || rc=1
  timeout 60 $py - "$sched" > "$out/workers.json" <<'PY' || rc=1
import json, os, sys
from distributed import Client
with Client(scheduler_file=sys.argv[1], timeout=30) as c:
    seen = c.run(lambda: {"affinity": sorted(os.sched_getaffinity(0)),
                          "env": {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "CUDA_"))}})
print(json.dumps(seen, indent=1))
PY
  cat "$out/workers.json"
else
  echo "cluster did not come up within 120 s"; rc=1
fi
kill -TERM "$cpid" 2>/dev/null; wait "$cpid"; crc=$?
echo "cluster exit status after SIGTERM: $crc"; [ "$crc" -eq 0 ] || rc=1
tail -n 25 "$out/cluster.out"; tail -n 5 "$out/cluster.err"
exit $rc
