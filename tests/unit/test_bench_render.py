"""The report of a recorded CPU-mode run (2 CPU workers, ucx + tcp + local_cupy + one knob): stdout table,
markdown, heatmap, command.txt, and `bench render`."""
import json
import shutil
from pathlib import Path

import pytest

from ucx_dask_gpu import cli
from ucx_dask_gpu.bench import render
from ucx_dask_gpu.errors import BENCH_CONFIG

RESULT = Path(__file__).resolve().parent.parent / "fixtures" / "bench" / "cpu_transpose_500_result.json"


@pytest.fixture
def payload():
    return json.loads(RESULT.read_text())


def test_recorded_result_has_the_stable_fields(payload):
    assert {"workload", "size", "chunk", "gpus", "runs", "reference"} <= set(payload)
    for r in payload["runs"]:
        assert {"protocol", "config", "wall_s", "p2p_gbps_median", "p2p"} <= set(r)
    assert {"tool", "protocol", "wall_s", "p2p_gbps_median"} <= set(payload["reference"])


def test_stdout_table(payload):
    text = render.stdout_text(payload)
    lines = text.splitlines()
    assert lines[0].startswith("transpose (x + x.T).sum(): 2000x2000 float64 in 500x500 chunks")
    rows = [ln for ln in lines if ln.startswith(("ucx ", "tcp "))]
    assert len(rows) == len(payload["runs"]) + len(payload["references"]) + len(payload["sweep"])
    assert any("local_cupy (reference)" in ln for ln in rows)
    assert "UCX/TCP wall ratio" in text and "goal wall_s <= 0.1" in text


def test_markdown_sections_and_numbers(payload):
    md = render.markdown(payload)
    for section in ("## Results", "## Knob sweep", "## Per-pair bandwidth", "## Where the time goes",
                    "## Reference (ucx)", "## Reference (tcp)", "## Configuration"):
        assert section in md
    head = payload["runs"][0]
    ms = round(head["wall_s_median"] * 1e3, 2)
    shown = f"{ms:.1f}" if ms >= 100 else f"{ms:.3g}"  # report.format_table's rule for floats
    assert f"| {head['protocol']} | {head['config']} | ok | {shown} |" in md
    for p in head["p2p"]["pairs"]:
        assert f"w{p['src']} -> w{p['dst']} | {p['transfers']} |" in md


def test_heatmap_png(payload):
    png = render.heatmap(payload)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert render.heatmap(dict(payload, runs=[])) is None


def test_command_txt_keeps_other_commands(tmp_path):
    (tmp_path / "command.txt").write_text("ucx-dask-gpu verify-nvlink --out x\n")
    text = render.merged_command_txt(tmp_path, "ucx-dask-gpu bench svd --out x")
    assert text.splitlines() == ["ucx-dask-gpu verify-nvlink --out x", "ucx-dask-gpu bench svd --out x"]
    assert render.merged_command_txt(tmp_path, "ucx-dask-gpu verify-nvlink --out x").count("verify-nvlink") == 1


def test_bench_render_redraws_beside_the_json(tmp_path, payload, capsys):
    payload["notes"] = ["no PNG heatmap: matplotlib is not installed"]
    target = tmp_path / "transpose-500x500.json"
    target.write_text(json.dumps(payload))
    assert cli.main(["bench", "render", str(target)]) == 0
    assert (tmp_path / "transpose-500x500.png").read_bytes()[:4] == b"\x89PNG"
    assert "## Results" in (tmp_path / "transpose-500x500.md").read_text()
    assert "notes" not in json.loads(target.read_text())
    assert not (tmp_path / "command.txt").exists()


def test_bench_render_refuses_other_json(tmp_path, capsys):
    other = tmp_path / "x.json"
    other.write_text(json.dumps({"pairs": []}))
    assert cli.main(["bench", "render", str(other)]) == BENCH_CONFIG
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    shutil.rmtree(tmp_path)
