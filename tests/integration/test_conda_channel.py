"""`ucx-dask-gpu conda channel`: the real recipes, a real UCX build through recipes/ucx/build.sh (once), real .conda
archives, a py-rattler-indexed channel, and a py-rattler solve + install of `ucx` into a fresh prefix.

What runs here and what needs a machine with conda-forge is listed in README "Conda".
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import BUILD_FAILED, INSTALL_FAILED
from ucx_dask_gpu.stack import load

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ucx_dask_gpu"]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Run the whole chain once (fetch -> render/lint -> build -> pack -> index -> install test)."""
    tmp = tmp_path_factory.mktemp("conda")
    channel = tmp / "channel"
    proc = subprocess.run([*CLI, "conda", "channel", "--out", str(channel), "--work", str(tmp / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    sys.stdout.write(proc.stdout[-6000:])
    sys.stderr.write(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    return {"channel": channel, "tmp": tmp, "stdout": proc.stdout, "ucx_version": load(REPO / "stack.toml").ucx.version}


def _records(channel: Path, subdir: str) -> dict:
    return json.loads((channel / subdir / "repodata.json").read_text())["packages.conda"]


def test_channel_layout(built):
    channel = built["channel"]
    assert sorted(p.name for p in channel.iterdir()) == ["linux-64", "noarch"]
    ucx = _records(channel, "linux-64")
    meta = _records(channel, "noarch")
    assert len(ucx) == 1 and len(meta) == 1
    assert all((channel / "linux-64" / fn).is_file() for fn in ucx)
    assert not list(channel.parent.glob(".channel.*")), "staging directory left behind"


def test_ucx_package_is_named_for_the_ucx_it_contains(built):
    st = load(REPO / "stack.toml")
    (fn, rec), = _records(built["channel"], "linux-64").items()
    assert rec["name"] == "ucx" and rec["version"] == built["ucx_version"]
    assert rec["build"].startswith(f"cuda{st.cuda_major}_udg_h") and rec["subdir"] == "linux-64"
    assert rec["constrains"] == [f"__cuda >={st.cuda_major}"]
    assert [d for d in rec["depends"] if d.startswith("__glibc >=2.")]
    assert rec["license"] == "BSD-3-Clause"


def test_ucx_package_contents(built, tmp_path):
    import conda_package_handling.api as cph

    st = load(REPO / "stack.toml")
    (fn, _), = _records(built["channel"], "linux-64").items()
    cph.extract(str(built["channel"] / "linux-64" / fn), dest_dir=str(tmp_path))
    info = tmp_path / "info"
    files = (info / "files").read_text().split()
    for module in st.required_modules:
        assert f"lib/ucx/{module}" in files
    assert "bin/ucx_info" in files and "bin/ucx_perftest" in files
    assert not [f for f in files if f.endswith((".a", ".la"))]
    v = built["ucx_version"]
    nxt = v.split(".")
    assert json.loads((info / "run_exports.json").read_text()) == \
        {"weak": [f"ucx >={v},<{nxt[0]}.{int(nxt[1]) + 1}.0a0"]}
    paths = json.loads((info / "paths.json").read_text())["paths"]
    modes = {p["_path"]: p.get("file_mode") for p in paths if p.get("prefix_placeholder")}
    assert "binary" in modes.values(), "UCX compiles its prefix into libraries: binary prefix replacement expected"
    assert all(len(p["prefix_placeholder"]) == 255 for p in paths if p.get("prefix_placeholder"))
    src = st.ucx
    rendered = (info / "recipe/meta.yaml").read_text()
    assert f"version: {v}" in rendered and src.sha256 in rendered and src.urls[0] in rendered
    assert (info / "recipe/meta.yaml.template").read_text() == (REPO / "recipes/ucx/meta.yaml").read_text()
    assert (info / "licenses/LICENSE").is_file()
    assert "ucx_info -v" in (info / "test/run_test.sh").read_text()
    about = json.loads((info / "about.json").read_text())
    assert about["extra"]["built_by"]["linked_outside_package"]["libibverbs.so.1"].startswith("rdma-core")
    build_info = json.loads((tmp_path / "share/ucx-dask-gpu/build-info.json").read_text())
    assert build_info["ucx_version"] == v == st.ucx.version
    assert build_info["source"]["content_tree"] == src.content_tree


def test_metapackage(built, tmp_path):
    import conda_package_handling.api as cph
    from rattler import MatchSpec

    st = load(REPO / "stack.toml")
    (fn, rec), = _records(built["channel"], "noarch").items()
    assert rec["name"] == st.name and rec["version"] == st.version and rec["noarch"] == "python"
    specs = [MatchSpec(d) for d in rec["depends"]]
    assert {s.name.normalized for s in specs} >= {"python", "ucx", "ucxx", "distributed-ucxx", "dask-cuda", "dask",
                                                  "distributed", "cupy", "nvidia-ml-py"}
    want = str(MatchSpec(f"ucx {built['ucx_version']} *_udg_*"))
    assert want in [str(s) for s in specs]
    cph.extract(str(built["channel"] / "noarch" / fn), dest_dir=str(tmp_path))
    assert json.loads((tmp_path / "info/link.json").read_text())["noarch"]["entry_points"] == \
        ["ucx-dask-gpu = ucx_dask_gpu.cli:main"]
    assert (tmp_path / "site-packages/ucx_dask_gpu/cli.py").is_file()
    assert (tmp_path / "site-packages/ucx_dask_gpu/_data/stack.toml").read_bytes() == (REPO / "stack.toml").read_bytes()
    assert not list(tmp_path.rglob("__pycache__")) and not (tmp_path / "bin").exists()


def test_install_from_the_channel_into_a_fresh_prefix(built, tmp_path):
    proc = subprocess.run([*CLI, "conda", "test-install", "--channel", str(built["channel"]),
                           "--work", str(tmp_path), "--json", str(tmp_path / "res.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    assert any(v.startswith("__cuda=") for v in res["virtual_packages"])
    (ucx_fn,) = [fn for fn in res["packages"] if fn.startswith("ucx-") and not fn.startswith("ucx-dask-gpu")]
    prefix = Path(res["packages"][ucx_fn]["prefix"])
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}  # no LD_LIBRARY_PATH: RUNPATH only
    out = subprocess.run([prefix / "bin/ucx_info", "-v"], capture_output=True, text=True, env=env).stdout
    assert built["ucx_version"] in out and f"--prefix={prefix}" in out and "_placehold" not in out
    devices = subprocess.run([prefix / "bin/ucx_info", "-d"], capture_output=True, text=True, env=env).stdout
    assert "Transport: self" in devices and "Transport: posix" in devices
    assert res["packages"][ucx_fn]["elf_files_checked"] > 5
    (meta_fn,) = [fn for fn in res["packages"] if fn.startswith("ucx-dask-gpu-")]
    assert res["packages"][meta_fn]["ucx_spec_matches"] == [ucx_fn]


def test_old_driver_is_refused_by_the_solver(built, tmp_path):
    proc = subprocess.run([*CLI, "conda", "test-install", "--channel", str(built["channel"]), "--cuda", "12.4",
                           "--work", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == INSTALL_FAILED
    assert len(proc.stderr.strip().splitlines()) == 1 and "__cuda" in proc.stderr


def test_broken_build_script_keeps_the_existing_channel(built, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("stack.toml", "environment.yml", "pyproject.toml", "conda-forge.yml"):
        shutil.copy2(REPO / name, repo / name)
    shutil.copytree(REPO / "locks", repo / "locks")
    shutil.copytree(REPO / "recipes", repo / "recipes")
    (repo / "recipes/ucx/build.sh").write_text('mkdir -p "$PREFIX/lib" && : > "$PREFIX/lib/libucp.so.0"\n'
                                               'echo "configure: error: broken on purpose" >&2; exit 2\n')
    before = _tree_digest(built["channel"])
    proc = subprocess.run([*CLI, "conda", "--stack", str(repo / "stack.toml"), "channel",
                           "--out", str(built["channel"]), "--sources", str(REPO / ".cache/sources"),
                           "--work", str(tmp_path / "work")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == BUILD_FAILED
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ucx-dask-gpu conda: error: ucx/build.sh failed (exit 2)") and "on purpose" in last
    assert _tree_digest(built["channel"]) == before
    assert not list(built["channel"].parent.glob(".channel.*"))
