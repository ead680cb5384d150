"""Every launcher form of a Dask role, through the image's entrypoint or around it (`--entrypoint ''`, as Apptainer
`exec`, a Kubernetes `command:` and the SLURM recipe run them), on the real image, and the image's start-up hook in
a Python of this host (the `python -m` forms, without Docker):

- the effective preload lists of the scheduler, every worker and every nanny, read from the running processes, are
  the same for every spelling (`dask worker`, `dask-worker`, dask-jobqueue's `python -m distributed.cli.dask_worker
  --nanny`, `python -m dask worker`; `dask scheduler`, `dask-scheduler`);
- a GPU worker on a host without a usable GPU (`dask cuda worker`, `dask-cuda-worker`, `python -m dask_cuda.cli`)
  ends in the same one line and exit 10 in every form (without the entrypoint it used to be dask-cuda's 78-line
  pynvml traceback).
"""
from __future__ import annotations

import json
import site
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import NO_GPU, SCHEDULER_UNREACHABLE
from ucx_dask_gpu.image import entrypoint, rolehook
from ucx_dask_gpu.image.cluster import parse_json_output

from pods import Net

pytestmark = pytest.mark.integration

# What /etc/dask in the image configures for each role (gate/daskconfig.py installs it).
EVERY_ROLE = ["ucx_dask_gpu.gate.guard", "ucx_dask_gpu.ucx.startup", "ucx_dask_gpu.gate.quietclose"]
ADDRESS = "tcp://scheduler:8786"
WORKER_FORMS = {  # name -> (argv, entrypoint: None = the image's, "" = none)
    "ep-dask-worker": (["dask", "worker", ADDRESS], None),
    "ep-legacy": (["dask-worker", ADDRESS], None),
    "ep-jobqueue": (["python", "-m", "distributed.cli.dask_worker", ADDRESS, "--nanny"], None),
    "raw-dask-worker": (["dask", "worker", ADDRESS], ""),
    "raw-legacy": (["dask-worker", ADDRESS], ""),
    "raw-jobqueue": (["python", "-m", "distributed.cli.dask_worker", ADDRESS, "--nanny"], ""),
    "raw-python-m-dask": (["python", "-m", "dask", "worker", ADDRESS], ""),
}
PRELOADS = """
import json, sys
import ucx_dask_gpu.gate.guard  # this client sends its environment, as every client must
from distributed import Client

def names(dask_worker):
    return [str(dask_worker.name), [p.name for p in dask_worker.preloads]]

n = int(sys.argv[2])
with Client(sys.argv[1], timeout=60) as c:
    if n:
        c.wait_for_workers(n, timeout=300)
    print(json.dumps({"scheduler": c.run_on_scheduler(lambda dask_scheduler: [p.name for p in
                                                                               dask_scheduler.preloads]),
                      "workers": dict(c.run(names).values()) if n else {},
                      "nannies": dict(c.run(names, nanny=True).values()) if n else {}}))
"""


@pytest.mark.docker
def test_every_launcher_form_loads_the_same_preloads(image):
    net = Net(image["tag"], "forms")
    try:
        sched = net.run("scheduler", ["dask", "scheduler", "--port", "8786", "--no-dashboard"],
                        aliases=("scheduler",))
        raw_sched = net.run("raw-scheduler", ["dask-scheduler", "--port", "8786", "--no-dashboard"],
                            entrypoint="", aliases=("raw-scheduler",))
        net.wait_log(sched, "Scheduler at:")
        net.wait_log(raw_sched, "Scheduler at:")
        for name, (argv, entrypoint) in WORKER_FORMS.items():
            net.run(name, [*argv, "--name", name, "--nthreads", "1", "--no-dashboard"], entrypoint=entrypoint)
        net.wait_log(sched, "Register worker", count=len(WORKER_FORMS), timeout=400)
        proc = net.client(["python", "-c", PRELOADS, ADDRESS, str(len(WORKER_FORMS))], timeout=400)
        assert proc.returncode == 0, proc.stderr[-3000:]
        seen = parse_json_output(proc.stdout)
        raw = net.client(["python", "-c", PRELOADS, "tcp://raw-scheduler:8786", "0"], timeout=300)
        assert raw.returncode == 0, raw.stderr[-3000:]
        raw_seen = parse_json_output(raw.stdout)
    finally:
        report = net.stop()
    print(json.dumps({"scheduler": seen["scheduler"], "raw-scheduler": raw_seen["scheduler"], **seen["workers"]}))
    assert seen["scheduler"] == raw_seen["scheduler"] == EVERY_ROLE
    assert seen["workers"] == {name: EVERY_ROLE for name in WORKER_FORMS}
    assert seen["nannies"] == {name: EVERY_ROLE for name in WORKER_FORMS}
    assert not report["tracebacks"], {n: report["logs"][n][-2000:] for n in report["tracebacks"]}


@pytest.mark.docker
@pytest.mark.parametrize("use_entrypoint", [None, ""], ids=["entrypoint", "no-entrypoint"])
@pytest.mark.parametrize("argv", [["dask", "cuda", "worker", "ucx://scheduler:8786"],
                                  ["dask-cuda-worker", "ucx://scheduler:8786"],
                                  ["python", "-m", "dask_cuda.cli", "ucx://scheduler:8786"]],
                         ids=["dask-cuda-worker-cli", "dask-cuda-worker", "python-m-dask_cuda.cli"])
def test_a_gpu_worker_without_a_gpu_is_one_line_in_every_form(image, argv, use_entrypoint):
    net = Net(image["tag"], "nogpu")
    try:
        proc = net.client(argv, entrypoint=use_entrypoint, timeout=300)
    finally:
        net.stop()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == NO_GPU, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "needs a GPU: no NVIDIA driver in this container (libnvidia-ml.so.1 not found" in lines[0], lines


# --- the start-up hook in a Python of this host ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory) -> Path:
    """A venv of this host's Python that sees this environment's packages (this venv's site-packages added as a site
    directory, so its own start-up lines run too) and carries the image's start-up hook, as the image's Python does."""
    venv = tmp_path_factory.mktemp("hooked") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # "aa-": site reads .pth files in name order, and the hook needs these packages when it runs.
    (Path(purelib) / "aa-this-environment.pth").write_text(
        "import site; " + "; ".join(f"site.addsitedir({d!r})" for d in site.getsitepackages()) + "\n")
    rolehook.install(purelib)
    return python


def test_python_m_dask_cuda_cli_without_a_gpu_is_one_line_through_the_hook(hooked_python, procs, shipped_config,
                                                                          tmp_path):
    if entrypoint.missing_gpu({}) is None:
        pytest.skip("a GPU is visible here")
    proc = subprocess.run([str(hooked_python), "-m", "dask_cuda.cli", "tcp://127.0.0.1:8786"], capture_output=True,
                          text=True, timeout=300, env=procs.env_for(tmp_path, shipped_config))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == NO_GPU and len(lines) == 1, proc.stderr[-3000:]
    assert f"{hooked_python} -m dask_cuda.cli needs a GPU: no NVIDIA driver" in lines[0], lines


def test_the_jobqueue_worker_form_gets_the_guard_in_its_nanny_through_the_hook(hooked_python, procs, shipped_config,
                                                                               tmp_path):
    """dask-jobqueue's `python -m distributed.cli.dask_worker ADDRESS --nanny`, pointed at a closed port: the guard
    in its nanny (which that CLI never loads from the config) ends it in one line, exit 20."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    proc = subprocess.run([str(hooked_python), "-m", "distributed.cli.dask_worker", f"tcp://127.0.0.1:{port}",
                           "--nanny", "--death-timeout", "12", "--no-dashboard", "--local-directory",
                           str(tmp_path / "space")], capture_output=True, text=True, timeout=300,
                          env=procs.env_for(tmp_path, shipped_config))
    errors = [ln for ln in proc.stderr.splitlines() if " - ERROR - " in ln]
    assert proc.returncode == SCHEDULER_UNREACHABLE, proc.stderr[-3000:]
    assert len(errors) == 1 and "ucx-dask-gpu guard: no scheduler at" in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
