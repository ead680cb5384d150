"""The numbers of a benchmark: quantiles, the bootstrap interval of a ratio of medians and its verdict, the order
variants take turns in, per-pair bandwidth and the bytes-moved check."""
import math
import random

import pytest

from ucx_dask_gpu.bench import stats

W = ["ucx://h:1", "ucx://h:2"]
MIB = 2 ** 20


def lognormal(rng, median, n, sigma=0.15):
    return [median * math.exp(rng.gauss(0, sigma)) for _ in range(n)]


def test_quantiles_match_numpy_linear():
    assert stats.quantile([4.0, 1.0, 3.0, 2.0], 0.25) == pytest.approx(1.75)
    assert stats.median([4.0, 1.0, 3.0, 2.0]) == pytest.approx(2.5)
    assert stats.quantile([], 0.5) is None
    s = stats.summary([3.0, 1.0, 2.0])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.0, 3.0)


def test_the_interval_holds_the_true_ratio_and_excludes_one_for_a_real_effect():
    rng = random.Random(7)
    base, faster = lognormal(rng, 100e-3, 15), lognormal(rng, 80e-3, 15)
    r = stats.bootstrap_ratio(faster, base, seed=3)
    assert r["ci95"][0] <= 0.8 <= r["ci95"][1]
    assert r["ci95"][1] < 1.0 and r["verdict"] == "faster"
    assert stats.bootstrap_ratio(base, faster, seed=3)["verdict"] == "slower"
    assert r["median"] == pytest.approx(stats.median(faster) / stats.median(base), abs=1e-4)
    assert (r["n"], r["n_baseline"], r["resamples"], r["seed"]) == (15, 15, 2000, 3)


def test_no_effect_is_noise():
    rng = random.Random(11)
    r = stats.bootstrap_ratio(lognormal(rng, 0.1, 15), lognormal(rng, 0.1, 15), seed=0)
    assert r["ci95"][0] < 1.0 < r["ci95"][1] and r["verdict"] == "noise"


def test_same_seed_same_interval_other_seed_other_resamples():
    rng = random.Random(1)
    a, b = lognormal(rng, 1.0, 15), lognormal(rng, 1.1, 15)
    assert stats.bootstrap_ratio(a, b, seed=5) == stats.bootstrap_ratio(a, b, seed=5)
    assert stats.bootstrap_ratio(a, b, seed=5)["ci95"] != stats.bootstrap_ratio(a, b, seed=6)["ci95"]


def test_coverage_is_near_the_level_on_synthetic_data():
    """Over 40 synthetic experiments (fixed seed) with a true ratio of 0.9, the 95 % interval holds it in most."""
    rng = random.Random(2024)
    held = 0
    for i in range(40):
        r = stats.bootstrap_ratio(lognormal(rng, 0.9, 20), lognormal(rng, 1.0, 20), resamples=500, seed=i)
        held += r["ci95"][0] <= 0.9 <= r["ci95"][1]
    assert held >= 32, held


def test_verdict_has_a_direction_and_empty_input():
    """Ratios are of times: below 1.0 the variant is faster, above it slower (an 8 B transfer 1.09x [1.007, 1.168]
    of its baseline is slower, never a reason to keep a setting)."""
    assert stats.verdict(1.007, 1.168) == "slower" and stats.verdict(0.5, 0.99) == "faster"
    assert stats.verdict(0.9, 1.1) == "noise" and stats.verdict(1.0, 1.3) == "noise"
    assert stats.bootstrap_ratio([], [1.0]) is None and stats.bootstrap_ratio([1.0], []) is None


def test_rounds_alternate_direction():
    names = ["a", "b", "c"]
    assert [stats.round_order(names, r) for r in range(4)] == [["a", "b", "c"], ["c", "b", "a"],
                                                               ["a", "b", "c"], ["c", "b", "a"]]
    # over two rounds every variant runs once in each half: no variant always follows the same one
    firsts = [stats.round_order(names, r)[0] for r in range(2)]
    assert firsts == ["a", "c"]


def t(src, dst, nbytes, seconds):
    return {"src": W[src], "dst": W[dst], "bytes": nbytes, "duration": seconds}


def test_p2p_pairs_and_small_transfers_left_out():
    p = stats.p2p([t(1, 0, 128 * MIB, 0.002), t(1, 0, 128 * MIB, 0.004), t(0, 1, 8, 0.001), t(0, 1, 64 * MIB, 0.001)],
                  W, repetitions=2, ignore_bytes=MIB)
    pairs = {(x["src"], x["dst"]): x for x in p["pairs"]}
    assert set(pairs) == {(0, 1), (1, 0)} and pairs[(1, 0)]["transfers"] == 2
    assert pairs[(0, 1)]["q50_gbps"] == pytest.approx(64 * MIB / 0.001 / 1e9, abs=1e-3)
    assert p["transfers_per_repetition"] == 1.5


def test_bytes_moved_notes():
    assert stats.bytes_moved_notes({"a": [100, 100], "b": [100, 100]}, "a") == []
    notes = stats.bytes_moved_notes({"a": [100e6] * 3, "b": [100e6] * 3, "c": [150e6] * 3}, "a")
    assert notes == ["c moved 150.0 MB per repetition (median), the baseline a 100.0 MB: its ratio compares "
                     "different work"]
    notes = stats.bytes_moved_notes({"a": [1e6, 2e6], "b": [1.5e6, 1.5e6]}, "b")
    assert any("varied between repetitions (a 1.0-2.0 MB)" in n for n in notes)


def test_a_ratio_only_between_variants_that_moved_the_same_bytes():
    base = [1_000_000_000] * 5
    assert stats.same_work([1_040_000_000] * 5, base) and stats.same_work([], [])
    assert not stats.same_work([1_548_000_000] * 5, [1_011_000_000] * 5) and not stats.same_work([1], [])
    assert stats.same_work([96], [480]) and not stats.same_work([0], [1 << 20])  # next to nothing, both
    d = stats.different_work([1_548_000_000], [1_011_000_000])
    assert d["verdict"] == "different work" and d["median"] is None and d["ci95"] is None
    assert (d["bytes_moved_median"], d["baseline_bytes_moved_median"]) == (1_548_000_000, 1_011_000_000)
