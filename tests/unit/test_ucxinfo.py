"""Parsing `ucx_info -v` / `-d` on output recorded from real UCX builds (tests/fixtures/ucx_info/README.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ucx_dask_gpu.ucx import info as ucxinfo
from ucx_dask_gpu.errors import UCX_NOT_FOUND, UserError

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "ucx_info"


def fixture(name: str) -> str:
    return (FIX / name).read_text()


def test_version_1_13_format():
    v = ucxinfo.parse_version(fixture("ucx-1.13.1-source-cpu-v.txt"))
    assert v.version == "1.13.1"
    assert v.library_path is None  # 1.13 does not print it
    assert v.revision is None  # empty revision in a Debian source build: not the next line's '#'
    assert {"--with-verbs", "--with-rdmacm"} <= set(v.configure_args) and "--without-verbs" not in v.configure_args
    assert [a for a in v.configure_args if a.startswith("--with-cuda=")][0].endswith("/nvidia/cu13")
    assert v.configure_line.startswith("--disable-logging")


def test_version_1_21_format():
    v = ucxinfo.parse_version(fixture("ucx-1.21.0-wheel-cpu-v.txt"))
    assert v.version == "1.21.0"
    assert v.library_path.endswith("libucx/lib/libucs.so.0")
    assert v.revision == "b6a9d47"
    # The pip UCX is built without InfiniBand: the reason this repository builds its own.
    assert "--without-verbs" in v.configure_args and "--with-verbs" not in v.configure_args


def test_version_rejects_other_text():
    with pytest.raises(ValueError):
        ucxinfo.parse_version("# Memory domain: self\n")


@pytest.mark.parametrize("name", ["ucx-1.13.1-source-cpu-d.txt", "ucx-1.21.0-wheel-cpu-d.txt"])
def test_devices_host_transports(name):
    d = ucxinfo.parse_devices(fixture(name))
    for tl in ("self", "tcp", "sysv", "posix", "cma"):
        assert tl in d.transports
    assert d.transports == sorted(d.transports)
    assert "lo" in d.devices("tcp")
    assert d.connection_managers == ["tcp"]
    r = next(r for r in d.resources if r.transport == "posix")
    assert (r.device, r.memory_domain, r.type) == ("memory", "posix", "intra-node")


def test_devices_count_matches_transport_lines():
    text = fixture("ucx-1.13.1-source-cpu-d.txt")
    assert len(ucxinfo.parse_devices(text).resources) == text.count("Transport:")


def test_devices_handles_gpu_and_ib_blocks():
    """Structure of GPU/IB entries (same line format as host ones; a CPU box cannot record them)."""
    text = "\n".join([
        "# Memory domain: cuda_cpy", "#     Component: cuda_cpy",
        "#      Transport: cuda_copy", "#         Device: cuda", "#           Type: accelerator",
        "# Memory domain: mlx5_0", "#     Component: ib",
        "#      Transport: rc_mlx5", "#         Device: mlx5_0:1", "#           Type: network",
        "#      Transport: ud_verbs", "#         Device: mlx5_0:1",
    ])
    d = ucxinfo.parse_devices(text)
    assert d.transports == ["cuda_copy", "rc_mlx5", "ud_verbs"]
    assert d.devices("rc_mlx5") == ["mlx5_0:1"]
    assert [r.memory_domain for r in d.resources] == ["cuda_cpy", "mlx5_0", "mlx5_0"]
    assert d.resources[2].type is None


def test_find_ucx_info_in_a_prefix_that_is_not_one(tmp_path):
    with pytest.raises(UserError) as e:
        ucxinfo.find_ucx_info(tmp_path)
    assert e.value.exit_code == UCX_NOT_FOUND and str(tmp_path) in str(e.value)
