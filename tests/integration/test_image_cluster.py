"""The one image, for real: built with a real Docker engine (--network none), run as scheduler + 2 workers + client on
an internal network, over ucx (UCXX over TCP on CPU hosts), tcp and tls.

Building the image is the expensive part: the session builds it once through scripts/build_image.sh (a warm
Docker cache makes that a no-op), plus one deliberately different image (our own package under another version,
hence another stack id) for the environment gate. A client outside the image is a venv made by pip from the same
lock, wheels and our wheel: accepted, and refused once one pin differs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import BINDING_NOT_LOADABLE, ENV_MISMATCH, NO_SUCH_COMMAND, NOT_A_SCHEDULER, TLS_REFUSED
from ucx_dask_gpu.gate import identity
from ucx_dask_gpu.image import leftovers
from ucx_dask_gpu.image.cluster import Cluster, has_traceback, parse_json_output
from ucx_dask_gpu.image.docker import container_logs, container_state, docker_bin, wait_until
from ucx_dask_gpu.image.paths import base_ref, default_cache, default_ucxx_wheels, work_dir
from ucx_dask_gpu.image.wheelhouse import build_own_wheel, wheelhouse_dir

pytestmark = [pytest.mark.integration, pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]


def own_wheel_as(st, tmp: Path, wheels, local: str) -> Path:
    """Our package built from this checkout, under the version <stack version>+<local> (same code)."""
    built = build_own_wheel(st, tmp / "built")
    return wheels.reversioned(built, f"{st.version}+{local}", tmp / local)


@pytest.fixture(scope="session")
def variant(image, st, tmp_path_factory, build_image, wheels) -> dict:
    """Same Dockerfile, our own package under another version (a patched build): another stack id."""
    own = own_wheel_as(st, tmp_path_factory.mktemp("variant"), wheels, "variant")
    return build_image("--tag", f"{image['tag'].split(':')[0]}:variant", "--own-wheel", str(own))


def stop_clean(cluster: Cluster, allow_tracebacks: tuple[str, ...] = ()) -> dict:
    report = cluster.stop()
    bad = [n for n in report["tracebacks"] if n not in allow_tracebacks]
    assert not bad, "traceback in " + "; ".join(f"{n}:\n{report['logs'][n][-3000:]}" for n in bad)
    # Stopped by SIGTERM within the grace period, not killed after it.
    killed = {n: c for n, c in report["exit_codes"].items() if c == 137 and n not in allow_tracebacks}
    assert not killed, f"containers needed SIGKILL to stop: {killed}"
    return report


# --- the image itself ----------------------------------------------------------------------------------------------

def test_image_labels_and_stack_id(image, st):
    proc = subprocess.run([docker_bin(), "image", "inspect", image["tag"]], capture_output=True, text=True,
                          check=True)
    cfg = json.loads(proc.stdout)[0]["Config"]
    labels = cfg["Labels"]
    assert labels["io.ucx-dask-gpu.stack-id"] == image["stack_id"]
    assert labels["org.opencontainers.image.version"] == st.version
    assert labels["io.ucx-dask-gpu.ucx.version"] == image["ucx_version"]
    assert cfg["User"] == f"{st.image.uid}:{st.image.uid}"
    assert cfg["Entrypoint"][0] == "/usr/bin/tini"
    # The id the image computes is the label (build_image.sh checked it too), and the id this venv computes: the
    # same lock, UCXX wheels and package, the same computation.
    out = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], "ucx-dask-gpu", "guard",
                          "show", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    inside = json.loads(out.stdout)
    assert inside["stack_id"] == image["stack_id"] == identity.stack_id(), (inside["contract"],
                                                                           identity.own_contract())


def test_doctor_in_the_image_says_ucxx_runs_on_our_ucx(image, st):
    out = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], "ucx-dask-gpu", "doctor",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    x = report["ucxx"]
    assert x["runs_on"] == "ours" and x["loaded"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so")
    assert x["provenance"]["from_source"] and x["libucx_wheel_version"] is None
    assert x["statement"].startswith(f"UCXX {x['ucxx_version']} (built from source) on our UCX {st.ucx.version}")
    assert image["ucx_version"] == st.ucx.version and image["ucxx_version"] == st.ucxx.source.version
    assert image["stack_id"] in json.dumps(report)


def test_the_image_can_serialise_cupy_and_rmm_device_buffers(image):
    """distributed registers its CuPy/RMM serialisers only where numba.cuda imports (protocol/cupy.py); without them a
    GPU worker cannot send a CuPy block ("Could not serialize object of type ndarray", seen on an H200). Importing
    needs no GPU."""
    code = ("import distributed.protocol.cupy as c, distributed.protocol.rmm as r; "
            "print(c.cuda_serialize_cupy_ndarray.__name__, r.dask_deserialize_rmm_device_buffer.__name__)")
    out = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], "python", "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["cuda_serialize_cupy_ndarray", "dask_deserialize_rmm_device_buffer"], out.stdout


def test_any_command_runs_and_a_missing_one_is_one_line(image, st):
    """`docker run IMAGE <anything>` runs it, as in docker-library images (its exit code its own), reading the dask
    config roles read; a command the image does not have is one line naming the roles."""
    def run(*argv):
        return subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], *argv],
                              capture_output=True, text=True, timeout=120)

    proc = run("python", "-c", "import sys; print(sys.prefix)")
    assert proc.returncode == 0 and proc.stdout.strip() == st.image.venv, proc.stderr
    code = "import dask.config as c; print(c.get('distributed.scheduler.preload'))"
    proc = run("sh", "-c", f'python -c "{code}"; exit 4')
    assert proc.returncode == 4 and "ucx_dask_gpu.gate.guard" in proc.stdout, proc.stderr  # /etc/dask, as roles read it
    proc = run("schedular", "--port", "8786")
    assert proc.returncode == NO_SUCH_COMMAND
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no command 'schedular' in this image" in lines[0], proc.stderr


def test_runtime_base_from_a_registry_image(engine, image, st):
    """The registry path (`--base-from debian:bookworm-slim@sha256:...`), with our debootstrapped base standing in
    for the registry's Debian image (no registry is reachable here): apt installs stack.toml's packages on top."""
    source = base_ref(st, "runtime")
    proc = subprocess.run([str(ROOT / ".venv/bin/ucx-dask-gpu"), "image", "base", "--kind", "runtime", "--from", source],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tag = proc.stdout.strip().splitlines()[-1]
    assert tag == source + "-from-registry"
    out = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", tag, "sh", "-c",
                          "command -v tini && command -v python3 && ls /var/lib/apt/lists | grep -c Packages || true"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "/usr/bin/tini" in out.stdout and "/usr/bin/python3" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "0"  # no apt lists left in the layer


def test_variant_has_another_stack_id(image, variant):
    assert variant["stack_id"] != image["stack_id"]
    assert variant["ucx_version"] == image["ucx_version"]


def test_the_build_records_its_images_to_remove_them_when_superseded(image, st):
    """Every step's image and the normalised image are recorded for the next build of the tag to prune."""
    rec = leftovers.read_record(work_dir(default_cache(), image["tag"]))
    assert image["tag"] in rec["tags"] and len(rec["images"]) > 10
    assert image["image_id"].split(":")[-1][:12] in rec["images"]


# --- ucx: workloads, versions, the gate ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ucx_cluster(image):
    cluster = Cluster(image["tag"], protocol="ucx").start()
    yield cluster
    cluster.stop(quiet=True)


def test_transpose_over_ucx_gives_the_numpy_answer(ucx_cluster):
    r = ucx_cluster.workload("transpose", "--size", "4000", "--chunk", "1000")
    assert r["protocol"] == "ucx" and r["workers_start"] == 2 and r["blocks"] == 16
    assert r["ok"] and abs(r["value"] - r["expected"]) <= 1e-9 * abs(r["expected"])


def test_every_role_runs_on_the_ucx_built_in_the_image(ucx_cluster, st):
    """Client, scheduler and both workers: libucp mapped from the image's UCX prefix, at stack.toml's version."""
    r = ucx_cluster.workload("transpose", "--size", "1000", "--chunk", "500")
    roles = [r["ucx"]["client"], r["ucx"]["scheduler"], *r["ucx"]["workers"].values()]
    assert len(roles) == 4
    for role in roles:
        assert role["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so"), role
        assert role["ucx_version"] == st.ucx.version, role


VERSIONS_CLIENT = """
import json, sys
from distributed import Client
with Client(sys.argv[1], timeout=60) as c:
    v = c.get_versions(check=False)
    print(json.dumps({"client": v["client"]["packages"], "scheduler": v["scheduler"]["packages"],
                      "workers": [w["packages"] for w in v["workers"].values()],
                      "python": [v["client"]["host"]["python"], v["scheduler"]["host"]["python"]]
                                + [w["host"]["python"] for w in v["workers"].values()]}))
"""


def test_versions_identical_across_roles(ucx_cluster):
    proc = ucx_cluster.run_client(["python", "-", ucx_cluster.address], input=VERSIONS_CLIENT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    v = parse_json_output(proc.stdout)
    assert len(v["workers"]) == 2
    assert all(w == v["client"] for w in v["workers"]) and v["scheduler"] == v["client"]
    assert v["client"]["distributed"] and len(set(v["python"])) == 1


def test_from_map_reads_only_projected_columns_on_workers(ucx_cluster):
    r = ucx_cluster.workload("from-map", "/data/from-map", "--columns", "a,b", "--files", "6")
    assert r["ok"] and r["values_ok"] and r["projection_ok"]
    assert r["columns_read"] == [["a", "b"]] and r["files_read"] == 6
    assert set(r["all_columns"]) > {"a", "b"}  # there were other columns to skip


def test_worker_from_a_different_image_is_refused_in_one_line(ucx_cluster, image, variant, st):
    name = ucx_cluster.add_worker("variant", image=variant["tag"])
    sched_before = container_logs(ucx_cluster.scheduler_name).splitlines()
    try:
        state = wait_until(lambda: (s := container_state(name)) and not s["Running"] and s, 120)
        assert state, f"{name} is still running: the scheduler did not refuse it"
        log = container_logs(name)
        assert state["ExitCode"] == ENV_MISMATCH, log[-3000:]
        errors = [ln for ln in log.splitlines() if " - ERROR - " in ln]
        assert len(errors) == 1 and "refused worker" in errors[0], log[-3000:]
        assert variant["stack_id"] in errors[0] and image["stack_id"] in errors[0]
        assert f"ucx-dask-gpu: {st.version} vs {st.version}+variant" in errors[0]  # the differing package, named
        own = [ln for ln in log.splitlines() if "distributed.preloading - INFO" not in ln]  # one pair per preload
        assert not has_traceback(log) and len(own) <= 3, log
        sched = container_logs(ucx_cluster.scheduler_name).splitlines()[len(sched_before) - 1:]
        assert len([ln for ln in sched if "refused worker" in ln]) == 1 and not has_traceback("\n".join(sched))
    finally:
        subprocess.run([docker_bin(), "rm", "-f", name], capture_output=True)
        ucx_cluster.containers.remove(name)
    assert ucx_cluster.registered_workers() == 2


def test_client_with_a_different_stack_id_is_refused_at_connect(ucx_cluster, image, variant):
    proc = ucx_cluster.run_client(["ucx-dask-gpu", "workload", "transpose", "--scheduler", ucx_cluster.address],
                                  image=variant["tag"])
    assert proc.returncode == ENV_MISMATCH, proc.stderr[-2000:]
    # One line says it all, over UCX too: no traceback, no UCX/UCXX lines around it.
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused client" in lines[0] and "breaks the contract" in lines[0], proc.stderr
    assert image["stack_id"] in lines[0] and variant["stack_id"] in lines[0]
    assert "ucx-dask-gpu: " in lines[0] and "+variant" in lines[0]


def test_ucx_cluster_shuts_down_cleanly(ucx_cluster):
    stop_clean(ucx_cluster)


# --- tcp: the same answer, and a worker killed mid-computation ------------------------------------------------------

KILL_CLIENT = """
import json, sys, time
import dask.array as da
from distributed import Client
from ucx_dask_gpu.proof.transpose import _chunk_sizes, _generate_block, transpose_expected

def slow(block):
    time.sleep(0.3)
    return block

size, chunk = 4000, 500
with Client(sys.argv[1], timeout=60) as c:
    sizes = tuple(_chunk_sizes(size, chunk))
    x = da.map_blocks(_generate_block, 0, "numpy", chunks=(sizes, sizes), dtype="float64", meta=None,
                      name="kill-test-random")
    y = (x + x.T).map_blocks(slow, dtype="float64").sum()
    fut = c.compute(y, retries=3)
    # Kill only once both workers hold results: the killed one takes finished work with it.
    while True:
        held = c.has_what()
        if len(held) == 2 and all(len(keys) >= 4 for keys in held.values()):
            break
        time.sleep(0.05)
    print("KILL " + json.dumps(sorted(held)), flush=True)
    value = float(fut.result())
    print(json.dumps({"value": value, "expected": transpose_expected(size, chunk, 0),
                      "workers_end": len(c.scheduler_info()["workers"])}), flush=True)
"""


@pytest.fixture(scope="module")
def tcp_cluster(image):
    cluster = Cluster(image["tag"], protocol="tcp").start()
    yield cluster
    cluster.stop(quiet=True)


def test_transpose_over_tcp_gives_the_numpy_answer(tcp_cluster):
    r = tcp_cluster.workload("transpose", "--size", "4000", "--chunk", "1000")
    assert r["protocol"] == "tcp" and r["ok"] and r["versions_identical"]


@pytest.fixture(scope="module")
def pip_client(image, st, tmp_path_factory, wheels) -> Path:
    """A client outside the image, made the way a user without the image makes one: a fresh venv, `pip install`
    from the lock (the wheelhouse the image build verified), our UCXX wheels and our own wheel, no dask config."""
    tmp = tmp_path_factory.mktemp("pip-client")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--disable-pip-version-check"]
    cache = default_cache()
    subprocess.run([*pip, "--find-links", str(wheelhouse_dir(cache, st.lock_path())), "--require-hashes", "-r",
                    str(st.lock_path())], check=True, timeout=1800)
    subprocess.run([*pip, "--no-deps", *map(str, sorted(default_ucxx_wheels().glob("*.whl"))),
                    str(build_own_wheel(st, tmp / "own"))], check=True, timeout=600)
    return venv


def pip_workload(venv: Path, cluster: Cluster, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Its `ucx-dask-gpu workload` against the cluster's scheduler, from this host (its container address)."""
    ip = json.loads(subprocess.run([docker_bin(), "inspect", cluster.scheduler_name], capture_output=True, text=True,
                                   check=True).stdout)[0]["NetworkSettings"]["Networks"][cluster.network]["IPAddress"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHON", "VIRTUAL"))}
    return subprocess.run([str(venv / "bin" / "ucx-dask-gpu"), "workload", "transpose", "--scheduler",
                           f"tcp://{ip}:8786", "--size", "1000", "--chunk", "500", *args], capture_output=True,
                          text=True, timeout=300, env={**clean, **(env or {})}, cwd=venv)


def test_a_pip_installed_client_outside_the_image_is_accepted(tcp_cluster, pip_client, image):
    proc = pip_workload(pip_client, tcp_cluster, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["ok"]
    out = subprocess.run([str(pip_client / "bin" / "ucx-dask-gpu"), "guard", "id"], capture_output=True, text=True)
    assert out.stdout.strip() == image["stack_id"]


def test_the_pip_client_with_one_pin_changed_is_refused(tcp_cluster, pip_client, tmp_path, wheels):
    changed = f"{version('cloudpickle')}.post1"
    site = wheels.pip_target([wheels.installed_as_wheel("cloudpickle", changed, tmp_path / "w")], tmp_path / "site")
    proc = pip_workload(pip_client, tcp_cluster, env={"PYTHONPATH": str(site)})
    assert proc.returncode == ENV_MISMATCH, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"cloudpickle: {version('cloudpickle')} vs {changed}" in lines[0], lines


def test_the_pip_client_over_ucx_says_what_it_needs_and_works_once_set_up(pip_client, procs, shipped_config,
                                                                          tmp_path):
    """docs/environment-gate.md's pip recipe over ucx://, against a UCX scheduler and worker of this host's venv. With
    the UCXX wheels installed by plain pip, libucxx.so cannot find a libucp: one line, exit 29, naming the fix (not
    exit 8, as if the guard had refused it). After `ucx-src-build/build.sh install-ucxx` on that venv (as that page
    says), the same command computes over ucx. Last of the pip client's tests: it changes that venv."""
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env, protocol="ucx")
    worker = procs.start_worker(tmp_path, env, address, "w")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "PYTHON", "VIRTUAL", "UCX", "LD_"))}

    def run() -> subprocess.CompletedProcess:
        return subprocess.run([str(pip_client / "bin" / "ucx-dask-gpu"), "workload", "transpose", "--scheduler",
                               address, "--size", "400", "--chunk", "200", "--json", "--wait-workers", "180"],
                              capture_output=True, text=True, timeout=600, env=clean, cwd=pip_client)

    try:
        before = run()
        setup = subprocess.run([str(ROOT / "ucx-src-build" / "build.sh"), "install-ucxx", "--python",
                                str(pip_client / "bin" / "python"), "--wheels", str(default_ucxx_wheels()),
                                "--ucx-prefix", os.environ.get("UCX_PREFIX", str(ROOT / "build" / "ucx-prefix"))],
                               capture_output=True, text=True, timeout=600)
        after = run()
    finally:
        worker.stop()
        sched.stop()
    assert before.returncode == BINDING_NOT_LOADABLE, before.stderr[-3000:]
    lines = before.stderr.strip().splitlines()
    assert len(lines) == 1 and "UCX binding not loadable: ImportError:" in lines[0], lines
    assert "ucx-src-build/build.sh install-ucxx" in lines[0]
    assert setup.returncode == 0, setup.stderr[-3000:]
    assert after.returncode == 0, after.stderr[-3000:]
    result = json.loads(after.stdout)
    assert result["ok"] and result["protocol"] == "ucx"


def test_killing_a_worker_mid_computation_still_gives_the_right_result(tcp_cluster):
    cmd = tcp_cluster.client_args(interactive=True) + ["python", "-", tcp_cluster.address]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        proc.stdin.write(KILL_CLIENT)
        proc.stdin.close()
        proc.stdin = None
        seen = []
        for line in proc.stdout:  # wait until both workers hold results
            seen.append(line)
            if line.startswith("KILL"):
                break
        assert seen and seen[-1].startswith("KILL"), "".join(seen)
        tcp_cluster.kill(tcp_cluster.worker_name(1))
        out, _ = proc.communicate(timeout=300)
        err.seek(0)
        assert proc.returncode == 0, err.read()[-3000:]
    r = parse_json_output(out)
    assert abs(r["value"] - r["expected"]) <= 1e-9 * abs(r["expected"])
    assert r["workers_end"] == 1
    assert "Remove worker" in container_logs(tcp_cluster.scheduler_name)


def test_tcp_cluster_shuts_down_cleanly(tcp_cluster):
    # The killed worker died by SIGKILL (exit 137, by design); every other container stops cleanly.
    stop_clean(tcp_cluster, allow_tracebacks=(tcp_cluster.worker_name(1),))


# --- tls: end to end, and a plain-TCP client is refused -------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_cluster(image):
    cluster = Cluster(image["tag"], protocol="tls").start()
    yield cluster
    cluster.stop(quiet=True)


def test_transpose_over_tls(tls_cluster):
    r = tls_cluster.workload("transpose", "--size", "4000", "--chunk", "1000")
    assert r["protocol"] == "tls" and r["ok"] and r["workers_start"] == 2


def test_plain_tcp_client_is_refused_by_the_tls_cluster(tls_cluster, image):
    clients_before = container_logs(tls_cluster.scheduler_name).count("Receive client connection")
    cmd = [docker_bin(), "run", "--rm", "--network", tls_cluster.network, image["tag"], "ucx-dask-gpu", "workload",
           "transpose", "--scheduler", "tcp://scheduler:8786", "--timeout", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == NOT_A_SCHEDULER, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no Dask scheduler at tcp://scheduler:8786: a TLS server answered" in lines[0], lines
    # ... and it never became a client of the cluster.
    assert container_logs(tls_cluster.scheduler_name).count("Receive client connection") == clients_before


def test_a_client_without_a_certificate_is_refused_by_the_tls_cluster(tls_cluster, image):
    """The same image, on the cluster's network, without the cluster's certificates (mutual TLS)."""
    clients_before = container_logs(tls_cluster.scheduler_name).count("Receive client connection")
    cmd = [docker_bin(), "run", "--rm", "--network", tls_cluster.network, image["tag"], "ucx-dask-gpu", "workload",
           "transpose", "--scheduler", tls_cluster.address, "--timeout", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == TLS_REFUSED, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "this client has no TLS certificate" in lines[0], lines
    assert container_logs(tls_cluster.scheduler_name).count("Receive client connection") == clients_before


def test_tls_cluster_shuts_down_cleanly(tls_cluster):
    stop_clean(tls_cluster)
