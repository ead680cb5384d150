"""A Dask cluster of separate processes, started with the launchers users run (`dask scheduler`, `dask worker`,
`dask cuda worker`), each process in a session of its own (what it spawns stops with it), its output in a log file;
or attached: in the starting process's group, its output that process's (a signal to the group reaches it too).
The bench studies' and `bench idle`'s clusters, and the integration tests'.
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


def signal_process(p: subprocess.Popen, sig: int, group: bool) -> None:
    """`sig` to the process, or with `group` to its process group (one of a session of its own: what it spawned)."""
    with contextlib.suppress(ProcessLookupError):
        if group:
            os.killpg(p.pid, sig)
        else:
            p.send_signal(sig)


def stop_processes(procs: list[subprocess.Popen], grace: float, groups: bool = True) -> list[subprocess.Popen]:
    """SIGTERM to each process (with `groups`, to its process group), in order, then SIGKILL to those not gone after
    `grace` seconds; returns those."""
    killed = []
    for p in procs:
        signal_process(p, signal.SIGTERM, groups)
    for p in procs:
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            killed.append(p)
            signal_process(p, signal.SIGKILL, groups)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
    return killed


class DaskProcess:
    """One process in a session of its own, its stdout and stderr in `log` (`attached`: in this process's group, its
    output this process's, no log); `scheduler()` and `worker()` start Dask's launchers."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: Path, attached: bool = False):
        self.log, self.scheduler_file, self.attached = None if attached else log, None, attached
        with open(log, "wb") if not attached else contextlib.nullcontext() as out:
            self.popen = subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT if out else None,
                                          stdin=subprocess.DEVNULL, start_new_session=not attached)

    @classmethod
    def scheduler(cls, python: str, env: Mapping[str, str], directory: Path, name: str = "scheduler",
                  protocol: str = "tcp", extra: Iterable[str] = (), attached: bool = False) -> DaskProcess:
        """`dask scheduler` on 127.0.0.1, any free port; its address in DIRECTORY/NAME.json (`address()`)."""
        sched_file = directory / f"{name}.json"
        self = cls([python, "-m", "dask", "scheduler", "--protocol", protocol, "--host", "127.0.0.1", "--port", "0",
                    "--dashboard-address", ":0", "--scheduler-file", str(sched_file), *extra], env,
                   directory / f"{name}.log", attached)
        self.scheduler_file = sched_file
        return self

    @classmethod
    def worker(cls, python: str, env: Mapping[str, str], directory: Path, name: str, scheduler: str | Path, *,
               cuda: bool = False, nanny: bool = True, nthreads: int = 1, extra: Iterable[str] = (),
               attached: bool = False) -> DaskProcess:
        """`dask worker` (`dask cuda worker` with `cuda`: a worker per GPU its CUDA_VISIBLE_DEVICES names) named NAME,
        joining `scheduler` (an address, or a scheduler file); its local directory DIRECTORY/NAME-space."""
        where = ["--scheduler-file", str(scheduler)] if isinstance(scheduler, Path) else [scheduler]
        return cls([python, "-m", "dask", *(["cuda", "worker"] if cuda else ["worker"]), *where, "--nthreads",
                    str(nthreads), "--name", name, "--dashboard-address", ":0", "--local-directory",
                    str(directory / f"{name}-space"), *extra, *([] if nanny else ["--no-nanny"])], env,
                   directory / f"{name}.log", attached)

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
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
        """`sig` to the process; its session (attached: the process) SIGKILLed if it has not exited `timeout` seconds
        later."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                signal_process(self.popen, signal.SIGKILL, not self.attached)
                self.popen.wait(10)


def launch_cluster(python: str, env: Mapping[str, str], worker_envs: list[Mapping[str, str]], directory: Path, *,
                   protocol: str, cuda: bool, nthreads: int = 1, worker_flags: Iterable[str] = (),
                   scheduler_flags: Iterable[str] = (), attached: bool = False) -> dict[str, DaskProcess]:
    """`dask scheduler` ("scheduler", with `env`) and a worker launcher per environment in `worker_envs` ("w0-nanny",
    "w1-nanny", ...) joining it through its scheduler file: the workers start while the scheduler does."""
    directory.mkdir(parents=True, exist_ok=True)
    procs = {"scheduler": DaskProcess.scheduler(python, env, directory, protocol=protocol, extra=scheduler_flags,
                                                attached=attached)}
    for i, worker_env in enumerate(worker_envs):
        procs[f"w{i}-nanny"] = DaskProcess.worker(python, worker_env, directory, f"w{i}",
                                                  procs["scheduler"].scheduler_file, cuda=cuda, nthreads=nthreads,
                                                  extra=worker_flags, attached=attached)
    return procs
