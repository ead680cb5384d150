"""The shipped dask config: it installs all-or-nothing, every key is one dask/distributed-ucxx really reads, and the
transports translate to the UCX_TLS we mean (through distributed-ucxx's own translation)."""
from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import dask
import dask.config
import pytest

from ucx_dask_gpu.gate import daskconfig
from ucx_dask_gpu.errors import OUTPUT_REFUSED, UserError


def _flat(d, prefix=""):
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            yield from _flat(v, key)
        else:
            yield key, v


@pytest.mark.parametrize("kind", ["auto", "cpu", "gpu"])
def test_install_writes_both_files_with_guard_preloads(tmp_path, kind):
    written = daskconfig.install(tmp_path, kind)
    assert sorted(p.name for p in written) == sorted([daskconfig.COMMON, daskconfig.INSTALLED_TRANSPORTS])
    cfg = daskconfig.load_installed(tmp_path)
    every = ["ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup", "ucx_dask_gpu.gate.quietclose"]
    for role in ("scheduler", "worker", "nanny"):
        assert cfg["distributed"][role]["preload"] == every
    assert cfg["distributed"]["client"]["preload"] == ["ucx_dask_gpu.gate.guard"]
    assert cfg["distributed-ucxx"].get("nvlink") is {"auto": None, "cpu": None, "gpu": True}[kind]


def test_the_default_is_automatic_and_never_turns_a_transport_off(tmp_path):
    """What the image ships: UCX selects (no flag is set, so distributed-ucxx sets no UCX_TLS), and no file
    switches InfiniBand or anything else off."""
    from distributed_ucxx.ucxx import _prepare_ucx_config

    daskconfig.install(tmp_path)
    cfg = daskconfig.load_installed(tmp_path)
    assert all(v is None for v in cfg["distributed-ucxx"].values())
    with dask.config.set(cfg):
        options, env = _prepare_ucx_config()
    assert "TLS" not in options and "UCX_TLS" not in env
    for kind in daskconfig.TRANSPORTS:
        assert "false" not in daskconfig.packaged_text(daskconfig.TRANSPORTS[kind]).split("distributed-ucxx:")[1]


def test_every_key_is_known_to_dask_or_distributed_ucxx(tmp_path):
    import distributed  # noqa: F401  (loads distributed's defaults into dask.config)
    from distributed_ucxx.config import _load_default_config

    daskconfig.install(tmp_path, "gpu")
    ours = daskconfig.load_installed(tmp_path)
    defaults = dask.config.merge(dask.config.config, _load_default_config())
    known = dict(_flat(defaults))
    for key, _ in _flat(ours):
        # Free-form mappings (UCX environment) have no defaults to compare against.
        if key.startswith("distributed-ucxx.environment."):
            continue
        assert key in known, f"{key} is not a dask/distributed-ucxx setting (typo?)"


@pytest.mark.parametrize("kind,tls", [("auto", None), ("cpu", "tcp"), ("gpu", "tcp,cuda_copy,cuda_ipc")])
def test_transports_become_the_intended_ucx_tls(tmp_path, kind, tls):
    from distributed_ucxx.ucxx import _prepare_ucx_config

    daskconfig.install(tmp_path, kind)
    with dask.config.set(daskconfig.load_installed(tmp_path)):
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
