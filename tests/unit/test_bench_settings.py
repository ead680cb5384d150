"""--config files and --knob sweep variants: parsing, validation against dask's own keys, and merging."""
import json
from pathlib import Path

import pytest
import yaml
from dask.utils import parse_bytes

from ucx_dask_gpu.bench import settings as st
from ucx_dask_gpu.errors import BENCH_CONFIG, USAGE, UserError

# the 2xH200 session that chose the shipped tuned-gpu.yaml (committed results, read-only)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200x2-2026-11-30"


def code_of(fn, *args):
    with pytest.raises(UserError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return e.value.exit_code


def test_shipped_tuned_config_is_valid_and_complete():
    cfg = st.load_config("tuned")
    assert cfg.name == "tuned-gpu" and cfg.path.endswith("config/tuned-gpu.yaml")
    t = cfg.tree
    cluster, ignored = st.cluster_settings(t, cpu=False)
    # one thread per worker, CuPy on its own pool; an RMM pool for what RMM allocates (the receive buffers)
    assert cluster["threads-per-worker"] == 1 and cluster["rmm-pool-size"] == 0.05
    assert cluster["rmm-allocator-external-lib-list"] is None and not ignored
    assert st.get_path(t, "distributed.comm.compression") is False
    # installed on every host: no CUDA context demanded of a scheduler or client without GPU
    assert st.get_path(t, "distributed-ucxx.create-cuda-context") is None
    env, unset = st.environment(t)
    assert env == {"UCXPY_PROGRESS_MODE": "blocking"} and not unset
    assert parse_bytes(st.get_path(t, "distributed.worker.transfer.message-bytes-limit")) == 2 ** 30
    # "inf" is the spelling distributed's Scheduler turns into math.inf
    assert st.get_path(t, "distributed.scheduler.worker-saturation") == "inf"
    # everything distributed-ucxx copies into os.environ must be text
    assert all(isinstance(v, str) for v in st.get_path(t, "distributed-ucxx.environment").values())
    # every key is one dask / distributed / distributed-ucxx know (check_tree raised otherwise)
    assert {k.split(".")[0] for k, _ in st.leaves(t)} <= {"array", "distributed", "distributed-ucxx", "ucx-dask-gpu"}


def test_shipped_tuned_config_keeps_the_measured_combination():
    """tuned-gpu.yaml keeps what the 2xH200 run measured: its base config (the file as it was) plus the combined
    knob -- and that knob beat the base in the recording -- except where a line of the file says it is pending a new
    measurement (an RMM pool for the receive buffers only; new settings) or why it left (create-cuda-context)."""
    rec = json.loads((RESULTS / "transpose-128MiB-combined-knobs.json").read_text())
    (base,) = [r for r in rec["runs"] if r["kind"] != "knob"]
    (combined,) = [r for r in rec["runs"] if r["kind"] == "knob"]
    assert combined["status"] == base["status"] == "ok" and combined["check"]["ok"] and base["check"]["ok"]
    assert combined["wall_s_median"] < base["wall_s_median"]  # recorded: 200.5 vs 278.5 ms
    knob = st.parse_knob(combined["knob"])
    assert {s.key: s.value for s in knob.settings} == combined["settings"]
    measured = dict(st.leaves(st.apply_settings(rec["config"]["tree"], knob.settings)))
    shipped = dict(st.leaves(st.load_config("tuned").tree))
    changed = {k for k in measured if shipped.get(k, "absent") != measured[k]}
    assert changed == {"ucx-dask-gpu.cluster.rmm-pool-size", "distributed-ucxx.create-cuda-context"}
    text = st.tuned_path().read_text()
    assert "PENDING MEASUREMENT. Each GPU worker gets an RMM pool" in text and "Not here: create-cuda-context" in text
    # what the workers really ran with: blocking progress, no RMM pool under CuPy
    for applied in combined["applied"].values():
        assert applied["progress_mode"] == "blocking"
        assert applied["ucx-dask-gpu.cluster.rmm-pool-size"] == "CudaMemoryResource"
    # each part of the combination helped on its own in the sweep
    sweep = {r["knob"]: r for r in json.loads((RESULTS / "transpose-128MiB.json").read_text())["sweep"]}
    for s in knob.settings:
        if s.key == "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list":
            continue  # swept together with rmm-pool-size (one knob)
        (single,) = [r for k, r in sweep.items() if k.startswith(s.text())]
        assert single["status"] == "ok" and single["wall_vs_base"] < 1, single


def test_cpu_mode_ignores_gpu_only_cluster_keys():
    tuned = st.load_config("tuned").tree
    # the shipped file's only GPU-only key off its default: the RMM pool (pending measurement)
    assert st.cluster_settings(tuned, cpu=True)[1] == ["ucx-dask-gpu.cluster.rmm-pool-size"]
    pooled = st.apply_settings(tuned, st.parse_knob("ucx-dask-gpu.cluster.rmm-pool-size=0.5;"
                                                    "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list=cupy").settings)
    cluster, ignored = st.cluster_settings(pooled, cpu=True)
    assert cluster["rmm-pool-size"] is None and cluster["rmm-allocator-external-lib-list"] is None
    assert ignored == ["ucx-dask-gpu.cluster.rmm-pool-size", "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list"]
    assert st.cluster_settings(pooled, cpu=False)[0]["rmm-pool-size"] == 0.5


def test_none_config():
    cfg = st.load_config("none")
    assert cfg.tree == {} and cfg.path is None and cfg.name == "defaults"


def test_config_file_errors(tmp_path):
    assert code_of(st.load_config, str(tmp_path / "missing.yaml")) == BENCH_CONFIG
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed: [unclosed\n")
    assert code_of(st.load_config, str(bad)) == BENCH_CONFIG
    typo = tmp_path / "typo.yaml"
    typo.write_text("distributed:\n  scheduler:\n    bandwith: 1GB\n")
    with pytest.raises(UserError, match="distributed.scheduler.bandwith"):
        st.load_config(str(typo))
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    assert code_of(st.load_config, str(listy)) == BENCH_CONFIG
    ucx_int = tmp_path / "ucxint.yaml"
    ucx_int.write_text("distributed-ucxx:\n  environment:\n    max-rndv-rails: 1\n")
    with pytest.raises(UserError, match="must be a string"):
        st.load_config(str(ucx_int))
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("ucx-dask-gpu:\n  cluster:\n    threads-per-worker: 0\n")
    assert code_of(st.load_config, str(cluster)) == BENCH_CONFIG


def test_config_file_accepts_dash_underscore_and_freeform(tmp_path):
    f = tmp_path / "ok.yaml"
    f.write_text(yaml.safe_dump({
        "distributed": {"worker": {"memory": {"target": False}}, "comm": {"offload": "10MiB"},
                        "nanny": {"pre-spawn-environ": {"ANY_NAME": "1"}}},
        "distributed-ucxx": {"multi_buffer": True, "environment": {"rndv-scheme": "get_zcopy"}},
        "ucx-dask-gpu": {"other-tool": {"x": 1}},
    }))
    assert st.load_config(str(f)).name == "ok"


def test_knob_kinds():
    k = st.parse_knob("UCXPY_PROGRESS_MODE=blocking")
    assert k.settings == (st.Setting("UCXPY_PROGRESS_MODE", "blocking", "env"),)
    k = st.parse_knob("distributed.scheduler.bandwidth=1GB ; ucx-dask-gpu.cluster.threads-per-worker=2")
    assert [(s.key, s.value, s.kind) for s in k.settings] == [
        ("distributed.scheduler.bandwidth", "1GB", "dask"), ("ucx-dask-gpu.cluster.threads-per-worker", 2, "cluster")]
    k = st.parse_knob("distributed-ucxx.multi-buffer=true;ucx-dask-gpu.cluster.rmm-pool-size=none")
    assert [s.value for s in k.settings] == [True, None]
    k = st.parse_knob("distributed-ucxx.environment.max-rndv-rails=2")
    assert k.settings[0].value == "2"  # stays text: it goes to os.environ
    assert st.parse_knob("UCX_MAX_RNDV_RAILS=").settings[0].value is None


@pytest.mark.parametrize("text, code", [
    ("", USAGE), ("no-equals", USAGE), ("a=1;", USAGE), ("=1", USAGE),
    ("UCX_TLS=tcp;UCX_TLS=rc", USAGE),
    ("distributed.scheduler.bandwidht=1GB", BENCH_CONFIG),
    ("nosuchnamespace.key=1", BENCH_CONFIG),
    ("ucx-dask-gpu.cluster.threads=2", BENCH_CONFIG),
    ("ucx-dask-gpu.cluster.threads-per-worker=0", BENCH_CONFIG),
    ("ucx-dask-gpu.cluster.rmm-async=maybe", BENCH_CONFIG),
    ("ucx-dask-gpu.cluster.rmm-pool-size=lots", BENCH_CONFIG),
    ("ucx-dask-gpu.cluster.rmm-allocator-external-lib-list=numba", BENCH_CONFIG),
    ("distributed-ucxx.environment=x", BENCH_CONFIG),
    ("Mixed.Case=1", BENCH_CONFIG),
])
def test_bad_knobs(text, code):
    assert code_of(st.parse_knob, text) == code


def test_apply_settings_env_dask_cluster():
    base = st.load_config("tuned").tree
    k = st.parse_knob("UCXPY_PROGRESS_MODE=blocking;UCX_RNDV_SCHEME=get_zcopy;distributed.comm.offload=10MiB;"
                      "ucx-dask-gpu.cluster.threads-per-worker=4")
    t = st.apply_settings(base, k.settings)
    env, unset = st.environment(t)
    assert env == {"UCXPY_PROGRESS_MODE": "blocking", "UCX_RNDV_SCHEME": "get_zcopy"} and unset == []
    assert st.get_path(t, "distributed.comm.offload") == "10MiB"
    assert st.cluster_settings(t, cpu=False)[0]["threads-per-worker"] == 4
    assert st.get_path(base, "distributed.comm.offload") is False  # base untouched

    t2 = st.apply_settings(base, st.parse_knob("UCXPY_PROGRESS_MODE=").settings)
    env2, unset2 = st.environment(t2)
    assert "UCXPY_PROGRESS_MODE" not in env2 and unset2 == ["UCXPY_PROGRESS_MODE"]


def test_setting_text_roundtrip():
    for text in ("UCX_TLS=tcp", "distributed-ucxx.multi-buffer=false", "ucx-dask-gpu.cluster.rmm-pool-size=none"):
        assert st.parse_knob(text).settings[0].text() == text
