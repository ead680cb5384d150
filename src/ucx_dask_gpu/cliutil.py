"""The pieces every entry point shares: a parser whose errors are one line, options that name an output, byte sizes
as dask spells them, progress lines, and running a parsed command with the project's exit codes (its outputs checked
first; SIGINT and SIGTERM unwinding it, so what it started is stopped, then 130/143). Standard library only: the UCX
build (ucxbuild) runs with a bare python3 and imports this, and keeping cli.py (which lists every command) out of its
imports keeps the UCX build's inputs small.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import threading
import time

from .errors import USAGE, UserError
from .fsutil import OutputDir, OutputFile, check_output_dir, check_output_file

FILE_HELP = "a file: an existing directory there is refused (exit 9), nothing in it touched"
WORK_DIR_HELP = ("new, empty, or one this command worked in before (its mark): its own folders in it (logs, sources, "
                 "stages) are replaced on every run; one holding anything else is refused (exit 9)")
DIR_HELP = ("a directory, created when missing: only the files named here are written in it, everything else in it "
            "is left alone; a file there is refused (exit 9)")


# Byte sizes, one convention everywhere: dask's (dask.utils.parse_bytes, whose exact semantics parse_bytes below has,
# without importing dask: commands that start on a bare python3 parse sizes as the rest do).
SIZE_HELP = "sizes as dask spells them: 64MB or 64M = 64*10^6 bytes, 64MiB = 64*2^20"
_DECIMAL = {"kB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_BINARY = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
BYTE_SIZES = {**{k.lower(): v for k, v in {**_DECIMAL, **_BINARY, "B": 1, "": 1}.items()},
              **{k[0].lower(): v for k, v in _DECIMAL.items()},          # k, m, g, t, p: decimal, as kB ...
              **{k[:-1].lower(): v for k, v in _BINARY.items()}}         # ki, mi, ...: binary, as KiB ...


def parse_bytes(s: float | str) -> int:
    """'100MB' -> 100000000, '1 MiB' -> 1048576, '5.4kB' -> 5400, '1e6' -> 1000000, 'MB' -> 1000000; ValueError
    otherwise. What dask.utils.parse_bytes returns for every input it accepts (a unit test compares them)."""
    if isinstance(s, (int, float)):
        return int(s)
    s = s.replace(" ", "")
    if not any(char.isdigit() for char in s):
        s = f"1{s}"
    index = len(s)
    while index > 0 and s[index - 1].isalpha():
        index -= 1
    prefix, suffix = s[:index], s[index:]
    try:
        n = float(prefix)
    except ValueError as e:
        raise ValueError(f"Could not interpret '{prefix}' as a number") from e
    try:
        multiplier = BYTE_SIZES[suffix.lower()]
    except KeyError as e:
        raise ValueError(f"Could not interpret '{suffix}' as a byte unit") from e
    if not math.isfinite(n * multiplier):  # '1e999': dask's int() of it raises OverflowError, which no caller expects
        raise ValueError(f"Could not interpret '{prefix}' as a finite number")
    return int(n * multiplier)


def format_bytes(n: float | None) -> str:
    """The other way round from parse_bytes: 3.5 GiB, 512 KiB, 100 B (3 significant digits); 'n/a' for None."""
    if n is None:
        return "n/a"
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.3g} {unit}"
    return f"{n:.0f} B"


# Longer is no size anyone types ('1.5 GiB' is 7): refused before float() reads a megabyte of digits.
MAX_SIZE_CHARS = 64


def _checked_size(text: str, minimum: int) -> int:
    try:
        if len(text) > MAX_SIZE_CHARS:
            raise ValueError(text)
        size = parse_bytes(text)
    except (ValueError, TypeError):
        shown = text if len(text) <= MAX_SIZE_CHARS else f"{text[:MAX_SIZE_CHARS]}...({len(text)} characters)"
        raise ValueError(f"{shown!r}: not a byte size ({SIZE_HELP})") from None
    if size < minimum:
        raise ValueError(f"{text!r}: {size} bytes, at least {minimum} needed")
    return size


def parse_size(text: str, option: str, minimum: int = 1) -> int:
    """A byte size given to `option` (parse_bytes), at least `minimum`; UserError(USAGE), one line, otherwise."""
    try:
        return _checked_size(text, minimum)
    except ValueError as e:
        raise UserError(f"{option} {e}", USAGE) from None


def size_type(minimum: int = 1):
    """An argparse `type=` for a byte size: a bad one is the parser's one-line error (exit 2)."""
    def byte_size(text: str) -> int:
        try:
            return _checked_size(text, minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return byte_size


def number_type(convert, low: float, what: str):
    """An argparse `type=` for a number (`convert`: int or float) of at least `low`: a bad one is the parser's one-line
    error (exit 2)."""
    def number(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"expected {what} >= {low}, got {text}")
        return v

    return number


class Progress:
    """A command's progress lines: `prefix` + the message, flushed, on stderr (on stdout where `stream` says so: the
    commands whose stdout is a log of their steps); nothing when `quiet`. `timed`: each line says the seconds since
    the start; `total`: each step says which of `total` it is, and the seconds. Safe to call from several threads."""

    def __init__(self, prefix: str = "", *, stream: str = "stderr", quiet: bool = False, timed: bool = False,
                 total: int | None = None):
        self.prefix, self.stream, self.quiet, self.timed, self.total = prefix, stream, quiet, timed, total
        self.step, self.start, self.lock = 0, time.monotonic(), threading.Lock()

    def __call__(self, msg: str, step: bool = True) -> None:
        with self.lock:
            if self.total is not None and step:
                self.step += 1
            if self.quiet:
                return
            head, elapsed = "", time.monotonic() - self.start
            if self.total is not None:
                head = f"[{self.step}/{self.total} {elapsed:5.0f}s] " if step else " " * 16
            elif self.timed:
                head = f"[{elapsed:7.1f}s] "
            # the stream is looked up at each line: a caller that redirects sys.stdout/stderr gets the lines
            print(f"{self.prefix}{head}{msg}", file=getattr(sys, self.stream), flush=True)


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


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM (`docker stop`, `timeout`, systemd) arrived: raised where the command is, so every
    `finally` and context manager on the way out stops the containers, clusters and processes it started."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    # Only the first signal interrupts: a second Ctrl-C (or a SIGTERM after it) must not cut short the cleanup the
    # first one started, which is what would leave containers, networks and volumes behind.
    if not getattr(_interrupt, "raised", False):
        _interrupt.raised = True
        raise Interrupted(signum)


def _redeliver_swallowed(unraisable) -> None:
    """sys.unraisablehook while a command runs. A signal that arrives while Python runs a garbage-collector callback
    (distributed's GC diagnosis has one), a __del__ or a weakref callback raises Interrupted there, where Python only
    prints "Exception ignored" and goes on: the command would run to its end and exit 0. Deliver it again, from a
    thread, so that it lands once that callback has returned (again, should it land in another one)."""
    exc = unraisable.exc_value
    if not isinstance(exc, Interrupted):
        _redeliver_swallowed.previous(unraisable)
        return
    _interrupt.raised = False  # it never reached the command: the next delivery is the first one

    def again():
        time.sleep(0.01)
        signal.pthread_kill(threading.main_thread().ident, exc.signum)

    threading.Thread(target=again, name="signal-redelivery", daemon=True).start()


def _on_signals() -> dict:
    """SIGINT and SIGTERM raise Interrupted in the main thread (SIGTERM's default would end the process without a
    line and without cleanup); returns the handlers to put back (sys.unraisablehook under the key None)."""
    _interrupt.raised = False
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous: dict = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[None], _redeliver_swallowed.previous = sys.unraisablehook, sys.unraisablehook
    sys.unraisablehook = _redeliver_swallowed
    return previous


def _put_back(previous: dict) -> None:
    for s, handler in previous.items():
        if s is None:
            sys.unraisablehook = handler
        else:
            signal.signal(s, handler)


def _hold(held: list[int]) -> dict:
    """SIGINT and SIGTERM appended to `held` instead of acting; returns the handlers they had."""
    return {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}


_held_before_run: list[int] = []


def hold_signals_until_run() -> None:
    """An entry point's first step, before it imports the commands (a few tenths of a second, more on a busy host): a
    Ctrl-C or SIGTERM arriving then is kept, and run_parsed delivers it, so it too ends in one line and 130/143
    instead of a traceback (SIGINT) or a silent end (SIGTERM)."""
    if threading.current_thread() is threading.main_thread():
        _hold(_held_before_run)


@contextlib.contextmanager
def signals_deferred():
    """Cleanup that must run to its end (stopping containers, removing a network): SIGINT/SIGTERM arriving meanwhile
    are held and delivered once it is done, to whatever handler is in place then."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = _hold(held)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if held:
            signal.raise_signal(held[0])


def run_parsed(args: argparse.Namespace, label: str) -> int:
    """Check the outputs it names, then call the chosen command; a UserError becomes its one line on stderr and its
    exit code; SIGINT/SIGTERM one line and 130/143, after what the command started has stopped."""
    previous = _on_signals()
    try:
        if _held_before_run:
            signal.raise_signal(_held_before_run.pop(0))
        check_outputs(args)
        return int(args.func(args) or 0)
    except UserError as e:
        print(f"{label}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"{label}: interrupted by {signal.Signals(signum).name}; what it started has stopped", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # `... | head`: the reader left; end as a shell's command would on SIGPIPE, silently
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's final flush must not fail again
        return 141
    finally:
        _put_back(previous)


def standalone_main(command: str, register, argv: list[str] | None = None, description: str | None = None) -> int:
    """`python -m ucx_dask_gpu.<module> ...`: one subcommand without importing every other command's module (a bare
    GPU host carries only what that command needs)."""
    parser = Parser(prog="ucx-dask-gpu", description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True
    register(sub)
    args = parser.parse_args([command, *(sys.argv[1:] if argv is None else argv)])
    return run_parsed(args, f"ucx-dask-gpu {command}")
