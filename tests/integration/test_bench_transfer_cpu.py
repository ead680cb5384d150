"""`python -m ucx_dask_gpu.bench.transfer` end to end on CPU: real LocalClusters over TCP and over UCX (UCX over TCP,
our UCX and UCXX), the stock progress mode and the event-driven one of our UCXX patch, a traced variant, and the
transpose sanity check. Checks that every variant measured what it says it measured; no timing is asserted."""
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SIZES = [8, 65536]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    proc = subprocess.run(
        [sys.executable, "-m", "ucx_dask_gpu.bench.transfer", "--sizes", "8,64KiB", "--rounds", "3", "--warmup", "1",
         "--variant", "ucx,tcp@baseline:none", "--variant", "ucx@event:none:UCXPY_ENABLE_PYTHON_FUTURE=1",
         "--trace", "event", "--trace-rounds", "2", "--transpose", "400", "--transpose-chunks", "100",
         "--transpose-runs", "1", "--transpose-protocols", "ucx,tcp", "--seconds", "60", "--out", str(out)],
        capture_output=True, text=True, timeout=600)
    report = json.loads((out / "transfer.json").read_text()) if (out / "transfer.json").exists() else None
    return proc, report, out


def test_exit_outputs_and_summary(run):
    proc, report, out = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"transfer.json", "transfer.md", "transfer-raw.json.gz", "command.txt"}
    assert "python -m ucx_dask_gpu.bench.transfer --sizes 8,64KiB" in (out / "command.txt").read_text()
    lines = [ln for ln in proc.stdout.splitlines() if ln.split()[:1] in (["ucx"], ["tcp"])]
    assert [ln.split()[:2] for ln in lines] == [["ucx", "baseline"], ["tcp", "baseline"], ["ucx", "event"]]
    assert all("transpose" in ln and ln.rstrip().endswith("ok") for ln in lines)


def test_every_variant_measured_every_size(run):
    _, report, _ = run
    assert report["sizes"] == SIZES
    for v in report["variants"]:
        assert v["status"] == "ok", v
        assert v["cluster"] == "LocalCluster, two CPU workers"
        for row in v["rows"]:
            assert row["samples"] == 3 and row["missing_log"] == 0
            assert row["transfer_ms_median"] > 0 and row["e2e_ms_median"] >= row["transfer_ms_median"]
        assert v["transpose"]["check_ok"] and v["transpose"]["runs"] == 1


def test_settings_reached_the_workers(run):
    _, report, _ = run
    by = {(v["protocol"], v["label"]): v["applied"] for v in report["variants"]}
    ours = str((REPO / "build" / "ucx-prefix" / "lib").resolve())
    for key in (("ucx", "baseline"), ("ucx", "event")):
        assert by[key]["progress_mode"] == "blocking"
        assert by[key]["libucp"].startswith(ours), by[key]["libucp"]
    assert by[("ucx", "baseline")]["python_future"] is False
    assert by[("ucx", "event")]["python_future"] is True
    assert by[("ucx", "event")]["UCXPY_ENABLE_PYTHON_FUTURE"] == "1"
    assert "progress_mode" not in by[("tcp", "baseline")]


def test_traced_variant_has_its_phases(run):
    _, report, out = run
    [event] = [v for v in report["variants"] if v["label"] == "event"]
    assert [p["bytes"] for p in event["phases"]] == SIZES
    for ph in event["phases"]:
        assert ph["samples"] == 2 and ph["gather_ms_median"] > 0
        what = {s["what"] for s in ph["segments"]}
        assert {"A: serialise response", "B: deserialise response", "response header: send + wire + B wakes",
                "B: receive the frames (buffers, data)", "B: write 'OK'"} <= what
        # a get_data response is 2 header messages + its frames; the request and the OK are 2 + 1 each
        assert ph["ops_median"]["A.ep.send"] >= 3 and ph["ops_median"]["B.ep.recv"] >= 3
    with gzip.open(out / "transfer-raw.json.gz", "rt") as f:
        raw = json.load(f)
    traced = [s for r in raw["results"] if r["label"] == "event" for res in r["results"] for s in res["traced"]]
    assert len(traced) == 2 * len(SIZES) and all(s["events"]["A"]["events"] and s["events"]["B"]["events"]
                                                 for s in traced)
