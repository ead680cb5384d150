"""The image's entrypoint: every launcher's spelling of a role is known (legacy ones exec'd as the current CLI), any
other command runs as it is (a command the image lacks: one line + NO_SUCH_COMMAND); conflicting transports and a GPU
worker without a GPU end in one line too."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.image import entrypoint
from ucx_dask_gpu.errors import NO_GPU, NO_SUCH_COMMAND, TRANSPORT_CONFLICT, UserError


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
    assert list(entrypoint.classify(argv).argv) == argv


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


@pytest.mark.parametrize("argv", [
    ["pip", "list"],
    ["bash", "-c", "echo hi"],
    ["Rscript", "analysis.R"],
    ["/opt/venv/bin/python", "my_client.py"],
    ["./python", "-c", "1"],
    ["dask", "info", "versions"],            # dask's own command line, not a role
    ["dask", "schedular"],                   # dask's own CLI says what it lacks
    ["dask", "cuda", "scheduler"],
    ["python", "-m", "http.server"],
    ["schedular"],
])
def test_any_other_command_runs_as_it_is(argv):
    role = entrypoint.classify(argv)
    assert role.kind == "command" and list(role.argv) == argv
    entrypoint.check_gpu(role, {})  # no role checks for it


def test_no_command_is_refused():
    for argv in ([], [""]):
        with pytest.raises(UserError) as err:
            entrypoint.classify(argv)
        assert err.value.exit_code == NO_SUCH_COMMAND and "dask scheduler" in str(err.value)


def _entrypoint(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu.image.entrypoint", *argv], capture_output=True,
                          text=True, env=env)


@pytest.mark.parametrize("argv, named", [(["schedular"], "'schedular' in this image (not on PATH)"),
                                         (["/no/such/tool", "-v"], "'/no/such/tool' in this image (no such file)")])
def test_a_command_the_image_lacks_is_one_line_naming_the_roles(argv, named):
    proc = _entrypoint(*argv)
    assert proc.returncode == NO_SUCH_COMMAND
    assert proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert f"no command {named}" in line and "dask scheduler" in line


def test_a_file_that_is_not_executable_is_one_line(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text("echo never\n")
    proc = _entrypoint(str(script))
    assert proc.returncode == NO_SUCH_COMMAND and proc.stdout == ""
    [line] = proc.stderr.strip().splitlines()
    assert f"cannot run '{script}': Permission denied" in line


def test_other_commands_run_with_the_environment_and_dask_config_roles_get(tmp_path):
    """`exec "$@"`: the command itself runs (its exit code and output are its own), with the image's environment and
    the dask config every role reads; only Dask roles are marked as checked."""
    (tmp_path / "site.yaml").write_text("distributed:\n  comm:\n    timeouts:\n      connect: 77s\n")
    env = {**os.environ, "DASK_CONFIG": str(tmp_path), "MY_SETTING": "kept"}
    code = ("import os, sys, dask; print(os.environ['MY_SETTING'], "
            "dask.config.get('distributed.comm.timeouts.connect'), "
            f"{entrypoint.ROLE_CHECKED_ENV!r} in os.environ); sys.exit(3)")
    proc = _entrypoint(sys.executable, "-c", code, env=env)
    assert proc.returncode == 3 and proc.stdout == "kept 77s False\n", proc.stderr
    proc = _entrypoint(sys.executable, "-m", "pip", "--version", env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("pip "), proc.stderr
    proc = _entrypoint("sh", "-c", "echo $MY_SETTING; exit 5", env=env)
    assert proc.returncode == 5 and proc.stdout == "kept\n"


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


def test_legacy_commands_of_the_image_go_through_the_entrypoint(tmp_path, legacy_command):
    """`dask-scheduler` as the image has it (what a launcher that bypasses the entrypoint runs): the script
    docker/Dockerfile writes, written the same way for this Python (the package itself installs no such name)."""
    dockerfile = (Path(__file__).resolve().parents[2] / "docker" / "Dockerfile").read_text()
    assert "from %s import legacy_main" in dockerfile and "for name in dask-scheduler dask-worker" in dockerfile
    exe = legacy_command(tmp_path, "dask-scheduler")
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
        entrypoint.check_worker_address(entrypoint.classify(argv), {})
    assert err.value.exit_code == 2 and argv[-1] in str(err.value)
    for fine in (["dask", "worker", "--nthreads", "2", "tcp://s:1"],  # options first: dask's own
                 ["dask", "worker", "ucx://scheduler:8786"], ["dask", "scheduler", "--port", "x"]):
        entrypoint.check_worker_address(entrypoint.classify(fine), {})


@pytest.mark.parametrize("argv", [["dask", "worker"], ["dask", "cuda", "worker", "--no-dashboard"], ["dask-worker"],
                                  ["python", "-m", "distributed.cli.dask_worker"]])
def test_a_worker_without_a_scheduler_address_is_one_line(argv):
    """dask's own answer is a 26-line ValueError traceback."""
    with pytest.raises(UserError) as err:
        entrypoint.check_worker_address(entrypoint.classify(argv), {})
    assert err.value.exit_code == 2 and "no scheduler address" in str(err.value)
    with pytest.raises(UserError) as err:  # options that take values, still no address
        entrypoint.check_worker_address(entrypoint.classify(argv + ["--nthreads", "2", "--name", "w"]), {})
    assert err.value.exit_code == 2 and "no scheduler address" in str(err.value)
    for fine, config in ((argv + ["tcp://s:1"], {}), (argv + ["--scheduler-file", "f.json"], {}),
                         (argv + ["--nthreads", "2", "tcp://s:1"], {}), (argv + ["--no-dashboard", "tcp://s:1"], {}),
                         (argv + ["--help"], {}), (argv, {"scheduler-address": "tcp://s:1"}),
                         (["dask", "scheduler"], {})):
        entrypoint.check_worker_address(entrypoint.classify(fine), config)
