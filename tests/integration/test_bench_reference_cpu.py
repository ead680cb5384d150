"""dask-cuda's local_cupy beside `ucx-dask-gpu bench transpose`, for real in CPU mode: --parity on a variant's running
cluster and --peer on a cluster started for it alone, each run in chunks between our timed rounds; and the hand-over
that lets local_cupy apply its own RMM arguments to the peer's dask-cuda workers. No timing is asserted."""
import json
import re
import subprocess
import sys

import pytest

from ucx_dask_gpu.bench import reference

pytestmark = pytest.mark.integration

RUNS = 6  # two chunks of 3 timed runs: after our rounds 2 and 5


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "ucx_dask_gpu", "bench", "transpose", "--cpu", "--size", "400", "--chunks", "100",
         "--runs", str(RUNS), "--allow-few", "--warmup", "1", "--variant", "ucx@defaults:none", "--variant",
         "tcp@defaults:none", "--parity", "tcp/defaults", "--peer", "--out", str(out), "--budget", "400",
         "--run-timeout", "120"], capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((out / "transpose.json").read_text()), (out / "transpose.md").read_text()


def test_each_reference_ran_on_the_cluster_it_belongs_on(run):
    """parity: the workers local_cupy printed are its variant's; peer: those of a cluster started for it alone with
    the defaults' config (ucx/defaults'), none of a variant's."""
    _, p, _ = run
    clusters = {c["id"]: c for c in p["clusters"]}
    parity, peer = p["references"]
    assert parity["status"] == peer["status"] == "ok", (parity.get("error"), peer.get("error"))
    mine = clusters[parity["cluster"]]
    assert mine["variants"] == ["tcp/defaults"] and parity["against"] == "tcp/defaults"
    assert sorted(parity["worker_addresses"].values()) == sorted(mine["workers"])
    own = clusters[peer["cluster"]]
    variants = [c for c in p["clusters"] if c is not own]
    assert own["variants"] == [f"ucx/{reference.PEER_LABEL}"] and peer["against"] == f"its own cluster {own['id']}"
    assert own["config"] == next(c for c in variants if c["variants"] == ["ucx/defaults"])["config"]
    assert own["id"] not in {r["cluster"] for r in p["runs"]} and own["shutdown"]["clean"]
    assert f"--scheduler-address {own['scheduler']}" in peer["command"] and "rmm" not in peer["command"]
    assert sorted(peer["worker_addresses"].values()) == sorted(own["workers"])
    assert not set(own["workers"]) & {w for c in variants for w in c["workers"]}
    assert peer["compared_with"] == "ucx/defaults" and peer["ratio_to_ours"]["n"] == RUNS


def test_local_cupy_ran_in_chunks_between_our_rounds(run):
    """Two chunks of 3 timed runs, after our rounds 2 and 5 (in the JSON and in the log's order), warm-up runs in the
    first only; their walls merged."""
    proc, p, md = run
    lines = proc.stderr.splitlines()

    def where(pattern):
        return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]

    for r in p["references"]:
        assert r["interleaving"] == {"chunks": 2, "runs_per_chunk": [3, 3], "after_rounds": [2, 5],
                                     "rounds_between_chunks": [3], "warmup_runs": [1, 0]}
        assert [c["rounds_before"] for c in r["chunks"]] == [2, 5] and r["warmup_runs"] == 1
        assert [c["command"].split("--warmup-runs ")[1][0] for c in r["chunks"]] == ["1", "0"]
        assert r["wall_s"] == r["chunks"][0]["wall_s"] + r["chunks"][1]["wall_s"] and len(r["wall_s"]) == RUNS
        assert r["chunks"][0]["end_s"] <= r["chunks"][1]["start_s"]
        for index, after in ((1, 2), (2, 5)):
            (start,) = where(rf"\[{r['kind']} local_cupy {index}/2\] -m {reference.TOOL}")
            assert max(where(rf"\] round {after}:")) < start < min(where(rf"\] round {after + 1}:"))
        assert f"- {r['kind']}: against {r['against']}" in md
        assert "runs 3 (+1 warm-up) after round 2, 3 (+0 warm-up) after round 5" in md


def test_the_rmm_handover_removes_only_dask_cudas_rmmsetup():
    """FORGET_RMM_SETUP on a running cluster: the RMMSetup plugin is gone (local_cupy's test for a memory setup of the
    cluster's own then finds none), every other plugin stays."""
    from distributed import Client, LocalCluster, WorkerPlugin

    with LocalCluster(n_workers=2, processes=False, protocol="tcp", host="127.0.0.1", dashboard_address=None) \
            as cluster, Client(cluster) as client:
        for name in ("RMMSetup-0123", "keep-me"):
            client.register_plugin(WorkerPlugin(), name=name)
        proc = subprocess.run([sys.executable, "-c", reference.FORGET_RMM_SETUP, cluster.scheduler_address],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines()[-1] == "2"  # workers that had one
        left = client.run(lambda dask_worker: sorted(dask_worker.plugins))
        assert all("keep-me" in names and not any("RMMSetup" in n for n in names) for names in left.values())
