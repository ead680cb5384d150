"""benchmarks/pertask.py's breakdown of a recorded run (three steady-state repeats on CPU: the client's walls, the task
stream and the scheduler's update-graph metrics): submit -> first task split into the client's part, the scheduler's
(materialise, order, task states) and the dispatch to a worker."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import OUTPUT_REFUSED, RESULT_KEPT

ROOT = Path(__file__).resolve().parents[2]
RECORDED = json.loads((ROOT / "tests/fixtures/bench/pertask-stream-cpu.json").read_text())


@pytest.fixture(scope="module")
def pertask():
    spec = importlib.util.spec_from_file_location("pertask", ROOT / "benchmarks/pertask.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_repeat_splits_submit_to_first_task_into_the_graphs_parts(pertask):
    for t0, t1 in RECORDED["walls"]:
        first = min(s["start"] for t in RECORDED["stream"] for s in t["startstops"]
                    if s["action"] == "compute" and t0 <= s["start"] <= t1)
        parts = pertask._graph_parts(RECORDED["graphs"], t0, first)
        assert set(parts) == set(pertask.GRAPH_PARTS) and all(v > 0 for v in parts.values()), parts
        graph = next(g for g in RECORDED["graphs"] if t0 <= g["start_timestamp_seconds"] <= first)
        scheduler = parts["materialise_ms"] + parts["order_ms"] + parts["task_states_ms"]
        assert scheduler <= graph["duration_seconds"] * 1e3 + 1e-6  # its steps, within its whole update_graph
        assert parts["to_update_graph_ms"] + graph["duration_seconds"] * 1e3 + parts["dispatch_ms"] == \
            pytest.approx((first - t0) * 1e3)


def test_the_breakdown_reports_the_parts_beside_the_task_stream(pertask):
    b = pertask.breakdown(RECORDED)
    assert b["repeats"] == 3 and b["tasks_per_repeat"] == 18
    assert all(b[k] > 0 for k in pertask.GRAPH_PARTS)
    assert sum(b[k] for k in pertask.GRAPH_PARTS) == pytest.approx(b["submit_to_first_task_ms"], rel=0.25)


def test_a_run_without_the_schedulers_graph_metrics_leaves_the_parts_unknown(pertask):
    b = pertask.breakdown({**RECORDED, "graphs": []})
    assert b["repeats"] == 3 and all(b[k] is None for k in pertask.GRAPH_PARTS)
    assert pertask.breakdown({k: v for k, v in RECORDED.items() if k != "graphs"})["order_ms"] is None


def test_the_breakdown_says_how_the_blocks_were_placed(pertask):
    # 16 blocks (2000^2 in 500^2 chunks) + aggregate + finalize; a worker with none counts as 0, the busiest first
    b = pertask.breakdown(RECORDED)
    assert len(b["blocks_per_worker"]) == len(RECORDED["workers"]) == 2
    assert sum(b["blocks_per_worker"]) == b["tasks_per_repeat"] - 2
    assert b["blocks_per_worker"] == sorted(b["blocks_per_worker"], reverse=True)
    assert 0 < b["busiest_worker_blocks_ms"] <= b["on_workers_ms"]
    one_worker = {**RECORDED, "stream": [{**t, "worker": RECORDED["workers"][0]} for t in RECORDED["stream"]]}
    assert pertask.breakdown(one_worker)["blocks_per_worker"] == [16, 0]


def test_render_writes_the_breakdown_again_from_a_recorded_run(pertask, tmp_path):
    recorded = ROOT / "benchmarks/results/h200-2026-12-04/pertask/pertask.json"
    (tmp_path / "pertask.json").write_text(recorded.read_text())
    (tmp_path / "pertask-stream.json").write_text(json.dumps(RECORDED))
    assert pertask.render_again(tmp_path) == 0
    payload = json.loads((tmp_path / "pertask.json").read_text())
    assert payload["task_stream"] == pertask.breakdown(RECORDED)
    assert payload["profiles"] == json.loads(recorded.read_text())["profiles"]  # as recorded
    assert "| blocks per worker, busiest first |" in (tmp_path / "pertask.md").read_text()


def test_render_of_a_folder_without_a_recorded_run_says_so_and_writes_nothing(pertask, tmp_path):
    with pytest.raises(SystemExit, match="^pertask: cannot render .*pertask.json"):
        pertask.render_again(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_render_that_cannot_write_keeps_the_breakdown_and_says_where(pertask, tmp_path, capsys):
    recorded = ROOT / "benchmarks/results/h200-2026-12-04/pertask/pertask.json"
    (tmp_path / "pertask.json").write_text(recorded.read_text())
    (tmp_path / "pertask-stream.json").write_text(json.dumps(RECORDED))
    (tmp_path / "pertask.md").mkdir()  # where the table goes, a directory: not replaced
    with pytest.raises(SystemExit) as e:
        pertask.render_again(tmp_path)
    assert e.value.code == RESULT_KEPT
    (line,) = capsys.readouterr().err.splitlines()
    kept = Path(re.search(r"is kept in (\S+)$", line)[1])
    assert json.loads((kept / "pertask.json").read_text())["task_stream"] == pertask.breakdown(RECORDED)
    assert (tmp_path / "pertask.json").read_text() == recorded.read_text(), "all or none: the old one stays"


def test_an_out_holding_a_file_of_its_names_it_did_not_write_is_refused_before_any_cluster(tmp_path):
    (tmp_path / "pertask.md").write_text("a user's notes")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/pertask.py"), "--cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == OUTPUT_REFUSED, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "pertask.md is there" in proc.stderr
    assert (tmp_path / "pertask.md").read_text() == "a user's notes" and len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("host, split", [("host-a", [22, 3]), ("host-b", [13, 12])])
def test_the_breakdown_tells_an_uneven_placement_from_an_even_one(pertask, host, split):
    # Two recorded GPU runs of the same steady-state transpose: one with 22 of 25 blocks on one worker, one even
    stream = ROOT / f"benchmarks/results/h200-2026-12-05/{host}/pertask/pertask-stream.json"
    b = pertask.breakdown(json.loads(stream.read_text()))
    assert b["blocks_per_worker"] == split
    busiest_per_block = b["busiest_worker_blocks_ms"] / split[0]
    assert b["busiest_worker_blocks_ms"] < b["on_workers_ms"] and busiest_per_block > b["task_compute_ms"]
