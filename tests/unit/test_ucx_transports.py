"""Which UCX transports a Dask process will use: the settings resolved as distributed-ucxx resolves them (checked
against distributed-ucxx itself), UCX_TLS aliases, the plan from recorded `ucx_info -d` output, the host facts read
from a recorded tree, and the warnings."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask
import pytest

from ucx_dask_gpu.fsutil import mapped_library
from ucx_dask_gpu.ucx import transports as t
from ucx_dask_gpu.ucx.info import parse_devices

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ucx_info"
H200 = parse_devices((FIXTURES / "ucx-1.13.1-source-h200-d.txt").read_text())
CPU = parse_devices((FIXTURES / "ucx-1.13.1-source-cpu-d.txt").read_text())
# `ucx_info -d` lines for one InfiniBand port (format of the recordings above; no IB host was recorded).
IB_TEXT = """#
# Memory domain: mlx5_0
#     Component: ib
#      Transport: rc_mlx5
#         Device: mlx5_0:1
#           Type: network
#      Transport: ud_mlx5
#         Device: mlx5_0:1
#           Type: network
"""
H200_IB = parse_devices((FIXTURES / "ucx-1.13.1-source-h200-d.txt").read_text() + IB_TEXT)
HOST = t.HostFacts(boot_id="b0b0", ipc_ns=t.HOST_IPC_NS, pid_ns=t.HOST_PID_NS, ib_devices=(), uverbs=(), memlock=None)
CONTAINER = t.HostFacts(boot_id="b0b0", ipc_ns=4026532000, pid_ns=4026532001, ib_devices=(), uverbs=(), memlock=None)


def ucxx(config: dict) -> dict:
    return {"distributed-ucxx": config}


@pytest.mark.parametrize("flags", [
    {}, {"tcp": True}, {"nvlink": True}, {"tcp": True, "nvlink": True, "cuda-copy": True},
    {"tcp": True, "infiniband": True, "rdmacm": True}, {"infiniband": True, "nvlink": True},
    {"tcp": False, "nvlink": False, "infiniband": False}, {"cuda-copy": True},
])
def test_flags_become_the_ucx_tls_distributed_ucxx_itself_sets(flags):
    from distributed_ucxx.ucxx import _prepare_ucx_config

    with dask.config.set({f"distributed-ucxx.{k}": v for k, v in flags.items()}):
        options, _ = _prepare_ucx_config()
    assert t.flags_tls(flags) == options.get("TLS")


def test_nothing_set_is_automatic():
    s = t.settings({}, {})
    assert s.automatic and s.tls is None and s.conflicts == ()
    s = t.settings(ucxx({k: None for k in t.FLAGS}), {})
    assert s.automatic and "nothing sets" in s.source


def test_precedence_environment_then_flags_then_environment_config():
    cfg = ucxx({"tcp": True, "nvlink": True, "environment": {"tls": "rc"}})
    assert t.settings(cfg, {"UCX_TLS": "tcp"}).tls == "tcp"
    assert t.settings(cfg, {}).tls == "tcp,cuda_copy,cuda_ipc"
    assert t.settings(ucxx({"environment": {"tls": "rc,tcp"}}), {}).tls == "rc,tcp"
    # the legacy spelling counts too
    assert t.settings({"distributed": {"comm": {"ucx": {"tcp": True}}}}, {}).tls == "tcp"


@pytest.mark.parametrize("config, environ, says", [
    (ucxx({"nvlink": True, "tcp": True}), {"UCX_TLS": "tcp"}, "UCX_TLS=tcp in the environment overrides"),
    (ucxx({"tcp": True, "environment": {"tls": "rc"}}), {}, "environment.tls=rc is ignored"),
    (ucxx({"environment": {"tls": "rc"}}), {"UCX_TLS": "all"}, "overrides distributed-ucxx.environment.tls=rc"),
    (ucxx({"tcp": True, "rdmacm": True}), {}, "rdmacm=True needs distributed-ucxx.infiniband=True"),
    (ucxx({"cuda-copy": True}), {}, "has no effect without tcp, nvlink or infiniband"),
    ({"distributed-ucxx": {"nvlink": True}, "distributed": {"comm": {"ucx": {"nvlink": False}}}}, {},
     "legacy distributed.comm.ucx.nvlink=False disagree"),
])
def test_conflicting_settings_are_named(config, environ, says):
    conflicts = t.settings(config, environ).conflicts
    assert any(says in c for c in conflicts), conflicts
    assert all("\n" not in c for c in conflicts)


def test_consistent_settings_have_no_conflict():
    for config, environ in [({}, {"UCX_TLS": "^cuda_ipc"}), (ucxx({"tcp": True, "nvlink": True}), {}),
                            (ucxx({"tcp": True, "infiniband": True, "rdmacm": True}), {})]:
        assert t.settings(config, environ).conflicts == ()


@pytest.mark.parametrize("tls, transport, on", [
    (None, "cuda_ipc", True), ("all", "rc_mlx5", True), ("tcp,cuda_copy,cuda_ipc", "cuda_ipc", True),
    ("tcp,cuda_copy,cuda_ipc", "posix", False), ("sm", "cma", True), ("shm,tcp", "sysv", True),
    ("rc,tcp", "rc_verbs", True), ("rc,tcp", "ud_mlx5", False), ("ib", "ud_mlx5", True), ("cuda", "cuda_ipc", True),
    ("^cuda_ipc", "cuda_ipc", False), ("^cuda_ipc", "cuda_copy", True), ("^sm", "posix", False),
    ("\\rc", "rc", True), ("ud:aux,rc_x", "rc_mlx5", True),
])
def test_ucx_tls_aliases(tls, transport, on):
    assert t.enabled(transport, tls) is on


def test_automatic_on_a_gpu_host_uses_cuda_ipc_and_shared_memory():
    p = t.plan(t.settings({}, {}), H200, HOST)
    assert p.gpu and p.gpu_peers == ["cuda_ipc"]
    assert p.same_host == ["posix", "sysv", "cma"] and p.other_hosts == ["tcp (eth0, lo)"]
    assert p.warnings == [] and p.off == []


def test_the_old_gpu_file_leaves_out_shared_memory_and_says_what_is_off():
    p = t.plan(t.settings(ucxx({"tcp": True, "nvlink": True, "cuda-copy": True}), {}), H200, HOST)
    assert p.gpu_peers == ["cuda_ipc"] and p.same_host == ["tcp (eth0, lo)"]
    assert p.off == ["cma", "posix", "sysv"]


def test_tcp_only_on_a_gpu_host_warns_that_gpu_buffers_go_nowhere_fast():
    p = t.plan(t.settings({}, {"UCX_TLS": "tcp"}), H200, HOST)
    assert p.gpu_peers == [] and any("leaves out cuda_ipc" in w for w in p.warnings)
    assert any("leaves out cuda_copy" in w and "cannot send GPU buffers" in w for w in p.warnings)
    p = t.plan(t.settings({}, {"UCX_TLS": "^cuda_ipc"}), H200, HOST)
    assert p.gpu_peers == ["cuda_copy + host memory"]


def test_cuda_ipc_from_a_private_namespace_is_a_warning():
    p = t.plan(t.settings({}, {}), H200, CONTAINER)
    [w] = p.warnings
    assert "private IPC and PID namespace" in w and "boot id b0b0" in w and "--ipc/--pid container:NAME" in w
    # no GPU: nothing to warn about
    assert t.plan(t.settings({}, {}), CPU, CONTAINER).warnings == []


def test_infiniband_present_but_not_mapped_and_memlock():
    unmapped = t.HostFacts("b", t.HOST_IPC_NS, t.HOST_PID_NS, ("mlx5_0", "mlx5_1"), (), 64 * 1024)
    p = t.plan(t.settings({}, {}), H200, unmapped)
    assert any("InfiniBand devices mlx5_0, mlx5_1 exist" in w and "--device /dev/infiniband" in w for w in p.warnings)
    assert any("memlock limit 64 KiB" in w and "--ulimit memlock=-1" in w for w in p.warnings)
    mapped = t.HostFacts("b", t.HOST_IPC_NS, t.HOST_PID_NS, ("mlx5_0",), ("uverbs0",), None)
    p = t.plan(t.settings({}, {}), H200_IB, mapped)
    assert p.warnings == [] and p.other_hosts == ["rc_mlx5 (mlx5_0:1)", "ud_mlx5 (mlx5_0:1)", "tcp (eth0, lo)"]
    p = t.plan(t.settings(ucxx({"tcp": True, "nvlink": True}), {}), H200_IB, mapped)
    assert any("leaves out InfiniBand (rc_mlx5, ud_mlx5)" in w for w in p.warnings)


def test_host_facts_from_a_recorded_tree(tmp_path, monkeypatch):
    (tmp_path / "proc/sys/kernel/random").mkdir(parents=True)
    (tmp_path / "proc/sys/kernel/random/boot_id").write_text("1234-abcd\n")
    (tmp_path / "sys/class/infiniband/mlx5_0").mkdir(parents=True)
    (tmp_path / "dev/infiniband").mkdir(parents=True)
    (tmp_path / "dev/infiniband/uverbs0").write_text("")
    monkeypatch.setattr(t.resource, "getrlimit", lambda which: (65536, 65536))
    h = t.host_facts(tmp_path)
    assert h.boot_id == "1234-abcd" and h.ib_devices == ("mlx5_0",) and h.uverbs == ("uverbs0",)
    assert h.memlock == 65536 and h.ipc_ns is None and not h.private_ipc


def test_host_facts_of_this_process():
    h = t.host_facts()
    assert h.boot_id == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert h.ipc_ns == os.stat("/proc/self/ns/ipc").st_ino


def test_same_kernel_workers_in_different_namespaces_cannot_use_cuda_ipc():
    a = t.peer_facts(t.plan(t.settings({}, {}), H200, CONTAINER), CONTAINER)
    assert a["cuda_ipc"] is True
    other_container = dict(a, ipc_ns=4026532100, pid_ns=4026532101)
    shared = dict(a)
    other_host = dict(a, boot_id="c0c0", ipc_ns=4026532100)
    assert t.cuda_ipc_blocked(a, other_container)
    assert not t.cuda_ipc_blocked(a, shared) and not t.cuda_ipc_blocked(a, other_host)
    assert not t.cuda_ipc_blocked(a, dict(other_container, cuda_ipc=False))


def test_summary_is_one_line_naming_each_kind_of_peer():
    p = t.plan(t.settings({}, {}), H200, CONTAINER)
    line = t.summary(p, CONTAINER)
    assert "\n" not in line
    assert line.startswith("transports automatic") and "GPU buffers to this host: cuda_ipc" in line
    assert "other hosts: tcp (eth0, lo)" in line and "IPC private, PID private" in line
    line = t.summary(t.plan(t.settings(ucxx({"tcp": True}), {}), CPU, HOST), HOST)
    assert "UCX_TLS=tcp from dask config distributed-ucxx tcp=True" in line and "no GPU seen by UCX" in line


def test_mapped_library_names_the_file_the_loader_chose():
    """By name prefix, from /proc/PID/maps: this process's libc, a child's, none for a library nobody loaded or for a
    process that is gone; mapped_libucp is that for libucp.so."""
    libc = mapped_library("libc.so")
    assert libc and os.path.basename(libc).startswith("libc.so") and os.path.isfile(libc)
    assert mapped_library("libnothing-like-this.so") is None
    assert t.mapped_libucp(os.getpid()) == mapped_library("libucp.so")
    # -S: no site, so no environment start-up preload of a UCX either
    child = subprocess.Popen([sys.executable, "-S", "-c", "print('up', flush=True); import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"up\n"  # exec'd: its maps are its own, not the forked parent's
        assert mapped_library("libc.so", child.pid) == libc and t.mapped_libucp(child.pid) is None
    finally:
        child.communicate(b"")
    assert mapped_library("libc.so", child.pid) is None
