"""`ucx-dask-gpu` command line: every folder's cli.py registers its subcommands (`register(subparsers)`).

Every module here starts with the standard library alone: third-party libraries (dask, NVML, matplotlib, ...) are
imported where a command needs them, so `--help` is fast and `stack get` runs on a bare python3.
"""
from __future__ import annotations

import argparse
import sys

from . import package_version
from .bench import cli as bench
from .cliutil import Parser, run_parsed
from .conda import cli as conda
from .errors import UserError
from .gate import cli as gate
from .image import cli as image
from .nvlink import cli as nvlink
from .proof import cli as proof
from .stack import cli as stack
from .topology import cli as topology
from .ucx import cli as ucx
from .ucxbuild import cli as ucxbuild

# In the order `--help` lists them.
FOLDERS = (stack, conda, ucxbuild, ucx, topology, image, gate, proof, bench, nvlink)


class _Version(argparse.Action):
    """--version: the version is read when asked for (from stack.toml in a source tree), its failure one line."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            print(f"{parser.prog} {package_version()}")
        except UserError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            parser.exit(e.exit_code)
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ucx-dask-gpu", description="Run Dask on GPUs over UCX: build, verify, benchmark.")
    parser.add_argument("--version", action=_Version, help="show the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    for folder in FOLDERS:
        folder.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_parsed(args, f"ucx-dask-gpu {args.command}")
