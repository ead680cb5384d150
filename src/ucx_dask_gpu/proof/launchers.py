"""A Dask cluster of separate processes, started with the launchers users run (`dask scheduler`, `dask worker`,
`dask cuda worker`), each process in a session of its own (what it spawns stops with it), its output in a log file:
`bench idle`'s clusters and the integration tests'.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path


def stop_sessions(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM to each process's session (each was started in one of its own: what it spawned goes too), in order,
    then SIGKILL to those not gone after `grace` seconds."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=grace)


class DaskProcess:
    """One process in a session of its own, its stdout and stderr in `log`; `scheduler()` and `worker()` start
    Dask's launchers."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: Path):
        self.log, self.scheduler_file = log, None
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    @classmethod
    def scheduler(cls, python: str, env: Mapping[str, str], directory: Path, name: str = "scheduler",
                  protocol: str = "tcp") -> DaskProcess:
        """`dask scheduler` on 127.0.0.1, any free port; its address in DIRECTORY/NAME.json (`address()`)."""
        sched_file = directory / f"{name}.json"
        self = cls([python, "-m", "dask", "scheduler", "--protocol", protocol, "--host", "127.0.0.1", "--port", "0",
                    "--dashboard-address", ":0", "--scheduler-file", str(sched_file)], env, directory / f"{name}.log")
        self.scheduler_file = sched_file
        return self

    @classmethod
    def worker(cls, python: str, env: Mapping[str, str], directory: Path, name: str, scheduler: str | Path, *,
               cuda: bool = False, nanny: bool = True, extra: Iterable[str] = ()) -> DaskProcess:
        """`dask worker` of one thread (`dask cuda worker` with `cuda`) named NAME, joining `scheduler` (an address,
        or a scheduler file); its local directory DIRECTORY/NAME-space."""
        where = ["--scheduler-file", str(scheduler)] if isinstance(scheduler, Path) else [scheduler]
        return cls([python, "-m", "dask", *(["cuda", "worker"] if cuda else ["worker", "--nthreads", "1"]), *where,
                    "--name", name, "--dashboard-address", ":0", "--local-directory", str(directory / f"{name}-space"),
                    *extra, *([] if nanny else ["--no-nanny"])], env, directory / f"{name}.log")

    def address(self, timeout: float) -> str:
        """A scheduler's address, once its scheduler file says it; ChildProcessError if it exits first, TimeoutError
        after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise ChildProcessError(f"the scheduler exited ({self.popen.returncode}):\n{self.text()[-3000:]}")
            with contextlib.suppress(OSError, ValueError, KeyError):
                return json.loads(self.scheduler_file.read_text())["address"]
            time.sleep(0.2)
        raise TimeoutError(f"the scheduler did not start within {timeout:.0f} s (log: {self.log})")

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """`sig` to the process; its session SIGKILLed if it has not exited `timeout` seconds later."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
