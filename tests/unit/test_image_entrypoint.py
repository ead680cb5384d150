"""The image's entrypoint: every launcher's spelling of a role is known (legacy ones exec'd as the current CLI), anything
else is one line + UNKNOWN_ROLE; conflicting transports and a GPU worker without a GPU end in one line too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.image import entrypoint
from ucx_dask_gpu.errors import NO_GPU, TRANSPORT_CONFLICT, UNKNOWN_ROLE, UserError


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


@pytest.mark.parametrize("argv, kind, execd", [
    # dask Helm chart / dask-kubernetes operator
    (["dask-scheduler", "--port=8786", "--dashboard-address=:8787"], "scheduler",
     ["dask", "scheduler", "--port=8786", "--dashboard-address=:8787"]),
    (["dask-scheduler", "--host", "0.0.0.0"], "scheduler", ["dask", "scheduler", "--host", "0.0.0.0"]),
    (["dask-worker", "--name", "w-1", "--dashboard"], "worker", ["dask", "worker", "--name", "w-1", "--dashboard"]),
    (["dask-cuda-worker", "ucx://s:8786"], "cuda-worker", ["dask", "cuda", "worker", "ucx://s:8786"]),
    (["dask-cuda-config", "ucx://s:8786"], "cuda-config", ["dask", "cuda", "config", "ucx://s:8786"]),
    (["dask", "cuda", "config", "ucx://s:8786"], "cuda-config", ["dask", "cuda", "config", "ucx://s:8786"]),
    # dask-jobqueue (python may be an absolute path: sys.executable of the process that made the job script)
    (["python", "-m", "distributed.cli.dask_worker", "tcp://s:8786", "--nanny"], "worker", None),
    (["/opt/venv/bin/python", "-m", "distributed.cli.dask_worker", "tcp://s:8786"], "worker", None),
    (["python3", "-m", "distributed.cli.dask_scheduler"], "scheduler", None),
    (["python3.11", "-m", "dask_cuda.cli", "ucx://s:8786"], "cuda-worker", None),
    (["python", "-m", "http.server"], "command", None),
])
def test_launcher_spellings_are_roles(argv, kind, execd):
    role = entrypoint.classify(argv)
    assert role.kind == kind and list(role.argv) == (execd or argv)


@pytest.mark.parametrize("argv, named", [
    (["schedular"], "'schedular'"),
    (["dask", "schedular"], "'dask schedular'"),
    (["dask"], "'dask'"),
    (["dask", "cuda", "scheduler"], "'dask cuda scheduler'"),
    (["rm", "-rf", "/"], "'rm'"),
    (["dask-schedular"], "'dask-schedular'"),
    (["./python", "-c", "1"], "'./python'"),
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


def test_transport_conflicts_refuse_dask_roles_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "UCX_"))}
    env.update(UCX_TLS="tcp", DASK_DISTRIBUTED_UCXX__NVLINK="True", DASK_CONFIG=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.image.entrypoint", "dask-scheduler", "--help"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == TRANSPORT_CONFLICT, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "conflicting transport settings: UCX_TLS=tcp in the environment overrides" in line and "nvlink=True" in line
    # a client script is not a Dask role: it runs (its own Client reads the same settings)
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.image.entrypoint", "python", "-c", "print(2)"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and proc.stdout == "2\n"


def test_conflicts_come_from_the_config_the_role_will_read(tmp_path):
    (tmp_path / "mine.yaml").write_text("distributed-ucxx:\n  tcp: true\n  environment:\n    tls: rc\n")
    env = {"DASK_CONFIG": str(tmp_path)}
    with pytest.raises(UserError) as err:
        entrypoint.check_transports(entrypoint.collect_for(env), env)
    assert err.value.exit_code == TRANSPORT_CONFLICT and "environment.tls=rc is ignored" in str(err.value)
    entrypoint.check_transports(entrypoint.collect_for({}), {})  # nothing set: nothing to refuse


def test_gpu_worker_without_a_gpu_names_what_is_missing(tmp_path):
    role = entrypoint.classify(["dask-cuda-worker", "ucx://s:8786"])
    if entrypoint.missing_gpu({}) is None:
        pytest.skip("a GPU is visible here")
    with pytest.raises(UserError) as err:
        entrypoint.check_gpu(role, {})
    assert err.value.exit_code == NO_GPU
    assert "dask cuda worker needs a GPU: no NVIDIA driver in this container (libnvidia-ml.so.1 not found" in \
        str(err.value) and "--gpus device=N" in str(err.value)
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in entrypoint.missing_gpu({"CUDA_VISIBLE_DEVICES": ""})
    assert "NVIDIA_VISIBLE_DEVICES='void'" in entrypoint.missing_gpu({"NVIDIA_VISIBLE_DEVICES": "void"})
    entrypoint.check_gpu(entrypoint.classify(["dask-cuda-worker", "--help"]), {})  # help needs no GPU
    entrypoint.check_gpu(entrypoint.classify(["dask", "worker", "tcp://s:8786"]), {})


def test_legacy_commands_of_the_package_go_through_the_entrypoint(tmp_path):
    """`dask-scheduler` as installed by this package (what a launcher that bypasses the entrypoint runs)."""
    exe = Path(sys.executable).parent / "dask-scheduler"
    if not exe.exists():
        pytest.skip(f"{exe} not installed (pip install -e . installs it)")
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "Usage: dask scheduler" in proc.stdout


NANNY = {"distributed": {"nanny": {"preload": ["ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup"]}}}


@pytest.mark.parametrize("argv, n", [
    (["dask", "worker", "tcp://scheduler:8786", "--nthreads", "2"], 2),
    (["dask-worker", "tcp://scheduler:8786", "--nthreads", "2"], 2),
    # dask-jobqueue's job scripts
    (["/opt/venv/bin/python", "-m", "distributed.cli.dask_worker", "tcp://scheduler:8786", "--nthreads", "2",
      "--nanny"], 3),
])
def test_dask_worker_gets_the_configured_nanny_preloads(argv, n):
    """`dask worker` ignores distributed.nanny.preload in every spelling; the guard must run in the nanny to refuse in
    one line, and the nanny loads what `dask cuda worker`'s reads from the config."""
    role = entrypoint.nanny_preload_args(entrypoint.classify(argv), NANNY)
    assert list(role.argv[n:n + 4]) == ["--preload-nanny", "ucx_dask_gpu.gate.guard",
                                        "--preload-nanny", "ucx_dask_gpu.ucx.startup"]
    assert role.argv[n + 4] == "tcp://scheduler:8786"
    assert entrypoint.nanny_preload_args(role, NANNY) == role  # given already: not twice
    # Without any config, the guard still.
    assert entrypoint.nanny_preload_args(entrypoint.classify(argv), {}).argv[n:n + 2] == \
        ("--preload-nanny", "ucx_dask_gpu.gate.guard")
    for other in (["dask", "cuda", "worker", "tcp://s:1"], ["dask", "scheduler"],
                  ["python", "-m", "dask_cuda.cli", "tcp://s:1"]):  # dask-cuda reads the config itself
        assert entrypoint.nanny_preload_args(entrypoint.classify(other), NANNY).argv == tuple(other)


@pytest.mark.parametrize("argv", [["dask", "worker", "not-an-address"], ["dask", "cuda", "worker", "foo://s:1"],
                                  ["python", "-m", "distributed.cli.dask_worker", "http://s:1"],
                                  ["dask-cuda-worker", "s"]])
def test_a_malformed_worker_address_is_one_line_before_dask_starts(argv):
    with pytest.raises(UserError) as err:
        entrypoint.check_worker_address(entrypoint.classify(argv))
    assert err.value.exit_code == 2 and argv[-1] in str(err.value)
    for fine in (["dask", "worker", "--nthreads", "2", "tcp://s:1"],  # options first: dask's own
                 ["dask", "worker", "ucx://scheduler:8786"], ["dask", "scheduler", "--port", "x"]):
        entrypoint.check_worker_address(entrypoint.classify(fine))
