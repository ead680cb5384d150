"""Dask on Kubernetes from the ONE image, with the dask-kubernetes operator: a scheduler pod and one worker pod per
GPU node, over UCX.

    pip install dask-kubernetes           # the version stack.toml [test_tools] pins was tested
    python kube_cluster.py REGISTRY/ucx-dask-gpu:TAG --name gpu --workers 4 --gpus-per-node 8 > cluster.yaml
    kubectl apply -f cluster.yaml         # or, from Python: KubeCluster(custom_cluster_spec=cluster_spec(...))

What the spec does, and why:
- the operator runs `dask-scheduler` and `dask-worker`/`dask-cuda-worker` (make_cluster_spec): the image's
  entrypoint takes those spellings, and the image's /etc/dask (guard, transports line, UCX transports left to UCX)
  applies to every pod, with or without the entrypoint;
- UCX: the scheduler gets `--protocol ucx` and the workers DASK_SCHEDULER_ADDRESS=ucx://... (the controller only
  adds its tcp:// address when the pod spec has none);
- one worker POD per node holding all its GPUs (`nvidia.com/gpu: N`): `dask-cuda-worker` starts one worker process
  per GPU inside it, so they share the pod's IPC and PID namespaces and cuda_ipc works between them. Separate pods
  on one node do not share them (only hostIPC/hostPID would), and UCX still selects cuda_ipc between them (it
  compares boot ids only): the scheduler log warns when it sees that;
- a memory-backed /dev/shm in every worker pod (an `emptyDir` with `medium: Memory`, --shm-size, default 1Gi per GPU
  worker, as `docker run --shm-size 1g` gives each worker container): Kubernetes gives a container 64 MiB, and UCX's
  shared-memory transports between the pod's worker processes live there. Its pages count against the pod's memory
  limit where one is set;
- host memory per GPU worker: dask-cuda-worker's default `--memory-limit auto` gives each worker process its share of
  the pod's memory limit (or of the node's memory), so no flag is passed;
- InfiniBand (--infiniband): the RDMA device resource of your device plugin, IPC_LOCK and host networking (rdmacm
  needs the node's IB addresses);
- ulimits: a pod spec has no field for them. memlock (RDMA) and the 64 MiB stack RAPIDS gives its `docker run` lines
  (`--ulimit stack=67108864`) come from the node's container runtime (containerd's or CRI-O's default rlimits; RDMA
  nodes usually run with memlock unlimited).
"""
from __future__ import annotations

import argparse
import sys

from dask_kubernetes.operator import make_cluster_spec


def cluster_spec(name: str, image: str, n_workers: int = 2, protocol: str = "ucx", gpus_per_node: int = 1,
                 namespace: str = "default", infiniband: bool = False, rdma_resource: str = "rdma/ib",
                 shm_size: str | None = None) -> dict:
    """A DaskCluster resource (dict); gpus_per_node=0 gives CPU workers (`dask-worker`). `shm_size` (a Kubernetes
    quantity) sizes each worker pod's /dev/shm: default 1Gi per GPU worker (1Gi for a CPU worker)."""
    spec = make_cluster_spec(name=name, image=image, n_workers=n_workers,
                             worker_command="dask-cuda-worker" if gpus_per_node else "dask-worker")
    scheduler = spec["spec"]["scheduler"]["spec"]["containers"][0]
    worker = spec["spec"]["worker"]["spec"]["containers"][0]
    if protocol != "tcp":
        scheduler["args"] += ["--protocol", protocol]
        worker["env"] = [{"name": "DASK_SCHEDULER_ADDRESS",
                          "value": f"{protocol}://{name}-scheduler.{namespace}.svc.cluster.local:8786"}]
    limits = {}
    if gpus_per_node:
        limits["nvidia.com/gpu"] = gpus_per_node
    if infiniband:
        limits[rdma_resource] = 1
        worker["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
        spec["spec"]["worker"]["spec"]["hostNetwork"] = True
        spec["spec"]["worker"]["spec"]["dnsPolicy"] = "ClusterFirstWithHostNet"
    if limits:
        worker["resources"] = {"limits": limits}
    spec["spec"]["worker"]["spec"]["volumes"] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size or f"{max(gpus_per_node, 1)}Gi"}}]
    worker["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    for container in (scheduler, worker):  # the API server drops null fields; the operator's controller needs that
        for key in [k for k, v in container.items() if v is None]:
            del container[key]
    return spec


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(description="print a DaskCluster resource for the ucx-dask-gpu image")
    p.add_argument("image")
    p.add_argument("--name", default="ucx-dask-gpu")
    p.add_argument("--namespace", default="default")
    p.add_argument("--workers", type=int, default=2, help="worker pods (GPU nodes)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="GPUs per worker pod (0: CPU workers)")
    p.add_argument("--protocol", choices=["ucx", "tcp"], default="ucx")
    p.add_argument("--infiniband", action="store_true")
    p.add_argument("--shm-size", metavar="QUANTITY",
                   help="memory-backed /dev/shm per worker pod, e.g. 16Gi (default: 1Gi per GPU worker)")
    a = p.parse_args(argv)
    spec = cluster_spec(a.name, a.image, a.workers, a.protocol, a.gpus_per_node, a.namespace, a.infiniband,
                        shm_size=a.shm_size)
    spec["metadata"]["namespace"] = a.namespace
    yaml.safe_dump(spec, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
