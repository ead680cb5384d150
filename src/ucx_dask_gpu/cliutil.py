"""The pieces every entry point shares: a parser whose errors are one line, and running a parsed command with the
project's exit codes. Standard library only: the UCX build (ucxbuild) runs with a bare python3 and imports this,
and keeping cli.py (which lists every command) out of its imports keeps the UCX build's inputs small.
"""
from __future__ import annotations

import argparse
import sys

from .errors import UserError


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def run_parsed(args: argparse.Namespace, label: str) -> int:
    """Call the chosen command; a UserError becomes its one line on stderr and its exit code."""
    try:
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"{label}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130


def standalone_main(command: str, register, argv: list[str] | None = None, description: str | None = None) -> int:
    """`python -m ucx_dask_gpu.<module> ...`: one subcommand without importing every other command's module (a bare
    GPU host carries only what that command needs)."""
    parser = Parser(prog="ucx-dask-gpu", description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    register(sub)
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return run_parsed(args, f"ucx-dask-gpu {command}")
