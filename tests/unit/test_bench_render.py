"""The report of recorded CPU runs of the harness (transpose: ucx + tcp + parity + peer; transfer: 2 sizes): the stable
JSON fields, the stdout table, markdown, PNG, command.txt, and `bench render`."""
import json
import shutil
from pathlib import Path

import pytest

from ucx_dask_gpu import cli
from ucx_dask_gpu.bench import common, render
from ucx_dask_gpu.errors import BENCH_CONFIG

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "bench"


@pytest.fixture(params=["cpu_transpose_result.json", "cpu_transfer_result.json"])
def payload(request):
    return json.loads((FIXTURES / request.param).read_text())


def test_recorded_results_have_the_stable_fields(payload):
    assert payload["schema_version"] == common.SCHEMA_VERSION
    assert {"workload", "gpus", "runs", "reference", "provenance", "baseline", "primary_metric"} <= set(payload)
    prov = payload["provenance"]
    assert {"git", "versions", "host", "cpu_count", "command", "libucp"} <= set(prov)
    assert prov["git"]["commit"] and prov["versions"]["dask"]
    for r in payload["runs"]:
        assert {"protocol", "config", "wall_s", "p2p_gbps_median", "p2p", "bytes_moved", "ratio_to_baseline"} <= set(r)
        assert r["wall_s"] == r["samples"][payload["primary_metric"]]
        ratio = r["ratio_to_baseline"]
        if r["name"] == payload["baseline"]:
            assert ratio is None
        else:
            assert ratio["ci95"][0] <= ratio["median"] <= ratio["ci95"][1] and ratio["verdict"] in ("faster", "slower", "noise")
    for cid, lib in prov["libucp"].items():
        assert all(p.endswith(".so.0.0.0") or p is None for p in lib["workers"].values())


def test_transpose_reference_fields():
    p = json.loads((FIXTURES / "cpu_transpose_result.json").read_text())
    assert [r["kind"] for r in p["references"]] == ["parity", "peer"] and p["reference"]["kind"] == "parity"
    for r in p["references"]:
        assert {"tool", "protocol", "wall_s", "p2p_gbps_median", "ratio_to_ours", "against"} <= set(r)
    assert p["reference"]["against"] == "ucx/shipped" and p["references"][1]["against"] == "ucx/defaults"


def test_stdout_table(payload):
    text = render.text(payload)
    rows = [ln for ln in text.splitlines() if ln.startswith(("ucx/", "tcp/"))]
    assert len(rows) == sum(len(r["summary"]) for r in payload["runs"])
    base = [ln for ln in rows if ln.startswith(payload["baseline"] + " ")]
    assert base and all("baseline" in ln for ln in base)


def test_markdown_sections(payload):
    md = render.markdown(payload)
    assert md.startswith(f"# {payload['workload']}: ")
    assert f"## Results (baseline {payload['baseline']})" in md and "## Clusters" in md
    assert payload["provenance"]["git"]["commit"] in md and payload["command"] in md
    assert ("## dask-cuda's local_cupy beside it" in md) == bool(payload["references"])
    for r in payload["runs"]:
        assert f"| {r['name']} | {payload['primary_metric']} |" in md


def test_png_or_a_note_why_not(payload, monkeypatch):
    picture = render.png(payload)
    assert picture is None or picture[:8] == b"\x89PNG\r\n\x1a\n"
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert render.png(payload) is None and payload["notes"][-1].startswith("no PNG: matplotlib is not installed")


def test_write_and_command_txt_keeps_every_command(tmp_path, payload):
    render.write(payload, tmp_path, "a", "first command")
    written = render.write(payload, tmp_path, "b", "second command")
    assert {p.name for p in written} >= {"b.json", "b.md", "command.txt"}
    assert (tmp_path / "command.txt").read_text() == "first command\nsecond command\n"
    assert json.loads((tmp_path / "b.json").read_text())["runs"] == payload["runs"]


def test_bench_render_redraws_from_the_json(tmp_path, capsys):
    shutil.copy(FIXTURES / "cpu_transpose_result.json", tmp_path / "t.json")
    assert cli.main(["bench", "render", str(tmp_path / "t.json")]) == 0
    assert (tmp_path / "t.md").read_text().startswith("# transpose: ")
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["bench", "render", str(tmp_path / "bad.json")]) == BENCH_CONFIG
    assert "schema" in capsys.readouterr().err
