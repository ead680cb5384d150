"""`ucx-dask-gpu topology` (print the per-GPU worker plan) and `ucx-dask-gpu cluster` (run it on this host)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from ..cliutil import SIZE_HELP, add_output
from ..errors import SYSFS_UNREADABLE, UserError
from ..fsutil import write_output_file
from . import cluster
from .machine import from_machine, materialize_sysfs, record_sysfs
from .plan import make_plan, render_plan, render_settings, worker_settings
from .topotext import read_topo_file


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from-topo", metavar="FILE",
                   help="plan from recorded `nvidia-smi topo -m` text instead of NVML + sysfs ('-' = stdin)")
    p.add_argument("--gpus", default="all", metavar="all|auto|LIST",
                   help="all GPUs (default), auto = the largest fully NVLink-connected subset, or indices 0,1,2")
    p.add_argument("--protocol", choices=("ucx", "tcp"), default="ucx", help="Dask protocol (default ucx)")
    p.add_argument("--net-devices", action="store_true",
                   help="pin each worker's UCX_NET_DEVICES to its nearest NIC (default: UCX pairs GPUs and NICs "
                        "itself, as dask-cuda recommends)")
    p.add_argument("--sysfs-root", metavar="DIR|RECORD",
                   help="read sysfs under DIR, or from a file written by --record-sysfs (default /)")


def register(sub) -> None:
    p = sub.add_parser("topology", help="the per-GPU worker plan: cores, NUMA node, nearest NIC, UCX settings",
                       description="Read GPUs, NVLinks, CPU affinity (NVML, sysfs fallback) and NICs (sysfs), "
                                   "or `nvidia-smi topo -m` text, and print one Dask worker per GPU.")
    _plan_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_output(p, "--record-sysfs", metavar="FILE",
               help="also write the sysfs entries read here to FILE (a fixture for tests elsewhere)")
    p.set_defaults(func=run_topology)

    c = sub.add_parser("cluster", help="scheduler + one dask-cuda worker per GPU on this host, per the plan",
                       description="Start a LocalCUDACluster that applies the topology plan per worker "
                                   "(affinity, interface, UCX_TLS; UCX_NET_DEVICES with --net-devices); print the "
                                   "scheduler address; stop cleanly on SIGINT/SIGTERM.")
    _plan_args(c)
    c.add_argument("--scheduler-port", type=int, default=8786, help="scheduler port (default 8786; 0 = any)")
    c.add_argument("--dashboard-address", default=":8787", help="dashboard address, or 'none' (default :8787)")
    add_output(c, "--scheduler-file", metavar="FILE",
               help="write {address} here once the cluster is up (Client(scheduler_file=FILE)); removed at stop")
    c.add_argument("--rmm-pool-size", default=None,
                   help=f"RMM pool per worker: a fraction of the GPU's memory or a size (0.8, 20GB); needs rmm; "
                        f"{SIZE_HELP}")
    c.add_argument("--device-memory-limit", default="default",
                   help="dask-cuda's device spill threshold per worker, a fraction or a size as --rmm-pool-size "
                        "(default: dask-cuda's; 0 = no spilling)")
    c.add_argument("--no-pin", action="store_true", help="do not set CPU affinity")
    c.add_argument("--dry-run", action="store_true", help="print the plan and the per-worker settings, start nothing")
    c.set_defaults(func=run_cluster)


def _topology(args):
    if args.from_topo:
        return read_topo_file(args.from_topo)
    root = args.sysfs_root or "/"
    if os.path.isfile(root):
        try:
            record = Path(root).read_text()
        except OSError as e:
            raise UserError(f"cannot read {root}: {e.strerror}", SYSFS_UNREADABLE) from None
        with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-sysfs.") as tmp:
            return from_machine(materialize_sysfs(record, tmp))
    return from_machine(root)


def _plan(args):
    return make_plan(_topology(args), gpus=args.gpus, protocol=args.protocol, net_devices=args.net_devices)


def run_topology(args) -> int:
    plan = _plan(args)
    if args.record_sysfs:
        if args.from_topo:
            raise UserError("--record-sysfs reads this machine's sysfs; it does not combine with --from-topo")
        write_output_file(args.record_sysfs, record_sysfs(args.sysfs_root or "/"), what="the record")
        print(f"sysfs record written to {args.record_sysfs}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render_plan(plan))
    return 0


def run_cluster(args) -> int:
    plan = _plan(args)
    settings = worker_settings(plan, pin=not args.no_pin)
    print(render_plan(plan))
    print()
    print(render_settings(settings), flush=True)
    if args.dry_run:
        return 0
    if args.from_topo:
        raise UserError("--from-topo plans another host; `cluster` runs on this one (use --dry-run to inspect)")
    kwargs = {"scheduler_port": args.scheduler_port}
    if args.rmm_pool_size:
        kwargs["rmm_pool_size"] = args.rmm_pool_size
    if args.device_memory_limit != "default":
        kwargs["device_memory_limit"] = None if args.device_memory_limit in ("0", "none") else args.device_memory_limit
    dashboard = None if args.dashboard_address.lower() == "none" else args.dashboard_address
    return cluster.serve(plan, settings, scheduler_file=args.scheduler_file, dashboard=dashboard, **kwargs)
