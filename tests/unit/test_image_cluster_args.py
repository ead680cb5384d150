"""How the docker-run cluster starts each role (no Docker needed)."""
import pytest

from ucx_dask_gpu.image.cluster import Cluster, has_traceback, parse_json_output
from ucx_dask_gpu.errors import USAGE, UserError


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
