"""Inputs for verify-nvlink's decision tests, built from fixtures: the 2xH200 topology from the nvidia-smi output
recorded there, perftest output (tests/fixtures/verify_nvlink/), and NVLink counter snapshots."""
from __future__ import annotations

import re
from pathlib import Path

from ucx_dask_gpu import nvml
from ucx_dask_gpu import perftest as pt
from ucx_dask_gpu.nvlink_verdict import counter_deltas

FIX = Path(__file__).resolve().parent.parent / "fixtures"
H200 = FIX / "h200x2"
CONSTRUCTED = FIX / "verify_nvlink" / "constructed-h200x2"


def h200_gpus() -> list[nvml.Gpu]:
    """The two H200s as NVML would describe them, from the recorded query-gpu / nvlink -s output."""
    rows = [[c.strip() for c in line.split(",")] for line in (H200 / "nvidia-smi-query-gpu.csv").read_text().splitlines()[1:]]
    speeds: dict[str, list[float]] = {}
    cur = None
    for line in (H200 / "nvidia-smi-nvlink-s.txt").read_text().splitlines():
        m = re.search(r"UUID:\s*(\S+)\)", line)
        if m:
            cur = speeds.setdefault(m.group(1), [])
        m = re.search(r"Link \d+: ([\d.]+) GB/s", line)
        if m and cur is not None:
            cur.append(float(m.group(1)))
    gpus = [nvml.Gpu(index=int(r[0]), uuid=r[1], pci_bus_id=nvml.normalise_bus_id(r[2]), name=r[3]) for r in rows]
    for g in gpus:
        (peer,) = [o for o in gpus if o is not g]
        g.links = {i: peer.pci_bus_id for i in range(len(speeds[g.uuid]))}
        g.nvlink_peers = {peer.pci_bus_id: len(speeds[g.uuid])}
        g.link_speed_gbps = min(speeds[g.uuid])
    return gpus


def snapshot(gpu: nvml.Gpu, tx: int, rx: int, base: int = 7 << 30) -> nvml.NvlinkThroughput:
    """Counters of one GPU after it sent `tx` and received `rx` bytes (KiB granularity, spread over its links)."""
    n = len(gpu.links)
    answers = []
    for ln in sorted(gpu.links):
        answers += [(nvml.FI_NVLINK_THROUGHPUT_DATA_TX, ln, 0, (base + tx) // 1024 // n),
                    (nvml.FI_NVLINK_THROUGHPUT_DATA_RX, ln, 0, (base + rx) // 1024 // n)]
    total_tx = sum(v for f, _, _, v in answers if f == nvml.FI_NVLINK_THROUGHPUT_DATA_TX)
    total_rx = sum(v for f, _, _, v in answers if f == nvml.FI_NVLINK_THROUGHPUT_DATA_RX)
    answers += [(nvml.FI_NVLINK_THROUGHPUT_DATA_TX, nvml.NVLINK_SCOPE_ALL_LINKS, 0, total_tx),
                (nvml.FI_NVLINK_THROUGHPUT_DATA_RX, nvml.NVLINK_SCOPE_ALL_LINKS, 0, total_rx),
                (nvml.FI_NVLINK_THROUGHPUT_RAW_TX, nvml.NVLINK_SCOPE_ALL_LINKS, 3, 0)]  # raw: NOT_SUPPORTED here
    return nvml.throughput_from_field_values(gpu.uuid, answers)


def deltas(src: nvml.Gpu, dst: nvml.Gpu, sent: int, received: int | None = None, back: int = 0) -> tuple[dict, dict]:
    """counter_deltas() of src and dst for a run where src sent `sent` bytes to dst (and dst sent `back`)."""
    received = sent if received is None else received
    links_sd = sorted(ln for ln, p in src.links.items() if p == dst.pci_bus_id)
    links_ds = sorted(ln for ln, p in dst.links.items() if p == src.pci_bus_id)
    cs = counter_deltas(snapshot(src, 0, 0), snapshot(src, sent, back), links_sd)
    cd = counter_deltas(snapshot(dst, 0, 0), snapshot(dst, back, received), links_ds)
    return cs, cd


def output(stem: str) -> pt.PairOutput:
    server = (CONSTRUCTED / f"{stem}.server.txt").read_text()
    client = (CONSTRUCTED / f"{stem}.client.txt").read_text()
    ok = pt.parse_result(client) is not None
    return pt.PairOutput(server, client, 0 if ok else 255, 0 if ok else 127, 4101, 4102, 2.5)


def measured(stem: str, src, dst, sent_fraction: float = 1.02, received_fraction: float | None = None,
             server_nvml=None, client_nvml=None) -> tuple:
    """(size, n, warmup, raw) for pair_record, from a perftest output fixture and counters that saw
    `sent_fraction` of the bytes perftest moved."""
    out = output(stem)
    res = pt.parse_result(out.client_out)
    size = int(re.search(r"Message size:\s+(\d+)", out.server_out).group(1))
    n = res.iterations
    w = n // 10
    moved = (n + w) * size
    rf = sent_fraction if received_fraction is None else received_fraction
    cs, cd = deltas(src, dst, int(moved * sent_fraction), int(moved * rf))
    raw = {"result": res, "out": out, "counters_src": cs, "counters_dst": cd,
           "server_nvml": server_nvml, "client_nvml": client_nvml}
    return size, n, w, raw


def isolated_visibility(src, dst) -> dict:
    return {"server_cuda_visible_devices": dst.uuid, "client_cuda_visible_devices": src.uuid,
            "server_declared": [dst.uuid], "client_declared": [src.uuid],
            "server_probed": [dst.uuid], "client_probed": [src.uuid], "probe_errors": []}


def trap_visibility(gpus) -> dict:
    all_idx = ",".join(str(g.index) for g in gpus)
    every = [g.uuid for g in gpus]
    return {"server_cuda_visible_devices": all_idx, "client_cuda_visible_devices": all_idx,
            "server_declared": every, "client_declared": every,
            "server_probed": every, "client_probed": every, "probe_errors": []}
