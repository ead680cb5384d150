"""`ucx-dask-gpu bench` end to end in CPU mode: real LocalClusters (tcp, and UCX over TCP through distributed-ucxx),
real dask-cuda local_cupy as the reference, one knob variant; every number in the report comes from those runs."""
import json
import subprocess
import sys

import pytest

from ucx_dask_gpu.bench import settings as st
from ucx_dask_gpu.bench.reference import parse_local_cupy

pytestmark = pytest.mark.integration

SIZE, CHUNK, RUNS = 2000, 500, 2
# against the shipped file's (measured) blocking progress: a knob that changes it, so it is seen to reach the workers
KNOB = "UCXPY_PROGRESS_MODE=thread;ucx-dask-gpu.cluster.threads-per-worker=2;distributed.scheduler.bandwidth=1GB"


def bench(*argv, timeout=420):
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def transpose(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    # The shipped config, plus no root-task queuing: the input's blocks are spread evenly over both workers, so every
    # repetition has to move blocks (with queuing, one worker may end up holding nearly all of them).
    tree = st.load_config("tuned").tree
    st.set_path(tree, "distributed.scheduler.worker-saturation", float("inf"))
    cfg = tmp / "tuned-spread.yaml"
    import yaml

    cfg.write_text(yaml.safe_dump(tree))
    out = tmp / "out"
    proc = bench("transpose", "--cpu", "--size", str(SIZE), "--chunks", str(CHUNK), "--runs", str(RUNS),
                 "--warmup", "1", "--protocols", "ucx,tcp", "--reference", "--config", str(cfg), "--knob", KNOB,
                 "--goal", "wall_s<=1000", "--goal", "p2p_gbps_median>=1000", "--out", str(out),
                 "--budget", "400", "--run-timeout", "150")
    payload = json.loads((out / "transpose-500x500.json").read_text()) if (out / "transpose-500x500.json").exists() \
        else None
    return proc, payload, out


def test_exit_and_outputs(transpose):
    proc, payload, out = transpose
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert payload is not None
    assert {p.name for p in out.iterdir()} == {"transpose-500x500.json", "transpose-500x500.md",
                                                "transpose-500x500.png", "command.txt"}
    assert (out / "transpose-500x500.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ucx-dask-gpu bench transpose --cpu" in (out / "command.txt").read_text()
    md = (out / "transpose-500x500.md").read_text()
    assert "## Knob sweep" in md and "UCXPY_PROGRESS_MODE=thread" in md and "## Where the time goes" in md
    # the stdout table and progress lines
    assert "local_cupy (reference)" in proc.stdout and "UCX/TCP wall ratio" in proc.stdout
    assert "[ucx tuned-spread] run 2/2" in proc.stderr


def test_stable_json_fields(transpose):
    _, p, _ = transpose
    assert p["workload"] == "transpose" and p["size"] == SIZE and p["chunk"] == [CHUNK, CHUNK] and p["gpus"] == []
    assert [(r["protocol"], r["kind"]) for r in p["runs"]] == [("ucx", "base"), ("tcp", "base"), ("ucx", "knob")]
    for r in p["runs"]:
        assert r["status"] == "ok", r.get("error")
        assert {"protocol", "config", "wall_s", "p2p_gbps_median", "p2p"} <= set(r)
        assert len(r["wall_s"]) == (RUNS if r["kind"] == "base" else min(3, RUNS))
        assert all(w > 0 for w in r["wall_s"])
        assert r["chunk"] == [CHUNK, CHUNK]
    ref = p["reference"]
    assert ref["tool"] == "dask_cuda.benchmarks.local_cupy" and ref["protocol"] == "ucx"
    assert ref["status"] == "ok" and len(ref["wall_s"]) == RUNS and ref["compute_chunk_size"] == [CHUNK, CHUNK]
    assert {"tool", "protocol", "wall_s", "p2p_gbps_median"} <= set(ref)
    assert parse_local_cupy(ref["stdout"])["wall_s"] == ref["wall_s"]  # verbatim output kept: a future fixture
    assert [r["protocol"] for r in p["references"]] == ["ucx", "tcp"]
    assert all(r["status"] == "ok" for r in p["references"])
    goals = {g["goal"]: g["met"] for g in p["summary"]["goals"]}
    assert goals == {"wall_s <= 1000": True, "p2p_gbps_median >= 1000": False}
    # the report gives the ratio to 2 decimals: exactly the rounded ratio of the two medians it lists
    assert p["summary"]["ucx_tcp_wall_ratio"] == round(p["runs"][1]["wall_s_median"] / p["runs"][0]["wall_s_median"], 2)


def test_blocks_moved_and_were_measured(transpose):
    _, p, _ = transpose
    for r in p["runs"][:2]:
        p2p = r["p2p"]
        assert p2p["transfers"] > 0 and p2p["gbps_median"] > 0, r["protocol"]
        assert p2p["ignore_bytes"] == 2 ** 20
        assert all(t["bytes"] >= 2 ** 20 for t in r["transfers"] if t["gbps"] == p2p["gbps_median"])
        assert {(x["src"], x["dst"]) for x in p2p["pairs"]} <= {(0, 1), (1, 0)}
        assert sum(x["transfers"] for x in p2p["pairs"]) == p2p["transfers"]
        # every 500x500 float64 block is 2 MB: what moved is whole blocks (or batches of them)
        big = [t for t in r["transfers"] if t["bytes"] >= 2 ** 20]
        assert all(t["bytes"] % (CHUNK * CHUNK * 8) == 0 for t in big)
        assert r["array"]["placement"] and sum(r["array"]["placement"].values()) == (SIZE // CHUNK) ** 2
        assert r["breakdown"]["phases"]["tasks"] > 0
        assert r["breakdown"]["digests"]["gather-dep"]["network"] > 0


def test_sum_is_correct(transpose):
    """The cluster's (x + x.T).sum() equals numpy's on the same input, rebuilt here from its seed."""
    import dask
    import dask.array as da
    import numpy as np

    _, p, _ = transpose
    for r in p["runs"]:
        check = r["check"]
        rs = da.random.RandomState(check["input_seed"], RandomState=np.random.RandomState)
        x = rs.random((SIZE, SIZE), chunks=CHUNK)
        with dask.config.set(scheduler="sync"):
            xn = x.compute()
        expected = float((xn + xn.T).sum())
        assert check["ok"] and check["value"] == pytest.approx(expected, rel=1e-12)


def test_knob_reached_the_workers(transpose):
    _, p, _ = transpose
    base, knob = p["runs"][0], p["runs"][2]
    assert knob["knob"] == KNOB and knob["settings"] == {
        "UCXPY_PROGRESS_MODE": "thread", "ucx-dask-gpu.cluster.threads-per-worker": 2,
        "distributed.scheduler.bandwidth": "1GB"}
    for applied in knob["applied"].values():
        assert applied["UCXPY_PROGRESS_MODE"] == "thread" and applied["progress_mode"] == "thread"
        assert applied["ucx-dask-gpu.cluster.threads-per-worker"] == 2
        assert applied["distributed.scheduler.bandwidth"] == "1GB"
        assert applied["ucx"]["TLS"] == "tcp"  # CPU mode: UCX over TCP
    for applied in base["applied"].values():
        assert applied["UCXPY_PROGRESS_MODE"] == "blocking" and applied["progress_mode"] == "blocking"
        assert applied["ucx-dask-gpu.cluster.threads-per-worker"] == 1
        assert applied["distributed.comm.offload"] is False
        assert applied["distributed-ucxx.environment.max-rndv-rails"] == "1" and applied["ucx"]["MAX_RNDV_RAILS"] == "1"
    assert knob["applied_client"]["progress_mode"] == "thread"  # the scheduler/client process too
    row = p["sweep"][0]
    assert row["knob"] == KNOB and row["wall_vs_base"] == pytest.approx(
        knob["wall_s_median"] / base["wall_s_median"], rel=0.01)


def test_clean_shutdown(transpose):
    _, p, _ = transpose
    for r in p["runs"]:
        assert r["shutdown"]["clean"], (r["shutdown"], r.get("log_tail"))
        assert r["process"]["tracebacks"] == 0 and r["process"]["rc"] == 0
        assert r["shutdown"]["steps"][-1] == "cluster closed"


def test_svd(tmp_path):
    """The tall-skinny SVD on a cluster, checked against numpy's singular values of the same input."""
    import dask
    import dask.array as da
    import numpy as np

    proc = bench("svd", "--cpu", "--size", "8000", "--second-size", "50", "--chunks", "1000", "--runs", "1",
                 "--warmup", "0", "--protocols", "tcp", "--config", "none", "--out", str(tmp_path),
                 "--budget", "200", "--run-timeout", "120")
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads((tmp_path / "svd.json").read_text())
    assert p["workload"] == "svd" and p["shape"] == [8000, 50] and p["chunk"] == [1000, 50]
    assert p["reference"] is None and p["config"]["name"] == "defaults"
    run = p["runs"][0]
    assert run["status"] == "ok" and run["check"]["identity"] == "sum(s**2) == sum(x**2)"
    rs = da.random.RandomState(run["check"]["input_seed"], RandomState=np.random.RandomState)
    with dask.config.set(scheduler="sync"):
        xn = rs.random((8000, 50), chunks=(1000, 50)).compute()
    s = np.linalg.svd(xn, compute_uv=False)
    assert run["check"]["value"] == pytest.approx(float((s ** 2).sum()), rel=1e-9)
    assert run["check"]["ok"]
