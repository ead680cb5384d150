"""verify-nvlink's report: DESIGN.md field names, per-run sections, exit status, and the all-or-nothing file set."""
from __future__ import annotations

import json

from ucx_dask_gpu.nvlink import report, verify
from ucx_dask_gpu.errors import PERFTEST_FAILED, VERDICT_FAILED
from ucx_dask_gpu.nvlink.verdict import Thresholds
from ucx_dask_gpu.report import format_table, write_report

TH = Thresholds()
DESIGN_PAIR_FIELDS = ["src", "dst", "msg_bytes", "ucx_gbps", "memcpy_peer_gbps", "ratio", "nvlink_tx_bytes",
                      "nvlink_rx_bytes", "link_capacity_gbps", "transport", "verdict"]
STEMS = [1 << 20, 256 << 20]  # recorded pip 1.21 runs (tests/fixtures/verify_nvlink/h200x2/)


def _pairs(h200, ratio=0.95, trap=False):
    if trap:  # the trap as the GPU host recorded it (one direction recorded; the verdict is the pair's)
        return [h200.replay(h200.TRAP_PIP)]
    recs = []
    for src, dst in ((h200.g0, h200.g1), (h200.g1, h200.g0)):
        ms = [h200.measured(h200.PIP, s, src, dst) for s in STEMS]
        memcpy = {m[0]: m[3]["result"].gbps / (ratio if m[0] == ms[-1][0] else 0.6) for m in ms}
        recs.append(verify.pair_record(src, dst, "proto-used", ms, None, {}, h200.isolated_visibility(src, dst),
                                       memcpy, TH))
    return recs


def _run(label, pairs, variant=None, error=None, version="1.21.0"):
    return {"label": label, "ucx": {"version": version, "source": "pip wheel libucx (libucx-cu13)", "prefix": "/x"},
            "variant": variant, "env": variant or {}, "evidence_method": "proto-used",
            "counts_for_exit": variant is None, "error": error, "pairs": pairs}


def _payload(h200, runs):
    return report.build_payload("h200x2", "580.159.04", h200.gpus, runs, {}, [1 << 20, 1 << 28], TH,
                            verify.parse_goals(verify.DEFAULT_GOALS), "ucx-dask-gpu verify-nvlink --out x", False)


def test_payload_has_design_fields_and_is_json(h200):
    runs = [_run("pip 1.21.0", _pairs(h200)), _run("source 1.13.1", _pairs(h200), version="1.13.1")]
    p = _payload(h200, runs)
    assert set(["host", "gpus", "pairs", "ucx"]) <= set(p)
    assert set(p["ucx"]) >= {"version", "source"} and p["ucx"]["version"] == "1.21.0"  # the first UCX is primary
    for pair in p["pairs"]:
        assert list(pair)[: len(DESIGN_PAIR_FIELDS)] == DESIGN_PAIR_FIELDS
    assert [len(r["pairs"]) for r in p["runs"]] == [2, 2]
    back = json.loads(json.dumps(p))
    assert back["pairs"][0]["sizes"][-1]["msg_bytes"] == back["pairs"][0]["msg_bytes"]
    assert p["verdict"] == "pass" and p["exit_code"] == 0


def test_exit_status(h200):
    good, bad = _run("a", _pairs(h200)), _run("b", _pairs(h200, ratio=0.5))
    assert report.exit_code([good]) == 0
    assert report.exit_code([good, bad]) == VERDICT_FAILED and report.overall_verdict([good, bad]) == "fail"
    # a settings study that fails does not fail the verification...
    study = _run("a + UCX_RNDV_SCHEME=put_zcopy", _pairs(h200, ratio=0.5), variant={"UCX_RNDV_SCHEME": "put_zcopy"})
    assert report.exit_code([good, study]) == 0
    # ...the trap always does, and an invalid run outranks a failed one
    trap = _run("a", _pairs(h200, trap=True))
    assert report.overall_verdict([bad, trap]) == "invalid" and report.exit_code([trap]) == VERDICT_FAILED
    # a UCX whose perftest failed (--keep-going) is an error exit; a study that broke perftest is only reported
    assert report.exit_code([good, _run("c", [], error="ucx_perftest failed")]) == PERFTEST_FAILED
    assert report.exit_code([good, _run("d", [], variant={"UCX_X": "1"}, error="ucx_perftest failed")]) == 0
    assert report.overall_verdict([]) == "fail"  # nothing measured never passes


def test_markdown_png_and_files(tmp_path, h200):
    base = _run("pip 1.21.0", _pairs(h200))
    study = _run("pip 1.21.0 + UCX_MAX_RNDV_RAILS=1", _pairs(h200, ratio=0.8), variant={"UCX_MAX_RNDV_RAILS": "1"})
    p = _payload(h200, [base, study])
    md = report.render_markdown(p, verify.parse_goals(verify.DEFAULT_GOALS))
    assert "Verdict: **pass**" in md and "(study)" in md and "Settings studies" in md
    assert "ratio @ 256 MiB >= 0.97" in md and "NOT met" in md  # 0.95 at 256 MiB misses the 0.97 goal
    assert "ratio @ 1 MiB >= 0.5" in md
    png = report.render_png(p)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    single = report.render_png(_payload(h200, [base]))
    assert single[:4] == b"\x89PNG" and single != png
    files = write_report(tmp_path / "out", report.STEM, p, md, png, p["command"])
    names = sorted(f.name for f in files)
    assert names == ["command.txt", "verify-nvlink.json", "verify-nvlink.md", "verify-nvlink.png"]
    assert json.loads((tmp_path / "out" / "verify-nvlink.json").read_text())["runs"][1]["counts_for_exit"] is False


def test_stdout_table_one_row_per_size(h200):
    runs = [_run("pip 1.21.0", _pairs(h200))]
    rows = report.table_rows(runs)
    assert len(rows) == 2 * len(STEMS)
    text = format_table(report.TABLE_HEADERS, rows)
    assert text.count("GPU0->GPU1") == len(STEMS) and "cuda_ipc (proto-used)" in text
    # the verdict is printed once per pair, on its largest size
    assert [r[-1] for r in rows].count("pass") == 2
