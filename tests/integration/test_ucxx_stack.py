"""UCX and UCXX built from source are what Dask runs on here: the wheels `make ucxx` built (env UCXX_WHEELS, default
build/ucxx-wheels) against `make ucx`'s prefix (env UCX_PREFIX), installed in the venv (`make venv`), with no libucx
wheel anywhere; and the carried UCX patch is what lets UCX-over-TCP work on a host whose only interface is loopback
(shown both ways: the patched build connects, the same tree rebuilt without the patch fails with upstream's error).

CI runs `make ucx ucxx venv` before pytest; these tests do not build the wheels (minutes) and fail clearly when they
are missing.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ucx_dask_gpu import stack
from ucx_dask_gpu.fsutil import sha256_file
from ucx_dask_gpu.ucxbuild import ucxx as ucxxbuild
from ucx_dask_gpu.ucxbuild.build import BUILD_INFO

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PREFIX = Path(os.environ.get("UCX_PREFIX", REPO / "build" / "ucx-prefix")).resolve()
WHEELS = Path(os.environ.get("UCXX_WHEELS", REPO / "build" / "ucxx-wheels")).resolve()
UCX_WORK = REPO / "build" / "ucx-work"  # `make ucx`'s work dir: the configured, patched source tree
PATCH = REPO / "ucx-src-build" / "patches" / "1.20.1" / "0001-uct-tcp-loopback-reachability.patch"


@pytest.fixture(scope="module")
def st() -> stack.Stack:
    return stack.load(REPO / "stack.toml")


@pytest.fixture(scope="module")
def info() -> dict:
    path = WHEELS / ucxxbuild.UCXX_BUILD_INFO
    if not path.is_file():
        pytest.fail(f"no UCXX wheels at {WHEELS} (missing {path.name}): run `make ucxx` first, or set UCXX_WHEELS")
    return json.loads(path.read_text())


def _python(code: str, env: dict | None = None, timeout: int = 300, wrap: list[str] = ()) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") and k != "LD_LIBRARY_PATH"}
    e.update(env or {})
    return subprocess.run([*wrap, sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=e)


def _netns_prefix() -> list[str]:
    """A fresh network namespace with only loopback, brought up (a host whose only interface is loopback)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to make a loopback-only network namespace")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here ({probe.stderr.strip()}): needs root")
    return ["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" "$@"']


# --- what was built -----------------------------------------------------------------------------------------------

def test_build_info_records_sources_options_and_isolation(info, st):
    assert info["ucxx_version"] == st.ucxx.source.version
    for name, src in (("UCXX", st.ucxx.source), ("rapids-cmake", st.ucxx.rapids_cmake), ("CPM.cmake", st.ucxx.cpm)):
        rec = info["sources"][name]
        assert (rec["tag"], rec["commit"], rec["content_tree"]) == (src.tag, src.commit, src.content_tree)
    assert "-DFETCHCONTENT_FULLY_DISCONNECTED=ON" in info["cmake_args"]
    assert not any(str(REPO) in a for a in info["cmake_args"]), "paths of this machine are recorded as placeholders"
    assert info["network_isolation"] in ("unshare --net", "unshare --net --map-root-user", "only loopback")
    assert info["matrix_entry"] == st.ucxx.matrix_entry
    ucx = json.loads((PREFIX / BUILD_INFO).read_text())
    assert info["ucx"] == ucxxbuild.ucx_identity(ucx), "built against the UCX `make ucx` made"
    assert [p["package"] for p in info["packages"]] == [p.name for p in st.ucxx.packages]
    assert info["patches"] == [{"name": f"{p.parent.name}/{p.name}", "sha256": sha256_file(p)}
                               for p in ucxxbuild.ucxx_patches(st)], "the carried UCXX patches, in order"


def test_wheels_are_named_for_cuda_and_need_no_libucx(info, st):
    for p in info["packages"]:
        assert p["name"] == f"{p['package']}-cu{st.cuda_major}"
        names = {Requirement(r).name for r in p["requires"]}
        assert not names & {"libucx", "libucx-cu12", "libucx-cu13"}, p["requires"]
        assert ucxxbuild.wheel_metadata(WHEELS / p["wheel"])["requires"] == p["requires"]
    libucxx = next(p for p in info["packages"] if p["package"] == "libucxx")
    assert "libucxx/lib64/libucxx.so" in libucxx["shared_libraries"]


def test_the_venv_holds_our_wheels_and_no_libucx_wheel(info):
    for p in info["packages"]:
        assert metadata.version(p["name"]) == p["version"]
    for name in ("libucx-cu13", "libucx-cu12", "libucx"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.distribution(name)


# --- what runs ----------------------------------------------------------------------------------------------------

def test_ucxx_imports_on_our_ucx(st):
    r = _python("""
        import ucxx
        print(".".join(map(str, ucxx.get_ucx_version())))
        print(next(l.split()[-1] for l in open("/proc/self/maps") if "libucp.so" in l))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    version, libucp = r.stdout.split()
    assert version == st.ucx.version
    assert PREFIX in Path(libucp).parents


CLUSTER = """
    import json
    import dask.array as da
    from distributed import Client, LocalCluster

    def maps():
        return next(l.split()[-1] for l in open("/proc/self/maps") if "libucp.so" in l)

    if __name__ == "__main__":
        with LocalCluster(protocol="ucx", n_workers=2, threads_per_worker=1, dashboard_address=None,
                          host="127.0.0.1") as c, Client(c) as client:
            x = da.random.RandomState(0).random((2000, 2000), chunks=500)
            got = float((x + x.T).sum().compute())
            want = float((x.compute() + x.compute().T).sum())
            print(json.dumps({"ok": abs(got - want) < 1e-6 * abs(want), "address": c.scheduler_address,
                              "workers": client.run(maps), "scheduler": client.run_on_scheduler(maps),
                              "client": maps()}))
"""


def _cluster(wrap: list[str] = ()) -> dict:
    r = _python(CLUSTER, wrap=wrap, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dask_over_ucx_runs_every_role_on_our_ucx():
    out = _cluster()
    assert out["ok"] and out["address"].startswith("ucx://")
    libs = [out["client"], out["scheduler"], *out["workers"].values()]
    assert len(out["workers"]) == 2 and all(PREFIX in Path(p).parents for p in libs), libs


def test_dask_over_ucx_on_a_loopback_only_host():
    out = _cluster(wrap=_netns_prefix())
    assert out["ok"] and out["address"].startswith("ucx://127.0.0.1:")


def _perftest_over_loopback(prefix: Path, wrap: list[str]) -> subprocess.CompletedProcess:
    script = f"""
        set -u
        export UCX_TLS=tcp,self UCX_NET_DEVICES=lo
        {prefix}/bin/ucx_perftest -t tag_bw -s 4096 -n 200 -p 23457 >/dev/null 2>&1 &
        server=$!
        sleep 1
        timeout 30 {prefix}/bin/ucx_perftest 127.0.0.1 -t tag_bw -s 4096 -n 200 -p 23457
        rc=$?
        kill $server 2>/dev/null
        exit $rc
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") and k != "LD_LIBRARY_PATH"}
    return subprocess.run([*wrap, "bash", "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.fixture(scope="module")
def unpatched_prefix(tmp_path_factory) -> Path:
    """Our prefix with libuct rebuilt from the same configured tree minus the loopback patch (only the patched file
    recompiles, so this takes seconds)."""
    src = next(UCX_WORK.glob("src/ucx-*"), None)
    if src is None or not (src / "src" / "uct" / "Makefile").is_file():
        pytest.fail(f"no configured UCX tree under {UCX_WORK} (`make ucx` keeps it)")
    tmp = tmp_path_factory.mktemp("unpatched")
    tree = tmp / src.name
    shutil.copytree(src, tree, symlinks=True)
    subprocess.run(["patch", "-R", "-p1", "--batch", "-i", str(PATCH)], cwd=tree, check=True, capture_output=True)
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp)}
    r = subprocess.run(["make", "-C", "src/uct", f"-j{os.cpu_count() or 1}", "libuct.la"], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    prefix = tmp / "prefix"
    shutil.copytree(PREFIX, prefix, symlinks=True)
    lib = prefix / "lib" / Path(os.readlink(prefix / "lib" / "libuct.so.0")).name
    shutil.copyfile(tree / "src" / "uct" / ".libs" / lib.name, lib)
    subprocess.run(["patchelf", "--set-rpath", "$ORIGIN", str(lib)], check=True)
    return prefix


def test_the_loopback_patch_is_what_makes_a_loopback_only_host_work(unpatched_prefix):
    wrap = _netns_prefix()
    ours = _perftest_over_loopback(PREFIX, wrap)
    assert ours.returncode == 0, ours.stdout[-1500:] + ours.stderr[-1500:]
    assert "Final:" in ours.stdout
    without = _perftest_over_loopback(unpatched_prefix, wrap)
    assert without.returncode != 0
    assert "tcp/lo - no route to" in without.stdout + without.stderr  # upstream 1.20.x's own failure


def test_build_steps_cannot_reach_the_network():
    """The namespace the UCXX build steps run in has no route out; the same request outside it would get an answer
    (PyPI is reachable from build machines), so the failure is the namespace's doing."""
    wrap = ucxxbuild.isolation_prefix()
    if not wrap:
        pytest.skip("this machine has only loopback: nothing to isolate from")
    code = """
        import socket
        try:
            socket.create_connection(("pypi.org", 443), timeout=10).close()
            print("reached")
        except OSError as e:
            print(f"refused: {e}")
    """
    inside = _python(code, wrap=wrap)
    assert inside.returncode == 0 and inside.stdout.startswith("refused"), inside.stdout + inside.stderr
    outside = _python(code)
    if not outside.stdout.startswith("reached"):
        pytest.skip(f"pypi.org is not reachable from this machine either ({outside.stdout.strip()})")
