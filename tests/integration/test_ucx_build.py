"""The UCX prefix that `make ucx` built (env UCX_PREFIX, default build/ucx-prefix): CUDA + verbs + rdmacm modules,
the selected version, host transports, a real two-process ucx_perftest, and the same after copying the prefix.

CI runs `make ucx` before pytest; these tests do not build (that takes minutes) and fail clearly when it is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.ucx import doctor, info as ucxinfo
from ucx_dask_gpu.ucxbuild import relocate, verify
from ucx_dask_gpu.ucx.install import BUILD_INFO, SHARE, read_build_info, read_ucxx_build_info

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(os.environ.get("UCX_PREFIX", REPO / "build" / "ucx-prefix")).resolve()


@pytest.fixture(scope="module")
def prefix() -> Path:
    if not (PREFIX / BUILD_INFO).is_file():
        pytest.fail(f"no UCX build at {PREFIX} (missing {BUILD_INFO}): run `make ucx` first, or set UCX_PREFIX")
    return PREFIX


@pytest.fixture(scope="module")
def info(prefix) -> dict:
    return read_build_info(prefix)


@pytest.fixture(scope="module")
def copied(prefix, tmp_path_factory) -> Path:
    """The prefix copied to an unrelated path (as `docker COPY` or a conda install would)."""
    dest = tmp_path_factory.mktemp("relocated") / "some" / "other" / "ucx"
    shutil.copytree(prefix, dest, symlinks=True)
    return dest


def test_required_modules_built(prefix, st):
    for module in st.required_modules:  # libuct_cuda, libucm_cuda, libuct_ib, libuct_rdmacm
        assert (prefix / "lib" / "ucx" / module).is_file(), module


def test_build_info_records_the_selected_source(info, st):
    src = info["source"]
    assert (src["version"], src["tag"], src["commit"], src["content_tree"]) == \
        (st.ucx.version, st.ucx.tag, st.ucx.commit, st.ucx.content_tree)
    assert src["verified_by"] in ("sha256", "content tree")
    assert info["ucx_version"] == src["version"]
    for flag in st.configure_flags:
        assert flag in info["configure"]["command"].split()
    assert info["capabilities"]["verbs"] and info["capabilities"]["rdmacm"] and info["capabilities"]["cuda"]
    assert {"ib", "rdmacm", "cuda"} <= set(info["configure"]["summary"]["UCT modules"])
    patches = sorted(p.name for p in (REPO / "ucx-src-build" / "patches" / src["version"]).glob("*.patch"))
    assert [p["name"].split("/")[-1] for p in info["patches"]] == patches
    assert info["modules"] == sorted(info["modules"]) and set(st.required_modules) <= set(info["modules"])


def test_build_info_has_no_timestamps_and_lists_files(info, prefix):
    text = json.dumps(info)
    assert not re.search(r"20\d\d-\d\d-\d\dT\d\d:\d\d", text)
    for rel, digest in info["files"].items():
        p = prefix / rel
        assert p.is_symlink() if digest.startswith("-> ") else p.is_file(), rel


def test_no_file_names_the_checkout_or_the_build_directories(prefix, info, st):
    """Every file of the prefix, byte for byte: not this checkout (make's work dir and prefix live in it), not the
    prefix itself: UCX is configured for [image].ucx_prefix and its work directory is a stand-in, so the prefix does
    not depend on where the repository was cloned. The build's own search says the same."""
    dirs = {str(REPO), str(prefix)}
    found = [(str(p.relative_to(prefix)), d) for p in sorted(prefix.rglob("*")) if p.is_file() and not p.is_symlink()
             for d in dirs if d.encode() in p.read_bytes()]
    assert found == []
    assert info["build_paths_found"] == {} and info["build_prefix"] == st.image.ucx_prefix
    assert f"--prefix={st.image.ucx_prefix} " in info["configure"]["command"]
    assert f"-ffile-prefix-map={st.build_root}/ucx={st.build_root}/ucx" in info["configure"]["command"]


def test_ucx_info_reports_the_selected_version(prefix, info):
    v = ucxinfo.version(ucxinfo.find_ucx_info(prefix), env=verify.clean_env())
    assert v.version == info["source"]["version"]
    assert {"--with-verbs", "--with-rdmacm"} <= set(v.configure_args)


def test_no_revision_of_this_repository_leaks_into_ucx(prefix):
    """UCX's autogen asks git for a revision; a work dir inside this checkout must not stamp OUR commit into UCX."""
    v = ucxinfo.version(ucxinfo.find_ucx_info(prefix), env=verify.clean_env())
    if v.revision:
        r = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{v.revision}^{{commit}}"], capture_output=True)
        assert r.returncode != 0, f"UCX reports revision {v.revision}, a commit of this repository"


def test_ucx_info_lists_host_transports(prefix):
    d = ucxinfo.devices(ucxinfo.find_ucx_info(prefix), env=verify.clean_env())
    for tl in ("tcp", "posix", "sysv", "cma"):
        assert tl in d.transports


def test_runpaths_are_relative_and_no_libtool_archives(prefix):
    elves = relocate.elf_files(prefix)
    assert elves["bin"] and elves["lib"] and elves["lib/ucx"]
    for sub, files in elves.items():
        for f in files:
            entries = relocate.runpath_of(f).split(":")
            assert entries[0] == relocate.RPATHS[sub] and all(e.startswith("$ORIGIN") for e in entries), f
    assert not list(prefix.glob("lib/**/*.la"))


def test_host_memory_perftest_between_two_processes(prefix):
    res, out = verify.perftest_loopback(prefix)
    print(f"ucx_perftest tag_bw host loopback: {res.gbps:.2f} GB/s")  # informative; never asserted on speed
    assert res.iterations == verify.LOOPBACK_ITERATIONS
    assert res.bw_overall_mbs > 0


def test_copied_prefix_still_works(copied, info):
    env = verify.clean_env()
    exe = ucxinfo.find_ucx_info(copied)
    assert ucxinfo.version(exe, env=env).version == info["ucx_version"]
    assert "cma" in ucxinfo.devices(exe, env=env).transports
    res, _ = verify.perftest_loopback(copied, env=env)
    assert res.bw_overall_mbs > 0


def test_copied_prefix_loads_only_its_own_libraries_and_modules(copied, prefix):
    """LD_DEBUG shows every library the loader initialises; none may come from the original prefix."""
    env = verify.clean_env({"LD_DEBUG": "libs"})
    r = subprocess.run([copied / "bin" / "ucx_info", "-d"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    inits = re.findall(r"calling init: (\S+)", r.stderr)
    ucx_libs = [Path(p) for p in inits if re.search(r"/lib(ucs|uct|ucp|ucm)[._]", p)]
    assert any(p.parent.name == "ucx" for p in ucx_libs), "modules from lib/ucx were loaded"
    for p in ucx_libs:
        assert copied in p.parents, f"{p} loaded from outside the copy"
        assert prefix not in p.parents


def test_every_ucx_library_resolves_inside_the_copy(copied):
    """ldd on each module: UCX's own libraries (incl. sibling modules, libuct_rdmacm -> libuct_ib) come from the copy.
    (Host libraries such as libcuda.so.1 may be absent on a CPU box; that is doctor's business.)"""
    env = verify.clean_env()
    for so in sorted((copied / "lib" / "ucx").glob("*.so")) + sorted((copied / "bin").iterdir()):
        out = subprocess.run(["ldd", so], env=env, capture_output=True, text=True).stdout
        for line in out.splitlines():
            name = line.split("=>")[0].strip()
            if re.match(r"lib(ucs|uct|ucp|ucm)", name):
                assert "not found" not in line and str(copied) in line, f"{so.name}: {line.strip()}"


def test_pkgconfig_follows_the_copy(copied):
    if shutil.which("pkg-config") is None:
        pytest.skip("pkg-config not installed")
    r = subprocess.run(["pkg-config", "--cflags", "ucx"], capture_output=True, text=True,
                       env={**os.environ, "PKG_CONFIG_PATH": str(copied / "lib" / "pkgconfig")})
    assert r.returncode == 0, r.stderr
    inc = Path(r.stdout.split()[0].removeprefix("-I"))
    assert inc.resolve() == (copied / "include").resolve()


def test_ucx_verify_cli(copied):
    r = subprocess.run([str(REPO / "ucx-src-build" / "build.sh"), "verify", "--prefix", str(copied), "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] and {c["name"] for c in report["checks"]} >= {"modules", "ucx_info -v", "ucx_info -d"}


def test_ucx_verify_fails_on_a_damaged_prefix(copied, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(copied, broken, symlinks=True)
    for so in (broken / "lib" / "ucx").glob("libuct_ib.so*"):
        so.unlink()
    r = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "ucx", "verify", "--prefix", str(broken),
                        "--no-perftest"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.returncode == 1
    assert "FAIL  modules" in r.stdout and "libuct_ib.so" in r.stdout
    assert len(r.stderr.strip().splitlines()) == 1


def _doctor(*args: str, env: dict | None = None) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")}
    e.update(env or {})
    r = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "doctor", "--json", *args], capture_output=True,
                       text=True, timeout=300, env=e)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_doctor_reports_the_ucx_it_loaded(copied, info, st):
    u = _doctor("--ucx-prefix", str(copied))["ucx"]
    assert u["version"] == info["ucx_version"], "ucp_get_version_string() of the library actually loaded"
    assert copied in Path(u["libraries"]["libucp.so"]).parents and not u["mixed_builds"]
    assert u["ours"] and set(st.required_modules) <= set(u["modules"])
    assert {"tcp", "posix", "sysv", "cma"} <= set(u["transports"])
    for module, missing in u["modules_unloadable"].items():  # a CPU box lacks libcuda.so.1; never UCX's own
        assert missing and not [m for m in missing if re.match(r"lib(ucs|uct|ucp|ucm)", m)], (module, missing)


def test_doctor_says_ucxx_runs_on_our_ucx_and_is_our_build(prefix, info):
    """The venv (`make venv`) holds our UCXX wheels and preloads our UCX: doctor proves both from the process."""
    x = _doctor()["ucxx"]
    assert x["runs_on"] == "ours" and prefix in Path(x["loaded"]).parents
    assert x["version"] == info["ucx_version"] and x["libucx_wheel_version"] is None
    assert x["provenance"]["from_source"] and x["provenance"]["checked"] >= 2 and not x["provenance"]["differing"]
    assert x["statement"].startswith(f"UCXX {x['ucxx_version']} (built from source) on our UCX {info['ucx_version']}")


def test_doctor_notices_ucxx_libraries_that_are_not_our_build(tmp_path):
    real = read_ucxx_build_info(Path(sys.prefix) / SHARE)
    pkg = next(p for p in real["packages"] if p["shared_libraries"])
    lib = next(iter(pkg["shared_libraries"]))
    pkg["shared_libraries"][lib] = "0" * 64
    (tmp_path / "ucxx-build-info.json").write_text(json.dumps(real))
    prov = doctor.ucxx_provenance(tmp_path)
    assert not prov["from_source"] and prov["differing"] == [f"{lib} differs from the build"]
