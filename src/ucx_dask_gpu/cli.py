"""`ucx-dask-gpu` command line: one subcommand per module, each exposing `register(subparsers)`.

Modules keep heavy imports (dask, NVML, matplotlib) inside their run functions so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .errors import UserError

# module name -> registers one or more subcommands
COMMAND_MODULES = [
    "ucx_dask_gpu.stackcmd",
    "ucx_dask_gpu.conda.cmd",
    "ucx_dask_gpu.ucxbuild.cli",
    "ucx_dask_gpu.doctor",
    "ucx_dask_gpu.topologycmd",
    "ucx_dask_gpu.imagecmd",
    "ucx_dask_gpu.reproducible",
    "ucx_dask_gpu.sbom",
    "ucx_dask_gpu.envgate",
    "ucx_dask_gpu.daskconfig",
    "ucx_dask_gpu.workloads",
    "ucx_dask_gpu.bench.command",
    "ucx_dask_gpu.verify_nvlink",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ucx-dask-gpu", description="Run Dask on GPUs over UCX: build, verify, benchmark.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.func(args)
    except UserError as e:
        print(f"ucx-dask-gpu {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"ucx-dask-gpu {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
