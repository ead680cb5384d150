"""--config files and --knob sweep variants: parsing, validation against dask's own keys, and merging."""
import pytest
import yaml

from ucx_dask_gpu.bench import settings as st
from ucx_dask_gpu.errors import BENCH_CONFIG, USAGE, UserError


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
    assert cluster["threads-per-worker"] == 1 and cluster["rmm-pool-size"] == 0.5
    assert cluster["rmm-allocator-external-lib-list"] == "cupy" and not ignored
    assert st.get_path(t, "distributed.comm.compression") is False
    assert st.get_path(t, "distributed-ucxx.create-cuda-context") is True
    env, unset = st.environment(t)
    assert env["UCXPY_PROGRESS_MODE"] == "thread" and not unset
    # everything distributed-ucxx copies into os.environ must be text
    assert all(isinstance(v, str) for v in st.get_path(t, "distributed-ucxx.environment").values())
    # every key is one dask / distributed / distributed-ucxx know (check_tree raised otherwise)
    assert {k.split(".")[0] for k, _ in st.leaves(t)} <= {"array", "distributed", "distributed-ucxx", "ucx-dask-gpu"}


def test_cpu_mode_ignores_gpu_only_cluster_keys():
    cluster, ignored = st.cluster_settings(st.load_config("tuned").tree, cpu=True)
    assert cluster["rmm-pool-size"] is None
    assert "ucx-dask-gpu.cluster.rmm-pool-size" in ignored


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
