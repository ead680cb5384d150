"""Run `ucx_perftest` as a server/client pair and parse what it prints.

Parsers take text (tested on recorded output, tests/fixtures/verify_nvlink/); the runner is thin: it starts the two
processes with the environments it is given, waits, and hands back their output. Formats, learned from real runs of
UCX 1.13.1 and 1.21.0 and from UCX source (src/tools/perf/perftest.c, src/ucp/proto/proto_debug.c):

- results: a `Final:` row of 8 numbers -- iterations, latency 50%ile (1.13: "typical"), average, overall (usec),
  bandwidth average, overall ("MB/s", which UCX computes with MB = 1024*1024 bytes), message rate average, overall.
  `-f` prints the same 8 numbers without the `Final:` label.
- protocol tables (UCX_PROTO_INFO=y|used, protocol v2): a 2-cell header row `| <ep cfg> | <operation> |` followed by
  3-cell rows `| [count] <range> | <protocol> | <transport/device ...> |`; the count column only with `used`.
  Each line may carry a log prefix (`[ts] [host:pid:tid]` and, on older UCX, `proto_debug.c:NNN UCX INFO`).
- lanes (UCX_LOG_LEVEL=info, any version): `ep_cfg[N]: tag(sysv/memory cma/memory) ...`.

What real GPU runs print (2xH200, tests/fixtures/verify_nvlink/h200x2/):
- 1.21 `used`: EACH side prints a send table AND a fetch table -- perftest's own control messages go the other way
  (server -> client, a handful) -- so only the client's send table and the server's fetch table describe the
  measured data (client = sender). Headers name the device the process used, as its CUDA ordinal:
  `... from cuda/GPU0`, `rendezvous data fetch(multi) into cuda/GPU0 from cuda`; with both GPUs visible the client
  printed `cuda/GPU1`. Protocol cells may start with `(?)`, transport cells are `cuda_ipc/cuda`.
- 1.13 protocol v2 (`UCX_PROTO_ENABLE=y UCX_PROTO_INFO=y`): the header's first cell is `0x<ep> ep_cfg[N]`; the
  client's `tagged message ... (multi) from cuda/GPU0` row names no transport (`rendezvous no data fetch`, empty
  cell) and the data path is in its `rendezvous data send(multi) from cuda/GPU0 to host` table; tables may repeat.
- 1.13 lanes: `ep_cfg[1]: tag(sysv/memory cma/memory cuda_ipc/cuda)` -- cuda memory has no cuda_copy tag lane.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cliutil import signals_deferred
from ..errors import PERFTEST_FAILED, UserError

MIB = 1 << 20
PERFTEST_MB = 1 << 20  # ucx_perftest's "MB/s" is MiB/s

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+|inf|nan)"
_FINAL_RE = re.compile(rf"^\s*Final:\s+(\d+)((?:\s+{_NUM}){{7}})\s*$", re.M)
_BARE_RE = re.compile(rf"^\s*(\d+)((?:\s+{_NUM}){{7}})\s*$", re.M)
_CSV_HEAD = "iterations,"
_LOG_PREFIX_RE = re.compile(r"^(?:\s*\[[^\]]*\])*\s*(?:\S+\.c:\d+\s+UCX\s+\w+\s+)?")
_TL_RE = re.compile(r"(?<![\w/])([a-z][a-z0-9_]*)/[^\s,|]+")
_LANES_RE = re.compile(r"ep_cfg\[(\d+)\]:\s*(.*)$")
_FEATURE_RE = re.compile(r"(\w+)\(([^)]*)\)")
_GPU_RE = re.compile(r"\bcuda/GPU(\d+)\b")


# --- results -------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PerftestResult:
    iterations: int
    lat_overall_us: float
    bw_average_mbs: float  # as printed, MiB/s
    bw_overall_mbs: float  # as printed, MiB/s

    @property
    def gbps(self) -> float:
        """Overall bandwidth in GB/s (1e9 bytes/s)."""
        return self.bw_overall_mbs * PERFTEST_MB / 1e9


def parse_result(text: str) -> PerftestResult | None:
    """The final result row of a client's output (`Final:` row, `-f` bare row or `-v` CSV); None when absent."""
    lines = text.splitlines()
    for i, line in enumerate(lines):  # -v: a CSV header then one row of values
        if line.strip().startswith(_CSV_HEAD) and i + 1 < len(lines):
            vals = [v.strip() for v in lines[i + 1].split(",")]
            if len(vals) >= 6:
                return PerftestResult(int(vals[0]), float(vals[3]), float(vals[4]), float(vals[5]))
    m = None
    for m in _FINAL_RE.finditer(text):
        pass
    if m is None:
        for m in _BARE_RE.finditer(text):
            pass
    if m is None:
        return None
    nums = [float(x) for x in m.group(2).split()]
    return PerftestResult(int(m.group(1)), nums[2], nums[3], nums[4])


def error_line(text: str) -> str | None:
    """The most telling line of a failed run: the FIRST UCX ERROR / loader error (the cause; later ones are its
    consequences, e.g. "Failed to run test"), else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if re.search(r"\bERROR\b|error while loading|symbol lookup error|cannot open shared object|"
                     r"undefined symbol|Segmentation fault|Aborted", ln):
            return _LOG_PREFIX_RE.sub("", ln).strip() or ln
    return lines[-1] if lines else None


# --- protocol tables -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProtoRow:
    lo: int
    hi: int | None  # None = inf
    protocol: str
    config: str
    count: int | None = None  # only with UCX_PROTO_INFO=used

    def covers(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size <= self.hi)

    @property
    def transports(self) -> tuple[str, ...]:
        return transports_in(self.config)


@dataclass
class ProtoTable:
    ep_cfg: str
    operation: str
    rows: list[ProtoRow] = field(default_factory=list)

    @property
    def used(self) -> bool:
        return any(r.count is not None for r in self.rows)

    @property
    def is_send(self) -> bool:
        return "ucp_tag_send" in self.operation

    @property
    def is_rndv_fetch(self) -> bool:
        return "rendezvous data fetch" in self.operation

    @property
    def is_rndv_send(self) -> bool:
        """The sender's side of a put-based rendezvous (`rendezvous data send(multi) from cuda/GPU0 to host`): where
        protocol v2 names the sender's data path when the receiver did not fetch."""
        return "rendezvous data send" in self.operation

    @property
    def local_gpu(self) -> int | None:
        """CUDA ordinal of the GPU this process used, as the header names it (`from cuda/GPU1`, `into cuda/GPU0 from
        cuda`): the first `cuda/GPU<N>` -- the local buffer comes first in every operation UCX prints. None when the
        header names no GPU (host memory, or a UCX that prints `cuda memory`)."""
        m = _GPU_RE.search(self.operation)
        return int(m.group(1)) if m else None

    def mem_is(self, mem: str) -> bool:
        """Whether the operation's memory (`from cuda/GPU0`, `into cuda memory`, `to cuda/dev[0]`) is `mem`."""
        return re.search(rf"\b(?:from|into|to)\s+{re.escape(mem)}[/ ]", self.operation + " ") is not None


def transports_in(config: str) -> tuple[str, ...]:
    """Transport names in a protocol config / lanes string: 'cuda_ipc/cuda 50% on rc_mlx5/mlx5_0:1' -> both."""
    return tuple(dict.fromkeys(_TL_RE.findall(config)))


def parse_memunits(s: str) -> int | None:
    """UCX memunits as printed in ranges: '6031', '8K', '1M', 'inf' (None). UCX's own notation, binary (8K = 8192):
    what UCX prints, not a size a user gives (those are dask's: cliutil.parse_bytes)."""
    s = s.strip()
    if s == "inf":
        return None
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", s)
    if not m:
        raise ValueError(f"not a UCX size: {s!r}")
    return int(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2)]


def _parse_range_cell(cell: str) -> tuple[int | None, int, int | None]:
    toks = cell.split()
    count = int(toks[0]) if len(toks) == 2 else None
    rng = toks[-1]
    lo_s, sep, hi_s = rng.partition("..")
    lo = parse_memunits(lo_s)
    hi = parse_memunits(hi_s) if sep else lo
    return count, (lo or 0), hi


def parse_proto_tables(text: str) -> list[ProtoTable]:
    """Every protocol table in one process's output, in order."""
    tables: list[ProtoTable] = []
    cur: ProtoTable | None = None
    for raw in text.splitlines():
        line = _LOG_PREFIX_RE.sub("", raw, count=1)
        if line.startswith("+"):
            continue  # separator
        if not line.startswith("|"):
            cur = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2:  # header: | <ep cfg> | <operation> |
            cur = ProtoTable(cells[0], cells[1])
            tables.append(cur)
        elif len(cells) == 3 and cur is not None:
            try:
                count, lo, hi = _parse_range_cell(cells[0])
            except (ValueError, IndexError):
                cur = None
                continue
            cur.rows.append(ProtoRow(lo, hi, cells[1], cells[2], count))
        else:
            cur = None
    return [t for t in tables if t.rows]


def parse_lanes(text: str) -> list[dict[str, list[str]]]:
    """`ep_cfg[N]: tag(a/b c/d) rma(...)` lines -> [{'ep_cfg': ['N'], 'tag': ['a/b', 'c/d'], ...}]."""
    out = []
    for raw in text.splitlines():
        m = _LANES_RE.search(raw)
        if not m:
            continue
        entry: dict[str, list[str]] = {"ep_cfg": [m.group(1)]}
        for feat, body in _FEATURE_RE.findall(m.group(2)):
            entry[feat] = body.split()
        out.append(entry)
    return out


# --- capability probes (ucx_info -c) --------------------------------------------------------------------------------

def config_value(ucx_info_c: str, name: str) -> str | None:
    """Value of UCX_<name> in `ucx_info -c` output (None when not printed)."""
    m = re.search(rf"^UCX_{re.escape(name)}=(.*)$", ucx_info_c, re.M)
    return m.group(1).strip() if m else None


# The first UCX whose UCX_PROTO_INFO=used prints the protocols actually used (with counts) at exit: before it, the
# value is a glob over operation names (1.20's ucp_context.c) that matches none, and tables are never printed.
PROTO_INFO_USED_SINCE = (1, 21)


def accepts_proto_info_used(stdout_with_used: str, version: str | None) -> bool:
    """Given `UCX_PROTO_INFO=used ucx_info -c` stdout and the UCX version: 1.13 rejects the value ("Invalid value for
    PROTO_INFO: 'used'") and prints no configuration; 1.14-1.20 echo it back but read it as a glob (no tables at
    all: recorded with 1.20.1); from 1.21 it means 'print the used protocols'."""
    try:
        v = tuple(int(x) for x in (version or "").split(".")[:2])
    except ValueError:
        return False
    return config_value(stdout_with_used, "PROTO_INFO") == "used" and v >= PROTO_INFO_USED_SINCE


def truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("y", "yes", "on", "1", "true")


# --- running -------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether some socket LISTENs on `port`, from /proc/net/tcp{,6}: connecting to test would steal the one
    connection ucx_perftest's server accepts."""
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f, None)
                for line in f:
                    parts = line.split()
                    if len(parts) > 3 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                        return True
        except OSError:
            continue
    return False


@dataclass
class PairOutput:
    server_out: str
    client_out: str
    server_rc: int | None
    client_rc: int | None
    server_pid: int
    client_pid: int
    wall_s: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return not self.timed_out and self.server_rc == 0 and self.client_rc == 0


def result_or_raise(out: PairOutput, what: str) -> PerftestResult:
    """The client's result, or UserError(PERFTEST_FAILED) with one line saying why (exit codes + the telling line
    of the output: a UCX ERROR, a loader 'symbol lookup error', ...)."""
    res = parse_result(out.client_out) if out.ok else None
    if res is not None:
        return res
    why = ("timed out" if out.timed_out else
           f"client exit {out.client_rc}, server exit {out.server_rc}" if not out.ok else "no result row")
    line = error_line(out.client_out) or error_line(out.server_out) or "no output"
    raise UserError(f"ucx_perftest failed ({what}: {why}): {line}", PERFTEST_FAILED)


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the process group we created for it (start_new_session)
        except (ProcessLookupError, PermissionError):
            p.kill()
    p.wait()


def run_pair(perftest: str | os.PathLike, args: list[str], server_env: dict[str, str], client_env: dict[str, str],
             workdir: Path, port: int | None = None, timeout: float = 300.0, start_timeout: float = 60.0,
             poll: Callable[[int, int], None] | None = None, poll_interval: float = 0.2) -> PairOutput:
    """Start `perftest args -p PORT` as server, wait until it listens, run the client against 127.0.0.1. Output goes to
    files in `workdir` (no pipes to fill up). `poll(server_pid, client_pid)` is called every `poll_interval` seconds
    while both run (verify-nvlink samples NVML's process lists there)."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    full = [*map(str, args), "-p", str(port)]
    t0 = time.monotonic()
    with open(workdir / "server.out", "w+b") as so, open(workdir / "client.out", "w+b") as co:
        with signals_deferred():  # a process started is one the `finally` below ends (Ctrl-C, SIGTERM)
            server = subprocess.Popen([str(perftest), *full], stdout=so, stderr=subprocess.STDOUT, env=server_env,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        client = None
        timed_out = False
        try:
            deadline = time.monotonic() + start_timeout
            while not listening(port) and server.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if server.poll() is None and listening(port):
                with signals_deferred():
                    client = subprocess.Popen([str(perftest), "127.0.0.1", *full], stdout=co,
                                              stderr=subprocess.STDOUT, env=client_env, stdin=subprocess.DEVNULL,
                                              start_new_session=True)
                deadline = time.monotonic() + timeout
                while client.poll() is None and time.monotonic() < deadline:
                    if poll is not None and server.poll() is None:
                        poll(server.pid, client.pid)
                    time.sleep(poll_interval)
                if client.poll() is None:
                    timed_out = True
                # the server exits right after the client; give it a moment, never forever
                end = time.monotonic() + 30
                while server.poll() is None and time.monotonic() < end:
                    time.sleep(0.05)
                if server.poll() is None:
                    timed_out = True
            elif server.poll() is None:
                timed_out = True  # never started listening
        finally:
            with signals_deferred():
                for p in (client, server):
                    if p is not None:
                        _kill(p)
        so.seek(0)
        co.seek(0)
        return PairOutput(
            server_out=so.read().decode(errors="replace"),
            client_out=co.read().decode(errors="replace"),
            server_rc=server.returncode,
            client_rc=client.returncode if client is not None else None,
            server_pid=server.pid,
            client_pid=client.pid if client is not None else -1,
            wall_s=time.monotonic() - t0,
            timed_out=timed_out,
        )
