"""`bench transfer --trace`: one transfer's phases reconstructed from the tracer's events (recorded shape, synthetic
times)."""
import pytest

from ucx_dask_gpu.bench import trace


def ucx_events():
    """One UCX transfer as the tracer sees it (times in ms from 0, converted below)."""
    cb, ep_b, ca, ep_a = 11, 12, 21, 22
    B = [(0.0, "stimulus:ComputeTaskEvent", "i", 0), (0.2, "gather_dep", "b", 0), (0.21, "connect", "b", 0),
         (0.22, "connect", "e", cb), (0.25, "comm.write", "b", cb), (0.26, "to_frames", "b", 0),
         (0.30, "to_frames", "e", 0), (0.31, "ep.send", "b", ep_b), (0.32, "ep.send", "e", ep_b),
         (0.35, "comm.write", "e", cb), (0.36, "comm.read", "b", cb), (0.37, "ep.recv", "b", ep_b),
         (0.5, "heartbeat-noise", "b", 99),
         (1.00, "ep.recv", "e", ep_b), (1.01, "ep.recv", "b", ep_b), (1.40, "ep.recv", "e", ep_b),
         (1.41, "from_frames", "b", 0), (1.50, "from_frames", "e", 0), (1.51, "comm.read", "e", cb),
         (1.52, "comm.write", "b", cb), (1.60, "comm.write", "e", cb), (1.65, "gather_dep", "e", 0),
         (1.70, "stimulus:GatherDepSuccessEvent", "i", 0), (1.90, "execute", "b", 0), (2.10, "execute", "e", 0)]
    A = [(0.10, "comm.read", "b", ca), (0.45, "ep.recv", "e", ep_a), (0.50, "from_frames", "b", 0),
         (0.55, "from_frames", "e", 0), (0.56, "comm.read", "e", ca), (0.58, "get_data", "b", ca),
         (0.70, "comm.write", "b", ca), (0.71, "to_frames", "b", 0), (0.90, "to_frames", "e", 0),
         (0.91, "ep.send", "b", ep_a), (1.45, "ep.send", "e", ep_a), (1.46, "comm.write", "e", ca),
         (1.70, "comm.read", "b", ca), (1.75, "get_data", "e", ca)]

    def conv(evs):
        return [[100.0 + t / 1e3, name, edge, ident, -1] for t, name, edge, ident in evs]

    return {"A": {"events": conv(A), "ep_owner": {str(ep_a): ca}},
            "B": {"events": conv(B), "ep_owner": {str(ep_b): cb}}}


def test_milestones_follow_the_causal_chain():
    m = trace.milestones({"bytes": 8, "submit": 99.999, "result": 100.003, "events": ucx_events()})
    ms = {k: round((v - 100.0) * 1e3, 3) for k, v in m.items()}
    assert ms["B.compute_task"] == 0.0 and ms["B.gather.b"] == 0.2 and ms["B.gather.e"] == 1.65
    assert ms["B.write_req.b"] == 0.25 and ms["B.req_frames.e"] == 0.30
    assert ms["A.read_req.e"] == 0.56 and ms["A.get_data.b"] == 0.58
    assert ms["A.write_resp.b"] == 0.70 and ms["A.to_frames.e"] == 0.90
    assert ms["B.resp_first.e"] == 1.00  # first recv of the response on B's gather endpoint
    assert ms["B.from_frames.b"] == 1.41 and ms["B.from_frames.e"] == 1.50 and ms["B.write_ok.e"] == 1.60
    assert ms["B.execute.b"] == 1.90 and ms["B.execute.e"] == 2.10


def test_phase_table_and_op_counts():
    traced = [{"bytes": 8, "submit": 99.999, "result": 100.003, "events": ucx_events()} for _ in range(3)]
    [row] = trace.phase_table(traced, [8])
    assert row["samples"] == 3 and row["gather_ms_median"] == pytest.approx(1.45)
    seg = {s["what"]: s["ms_median"] for s in row["segments"]}
    assert seg["A: serialise response"] == pytest.approx(0.2)
    assert seg["response header: send + wire + B wakes"] == pytest.approx(0.1)
    assert seg["B: receive the frames (buffers, data)"] == pytest.approx(0.41)
    assert seg["client -> scheduler -> B (compute-task)"] == pytest.approx(1.0)
    assert row["ops_median"] == {"A.ep.send": 1, "B.ep.recv": 2, "B.ep.send": 1}


def test_an_incomplete_trace():
    s = {"bytes": 8, "submit": 1.0, "result": 2.0, "events": {"A": {"events": []}, "B": {"events": []}}}
    assert trace.milestones(s) == {"submit": 1.0, "result": 2.0}
    [row] = trace.phase_table([s], [8])
    assert row["segments"] == [] and row["gather_ms_median"] is None and row["e2e_ms_median"] == 1000.0


def test_wrapped_functions_record_begin_and_end():
    trace.EVENTS.clear()
    f = trace.wrap(lambda x: x + 1, "plus", size=lambda a, k: a[0])
    assert f(2) == 3 and getattr(f, "__traced__", False)
    assert [(e[1], e[2], e[4]) for e in trace.EVENTS] == [("plus", "b", 2), ("plus", "e", -1)]
    assert trace.pop_events()["events"] and not trace.EVENTS
