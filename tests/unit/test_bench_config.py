"""Benchmark variants: `[PROTOCOLS@]LABEL:CONFIG[:KEY=VALUE;...]` parsed, checked against dask's own keys, merged
with dask.config; which variants share a running cluster; the shipped and tuned files."""
import json
import re
from pathlib import Path

import dask.config
import pytest
import yaml

from ucx_dask_gpu.bench import config
from ucx_dask_gpu.errors import BENCH_CONFIG, USAGE, UserError
from ucx_dask_gpu.proof.transpose import SPLIT_EVERY

# the 2xH200 session that chose tuned-gpu.yaml (committed results, read-only)
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200x2-2026-11-30"


def one(text, cpu=False, protocols=("ucx",)):
    (v,) = config.parse_variant(text, list(protocols), cpu)
    return v


def code_of(fn, *args):
    with pytest.raises(UserError) as e:
        fn(*args)
    assert "\n" not in str(e.value)
    return e.value.exit_code


def test_forms_and_names():
    a, b = config.parse_variant("ucx,tcp@base:none", ["ucx"], False)
    assert (a.name, b.name, a.config, a.settings, a.tree) == ("ucx/base", "tcp/base", "none", (), {})
    v = one("pool:none:ucx-dask-gpu.cluster.rmm-pool-size=8GiB;distributed.scheduler.worker-saturation=inf")
    assert v.protocol == "ucx" and dict(v.settings) == {"ucx-dask-gpu.cluster.rmm-pool-size": "8GiB",
                                                        "distributed.scheduler.worker-saturation": "inf"}
    assert v.tree == {"ucx-dask-gpu": {"cluster": {"rmm-pool-size": "8GiB"}},
                      "distributed": {"scheduler": {"worker-saturation": "inf"}}}
    # values as dask reads DASK_* variables; distributed-ucxx's environment entries stay text
    v = one("x:none:distributed-ucxx.multi-buffer=true;split_every=8;distributed-ucxx.environment.max-rndv-rails=2")
    assert dict(v.settings) == {"distributed-ucxx.multi-buffer": True, "split_every": 8,
                                "distributed-ucxx.environment.max-rndv-rails": "2"}
    # a value may hold ':' (only the first two separate label, config and settings)
    assert dict(one("x:none:UCX_NET_DEVICES=mlx5_0:1").env) == {"UCX_NET_DEVICES": "mlx5_0:1"}


def test_environment_set_and_unset():
    v = one("e:tuned:UCXPY_ENABLE_PYTHON_FUTURE=1;UCX_RNDV_THRESH=8192")
    # tuned-gpu.yaml's own pre-spawn-environ entry comes along: every process gets the same environment
    assert dict(v.env) == {"UCXPY_PROGRESS_MODE": "blocking", "UCXPY_ENABLE_PYTHON_FUTURE": "1",
                           "UCX_RNDV_THRESH": "8192"}
    assert v.tree["distributed"]["nanny"]["pre-spawn-environ"] == dict(v.env)
    u = one("u:tuned:UCXPY_PROGRESS_MODE=")
    assert u.unset == ("UCXPY_PROGRESS_MODE",) and dict(u.env) == {}
    env = config.child_env({"PATH": "/bin", "DASK_X": "1", "UCXPY_PROGRESS_MODE": "thread"}, Path("/c"), Path("/r"),
                           u.env, u.unset)
    assert env["DASK_CONFIG"] == "/c" and env["DASK_ROOT_CONFIG"] == "/r" and "DASK_X" not in env
    assert "UCXPY_PROGRESS_MODE" not in env and env["PATH"] == "/bin"


@pytest.mark.parametrize("text, code", [
    ("nolabel", USAGE), (":none", USAGE), ("x:", USAGE), ("udp@x:none", USAGE), ("ucx,ucx@x:none", USAGE),
    ("bad label:none", USAGE), ("x:none:no-equals", USAGE), ("x:none:A=1;A=2", USAGE),
    ("x:none:distributed.scheduler.bandwidht=1GB", BENCH_CONFIG), ("x:none:nosuchnamespace.key=1", BENCH_CONFIG),
    ("x:none:ucx-dask-gpu.cluster.threads=2", BENCH_CONFIG),
    ("x:none:ucx-dask-gpu.cluster.threads-per-worker=0", BENCH_CONFIG),
    ("x:none:ucx-dask-gpu.cluster.rmm-async=maybe", BENCH_CONFIG),
    ("x:none:ucx-dask-gpu.cluster.rmm-pool-size=lots", BENCH_CONFIG),
    ("x:none:ucx-dask-gpu.cluster.rmm-allocator-external-lib-list=numba", BENCH_CONFIG),
    ("x:none:distributed-ucxx.environment=x", BENCH_CONFIG), ("x:none:Mixed.Case=1", BENCH_CONFIG),
    ("x:/nonexistent/c.yaml", BENCH_CONFIG),
])
def test_bad_variants(text, code):
    assert code_of(config.parse_variant, text, ["ucx"], False) == code


def test_same_name_twice_and_lookup():
    vs = config.parse_variants(["ucx,tcp@a:none", "ucx@b:none"], ["ucx"], False)
    assert config.find_variant(vs, "b", "--baseline").name == "ucx/b"
    assert config.find_variant(vs, "tcp/a", "--baseline").name == "tcp/a"
    assert code_of(config.find_variant, vs, "a", "--baseline") == USAGE  # two protocols have it
    assert code_of(config.parse_variants, ["ucx@a:none", "ucx@a:shipped"], ["ucx"], False) == USAGE


def test_client_side_keys_share_a_cluster_and_the_rest_do_not():
    base, split, sat, tcp, env = (one(t, protocols=("ucx", "tcp")) for t in (
        "ucx@a:tuned", "ucx@b:tuned:split_every=100;array.chunk-size=256MiB", "ucx@c:tuned:distributed.scheduler.worker-saturation=1.1",
        "tcp@a:tuned", "ucx@e:tuned:UCX_RNDV_THRESH=8192"))
    ids = {v.name: v.cluster_id(()) for v in (base, split, sat, tcp, env)}
    assert ids["ucx/a"] == ids["ucx/b"]
    assert len({ids["ucx/a"], ids["ucx/c"], ids["tcp/a"], ids["ucx/e"]}) == 4
    cluster_tree, overlay = split.split(())
    # array.* and split_every go to the client, flattened for dask.config.set
    assert overlay == {"array.chunk-size": "256MiB", "split_every": 100}
    assert "array" not in cluster_tree and "split_every" not in cluster_tree
    assert cluster_tree["distributed"] == base.tree["distributed"]
    # a key declared client-side (--client-key) moves to the client too: those variants share a cluster
    assert sat.cluster_id(("distributed.scheduler.worker-saturation",)) == base.cluster_id(
        ("distributed.scheduler.worker-saturation",))


def test_cpu_mode_makes_ucx_tcp_and_ignores_gpu_only_keys():
    v = one("p:none:ucx-dask-gpu.cluster.rmm-pool-size=0.5", cpu=True)
    assert v.tree["distributed-ucxx"]["tcp"] is True and v.tree["distributed-ucxx"]["create-cuda-context"] is False
    cluster, ignored = config.cluster_settings(v.tree, cpu=True)
    assert cluster["rmm-pool-size"] is None and ignored == ["ucx-dask-gpu.cluster.rmm-pool-size"]
    assert config.cluster_settings(v.tree, cpu=False)[0]["rmm-pool-size"] == 0.5


def test_shipped_is_what_config_install_writes():
    from ucx_dask_gpu.gate import daskconfig

    v = one("s:shipped")
    for text in daskconfig.render("auto").values():
        for top, tree in yaml.safe_load(text).items():
            for key, value in config.flatten(tree, top).items():
                assert dask.config.get(key, config=v.tree) == value
    assert one("s:shipped", cpu=True).tree["distributed-ucxx"]["tcp"] is True


def test_config_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("distributed: [unclosed\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("distributed:\n  scheduler:\n    bandwith: 1GB\n")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n")
    ucx_int = tmp_path / "ucxint.yaml"
    ucx_int.write_text("distributed-ucxx:\n  environment:\n    max-rndv-rails: 1\n")
    for f in (bad, typo, listy, ucx_int):
        assert code_of(config.load_config, str(f), False) == BENCH_CONFIG, f
    ok = tmp_path / "ok.yaml"
    ok.write_text(yaml.safe_dump({"distributed": {"worker": {"memory": {"target": False}}, "comm": {"offload": "10MiB"},
                                                  "nanny": {"pre-spawn-environ": {"ANY_NAME": "1"}}},
                                  "distributed-ucxx": {"multi_buffer": True, "environment": {"rndv-scheme": "x"}},
                                  "ucx-dask-gpu": {"other-tool": {"x": 1}}, "split_every": 8}))
    assert config.load_config(str(ok), False)["split_every"] == 8


def test_tuned_file_keeps_the_measured_combination():
    """tuned-gpu.yaml keeps what the 2xH200 run measured (its base config plus the combined knob, which beat the base)
    except where its lines say why: an RMM pool for the receive buffers (measured since, on one H200), no
    create-cuda-context (every host gets the file; a UCX scheduler without GPU cannot make a CUDA context), no
    array.chunk-size (dropped: the harness has not measured it), no max-rndv-rails (UCXX sets 1 itself), no
    worker-saturation inf (it overproduces root tasks: tests/integration/test_memory_cluster.py) and CuPy on the one
    bounded RMM pool (memory; measured noise on speed)."""
    from ucx_dask_gpu.gate.daskconfig import flatten

    rec = json.loads((RESULTS / "transpose-128MiB-combined-knobs.json").read_text())
    (base,) = [r for r in rec["runs"] if r["kind"] != "knob"]
    (combined,) = [r for r in rec["runs"] if r["kind"] == "knob"]
    assert combined["wall_s_median"] < base["wall_s_median"]  # recorded: 200.5 vs 278.5 ms
    measured = json.loads(json.dumps(rec["config"]["tree"]))
    settings, env, unset = config.parse_settings(combined["knob"], "knob")
    for key, value in settings:
        dask.config.set({key: value}, config=measured)
    for name, value in env:
        dask.config.set({f"{config.PRE_SPAWN}.{name}": value}, config=measured)
    shipped = dict(flatten(config.load_config("tuned", False)))
    changed = {k for k, v in flatten(measured) if shipped.get(k, "absent") != v}
    assert changed == {"ucx-dask-gpu.cluster.rmm-pool-size", "distributed-ucxx.create-cuda-context", "array.chunk-size",
                       "distributed-ucxx.environment.max-rndv-rails", "distributed.scheduler.worker-saturation",
                       "ucx-dask-gpu.cluster.rmm-allocator-external-lib-list"}


def test_the_fastpath_variant_list_parses_whole():
    # tools/gpu-host/fastpath-variants.txt is handed line by line to a run on the GPU host: a line the parser refuses
    # costs that whole run (labels naming a combination carry '+').
    path = Path(__file__).resolve().parents[2] / "tools" / "gpu-host" / "fastpath-variants.txt"
    lines = [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    # The workload's split_every is put in, never restated; only a line that measures another one names a number.
    assert all(ln.startswith("ucx@split-") for ln in lines if re.search(r"split_every=\d", ln))
    # what fastpath_session.sh puts in for $SPLIT_EVERY
    lines = [ln.replace("$SPLIT_EVERY", str(SPLIT_EVERY)) for ln in lines]
    variants = config.parse_variants(lines, ["ucx"], False)
    assert len({v.name for v in variants}) == len(variants) >= len(lines)
    assert any("+" in v.name for v in variants)
