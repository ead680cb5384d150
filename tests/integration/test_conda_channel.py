"""The stand-in channel (`python -m tools.conda_standin channel`, `make channel`): the v1 recipes rendered and checked
by rattler-build, every output -- ucx, libucxx, ucxx, distributed-ucxx, the metapackage -- built by rattler-build on its
stand-in recipe (real UCX and UCXX builds of the recipes' scripts; libucxx and ucxx against the channel's own ucx,
installed by rattler-build), a py-rattler-indexed channel, and the install check: ucx and libucxx each solved and
installed into a fresh prefix and tested by rattler-build, then `ucx-dask-gpu cuda-version=<major>.0` solved and
installed by py-rattler into a prefix where ucx_info is the packaged UCX, ucxx maps the prefix's libucp, and a client
joins a cluster of the image.

What runs here and what needs a machine with conda-forge is listed in docs/conda.md. The packages are kept by input
hash (.cache/conda-builds), so a second run of the chain with the same inputs builds nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import conda_package_handling.api as cph
import pytest
import yaml
from rattler import MatchSpec

from tools.conda_standin import standin
from ucx_dask_gpu.conda import publish, settings
from ucx_dask_gpu.errors import BUILD_FAILED, PACKAGE_INVALID, RECIPE_INVALID, STANDIN_REFUSED, UserError
from ucx_dask_gpu.gate import identity
from ucx_dask_gpu.stack import load
from ucx_dask_gpu.ucxbuild.fetch import CACHE_ENV, default_cache_dir, local_dirs

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
STANDIN = [sys.executable, "-m", "tools.conda_standin"]  # from the repository root (cwd=REPO)
STANDIN_PROG = "python -m tools.conda_standin channel"  # how its one-line errors start


def _tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _scratch_repo(tmp: Path) -> Path:
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("stack.toml", "pyproject.toml", "conda-forge.yml", "LICENSE"):
        shutil.copy2(REPO / name, repo / name)
    for name in ("locks", "recipes", "ucx-src-build", "src"):
        shutil.copytree(REPO / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    return repo


def _channel_in(repo: Path, out: Path, work: Path, timeout: int = 1800) -> subprocess.CompletedProcess:
    """`conda channel` of a scratch copy, with this checkout's source mirror and caches (a package whose inputs did
    not change is taken from the build cache)."""
    st = load(REPO / "stack.toml")
    mirror = local_dirs(st)[0]  # a scratch repo has no mirror beside it
    env = {**os.environ, CACHE_ENV: str(default_cache_dir(st))}
    return subprocess.run([*STANDIN, "--stack", str(repo / "stack.toml"), "channel", "--recipes", str(repo / "recipes"),
                           "--out", str(out), "--work", str(work), "--sources", str(mirror),
                           "--no-install-test"], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Run the whole chain once (check -> build -> index -> install check)."""
    tmp = tmp_path_factory.mktemp("conda")
    channel = tmp / "channel"
    proc = subprocess.run([*STANDIN, "channel", "--out", str(channel), "--work", str(tmp / "work")],
                          cwd=REPO, capture_output=True, text=True, timeout=5400)
    sys.stdout.write(proc.stdout[-8000:])
    sys.stderr.write(proc.stderr[-6000:])
    assert proc.returncode == 0, proc.stderr.strip().splitlines()[-1:]
    return {"channel": channel, "tmp": tmp, "stdout": proc.stdout, "env": tmp / "work" / "install-test" / "env"}


def _records(channel: Path, subdir: str) -> dict:
    return json.loads((channel / subdir / "repodata.json").read_text())["packages.conda"]


def _record(channel: Path, name: str) -> tuple[str, dict]:
    (found,) = [(fn, r) for sub in ("linux-64", "noarch") for fn, r in _records(channel, sub).items()
                if r["name"] == name]
    return found


def _unpacked(channel: Path, name: str, dest: Path) -> Path:
    fn, rec = _record(channel, name)
    cph.extract(str(channel / rec["subdir"] / fn), dest_dir=str(dest))
    return dest


def test_channel_layout(built):
    channel = built["channel"]
    assert sorted(p.name for p in channel.iterdir()) == ["linux-64", "noarch"]
    assert sorted(r["name"] for r in _records(channel, "linux-64").values()) == ["libucxx", "ucx", "ucxx"]
    assert sorted(r["name"] for r in _records(channel, "noarch").values()) == ["distributed-ucxx", "ucx-dask-gpu"]
    assert not list(channel.parent.glob(".channel.*")), "staging directory left behind"
    # Every package says it is a stand-in build, and the publish path refuses the channel.
    builds = [r["build"] for sub in ("linux-64", "noarch") for r in _records(channel, sub).values()]
    assert builds and all(b.endswith("_standin") for b in builds), builds
    with pytest.raises(UserError) as e:
        publish.check([channel])
    assert e.value.exit_code == STANDIN_REFUSED
    out = built["stdout"]
    assert "rendered + checked, not built here:" in out and "linux-aarch64/ucx-" in out
    assert "linux-64/ucxx-0.51.01-cuda12_py311" in out  # the other CUDA version: rendered only


def test_ucx_package_metadata(built):
    st = load(REPO / "stack.toml")
    fn, rec = _record(built["channel"], "ucx")
    assert (rec["name"], rec["version"]) == ("ucx", st.ucx.version)
    assert rec["build"].startswith(f"cuda{st.cuda_major}_h") and rec["subdir"] == "linux-64"
    assert rec["constrains"] == [f"cuda-version >={st.cuda_major},<{st.cuda_major + 1}.0a0",
                                 f"cuda-cudart {st.cuda_major}.*"]
    # This machine's glibc, which the stand-in's compiler linked against (no cuda-cudart: ignored run export).
    assert rec["depends"] == [f"__glibc >={standin.host_glibc()}"]
    assert rec["license"] == "BSD-3-Clause"


def test_ucx_package_contents(built, tmp_path):
    st = load(REPO / "stack.toml")
    info = _unpacked(built["channel"], "ucx", tmp_path) / "info"
    files = {p["_path"] for p in json.loads((info / "paths.json").read_text())["paths"]}
    for module in st.required_modules:
        assert f"lib/ucx/{module}" in files
    assert {"bin/ucx_info", "bin/ucx_perftest", "lib/libucp.so"} <= files
    assert not [f for f in files if f.endswith((".a", ".la"))]
    major, minor = st.ucx.version.split(".")[:2]
    assert json.loads((info / "run_exports.json").read_text()) == \
        {"weak": [f"ucx >={st.ucx.version},<{major}.{int(minor) + 1}.0a0"]}
    paths = json.loads((info / "paths.json").read_text())["paths"]
    assert any(p.get("file_mode") == "binary" for p in paths), "UCX compiles its prefix into its libraries"
    rendered = yaml.safe_load((info / "recipe/rendered_recipe.yaml").read_text())
    # Built from the verified archive of the commit; the recipe a feedstock carries keeps the git source.
    assert rendered["recipe"]["source"][0]["sha256"] == st.ucx.sha256
    original = yaml.safe_load((info / "recipe/original-recipe.yaml").read_text())
    assert original["source"]["git"] == "${{ git_url }}" and original["context"]["git_rev"] == st.ucx.commit
    carried = sorted(p.name for p in settings.carried_patches(st, "ucx"))
    assert [p.split("/")[-1] for p in rendered["recipe"]["source"][0]["patches"]] == carried
    assert (info / "licenses/LICENSE").is_file()
    tests = yaml.safe_load((info / "tests/tests.yaml").read_text())
    assert any("ucx_info -v" in " ".join(t.get("script", [])) for t in tests)
    standin = json.loads((info / "about.json").read_text())["extra"]["standin"]
    assert standin["sonames_left_to_the_system"]["libibverbs.so.1"] == "rdma-core"
    assert "cuda-cudart-dev" in standin["requirements_not_installed"]["host"]
    assert standin["git_sources_taken_from_archives"] == [{"git": st.ucx.git, "rev": st.ucx.commit,
                                                          "taken_from": st.ucx.archive}]


def test_libucxx_is_built_against_the_channels_ucx(built, tmp_path):
    st = load(REPO / "stack.toml")
    fn, rec = _record(built["channel"], "libucxx")
    assert rec["build"].startswith(f"cuda{st.cuda_major}_h")
    depends = [MatchSpec(d) for d in rec["depends"]]
    names = {d.name.normalized for d in depends}
    assert {"ucx", "cuda-version", "__glibc"} <= names and "librmm" not in names  # librmm: headers only
    # ucx's run export, applied by rattler-build because the real ucx package was in the host environment
    assert f"ucx >={st.ucx.version},<{'.'.join(st.ucx.version.split('.')[:1])}." in " ".join(rec["depends"])
    root = _unpacked(built["channel"], "libucxx", tmp_path)
    files = {p["_path"] for p in json.loads((root / "info/paths.json").read_text())["paths"]}
    assert {"lib/libucxx.so", "include/ucxx/api.h", "lib/cmake/ucxx/ucxx-config.cmake"} <= files
    assert "lib/libucxx_python.so" not in files
    needed = subprocess.run(["readelf", "-d", str(root / "lib/libucxx.so")], capture_output=True, text=True).stdout
    assert "libucp.so.0" in needed and "$ORIGIN" in needed
    standin = json.loads((root / "info/about.json").read_text())["extra"]["standin"]
    assert any(h.startswith("librmm ") for h in standin["requirements_not_installed"]["host"])
    assert not any(h.startswith("ucx ") for h in standin["requirements_not_installed"]["host"])  # installed, real
    assert any("UCXX build venv" in note for note in standin["stood_in_by"])


def test_ucxx_is_built_for_the_images_python_against_libucxx(built, tmp_path):
    st = load(REPO / "stack.toml")
    fn, rec = _record(built["channel"], "ucxx")
    py = st.python.version.replace(".", "")
    assert rec["build"].startswith(f"cuda{st.cuda_major}_py{py}h")
    _, lib = _record(built["channel"], "libucxx")
    pins = [MatchSpec(d) for d in rec["depends"] if d.startswith("libucxx ") and lib["build"] in d]
    assert pins and str(pins[0].version) == "==0.51.1"  # pin_subpackage(exact=True): this very libucxx
    assert any(d.startswith(f"python {st.python.version}.*") for d in rec["depends"])
    root = _unpacked(built["channel"], "ucxx", tmp_path)
    files = {p["_path"] for p in json.loads((root / "info/paths.json").read_text())["paths"]}
    site = f"lib/python{st.python.version}/site-packages"
    assert "lib/libucxx_python.so" in files and f"{site}/ucxx/__init__.py" in files
    assert f"{site}/ucxx/_lib/libucxx.abi3.so" in files  # the Cython extension, abi3 as the wheel's
    patched = [p.split("/")[-1] for p in yaml.safe_load((root / "info/recipe/rendered_recipe.yaml").read_text())
               ["recipe"]["source"][0]["patches"]]
    assert patched == sorted(p.name for p in settings.carried_patches(st, "ucxx"))


def test_metapackage(built, tmp_path):
    st = load(REPO / "stack.toml")
    fn, rec = _record(built["channel"], st.name)
    assert rec["version"] == st.version and rec["noarch"] == "python"
    specs = [MatchSpec(d) for d in rec["depends"]]
    assert {s.name.normalized for s in specs} >= {"python", "ucx", "ucxx", "distributed-ucxx", "dask-cuda", "dask",
                                                  "distributed", "cupy", "nvidia-ml-py"}
    root = _unpacked(built["channel"], st.name, tmp_path)
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert json.loads((root / "info/link.json").read_text())["noarch"]["entry_points"] == \
        [f"{k} = {v}" for k, v in scripts.items()]
    assert (root / "site-packages/ucx_dask_gpu/cli.py").is_file()
    assert (root / "site-packages/ucx_dask_gpu/_data/stack.toml").read_bytes() == (REPO / "stack.toml").read_bytes()
    assert not list(root.rglob("__pycache__")) and not (root / "bin").exists()


def test_the_install_line_gives_an_environment_on_the_packaged_ucx(built):
    st = load(REPO / "stack.toml")
    res = json.loads((built["tmp"] / "work" / "install-check.json").read_text())
    for name in ("ucx", "libucxx"):
        (r,) = [r for fn, r in res["packages"].items() if fn.startswith(f"{name}-0") or fn.startswith(f"{name}-1")]
        assert r["recipe_tests"] and r["elf_files_checked"] > 0
    env = res["environment"]
    prefix = Path(env["prefix"])
    assert prefix == built["env"]
    assert env["specs"] == [st.name, f"cuda-version={st.cuda_major}.0"]
    assert set(env["from_channel"]) == {"ucx", "libucxx", "ucxx", "distributed-ucxx", st.name}
    assert env["from_channel"]["ucx"].startswith(f"ucx-{st.ucx.version}-cuda{st.cuda_major}")
    assert {"python", "dask", "distributed", "rmm", "cupy", "cuda-version"} <= set(env["placeholders"])
    assert env["ucx_info"] == f"# Library version: {st.ucx.version}"
    assert env["ucx_info_path"] == str(prefix / "bin/ucx_info")
    assert env["libucp"].startswith(str(prefix.resolve())) and env["ucxx"].startswith(str(prefix))
    # The same environment contract as the venv on our UCXX wheels (and so the image): one stack id.
    assert env["stack_id"] == identity.stack_id()
    out = subprocess.run([prefix / "bin/ucx_info", "-d"], capture_output=True, text=True,  # RUNPATH only
                         env={"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root")}).stdout
    assert "Transport: self" in out and "Transport: tcp" in out
    assert "stood in (conda-forge/rapidsai, not reachable here): " in built["stdout"]


def test_a_second_run_with_the_same_inputs_builds_nothing(built, tmp_path):
    """Every package whose sources are archives is taken from the build cache; the metapackage, whose source is this
    working tree, is built again (seconds)."""
    st = load(REPO / "stack.toml")
    proc = subprocess.run([*STANDIN, "channel", "--out", str(tmp_path / "channel"), "--work",
                           str(tmp_path / "work"), "--no-install-test"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again, first = _tree_digest(tmp_path / "channel"), _tree_digest(built["channel"])
    kept = [k for k in first if k.endswith(".conda") and f"/{st.name}-" not in k]
    assert len(kept) == 4 and all(again[k] == first[k] for k in kept)
    assert [p.name.split("-0")[0] for p in (tmp_path / "work" / "logs").glob("*.log")] == [st.name]


def test_drift_writes_no_channel(tmp_path):
    repo = _scratch_repo(tmp_path)
    text = (repo / "stack.toml").read_text()
    (repo / "stack.toml").write_text(text.replace('"--enable-mt", ', '"--enable-mt", "--enable-debug", ', 1))
    out = tmp_path / "channel"
    proc = _channel_in(repo, out, tmp_path / "work", timeout=600)
    assert proc.returncode == RECIPE_INVALID
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "recipes/ucx/build.sh is out of date" in \
        proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_broken_build_script_keeps_the_existing_channel(built, tmp_path):
    repo = _scratch_repo(tmp_path)
    build_sh = repo / "recipes/ucx/build.sh"
    build_sh.write_text(build_sh.read_text().replace("./autogen.sh", 'echo "autogen: broken on purpose" >&2; exit 2'))
    before = _tree_digest(built["channel"])
    proc = _channel_in(repo, built["channel"], tmp_path / "work", timeout=900)
    assert proc.returncode == BUILD_FAILED, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()
    assert len(last) == 1 and last[0].startswith(f"{STANDIN_PROG}: error: ucx-") and "rattler-build" in last[0]
    assert _tree_digest(built["channel"]) == before
    assert not list(built["channel"].parent.glob(".channel.*"))


def test_a_library_the_recipe_does_not_declare_is_refused(built, tmp_path):
    """libucxx without the C++ compiler: the real build still links libstdc++, which nothing declared provides, and
    rattler-build refuses the package (ucx comes from the build cache: same inputs)."""
    repo = _scratch_repo(tmp_path)
    recipe = repo / "recipes/ucxx/recipe.yaml"
    text = recipe.read_text()
    first = text.index('        - ${{ compiler("cxx") }}\n')  # libucxx's, the first output
    recipe.write_text(text[:first] + text[first:].replace('        - ${{ compiler("cxx") }}\n', "", 1))
    before = _tree_digest(built["channel"])
    proc = _channel_in(repo, built["channel"], tmp_path / "work", timeout=1800)
    assert proc.returncode == PACKAGE_INVALID, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"{STANDIN_PROG}: error: libucxx-") and "Overlinking against: libstdc++" in line
    assert _tree_digest(built["channel"]) == before


# --- a client from the conda environment joins a cluster of the image -------------------------------------------------

@pytest.mark.docker
@pytest.mark.parametrize("protocol", ["ucx", "tcp"])
def test_a_client_from_the_conda_environment_runs_the_transpose_on_the_images_cluster(built, image, protocol):
    from ucx_dask_gpu.image.cluster import Cluster
    from ucx_dask_gpu.image.docker import docker_bin

    prefix = built["env"]
    ours = subprocess.run([str(prefix / "bin/ucx-dask-gpu"), "guard", "id"], capture_output=True, text=True)
    assert ours.stdout.strip() == image["stack_id"], ours.stderr
    cluster = Cluster(image["tag"], protocol=protocol).start()
    try:
        ip = json.loads(subprocess.run([docker_bin(), "inspect", cluster.scheduler_name], capture_output=True,
                                       text=True, check=True).stdout)[0]["NetworkSettings"]["Networks"][
            cluster.network]["IPAddress"]
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHON", "VIRTUAL", "UCX_"))}
        # This host reaches the cluster's internal network only through Docker's bridge, which UCX leaves out of
        # its TCP devices unless told (a client on another host needs nothing of the kind).
        bridge = {"UCX_TCP_BRIDGE_ENABLE": "y"} if protocol == "ucx" else {}
        proc = subprocess.run([str(prefix / "bin/ucx-dask-gpu"), "workload", "transpose", "--scheduler",
                               f"{protocol}://{ip}:8786", "--size", "1000", "--chunk", "500", "--json"],
                              capture_output=True, text=True, timeout=600, cwd=prefix,
                              env={**clean, **bridge, "PATH": f"{prefix}/bin:/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = json.loads(proc.stdout)
        assert r["ok"] and r["protocol"] == protocol and r["workers_start"] == 2
    finally:
        cluster.stop(quiet=True)
