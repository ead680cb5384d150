"""The environment gate's pure parts: where a stack id comes from, the package list, and the refusal message."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

from ucx_dask_gpu.gate import identity


def test_stack_id_env_wins_over_file(tmp_path):
    f = tmp_path / "stack-id"
    f.write_text("fromfile\n")
    assert identity.stack_id({identity.STACK_ID_ENV: "fromenv"}, f) == ("fromenv", f"env {identity.STACK_ID_ENV}")


def test_stack_id_falls_back_to_file_then_none(tmp_path):
    f = tmp_path / "stack-id"
    assert identity.stack_id({}, f) == (None, "none")
    f.write_text("  abc123 \n")
    # An empty variable is "unset", not an id.
    assert identity.stack_id({identity.STACK_ID_ENV: " "}, f) == ("abc123", str(f))


def test_installed_packages_match_importlib_metadata():
    pkgs = identity.installed_packages()
    for name in ("dask", "distributed", "numpy"):
        assert pkgs[name] == importlib.metadata.version(name)
    assert identity.decode_packages(identity.encode_packages(pkgs)) == pkgs


def _ident(sid, pkgs):
    return {"stack-id": sid, "packages-sha256": identity.packages_digest(pkgs),
            "packages": identity.encode_packages(pkgs)}


def test_same_stack_id_is_accepted():
    ours = _ident("aaaa", {"dask": "1"})
    assert identity.check_peer(ours, "worker", "tcp://w:1", _ident("aaaa", {"dask": "2"}), None) is None


def test_different_stack_id_names_both_ids_and_packages():
    ours = _ident("aaaa", {"dask": "2026.7.1", "numpy": "2.4.6", "only-ours": "1.0"})
    theirs = _ident("bbbb", {"dask": "2026.7.1", "numpy": "2.3.0", "only-theirs": "9.9"})
    msg = identity.check_peer(ours, "worker", "tcp://w:1", theirs, None)
    assert "aaaa" in msg and "bbbb" in msg and "tcp://w:1" in msg
    assert "numpy: 2.4.6 vs 2.3.0" in msg
    assert "only-ours: 1.0 vs missing" in msg and "only-theirs: missing vs 9.9" in msg
    assert "dask:" not in msg
    assert "\n" not in msg


def test_peer_without_guard_is_refused_using_distributeds_own_version_report():
    ours = _ident("aaaa", {"dask": "2026.7.1", "numpy": "2.4.6", "pandas": "3.1.0"})
    versions = {"packages": {"python": "3.11.7", "dask": "2026.7.1", "numpy": "1.26.4"}}
    msg = identity.check_peer(ours, "client", "Client-1", None, versions)
    assert "client none" in msg and "ucx_dask_gpu.gate.guard" in msg
    # Only what the peer could report is compared: pandas is not in its report, so it is not listed.
    assert "numpy: 2.4.6 vs 1.26.4" in msg and "pandas" not in msg


def test_long_differences_are_truncated():
    ours = _ident("a", {f"p{i:02d}": "1" for i in range(30)})
    theirs = _ident("b", {f"p{i:02d}": "2" for i in range(30)})
    msg = identity.check_peer(ours, "worker", "w", theirs, None)
    assert f"(+{30 - identity.MAX_LISTED} more)" in msg


def test_guard_show_cli_reports_env_id():
    out = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "guard", "show", "--json"], capture_output=True,
                         text=True, env={"UCX_DASK_GPU_STACK_ID": "cafe01", "PATH": "/usr/bin:/bin"}, check=True)
    info = json.loads(out.stdout)
    assert info["stack_id"] == "cafe01" and info["source"] == f"env {identity.STACK_ID_ENV}"
    assert info["packages"] == len(identity.installed_packages())


def test_preload_names_are_the_modules_dask_loads():
    """The shipped dask config, the refusal message and the entrypoint name the preloads by these strings."""
    from ucx_dask_gpu.gate import daskconfig, guard, quietclose

    assert identity.GUARD == guard.__name__
    assert daskconfig.QUIET_CLOSE == quietclose.__name__
    installed = daskconfig.render("cpu")[daskconfig.COMMON]
    assert installed.count(f"preload: [{identity.GUARD}") == 4  # first on every role
