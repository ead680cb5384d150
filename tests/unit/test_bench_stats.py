"""Turning runner data (transfer logs, digests, task stream) into the report's numbers."""
import pytest

from ucx_dask_gpu.bench import stats

W = ["ucx://h:1", "ucx://h:2"]
MIB = 2 ** 20


def t(src, dst, nbytes, seconds, start=0.0):
    return {"src": W[src], "dst": W[dst], "bytes": nbytes, "keys": 1, "start": start, "stop": start + seconds,
            "duration_s": seconds, "bandwidth": nbytes / seconds}


def test_quantiles_match_numpy_linear():
    vals = [4.0, 1.0, 3.0, 2.0]
    assert stats.quantile(vals, 0.25) == pytest.approx(1.75)
    assert stats.median(vals) == pytest.approx(2.5)
    assert stats.quantile([], 0.5) is None
    assert stats.hmean([1.0, 4.0]) == pytest.approx(1.6)


def test_p2p_pairs_and_overall():
    runs = [
        {"start": 100.0, "transfers": [t(1, 0, 128 * MIB, 0.002, 100.01), t(1, 0, 128 * MIB, 0.004, 100.02),
                                       t(0, 1, 8, 0.001, 100.03)]},
        {"start": 200.0, "transfers": [t(0, 1, 128 * MIB, 0.001, 200.01), t(1, 0, 64 * MIB, 0.001, 200.02)]},
    ]
    p = stats.p2p(runs, W, ignore_bytes=MIB)
    assert p["transfers"] == 4 and p["transfers_dropped_small"] == 1
    assert p["transfers_per_run"] == 2.0
    pairs = {(x["src"], x["dst"]): x for x in p["pairs"]}
    assert set(pairs) == {(0, 1), (1, 0)}
    gb = 128 * MIB / 1e9
    assert pairs[(0, 1)]["q50_gbps"] == pytest.approx(gb / 0.001, abs=1e-3)
    b10 = sorted([gb / 0.002, gb / 0.004, 64 * MIB / 1e9 / 0.001])
    assert pairs[(1, 0)]["q50_gbps"] == pytest.approx(b10[1], abs=1e-3)
    assert pairs[(1, 0)]["transfers"] == 3 and pairs[(1, 0)]["bytes"] == 320 * MIB
    all_bw = sorted(b10 + [gb / 0.001])
    assert p["gbps_median"] == pytest.approx((all_bw[1] + all_bw[2]) / 2, abs=1e-3)
    assert p["gbps_weighted"] == pytest.approx(448 * MIB / 0.008 / 1e9, abs=1e-3)
    m = stats.pair_matrix(p)
    assert m[0][0] is None and m[0][1] == pairs[(0, 1)]["q50_gbps"]


def test_p2p_without_large_transfers():
    p = stats.p2p([{"start": 0.0, "transfers": [t(0, 1, 100, 0.001)]}], W)
    assert p["pairs"] == [] and p["gbps_median"] is None and p["gbps_weighted"] is None


def test_transfer_table_and_size_classes():
    runs = [{"start": 10.0, "transfers": [t(1, 0, 128 * MIB, 0.002, 10.5), t(0, 1, 8, 0.001, 10.25)]}]
    rows = stats.transfer_table(runs, W)
    assert [(r["src"], r["dst"], r["start_s"]) for r in rows] == [(1, 0, 0.5), (0, 1, 0.25)]
    classes = stats.size_classes(rows)
    assert [c["bytes_from"] for c in classes] == [8, 128 * MIB]
    assert classes[1]["median_duration_s"] == pytest.approx(0.002)


def test_digest_summary_sums_workers_per_run():
    digests = {
        W[0]: {"gather-dep|network|seconds": 0.4, "gather-dep|deserialize|seconds": 0.02,
               "execute|sum|thread-cpu|seconds": 0.2, "transfer-duration": 0.4, "latency": 0.1},
        W[1]: {"gather-dep|network|seconds": 0.2, "get-data|serialize|seconds": 0.04,
               "execute|sum|thread-cpu|seconds": 0.1},
    }
    s = stats.digest_summary(digests, runs=2)
    assert s["gather-dep"] == {"deserialize": 0.01, "network": 0.3}
    assert s["get-data"] == {"serialize": 0.02}
    assert s["execute"] == {"sum": {"thread-cpu": 0.15}}
    assert s["transfer"] == {"duration_s": 0.2}


def test_task_phases():
    prof = {"start": 100.0, "stop": 100.5, "wall_s": 0.5, "tasks": [
        {"prefix": "sum", "worker": W[0], "startstops": [
            {"action": "transfer", "start": 100.05, "stop": 100.15, "source": W[1]},
            {"action": "compute", "start": 100.15, "stop": 100.25}]},
        {"prefix": "sum", "worker": W[1], "startstops": [{"action": "compute", "start": 100.1, "stop": 100.4}]},
    ]}
    ph = stats.task_phases(prof, W)
    assert ph["start_latency_s"] == pytest.approx(0.1)
    assert ph["active_s"] == pytest.approx(0.3)
    assert ph["end_latency_s"] == pytest.approx(0.1)
    assert ph["transfer_s_per_worker"] == {"0": pytest.approx(0.1)}
    assert ph["compute_by_prefix"]["sum"]["tasks"] == 2
    rows = stats.compact_tasks(prof, W)
    assert rows[0][:3] == ["sum", 0, "transfer"] and rows[0][5] == 1
    assert stats.task_phases({}, W) == {}
