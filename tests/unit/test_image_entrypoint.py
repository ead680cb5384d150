"""The image's entrypoint: known roles pass through unchanged, anything else is one line + UNKNOWN_ROLE."""
import os
import subprocess
import sys

import pytest

from ucx_dask_gpu.image import entrypoint
from ucx_dask_gpu.errors import UNKNOWN_ROLE, UserError


@pytest.mark.parametrize("argv", [
    ["dask", "scheduler", "--protocol", "ucx"],
    ["dask", "worker", "ucx://scheduler:8786", "--nthreads", "2"],
    ["dask", "cuda", "worker", "ucx://scheduler:8786"],
    ["ucx-dask-gpu", "workload", "transpose", "--scheduler", "tcp://scheduler:8786"],
    ["python", "-c", "print(1)"],
    ["ucx_info", "-v"],
    ["bash"],
])
def test_known_roles_exec_unchanged(argv):
    assert entrypoint.resolve(argv) == argv


@pytest.mark.parametrize("argv, named", [
    (["schedular"], "'schedular'"),
    (["dask", "schedular"], "'dask schedular'"),
    (["dask"], "'dask'"),
    (["dask", "cuda", "scheduler"], "'dask cuda scheduler'"),
    (["rm", "-rf", "/"], "'rm'"),
])
def test_unknown_roles_are_refused_with_the_list_of_roles(argv, named):
    with pytest.raises(UserError) as err:
        entrypoint.resolve(argv)
    assert err.value.exit_code == UNKNOWN_ROLE
    assert named in str(err.value) and "dask scheduler" in str(err.value)


def test_no_role_is_refused():
    with pytest.raises(UserError) as err:
        entrypoint.resolve([])
    assert err.value.exit_code == UNKNOWN_ROLE


def test_main_prints_one_line_and_exits_with_unknown_role():
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.image.entrypoint", "wrker"], capture_output=True,
                          text=True)
    assert proc.returncode == UNKNOWN_ROLE
    assert proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "unknown role 'wrker'" in proc.stderr


def test_main_execs_the_role():
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.image.entrypoint", "python", "-c", "print('hi')"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "hi\n"


def test_gpu_transports_only_on_request_or_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(entrypoint, "GPU_CONFIG_DIR", str(tmp_path))
    assert entrypoint.transports_env({"UCX_DASK_GPU_TRANSPORTS": "gpu"}) == {"DASK_CONFIG": str(tmp_path)}
    assert entrypoint.transports_env({"UCX_DASK_GPU_TRANSPORTS": "cpu"}) == {}
    # An explicit DASK_CONFIG is the operator's choice: never overridden.
    assert entrypoint.transports_env({"UCX_DASK_GPU_TRANSPORTS": "gpu", "DASK_CONFIG": "/x"}) == {}


def test_workers_add_quiet_close_after_the_configured_preloads():
    import dask.config

    with dask.config.set({"distributed.worker.preload": ["ucx_dask_gpu.gate.guard"]}):
        env = entrypoint.worker_preload_env(["dask", "worker", "tcp://s:8786"], dict(os.environ))
    assert env == {entrypoint.WORKER_PRELOAD_ENV: repr(["ucx_dask_gpu.gate.guard", entrypoint.QUIET_CLOSE])}
    with dask.config.set({"distributed.worker.preload": ["ucx_dask_gpu.gate.guard", entrypoint.QUIET_CLOSE]}):
        assert entrypoint.worker_preload_env(["dask", "worker", "x"], dict(os.environ)) == {}
    # Not for other roles, and never over an explicit choice.
    assert entrypoint.worker_preload_env(["dask", "scheduler"], dict(os.environ)) == {}
    assert entrypoint.worker_preload_env(["dask", "worker", "x"], {entrypoint.WORKER_PRELOAD_ENV: "[]"}) == {}


def test_dask_worker_gets_the_guard_as_nanny_preload():
    """`dask worker` ignores distributed.nanny.preload; the guard must run in the nanny to refuse in one line."""
    got = entrypoint.nanny_preload_args(["dask", "worker", "tcp://scheduler:8786", "--nthreads", "2"])
    assert got == ["dask", "worker", "--preload-nanny", "ucx_dask_gpu.gate.guard", "tcp://scheduler:8786",
                   "--nthreads", "2"]
    assert entrypoint.nanny_preload_args(got) == got
    for other in (["dask", "cuda", "worker", "tcp://s:1"], ["dask", "scheduler"]):  # dask-cuda honours the config
        assert entrypoint.nanny_preload_args(other) == other


@pytest.mark.parametrize("argv", [["dask", "worker", "not-an-address"], ["dask", "cuda", "worker", "foo://s:1"]])
def test_a_malformed_worker_address_is_one_line_before_dask_starts(argv):
    with pytest.raises(UserError) as err:
        entrypoint.check_worker_address(argv)
    assert err.value.exit_code == 2 and argv[-1] in str(err.value)
    entrypoint.check_worker_address(["dask", "worker", "--nthreads", "2", "tcp://s:1"])  # options first: dask's own
    entrypoint.check_worker_address(["dask", "worker", "ucx://scheduler:8786"])
