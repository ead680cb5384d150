"""`ucx-dask-gpu topology` (print the per-GPU worker plan) and `ucx-dask-gpu cluster` (run it on this host)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import SYSFS_UNREADABLE, TOPOLOGY_CLUSTER_FAILED, UserError


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-topo", metavar="FILE",
                   help="plan from recorded `nvidia-smi topo -m` text instead of NVML + sysfs ('-' = stdin)")
    p.add_argument("--gpus", default="all", metavar="all|auto|LIST",
                   help="all GPUs (default), auto = the largest fully NVLink-connected subset, or indices 0,1,2")
    p.add_argument("--protocol", choices=("ucx", "tcp"), default="ucx", help="Dask protocol (default ucx)")
    p.add_argument("--no-net-devices", action="store_true",
                   help="do not set UCX_NET_DEVICES (let UCX choose the devices)")
    p.add_argument("--sysfs-root", metavar="DIR|RECORD",
                   help="read sysfs under DIR, or from a file written by --record-sysfs (default /)")


def register(sub) -> None:
    p = sub.add_parser("topology", help="the per-GPU worker plan: cores, NUMA node, nearest NIC, UCX settings",
                       description="Read GPUs, NVLinks, CPU affinity (NVML, sysfs fallback) and NICs (sysfs), "
                                   "or `nvidia-smi topo -m` text, and print one Dask worker per GPU.")
    _plan_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--record-sysfs", metavar="FILE",
                   help="also write the sysfs entries read here to FILE (a fixture for tests elsewhere)")
    p.set_defaults(func=run_topology)

    c = sub.add_parser("cluster", help="scheduler + one dask-cuda worker per GPU on this host, per the plan",
                       description="Start a LocalCUDACluster that applies the topology plan per worker "
                                   "(affinity, UCX_NET_DEVICES, interface, UCX_TLS); print the scheduler address; "
                                   "stop cleanly on SIGINT/SIGTERM.")
    _plan_args(c)
    c.add_argument("--scheduler-port", type=int, default=8786, help="scheduler port (default 8786; 0 = any)")
    c.add_argument("--dashboard-address", default=":8787", help="dashboard address, or 'none' (default :8787)")
    c.add_argument("--scheduler-file", metavar="FILE",
                   help="write {address} here once the cluster is up (Client(scheduler_file=FILE)); removed at stop")
    c.add_argument("--rmm-pool-size", default=None, help="RMM pool per worker (e.g. 0.8 or 20GB); needs rmm")
    c.add_argument("--device-memory-limit", default="default",
                   help="dask-cuda's device spill threshold per worker (default: dask-cuda's; 0 = no spilling)")
    c.add_argument("--no-pin", action="store_true", help="do not set CPU affinity")
    c.add_argument("--dry-run", action="store_true", help="print the plan and the per-worker settings, start nothing")
    c.set_defaults(func=run_cluster)


def _topology(args):
    from . import topology

    if args.from_topo:
        return topology.read_topo_file(args.from_topo)
    root = args.sysfs_root or "/"
    if os.path.isfile(root):
        try:
            record = Path(root).read_text()
        except OSError as e:
            raise UserError(f"cannot read {root}: {e.strerror}", SYSFS_UNREADABLE) from None
        with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-sysfs.") as tmp:
            return topology.from_machine(topology.materialize_sysfs(record, tmp))
    return topology.from_machine(root)


def _plan(args):
    from . import topology

    return topology.make_plan(_topology(args), gpus=args.gpus, protocol=args.protocol,
                              net_devices=not args.no_net_devices)


def run_topology(args) -> int:
    from . import topology
    from .fsutil import atomic_write_text

    plan = _plan(args)
    if args.record_sysfs:
        if args.from_topo:
            raise UserError("--record-sysfs reads this machine's sysfs; it does not combine with --from-topo")
        atomic_write_text(args.record_sysfs, topology.record_sysfs(args.sysfs_root or "/"))
        print(f"sysfs record written to {args.record_sysfs}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(topology.render_plan(plan))
    return 0


class _Interrupted(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def run_cluster(args) -> int:
    from . import topology

    plan = _plan(args)
    settings = topology.worker_settings(plan, pin=not args.no_pin)
    print(topology.render_plan(plan))
    print()
    print(topology.render_settings(settings), flush=True)
    if args.dry_run:
        return 0
    if args.from_topo:
        raise UserError("--from-topo plans another host; `cluster` runs on this one (use --dry-run to inspect)")
    try:
        from .cluster import TopologyCUDACluster
    except ImportError as e:
        raise UserError(f"cannot start the cluster: {e} (install dask-cuda and distributed-ucxx)",
                        TOPOLOGY_CLUSTER_FAILED) from None

    stop = threading.Event()
    received: list[int] = []
    started = threading.Event()

    def on_signal(signum, frame):
        received.append(signum)
        stop.set()
        if not started.is_set():       # still starting: abort the start (distributed cleans up what it began)
            raise _Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    dashboard = None if args.dashboard_address.lower() == "none" else args.dashboard_address
    kwargs = {"scheduler_port": args.scheduler_port, "dashboard_address": dashboard}
    if args.rmm_pool_size:
        kwargs["rmm_pool_size"] = args.rmm_pool_size
    if args.device_memory_limit != "default":
        kwargs["device_memory_limit"] = None if args.device_memory_limit in ("0", "none") else args.device_memory_limit
    t0 = time.monotonic()
    try:
        try:
            cluster = TopologyCUDACluster(plan, settings=settings, **kwargs)
        except _Interrupted as e:
            name = signal.Signals(e.signum).name
            raise UserError(f"{name} while the cluster was starting: stopped", TOPOLOGY_CLUSTER_FAILED) from None
        except Exception as e:  # dask raises many types; the user gets one line, with the root cause
            root = e
            for _ in range(20):
                nxt = root.__cause__ or root.__context__
                if nxt is None:
                    break
                root = nxt
            why = f" (root cause: {type(root).__name__}: {root})" if root is not e else ""
            raise UserError(f"cluster did not start: {type(e).__name__}: {e}{why}", TOPOLOGY_CLUSTER_FAILED) from None
        started.set()
        try:
            address = cluster.scheduler_address
            print(f"scheduler: {address}", flush=True)
            if dashboard:
                print(f"dashboard: {cluster.dashboard_link}", flush=True)
            print(f"{len(cluster.workers)} worker(s) up in {time.monotonic() - t0:.1f} s; "
                  "SIGINT/SIGTERM stops the cluster", flush=True)
            if args.scheduler_file:
                from .fsutil import atomic_write_text

                atomic_write_text(args.scheduler_file, json.dumps(
                    {"type": "Scheduler", "address": address, "workers": len(cluster.workers)}) + "\n")
            while not stop.wait(1.0):
                if cluster.status.name in ("closed", "closing", "failed"):
                    raise UserError(f"the cluster stopped on its own (status {cluster.status.name})",
                                    TOPOLOGY_CLUSTER_FAILED)
        finally:
            if args.scheduler_file:
                Path(args.scheduler_file).unlink(missing_ok=True)
            cluster.close(timeout=60)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    name = signal.Signals(received[0]).name if received else "signal"
    print(f"cluster stopped ({name})", file=sys.stderr)
    return 0
