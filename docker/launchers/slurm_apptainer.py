"""Dask on SLURM from the ONE image, with dask-jobqueue and Apptainer: every worker job runs the image's Python.

    apptainer build ucx-dask-gpu.sif docker-daemon://REGISTRY/ucx-dask-gpu:TAG     # or docker://... from a registry
    # the scheduler and your client live in the same image (the guard refuses other environments); dask-jobqueue is
    # not in the image: put it on PYTHONPATH (pure Python, it needs only dask and distributed, which the image has)
    pip install --no-deps --target ~/jq dask-jobqueue    # the version stack.toml [test_tools] pins was tested
    APPTAINERENV_PYTHONPATH=~/jq apptainer exec --nv ucx-dask-gpu.sif python my_analysis.py

    # my_analysis.py
    from slurm_apptainer import slurm_cluster
    cluster = slurm_cluster("/shared/ucx-dask-gpu.sif", gpus_per_job=4, interface="ib0")
    cluster.scale(jobs=2)
    client = Client(cluster)

What the job script runs, and why:
- `apptainer exec --nv IMAGE.sif python -m dask_cuda.cli ADDRESS ...` (`distributed.cli.dask_worker` for CPU jobs):
  `exec` bypasses the image's entrypoint, so everything rides on the image's /etc/dask (guard, transports line,
  UCX transports left to UCX), which Apptainer reads like any file of the image; --nv binds the node's driver;
- one job per node with all its GPUs: dask-cuda starts one worker process per GPU inside the job, sharing its
  namespaces, so cuda_ipc works between them; Apptainer shares the host's IPC and PID namespaces by default;
- `memory` is the job's (`#SBATCH --mem`); dask-cuda applies `--memory-limit` to EACH of its worker processes, so
  each GPU worker gets an equal share: memory / gpus_per_job;
- GPU jobs raise the soft stack limit to the 64 MiB RAPIDS gives its `docker run` lines (`--ulimit stack=67108864`)
  before starting Apptainer, whose processes keep the job's limits;
- `interface="ib0"`: the scheduler listens on the InfiniBand interface, so UCX connects through rdmacm.
"""
from __future__ import annotations

import dask
from dask.utils import format_bytes, parse_bytes

STACK_KIB = 65536


def slurm_cluster(image_sif: str | None, protocol: str = "ucx", gpus_per_job: int = 1, cores: int = 8,
                  memory: str = "64GiB", interface: str | None = None, python: str | None = None, **kwargs):
    """A dask_jobqueue.SLURMCluster whose workers run in `image_sif` (or through `python`, a command that runs the
    image's Python); gpus_per_job=0 gives CPU workers. `memory` is the whole job's."""
    from dask_jobqueue import SLURMCluster  # only where a cluster is made
    from dask_jobqueue.slurm import slurm_format_bytes_ceil

    extra = list(kwargs.pop("job_extra_directives", []))
    if gpus_per_job:
        extra.append(f"--gpus={gpus_per_job}")
        prologue = kwargs.get("job_script_prologue") or dask.config.get("jobqueue.slurm.job-script-prologue", [])
        kwargs["job_script_prologue"] = [*prologue, f"ulimit -S -s {STACK_KIB}"]
        kwargs.setdefault("job_mem", slurm_format_bytes_ceil(parse_bytes(memory)))
        memory = format_bytes(parse_bytes(memory) // gpus_per_job).replace(" ", "")
    scheduler_options = {"protocol": protocol, **({"interface": interface} if interface else {}),
                         **kwargs.pop("scheduler_options", {})}
    return SLURMCluster(
        python=python or f"apptainer exec --nv {image_sif} python",
        worker_command="dask_cuda.cli" if gpus_per_job else "distributed.cli.dask_worker",
        cores=cores, processes=1, memory=memory, interface=interface, job_extra_directives=extra,
        scheduler_options=scheduler_options, **kwargs)
