"""Fixtures of the unit tests: tar archives built entry by entry, tag-like source archives with the tree ids git gives
them, and the 2xH200 session verify-nvlink recorded."""
from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from ucx_dask_gpu import nvml
from ucx_dask_gpu.nvlink.verdict import Thresholds, counter_deltas
from ucx_dask_gpu.nvlink.verify import pair_record
from ucx_dask_gpu.ucx import perftest as pt


def _make_tar(entries, fmt=tarfile.PAX_FORMAT, mtime: int = 0) -> bytes:
    """entries: (name, kind, dict) with kind file/dir/symlink/hardlink/char; dict: data, mode, mtime (default:
    `mtime`), uid, gid, uname, gname, link, pax."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, kind, opts in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = opts.get("mtime", mtime)
            ti.mode = opts.get("mode", 0o755 if kind == "dir" else 0o644)
            ti.uid, ti.gid = opts.get("uid", 0), opts.get("gid", 0)
            ti.uname, ti.gname = opts.get("uname", "root"), opts.get("gname", "root")
            ti.pax_headers = dict(opts.get("pax", {}))
            data = None
            if kind == "file":
                data = opts.get("data", b"")
                ti.size = len(data)
            elif kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif kind == "symlink":
                ti.type, ti.linkname = tarfile.SYMTYPE, opts["link"]
            elif kind == "hardlink":
                ti.type, ti.linkname = tarfile.LNKTYPE, opts["link"]
            elif kind == "char":
                ti.type, ti.devmajor, ti.devminor = tarfile.CHRTYPE, 1, 3
            t.addfile(ti, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


@pytest.fixture(scope="session")
def make_tar():
    """make_tar(entries, fmt=PAX, mtime=0) -> the bytes of a tar archive holding `entries`."""
    return _make_tar


# --- source archives like `git archive` makes them ----------------------------------------------------------------

def _make_archive(path: Path, top: str, files: dict[str, bytes], executable: set[str] = frozenset(),
                  symlinks: dict[str, str] | None = None, empty_dirs: tuple[str, ...] = ()) -> Path:
    """A .tar.gz like `git archive --prefix=TOP/`: files (some executable), symlinks and empty directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for d in (top, *(f"{top}/{e}" for e in empty_dirs)):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o775
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o775 if name in executable else 0o664
            tar.addfile(info, io.BytesIO(data))
        for name, target in sorted((symlinks or {}).items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def _git_write_tree(work: Path, archive: Path) -> str:
    """The tree id git itself gives the unpacked archive (`git add -A -f && git write-tree`)."""
    root = work / f"git-{archive.name}"
    root.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="tar")
    (top,) = list(root.iterdir())
    subprocess.run(["git", "init", "-q"], cwd=top, check=True)
    subprocess.run(["git", "add", "-A", "-f"], cwd=top, check=True)
    return subprocess.run(["git", "write-tree"], cwd=top, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def make_archive():
    """make_archive(path, top, files, executable=..., symlinks=..., empty_dirs=...) -> a .tar.gz like git archive."""
    return _make_archive


@pytest.fixture
def git_write_tree():
    """git_write_tree(work, archive) -> the tree id git gives the archive's content."""
    return _git_write_tree


# --- the 2xH200 session verify-nvlink recorded ------------------------------------------------------------------------

FIX = Path(__file__).resolve().parent.parent / "fixtures"
H200 = FIX / "h200x2"
RECORDED = FIX / "verify_nvlink" / "h200x2"


class RecordedH200:
    """Inputs for verify-nvlink's decision tests, built from fixtures: the 2xH200 topology from the nvidia-smi output
    recorded there, ucx_perftest output and the evidence verify-nvlink recorded on the 2xH200 GPU host
    (tests/fixtures/verify_nvlink/h200x2/, see its README), and NVLink counter snapshots."""

    FIX = FIX
    # recorded runs (raw-dir layout: <raw|raw-trap>/<run>/<pair>/<size>[-without-cuda_ipc]/{server,client,command}.txt)
    PIP = "raw/pip_1.21.0/gpu0-gpu1"
    PIP_BACK = "raw/pip_1.21.0/gpu1-gpu0"
    OURS = "raw/source_1.13.1/gpu0-gpu1"
    OURS_V2 = "raw/source_1.13.1_UCX_PROTO_ENABLE=y/gpu0-gpu1"
    TRAP_PIP = "raw-trap/pip_1.21.0/gpu0-gpu1"
    TRAP_OURS = "raw-trap/source_1.13.1/gpu0-gpu1"

    def __init__(self):
        self.recorded = json.loads((RECORDED / "recorded-evidence.json").read_text())
        self.gpus = self.recorded_gpus()

    @property
    def g0(self) -> nvml.Gpu:
        return self.gpus[0]

    @property
    def g1(self) -> nvml.Gpu:
        return self.gpus[1]

    def smi_gpus(self) -> list[nvml.Gpu]:
        """The two H200s as NVML would describe them, from the recorded query-gpu / nvlink -s output."""
        query = (H200 / "nvidia-smi-query-gpu.csv").read_text().splitlines()[1:]
        rows = [[c.strip() for c in line.split(",")] for line in query]
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

    def snapshot(self, gpu: nvml.Gpu, tx: int, rx: int, base: int = 7 << 30) -> nvml.NvlinkThroughput:
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

    def deltas(self, src: nvml.Gpu, dst: nvml.Gpu, sent: int, received: int | None = None,
               back: int = 0) -> tuple[dict, dict]:
        """counter_deltas() of src and dst for a run where src sent `sent` bytes to dst (and dst sent `back`)."""
        received = sent if received is None else received
        links_sd = sorted(ln for ln, p in src.links.items() if p == dst.pci_bus_id)
        links_ds = sorted(ln for ln, p in dst.links.items() if p == src.pci_bus_id)
        cs = counter_deltas(self.snapshot(src, 0, 0), self.snapshot(src, sent, back), links_sd)
        cd = counter_deltas(self.snapshot(dst, 0, 0), self.snapshot(dst, back, received), links_ds)
        return cs, cd

    def recorded_gpus(self) -> list[nvml.Gpu]:
        """The two H200s of the recorded session, as verify-nvlink described them in its JSON."""
        gpus = []
        for g in self.recorded["gpus"]:
            (peer, n), = g["nvlink_peers"].items()
            gpus.append(nvml.Gpu(index=g["index"], uuid=g["uuid"], pci_bus_id=g["pci_bus_id"], name=g["name"],
                                 nvlink_peers=dict(g["nvlink_peers"]), links={i: peer for i in range(n)},
                                 link_speed_gbps=g["link_speed_gbps"]))
        return gpus

    def run_dir(self, pair: str, size: int, suffix: str = "") -> Path:
        return RECORDED / pair / f"{size}{suffix}"

    def command(self, pair: str, size: int, suffix: str = "") -> tuple[int, int]:
        """(-n, -w) of the recorded run, from its command.txt."""
        text = (self.run_dir(pair, size, suffix) / "command.txt").read_text()
        return int(re.search(r" -n (\d+)", text).group(1)), int(re.search(r" -w (\d+)", text).group(1))

    def output(self, pair: str, size: int, suffix: str = "") -> pt.PairOutput:
        d = self.run_dir(pair, size, suffix)
        server, client = (d / "server.txt").read_text(), (d / "client.txt").read_text()
        ok = pt.parse_result(client) is not None
        return pt.PairOutput(server, client, 0 if ok else 255, 0 if ok else 127, 4101, 4102, 2.5)

    def measured(self, pair: str, size: int, src, dst, sent_fraction: float = 1.02,
                 received_fraction: float | None = None, server_nvml=None, client_nvml=None) -> tuple:
        """(size, n, warmup, raw) for pair_record: a recorded perftest output with SYNTHETIC counters that saw
        `sent_fraction` of the bytes perftest moved -- for the decision's boundaries (replay() uses the recorded
        ones)."""
        out = self.output(pair, size)
        res = pt.parse_result(out.client_out)
        n, w = self.command(pair, size)
        assert res.iterations == n
        moved = (n + w) * size
        rf = sent_fraction if received_fraction is None else received_fraction
        cs, cd = self.deltas(src, dst, int(moved * sent_fraction), int(moved * rf))
        raw = {"result": res, "out": out, "counters_src": cs, "counters_dst": cd,
               "server_nvml": server_nvml, "client_nvml": client_nvml}
        return size, n, w, raw

    def evidence(self, pair: str) -> dict:
        return self.recorded["pairs"][pair]

    def ablation_of(self, pair: str) -> dict | None:
        """The ablation as verify-nvlink builds it, from the recorded `-without-cuda_ipc` run (None if there is
        none)."""
        ev = self.evidence(pair)["ablation"]
        if ev is None:
            return None
        size = ev["msg_bytes"]
        out = self.output(pair, size, "-without-cuda_ipc")
        n, w = self.command(pair, size, "-without-cuda_ipc")
        return {"UCX_TLS": ev["UCX_TLS"], "msg_bytes": size, "ucx_gbps": pt.parse_result(out.client_out).gbps,
                "iterations": n, "lanes": pt.parse_lanes(out.client_out), "error": None}

    def replay(self, pair: str, sizes: list[int] | None = None, gpus: list[nvml.Gpu] | None = None, th=None,
               mode: str | None = None) -> dict:
        """verify-nvlink's pair record, recomputed from what the GPU host recorded: the perftest outputs kept here, and
        the NVLink counter deltas, NVML process lists, visibility and cudaMemcpyPeer baseline from its JSON."""
        ev = self.evidence(pair)
        gpus = gpus or self.recorded_gpus()
        src, dst = gpus[ev["src"]], gpus[ev["dst"]]
        sizes = sizes or sorted(int(s) for s in ev["sizes"])
        ms = []
        for size in sizes:
            rec = ev["sizes"][str(size)]
            out = self.output(pair, size)
            n, w = self.command(pair, size)
            assert (n, w) == (rec["iterations"], rec["warmup"])
            ms.append((size, n, w, {"result": pt.parse_result(out.client_out), "out": out,
                                    "counters_src": rec["counters"]["src"], "counters_dst": rec["counters"]["dst"],
                                    "server_nvml": rec["processes"]["server_gpus_nvml"],
                                    "client_nvml": rec["processes"]["client_gpus_nvml"]}))
        memcpy = {size: ev["sizes"][str(size)]["memcpy_peer_gbps"] for size in sizes}
        baseline = {"counter_fraction": ev["baseline_counter_fraction"]}
        return pair_record(src, dst, mode or ev["evidence_method"], ms, self.ablation_of(pair), baseline,
                           dict(ev["visibility"]), memcpy, th or Thresholds())

    def isolated_visibility(self, src, dst) -> dict:
        return {"server_cuda_visible_devices": dst.uuid, "client_cuda_visible_devices": src.uuid,
                "server_declared": [dst.uuid], "client_declared": [src.uuid],
                "server_probed": [dst.uuid], "client_probed": [src.uuid], "probe_errors": []}


@pytest.fixture(scope="session")
def h200() -> RecordedH200:
    """What the 2xH200 GPU host recorded for verify-nvlink (tests/fixtures/verify_nvlink/h200x2/)."""
    return RecordedH200()
