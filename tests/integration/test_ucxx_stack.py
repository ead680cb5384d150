"""UCX and UCXX built from source are what Dask runs on here: the wheels `make ucxx` built (env UCXX_WHEELS, default
build/ucxx-wheels) against `make ucx`'s prefix (env UCX_PREFIX), installed in the venv (`make venv`), with no libucx
wheel anywhere; and the carried UCX patch is what lets UCX-over-TCP work on a host whose only interface is loopback
(shown both ways: the patched build connects, the same tree rebuilt without the patch fails with upstream's error).

CI runs `make ucx ucxx venv` before pytest; these tests do not build the wheels (minutes) and fail clearly when they
are missing.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ucx_dask_gpu import stack
from ucx_dask_gpu.fsutil import sha256_file
from ucx_dask_gpu.ucxbuild import ucxx as ucxxbuild
from ucx_dask_gpu.ucx.install import UCXX_BUILD_INFO, read_build_info, read_ucxx_build_info
from ucx_dask_gpu.ucxbuild.fetch import default_cache_dir, fetch_source, local_dirs

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
    info = read_ucxx_build_info(WHEELS)
    if info is None:
        pytest.fail(f"no UCXX wheels at {WHEELS} (missing {UCXX_BUILD_INFO}): run `make ucxx` first, or set "
                    "UCXX_WHEELS")
    return info


def _clean_env(extra: dict | None = None) -> dict:
    """This environment without UCX settings or a loader path: the venv's own start-up preload picks our UCX."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("UCX_") and k != "LD_LIBRARY_PATH"}
    e.update(extra or {})
    return e


def _python(code: str, env: dict | None = None, timeout: int = 300, wrap: list[str] = ()) -> subprocess.CompletedProcess:
    e = _clean_env(env)
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
    assert not any(str(REPO) in a for a in info["cmake_args"]), "paths of this machine are recorded as stand-ins"
    assert f"-DCCCL_DIR={st.build_root}/ucxx/venv/" in " ".join(info["cmake_args"])
    assert info["network_isolation"] in ("unshare --net", "unshare --net --map-root-user", "only loopback")
    assert info["matrix_entry"] == st.ucxx.matrix_entry
    ucx = read_build_info(PREFIX)
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


def test_no_wheel_names_the_checkout_or_the_build_directories(info, st):
    """Every member of every wheel, byte for byte: not this checkout (where the work dir and the UCX prefix live in
    `make`'s build), not the UCX prefix, not the build's work directory: the wheels do not depend on where the
    repository was cloned. The build's own search says the same."""
    dirs = {str(REPO), str(PREFIX), str(REPO / "build" / "ucxx-work")}
    found = []
    for p in info["packages"]:
        with zipfile.ZipFile(WHEELS / p["wheel"]) as z:
            found += [(p["wheel"], n, d) for n in z.namelist() for d in dirs if d.encode() in z.read(n)]
    assert found == []
    assert info["build_paths_found"] == {}
    libucxx = zipfile.ZipFile(WHEELS / next(p["wheel"] for p in info["packages"] if p["package"] == "libucxx"))
    assert f"{st.build_root}/ucxx/src/".encode() in libucxx.read("libucxx/lib64/libucxx.so"), \
        "__FILE__ names the stand-in"


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
        from ucx_dask_gpu.fsutil import mapped_library
        print(".".join(map(str, ucxx.get_ucx_version())))
        print(mapped_library("libucp.so"))
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    version, libucp = r.stdout.split()
    assert version == st.ucx.version
    assert PREFIX in Path(libucp).parents


CLUSTER = """
    import json
    import dask.array as da
    from distributed import Client, LocalCluster
    from ucx_dask_gpu.fsutil import mapped_library

    def maps():
        return mapped_library("libucp.so")

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
    env = _clean_env()
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


# --- the carried UCXX patch 0002: an abandoned peer-info exchange ---------------------------------------------------

EXCHANGE_SERVER = """
    import asyncio, ucxx

    async def main():
        async def handler(ep):
            await asyncio.sleep(5)
        listener = ucxx.create_listener(handler, port=0)
        print("PORT", listener.port, flush=True)
        await asyncio.sleep(120)

    asyncio.run(main())
"""

# Connects to a listener that is stopped (SIGSTOP) until the connect timeout has passed, so the exchange of peer info
# is abandoned with its stream receive posted; then fills the freed small blocks with zeroed 16-byte bytearrays and
# lets the listener send its info. A bytearray that changes is freed memory that UCX wrote into.
EXCHANGE_CLIENT = """
    import asyncio, importlib.util, os, signal, struct, sys, time
    import ucxx
    import ucxx._lib_async.application_context as application_context
    from ucxx._lib_async.utils import hash64bits

    upstream = os.environ.get("UPSTREAM_EXCHANGE_PEER_INFO")
    if upstream:  # upstream's module, as released, instead of the one our build installed
        spec = importlib.util.spec_from_file_location("ucxx._lib_async.upstream_exchange_peer_info", upstream)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        application_context.exchange_peer_info = module.exchange_peer_info

    async def main(port, listener_pid):
        try:
            await ucxx.create_endpoint("127.0.0.1", port, connect_timeout=0.5)
            print("CONNECTED")
            return
        except asyncio.TimeoutError:
            pass
        sentinels = [bytearray(16) for _ in range(200000)]
        os.kill(listener_pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for b in sentinels:
            if any(b):
                tag, check = struct.unpack("QQ", bytes(b))
                print("FREED MEMORY WRITTEN:", "the listener's peer info" if hash64bits(tag) == check else b.hex())
        print("CHECKED")

    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


def _abandoned_exchange(env: dict | None = None) -> str:
    e = _clean_env({"UCX_WARN_UNUSED_ENV_VARS": "n", **(env or {})})
    server = subprocess.Popen([sys.executable, "-c", textwrap.dedent(EXCHANGE_SERVER)], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True, env=e)
    try:
        port = None
        for line in server.stdout:  # UCX may print its own lines on stdout first
            if line.startswith("PORT "):
                port = line.split()[1]
                break
        assert port, "the UCXX listener did not start"
        server.send_signal(signal.SIGSTOP)
        client = subprocess.run([sys.executable, "-c", textwrap.dedent(EXCHANGE_CLIENT), port, str(server.pid)],
                                capture_output=True, text=True, timeout=120, env=e)
        assert "CHECKED" in client.stdout, (client.returncode, client.stdout[-2000:], client.stderr[-3000:])
        return client.stdout
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()


@pytest.fixture(scope="module")
def upstream_exchange_peer_info(st, tmp_path_factory) -> Path:
    """UCXX's exchange_peer_info.py as released, from the verified source archive the wheels were built from."""
    fetched = fetch_source(st.ucxx.source, cache=default_cache_dir(st), dirs=local_dirs(st), offline=True)
    member = "python/ucxx/ucxx/_lib_async/exchange_peer_info.py"
    with tarfile.open(fetched.path) as tar:
        name = next(n for n in tar.getnames() if n.split("/", 1)[-1] == member)
        data = tar.extractfile(name).read()
    out = tmp_path_factory.mktemp("upstream") / "exchange_peer_info.py"
    out.write_bytes(data)
    return out


def test_an_abandoned_exchange_leaves_no_write_into_freed_memory(upstream_exchange_peer_info):
    """Upstream's exchange frees the buffer of a stream receive UCX still holds (its peer info lands in freed memory,
    seen in at least one of three tries); with the carried patch nothing freed is written, in three tries."""
    assert (REPO / "ucx-src-build/patches/ucxx-0.51.01"
            / "0002-python-exchange-peer-info-keeps-abandoned-buffers.patch").is_file()
    upstream = [_abandoned_exchange({"UPSTREAM_EXCHANGE_PEER_INFO": str(upstream_exchange_peer_info)})
                for _ in range(3)]
    assert any("FREED MEMORY WRITTEN: the listener's peer info" in out for out in upstream), upstream
    for _ in range(3):
        out = _abandoned_exchange()
        assert "FREED MEMORY WRITTEN" not in out, out


# --- the carried UCXX patch 0009: UCX_MEMTYPE_CACHE=n where UCX reads it, no warning ---------------------------------

UNUSED_WARNING = "unused environment variable"
MEMTYPE_CACHE = """
    def memtype_cache():
        import ctypes, os
        value = ctypes.create_string_buffer(32)
        ctypes.CDLL("libucs.so.0", mode=os.RTLD_NOLOAD).ucs_global_opts_get_value(b"MEMTYPE_CACHE", value, 32)
        return value.value.decode()
"""
# One UCP context and worker: where UCX reports environment variables it did not use.
UCX_WORKER = MEMTYPE_CACHE + """
    import os
    import ucxx
    from ucxx._lib import libucxx
    worker = libucxx.UCXWorker(libucxx.UCXContext())
    print("MEMTYPE_CACHE", memtype_cache(), os.environ.get("UCX_MEMTYPE_CACHE"))
"""
MEMTYPE_CLUSTER = MEMTYPE_CACHE + """
    import json
    from distributed import Client, LocalCluster

    if __name__ == "__main__":
        with LocalCluster(protocol="ucx", n_workers=2, threads_per_worker=1, dashboard_address=None,
                          host="127.0.0.1") as c, Client(c) as client:
            assert client.submit(sum, [1, 2]).result() == 3
            print(json.dumps({"client": memtype_cache(), "scheduler": client.run_on_scheduler(memtype_cache),
                              "workers": client.run(memtype_cache)}))
"""


def _without_preload(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """As in the image: no start-up preload (`python -S`), UCX found by the loader (there /etc/ld.so.conf.d), so
    libucxx is what loads UCX."""
    site = [p for p in sys.path if p.endswith("site-packages")]
    boot = f"import sys; sys.path += {site!r}; exec(compile({textwrap.dedent(code)!r}, '<probe>', 'exec'))"
    return subprocess.run([sys.executable, "-S", "-c", boot], capture_output=True, text=True, timeout=120,
                          env=_clean_env({"LD_LIBRARY_PATH": str(PREFIX / "lib"), **(env or {})}))


def test_a_dask_cluster_over_ucx_prints_no_ucx_warning_and_every_process_has_the_memtype_cache_off():
    """Client, scheduler and two nanny-started workers over UCX (our venv: UCX loaded at start-up, before UCXX)."""
    r = _python(MEMTYPE_CLUSTER, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert UNUSED_WARNING not in r.stdout + r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [out["client"], out["scheduler"], *out["workers"].values()] == ["n"] * 4, out


def test_where_ucxx_loads_ucx_itself_no_warning_either():
    r = _without_preload(UCX_WORKER)
    assert r.returncode == 0, r.stderr[-3000:]
    assert UNUSED_WARNING not in r.stdout + r.stderr, r.stderr[-3000:]
    assert "MEMTYPE_CACHE n n" in r.stdout  # set before UCX loaded: in the environment, for processes it starts too
    user = _without_preload(UCX_WORKER, {"UCX_MEMTYPE_CACHE": "y"})  # a user's own choice stays
    assert user.returncode == 0 and "MEMTYPE_CACHE y y" in user.stdout, user.stderr[-3000:]


def test_upstream_ucxx_sets_the_variable_too_late(st, tmp_path):
    """UCXX's __init__.py as released, in a copy of the installed package: UCX warns and the cache stays on."""
    assert (REPO / "ucx-src-build/patches/ucxx-0.51.01"
            / "0009-python-memtype-cache-set-where-ucx-reads-it.patch").is_file()
    installed = Path(importlib.util.find_spec("ucxx").submodule_search_locations[0])
    shutil.copytree(installed, tmp_path / "ucxx", ignore=shutil.ignore_patterns("__pycache__"))
    fetched = fetch_source(st.ucxx.source, cache=default_cache_dir(st), dirs=local_dirs(st), offline=True)
    with tarfile.open(fetched.path) as tar:
        name = next(n for n in tar.getnames() if n.split("/", 1)[-1] == "python/ucxx/ucxx/__init__.py")
        (tmp_path / "ucxx" / "__init__.py").write_bytes(tar.extractfile(name).read())
    probe = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + textwrap.dedent(UCX_WORKER)
    for how, r in (("UCX loaded at start-up", _python(probe)), ("UCX loaded by libucxx", _without_preload(probe))):
        assert r.returncode == 0, r.stderr[-3000:]
        # UCX logs to stdout
        assert f"{UNUSED_WARNING}: UCX_MEMTYPE_CACHE" in r.stdout and "MEMTYPE_CACHE try n" in r.stdout, \
            (how, r.stdout[-1000:], r.stderr[-2000:])
