"""dask-cuda's local_cupy beside our rounds (bench --parity / --peer): its runs in chunks among our timed rounds, each
against the cluster it belongs on (parity: the variant's; peer: its own), the chunks merged into one report entry.
The clusters and local_cupy are stand-ins that log what was asked of them, in order."""
import json
import shlex
from pathlib import Path

import pytest

from ucx_dask_gpu.bench import reference as ref
from ucx_dask_gpu.bench import render
from ucx_dask_gpu.bench.options import build_parser, options
from ucx_dask_gpu.bench.rounds import CLOSE_RESERVE_S, Budget, Record, run_rounds
from ucx_dask_gpu.bench.transpose import STUDY
from ucx_dask_gpu.cliutil import Progress

QUIET = Progress(quiet=True)
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "bench"


class FakeHost:
    """A running cluster: answers repetitions (logged), fails them from repetition `fail_from` on."""

    def __init__(self, hid, log, fail_from=None):
        self.id, self.log, self.fail_from, self.calls = hid, log, fail_from, 0
        self.facts, self.error, self.variants = {"scheduler": f"tcp://127.0.0.1:{1000 + int(hid[1:])}"}, None, []

    @property
    def alive(self):
        return self.facts is not None and self.error is None

    def request(self, req, timeout):
        self.calls += 1
        if self.fail_from and self.calls >= self.fail_from:
            return {"ok": False, "error": "boom"}
        self.log.append(("rep", self.id))
        return {"ok": True, "metrics": {"wall_s": 0.01}, "total_s": 0.01, "bytes": 0}


@pytest.fixture
def log(monkeypatch):
    """Every repetition and every local_cupy invocation, in order; local_cupy prints one wall per --runs."""
    events = []

    def fake_local_cupy(cmd, env, timeout, progress, label):
        runs, index = int(cmd[cmd.index("--runs") + 1]), int(label.split()[-1].split("/")[0])
        events.append(("local_cupy", label, cmd))
        return {"status": "ok", "command": shlex.join(cmd), "operation": "transpose_sum", "workers": 2,
                "wall_s": [0.1 * index] * runs, "throughput_bytes_per_s": [1.0] * runs,
                "pairs": [{"src": 0, "dst": 1, "q50_gbps": float(index), "bytes": 10}], "cluster_rmm_kept": False}

    monkeypatch.setattr(ref, "run_local_cupy", fake_local_cupy)
    return events


def make(argv, log, tmp_path, fail_from=None):
    """Options, one record per variant on a cluster of its own, the peer's cluster where it has one, the Besides."""
    opts = options(STUDY, build_parser(STUDY).parse_args(argv))
    records = {v.name: Record(v, FakeHost(f"c{i}", log, fail_from), {}) for i, v in enumerate(opts.variants)}
    peer = None
    if opts.peer and opts.mode != "gpu":
        peer = FakeHost(f"c{len(records)}", log)
        peer.variants = [opts.variants[0]]
    return opts, records, peer, ref.beside(opts, records, peer, tmp_path)


def rounds_before_each_chunk(log, variants: int, warmup: int) -> dict[str, list[int]]:
    """For each local_cupy invocation: how many of our timed rounds were over when it started."""
    out, reps = {}, 0
    for e in log:
        if e[0] == "rep":
            reps += 1
        else:
            out.setdefault(e[1].split()[0], []).append(reps // variants - warmup)
    return out


@pytest.mark.parametrize("runs, sizes, after", [
    (15, [5, 5, 5], [3, 8, 13]), (12, [4, 4, 4], [2, 6, 10]), (17, [5, 4, 4, 4], [3, 7, 11, 15]), (3, [3], [2]),
    (1, [1], [1]), (6, [3, 3], [2, 5]),
])
def test_chunk_plan_spreads_our_repetition_count(runs, sizes, after):
    plan = ref.chunk_plan(runs, 2, fresh=False)
    assert [c["runs"] for c in plan] == sizes and sum(sizes) == runs
    assert [c["after_round"] for c in plan] == after
    assert [c["warmup_runs"] for c in plan] == [2] + [0] * (len(plan) - 1)  # the cluster stays up: warm once
    assert [c["warmup_runs"] for c in ref.chunk_plan(runs, 2, fresh=True)] == [2] * len(plan)


def test_parity_and_peer_run_in_chunks_among_our_rounds(log, tmp_path):
    argv = ["--cpu", "--runs", "12", "--allow-few", "--warmup", "1", "--parity", "ucx/shipped", "--peer"]
    opts, records, peer, beside = make(argv, log, tmp_path)
    assert run_rounds(records, opts, Budget(1e6), QUIET, beside) == []
    assert rounds_before_each_chunk(log, len(records), 1) == {"parity": [2, 6, 10], "peer": [2, 6, 10]}
    parity, peer_ref = (b.report() for b in beside)
    for r in (parity, peer_ref):
        assert r["status"] == "ok" and r["error"] is None
        assert [c["rounds_before"] for c in r["chunks"]] == [2, 6, 10]
        assert r["interleaving"] == {"chunks": 3, "runs_per_chunk": [4, 4, 4], "after_rounds": [2, 6, 10],
                                     "rounds_between_chunks": [4, 4], "warmup_runs": [1, 0, 0]}
        assert r["wall_s"] == pytest.approx([0.1] * 4 + [0.2] * 4 + [0.3] * 4)  # every chunk's walls, in order
        assert r["warmup_runs"] == 1 and [p["chunk"] for p in r["pairs"]] == [1, 2, 3]
        assert r["p2p_gbps_median"] == 2.0
    commands = {}
    for _, label, cmd in (e for e in log if e[0] == "local_cupy"):
        commands.setdefault(label.split()[0], []).append(cmd)
    for cmds in commands.values():
        assert [c[c.index("--runs") + 1] for c in cmds] == ["4"] * 3
        assert [c[c.index("--warmup-runs") + 1] for c in cmds] == ["1", "0", "0"]
        assert all("--disable-rmm-pool" not in c and "--rmm-pool-size" not in c for c in cmds)
    schedulers = {k: {c[c.index("--scheduler-address") + 1] for c in cmds} for k, cmds in commands.items()}
    assert schedulers["parity"] == {records["ucx/shipped"].host.facts["scheduler"]}
    # the peer runs on its own cluster, never on a variant's
    assert schedulers["peer"] == {peer.facts["scheduler"]}
    assert not schedulers["peer"] & {r.host.facts["scheduler"] for r in records.values()}
    assert parity["against"] == "ucx/shipped" and parity["cluster"] == "c1"
    assert peer_ref["against"] == f"its own cluster {peer.id}" and peer_ref["cluster"] == peer.id
    assert peer_ref["config"].startswith("none") and "RMM" not in peer_ref["config"]  # CPU: no RMM to speak of


def test_a_peer_that_starts_its_own_cluster_warms_up_in_every_chunk(log, tmp_path):
    opts, records, peer, beside = make(["--gpus", "0,1", "--runs", "10", "--allow-few", "--peer"], log, tmp_path)
    assert peer is None
    run_rounds(records, opts, Budget(1e6), QUIET, beside)
    (r,) = [b.report() for b in beside]
    cmds = [e[2] for e in log if e[0] == "local_cupy"]
    assert [c[c.index("--warmup-runs") + 1] for c in cmds] == ["2", "2"] and all(c[-2:] == ["-d", "0,1"] for c in cmds)
    assert r["against"] == "its own LocalCUDACluster" and r["cluster"] is None and r["warmup_runs"] == 4
    assert [c["rounds_before"] for c in r["chunks"]] == [3, 8]


def test_the_peer_on_a_shared_gpu_gets_local_cupys_rmm_setup_once(log, tmp_path, monkeypatch):
    """On one GPU the peer's own cluster loses dask-cuda's RMMSetup marker before its first chunk (so local_cupy applies
    its RMM arguments); the parity run keeps its variant's memory setup."""
    handed = []

    def hand(self, timeout):
        handed.append(self.kind)
        self.rmm_handed = "2"

    monkeypatch.setattr(ref.Beside, "hand_rmm_over", hand)
    argv = ["--shared-gpu", "0", "--runs", "10", "--allow-few", "--parity", "ucx/defaults", "--peer"]
    opts, records, peer, beside = make(argv, log, tmp_path)
    run_rounds(records, opts, Budget(1e6), QUIET, beside)
    assert handed == ["peer"]
    parity, peer_ref = (b.report() for b in beside)
    assert peer_ref["config"].endswith("local_cupy's RMM arguments (dask-cuda's RMMSetup removed from 2 workers)")
    assert parity["config"] == "none" and parity["status"] == peer_ref["status"] == "ok"


def test_a_failed_rmm_handover_fails_the_peer(log, tmp_path, monkeypatch):
    monkeypatch.setattr(ref.Beside, "hand_rmm_over", lambda self, timeout: "dask-cuda's RMMSetup stayed: no")
    opts, records, peer, beside = make(["--shared-gpu", "0", "--runs", "3", "--allow-few", "--peer"], log, tmp_path)
    run_rounds(records, opts, Budget(1e6), QUIET, beside)
    (r,) = [b.report() for b in beside]
    assert r["status"] == "error" and "RMMSetup stayed" in r["error"] and not [e for e in log if e[0] == "local_cupy"]


def test_chunks_whose_turn_never_came_run_after_our_last_round_trimmed_to_it(log, tmp_path):
    """Our variants fail in round 9: the chunk planned after round 10 runs after round 9 with the 1 run left."""
    argv = ["--cpu", "--runs", "12", "--allow-few", "--warmup", "0", "--parity", "ucx/defaults", "--peer"]
    opts, records, peer, beside = make(argv, log, tmp_path, fail_from=9)
    run_rounds(records, opts, Budget(1e6), QUIET, beside)
    parity, peer_ref = (b.report() for b in beside)
    assert [c["rounds_before"] for c in peer_ref["chunks"]] == [2, 6, 9]
    assert [c["runs"] for c in peer_ref["chunks"]] == [4, 4, 1] and len(peer_ref["wall_s"]) == 9
    # the parity run's cluster is up (its variant failed, not the cluster): it too stops at our count
    assert [c["runs"] for c in parity["chunks"]] == [4, 4, 1]


def test_a_chunk_that_does_not_fit_the_budget_is_skipped_with_the_reason(log, tmp_path):
    opts, records, peer, beside = make(["--cpu", "--runs", "3", "--allow-few", "--peer"], log, tmp_path)
    run_rounds(records, opts, Budget(CLOSE_RESERVE_S + ref.START_S / 2), QUIET, beside)
    (r,) = [b.report() for b in beside]
    assert r["status"] == "skipped" and "--budget" in r["error"] and "wall_s" not in r
    assert not [e for e in log if e[0] == "local_cupy"]


class SpentBudget(Budget):
    """--budget spent only where a test says (local_cupy's chunks), not by the stand-ins' instant repetitions."""
    spent = 0.0

    def left(self):
        return self.seconds - self.spent


def test_beyond_min_runs_each_round_keeps_time_for_the_local_cupy_runs_it_owes(log, tmp_path, monkeypatch):
    """Each chunk spends START_S: 7 of the 8 planned fit; past round 15 a round runs only while a chunk of the runs
    it would owe still fits, so ours stop at 35 and local_cupy, trimmed, ends with as many timed runs as ours."""
    opts, records, peer, beside = make(["--cpu", "--runs", "40", "--warmup", "0", "--peer"], log, tmp_path)
    budget, quick = SpentBudget(CLOSE_RESERVE_S + 7.5 * ref.START_S), ref.run_local_cupy

    def spending(*args):
        budget.spent += ref.START_S
        return quick(*args)

    monkeypatch.setattr(ref, "run_local_cupy", spending)
    notes = run_rounds(records, opts, budget, QUIET, beside)
    r = beside[0].report()
    assert notes == [notes[0]] and notes[0].startswith("budget: stopped after 35 of 40")
    assert [c["status"] for c in r["chunks"]] == ["ok"] * 7 + ["skipped"]
    assert r["chunks"][-1]["error"] == "our timed rounds stopped after 35"
    assert r["status"] == "ok" and len(r["wall_s"]) == 35 == len(records[opts.baseline].reps)


def test_the_markdown_says_where_each_reference_ran_and_between_which_rounds(log, tmp_path):
    argv = ["--cpu", "--runs", "12", "--allow-few", "--warmup", "1", "--parity", "ucx/shipped", "--peer"]
    opts, records, peer, beside = make(argv, log, tmp_path)
    run_rounds(records, opts, Budget(1e6), QUIET, beside)
    payload = json.loads((FIXTURES / "cpu_transpose_result.json").read_text())
    payload["references"] = [b.report() for b in beside]
    md = render.markdown(payload)
    chunks = "timed runs 4 (+1 warm-up) after round 2, 4 (+0 warm-up) after round 6, 4 (+0 warm-up) after round 10"
    assert f"- parity: against ucx/shipped, config shipped; {chunks}" in md
    assert f"- peer: against its own cluster {peer.id}, config none (dask's defaults); {chunks}" in md
