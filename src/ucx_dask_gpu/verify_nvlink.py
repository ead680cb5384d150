"""`ucx-dask-gpu verify-nvlink`: prove, pair by pair, that NVLink delivers -- and cannot be fooled.

For every ordered GPU pair with NVLink (all pairs with --all-pairs), for each UCX under test (--ucx-prefix, repeatable)
and each settings variant (--variant):

1. `ucx_perftest -t tag_bw -m cuda` with the server (receiver) seeing ONLY the destination GPU and the client (sender)
   ONLY the source GPU (CUDA_VISIBLE_DEVICES=<uuid>, CUDA_DEVICE_ORDER=PCI_BUS_ID), on a free port;
2. NVLink throughput counters (NVML fields 138-141) read before and after on every GPU; the bytes the source sent and
   the destination received must account for what perftest moved ((iterations + warm-up) x size);
3. the transport named by UCX itself: UCX_PROTO_INFO=used (UCX >= 1.17-ish), the protocol-v2 selection tables
   (UCX_PROTO_INFO=y) when v2 is on but `used` is unknown, or -- for UCX whose active protocol layer prints nothing
   (1.13: v1 by default) -- the endpoint's lanes (UCX_LOG_LEVEL=info) plus an ablation run without cuda_ipc;
4. a cudaMemcpyPeer baseline for the same pair in the same invocation (CuPy, CUDA events, median of samples);
5. the visibility each process really had: as configured, as CUDA shows a probe process with the same environment,
   as NVML lists the perftest PIDs per GPU during the run, and -- where UCX prints protocol tables -- the GPU its
   tables name (`from cuda/GPU1`).

Decisions live in nvlink_verdict (pure functions); this module runs things and writes the report.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .ucx import info as ucxinfo
from .ucx import perftest as pt
from .ucx.install import UcxInstall, locate
from .errors import (NO_GPU, NO_NVLINK, ONE_GPU, PERFTEST_FAILED, PERFTEST_MISSING, USAGE, VERDICT_FAILED,
                     UserError)
from .nvlink_verdict import (FAIL, INVALID, PASS, PairInput, SizeMeasurement, Thresholds,
                             TransportEvidence, Visibility, counter_deltas, evaluate_pair, goal_met, size_label,
                             transport_from_lanes, transport_from_tables)

STEM = "verify-nvlink"
DEFAULT_SIZES = "1MiB,64MiB,256MiB"
DEFAULT_GOALS = "256MiB=0.97,1MiB=0.50"
# Never settable by --ucx-env/--variant: they are what makes the measurement honest.
RESERVED_ENV = {"CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH"}
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


# --- argument helpers (pure) ----------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """'1MiB', '64M', '256mib', '4k', '268435456' -> bytes (binary units: perftest sizes are powers of two)."""
    m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS or int(m.group(1)) <= 0:
        raise UserError(f"not a message size: {text!r} (use e.g. 1MiB, 64MiB, 268435456)", USAGE)
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_size(s) for s in text.split(",") if s.strip()})
    if not sizes:
        raise UserError("--sizes: no size given", USAGE)
    return sizes


def parse_assignment(text: str, what: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        raise UserError(f"{what}: expected KEY=VALUE, got {text!r}", USAGE)
    if key in RESERVED_ENV:
        raise UserError(f"{what}: {key} is set by verify-nvlink itself (it is what keeps the measurement honest)",
                        USAGE)
    return key, value


def parse_variant(text: str) -> dict[str, str]:
    """'UCX_RNDV_SCHEME=get_zcopy UCX_MAX_RNDV_RAILS=1' -> dict (whitespace separates; values may hold commas)."""
    items = text.split()
    if not items:
        raise UserError("--variant: empty", USAGE)
    return dict(parse_assignment(i, "--variant") for i in items)


def parse_goals(text: str) -> dict[int, float]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        k, sep, v = item.partition("=")
        try:
            out[parse_size(k)] = float(v)
        except ValueError:
            raise UserError(f"--goals: expected SIZE=RATIO, got {item!r}", USAGE) from None
        if not sep:
            raise UserError(f"--goals: expected SIZE=RATIO, got {item!r}", USAGE)
    return out


def iterations_for(size: int, target_bytes: int, fixed: int | None = None) -> tuple[int, int]:
    """(iterations, warm-up) for one run. A multiple of 10 makes perftest's warm-up exactly n/10 in every version
    (1.13 uses max_iter/10, newer ucs_div_round_up(max_iter, 10); both cap the -w we pass)."""
    n = fixed if fixed else max(20, min(200_000, target_bytes // size))
    n = max(10, int(math.ceil(n / 10.0)) * 10)
    return n, n // 10


def tls_without_cuda_ipc(value: str | None) -> str:
    """UCX_TLS for the ablation run: the same selection minus cuda_ipc."""
    if not value or value.strip() in ("all", "^"):
        return "^cuda_ipc"
    v = value.strip()
    if v.startswith("^"):
        items = [x for x in v[1:].split(",") if x]
        return "^" + ",".join(items + ([] if "cuda_ipc" in items else ["cuda_ipc"]))
    items = [x for x in v.split(",") if x and x != "cuda_ipc"]
    return ",".join(items) if items else "^cuda_ipc"


def select_pairs(gpus: list, all_pairs: bool = False, only: list[int] | None = None) -> list[tuple]:
    """Ordered (src, dst) pairs to measure; the bad-input exits for a machine that cannot be verified."""
    from .nvml import nvlink_count

    if not gpus:
        raise UserError("no GPU: NVML lists none", NO_GPU)
    if only:
        known = {g.index for g in gpus}
        missing = sorted(set(only) - known)
        if missing:
            raise UserError(f"--gpus: no GPU with index {', '.join(map(str, missing))} (have "
                            f"{', '.join(str(g.index) for g in gpus)})", USAGE)
        gpus = [g for g in gpus if g.index in set(only)]
    if len(gpus) < 2:
        raise UserError(f"only one GPU ({gpus[0].name}, {gpus[0].pci_bus_id}): NVLink needs two", ONE_GPU)
    pairs = [(a, b) for a in gpus for b in gpus if a is not b]
    linked = [(a, b) for a, b in pairs if nvlink_count(a, b) > 0]
    if not linked:
        raise UserError(f"no NVLink between any of the {len(gpus)} GPUs (NVML reports no active link to a peer GPU)",
                        NO_NVLINK)
    return pairs if all_pairs else linked


# --- UCX under test -------------------------------------------------------------------------------------------------

@dataclass
class UcxUnderTest:
    """One UCX installation and what its own ucx_info says about it (filled in by `preflight`)."""

    install: UcxInstall
    version: str | None = None
    proto_used: bool = False        # accepts UCX_PROTO_INFO=used
    proto_v2_default: bool = False  # UCX_PROTO_ENABLE default
    transports: list[str] = field(default_factory=list)
    configure_line: str | None = None
    preflight_error: str | None = None  # --keep-going: this UCX could not start; its runs are reported as errors

    @property
    def spec(self) -> str:
        return self.install.spec

    @property
    def kind(self) -> str:
        return self.install.kind

    @property
    def prefix(self) -> Path:
        return self.install.prefix

    @property
    def perftest(self) -> Path:
        return self.install.perftest

    @property
    def ucx_info(self) -> Path | None:
        return self.install.ucx_info

    @property
    def lib_dirs(self) -> list[Path]:
        return self.install.lib_dirs

    @property
    def build_info(self) -> dict | None:
        return self.install.build_info

    @property
    def label(self) -> str:
        return f"{self.kind} {self.version or '?'}"

    def describe(self) -> dict:
        src = {"pip": "pip wheel libucx (libucx-cu13)", "path": "ucx_perftest found on PATH"}.get(self.kind, "prefix")
        if self.build_info:
            s = self.build_info.get("source") or {}
            src = (f"built from source by ucx-dask-gpu: {s.get('archive', '?')} "
                   f"({'FALLBACK: ' + str(s.get('fallback_reason')) if s.get('fallback') else 'production pin'})")
        return {"version": self.version, "source": src, "prefix": str(self.prefix), "kind": self.kind,
                "proto_info_used": self.proto_used, "proto_v2_default": self.proto_v2_default,
                "transports": self.transports, "configure": self.configure_line,
                "build_info": {k: self.build_info.get(k) for k in ("ucx_version", "source", "capabilities")}
                if self.build_info else None}


def resolve_install(spec: str) -> UcxUnderTest:
    """--ucx-prefix value -> a UCX with ucx_perftest. `pip`: the libucx wheel of this Python; `path`: ucx_perftest on
    PATH; `auto`: PATH, then the wheel; anything else: a UCX prefix directory."""
    if spec == "auto":
        for alt in ("path", "pip"):
            try:
                return resolve_install(alt)
            except UserError:
                continue
        raise UserError("ucx_perftest not found: not on PATH and no libucx wheel in this Python; pass --ucx-prefix "
                        "DIR (a UCX install prefix) or --ucx-prefix pip", PERFTEST_MISSING)
    inst = locate(spec, PERFTEST_MISSING)
    if inst.perftest is None:
        raise UserError(f"no executable bin/ucx_perftest in {inst.prefix} "
                        f"({'the libucx wheel' if inst.kind == 'pip' else spec})", PERFTEST_MISSING)
    return UcxUnderTest(inst)


def cuda_runtime_dirs(extra: list[str]) -> list[Path]:
    """Directories holding libcudart.so* for the UCX CUDA modules (a from-source prefix links them against it)."""
    cands = [Path(e) for e in extra]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands += [Path(os.environ[env]) / "lib64", Path(os.environ[env]) / "targets/x86_64-linux/lib"]
    cands += [Path("/usr/local/cuda/targets/x86_64-linux/lib"), Path("/usr/local/cuda/lib64")]
    try:
        import importlib.util

        spec = importlib.util.find_spec("nvidia")
        for loc in (spec.submodule_search_locations or []) if spec else []:
            cands += sorted(Path(loc).glob("cu*/lib")) + sorted(Path(loc).glob("cuda_runtime/lib"))
    except (ImportError, ValueError):
        pass
    out = []
    for d in cands:
        if d.is_dir() and any(d.glob("libcudart.so*")) and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def child_env(inst: UcxUnderTest, cuda_dirs: list[Path], ucx_env: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    ld = [str(d) for d in inst.lib_dirs] + [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    ld += [str(d) for d in cuda_dirs]
    seen: list[str] = []
    for p in ld:
        if p not in seen:
            seen.append(p)
    env["LD_LIBRARY_PATH"] = ":".join(seen)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env.update(ucx_env)
    return env


def _run_tool(cmd: list[str], env: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def preflight(inst: UcxUnderTest, env: dict[str, str]) -> None:
    """Version, protocol-info capability and transports of one UCX, through its own ucx_info, under the environment
    perftest will get. A UCX that cannot start or has no CUDA transport ends the run here (PERFTEST_FAILED)."""
    if inst.ucx_info is None:
        return
    r = _run_tool([str(inst.ucx_info), "-v"], env)
    if r.returncode != 0:
        raise UserError(f"UCX at {inst.prefix} does not start (ucx_info -v exit {r.returncode}): "
                        f"{pt.error_line(r.stdout + r.stderr) or 'no output'}", PERFTEST_FAILED)
    try:
        v = ucxinfo.parse_version(r.stdout)
        inst.version, inst.configure_line = v.version, v.configure_line
    except ValueError:
        inst.version = None
    c = _run_tool([str(inst.ucx_info), "-c"], env)
    inst.proto_v2_default = pt.truthy(pt.config_value(c.stdout, "PROTO_ENABLE"))
    u = _run_tool([str(inst.ucx_info), "-c"], {**env, "UCX_PROTO_INFO": "used"})
    inst.proto_used = pt.accepts_proto_info_used(u.stdout)
    d = _run_tool([str(inst.ucx_info), "-d"], env)
    devs = ucxinfo.parse_devices(d.stdout)
    inst.transports = devs.transports
    if d.returncode != 0 or not any(t.startswith("cuda") for t in inst.transports):
        why = (pt.error_line(d.stderr) if d.stderr.strip() else None) or \
            "no CUDA driver/GPU visible to it, or its CUDA modules did not load"
        raise UserError(f"UCX {inst.version or '?'} at {inst.prefix} lists no CUDA transport in `ucx_info -d` "
                        f"(transports: {', '.join(inst.transports) or 'none'}): {why}", PERFTEST_FAILED)


def evidence_mode(inst: UcxUnderTest, env: dict[str, str], forced: str = "auto") -> str:
    if forced == "lanes":
        return "lanes"
    v2 = pt.truthy(env["UCX_PROTO_ENABLE"]) if "UCX_PROTO_ENABLE" in env else inst.proto_v2_default
    if v2:
        return "proto-used" if inst.proto_used else "proto-selected"
    return "lanes"


EVIDENCE_ENV = {"proto-used": {"UCX_PROTO_INFO": "used"}, "proto-selected": {"UCX_PROTO_INFO": "y"},
                "lanes": {"UCX_LOG_LEVEL": "info"}}


# --- GPU side (NVML + CUDA probes) ----------------------------------------------------------------------------------

def parse_nvidia_smi_gt(text: str) -> dict[str, dict[int, dict[str, int]]]:
    """`nvidia-smi nvlink -gt d`: {uuid: {link: {'data_tx': bytes, 'data_rx': bytes}}} (the tool prints KiB; the
    number is the second-to-last field)."""
    out: dict[str, dict[int, dict[str, int]]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^GPU\s+\d+:.*\(UUID:\s*(\S+?)\)", line.strip())
        if m:
            cur = out.setdefault(m.group(1), {})
            continue
        m = re.match(r"^Link\s+(\d+):\s+Data\s+(Tx|Rx):", line.strip())
        if m and cur is not None:
            parts = line.split()
            cur.setdefault(int(m.group(1)), {})[f"data_{m.group(2).lower()}"] = int(parts[-2]) * 1024
    return out


class GpuSide:
    """NVML snapshots, process sampling and the CuPy probes, for one invocation."""

    def __init__(self, gpus: list, python: str = sys.executable):
        from . import nvml

        self.nvml = nvml
        self.gpus = gpus
        self.python = python
        self.origin = "NVML"
        self._probe_cache: dict[str, tuple[list[str] | None, str | None]] = {}

    def snapshot(self) -> dict:
        snap = self.nvml.nvlink_throughput(self.gpus)
        if all(s.total.get("data_tx") is None and not any(v.get("data_tx") is not None for v in s.links.values())
               for s in snap.values()) and shutil.which("nvidia-smi"):
            r = subprocess.run(["nvidia-smi", "nvlink", "-gt", "d"], capture_output=True, text=True, timeout=60)
            per = parse_nvidia_smi_gt(r.stdout) if r.returncode == 0 else {}
            if per:
                self.origin = "nvidia-smi nvlink -gt d"
                for uuid, links in per.items():
                    if uuid in snap:
                        snap[uuid].links = {ln: {"data_tx": v.get("data_tx"), "data_rx": v.get("data_rx"),
                                                 "raw_tx": None, "raw_rx": None} for ln, v in links.items()}
        return snap

    def stable_snapshot(self, quiet_s: float = 0.5, max_s: float = 3.0, step: float = 0.1) -> dict:
        """Counters may land after the traffic (the driver samples them): read until the data counters have not moved
        for `quiet_s` (at most `max_s`)."""
        prev = self.snapshot()
        t_end, t_same = time.monotonic() + max_s, time.monotonic()
        while time.monotonic() < t_end:
            time.sleep(step)
            cur = self.snapshot()
            if _data_key(cur) != _data_key(prev):
                t_same = time.monotonic()
            elif time.monotonic() - t_same >= quiet_s:
                return cur
            prev = cur
        return prev

    def pids_sampler(self):
        seen: dict[int, set[str]] = {}

        def poll(server_pid: int, client_pid: int) -> None:
            try:
                per_gpu = self.nvml.compute_pids(self.gpus)
            except Exception:  # noqa: BLE001 - sampling is evidence, never a reason to stop measuring
                return
            for uuid, pids in per_gpu.items():
                for pid in (server_pid, client_pid):
                    if pid in pids:
                        seen.setdefault(pid, set()).add(uuid)
        return seen, poll

    def probe_visible(self, cuda_visible: str) -> tuple[list[str] | None, str | None]:
        """UUIDs CUDA shows a process started with CUDA_VISIBLE_DEVICES=cuda_visible (cached per value)."""
        if cuda_visible in self._probe_cache:
            return self._probe_cache[cuda_visible]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        try:
            r = subprocess.run([self.python, "-m", "ucx_dask_gpu.gpuprobe", "visible"], env=env, capture_output=True,
                               text=True, timeout=120)
        except subprocess.TimeoutExpired:
            res = (None, "probe timed out")
        else:
            if r.returncode != 0:
                res = (None, (r.stderr.strip().splitlines() or ["probe failed"])[-1])
            else:
                by_bus = {g.pci_bus_id: g.uuid for g in self.gpus}
                devs = json.loads(r.stdout)["devices"]
                res = ([d.get("uuid") or by_bus.get(d.get("pci_bus_id"), d.get("pci_bus_id")) for d in devs], None)
        self._probe_cache[cuda_visible] = res
        return res

    def memcpy_peer(self, src, dst, sizes: list[int], samples: int, timeout: float) -> tuple[dict | None, str | None]:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": f"{src.uuid},{dst.uuid}", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        cmd = [self.python, "-m", "ucx_dask_gpu.gpuprobe", "memcpy-peer", "--sizes", ",".join(map(str, sizes)),
               "--samples", str(samples)]
        try:
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"cudaMemcpyPeer probe did not finish in {timeout:.0f} s"
        if r.returncode != 0:
            return None, (r.stderr.strip().splitlines() or ["cudaMemcpyPeer probe failed"])[-1]
        return json.loads(r.stdout), None


def _data_key(snap: dict) -> tuple:
    return tuple(sorted((u, s.total.get("data_tx"), s.total.get("data_rx"),
                         tuple(sorted((ln, v.get("data_tx"), v.get("data_rx")) for ln, v in s.links.items())))
                        for u, s in snap.items()))


# --- the run ---------------------------------------------------------------------------------------------------------

@dataclass
class RunSpec:
    inst: UcxUnderTest
    variant: dict[str, str] | None
    label: str = ""

    @property
    def counts_for_exit(self) -> bool:
        return self.variant is None


class Progress:
    def __init__(self, total: int, quiet: bool):
        self.total, self.i, self.quiet, self.t0 = total, 0, quiet, time.monotonic()

    def say(self, msg: str, step: bool = True) -> None:
        if step:
            self.i += 1
        if not self.quiet:
            head = f"[{self.i}/{self.total} {time.monotonic() - self.t0:5.0f}s]" if step else "               "
            print(f"verify-nvlink {head} {msg}", flush=True)


def _peer_links(a, b) -> list[int]:
    return sorted(ln for ln, peer in a.links.items() if peer == b.pci_bus_id)


class Verifier:
    def __init__(self, args, gpus: list, pairs: list[tuple], runs: list[RunSpec], sizes: list[int],
                 side: GpuSide, cuda_dirs: list[Path], base_env: dict[str, str], th: Thresholds):
        self.a, self.gpus, self.pairs, self.runs, self.sizes = args, gpus, pairs, runs, sizes
        # what perftest moves: always cuda, except when the orchestration itself is tested on a machine without GPUs
        self.mem = getattr(args, "memory_type", "cuda")
        self.side, self.cuda_dirs, self.base_env, self.th = side, cuda_dirs, base_env, th
        self.work = Path(tempfile.mkdtemp(prefix="verify-nvlink-"))
        self.raw = Path(args.raw_dir) if args.raw_dir else None
        self.baseline: dict[tuple[str, str], dict] = {}
        self.errors: list[str] = []
        self.variant_sizes = parse_sizes(args.variant_sizes) if getattr(args, "variant_sizes", None) else sizes
        live = [r for r in runs if not r.inst.preflight_error]
        n_meas = sum(len(pairs) * len(self.sizes_for(r)) for r in live)
        n_abl = sum(len(pairs) for r in live if evidence_mode(r.inst, self._env(r), args.transport_evidence) == "lanes")
        self.progress = Progress(len(pairs) + n_meas + n_abl, args.quiet)

    def _env(self, run: RunSpec) -> dict[str, str]:
        return child_env(run.inst, self.cuda_dirs, {**self.base_env, **(run.variant or {})})

    def visible_for(self, role_gpu) -> str:
        if self.a.unsafe_visible_devices:
            return ",".join(str(g.index) for g in sorted(self.gpus, key=lambda g: g.index))
        return role_gpu.uuid

    def declared(self, cuda_visible: str) -> list[str]:
        by_index = {str(g.index): g.uuid for g in self.gpus}
        return [by_index.get(x.strip(), x.strip()) for x in cuda_visible.split(",") if x.strip()]

    # baseline -------------------------------------------------------------------------------------------------------
    def measure_baseline(self, src, dst) -> None:
        before = self.side.snapshot()
        sizes = sorted(set(self.sizes) | set(self.variant_sizes))
        res, err = self.side.memcpy_peer(src, dst, sizes, self.a.memcpy_samples, self.a.timeout)
        after = self.side.stable_snapshot()
        entry: dict = {"error": err}
        if res:
            moved = sum(r["bytes_moved"] for r in res["results"])
            cs = counter_deltas(before[src.uuid], after[src.uuid], _peer_links(src, dst), origin=self.side.origin)
            cd = counter_deltas(before[dst.uuid], after[dst.uuid], _peer_links(dst, src), origin=self.side.origin)
            frac = (min(cs["data_tx"], cd["data_rx"]) / moved
                    if cs["data_tx"] is not None and cd["data_rx"] is not None and moved else None)
            entry = {"error": None, "peer_access": res["peer_access"], "results": res["results"],
                     "bytes_moved": moved, "nvlink_tx_bytes": cs["data_tx"], "nvlink_rx_bytes": cd["data_rx"],
                     "counter_fraction": frac}
            summary = ", ".join(f"{size_label(r['msg_bytes'])} {r['gbps']:.1f}" for r in res["results"])
            counted = f"{frac:.0%}" if frac is not None else "n/a"
            self.progress.say(f"cudaMemcpyPeer GPU{src.index}->GPU{dst.index}: {summary} GB/s "
                              f"(NVLink counters saw {counted} of the bytes)")
        else:
            self.progress.say(f"cudaMemcpyPeer GPU{src.index}->GPU{dst.index}: FAILED: {err}")
        self.baseline[(src.uuid, dst.uuid)] = entry

    def memcpy_gbps(self, src, dst, size: int) -> float | None:
        for r in self.baseline.get((src.uuid, dst.uuid), {}).get("results", []) or []:
            if r["msg_bytes"] == size:
                return r["gbps"]
        return None

    # one perftest run -----------------------------------------------------------------------------------------------
    def perftest_once(self, run: RunSpec, env: dict, mode: str, src, dst, size: int, n: int, w: int,
                      tag: str) -> dict:
        sv, cv = self.visible_for(dst), self.visible_for(src)
        server_env = {**env, **EVIDENCE_ENV[mode], "CUDA_VISIBLE_DEVICES": sv}
        client_env = {**env, **EVIDENCE_ENV[mode], "CUDA_VISIBLE_DEVICES": cv}
        args = ["-t", "tag_bw", "-m", self.mem, "-s", str(size), "-n", str(n), "-w", str(w)]
        seen, poll = self.side.pids_sampler()
        before = self.side.snapshot()
        wd = self.work / tag
        out = pt.run_pair(run.inst.perftest, args, server_env, client_env, wd, timeout=self.a.timeout, poll=poll)
        after = self.side.stable_snapshot()
        if self.raw:
            d = self.raw / tag
            d.mkdir(parents=True, exist_ok=True)
            (d / "server.txt").write_text(out.server_out)
            (d / "client.txt").write_text(out.client_out)
            (d / "command.txt").write_text(
                f"server: CUDA_VISIBLE_DEVICES={sv} {' '.join(f'{k}={v}' for k, v in sorted(EVIDENCE_ENV[mode].items()))} "
                f"{run.inst.perftest} {' '.join(args)} -p PORT\nclient: CUDA_VISIBLE_DEVICES={cv} ... 127.0.0.1\n")
        res = pt.result_or_raise(out, f"{run.label}, GPU{src.index}->GPU{dst.index}, {size_label(size)}")
        cs = counter_deltas(before[src.uuid], after[src.uuid], _peer_links(src, dst), origin=self.side.origin)
        cd = counter_deltas(before[dst.uuid], after[dst.uuid], _peer_links(dst, src), origin=self.side.origin)
        by_pid = {pid: sorted(u) for pid, u in seen.items()}
        return {"result": res, "out": out, "counters_src": cs, "counters_dst": cd,
                "server_vis": sv, "client_vis": cv,
                "server_nvml": by_pid.get(out.server_pid), "client_nvml": by_pid.get(out.client_pid)}

    def sizes_for(self, run: RunSpec) -> list[int]:
        return self.sizes if run.variant is None else self.variant_sizes

    def measure_pair(self, run: RunSpec, src, dst) -> dict:
        env = self._env(run)
        mode = evidence_mode(run.inst, env, self.a.transport_evidence)
        sizes_out = []
        for size in self.sizes_for(run):
            n, w = iterations_for(size, self.a.target_bytes, self.a.iters)
            tag = f"{_slug(run.label)}/gpu{src.index}-gpu{dst.index}/{size}"
            r = self.perftest_once(run, env, mode, src, dst, size, n, w, tag)
            exp = (n + w) * size
            tx = r["counters_src"]["data_tx"]
            shown = f"{tx / exp:.0%}" if tx is not None else "n/a"
            self.progress.say(f"{run.label} GPU{src.index}->GPU{dst.index} {size_label(size)}: "
                              f"{r['result'].gbps:.1f} GB/s, NVLink counters {shown} of {exp / 1e9:.1f} GB "
                              f"({r['out'].wall_s:.1f}s)")
            sizes_out.append((size, n, w, r))
        ablation = None
        if mode == "lanes":
            big, n, w, r = sizes_out[-1]
            na, wa = iterations_for(big, self.a.target_bytes, max(20, n // 8))  # the slow path: fewer
            abl_env = {**env, "UCX_TLS": tls_without_cuda_ipc(env.get("UCX_TLS"))}
            try:
                ra = self.perftest_once(run, abl_env, "lanes", src, dst, big, na, wa,
                                        f"{_slug(run.label)}/gpu{src.index}-gpu{dst.index}/{big}-without-cuda_ipc")
                ablation = {"UCX_TLS": abl_env["UCX_TLS"], "msg_bytes": big, "ucx_gbps": ra["result"].gbps,
                            "iterations": na, "nvlink_tx_bytes": ra["counters_src"]["data_tx"],
                            "nvlink_rx_bytes": ra["counters_dst"]["data_rx"],
                            "lanes": pt.parse_lanes(ra["out"].client_out), "error": None}
                self.progress.say(f"{run.label} GPU{src.index}->GPU{dst.index} {size_label(big)} with "
                                  f"UCX_TLS={abl_env['UCX_TLS']}: {ra['result'].gbps:.1f} GB/s (ablation)")
            except UserError as e:
                ablation = {"UCX_TLS": abl_env["UCX_TLS"], "msg_bytes": big, "ucx_gbps": None, "error": str(e)}
                self.progress.say(f"{run.label} GPU{src.index}->GPU{dst.index} ablation failed: {e}")
        return {"mode": mode, "sizes": sizes_out, "ablation": ablation}

    def pair_record(self, run: RunSpec, src, dst, m: dict) -> dict:
        first = m["sizes"][0][3]
        sprobe, serr = self.side.probe_visible(first["server_vis"])
        cprobe, cerr = self.side.probe_visible(first["client_vis"])
        vis = {"server_cuda_visible_devices": first["server_vis"], "client_cuda_visible_devices": first["client_vis"],
               "server_declared": self.declared(first["server_vis"]), "client_declared": self.declared(first["client_vis"]),
               "server_probed": sprobe, "client_probed": cprobe, "probe_errors": [e for e in (serr, cerr) if e]}
        memcpy = {size: self.memcpy_gbps(src, dst, size) for size in self.sizes_for(run)}
        return pair_record(src, dst, m["mode"], m["sizes"], m["ablation"], self.baseline.get((src.uuid, dst.uuid), {}),
                           vis, memcpy, self.th, self.mem)

    def run(self) -> list[dict]:
        try:
            return self._run()
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _run(self) -> list[dict]:
        for src, dst in self.pairs:
            self.measure_baseline(src, dst)
        out = []
        for run in self.runs:
            env = self._env(run)
            mode = evidence_mode(run.inst, env, self.a.transport_evidence)
            entry = {"label": run.label, "ucx": run.inst.describe(), "variant": run.variant,
                     "env": {**self.base_env, **(run.variant or {})}, "evidence_method": mode,
                     "counts_for_exit": run.counts_for_exit, "error": None, "pairs": []}
            try:
                if run.inst.preflight_error:
                    raise UserError(run.inst.preflight_error, PERFTEST_FAILED)
                for src, dst in self.pairs:
                    m = self.measure_pair(run, src, dst)
                    entry["pairs"].append(self.pair_record(run, src, dst, m))
            except UserError as e:
                # a settings study that breaks perftest (e.g. a value this UCX does not parse) is a result, not a stop
                if e.exit_code != PERFTEST_FAILED or (run.counts_for_exit and not self.a.keep_going):
                    raise
                entry["error"] = str(e)
                self.errors.append(str(e))
                why = "a study" if not run.counts_for_exit else "--keep-going"
                self.progress.say(f"{run.label}: {e} ({why}: next run)", step=False)
            out.append(entry)
        return out


def transport_evidence(mode: str, out: pt.PairOutput, size: int, ablation: dict | None,
                       default_big_gbps: float, factor: float, mem: str = "cuda") -> TransportEvidence:
    if mode in ("proto-used", "proto-selected"):
        return transport_from_tables(pt.parse_proto_tables(out.server_out), pt.parse_proto_tables(out.client_out),
                                     size, mem)
    lanes = pt.parse_lanes(out.client_out) + pt.parse_lanes(out.server_out)
    note = (f"without cuda_ipc (UCX_TLS={ablation['UCX_TLS']}) at {size_label(ablation['msg_bytes'])}"
            if ablation else "ablation")
    ev = transport_from_lanes(lanes, default_big_gbps, ablation.get("ucx_gbps") if ablation else None, note, factor)
    if ablation and ablation.get("error"):
        ev.detail.append(f"ablation run failed: {ablation['error']}")
    return ev


def ucx_named_gpus(measured: list[tuple], vis: dict, role: str) -> list[str] | None:
    """The GPUs `role`'s protocol tables say it used (`from cuda/GPU1`: a CUDA ordinal in that process), as UUIDs:
    the ordinal indexes the GPUs CUDA showed a probe with the same CUDA_VISIBLE_DEVICES (CUDA's own order), else the
    configured list. None when no table names a GPU (lanes evidence, host memory). Recorded on 2xH200 with both GPUs
    visible: the client printed `cuda/GPU1` -- it sent from the destination GPU."""
    order = vis.get(f"{role}_probed") or vis.get(f"{role}_declared") or []
    found: list[int] = []
    for *_, r in measured:
        for t in pt.parse_proto_tables(getattr(r["out"], f"{role}_out")):
            if t.local_gpu is not None and t.local_gpu not in found:
                found.append(t.local_gpu)
    if not found:
        return None
    return sorted({order[i] if i < len(order) else f"CUDA device {i} (of {len(order)} visible)" for i in found})


def pair_record(src, dst, mode: str, measured: list[tuple], ablation: dict | None, baseline: dict, vis: dict,
                memcpy: dict[int, float | None], th: Thresholds, mem: str = "cuda") -> dict:
    """One pair's JSON record and verdict from what was measured (pure: processes and probes already ran).

    measured: [(size, iterations, warmup, {"result", "out", "counters_src", "counters_dst", "server_nvml",
    "client_nvml"})] in increasing size; vis: the visibility evidence (configured / probed)."""
    from .nvml import nvlink_count

    big_gbps = measured[-1][3]["result"].gbps
    sizes, size_rows = [], []
    for size, n, w, r in measured:
        ev = transport_evidence(mode, r["out"], size, ablation, big_gbps, th.ablation_factor, mem)
        sm = SizeMeasurement(size, n, w, r["result"].gbps, memcpy.get(size), r["counters_src"], r["counters_dst"], ev)
        sizes.append(sm)
        size_rows.append({
            "msg_bytes": size, "iterations": n, "warmup": w, "expected_bytes": sm.expected_bytes,
            "ucx_gbps": _r(sm.ucx_gbps), "perftest_mb_s": r["result"].bw_overall_mbs,
            "memcpy_peer_gbps": _r(sm.memcpy_peer_gbps), "ratio": _r(sm.ratio, 4),
            "nvlink_tx_bytes": sm.nvlink_tx_bytes, "nvlink_rx_bytes": sm.nvlink_rx_bytes,
            "nvlink_tx_fraction": _frac(sm.nvlink_tx_bytes, sm.expected_bytes),
            "nvlink_rx_fraction": _frac(sm.nvlink_rx_bytes, sm.expected_bytes),
            "transport": ev.name, "transport_method": ev.method, "transport_detail": ev.detail,
            "counters": {"src": r["counters_src"], "dst": r["counters_dst"]},
            "processes": {"server_pid": r["out"].server_pid, "client_pid": r["out"].client_pid,
                          "server_gpus_nvml": r.get("server_nvml"), "client_gpus_nvml": r.get("client_nvml")},
            "wall_s": round(r["out"].wall_s, 2),
        })
    s_nvml = sorted({u for *_, r in measured for u in (r.get("server_nvml") or [])}) or None
    c_nvml = sorted({u for *_, r in measured for u in (r.get("client_nvml") or [])}) or None
    s_ucx, c_ucx = (ucx_named_gpus(measured, vis, role) for role in ("server", "client"))
    visibility = Visibility(vis["server_declared"], vis["client_declared"], vis.get("server_probed"),
                            vis.get("client_probed"), s_nvml, c_nvml, s_ucx, c_ucx)
    links = nvlink_count(src, dst)
    pin = PairInput(src.uuid, dst.uuid, links, src.link_speed_gbps, visibility, sizes, baseline.get("counter_fraction"))
    v = evaluate_pair(pin, th)
    big = sizes[-1]
    return {
        "src": src.index, "dst": dst.index, "msg_bytes": big.msg_bytes, "ucx_gbps": _r(big.ucx_gbps),
        "memcpy_peer_gbps": _r(big.memcpy_peer_gbps), "ratio": _r(big.ratio, 4),
        "nvlink_tx_bytes": big.nvlink_tx_bytes, "nvlink_rx_bytes": big.nvlink_rx_bytes,
        "link_capacity_gbps": _r(pin.capacity_gbps), "transport": big.transport.name, "verdict": v.verdict,
        "reasons": v.reasons, "measurement_verdict": v.measurement_verdict, "notes": v.notes,
        "src_uuid": src.uuid, "dst_uuid": dst.uuid, "nvlinks": links, "link_speed_gbps": src.link_speed_gbps,
        "transport_method": big.transport.method, "expected_bytes": big.expected_bytes,
        "sizes": size_rows,
        "evidence": {"visibility": {**vis, "server_nvml": s_nvml, "client_nvml": c_nvml, "server_ucx": s_ucx,
                                    "client_ucx": c_ucx}, "ablation": ablation,
                     "baseline_counter_fraction": baseline.get("counter_fraction")},
    }


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", s).strip("_") or "run"


def _r(x, nd: int = 2):
    return None if x is None else round(float(x), nd)


def _frac(a, b):
    return None if a is None or not b else round(a / b, 4)


# --- report ----------------------------------------------------------------------------------------------------------

def overall_verdict(runs: list[dict]) -> str:
    counted = [p["verdict"] for r in runs if r["counts_for_exit"] for p in r["pairs"]]
    if any(r["error"] for r in runs if r["counts_for_exit"]):
        return "error"
    if any(v == INVALID for v in counted):
        return INVALID
    if any(v == FAIL for v in counted) or not any(v == PASS for v in counted):
        return FAIL
    return PASS


def exit_code(runs: list[dict]) -> int:
    if any(r["error"] for r in runs if r["counts_for_exit"]):
        return PERFTEST_FAILED
    return 0 if overall_verdict(runs) == PASS else VERDICT_FAILED


def build_payload(host: str, driver: str | None, gpus: list, runs: list[dict], baseline: dict, sizes: list[int],
                  th: Thresholds, goals: dict[int, float], command: str, unsafe: bool) -> dict:
    primary = runs[0] if runs else {"pairs": [], "ucx": {}}
    return {
        "host": host,
        "gpus": [{"index": g.index, "uuid": g.uuid, "pci_bus_id": g.pci_bus_id, "name": g.name,
                  "nvlink_peers": g.nvlink_peers, "link_speed_gbps": g.link_speed_gbps} for g in gpus],
        "pairs": primary["pairs"],
        "ucx": {"version": primary["ucx"].get("version"), "source": primary["ucx"].get("source"),
                "prefix": primary["ucx"].get("prefix"), "label": primary.get("label")},
        "verdict": overall_verdict(runs),
        "exit_code": exit_code(runs),
        "runs": runs,
        "baseline": {"tool": "cudaMemcpyPeer (CuPy memcpyPeerAsync, CUDA events, median)",
                     "pairs": [{"src_uuid": s, "dst_uuid": d, **v} for (s, d), v in baseline.items()]},
        "sizes": sizes,
        "thresholds": {"min_ratio": th.min_ratio, "counter_fraction": th.counter_fraction,
                       "ablation_factor": th.ablation_factor},
        "goals": {str(k): v for k, v in goals.items()},
        "unsafe_visible_devices": unsafe,
        "inherited_ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "driver": driver,
        "command": command,
        "generated_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "units": "GB/s = 1e9 bytes/s; perftest prints MB/s meaning MiB/s (2^20), converted; NVLink bytes = bytes",
    }


TABLE_HEADERS = ["run", "pair", "size", "ucx GB/s", "memcpyPeer GB/s", "ratio", "NVLink tx", "NVLink rx",
                 "cap GB/s", "transport", "verdict"]


def table_rows(runs: list[dict]) -> list[list]:
    rows = []
    for r in runs:
        if r["error"]:
            rows.append([r["label"], "-", "-", None, None, None, "-", "-", None, "-", "error"])
        for p in r["pairs"]:
            for s in p["sizes"]:
                last = s["msg_bytes"] == p["msg_bytes"]
                rows.append([r["label"] + ("" if r["counts_for_exit"] else " (study)"),
                             f"GPU{p['src']}->GPU{p['dst']}", size_label(s["msg_bytes"]), s["ucx_gbps"],
                             s["memcpy_peer_gbps"], s["ratio"], _pct(s["nvlink_tx_fraction"]),
                             _pct(s["nvlink_rx_fraction"]), p["link_capacity_gbps"],
                             f"{s['transport']} ({s['transport_method']})", p["verdict"] if last else ""])
    return rows


def _pct(x):
    return "n/a" if x is None else f"{x:.0%}"


def render_markdown(payload: dict, goals: dict[int, float]) -> str:
    from .report import markdown_table

    runs = payload["runs"]
    lines = [f"# verify-nvlink on {payload['host']}", "",
             f"Verdict: **{payload['verdict']}** (exit {payload['exit_code']}). Generated {payload['generated_utc']}, "
             f"driver {payload['driver'] or '?'}.", "", "```", payload["command"], "```", "",
             "## GPUs", "",
             markdown_table(["index", "name", "PCI bus", "UUID", "NVLinks to peers", "link GB/s"],
                            [[g["index"], g["name"], g["pci_bus_id"], g["uuid"],
                              ", ".join(f"{b}: {n}" for b, n in g["nvlink_peers"].items()) or "-",
                              g["link_speed_gbps"]] for g in payload["gpus"]]),
             "", "## Baseline: cudaMemcpyPeer", ""]
    brows = []
    for b in payload["baseline"]["pairs"]:
        if b.get("error"):
            brows.append([b["src_uuid"][:12], b["dst_uuid"][:12], "-", "-", f"error: {b['error']}"])
        for r in b.get("results") or []:
            brows.append([b["src_uuid"][:12], b["dst_uuid"][:12], size_label(r["msg_bytes"]), r["gbps"],
                          _pct(b.get("counter_fraction"))])
    lines += [markdown_table(["src", "dst", "size", "GB/s (median)", "NVLink counters saw"], brows), ""]
    lines += ["## Results", "", markdown_table(TABLE_HEADERS, table_rows(runs)), ""]
    lines += ["Runs marked *(study)* are `--variant` settings: reported, not counted in the exit status.", ""]
    for i, r in enumerate(runs):
        lines += [f"### R{i + 1}: {r['label']}", "", f"- UCX: {r['ucx'].get('version')} -- {r['ucx'].get('source')} "
                  f"({r['ucx'].get('prefix')})", f"- transport evidence: `{r['evidence_method']}`",
                  f"- settings: {' '.join(f'{k}={v}' for k, v in r['env'].items()) or '(defaults)'}"]
        if r["error"]:
            lines.append(f"- **error**: {r['error']}")
        for p in r["pairs"]:
            lines.append(f"- GPU{p['src']}->GPU{p['dst']}: **{p['verdict']}** (measurement alone: "
                         f"{p['measurement_verdict']})")
            lines += [f"  - {x}" for x in p["reasons"]]
            lines += [f"  - note: {x}" for x in p["notes"]]
            for s in p["sizes"]:
                for d in s["transport_detail"]:
                    lines.append(f"  - {size_label(s['msg_bytes'])} transport evidence: {d}")
        lines.append("")
    if goals:
        lines += ["## Benchmark goals (not verdicts)", ""]
        grows = []
        for r in runs:
            for p in r["pairs"]:
                cells = [r["label"], f"GPU{p['src']}->GPU{p['dst']}"]
                for size, goal in sorted(goals.items()):
                    s = next((x for x in p["sizes"] if x["msg_bytes"] == size), None)
                    met = goal_met(s["ratio"] if s else None, goal)
                    cells.append("not measured" if s is None else
                                 f"{s['ratio']:.2f} {'met' if met else 'NOT met'}" if s["ratio"] is not None else "n/a")
                grows.append(cells)
        lines += [markdown_table(["run", "pair"] + [f"ratio @ {size_label(k)} >= {v}" for k, v in sorted(goals.items())],
                                 grows), ""]
    studies = [r for r in runs if not r["counts_for_exit"]]
    if studies:
        lines += ["## Settings studies (change vs the same UCX without the variant)", ""]
        srows = []
        for r in studies:
            base = next((b for b in runs if b["counts_for_exit"] and b["ucx"].get("prefix") == r["ucx"].get("prefix")),
                        None)
            for p in r["pairs"]:
                bp = next((q for q in (base or {}).get("pairs", []) if q["src"] == p["src"] and q["dst"] == p["dst"]),
                          None)
                for s in p["sizes"]:
                    bs = next((x for x in (bp or {}).get("sizes", []) if x["msg_bytes"] == s["msg_bytes"]), None)
                    delta = (f"{(s['ucx_gbps'] / bs['ucx_gbps'] - 1):+.1%}" if bs and bs["ucx_gbps"] else "n/a")
                    srows.append([r["label"], f"GPU{p['src']}->GPU{p['dst']}", size_label(s["msg_bytes"]),
                                  bs["ucx_gbps"] if bs else None, s["ucx_gbps"], delta, s["ratio"]])
        lines += [markdown_table(["variant", "pair", "size", "base GB/s", "variant GB/s", "change", "ratio"], srows), ""]
    lines += ["## How to read this", "",
              "- `ucx GB/s`: ucx_perftest's overall bandwidth; perftest prints MB/s meaning MiB/s, converted to 1e9 B/s.",
              "- `NVLink tx/rx`: bytes the source GPU sent / the destination received on its NVLinks to the peer "
              "during the run, as a share of (iterations + warm-up) x size.",
              "- `cap GB/s`: active links x per-link speed (NVML); a result above it cannot be a transfer between GPUs.",
              "- transport evidence: `proto-used` = UCX_PROTO_INFO=used tables of the measured run; `proto-selected` = "
              "protocol-v2 selection tables; `lanes+ablation` = the endpoint's lanes (UCX_LOG_LEVEL=info) plus a run "
              "with UCX_TLS excluding cuda_ipc (UCX 1.13's default v1 protocols print no tables).", ""]
    return "\n".join(lines)


def render_png(payload: dict) -> bytes | None:
    """GB/s at the largest size: GPU x GPU for one run; pairs x runs (R1.. as in the markdown) for several."""
    from .report import heatmap_png

    all_runs = payload["runs"]
    fits = len(all_runs) <= 3 and all(len(r["label"]) <= 18 for r in all_runs)
    labelled = [(r["label"] if fits else f"R{i + 1}", r) for i, r in enumerate(all_runs) if r["pairs"]]
    if not labelled:
        return None
    big = size_label(labelled[0][1]["pairs"][0]["msg_bytes"])
    if len(labelled) == 1:
        run = labelled[0][1]
        idx = [g["index"] for g in payload["gpus"]]
        mat = [[None for _ in idx] for _ in idx]
        for p in run["pairs"]:
            mat[idx.index(p["src"])][idx.index(p["dst"])] = p["ucx_gbps"]
        return heatmap_png(mat, [f"GPU{i}" for i in idx], [f"GPU{i}" for i in idx],
                           f"ucx_perftest tag_bw {big}, {run['label']}", "GB/s")
    pairs = sorted({(p["src"], p["dst"]) for _, r in labelled for p in r["pairs"]})
    mat = [[next((p["ucx_gbps"] for p in r["pairs"] if (p["src"], p["dst"]) == pr), None) for _, r in labelled]
           for pr in pairs]
    return heatmap_png(mat, [f"{s}->{d}" for s, d in pairs], [lbl for lbl, _ in labelled],
                       f"ucx_perftest tag_bw {big} (GB/s)", "GB/s", xlabel="UCX run (see verify-nvlink.md)",
                       ylabel="GPU pair")


# --- command ---------------------------------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify-nvlink", help="prove, pair by pair, that NVLink delivers (ucx_perftest + NVLink counters)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ucx-prefix", action="append", metavar="DIR|pip|path",
                   help="UCX to test (repeatable, compared side by side): a prefix with bin/ucx_perftest, 'pip' for "
                        "the libucx wheel of this Python, 'path' for ucx_perftest on PATH (default: PATH, then pip)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--all-pairs", action="store_true", help="also measure pairs without NVLink (informational)")
    p.add_argument("--gpus", help="only these GPU indices (comma-separated, nvidia-smi numbering)")
    p.add_argument("--ucx-env", action="append", default=[], metavar="KEY=VAL", help="setting for every run")
    p.add_argument("--variant", action="append", default=[], metavar="'KEY=VAL [KEY=VAL]'",
                   help="an extra run per UCX with these settings (a study: reported, not counted in the exit status)")
    p.add_argument("--variant-sizes", metavar="SIZES", help="message sizes for the --variant runs (default: --sizes)")
    p.add_argument("--variants-on", choices=("all", "first"), default="all",
                   help="run the variants for every --ucx-prefix or only the first (default all)")
    p.add_argument("--min-ratio", type=float, default=0.90, help="ucx/cudaMemcpyPeer needed at the largest size")
    p.add_argument("--counter-fraction", type=float, default=0.90,
                   help="share of the bytes perftest moved that the NVLink counters must show")
    p.add_argument("--ablation-factor", type=float, default=0.5,
                   help="lanes evidence: bandwidth without cuda_ipc must fall below this x the default")
    p.add_argument("--transport-evidence", choices=("auto", "lanes"), default="auto",
                   help="auto: protocol tables where UCX prints them, lanes+ablation otherwise; lanes: always both")
    p.add_argument("--goals", default=DEFAULT_GOALS, help=f"benchmark goals SIZE=RATIO (default {DEFAULT_GOALS})")
    p.add_argument("--target-bytes", type=parse_size, default=parse_size("128GiB"),
                   help="bytes per perftest run, sets the iterations (default 128GiB)")
    p.add_argument("--iters", type=int, help="fixed iterations per run instead of --target-bytes")
    p.add_argument("--memcpy-samples", type=int, default=21, help="cudaMemcpyPeer samples per size (median)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per perftest run")
    p.add_argument("--cuda-lib", action="append", default=[], metavar="DIR",
                   help="extra directory with libcudart.so for the UCX CUDA modules")
    p.add_argument("--unsafe-visible-devices", action="store_true",
                   help="TRAP: give both processes every GPU (as a careless run would); must come out invalid")
    p.add_argument("--keep-going", action="store_true",
                   help="when one UCX's perftest fails, record it and go on with the others (exit 14 at the end)")
    p.add_argument("--raw-dir", help="keep every perftest server/client output here (for fixtures / debugging)")
    p.add_argument("--out", help="write verify-nvlink.{json,md,png} + command.txt here (all or nothing)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.add_argument("--memory-type", default="cuda", choices=("cuda", "host"), help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def run(args) -> int:
    from . import nvml
    from .report import command_line, format_table, write_report

    sizes = parse_sizes(args.sizes)
    goals = parse_goals(args.goals)
    base_env = dict(parse_assignment(e, "--ucx-env") for e in args.ucx_env)
    variants = [parse_variant(v) for v in args.variant]
    if args.variant_sizes:
        parse_sizes(args.variant_sizes)
    only = None
    if args.gpus:
        try:
            only = [int(x) for x in args.gpus.split(",") if x.strip()]
        except ValueError:
            raise UserError(f"--gpus: expected indices like 0,1, got {args.gpus!r}", USAGE) from None
    for name in ("min_ratio", "counter_fraction", "ablation_factor"):
        if not 0 < getattr(args, name) <= 10:
            raise UserError(f"--{name.replace('_', '-')}: out of range", USAGE)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory", USAGE)
    if args.iters is not None and args.iters < 10:
        raise UserError("--iters: at least 10", USAGE)

    installs = [resolve_install(s) for s in (args.ucx_prefix or ["auto"])]   # PERFTEST_MISSING
    gpus = nvml.discover()                                                      # NVML_UNAVAILABLE, NO_GPU
    pairs = select_pairs(gpus, args.all_pairs, only)                            # ONE_GPU, NO_NVLINK
    cuda_dirs = cuda_runtime_dirs(args.cuda_lib)
    for inst in installs:                                                       # PERFTEST_FAILED
        try:
            preflight(inst, child_env(inst, cuda_dirs, base_env))
        except UserError as e:
            if e.exit_code != PERFTEST_FAILED or not args.keep_going or len(installs) == 1:
                raise
            inst.preflight_error = str(e)
            print(f"verify-nvlink: {e} (--keep-going: its runs are reported as errors)", flush=True)
    seen: dict[str, int] = {}
    runs = []
    for k, inst in enumerate(installs):
        for var in [None, *(variants if k == 0 or args.variants_on == "all" else [])]:
            lbl = inst.label + ("" if var is None else " + " + " ".join(f"{key}={val}" for key, val in var.items()))
            seen[lbl] = seen.get(lbl, 0) + 1
            runs.append(RunSpec(inst, var, lbl if seen[lbl] == 1 else f"{lbl} #{seen[lbl]}"))
    th = Thresholds(args.min_ratio, args.counter_fraction, args.ablation_factor)
    side = GpuSide(gpus)
    ver = Verifier(args, gpus, pairs, runs, sizes, side, cuda_dirs, base_env, th)
    if not args.quiet:
        print(f"verify-nvlink: {len(gpus)} GPUs, {len(pairs)} pairs, sizes "
              f"{', '.join(size_label(s) for s in sizes)}; UCX: {', '.join(i.label for i in installs)}"
              + (f"; {len(variants)} variant(s)" if variants else "")
              + ("; UNSAFE visible devices (trap)" if args.unsafe_visible_devices else ""), flush=True)
    results = ver.run()
    try:
        driver = nvml.driver_version()
    except UserError:
        driver = None
    command = recorded_command(command_line())
    payload = build_payload(socket.gethostname(), driver, gpus, results, ver.baseline, sizes, th, goals, command,
                            args.unsafe_visible_devices)
    print(format_table(TABLE_HEADERS, table_rows(results)))
    for r in results:
        for p in r["pairs"]:
            for reason in p["reasons"]:
                print(f"  {r['label']} GPU{p['src']}->GPU{p['dst']} {p['verdict']}: {reason}")
    print(f"verdict: {payload['verdict']}")
    if args.out:
        md = render_markdown(payload, goals)
        png = render_png(payload)
        write_report(args.out, STEM, payload, md, png, command)
        print(f"report: {Path(args.out) / (STEM + '.json')}")
    return payload["exit_code"]


def recorded_command(cli_line: str, argv0: str | None = None) -> str:
    """command.txt's line: as typed, with `python3 -m ucx_dask_gpu.verify_nvlink` when run as a module."""
    import shlex

    argv0 = sys.argv[0] if argv0 is None else argv0
    if argv0.endswith(("verify_nvlink.py", "ucx_dask_gpu.verify_nvlink")):
        return shlex.join(["python3", "-m", "ucx_dask_gpu.verify_nvlink", *shlex.split(cli_line)[1:]])
    return cli_line


def main(argv: list[str] | None = None) -> int:
    """`python -m ucx_dask_gpu.verify_nvlink ...`: the same command without loading the other subcommands (a bare GPU
    host needs only this module's dependencies)."""
    from .cliutil import standalone_main

    return standalone_main("verify-nvlink", register, argv)


if __name__ == "__main__":
    sys.exit(main())
