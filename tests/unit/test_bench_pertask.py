"""benchmarks/pertask.py's breakdown of a recorded run (three steady-state repeats on CPU: the client's walls, the task
stream and the scheduler's update-graph metrics): submit -> first task split into the client's part, the scheduler's
(materialise, order, task states) and the dispatch to a worker."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

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
