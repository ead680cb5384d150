"""The driver's child processes: Child (a process in a session of its own, its output read as it comes) and Host, the
driver's handle on one cluster process (cluster.py) and the variants it serves: started with its cluster's dask config
and environment, asked for repetitions and checks one JSON line at a time, closed.
"""
from __future__ import annotations

import json
import queue
import re
import subprocess
import threading
import time
from collections import deque
from pathlib import Path

from ..cliutil import Progress
from ..proof.launchers import stop_processes
from . import cluster, config
from .options import Options

TRACEBACK_RE = re.compile(r"^Traceback \(most recent call last\):")
PROTO_ROW_RE = re.compile(r"\|.*\|")


class Child:
    """A child process in its own session (it and the workers it spawns stop together); its progress lines forwarded,
    its answers queued, the rest of its output kept."""

    def __init__(self, cmd: list[str], env: dict, label: str, progress: Progress, stdin: bool = False):
        self.label, self.progress = label, progress
        self.stdout: deque[str] = deque(maxlen=5000)
        self.stderr: deque[str] = deque(maxlen=300)
        self.answers: queue.Queue = queue.Queue()
        self.tracebacks, self.proto_info = 0, []
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, errors="replace",
                                     bufsize=1, start_new_session=True)
        self.threads = [threading.Thread(target=self._read, args=(s, s is self.proc.stderr), daemon=True)
                        for s in (self.proc.stdout, self.proc.stderr)]
        for t in self.threads:
            t.start()

    def _read(self, stream, is_err: bool) -> None:
        for raw in stream:
            line = raw.rstrip("\n")
            if line.startswith(cluster.ANSWER):
                self.answers.put(json.loads(line[len(cluster.ANSWER):]))
                continue
            if line.startswith(cluster.PROGRESS):
                self.progress(f"[{self.label}] {line[len(cluster.PROGRESS):]}")
                continue
            self.tracebacks += bool(TRACEBACK_RE.match(line))
            row = re.sub(r"^\s*\[[0-9.]+\]\s*\[[^\]]*\]\s*", "", line).strip()[:300]
            if PROTO_ROW_RE.search(line) and "cuda" in line.lower() and row not in self.proto_info \
                    and len(self.proto_info) < 80:
                self.proto_info.append(row)  # UCX_PROTO_INFO's protocol rows for device memory
            (self.stderr if is_err else self.stdout).append(line)
        if not is_err:
            self.answers.put(None)  # its stdout closed: no answer will come

    def send(self, obj: dict) -> None:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> dict | None:
        try:
            return self.answers.get(timeout=max(0.1, timeout))
        except queue.Empty:
            raise TimeoutError(f"no answer within {timeout:.0f} s") from None

    def kill(self, grace: float = 10.0) -> None:
        stop_processes([self.proc], grace)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


class Host:
    """The driver's handle on one cluster process and the variants it serves."""

    def __init__(self, index: int, variants: list, opts: Options, tmp: Path, progress: Progress):
        self.id, self.variants, self.facts, self.error, self.shutdown = f"c{index}", variants, None, None, None
        tree, _ = variants[0].split(opts.client_keys)
        d = tmp / self.id
        env = config.variant_env(d / "dask-config", tree, variants[0].env, variants[0].unset)  # makes d
        keys = sorted({k for v in variants for k, _ in v.settings if not config.client_side(k, opts.client_keys)}
                      | {k for v in variants for k, _ in v.env})
        spec = {"protocol": variants[0].protocol, "mode": opts.mode, "gpus": opts.gpus, "workers": opts.workers,
                "params": opts.params, "probe_keys": keys, "local_directory": str(d / "scratch"),
                "start_timeout": opts.run_timeout}
        (d / "spec.json").write_text(json.dumps(spec))
        if opts.proto_info:
            env["UCX_PROTO_INFO"] = "y"
        self.tree = tree
        self.child = Child([opts.python, "-m", opts.study.module, "--serve", str(d / "spec.json")], env,
                           f"{self.id} {variants[0].protocol}", progress, stdin=True)

    @property
    def alive(self) -> bool:
        return self.facts is not None and self.error is None

    def ready(self, timeout: float) -> None:
        try:
            ans = self.child.answer(timeout)
        except TimeoutError as e:
            ans = {"op": "error", "error": f"cluster did not start: {e}"}
        if ans and ans.get("op") == "ready":
            self.facts = ans
            return
        self.error = (ans or {}).get("error") or f"exited with {self.child.proc.poll()} before it was up"
        if self.child.proc.poll() is None:
            self.child.kill()

    def request(self, req: dict, timeout: float) -> dict:
        try:
            self.child.send(req)
            ans = self.child.answer(timeout)
        except (OSError, TimeoutError) as e:
            ans = None
            self.error = f"{req['op']}: {e}"
            self.child.kill()
        if ans is None:
            self.error = self.error or f"the cluster process exited with {self.child.proc.poll()}"
            return {"ok": False, "error": self.error}
        return ans

    def begin_close(self) -> None:
        if self.child.proc.poll() is None:
            try:
                self.child.send({"op": "close"})
                self.child.proc.stdin.close()
            except OSError:
                pass

    def finish_close(self, deadline: float) -> None:
        """Wait for its shutdown record (every cluster closes at once: begin_close first)."""
        while self.shutdown is None and time.monotonic() < deadline:
            try:
                ans = self.child.answer(deadline - time.monotonic())
            except TimeoutError:
                break
            if ans is None:
                break
            if ans.get("op") == "closed":
                self.shutdown = ans["shutdown"]
        self.rc = self.child.wait(max(1.0, deadline - time.monotonic()))
