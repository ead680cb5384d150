"""Per-transfer measurement: sizes and variants from the command line, numbers per size, the fixed vs per-byte fit,
and the phase breakdown reconstructed from tracer events."""
import pytest

from ucx_dask_gpu.bench import transfer, transfer_stats as ts
from ucx_dask_gpu.errors import UserError

MIB = 1 << 20


def sample(nbytes, e2e, start, stop, duration=None, **extra):
    s = {"bytes": nbytes, "e2e_s": e2e, "submit": 100.0, "result": 100.0 + e2e,
         "transfer": {"start": start, "stop": stop, "duration": duration if duration is not None else
                      max(0.001, stop - start), "total": nbytes, "who": "a", "keys": ["k"]}}
    s.update(extra)
    return s


@pytest.mark.parametrize("text,value", [("8", 8), ("64KiB", 64 * 1024), ("1 MiB", MIB), ("128MiB", 128 * MIB),
                                        ("2GB", 2 * 10**9), ("1kb", 1000)])
def test_sizes(text, value):
    assert transfer.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "MiB", "1.5", "0", "8 parsecs", "-1"])
def test_bad_sizes(text):
    with pytest.raises(UserError):
        transfer.parse_size(text)


def test_variant_forms():
    v = transfer.parse_variant("baseline:none", ["ucx", "tcp"])
    assert (v.label, v.config, v.knob, v.protocols) == ("baseline", "none", None, ["ucx", "tcp"])
    v = transfer.parse_variant("ucx@event:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1;UCX_TLS=tcp", ["ucx", "tcp"])
    assert (v.label, v.config, v.protocols) == ("event", "tuned", ["ucx"])
    assert v.knob == "UCXPY_ENABLE_PYTHON_FUTURE=1;UCX_TLS=tcp"
    # a knob value may itself hold ':' (only the first two separate label, config and knob)
    assert transfer.parse_variant("x:none:UCX_NET_DEVICES=mlx5_0:1", ["ucx"]).knob == "UCX_NET_DEVICES=mlx5_0:1"
    for bad in ("nolabel", ":none", "x:", "udp@x:none"):
        with pytest.raises(UserError):
            transfer.parse_variant(bad, ["ucx"])


def test_variants_become_runs_with_their_environment():
    runs = transfer.make_runs([transfer.parse_variant("ucx,tcp@base:none", []),
                               transfer.parse_variant("ucx@event:none:UCXPY_ENABLE_PYTHON_FUTURE=1", [])], cpu=True)
    assert [(r.protocol, r.spec.label) for r in runs] == [("ucx", "base"), ("tcp", "base"), ("ucx", "event")]
    assert runs[2].env == {"UCXPY_ENABLE_PYTHON_FUTURE": "1"} and runs[0].env == {}
    # CPU mode: ucx means UCX over TCP
    assert runs[0].tree["distributed-ucxx"]["tcp"] is True
    with pytest.raises(UserError):
        transfer.make_runs([transfer.parse_variant("a:none", ["ucx"]), transfer.parse_variant("a:tuned", ["ucx"])],
                           cpu=True)


def test_size_rows_use_unfloored_transfer_time():
    samples = [sample(8, 0.010, 1.0, 1.0002), sample(8, 0.012, 2.0, 2.0004), sample(8, 0.020, 3.0, 3.0006),
               sample(MIB, 0.015, 4.0, 4.002), {"bytes": MIB, "e2e_s": 0.1, "transfer": None}]
    rows = ts.size_rows(samples, [8, MIB])
    tiny, big = rows
    assert tiny["samples"] == 3 and tiny["missing_log"] == 0
    assert tiny["transfer_ms_median"] == pytest.approx(0.4)
    assert tiny["duration_ms_median"] == pytest.approx(1.0)  # distributed's own field is floored at 1 ms
    assert tiny["e2e_ms_median"] == pytest.approx(12.0)
    assert big["missing_log"] == 1 and big["transfer_ms_median"] == pytest.approx(2.0)
    assert big["transfer_gbps_median"] == pytest.approx(MIB / 0.002 / 1e9, rel=1e-3)


def test_fixed_and_per_byte_fit():
    # 0.5 ms fixed + 1 ms per 10 MB (10 GB/s)
    rows = [{"bytes": n, "transfer_ms_median": 0.5 + n / 1e7} for n in (8, MIB, 8 * MIB, 32 * MIB)]
    fit = ts.fixed_and_per_byte(rows)
    assert fit["fixed_ms"] == pytest.approx(0.5, abs=1e-3)
    assert fit["per_byte_gbps"] == pytest.approx(10.0, rel=1e-3)
    assert ts.fixed_and_per_byte(rows[:1])["fixed_ms"] is None


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
    s = {"bytes": 8, "submit": 99.999, "result": 100.003, "events": ucx_events()}
    m = ts.milestones(s)
    ms = {k: round((v - 100.0) * 1e3, 3) for k, v in m.items()}
    assert ms["B.compute_task"] == 0.0 and ms["B.gather.b"] == 0.2 and ms["B.gather.e"] == 1.65
    assert ms["B.write_req.b"] == 0.25 and ms["B.req_frames.e"] == 0.30 and ms["B.write_req.e"] == 0.35
    assert ms["A.read_req.e"] == 0.56 and ms["A.get_data.b"] == 0.58
    assert ms["A.write_resp.b"] == 0.70 and ms["A.to_frames.e"] == 0.90 and ms["A.write_resp.e"] == 1.46
    assert ms["B.resp_first.e"] == 1.00  # first recv of the response on B's gather endpoint
    assert ms["B.from_frames.b"] == 1.41 and ms["B.from_frames.e"] == 1.50 and ms["B.write_ok.e"] == 1.60
    assert ms["B.execute.b"] == 1.90 and ms["B.execute.e"] == 2.10


def test_phase_table_and_op_counts():
    traced = [{"bytes": 8, "submit": 99.999, "result": 100.003, "events": ucx_events()} for _ in range(3)]
    [row] = ts.phase_table(traced, [8])
    assert row["samples"] == 3 and row["gather_ms_median"] == pytest.approx(1.45)
    seg = {s["what"]: s["ms_median"] for s in row["segments"]}
    assert seg["A: serialise response"] == pytest.approx(0.2)
    assert seg["response header: send + wire + B wakes"] == pytest.approx(0.1)
    assert seg["B: receive the frames (buffers, data)"] == pytest.approx(0.41)
    assert seg["client -> scheduler -> B (compute-task)"] == pytest.approx(1.0)
    assert row["ops_median"] == {"A.ep.send": 1, "B.ep.recv": 2, "B.ep.send": 1}
    # B's two recvs: 0.37 -> 1.00 (waits for the response) and 1.01 -> 1.40; A's send 0.91 -> 1.45
    assert row["op_ms_median"]["B.ep.recv"] == {"total": pytest.approx(1.02), "longest": pytest.approx(0.63)}
    assert row["op_ms_median"]["A.ep.send"]["total"] == pytest.approx(0.54)


def test_milestones_of_an_incomplete_trace():
    s = {"bytes": 8, "submit": 1.0, "result": 2.0, "events": {"A": {"events": []}, "B": {"events": []}}}
    assert ts.milestones(s) == {"submit": 1.0, "result": 2.0}
    [row] = ts.phase_table([s], [8])
    assert row["segments"] == [] and row["gather_ms_median"] is None and row["e2e_ms_median"] == 1000.0


def test_variant_summary_compare_and_report():
    base = {"label": "baseline", "protocol": "ucx", "status": "ok", "sizes": [8],
            "samples": [sample(8, 0.02, 1.0, 1.002)], "applied": {"w": {"progress_mode": "blocking"}}}
    better = dict(base, label="event", samples=[sample(8, 0.01, 1.0, 1.0005)])
    failed = {"label": "broken", "protocol": "ucx", "status": "error", "error": "timed out", "sizes": [8]}
    vs = [ts.variant_summary(r) for r in (base, better, failed)]
    assert vs[0]["applied"] == {"progress_mode": "blocking"}
    cmp = ts.compare(vs, "baseline", 8)
    assert [c["ratio_to_base"] for c in cmp] == [1.0, 0.25, None]
    report = {"title": "t", "sizes": [8], "variants": vs, "command": "python -m x"}
    md = ts.markdown(report)
    assert "| ucx | event | 0.500 (10.00)" in md and "**error: timed out**" in md
    lines = ts.summary_lines(report)
    assert lines[1].split()[:2] == ["ucx", "event"] and "[error: timed out]" in lines[2]


def test_merge_pools_repeats_and_keeps_failures():
    ok1 = {"status": "ok", "samples": [1], "traced": [], "rounds": 3}
    ok2 = {"status": "ok", "samples": [2, 3], "traced": [4], "rounds": 2, "traced_rounds": 1}
    bad = {"status": "error", "error": "cluster did not start"}
    m = transfer.merge_results([ok1, bad, ok2])
    assert m["samples"] == [1, 2, 3] and m["traced"] == [4] and m["rounds"] == 5
    assert m["repeats_ok"] == 2 and m["repeats_failed"] == ["cluster did not start"]
    assert transfer.merge_results([bad])["status"] == "error"


@pytest.mark.filterwarnings("ignore:Cannot get CPU affinity")
def test_shared_gpu_cluster_puts_every_worker_on_the_first_gpu():
    """dask-cuda's own spec for GPU 0, under worker names 0, 1, ... (LocalCUDACluster refuses a second worker on one
    GPU; the GPU run needs two). Built without starting anything: no GPU here."""
    from ucx_dask_gpu.bench.transfer_run import SharedGPUCluster

    c = SharedGPUCluster.__new__(SharedGPUCluster)
    c.cuda_visible_devices = [3]
    c.worker_spec = {}
    c.new_spec = {"cls": object, "options": {"nthreads": 1}}
    for attr in ("rmm_pool_size", "rmm_maximum_pool_size", "rmm_release_threshold", "rmm_log_directory",
                 "rmm_allocator_external_lib_list", "pre_import", "cudf_spill_stats"):
        setattr(c, attr, None)
    c.rmm_managed_memory = c.rmm_async = c.rmm_track_allocations = c.enable_cudf_spill = False
    for _ in range(2):
        c.worker_spec.update(c.new_worker_spec())
    assert sorted(c.worker_spec) == [0, 1]
    for spec in c.worker_spec.values():
        assert spec["options"]["env"] == {"CUDA_VISIBLE_DEVICES": "3"}
        assert spec["options"]["plugins"]


def test_profile_summary_of_pyspy_raw_output():
    from ucx_dask_gpu.bench.transfer_profile import summarise

    loop = "<module> (<string>:1);BaseEventLoop._run_once (asyncio/base_events.py:1922)"
    raw = "\n".join([
        f"{loop};Handle._run (asyncio/events.py:80);BlockingMode._fd_reader_callback (ucxx/_lib_async/x.py:177) 60",
        f"{loop};EpollSelector.select (selectors.py:468) 40",
        "Thread._bootstrap (threading.py:1002);Thread._bootstrap_inner (threading.py:1045);"
        "Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81) 100",
        "garbage line",
    ])
    s = summarise(raw)
    assert s["samples"] == 200 and s["main_thread_samples"] == 100
    assert s["threads"] == {"main thread": 100, "thread: _worker (futures/thread.py)": 100}
    assert s["main_self_pct"][0] == ["BlockingMode._fd_reader_callback (_lib_async/x.py)", 60.0]
    assert ["BaseEventLoop._run_once (asyncio/base_events.py)", 100.0] in s["main_inclusive_pct"]


def test_summary_names_a_variant_that_failed():
    report = {"sizes": [8], "variants": [{"protocol": "ucx", "label": "baseline", "status": "error",
                                         "error": "exited with -11 before writing a result"}]}
    (line,) = ts.summary_lines(report)
    assert line.startswith("ucx baseline") and "8 B –" in line and "[error: exited with -11" in line
