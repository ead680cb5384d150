"""On a GPU host: the binding we built (UCXX on our UCX) moves CuPy blocks between two Dask workers that share GPU 0,
through UCX's cuda_ipc transport, with every role on our libucp. One GPU is enough; skips, with the reason, elsewhere.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ucx_dask_gpu import stack

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, time
    import cupy
    from distributed import Client, LocalCluster, wait
    from ucx_dask_gpu.proof.client import ucx_loaded

    def make(nbytes, seed):
        return cupy.random.RandomState(seed).random_sample(nbytes // 8)

    def checksum(a):
        return type(a).__module__.split(".")[0], float(a.sum())

    def incoming(dask_worker):
        return [{"nbytes": t["total"], "duration": t["duration"]} for t in dask_worker.transfer_incoming_log]

    if __name__ == "__main__":
        with LocalCluster(protocol="ucx", n_workers=2, threads_per_worker=1, dashboard_address=None,
                          host="127.0.0.1") as cluster, Client(cluster) as client:
            a, b = sorted(client.scheduler_info()["workers"])
            out = {"roles": {"client": ucx_loaded(), "scheduler": client.run_on_scheduler(ucx_loaded),
                             "workers": client.run(ucx_loaded)}, "sizes": {}}
            for i, nbytes in enumerate((8, 1 << 20, 128 << 20)):
                src = client.submit(make, nbytes, i, workers=[a], pure=False)
                wait(src)
                t0 = time.perf_counter()
                got = client.submit(checksum, src, workers=[b], allow_other_workers=False, pure=False).result()
                fetch = time.perf_counter() - t0
                want = client.submit(checksum, src, workers=[a], pure=False).result()
                out["sizes"][nbytes] = {"module": got[0], "equal": got == want, "fetch_s": fetch}
            out["incoming"] = client.run(incoming, workers=[b])[b]
        print(json.dumps(out))
""")


def test_two_workers_on_one_gpu_move_cupy_blocks_over_cuda_ipc_on_our_ucx(gpu):
    st = stack.load(REPO / "stack.toml")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "DASK_"))}
    # Both workers see GPU 0; UCX picks the transports itself (nothing forced) and says which protocol it chose.
    env.update(CUDA_VISIBLE_DEVICES="0", UCX_PROTO_INFO="y")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    roles = [out["roles"]["client"], out["roles"]["scheduler"], *out["roles"]["workers"].values()]
    for role in roles:
        assert role["ucx_version"] == st.ucx.version, role
        assert (Path(role["libucp"]).parent.parent / "share" / "ucx-dask-gpu" / "build-info.json").is_file(), role
    for nbytes, r in out["sizes"].items():
        assert r["module"] == "cupy" and r["equal"], (nbytes, r)
    moved = [t for t in out["incoming"] if t["nbytes"] >= 128 << 20]
    assert moved, out["incoming"]
    # UCX's own protocol table for the 128 MiB device-to-device message between the two worker processes.
    proto = "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if "cuda_ipc" in line)
    assert re.search(r"cuda_ipc", proto), (proc.stdout + proc.stderr)[-4000:]
    print(f"UCX {st.ucx.version}: 128 MiB CuPy block worker->worker on one GPU: transfer_incoming_log "
          f"{moved[0]['duration'] * 1e3:.2f} ms ({moved[0]['nbytes'] / moved[0]['duration'] / 1e9:.1f} GB/s), "
          f"end-to-end fetch {out['sizes'][str(128 << 20)]['fetch_s'] * 1e3:.1f} ms")
    for nbytes, r in sorted(out["sizes"].items(), key=lambda kv: int(kv[0])):
        print(f"  {int(nbytes):>10} B: fetch {r['fetch_s'] * 1e3:.1f} ms")
    print("\n".join(proto.splitlines()[:12]))
