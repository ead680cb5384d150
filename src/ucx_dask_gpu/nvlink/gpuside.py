"""verify-nvlink's GPU side, for one invocation: NVLink counter snapshots (NVML, else `nvidia-smi nvlink -gt d`), the
GPUs NVML lists each perftest process on, and the CUDA probes (visible devices, cudaMemcpyPeer) run in a child
process with the environment perftest gets (gpuprobe.py)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from .. import nvml

PROBE_MODULE = "ucx_dask_gpu.nvlink.gpuprobe"


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
        if cuda_visible not in self._probe_cache:
            out, err = self._probe(["visible"], cuda_visible, 120, "probe")
            by_bus = {g.pci_bus_id: g.uuid for g in self.gpus}
            self._probe_cache[cuda_visible] = (None, err) if out is None else (
                [d.get("uuid") or by_bus.get(d.get("pci_bus_id"), d.get("pci_bus_id")) for d in out["devices"]], None)
        return self._probe_cache[cuda_visible]

    def memcpy_peer(self, src, dst, sizes: list[int], samples: int, timeout: float) -> tuple[dict | None, str | None]:
        return self._probe(["memcpy-peer", "--sizes", ",".join(map(str, sizes)), "--samples", str(samples)],
                           f"{src.uuid},{dst.uuid}", timeout, "cudaMemcpyPeer probe")

    def _probe(self, args: list[str], cuda_visible: str, timeout: float, what: str) -> tuple[dict | None, str | None]:
        """gpuprobe `args` in a child that sees `cuda_visible`: (its answer, None), or (None, why there is none)."""
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": cuda_visible, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        try:
            r = subprocess.run([self.python, "-m", PROBE_MODULE, *args], env=env, capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"{what} did not finish in {timeout:.0f} s"
        if r.returncode != 0:
            return None, (r.stderr.strip().splitlines() or [f"{what} failed"])[-1]
        return json.loads(r.stdout), None


def _data_key(snap: dict) -> tuple:
    return tuple(sorted((u, s.total.get("data_tx"), s.total.get("data_rx"),
                         tuple(sorted((ln, v.get("data_tx"), v.get("data_rx")) for ln, v in s.links.items())))
                        for u, s in snap.items()))
