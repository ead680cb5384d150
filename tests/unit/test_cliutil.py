"""What every command shares: byte sizes parsed exactly as dask parses them, and progress lines."""
from __future__ import annotations

import argparse
import gc
import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from dask.utils import parse_bytes as dask_parse_bytes

from ucx_dask_gpu import cliutil
from ucx_dask_gpu.errors import USAGE, UserError

SIZES = ["0", "8", "100", "1e6", "1e6 kB", "5.4 kB", "5kB", "64MB", "64M", "64m", "64mb", "64MiB", "64mib", "64Mi",
         "1KiB", "1kib", "1K", "1k", "1GiB", "1G", "1.5GiB", "2TB", "2TiB", "1PB", "1PiB", "MB", "MiB", "kB", "",
         " 128 MiB ", "128MiB ", "-1MB", "0.5", "3B", "3b", "10 GB", "1_000", "1e3MiB", 123, 4.9, True]
REFUSED = ["5 foos", "1e", "inf", "nan", "abc", "1.2.3MB", "MB1", "1 XB", "--1"]


@pytest.mark.parametrize("text", SIZES)
def test_parse_bytes_is_dasks(text):
    assert cliutil.parse_bytes(text) == dask_parse_bytes(text)


@pytest.mark.parametrize("text", REFUSED)
def test_parse_bytes_refuses_what_dask_refuses(text):
    with pytest.raises(ValueError) as ours:
        cliutil.parse_bytes(text)
    with pytest.raises(ValueError) as dasks:
        dask_parse_bytes(text)
    assert str(ours.value) == str(dasks.value)


def test_the_units_are_dasks():
    from dask.utils import byte_sizes

    assert cliutil.BYTE_SIZES == byte_sizes


def test_the_convention_said_in_help_is_the_parsers():
    assert cliutil.parse_bytes("64MB") == cliutil.parse_bytes("64M") == 64 * 10**6
    assert cliutil.parse_bytes("64MiB") == 64 * 2**20
    assert "64MB" in cliutil.SIZE_HELP and "64MiB" in cliutil.SIZE_HELP


def test_parse_size_is_one_line_exit_2_naming_the_option():
    assert cliutil.parse_size("1MiB", "--sizes") == 1 << 20
    for text, why in (("12 parsecs", "not a byte size"), ("0", "at least 1"), ("0.5", "at least 1")):
        with pytest.raises(UserError) as e:
            cliutil.parse_size(text, "--sizes")
        assert e.value.exit_code == USAGE and str(e.value).startswith(f"--sizes {text!r}") and why in str(e.value)
    assert cliutil.parse_size("0", "--x", minimum=0) == 0


def test_progress_lines(monkeypatch):
    err, out = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.setattr("sys.stdout", out)
    cliutil.Progress("image: ")("one")
    cliutil.Progress("[conda] ", stream="stdout")("two")
    cliutil.Progress("x: ", quiet=True)("never")
    cliutil.Progress(timed=True)("three")
    steps = cliutil.Progress("verify-nvlink ", stream="stdout", total=2)
    steps("a")
    steps("aside", step=False)
    steps("b")
    assert err.getvalue().splitlines()[:1] == ["image: one"]
    assert err.getvalue().splitlines()[1].endswith("s] three") and err.getvalue().splitlines()[1].startswith("[")
    assert out.getvalue().splitlines()[0] == "[conda] two"
    assert [line.split("] ")[0].split()[1] for line in out.getvalue().splitlines()[1::2]] == ["[1/2", "[2/2"]
    assert out.getvalue().splitlines()[2] == "verify-nvlink " + " " * 16 + "aside"
    assert "never" not in err.getvalue() + out.getvalue()


def test_quiet_progress_still_counts_steps():
    p = cliutil.Progress(quiet=True, total=3)
    threads = [threading.Thread(target=p, args=("x",)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert p.step == 3


def test_a_bad_size_option_is_the_parsers_one_line(capsys):
    p = cliutil.Parser(prog="x")
    p.add_argument("--size", type=cliutil.size_type(), default=cliutil.parse_bytes("1GiB"))
    assert p.parse_args(["--size", "64MB"]).size == 64 * 10**6
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--size", "1Q"])
    err = capsys.readouterr().err
    assert e.value.code == USAGE and len(err.strip().splitlines()) == 1 and "argument --size: '1Q'" in err


# --- SIGINT / SIGTERM ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_unwinds_the_command_and_is_one_line_with_128_plus_its_number(capsys, sig):
    """SIGTERM's default would end the process without a line and without running any cleanup."""
    cleaned = []

    def command(args):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    rc = cliutil.run_parsed(argparse.Namespace(func=command), "ucx-dask-gpu x")
    assert rc == 128 + sig and cleaned == [True]
    assert capsys.readouterr().err.splitlines() == [
        f"ucx-dask-gpu x: interrupted by {signal.Signals(sig).name}; what it started has stopped"]
    assert signal.getsignal(signal.SIGTERM) is before, "the caller's handlers are put back"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_while_the_commands_are_imported_is_held_and_ends_the_command_in_one_line(capsys, sig):
    """`ucx-dask-gpu` holds signals from its first line: importing every command takes a few tenths of a second (more
    on a busy host), and a Ctrl-C then printed a traceback, a SIGTERM ended it without a line."""
    ran = []
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cliutil.hold_signals_until_run()
        os.kill(os.getpid(), sig)  # the entry point is still importing
        time.sleep(0.05)
        assert ran == []
        rc = cliutil.run_parsed(argparse.Namespace(func=lambda args: ran.append(True)), "ucx-dask-gpu x")
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert rc == 128 + sig and ran == [], "the command never starts"
    assert capsys.readouterr().err.splitlines() == [
        f"ucx-dask-gpu x: interrupted by {signal.Signals(sig).name}; what it started has stopped"]


def test_importing_the_console_scripts_module_leaves_the_signals_alone():
    """multiprocessing's spawn imports the console script (`from ucx_dask_gpu.__main__ import main`) again in every
    worker process of a local cluster: a hold there would leave each worker catching SIGTERM, which then never ends
    it."""
    code = ("import signal; import ucx_dask_gpu.__main__; "
            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, "
            "signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "True"], proc.stderr


def test_a_signal_during_cleanup_waits_for_it_and_a_second_one_cannot_cut_it_short(capsys):
    steps = []

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            with cliutil.signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while containers are being removed
                steps.append("removed")
            steps.append("after")

    assert cliutil.run_parsed(argparse.Namespace(func=command), "x") == 143
    assert steps == ["removed", "after"]


def test_signals_deferred_delivers_a_held_signal_when_done():
    with pytest.raises(cliutil.Interrupted) as e:
        previous = cliutil._on_signals()
        try:
            with cliutil.signals_deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
                held = "still here"
        finally:
            cliutil._put_back(previous)
    assert held == "still here" and e.value.signum == signal.SIGTERM


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_that_lands_in_a_gc_callback_still_ends_the_command(capsys, sig):
    """Python ignores (prints "Exception ignored in") an exception raised in a garbage-collector callback, as
    distributed's GC diagnosis installs: the signal must still end the command, with its one line."""
    steps = []

    def on_gc(phase, info):
        if phase == "start" and not steps:
            steps.append("signalled in the callback")
            signal.raise_signal(sig)   # its handler runs here, inside the callback
            sum(range(1000))

    def command(args):
        gc.callbacks.append(on_gc)
        try:
            gc.collect()
            for _ in range(500):       # 5 s of work the signal must cut short
                time.sleep(0.01)
            steps.append("ran to its end")
        finally:
            gc.callbacks.remove(on_gc)

    hook = sys.unraisablehook
    assert cliutil.run_parsed(argparse.Namespace(func=command), "ucx-dask-gpu x") == 128 + sig
    assert steps == ["signalled in the callback"]
    assert capsys.readouterr().err.splitlines() == [
        f"ucx-dask-gpu x: interrupted by {signal.Signals(sig).name}; what it started has stopped"]
    assert sys.unraisablehook is hook, "the caller's hook is put back"


FAKE_PERFTEST = """#!{python}
import socket, sys, time
port = int(sys.argv[sys.argv.index("-p") + 1])
if sys.argv[1] != "127.0.0.1":  # the server listens; both then run until stopped
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_during_a_perftest_pair_ends_both_processes(tmp_path, capsys, sig):
    """verify-nvlink's ucx_perftest server and client (their own sessions: a terminal's Ctrl-C does not reach them)
    are ended by the command when it is interrupted."""
    import sys

    from ucx_dask_gpu.ucx.perftest import run_pair

    fake = tmp_path / "ucx_perftest"
    fake.write_text(FAKE_PERFTEST.format(python=sys.executable))
    fake.chmod(0o755)
    pids: list[int] = []

    def poll(server: int, client: int) -> None:
        if not pids:
            pids.extend((server, client))
            threading.Timer(0.2, os.kill, (os.getpid(), sig)).start()

    def command(args):
        run_pair(fake, ["-t", "tag_bw"], dict(os.environ), dict(os.environ), tmp_path / "w", poll=poll)

    assert cliutil.run_parsed(argparse.Namespace(func=command), "ucx-dask-gpu verify-nvlink") == 128 + sig
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_format_bytes_is_the_parsers_other_way_round():
    from ucx_dask_gpu.cliutil import format_bytes, parse_bytes

    assert format_bytes(None) == "n/a" and format_bytes(100) == "100 B" and format_bytes(512 << 10) == "512 KiB"
    assert format_bytes(3.5 * (1 << 30)) == "3.5 GiB"
    for n in (1 << 20, 7 << 30, 123456789):
        assert abs(parse_bytes(format_bytes(n)) - n) <= 0.005 * n
