"""The pieces every entry point shares: a parser whose errors are one line, options that name an output, and running a
parsed command with the project's exit codes (its outputs checked first). Standard library only: the UCX build
(ucxbuild) runs with a bare python3 and imports this, and keeping cli.py (which lists every command) out of its
imports keeps the UCX build's inputs small.
"""
from __future__ import annotations

import argparse
import os
import sys

from .errors import UserError
from .fsutil import OutputDir, OutputFile, check_output_dir, check_output_file

FILE_HELP = "a file: an existing directory there is refused (exit 9), nothing in it touched"
WORK_DIR_HELP = ("a directory, created when missing: the command's own folders in it (logs, sources, stages) are "
                 "replaced on every run; one holding anything else is refused (exit 9)")
DIR_HELP = ("a directory, created when missing: only the files named here are written in it, everything else in it "
            "is left alone; a file there is refused (exit 9)")


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2, like every other bad input
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(2)


def add_output(parser: argparse.ArgumentParser, *flags: str, kind: str = "file", stdout_dash: bool = False,
               help: str | None = None, note: str | None = None, **kwargs) -> argparse.Action:
    """An option (or positional) naming where the command writes (`kind` "file" or "dir"). run_parsed checks it
    before the command starts (exit 9); the command writes it with fsutil.write_output_file|dir (the result kept,
    exit 18, when that fails). Its --help says how an existing directory or file there is treated: FILE_HELP or
    DIR_HELP, or `note` where the command treats it otherwise (and says so)."""
    cls = OutputFile if kind == "file" else OutputDir
    option = next((f for f in flags if f.startswith("--")), None) or \
        (flags[0] if flags[0].startswith("-") else (kwargs.get("metavar") or flags[0].upper()))

    def output(text: str) -> OutputFile | OutputDir:
        value = cls(text)
        value.option = option
        value.stdout_dash = stdout_dash
        return value

    output.__name__ = f"output {kind}"  # argparse names the type in its messages
    output.output_kind = kind  # what the tests find every writing option by
    note = note or (FILE_HELP if kind == "file" else DIR_HELP)
    return parser.add_argument(*flags, type=output, help=f"{help}; {note}" if help else note, **kwargs)


def check_outputs(args: argparse.Namespace) -> None:
    """Every output the command line names, checked before anything runs (UserError, exit 9)."""
    for value in vars(args).values():
        for v in value if isinstance(value, list) else [value]:
            if isinstance(v, OutputFile):
                check_output_file(v)
            elif isinstance(v, OutputDir):
                check_output_dir(v)


def run_parsed(args: argparse.Namespace, label: str) -> int:
    """Check the outputs it names, then call the chosen command; a UserError becomes its one line on stderr and its
    exit code."""
    try:
        check_outputs(args)
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"{label}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the reader left; end as a shell's command would on SIGPIPE, silently
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's final flush must not fail again
        return 141


def standalone_main(command: str, register, argv: list[str] | None = None, description: str | None = None) -> int:
    """`python -m ucx_dask_gpu.<module> ...`: one subcommand without importing every other command's module (a bare
    GPU host carries only what that command needs)."""
    parser = Parser(prog="ucx-dask-gpu", description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    register(sub)
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return run_parsed(args, f"ucx-dask-gpu {command}")
