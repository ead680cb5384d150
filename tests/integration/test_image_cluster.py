"""The one image, for real: built with a real Docker engine (--network none), run as scheduler + 2 workers + client on
an internal network, over ucx (UCXX over TCP on CPU hosts), tcp and tls.

Building the image is the expensive part: the session builds it once through scripts/build_image.sh (a warm
Docker cache makes that a no-op), plus one deliberately different image (the same Dockerfile with one extra
package installed, hence another stack id) for the environment gate.
"""
from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from ucx_dask_gpu.image.cluster import Cluster, has_traceback, parse_json_output
from ucx_dask_gpu.image.paths import base_ref
from ucx_dask_gpu.image.docker import container_logs, container_state, docker_bin, wait_until
from ucx_dask_gpu.errors import ENV_MISMATCH, SCHEDULER_UNREACHABLE, UNKNOWN_ROLE

pytestmark = [pytest.mark.integration, pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def variant(image, tmp_path_factory, build_image, make_wheel) -> dict:
    """Same Dockerfile, one extra package: a different stack id."""
    marker = make_wheel(tmp_path_factory.mktemp("variant"), "ucx-dask-gpu-variant-marker", "1",
                        payload="deliberately different image")
    return build_image("--tag", f"{image['tag'].split(':')[0]}:variant", "--extra-wheel", str(marker))


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
    # The id inside the image is the label (build_image.sh checked it too) and what the guard reads.
    out = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], "ucx-dask-gpu", "guard",
                          "show", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["stack_id"] == image["stack_id"]


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


def test_unknown_role_is_one_line_and_nonzero(image):
    proc = subprocess.run([docker_bin(), "run", "--rm", "--network", "none", image["tag"], "dask", "schedular"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == UNKNOWN_ROLE
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown role 'dask schedular'" in lines[0], proc.stderr


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


def test_worker_from_a_different_image_is_refused(ucx_cluster, image, variant):
    name = ucx_cluster.add_worker("variant", image=variant["tag"])
    try:
        state = wait_until(lambda: (s := container_state(name)) and not s["Running"] and s, 120)
        assert state, f"{name} is still running: the scheduler did not refuse it"
        log = container_logs(name)
        assert state["ExitCode"] != 0
        assert "refused worker" in log and variant["stack_id"] in log and image["stack_id"] in log, log[-3000:]
        sched = container_logs(ucx_cluster.scheduler_name)
        assert "stack id differs" in sched and variant["stack_id"] in sched
        assert "ucx-dask-gpu-variant-marker" in sched  # the differing package is named
    finally:
        # Its failed start is expected to log a traceback: keep it out of the clean-shutdown check.
        subprocess.run([docker_bin(), "rm", "-f", name], capture_output=True)
        ucx_cluster.containers.remove(name)
    assert ucx_cluster.registered_workers() == 2


def test_client_with_a_different_stack_id_is_refused_at_connect(ucx_cluster, image, variant):
    proc = ucx_cluster.run_client(["ucx-dask-gpu", "workload", "transpose", "--scheduler", ucx_cluster.address],
                                  image=variant["tag"])
    assert proc.returncode == ENV_MISMATCH, proc.stderr[-2000:]
    # One line says it all (dask's and UCX's own log lines may surround it); no traceback.
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "refused client" in lines[0] and "stack id differs" in lines[0], proc.stderr[-2000:]
    assert image["stack_id"] in lines[0] and variant["stack_id"] in lines[0]
    assert "ucx-dask-gpu-variant-marker" in lines[0]
    assert not has_traceback(proc.stderr)


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
    assert proc.returncode == SCHEDULER_UNREACHABLE, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "cannot connect to tcp://scheduler:8786" in lines[0], proc.stderr[-2000:]
    assert not has_traceback(proc.stderr)
    # ... and it never became a client of the cluster.
    assert container_logs(tls_cluster.scheduler_name).count("Receive client connection") == clients_before


def test_tls_cluster_shuts_down_cleanly(tls_cluster):
    stop_clean(tls_cluster)
