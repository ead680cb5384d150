"""A child process of the benchmark: its own session (so it and the workers it spawns can be stopped together),
progress lines forwarded as they come, the rest of its output kept for the report, tracebacks counted."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque

from .reference import EXCEPTION_RE, TRACEBACK_RE
from .runner import PROGRESS

# UCX_PROTO_INFO prints its protocol-selection tables as '|'-separated rows.
PROTO_ROW_RE = re.compile(r"\|.*\|")
MAX_PROTO_LINES = 300
UCX_PREFIX_RE = re.compile(r"^\s*\[[0-9.]+\]\s*\[[^\]]*\]\s*")


class Progress:
    """Progress lines on stderr, prefixed with the seconds since the benchmark started."""

    def __init__(self, stream=None, quiet: bool = False):
        self.start = time.monotonic()
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        if self.quiet:
            return
        with self.lock:
            print(f"[{time.monotonic() - self.start:7.1f}s] {msg}", file=self.stream, flush=True)


class Child:
    def __init__(self, cmd: list[str], env: dict[str, str], label: str, progress: Progress, stdin: bool = False):
        self.label = label
        self.progress = progress
        self.stdout: list[str] = []
        self.stderr_tail: deque[str] = deque(maxlen=300)
        self.tracebacks = 0
        self.shutdown_tracebacks = 0
        self.exception_lines: list[str] = []
        self.proto_info: list[str] = []
        self._proto_seen: set[str] = set()
        self.address: str | None = None
        self.address_seen = threading.Event()
        self._shutting_down = False
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True,
                                     errors="replace", bufsize=1, start_new_session=True)
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, False), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, True), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, stream, is_err: bool) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith(PROGRESS):
                msg = line[len(PROGRESS):]
                if msg.startswith("address "):
                    self.address = msg.split(" ", 1)[1].strip()
                    self.address_seen.set()
                    continue
                if msg == "shutting down":
                    self._shutting_down = True
                self.progress(f"[{self.label}] {msg}")
                continue
            if TRACEBACK_RE.match(line):
                self.tracebacks += 1
                if self._shutting_down:
                    self.shutdown_tracebacks += 1
            elif EXCEPTION_RE.match(line.strip()) and ":" in line and len(self.exception_lines) < 50:
                self.exception_lines.append(line.strip()[:300])
            if PROTO_ROW_RE.search(line) and len(self.proto_info) < MAX_PROTO_LINES:
                # Every process prints the same tables: keep each row once, without UCX's [time] [host:pid] prefix.
                row = UCX_PREFIX_RE.sub("", line).strip()[:300]
                if row not in self._proto_seen:
                    self._proto_seen.add(row)
                    self.proto_info.append(row)
            if is_err:
                self.stderr_tail.append(line)
            else:
                self.stdout.append(line)

    def wait(self, timeout: float) -> tuple[int | None, bool]:
        """(return code, timed out). A child past its time is stopped with its whole process group."""
        timed_out = False
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            rc = self.proc.returncode
        for t in self._threads:
            t.join(timeout=10)
        return rc, timed_out

    def kill(self, grace: float = 10.0) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)  # the group this child leads (start_new_session): it and its workers
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace)
                return
            except subprocess.TimeoutExpired:
                continue

    def close_stdin(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
        except OSError:
            pass

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def summary(self, rc, timed_out) -> dict:
        return {"rc": rc, "timed_out": timed_out, "seconds": round(self.elapsed, 2), "tracebacks": self.tracebacks,
                "shutdown_tracebacks": self.shutdown_tracebacks,
                "exceptions": sorted({ln.split(":", 1)[0].rsplit(".", 1)[-1] for ln in self.exception_lines})}
