"""verify-nvlink's orchestration end to end on a CPU machine: the real argument parser, the real pip ucx_perftest
(host memory instead of CUDA), real pair/ablation/variant sequencing, records and report files.

The GPU side (NVML counters, process lists, the CuPy probes) is replaced by a recorded-values stand-in: NVML and
CUDA do not exist here, and they are not what this test is about -- tests/gpu/test_verify_nvlink_gpu.py runs them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ucx_dask_gpu.nvlink import cli as nvlink_cli
from ucx_dask_gpu.nvlink import report, undertest, verdict, verify
from ucx_dask_gpu import nvml
from ucx_dask_gpu.cli import build_parser, main
from ucx_dask_gpu.errors import PERFTEST_FAILED, UserError
from ucx_dask_gpu.fsutil import MANIFEST
from ucx_dask_gpu.report import write_report

# The UCX under test: our build (`make ucx`), whose ucx_perftest runs host memory here for real.
OURS = str(Path(os.environ.get("UCX_PREFIX", Path(__file__).resolve().parents[2] / "build" / "ucx-prefix")).resolve())
pytestmark = pytest.mark.skipif(not (Path(OURS) / "bin" / "ucx_perftest").is_file(),
                                reason=f"no UCX build at {OURS} (make ucx, or set UCX_PREFIX)")


@pytest.fixture
def recorded_side(h200):
    """A class that stands in for GpuSide where there is no GPU: idle counters, the configured visibility, a fixed
    baseline."""
    class RecordedGpuSide:
        origin = "recorded"

        def __init__(self, gpus):
            self.gpus = gpus
            self.snapshots = 0

        def snapshot(self):
            self.snapshots += 1
            return {g.uuid: h200.snapshot(g, 0, 0) for g in self.gpus}

        def stable_snapshot(self):
            return self.snapshot()

        def pids_sampler(self):
            calls = []

            def poll(server_pid, client_pid):
                calls.append((server_pid, client_pid))
            return {}, poll

        def probe_visible(self, cuda_visible):
            return [u for u in cuda_visible.split(",")], None

        def memcpy_peer(self, src, dst, sizes, samples, timeout):
            return {"peer_access": True, "results": [{"msg_bytes": s, "gbps": 1.0, "bytes_moved": s * 10, "reps": 1}
                                                     for s in sizes]}, None

    return RecordedGpuSide


@pytest.fixture
def recorded_host(monkeypatch, h200, recorded_side):
    """The recorded H200 pair as the host's GPUs and driver, GpuSide recorded; `recorded_host(preflight)` also
    replaces the ucx_info preflight. Returns the GPUs."""
    gpus = h200.smi_gpus()

    def use(preflight):
        monkeypatch.setattr(nvml, "discover", lambda: gpus)
        monkeypatch.setattr(nvml, "driver_version", lambda: "580.159.04")
        monkeypatch.setattr(nvlink_cli, "preflight", preflight)
        monkeypatch.setattr(nvlink_cli, "GpuSide", recorded_side)
        return gpus
    return use


def test_run_and_variant_one_pair_on_host_memory(tmp_path, h200, recorded_side):
    gpus = h200.smi_gpus()
    args = build_parser().parse_args(["verify-nvlink", "--ucx-prefix", OURS, "--sizes", "64KiB,1MiB", "--iters", "100",
                                      "--variant", "UCX_PROTO_ENABLE=n", "--variant", "UCX_RNDV_SCHEME=bogus",
                                      "--variant-sizes", "1MiB", "--raw-dir", str(tmp_path / "raw"), "-q"])
    inst = undertest.resolve_install(OURS)
    # what preflight reads (GPU only) from 1.20.1: protocol v2, and `UCX_PROTO_INFO=used` not a mode of its own
    inst.version, inst.proto_v2_default, inst.proto_used = "1.20.1", True, False
    # the variant turns protocol v2 off: no tables any more, so it is judged by lanes + the ablation run
    # and a study whose value this UCX rejects: recorded as that run's error, the others go on
    runs = [verify.RunSpec(inst, None, "ours"), verify.RunSpec(inst, verify.parse_variant(args.variant[0]), "ours + v1"),
            verify.RunSpec(inst, verify.parse_variant(args.variant[1]), "ours + bogus")]
    side = recorded_side(gpus)
    args.memory_type = "host"
    ver = verify.Verifier(args, gpus, [(gpus[0], gpus[1])], runs, verify.parse_sizes(args.sizes), side, [], {},
                      verdict.Thresholds())
    results = ver.run()

    assert [r["evidence_method"] for r in results] == ["proto-selected", "lanes", "proto-selected"]
    assert [r["counts_for_exit"] for r in results] == [True, False, False]
    assert results[0]["error"] is None and results[1]["error"] is None
    assert "ucx_perftest failed" in results[2]["error"] and "bogus" in results[2]["error"]
    assert results[2]["pairs"] == []
    for r, sizes in zip(results[:2], ([64 << 10, 1 << 20], [1 << 20])):
        (p,) = r["pairs"]
        assert [s["msg_bytes"] for s in p["sizes"]] == sizes
        for s in p["sizes"]:
            assert s["iterations"] == 100 and s["warmup"] == 10 and s["ucx_gbps"] > 0
            assert s["memcpy_peer_gbps"] == 1.0
        # idle counters: nothing crossed NVLink, so nothing may pass
        assert p["verdict"] == "fail" and any("NVLink counters saw" in x for x in p["reasons"])
        vis = p["evidence"]["visibility"]
        assert vis["server_declared"] == [gpus[1].uuid] and vis["client_declared"] == [gpus[0].uuid]
    # the protocol-table run found the host-memory selection tables of the real perftest
    used = results[0]["pairs"][0]["sizes"][-1]
    assert used["transport_method"] == "proto-selected" and used["transport"] != "unknown"
    # the lanes run did its ablation (UCX_TLS without cuda_ipc) at the largest size
    abl = results[1]["pairs"][0]["evidence"]["ablation"]
    assert abl["UCX_TLS"] == "^cuda_ipc" and abl["msg_bytes"] == 1 << 20 and abl["error"] is None
    v1 = results[1]["pairs"][0]["sizes"][-1]
    assert v1["transport_method"] in ("lanes+ablation", "ablation") and len(v1["transport_detail"]) >= 2
    # raw outputs kept per run
    kept = sorted(p.parent.name for p in (tmp_path / "raw").rglob("client.txt"))
    assert len(kept) == 2 + 1 + 1 + 1
    assert side.snapshots >= 2 * 5

    payload = report.build_payload("cpu", None, gpus, results, ver.baseline, ver.sizes, ver.th,
                               verify.parse_goals(verify.DEFAULT_GOALS), "ucx-dask-gpu verify-nvlink ...", False)
    assert payload["verdict"] == "fail" and payload["exit_code"] == 1  # the failed study does not make it 14
    write_report(tmp_path / "out", report.STEM, payload, report.render_markdown(payload, {}),
                 report.render_png(payload), payload["command"])
    assert json.loads((tmp_path / "out" / "verify-nvlink.json").read_text())["runs"][1]["variant"] == {
        "UCX_PROTO_ENABLE": "n"}


def test_unsafe_visible_devices_declares_every_gpu(h200, recorded_side):
    gpus = h200.smi_gpus()
    args = build_parser().parse_args(["verify-nvlink", "--unsafe-visible-devices", "-q"])
    ver = verify.Verifier(args, gpus, [(gpus[0], gpus[1])], [], [1 << 20], recorded_side(gpus), [], {},
                      verdict.Thresholds())
    assert ver.visible_for(gpus[0]) == ver.visible_for(gpus[1]) == "0,1"
    assert ver.declared("0,1") == [g.uuid for g in gpus]
    safe = verify.Verifier(build_parser().parse_args(["verify-nvlink", "-q"]), gpus, [], [], [1], recorded_side(gpus),
                       [], {}, verdict.Thresholds())
    assert safe.visible_for(gpus[1]) == gpus[1].uuid and safe.declared(gpus[1].uuid) == [gpus[1].uuid]


def test_command_end_to_end_with_recorded_gpu_side(tmp_path, monkeypatch, capsys, recorded_host):
    """`verify-nvlink` as typed, down to the report files; only discovery, the ucx_info preflight (which refuses a UCX
    without CUDA transports, as here) and the GPU side are the recorded stand-ins."""

    def preflight(inst, env):
        inst.version, inst.proto_v2_default, inst.proto_used = "1.21.0", True, True

    recorded_host(preflight)
    out = tmp_path / "report"
    argv = ["verify-nvlink", "--ucx-prefix", OURS, "--sizes", "1MiB", "--iters", "50", "--memory-type", "host",
            "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["/usr/local/bin/ucx-dask-gpu", *argv])  # what command.txt records
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 1 and cap.err == ""  # idle counters: no pass, and nothing on stderr
    assert "verdict: fail" in cap.out and "GPU1->GPU0" in cap.out and "[4/4" in cap.out  # 2 baselines + 2 runs
    rep = json.loads((out / "verify-nvlink.json").read_text())
    assert [(p["src"], p["dst"]) for p in rep["pairs"]] == [(0, 1), (1, 0)]
    assert rep["ucx"]["version"] == "1.21.0" and rep["driver"] == "580.159.04" and rep["exit_code"] == 1
    assert (out / "command.txt").read_text().startswith(f"ucx-dask-gpu verify-nvlink --ucx-prefix {OURS}")
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "command.txt", "verify-nvlink.json", "verify-nvlink.md",
                                                     "verify-nvlink.png"]


def test_keep_going_reports_a_ucx_that_cannot_start(tmp_path, monkeypatch, capsys, recorded_host):
    """Two UCX under test, the second one broken (as a from-source prefix without libcudart would be): with
    --keep-going the first is still measured and the report says why the second has no numbers (exit 14)."""
    broken = tmp_path / "broken-ucx"  # a second UCX under test: the same files under another name
    broken.symlink_to(OURS)

    def preflight(inst, env):
        if inst.install.spec != OURS:
            raise UserError(f"UCX at {inst.install.prefix} does not start (ucx_info -v exit 127): symbol lookup error",
                            PERFTEST_FAILED)
        inst.version, inst.proto_v2_default, inst.proto_used = "1.21.0", True, True

    recorded_host(preflight)
    out = tmp_path / "report"
    rc = main(["verify-nvlink", "--ucx-prefix", OURS, "--ucx-prefix", str(broken), "--gpus", "0,1",
               "--sizes", "64KiB", "--iters", "20", "--memory-type", "host", "--keep-going", "--out", str(out), "-q"])
    cap = capsys.readouterr()
    assert rc == PERFTEST_FAILED and cap.err == ""
    rep = json.loads((out / "verify-nvlink.json").read_text())
    assert [bool(r["error"]) for r in rep["runs"]] == [False, True]
    assert "symbol lookup error" in rep["runs"][1]["error"] and len(rep["runs"][0]["pairs"]) == 2
    # without --keep-going the same machine stops at once, one line, no report
    rc = main(["verify-nvlink", "--ucx-prefix", OURS, "--ucx-prefix", str(broken), "--memory-type", "host",
               "--out", str(tmp_path / "none"), "-q"])
    cap = capsys.readouterr()
    assert rc == PERFTEST_FAILED and len(cap.err.strip().splitlines()) == 1 and not (tmp_path / "none").exists()
