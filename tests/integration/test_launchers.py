"""The launchers Dask users deploy with, generating what they run, and that run against the image.

- dask-kubernetes: the recipe's DaskCluster spec (docker/launchers/kube_cluster.py, through the operator's own
  make_cluster_spec) and the pods the operator's controller makes of it (build_*_deployment_spec), each started as
  kubelet would start it: the image's entrypoint with the container's args (`$(VAR)` expanded from its env), its env,
  the pod name as hostname, the scheduler Service's DNS name as a network alias.
- dask-jobqueue: the recipe's SLURMCluster (docker/launchers/slurm_apptainer.py) made inside the image (the scheduler
  and client live there, dask-jobqueue on PYTHONPATH as the recipe says); its job script run by bash, with the
  container runtime in Apptainer's place (`docker run --entrypoint ''` = `apptainer exec`: no entrypoint).
- the dask Helm chart: the args its templates give scheduler and workers for docker/launchers/helm-values.yaml
  (restated from the chart's templates: no helm here), run as the pods would.
No Kubernetes, SLURM, Apptainer or helm here: what they add (scheduling, DNS, GPUs) is outside what is tested.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re
import secrets
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from ucx_dask_gpu.errors import NO_GPU
from ucx_dask_gpu.image.cluster import parse_json_output
from ucx_dask_gpu.image.docker import docker_bin

from pods import Net

pytestmark = [pytest.mark.integration, pytest.mark.docker]
ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docker" / "launchers"


def recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stop_clean(net: Net) -> dict:
    report = net.stop()
    assert not report["tracebacks"], {n: report["logs"][n][-2000:] for n in report["tracebacks"]}
    return report


def transports_line(log: str) -> str:
    return next((ln for ln in log.splitlines() if "ucx-dask-gpu transports" in ln), "")


# --- what a runtime other than Docker gives the image -----------------------------------------------------------------

# Apptainer, enroot, Podman, Kubernetes readOnlyRootFilesystem, OpenShift: the image's root read-only, a user the
# image does not know (no home of its own), a writable /tmp (docs/gpu-hosts.md).
CONSTRAINED = ("--read-only", "--tmpfs", "/tmp:exec,mode=1777", "--user", "4242:4242")


@pytest.mark.parametrize("protocol", ["ucx", "tcp"])
def test_every_role_runs_with_a_read_only_root_and_an_arbitrary_uid(image, st, protocol):
    net = Net(image["tag"], f"readonly-{protocol}")
    address = f"{protocol}://scheduler:8786"
    try:
        sched = net.run("scheduler", ["dask", "scheduler", "--protocol", protocol, "--port", "8786",
                                      "--no-dashboard"], aliases=("scheduler",), flags=CONSTRAINED)
        net.wait_log(sched, "Scheduler at:")
        net.run("worker", ["dask", "worker", address, "--nthreads", "1", "--no-dashboard"], flags=CONSTRAINED)
        net.wait_log(sched, "Register worker")
        r = net.workload(address, "--size", "1000", "--chunk", "500", flags=CONSTRAINED)
        assert r["ok"] and r["protocol"] == protocol and r["workers_start"] == 1
        if protocol == "ucx":
            assert r["ucx"]["scheduler"]["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so")
    finally:
        stop_clean(net)


# --- the spellings themselves, through the image's entrypoint ---------------------------------------------------------

def test_python_module_spellings_through_the_entrypoint(image, st):
    """`python -m distributed.cli.dask_scheduler|dask_worker` (what older job scripts and launchers run) as the
    image's roles, the same guard and transports line."""
    net = Net(image["tag"], "spellings")
    address = "ucx://scheduler:8786"
    try:
        sched = net.run("scheduler", ["python", "-m", "distributed.cli.dask_scheduler", "--protocol", "ucx",
                                      "--port", "8786", "--no-dashboard"], aliases=("scheduler",))
        net.wait_log(sched, "Scheduler at:")
        worker = net.run("worker", ["python", "-m", "distributed.cli.dask_worker", address, "--nthreads", "2",
                                    "--no-dashboard"])
        net.wait_log(sched, "Register worker")
        assert f"scheduler accepts only stack id {image['stack_id']}" in net.logs(sched)
        assert "transports automatic" in transports_line(net.logs(worker)), net.logs(worker)[-2000:]
        r = net.workload(address, "--size", "2000", "--chunk", "500")
        assert r["ok"] and r["protocol"] == "ucx" and r["workers_start"] == 1
        assert r["ucx"]["scheduler"]["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so")
    finally:
        stop_clean(net)


# --- Kubernetes: the dask-kubernetes operator ------------------------------------------------------------------------

def kubelet_expand(arg: str, env: dict) -> str:
    """Kubernetes' `$(VAR)` expansion of a container's args: defined variables are replaced, `$$` is a `$`."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)


def pod_container(container: dict) -> dict:
    """How kubelet starts a container: `command` replaces the image's entrypoint, `args` its CMD."""
    env = {}
    for e in container.get("env") or []:
        assert "value" in e, f"only literal env values are run here: {e}"
        env[e["name"]] = kubelet_expand(str(e["value"]), env)
    args = [kubelet_expand(a, env) for a in container.get("args") or []]
    command = container.get("command")
    return {"env": env, "argv": [*command[1:], *args] if command else args,
            "entrypoint": command[0] if command else None}


@pytest.mark.parametrize("proto", ["ucx", "tcp"])
def test_kubernetes_operator_pods_form_a_cluster(image, st, proto):
    from dask_kubernetes.operator.controller.controller import (build_scheduler_deployment_spec,
                                                                build_worker_deployment_spec)

    name, ns = f"udg-k8s-{secrets.token_hex(2)}", "udg"
    spec = recipe("kube_cluster").cluster_spec(name, image["tag"], n_workers=2, protocol=proto, gpus_per_node=0,
                                               namespace=ns)
    service = f"{name}-scheduler.{ns}.svc.cluster.local"
    net = Net(image["tag"], "k8s")
    try:
        dep = build_scheduler_deployment_spec(name, spec["spec"]["scheduler"]["spec"], {}, {})
        c = pod_container(dep["spec"]["template"]["spec"]["containers"][0])
        assert c["argv"][0] == "dask-scheduler" and c["entrypoint"] is None
        sched = net.run("scheduler", c["argv"], env=c["env"], aliases=(service,), hostname=dep["metadata"]["name"])
        net.wait_log(sched, "Scheduler at:")
        workers = []
        for i in range(spec["spec"]["worker"]["replicas"]):
            dep = build_worker_deployment_spec("default", ns, name, f"{i}{secrets.token_hex(2)}",
                                               spec["spec"]["worker"]["spec"], {}, {})
            c = pod_container(dep["spec"]["template"]["spec"]["containers"][0])
            assert c["argv"][:2] == ["dask-worker", "--name"] and c["argv"][2] == dep["metadata"]["name"]
            assert c["env"]["DASK_SCHEDULER_ADDRESS"] == f"{proto}://{service}:8786"
            workers.append(net.run(f"worker-{i}", c["argv"], env=c["env"], hostname=dep["metadata"]["name"]))
        net.wait_log(sched, "Register worker", count=2)
        r = net.workload(f"{proto}://{service}:8786", "--size", "4000", "--chunk", "1000")
        assert r["ok"] and r["protocol"] == proto and r["workers_start"] == 2 and r["versions_identical"]
        if proto == "ucx":
            assert all(w["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so")
                       for w in r["ucx"]["workers"].values())
        for w in workers:
            assert "transports automatic" in transports_line(net.logs(w)), net.logs(w)[-2000:]
    finally:
        stop_clean(net)


def flag_value(argv: list[str], flag: str) -> str | None:
    """What a command line's option ends up as (click and argparse: the last occurrence counts)."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]
    return values[-1] if values else None


def shm_volume(pod: dict, container: dict) -> dict:
    """The emptyDir mounted at /dev/shm in `container` of `pod`."""
    [mount] = [m for m in container.get("volumeMounts") or [] if m["mountPath"] == "/dev/shm"]
    [volume] = [v for v in pod.get("volumes") or [] if v["name"] == mount["name"]]
    return volume["emptyDir"]


@pytest.mark.parametrize("gpus, shm_size, want", [(0, None, "1Gi"), (8, None, "8Gi"), (8, "32Gi", "32Gi")])
def test_kubernetes_worker_pods_get_a_memory_backed_dev_shm_and_no_memory_limit_flag(gpus, shm_size, want):
    """The pods the operator's controller makes of the recipe's spec: /dev/shm in memory (Kubernetes' own is 64
    MiB), sized per GPU worker unless given; no --memory-limit, so dask-cuda's `auto` splits the pod's memory."""
    from dask_kubernetes.operator.controller.controller import build_worker_deployment_spec

    spec = recipe("kube_cluster").cluster_spec("udg", "img:1", n_workers=1, gpus_per_node=gpus, shm_size=shm_size)
    dep = build_worker_deployment_spec("default", "default", "udg", "w0", spec["spec"]["worker"]["spec"], {}, {})
    pod = dep["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert shm_volume(pod, container) == {"medium": "Memory", "sizeLimit": want}
    assert flag_value(pod_container(container)["argv"], "--memory-limit") is None
    assert "UCX_NET_DEVICES" not in pod_container(container)["env"]
    if shm_size:  # the recipe's command line says the same
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            recipe("kube_cluster").main(["img:1", "--gpus-per-node", "8", "--shm-size", shm_size])
        cli = yaml.safe_load(out.getvalue())["spec"]["worker"]["spec"]
        assert shm_volume(cli, cli["containers"][0]) == {"medium": "Memory", "sizeLimit": want}


def test_kubernetes_gpu_worker_pod_without_a_gpu_says_what_is_missing(image):
    spec = recipe("kube_cluster").cluster_spec("udg-gpu", image["tag"], n_workers=1, gpus_per_node=8)
    worker = spec["spec"]["worker"]["spec"]["containers"][0]
    assert worker["args"][0] == "dask-cuda-worker" and worker["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    c = pod_container(worker)
    net = Net(image["tag"], "k8s-gpu")
    try:
        proc = net.client(c["argv"], env={**c["env"], "DASK_WORKER_NAME": "w"}, timeout=120)
    finally:
        stop_clean(net)
    assert proc.returncode == NO_GPU, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert "dask cuda worker needs a GPU: no NVIDIA driver in this container" in line and "--gpus" in line


# --- the dask Helm chart ---------------------------------------------------------------------------------------------

def helm_chart_args(values: dict, release: str) -> tuple[list[str], list[str]]:
    """The args dask/helm-chart's templates (dask-scheduler-deployment.yaml, dask-worker-deployment.yaml) give the
    scheduler and the worker containers for `values` (merged over the chart's defaults that matter here)."""
    s, w = values["scheduler"], values["worker"]
    port = s.get("servicePort", 8786)
    scheduler = ["dask-scheduler", f"--port={port}", "--dashboard-address=:8787", *s.get("extraArgs", [])]
    worker = [w["image"].get("dask_worker", "dask-worker"),
              w.get("custom_scheduler_url") or f"{release}-dask-scheduler:{port}"]
    limits = (w.get("resources") or {}).get("limits")
    if limits:
        default = w.get("default_resources", {"cpu": 1, "memory": "4GiB"})
        worker += ["--nthreads", str(w.get("threads_per_worker") or limits.get("cpu") or default["cpu"]),
                   "--memory-limit", str(limits.get("memory") or default["memory"])]
    worker += ["--no-dashboard", "--dashboard-address", str(w.get("portDashboard", 8790))]
    if w.get("port"):
        worker += ["--worker-port", str(w["port"])]
    return scheduler, worker + list(w.get("extraArgs", []))


def test_helm_values_give_each_gpu_worker_its_share_of_memory_and_a_memory_backed_dev_shm():
    values = yaml.safe_load((RECIPES / "helm-values.yaml").read_text())
    scheduler, gpu_worker = helm_chart_args(values, "gpu")
    assert scheduler[-2:] == ["--protocol", "ucx"]
    assert gpu_worker[:2] == ["dask-cuda-worker", "ucx://gpu-dask-scheduler:8786"]
    # The chart passes the pod's memory limit; the values' `auto` comes last: each GPU worker gets its share.
    assert gpu_worker[2:6] == ["--nthreads", "1", "--memory-limit", values["worker"]["resources"]["limits"]["memory"]]
    assert flag_value(gpu_worker, "--memory-limit") == "auto"
    assert "default_resources" not in values["worker"]  # deprecated by the chart ("use `resources`")
    # The chart's template puts worker.mounts.volumes into the pod and .volumeMounts into the worker container.
    mounts = values["worker"]["mounts"]
    assert shm_volume({"volumes": mounts["volumes"]}, {"volumeMounts": mounts["volumeMounts"]}) == \
        {"medium": "Memory", "sizeLimit": "8Gi"}


def test_helm_chart_values_run_as_the_chart_runs_them(image):
    values = yaml.safe_load((RECIPES / "helm-values.yaml").read_text())
    # Here, CPU workers: the same values with dask-worker and no GPU limits.
    values["worker"]["image"]["dask_worker"] = "dask-worker"
    del values["worker"]["resources"]
    scheduler, worker = helm_chart_args(values, "gpu")
    net = Net(image["tag"], "helm")
    try:
        sched = net.run("scheduler", scheduler, aliases=("gpu-dask-scheduler",))
        net.wait_log(sched, "Scheduler at:")
        workers = [net.run(f"worker-{i}", worker) for i in range(2)]
        net.wait_log(sched, "Register worker", count=2)
        r = net.workload("ucx://gpu-dask-scheduler:8786", "--size", "2000", "--chunk", "500")
        assert r["ok"] and r["protocol"] == "ucx" and r["workers_start"] == 2
        assert all("transports automatic" in transports_line(net.logs(w)) for w in workers)
    finally:
        stop_clean(net)


# --- dask-jobqueue: SLURM with Apptainer --------------------------------------------------------------------------

def test_slurm_recipe_generates_apptainer_job_scripts():
    cluster = recipe("slurm_apptainer").slurm_cluster("/shared/ucx-dask-gpu.sif", gpus_per_job=4, interface="lo",
                                                      scheduler_options={"dashboard_address": ":0"})
    try:
        script = cluster.job_script()
    finally:
        cluster.close()
    assert "#SBATCH --gpus=4" in script
    command = script.strip().splitlines()[-1]
    assert command.startswith("apptainer exec --nv /shared/ucx-dask-gpu.sif python -m dask_cuda.cli ucx://")
    # The job's memory for SLURM, a quarter of it for each of the job's 4 GPU workers (dask-cuda applies the limit
    # per worker process), and RAPIDS' 64 MiB stack before Apptainer starts.
    assert "#SBATCH --mem=64G" in script.splitlines()
    assert flag_value(command.split(), "--memory-limit") == "16.00GiB"
    assert script.index("ulimit -S -s 65536") < script.index("apptainer exec")
    cpu = recipe("slurm_apptainer").slurm_cluster(None, gpus_per_job=0, memory="8GiB", python="python",
                                                  scheduler_options={"dashboard_address": ":0"})
    try:
        cpu_script = cpu.job_script()
    finally:
        cpu.close()
    assert flag_value(cpu_script.split(), "--memory-limit") == "8.00GiB" and "ulimit" not in cpu_script


JOBQUEUE_CLIENT = """
import json, sys
from distributed import Client
from slurm_apptainer import slurm_cluster
from ucx_dask_gpu.gate.identity import KEY
from ucx_dask_gpu.proof.transpose import run_transpose

proto, launch = sys.argv[1], sys.argv[2]
cluster = slurm_cluster(None, protocol=proto, gpus_per_job=0, cores=2, memory="2GiB", interface="eth0",
                        python=launch, scheduler_options={"dashboard_address": ":0"})
print("JOB-SCRIPT-BEGIN\\n" + cluster.job_script() + "\\nJOB-SCRIPT-END", flush=True)
with Client(cluster) as client:
    client.wait_for_workers(1, timeout=240)
    print("GUARD " + json.dumps(client.scheduler_info().get(KEY)), flush=True)
    print(json.dumps(run_transpose(client, 2000, 500)), flush=True)
cluster.close()
"""


def _dask_jobqueue_tree(dest: Path) -> Path:
    """dask-jobqueue as the recipe puts it on PYTHONPATH (`pip install --no-deps --target`): its files, copied."""
    dist = metadata.distribution("dask-jobqueue")
    for f in dist.files:
        src = Path(str(dist.locate_file(f)))
        if src.is_file() and not str(f).startswith(".."):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / f)
    return dest


@pytest.mark.parametrize("proto", ["ucx", "tcp"])
def test_slurm_job_script_joins_a_scheduler_running_in_the_image(image, st, proto, tmp_path):
    jq = _dask_jobqueue_tree(tmp_path / "jq")
    net = Net(image["tag"], "slurm")
    job = f"{net.name}-job"
    # Apptainer's `exec IMAGE python` on a compute node: the image's python, no entrypoint.
    launch = f"{docker_bin()} run --rm --entrypoint '' --network {net.name} --label {net.label()} --name {job} " \
             f"{image['tag']} python"
    args = net.run_args(f"{net.name}-scheduler", ["python", "-", proto, launch], detach=False,
                        env={"PYTHONPATH": "/opt/jq:/recipes"}, volumes=(f"{jq}:/opt/jq:ro", f"{RECIPES}:/recipes:ro"))
    client = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    jobrun = None
    try:
        client.stdin.write(JOBQUEUE_CLIENT)
        client.stdin.close()
        client.stdin = None  # communicate() below must not flush it again
        lines = []
        for line in client.stdout:
            if line.strip() == "JOB-SCRIPT-END":
                break
            lines.append(line)
        script = "".join(lines[lines.index("JOB-SCRIPT-BEGIN\n") + 1:])
        assert "#SBATCH" in script and f"{launch} -m distributed.cli.dask_worker {proto}://" in script, script
        (tmp_path / "job.sh").write_text(script)
        with open(tmp_path / "job.log", "w") as log:
            jobrun = subprocess.Popen(["bash", str(tmp_path / "job.sh")], stdout=log, stderr=subprocess.STDOUT)
            out, err = client.communicate(timeout=400)
        assert client.returncode == 0, err[-3000:]
        r = parse_json_output(out)
        assert r["ok"] and r["protocol"] == proto and r["workers_start"] == 1
        if proto == "ucx":
            assert all(x["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so")
                       for x in [r["ucx"]["client"], r["ucx"]["scheduler"], *r["ucx"]["workers"].values()])
        # The scheduler (in the image) runs the guard, which admitted the job's worker: same environment contract
        # (dask-jobqueue, only on the client's side, is not part of it).
        guard = json.loads(next(ln[len("GUARD "):] for ln in out.splitlines() if ln.startswith("GUARD ")))
        assert guard and guard["stack-id"] == image["stack_id"], guard
        subprocess.run([docker_bin(), "stop", "-t", "30", job], capture_output=True)
        jobrun.wait(60)
        worker_log = (tmp_path / "job.log").read_text()
        assert "transports automatic" in transports_line(worker_log), worker_log[-2000:]
        # The client's cluster.close() ends the scheduler first (as on SLURM): the worker stops for that reason. What
        # dask logs on the worker after its scheduler is gone (a UCX comm closing under it) is dask's own; before
        # that, nothing went wrong.
        running, closed, _ = worker_log.partition("Reason: scheduler-close")
        assert closed and "Traceback (most recent call last)" not in running, worker_log[-3000:]
    finally:
        if client.poll() is None:
            client.kill()
        subprocess.run([docker_bin(), "rm", "-f", job, f"{net.name}-scheduler"], capture_output=True)
        if jobrun is not None and jobrun.poll() is None:
            jobrun.kill()
        stop_clean(net)
