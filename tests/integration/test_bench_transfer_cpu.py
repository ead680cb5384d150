"""`python -m ucx_dask_gpu.bench.transfer` end to end on CPU: real LocalClusters over UCX (UCX over TCP, our UCX and
UCXX) and TCP, an environment variable reaching the workers, rounds interleaved, traced rounds after them. Checks that
every variant measured what it says it measured; no timing is asserted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.fsutil import MANIFEST

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SIZES = [8, 65536]
RUNS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("transfer")
    proc = subprocess.run(
        [sys.executable, "-m", "ucx_dask_gpu.bench.transfer", "--cpu", "--sizes", "8,64KiB", "--runs", str(RUNS),
         "--allow-few", "--warmup", "1", "--variant", "ucx@event:none:UCXPY_ENABLE_PYTHON_FUTURE=1",
         "--variant", "tcp@base:none", "--trace", "2", "--out", str(out), "--budget", "300"],
        capture_output=True, text=True, timeout=400)
    report = json.loads((out / "transfer.json").read_text()) if (out / "transfer.json").exists() else None
    return proc, report, out


def test_exit_and_outputs(run):
    proc, report, out = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"transfer.json", "transfer.md", "transfer.png", "command.txt",
                                               MANIFEST}
    assert "python -m ucx_dask_gpu.bench.transfer --cpu --sizes 8,64KiB" in (out / "command.txt").read_text()
    assert report["sizes"] == SIZES and report["primary_metric"] == "e2e_s@8" and report["baseline"] == "ucx/event"


def test_every_variant_measured_every_size(run):
    _, report, _ = run
    for v in report["runs"]:
        assert v["status"] == "ok", v["error"]
        assert list(v["samples"]) == ["transfer_s@8", "e2e_s@8", "transfer_s@65536", "e2e_s@65536"]
        for n in SIZES:
            xfer, e2e = v["samples"][f"transfer_s@{n}"], v["samples"][f"e2e_s@{n}"]
            assert len(xfer) == len(e2e) == RUNS and all(0 < t < e for t, e in zip(xfer, e2e))
        assert v["bytes_moved"]["per_repetition"] == [sum(SIZES)] * RUNS  # exactly the blocks, every time
        assert v["wall_s"] == v["samples"]["e2e_s@8"]
    assert not [n for n in report["notes"] if "moved" in n]


def test_settings_reached_the_workers(run):
    _, report, _ = run
    clusters = {tuple(c["variants"]): c for c in report["clusters"]}
    ours = str((REPO / "build" / "ucx-prefix" / "lib").resolve())
    for f in clusters[("ucx/event",)]["worker_facts"].values():
        assert f["UCXPY_ENABLE_PYTHON_FUTURE"] == "1" and f["progress_mode"] == "blocking"
        assert f["libucp"].startswith(ours), f["libucp"]
    assert all(f["libucp"] is None or f["libucp"].startswith(ours)
               for f in clusters[("tcp/base",)]["worker_facts"].values())
    assert all(c["shutdown"]["clean"] for c in report["clusters"])


def test_traced_rounds_give_the_phases(run):
    _, report, out = run
    for v in report["runs"]:
        phases = v["check"]["phases"]
        assert [p["bytes"] for p in phases] == SIZES and all(p["samples"] == 2 for p in phases)
        what = {s["what"] for p in phases for s in p["segments"]}
        assert {"A: serialise response", "B: deserialise response", "B: write 'OK'"} <= what
        if v["protocol"] == "ucx":
            # a get_data response is 2 header messages + its frames; the request and the OK are 2 + 1 each
            assert all(p["ops_median"]["A.ep.send"] >= 3 and p["ops_median"]["B.ep.recv"] >= 3 for p in phases)
            assert "response header: send + wire + B wakes" in what
    assert "## Where one transfer's time goes: ucx/event" in (out / "transfer.md").read_text()
