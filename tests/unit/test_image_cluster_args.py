"""How the docker-run cluster and the compose file start each role, on CPU and GPU hosts (no Docker needed)."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ucx_dask_gpu.image import compose
from ucx_dask_gpu.image.cluster import Cluster, has_traceback, parse_json_output
from ucx_dask_gpu.image.gpuhost import HostFlags, gpu_workers, parse_gpus
from ucx_dask_gpu.errors import USAGE, UserError

ROOT = Path(__file__).resolve().parents[2]


def env_of(args: list[str]) -> dict:
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-e")


def test_roles_talk_to_the_scheduler_alias_on_the_cluster_network():
    c = Cluster("img:1", protocol="ucx", name="udg-t")
    assert c.address == "ucx://scheduler:8786" and c.network == "udg-t"
    assert c.scheduler_argv()[:4] == ["dask", "scheduler", "--protocol", "ucx"]
    w = c.worker_argv(0)
    assert w[:3] == ["dask", "worker", "ucx://scheduler:8786"] and "--nthreads" in w
    # Containers on an --internal network have no default route: the address comes from eth0, not from a probe.
    assert "--interface" in c.scheduler_argv() and "--interface" in w


def test_gpu_workers_are_dask_cuda_workers():
    w = Cluster("img:1", gpu=True).worker_argv(1)
    assert w[:4] == ["dask", "cuda", "worker", "tcp://scheduler:8786"] and "--nthreads" not in w


def opt(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_one_worker_per_gpu_in_the_namespaces_of_the_host_holder():
    c = Cluster("img:1", protocol="ucx", gpu=True, gpus=("0", "1", "3"), name="udg-g")
    assert c.n_workers == 3
    holder = c.run_args(c.holder_name, ["bash"], host=HostFlags(ipc="shareable"))
    assert opt(holder, "--ipc") == ["shareable"] and "--gpus" not in holder
    for i, gpu in enumerate(("0", "1", "3")):
        args = c.run_args(c.worker_name(i), c.worker_argv(i), host=c.host_flags(i))
        assert opt(args, "--gpus") == [f"device={gpu}"]                 # its own GPU, never `all`
        assert opt(args, "--ulimit") == ["stack=67108864"]               # RAPIDS' stack size
        assert opt(args, "--ipc") == ["container:udg-g-gpuhost"] and opt(args, "--pid") == ["container:udg-g-gpuhost"]
        assert "--cap-add" not in args and "--device" not in args
    sched = c.run_args(c.scheduler_name, c.scheduler_argv(), host=c.host_flags())
    assert "--gpus" not in sched and "--ipc" not in sched and opt(sched, "--shm-size") == ["1g"]
    assert "--ulimit" not in sched and "--ulimit" not in holder


def test_infiniband_and_cma_flags():
    c = Cluster("img:1", gpu=True, gpus=("0",), infiniband=True, cma=True, name="udg-i")
    args = c.host_flags(0).docker_args()
    assert opt(args, "--device") == ["/dev/infiniband"]
    assert opt(args, "--ulimit") == ["stack=67108864", "memlock=-1"]
    assert opt(args, "--cap-add") == ["IPC_LOCK", "SYS_PTRACE"]
    svc = c.host_flags(0, holder="gpu-host").compose()
    assert svc["devices"] == ["/dev/infiniband:/dev/infiniband"]
    assert svc["ulimits"] == {"stack": 67108864, "memlock": -1}
    assert svc["cap_add"] == ["IPC_LOCK", "SYS_PTRACE"] and svc["ipc"] == svc["pid"] == "service:gpu-host"
    assert svc["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]


def test_cpu_clusters_take_no_gpu_host_settings():
    assert Cluster("img:1").host_flags(0).docker_args() == ["--shm-size", "1g"]
    with pytest.raises(UserError) as err:
        Cluster("img:1", infiniband=True)
    assert err.value.exit_code == USAGE
    assert gpu_workers(["0", "1"], "h")[1] == HostFlags(gpu="1", ipc="container:h", pid="container:h")
    assert parse_gpus(" 0, 2 ") == ["0", "2"]
    for bad in ("", "0,0", ","):
        with pytest.raises(UserError) as err:
            parse_gpus(bad)
        assert err.value.exit_code == USAGE


def test_compose_file_is_the_cluster_as_services():
    c = Cluster("img:1", protocol="ucx", gpu=True, gpus=("0", "1"))
    doc = yaml.safe_load(compose.render(c, "--gpus 0,1"))
    s = doc["services"]
    assert list(s) == ["scheduler", "gpu-host", "worker-0", "worker-1", "client"]
    assert s["scheduler"]["command"] == c.scheduler_argv() and s["worker-1"]["command"] == c.worker_argv(1)
    assert s["gpu-host"]["ipc"] == "shareable"
    for w in ("worker-0", "worker-1"):
        assert s[w]["ipc"] == s[w]["pid"] == "service:gpu-host" and "gpu-host" in s[w]["depends_on"]
    assert [s[w]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for w in ("worker-0", "worker-1")] \
        == [["0"], ["1"]]
    assert s["worker-0"]["ulimits"] == {"stack": 67108864} and "ulimits" not in s["scheduler"]
    assert all(s[name]["shm_size"] == "1g" for name in s)
    assert s["client"]["profiles"] == ["client"] and s["client"]["command"][-2:] == ["--backend", "cupy"]
    cpu = yaml.safe_load(compose.render(Cluster("img:1", n_workers=3), "--workers 3"))["services"]
    assert list(cpu) == ["scheduler", "worker-0", "worker-1", "worker-2", "client"]
    assert all("deploy" not in v and "ipc" not in v for v in cpu.values())


def test_the_committed_compose_file_is_generated():
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "image", "compose", "--gpus", "0,1", "--check",
                           str(ROOT / "docker" / "compose.yaml")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_tls_comes_from_dask_config_for_every_role_and_requires_encryption(tmp_path):
    c = Cluster("img:1", protocol="tls")
    c.tls_dir = tmp_path
    env = env_of(c._env())
    assert env["DASK_DISTRIBUTED__COMM__REQUIRE_ENCRYPTION"] == "True"
    # Each role its own certificate of the cluster's CA: mutual TLS (gate/tls.py).
    assert env["DASK_DISTRIBUTED__COMM__TLS__CA_FILE"] == "/tls/ca.pem"
    for role in ("SCHEDULER", "WORKER", "CLIENT"):
        assert env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__CERT"] == f"/tls/{role.lower()}.pem"
        assert env[f"DASK_DISTRIBUTED__COMM__TLS__{role}__KEY"] == f"/tls/{role.lower()}.key"
    assert "--tls-cert" not in c.scheduler_argv()  # with --interface, dask refuses the --tls-* flags
    assert f"{tmp_path}:/tls:ro" in c.client_args()
    assert env_of(Cluster("img:1", protocol="tcp")._env()) == {}


def test_unknown_protocol_is_usage():
    with pytest.raises(UserError) as err:
        Cluster("img:1", protocol="udp")
    assert err.value.exit_code == USAGE


def test_json_output_is_found_among_other_lines():
    out = "[1] UCX  WARN something\n{\n  \"ok\": true,\n  \"v\": [1, 2]\n}\ntrailing line\n"
    assert parse_json_output(out) == {"ok": True, "v": [1, 2]}
    with pytest.raises(ValueError):
        parse_json_output("no json here\n")


def test_traceback_detection():
    assert has_traceback("x\nTraceback (most recent call last):\n  File ...")
    assert not has_traceback("distributed.worker - INFO - Stopping worker")
