"""`ucx-dask-gpu guard show` (this environment's identity) and `ucx-dask-gpu config install|show` (the dask config
that loads the guard on every role)."""
from __future__ import annotations

import argparse
import json
import sys

from . import daskconfig, identity


def _cmd_guard_show(args) -> int:
    sid, source = identity.stack_id()
    pkgs = identity.installed_packages()
    info = {"stack_id": sid, "source": source, "packages": len(pkgs), "packages_sha256": identity.packages_digest(pkgs)}
    if args.json:
        print(json.dumps(info))
    else:
        print(f"stack id {sid or 'none'} (from {source}); {len(pkgs)} packages, digest {info['packages_sha256']}")
    return 0


def _cmd_config_install(args) -> int:
    for path in daskconfig.install(args.dest, args.transports):
        print(f"wrote {path}")
    return 0


def _cmd_config_show(args) -> int:
    for name, text in daskconfig.render(args.transports).items():
        sys.stdout.write(f"# ---- {name}\n{text}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("guard", help="the environment gate that refuses mismatched Dask workers and clients")
    s = p.add_subparsers(dest="guard_command", metavar="ACTION", required=True)
    sh = s.add_parser("show", help="print this environment's stack id (and where it came from) and package digest")
    sh.add_argument("--json", action="store_true")
    sh.set_defaults(func=_cmd_guard_show)

    p = sub.add_parser("config", help="the dask config shipped for the image (guard preloads, UCX transports)")
    s = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    i = s.add_parser("install", help="write ucx-dask-gpu.yaml + ucx-dask-gpu-transports.yaml into a dask config dir")
    i.add_argument("--dest", required=True, help="dask config directory, e.g. /etc/dask")
    i.add_argument("--transports", choices=["auto", "cpu", "gpu"], default="auto",
                   help="UCX transports: auto = UCX selects on every host (default); opt-in pins: cpu = UCX over "
                        "TCP only, gpu = NVLink + cuda_copy + TCP (no shared memory, no InfiniBand)")
    i.set_defaults(func=_cmd_config_install)
    sh = s.add_parser("show", help="print the files `install` would write")
    sh.add_argument("--transports", choices=["auto", "cpu", "gpu"], default="auto")
    sh.set_defaults(func=_cmd_config_show)
