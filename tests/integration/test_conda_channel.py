"""`ucx-dask-gpu conda channel`: the v1 recipes rendered and checked by rattler-build, ucx (a real UCX build of its
recipe's build.sh) and the metapackage built by rattler-build on their stand-in recipes, a py-rattler-indexed channel,
a py-rattler solve + install of ucx into a fresh prefix, and the recipes' tests run by rattler-build.

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

import conda_package_handling.api as cph
import pytest
import yaml
from rattler import MatchSpec

from ucx_dask_gpu.conda import settings
from ucx_dask_gpu.ucxbuild.fetch import local_dirs
from ucx_dask_gpu.errors import BUILD_FAILED, PACKAGE_INVALID, RECIPE_INVALID
from ucx_dask_gpu.stack import load

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "ucx_dask_gpu"]


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _scratch_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("stack.toml", "pyproject.toml", "conda-forge.yml"):
        shutil.copy2(REPO / name, repo / name)
    for name in ("locks", "recipes", "ucx-src-build"):
        shutil.copytree(REPO / name, repo / name)
    return repo


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Run the whole chain once (check -> build -> index -> install + tests)."""
    tmp = tmp_path_factory.mktemp("conda")
    channel = tmp / "channel"
    proc = subprocess.run([*CLI, "conda", "channel", "--out", str(channel), "--work", str(tmp / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=3000)
    sys.stdout.write(proc.stdout[-6000:])
    sys.stderr.write(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    return {"channel": channel, "tmp": tmp, "stdout": proc.stdout}


def _records(channel: Path, subdir: str) -> dict:
    return json.loads((channel / subdir / "repodata.json").read_text())["packages.conda"]


def test_channel_layout(built):
    channel = built["channel"]
    assert sorted(p.name for p in channel.iterdir()) == ["linux-64", "noarch"]
    assert [r["name"] for r in _records(channel, "linux-64").values()] == ["ucx"]
    assert [r["name"] for r in _records(channel, "noarch").values()] == ["ucx-dask-gpu"]
    assert not list(channel.parent.glob(".channel.*")), "staging directory left behind"
    assert "rendered + checked, not built here:" in built["stdout"] and "linux-aarch64/ucx-" in built["stdout"]
    assert "linux-64/libucxx-" in built["stdout"] and "noarch/distributed-ucxx-" in built["stdout"]


def test_ucx_package_metadata(built):
    st = load(REPO / "stack.toml")
    s = settings.settings(st)
    (fn, rec), = _records(built["channel"], "linux-64").items()
    assert (rec["name"], rec["version"]) == ("ucx", s.ucx.version)
    assert rec["build"].startswith(f"cuda{st.cuda_major}_h") and rec["subdir"] == "linux-64"
    assert rec["constrains"] == [f"cuda-version >={st.cuda_major},<{st.cuda_major + 1}.0a0"]
    assert rec["depends"] == [f"__glibc >={s.c_stdlib_version}"]  # no cuda-cudart: ignored run export
    assert rec["license"] == "BSD-3-Clause"


def test_ucx_package_contents(built, tmp_path):
    st = load(REPO / "stack.toml")
    s = settings.settings(st)
    (fn, _), = _records(built["channel"], "linux-64").items()
    cph.extract(str(built["channel"] / "linux-64" / fn), dest_dir=str(tmp_path))
    info = tmp_path / "info"
    files = {p["_path"] for p in json.loads((info / "paths.json").read_text())["paths"]}
    for module in st.required_modules:
        assert f"lib/ucx/{module}" in files
    assert {"bin/ucx_info", "bin/ucx_perftest", "lib/libucp.so"} <= files
    assert not [f for f in files if f.endswith((".a", ".la"))]
    major, minor = s.ucx.version.split(".")[:2]
    assert json.loads((info / "run_exports.json").read_text()) == \
        {"weak": [f"ucx >={s.ucx.version},<{major}.{int(minor) + 1}.0a0"]}
    paths = json.loads((info / "paths.json").read_text())["paths"]
    assert any(p.get("file_mode") == "binary" for p in paths), "UCX compiles its prefix into its libraries"
    rendered = yaml.safe_load((info / "recipe/rendered_recipe.yaml").read_text())
    assert rendered["recipe"]["source"][0]["sha256"] == s.ucx.sha256
    assert (info / "licenses/LICENSE").is_file()
    tests = yaml.safe_load((info / "tests/tests.yaml").read_text())
    assert any("ucx_info -v" in " ".join(t.get("script", [])) for t in tests)
    standin = json.loads((info / "about.json").read_text())["extra"]["standin"]
    assert standin["sonames_left_to_the_system"]["libibverbs.so.1"] == "rdma-core"
    assert "cuda-cudart-dev" in standin["requirements_not_installed"]["host"]


def test_metapackage(built, tmp_path):
    st = load(REPO / "stack.toml")
    (fn, rec), = _records(built["channel"], "noarch").items()
    assert rec["name"] == st.name and rec["version"] == st.version and rec["noarch"] == "python"
    specs = [MatchSpec(d) for d in rec["depends"]]
    assert {s.name.normalized for s in specs} >= {"python", "ucx", "ucxx", "distributed-ucxx", "dask-cuda", "dask",
                                                  "distributed", "cupy", "nvidia-ml-py"}
    cph.extract(str(built["channel"] / "noarch" / fn), dest_dir=str(tmp_path))
    assert json.loads((tmp_path / "info/link.json").read_text())["noarch"]["entry_points"] == \
        ["ucx-dask-gpu = ucx_dask_gpu.cli:main"]
    assert (tmp_path / "site-packages/ucx_dask_gpu/cli.py").is_file()
    assert (tmp_path / "site-packages/ucx_dask_gpu/_data/stack.toml").read_bytes() == (REPO / "stack.toml").read_bytes()
    assert not list(tmp_path.rglob("__pycache__")) and not (tmp_path / "bin").exists()


def test_install_from_the_channel_and_recipe_tests(built, tmp_path):
    st = load(REPO / "stack.toml")
    proc = subprocess.run([*CLI, "conda", "test-install", "--channel", str(built["channel"]),
                           "--work", str(tmp_path), "--json", str(tmp_path / "res.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    (ucx_fn,) = [fn for fn in res["packages"] if fn.startswith("ucx-") and not fn.startswith("ucx-dask-gpu")]
    ucx = res["packages"][ucx_fn]
    assert ucx["recipe_tests"] == ["test 0: passed"] and ucx["elf_files_checked"] > 5
    prefix = Path(ucx["prefix"])
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}  # no LD_LIBRARY_PATH: RUNPATH only
    out = subprocess.run([prefix / "bin/ucx_info", "-v"], capture_output=True, text=True, env=env).stdout
    assert f"Library version: {settings.settings(st).ucx.version}" in out and "placehold" not in out
    devices = subprocess.run([prefix / "bin/ucx_info", "-d"], capture_output=True, text=True, env=env).stdout
    assert "Transport: self" in devices and "Transport: posix" in devices
    (meta_fn,) = [fn for fn in res["packages"] if fn.startswith("ucx-dask-gpu-")]
    assert res["packages"][meta_fn]["ucx_spec_matches"] == [ucx_fn]


def test_drift_writes_no_channel(tmp_path):
    repo = _scratch_repo(tmp_path)
    text = (repo / "stack.toml").read_text()
    (repo / "stack.toml").write_text(text.replace('"--enable-mt", ', '"--enable-mt", "--enable-debug", ', 1))
    out = tmp_path / "channel"
    proc = subprocess.run([*CLI, "conda", "--stack", str(repo / "stack.toml"), "--recipes", str(repo / "recipes"),
                           "channel", "--out", str(out), "--work", str(tmp_path / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == RECIPE_INVALID
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "recipes/ucx/build.sh is out of date" in \
        proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_broken_build_script_keeps_the_existing_channel(built, tmp_path):
    repo = _scratch_repo(tmp_path)
    build_sh = repo / "recipes/ucx/build.sh"
    build_sh.write_text(build_sh.read_text().replace("./autogen.sh", 'echo "autogen: broken on purpose" >&2; exit 2'))
    before = _tree_digest(built["channel"])
    mirror = local_dirs(load(REPO / "stack.toml"))[0]  # the scratch repo has no mirror beside it
    proc = subprocess.run([*CLI, "conda", "--stack", str(repo / "stack.toml"), "--recipes", str(repo / "recipes"),
                           "channel", "--out", str(built["channel"]), "--work", str(tmp_path / "work"),
                           "--sources", str(mirror)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == BUILD_FAILED, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith("ucx-dask-gpu conda: error: ucx-") and "rattler-build" in last[0]
    assert _tree_digest(built["channel"]) == before
    assert not list(built["channel"].parent.glob(".channel.*"))


def test_a_library_the_recipe_does_not_declare_is_refused(built, tmp_path):
    """Without rdma-core in host, the real UCX build's libibverbs is overlinking: rattler-build refuses the package."""
    repo = _scratch_repo(tmp_path)
    recipe = repo / "recipes/ucx/recipe.yaml"
    recipe.write_text(recipe.read_text().replace("    - rdma-core\n", "", 1))
    before = _tree_digest(built["channel"])
    mirror = local_dirs(load(REPO / "stack.toml"))[0]
    proc = subprocess.run([*CLI, "conda", "--stack", str(repo / "stack.toml"), "--recipes", str(repo / "recipes"),
                           "channel", "--out", str(built["channel"]), "--work", str(tmp_path / "work"),
                           "--sources", str(mirror)], cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == PACKAGE_INVALID, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert "Overlinking against: lib" in line and ("libibverbs" in line or "libmlx5" in line or "librdmacm" in line
                                                   or "libefa" in line)
    assert _tree_digest(built["channel"]) == before
