"""`ucx-dask-gpu doctor`: what this environment really uses (UCX, UCXX, CUDA, GPUs, NVLink, stack id)."""
from __future__ import annotations

import argparse
import json

from . import doctor
from .install import PREFIX_ENV


def _cmd_doctor(args) -> int:
    report = doctor.collect(args.ucx_prefix)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(doctor.render(report))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="what this environment really uses: UCX, UCXX, CUDA, GPUs, NVLink, stack id")
    p.add_argument("--ucx-prefix", help=f"UCX prefix to load (default: ${PREFIX_ENV}, the image's prefix "
                                        f"(stack.toml [image].ucx_prefix), else the loader's search path)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)
