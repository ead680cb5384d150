"""`ucx-dask-gpu` command line: one subcommand per module, each exposing `register(subparsers)`.

Modules keep heavy imports (dask, NVML, matplotlib) inside their run functions so `--help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import __version__
from .cliutil import Parser, run_parsed

# module name -> registers one or more subcommands
COMMAND_MODULES = [
    "ucx_dask_gpu.stack.cli",
    "ucx_dask_gpu.conda.cli",
    "ucx_dask_gpu.ucxbuild.cli",
    "ucx_dask_gpu.ucx.cli",
    "ucx_dask_gpu.topology.cli",
    "ucx_dask_gpu.image.cli",
    "ucx_dask_gpu.gate.cli",
    "ucx_dask_gpu.proof.cli",
    "ucx_dask_gpu.bench.cli",
    "ucx_dask_gpu.nvlink.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ucx-dask-gpu", description="Run Dask on GPUs over UCX: build, verify, benchmark.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_parsed(args, f"ucx-dask-gpu {args.command}")

if __name__ == "__main__":
    sys.exit(main())
