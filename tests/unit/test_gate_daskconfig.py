"""The shipped dask config: it installs all-or-nothing, every key is one dask/distributed-ucxx/dask-cuda or our start-up
preload really reads, the transports translate to the UCX_TLS we mean (through distributed-ucxx's own translation),
any one setting of the tuned file can be dropped by deleting its line, and a process's config in force is named."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import dask
import dask.config
import pytest

from ucx_dask_gpu.gate import daskconfig
from ucx_dask_gpu.errors import OUTPUT_REFUSED, UserError


_flat = daskconfig.flatten


def load_installed(dest) -> dict:
    """The config dask would read from `dest` alone (its YAML files merged)."""
    return dask.config.collect(paths=[str(dest)], env={})
FILES = sorted([daskconfig.COMMON, daskconfig.INSTALLED_TRANSPORTS, daskconfig.INSTALLED_TUNED])


@pytest.mark.parametrize("kind", ["auto", "cpu", "gpu"])
def test_install_writes_every_file_with_guard_preloads(tmp_path, kind):
    written = daskconfig.install(tmp_path, kind)
    assert sorted(p.name for p in written) == FILES
    cfg = load_installed(tmp_path)
    every = ["ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup", "ucx_dask_gpu.gate.quietclose"]
    for role in ("scheduler", "worker", "nanny"):
        assert cfg["distributed"][role]["preload"] == every
    assert cfg["distributed"]["client"]["preload"] == ["ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup",
                                                       "ucx_dask_gpu.gate.quietclose"]
    assert cfg["distributed-ucxx"].get("nvlink") is {"auto": None, "cpu": None, "gpu": True}[kind]
    # the tuned settings come with every transports kind, and are what the packaged tuned-gpu.yaml says
    assert daskconfig.in_force(cfg, [str(tmp_path)], {}).differ == {}


def test_no_tuned_installs_the_other_two_files(tmp_path, capsys):
    assert sorted(p.name for p in daskconfig.install(tmp_path, "auto", tuned=False)) == sorted(
        [daskconfig.COMMON, daskconfig.INSTALLED_TRANSPORTS])
    config = dask.config.merge(_defaults(), load_installed(tmp_path))  # what a process has in force
    report = daskconfig.in_force(config, [str(tmp_path)], {})
    assert len(report.differ) == report.settings - sum(  # only the tuned settings that are distributed's defaults hold
        1 for k, v in daskconfig.shipped_settings().items() if _default(k) == v)


def test_the_default_is_automatic_and_never_turns_a_transport_off(tmp_path):
    """What the image ships: UCX selects (no flag is set, so distributed-ucxx sets no UCX_TLS), and no file
    switches InfiniBand or anything else off, nor makes a CUDA context (which a host without GPU cannot)."""
    from distributed_ucxx.ucxx import _prepare_ucx_config

    daskconfig.install(tmp_path)
    cfg = load_installed(tmp_path)
    flags = ("tcp", "nvlink", "infiniband", "rdmacm", "cuda-copy", "create-cuda-context")
    assert all(cfg["distributed-ucxx"].get(f) is None for f in flags)
    with dask.config.set(cfg):
        options, env = _prepare_ucx_config()
    assert "TLS" not in options and "UCX_TLS" not in env
    for kind in daskconfig.TRANSPORTS:
        assert "false" not in daskconfig.packaged_text(daskconfig.TRANSPORTS[kind]).split("distributed-ucxx:")[1]


def _defaults() -> dict:
    import distributed  # noqa: F401  (loads distributed's defaults into dask.config)
    from distributed_ucxx.config import _load_default_config

    return dask.config.merge(dask.config.defaults and dask.config.config, _load_default_config())


def _default(key):
    return dask.config.get(key, None, config=_defaults())


def _ours(key: str) -> bool:
    """Keys our start-up preload applies (gate/tuning.py), or LocalCUDACluster arguments (`ucx-dask-gpu bench`)."""
    import inspect

    from dask_cuda import LocalCUDACluster

    from ucx_dask_gpu.gate import tuning

    section, _, name = key.removeprefix("ucx-dask-gpu.").partition(".")
    if section == "batched-send":
        return name in tuning.INTERVALS
    return section == "cluster" and name.replace("-", "_") in inspect.signature(LocalCUDACluster).parameters


def test_every_key_is_known_to_dask_or_distributed_ucxx_or_ours(tmp_path):
    daskconfig.install(tmp_path, "gpu")
    ours = load_installed(tmp_path)
    known = dict(_flat(_defaults()))
    for key, _ in _flat(ours):
        # Free-form mappings (UCX environment, a worker's environment) have no defaults to compare against.
        if key.startswith(("distributed-ucxx.environment.", "distributed.nanny.pre-spawn-environ.")):
            continue
        assert key in known or _ours(key), \
            f"{key} is not a dask/distributed-ucxx setting, nor ours (typo?)"
    assert _ours("ucx-dask-gpu.cluster.rmm-pool-size") and not _ours("ucx-dask-gpu.cluster.rmm-pool")


def test_no_setting_reaches_every_reduction(tmp_path):
    """split_every is read by every dask.array reduction of every client that has the config, tensordot-like ones
    whose partial results are whole blocks too: the transpose workload carries its measured one itself
    (tests/unit/test_proof.py)."""
    daskconfig.install(tmp_path, "gpu")
    assert "split_every" not in load_installed(tmp_path) and "split_every" not in daskconfig.shipped_settings()


def test_any_one_tuned_setting_drops_with_its_line():
    """Deleting one setting's line leaves a config in which every mapping dask/distributed hold is still a mapping
    (a parent left empty would read as null and blank every default below it)."""
    import yaml

    text = daskconfig.packaged_text(daskconfig.TUNED)
    lines = text.splitlines()
    settings = [i for i, ln in enumerate(lines) if ln.strip() and not ln.lstrip().startswith("#")
                and not ln.rstrip().endswith(":")]
    assert len(settings) == len(daskconfig.shipped_settings())  # one line per setting
    defaults = _defaults()
    for i in settings:
        tree = yaml.safe_load("\n".join(lines[:i] + lines[i + 1:])) or {}
        for key, value in _flat(tree):
            if value is None or value == {}:
                assert not isinstance(dask.config.get(key, None, config=defaults), dict), \
                    f"without `{lines[i].strip()}`, {key} is left empty"
        assert len(dict(_flat(tree))) == len(settings) - 1, lines[i]


def test_config_in_force_names_files_and_differences(tmp_path):
    daskconfig.install(tmp_path)
    env = {"DASK_DISTRIBUTED__SCHEDULER__WORK_STEALING": "False"}
    cfg = dask.config.collect(paths=[str(tmp_path)], env=env)
    report = daskconfig.in_force(cfg, [str(tmp_path)], env)
    assert [p for p, _ in report.files] == [str(tmp_path / f) for f in FILES]
    assert report.differ == {"distributed.scheduler.work-stealing": (True, False)}
    line = report.line()
    assert f"{report.settings - 1} of {report.settings} settings in force" in line and "work-stealing=False" in line
    assert str(tmp_path / daskconfig.INSTALLED_TUNED) in line and "1 DASK_* variable" in line
    whole = daskconfig.in_force(dask.config.collect(paths=[str(tmp_path)], env={}), [str(tmp_path)], {}).line()
    assert whole.startswith("dask config tuned-gpu.yaml@") and f"in force ({report.settings} settings)" in whole


@pytest.mark.parametrize("kind,tls", [("auto", None), ("cpu", "tcp"), ("gpu", "tcp,cuda_copy,cuda_ipc")])
def test_transports_become_the_intended_ucx_tls(tmp_path, kind, tls):
    from distributed_ucxx.ucxx import _prepare_ucx_config

    daskconfig.install(tmp_path, kind)
    with dask.config.set(load_installed(tmp_path)):
        options, _ = _prepare_ucx_config()
    assert options.get("TLS") == tls


def test_install_onto_a_file_fails_and_writes_nothing(tmp_path):
    target = tmp_path / "not-a-dir"
    target.write_text("x")
    with pytest.raises(UserError) as err:
        daskconfig.install(target, "cpu")
    assert err.value.exit_code == OUTPUT_REFUSED
    assert target.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["not-a-dir"]


def test_cli_bad_dest_is_one_line_and_its_own_exit_code(tmp_path):
    target = tmp_path / "f"
    target.write_text("")
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "config", "install", "--dest", str(target),
                           "--transports", "cpu"], capture_output=True, text=True)
    assert proc.returncode == OUTPUT_REFUSED
    assert len(proc.stderr.strip().splitlines()) == 1 and str(target) in proc.stderr


def test_unknown_transports_is_a_usage_error():
    with pytest.raises(UserError) as err:
        daskconfig.render("infiniband")
    assert err.value.exit_code == 2


def test_a_nanny_without_worker_preloads_keeps_the_configured_ones():
    """`dask worker` gives its nanny preload=() and the worker then reads distributed.worker.preload; adding a
    module must keep those (else the worker would load that module alone: no transports line, no quiet close)."""
    nanny = SimpleNamespace(preload=(), preload_argv=())
    with dask.config.set({"distributed.worker.preload": ["a.b", "c.d"]}):
        daskconfig.add_worker_preloads(nanny, ["c.d"])
        assert nanny.preload == ["a.b", "c.d"]
        daskconfig.add_worker_preloads(nanny, ["e.f", "a.b"])
    assert nanny.preload == ["a.b", "c.d", "e.f"]


def test_a_launchers_own_list_gets_the_configured_worker_preloads_added():
    """What `dask cuda worker` passes replaces distributed.worker.preload: the guard adds every configured one back,
    after the launcher's, each with its own (empty) argv."""
    cuda = SimpleNamespace(preload=["dask_cuda.initialize"], preload_argv=[["--create-cuda-context"]])
    with dask.config.set({"distributed.worker.preload": "a.b"}):
        configured = daskconfig.configured_worker_preloads()
    assert configured == ["a.b"]
    daskconfig.add_worker_preloads(cuda, ["g.h", *configured, "g.h"])
    assert cuda.preload == ["dask_cuda.initialize", "g.h", "a.b"]
    assert cuda.preload_argv == [["--create-cuda-context"], [], []]
