"""verify-nvlink's readers of tool output, on output RECORDED from real ucx_perftest / ucx_info / nvidia-smi runs
(tests/fixtures/verify_nvlink/cpu-*, tests/fixtures/verify_nvlink/h200x2/, tests/fixtures/h200x2/) and the argument
helpers."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ucx_dask_gpu.ucx import perftest as pt
from ucx_dask_gpu.nvlink import gpuside, verify
from ucx_dask_gpu.errors import USAGE, UserError
from ucx_dask_gpu.nvlink.verdict import transport_from_tables

FIX = Path(__file__).resolve().parent.parent / "fixtures"
VN = FIX / "verify_nvlink"
W121 = VN / "cpu-ucx-1.21.0-wheel"
S113 = VN / "cpu-ucx-1.13.1-source"
S1201 = VN / "cpu-ucx-1.20.1-source"
RECORDED_OK = [W121 / "perftest-host-1m-proto-used", S113 / "perftest-host-64m-log-info",
               S113 / "perftest-host-64m-proto-v2-info"]
RECORDED_FAILED = [W121 / "perftest-cuda-no-gpu", S113 / "perftest-host-1m-proto-info-used-rejected"]
GPU = VN / "h200x2"  # raw-dir layout: <raw|raw-trap>/<run>/<pair>/<size>[-without-cuda_ipc]/{server,client,command}.txt
GPU_RUNS = sorted(d.relative_to(GPU).as_posix() for d in GPU.glob("raw*/*/*/*") if (d / "client.txt").is_file())
EVIDENCE = json.loads((GPU / "recorded-evidence.json").read_text())


def _pair(stem: Path) -> tuple[str, str]:
    return (Path(f"{stem}.server.txt").read_text(), Path(f"{stem}.client.txt").read_text())


def _msg_size(server_out: str) -> int:
    return int(re.search(r"Message size:\s+(\d+)", server_out).group(1))


def _gpu(rel: str) -> tuple[str, str, str]:
    d = GPU / rel
    return (d / "server.txt").read_text(), (d / "client.txt").read_text(), (d / "command.txt").read_text()


def _asked(command: str) -> tuple[int, int, int]:
    """(-s, -n, -w) of a recorded run."""
    return tuple(int(re.search(rf" -{k} (\d+)", command).group(1)) for k in "snw")


# --- results ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stem", RECORDED_OK, ids=lambda p: p.name)
def test_final_row_bandwidth_is_mib_per_second(stem):
    """perftest's "MB/s" must be MiB/s: size / overall latency, read from the same output, agrees only that way."""
    server, client = _pair(stem)
    res = pt.parse_result(client)
    assert res is not None
    size = _msg_size(server)
    from_latency = size / (res.lat_overall_us * 1e-6)          # bytes/s
    assert res.gbps * 1e9 == pytest.approx(from_latency, rel=0.01)
    assert res.bw_overall_mbs * 1e6 != pytest.approx(from_latency, rel=0.01)  # decimal MB would be 4.9% off


@pytest.mark.parametrize("stem", RECORDED_OK, ids=lambda p: p.name)
def test_iterations_are_what_was_asked(stem):
    server, client = _pair(stem)
    n = pt.parse_result(client).iterations
    assert n in (20, 200)  # the recordings used -n 20 / -n 200 (README)
    assert pt.parse_result(server) is None  # only the client prints results


def test_gpu_runs_are_all_here():
    assert len(GPU_RUNS) == 11 and all(r.startswith(("raw/", "raw-trap/")) for r in GPU_RUNS)


@pytest.mark.parametrize("rel", GPU_RUNS)
def test_gpu_final_row(rel):
    """Every recorded GPU run: the result is the client's, for the -n asked, and its MiB/s agree with its latency."""
    server, client, command = _gpu(rel)
    size, n, w = _asked(command)
    assert _msg_size(server) == size
    res = pt.parse_result(client)
    assert res is not None and res.iterations == n and w == n // 10
    assert pt.parse_result(server) is None
    assert res.gbps * 1e9 == pytest.approx(size / (res.lat_overall_us * 1e-6), rel=0.01)


def test_gpu_bandwidths_are_the_ones_the_host_reported():
    """Parsed here from the raw output == written by verify-nvlink on the host (2 decimals)."""
    for key, pair in EVIDENCE["pairs"].items():
        for size, rec in pair["sizes"].items():
            _, client, _ = _gpu(f"{key}/{size}")
            assert round(pt.parse_result(client).gbps, 2) == rec["ucx_gbps"], (key, size)


def test_csv_and_bare_final_formats():
    csv = "iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n" \
          "  50,0.349,55258.818,55258.818,1158.19,1158.19,18,18\n"
    bare = "                          50      0.296 248577.785 73099.937      257.46     875.51           4          14\n"
    r1, r2 = pt.parse_result(csv), pt.parse_result(bare)
    assert (r1.iterations, r1.bw_overall_mbs) == (50, 1158.19)
    assert (r2.iterations, r2.bw_overall_mbs, r2.bw_average_mbs) == (50, 875.51, 257.46)


@pytest.mark.parametrize("stem", RECORDED_FAILED, ids=lambda p: p.name)
def test_failed_runs_have_no_result_and_name_the_cause(stem):
    server, client = _pair(stem)
    assert pt.parse_result(client) is None
    line = pt.error_line(client)
    # the first ERROR line is the cause; the "Failed to run test" that follows is its consequence
    first_error = next(ln for ln in client.splitlines() if " ERROR " in ln)
    assert line and line in first_error and "Failed to run test" not in line
    assert not line.startswith("[")  # log prefix stripped


def test_error_line_on_loader_failure():
    """Recorded: our 1.13.1 ucx_perftest copied without its lib/ (RUNPATH $ORIGIN/../lib): the server never starts,
    the client is never launched."""
    server, client = _pair(S113 / "perftest-relocated-without-lib")
    assert client == "" and pt.error_line(client) is None
    line = pt.error_line(server)
    assert line == server.strip() and "error while loading shared libraries: libucp.so.0" in line
    assert pt.error_line("") is None
    assert pt.error_line("a\nlast words\n") == "last words"


# --- protocol tables -------------------------------------------------------------------------------------------------

def test_used_tables_1_21_host():
    server, client = _pair(W121 / "perftest-host-1m-proto-used")
    size = _msg_size(server)
    st, ct = pt.parse_proto_tables(server), pt.parse_proto_tables(client)
    assert len(st) == 1 and len(ct) == 1 and st[0].used and ct[0].used
    assert ct[0].is_send and ct[0].mem_is("host") and not ct[0].mem_is("cuda")
    assert st[0].is_rndv_fetch and st[0].mem_is("host")
    # exactly one row was used on each side, and it is the one covering the message size
    for t in (st[0], ct[0]):
        used = [r for r in t.rows if r.count]
        assert len(used) == 1 and used[0].covers(size)
        assert all(not r.covers(size) for r in t.rows if not r.count)
    assert st[0].rows[-1].count == ct[0].rows[-1].count  # both sides count the same messages
    ev = transport_from_tables(st, ct, size, mem="host")
    assert ev.method == "proto-used"
    assert ev.transports == tuple(dict.fromkeys(ct[0].rows[-1].transports + st[0].rows[-1].transports))
    # asked about cuda memory in a host-memory run: no header names cuda, so every table is read -- and says cma
    other = transport_from_tables(st, ct, size, mem="cuda")
    assert other.transports == ev.transports and "no table header names cuda" in other.detail[-1]
    assert transport_from_tables([], [], size).transports == ()


def test_used_tables_1_21_gpu_both_directions():
    """Real GPU output: each side prints a send AND a fetch table; the client->server data is the client's send and
    the server's fetch (same count, >= the iterations + warm-up asked), perftest's few control messages the other
    two (same count, small). The count x size is what the NVLink counters saw (to KiB granularity)."""
    for key in ("raw/pip_1.21.0/gpu0-gpu1", "raw/pip_1.21.0/gpu1-gpu0", "raw-trap/pip_1.21.0/gpu0-gpu1"):
        for size_s, rec in EVIDENCE["pairs"][key]["sizes"].items():
            server, client, command = _gpu(f"{key}/{size_s}")
            size, n, w = _asked(command)
            st, ct = pt.parse_proto_tables(server), pt.parse_proto_tables(client)
            assert all(t.used for t in st + ct) and all(t.mem_is("cuda") and not t.mem_is("host") for t in st + ct)
            (c_send,), (c_fetch,) = [t for t in ct if t.is_send], [t for t in ct if t.is_rndv_fetch]
            (s_send,), (s_fetch,) = [t for t in st if t.is_send], [t for t in st if t.is_rndv_fetch]

            def used(t):
                rows = [r for r in t.rows if r.count]
                assert len(rows) == 1 and rows[0].covers(size) and rows[0].transports == ("cuda_ipc",)
                return rows[0].count

            data, control = used(c_send), used(s_send)
            assert used(s_fetch) == data >= n + w and used(c_fetch) == control < (n + w) / 10
            counted = rec["counters"]["src"]["data_tx"] if key.startswith("raw/") else rec["counters"]["dst"]["data_tx"]
            assert counted == pytest.approx(data * size, abs=64 * 1024)
            ev = transport_from_tables(st, ct, size)
            assert ev.transports == ("cuda_ipc",) and len(ev.detail) == 2
            assert ev.detail[0].startswith("client: tagged message") and ev.detail[1].startswith("server: rendezvous")


def test_tables_name_the_gpu_each_process_used():
    """`cuda/GPU<N>` is the CUDA ordinal in the process: 0 when it sees one GPU; in the trap (both visible) the
    client used device 1 and the server device 0."""
    for key, want in (("raw/pip_1.21.0/gpu0-gpu1/268435456", (0, 0)),
                      ("raw/source_1.13.1_UCX_PROTO_ENABLE=y/gpu0-gpu1/268435456", (0, 0)),
                      ("raw-trap/pip_1.21.0/gpu0-gpu1/268435456", (0, 1))):
        server, client, _ = _gpu(key)
        got = tuple({t.local_gpu for t in pt.parse_proto_tables(text) if t.local_gpu is not None}
                    for text in (server, client))
        assert got == ({want[0]}, {want[1]}), key
    host, _ = _pair(W121 / "perftest-host-1m-proto-used")
    assert all(t.local_gpu is None for t in pt.parse_proto_tables(host))


def test_selection_tables_1_13_v2_gpu():
    """UCX 1.13.1 + UCX_PROTO_ENABLE=y on cuda memory: the client's tag-send row names no transport (`rendezvous
    no data fetch`) and is printed twice; the data path is its `rendezvous data send ... to host` table and the
    server's fetch table -- cuda_ipc up to 2787801 bytes, a cma pipeline through host memory above."""
    for size, want in ((1 << 20, ("cuda_ipc",)), (256 << 20, ("cma",))):
        server, client, _ = _gpu(f"raw/source_1.13.1_UCX_PROTO_ENABLE=y/gpu0-gpu1/{size}")
        st, ct = pt.parse_proto_tables(server), pt.parse_proto_tables(client)
        assert not any(t.used for t in st + ct) and all("ep_cfg[1]" in t.ep_cfg for t in st + ct)
        multi = [t for t in ct if t.is_send and t.mem_is("cuda")]
        assert len(multi) == 2 and multi[0].rows == multi[1].rows
        assert [(r.lo, r.hi, r.config) for r in multi[0].rows] == [(0, None, "")]
        (fetch,) = [t for t in st if t.is_rndv_fetch]
        assert [r.transports for r in fetch.rows if r.covers(size)] == [want]
        ev = transport_from_tables(st, ct, size)
        assert ev.method == "proto-selected" and ev.transports == want
        assert sum("tagged message" in d for d in ev.detail) == 1  # the repeated table is read once
        puts = [t for t in ct if t.is_rndv_send]
        if size > 2787801:
            assert puts and any("rendezvous data send(multi) from cuda/GPU0 to host" in d for d in ev.detail)
        else:
            assert not puts  # the receiver fetched: no put table printed


def test_selection_tables_1_13_v2_prefer_multi():
    server, client = _pair(S113 / "perftest-host-64m-proto-v2-info")
    size = _msg_size(server)
    ct = pt.parse_proto_tables(client)
    assert ct and not any(t.used for t in ct)
    assert any("(multi)" in t.operation for t in ct) and any("()" in t.operation for t in ct)
    ev = transport_from_tables(pt.parse_proto_tables(server), ct, size, mem="host")
    assert ev.method == "proto-selected"
    assert ev.transports and all("multi" in d or d.startswith("server") for d in ev.detail)
    # ranges are contiguous from 0 to inf in every table
    for t in ct:
        assert t.rows[0].lo == 0 and t.rows[-1].hi is None
        assert all(a.hi + 1 == b.lo for a, b in zip(t.rows, t.rows[1:]))


def test_lanes_line_1_13():
    server, client = _pair(S113 / "perftest-host-64m-log-info")
    for text in (server, client):
        lanes = pt.parse_lanes(text)
        raw = re.search(r"ep_cfg\[\d+\]: tag\(([^)]*)\)", text).group(1).split()
        assert lanes and lanes[0]["tag"] == raw
    assert pt.parse_proto_tables(client) == []  # protocol v1 prints no tables


@pytest.mark.parametrize("suffix, want", [("", ["sysv/memory", "cma/memory", "cuda_ipc/cuda"]),
                                          ("-without-cuda_ipc", ["sysv/memory", "cma/memory"])])
def test_lanes_line_1_13_gpu(suffix, want):
    """Recorded on the GPU host: one ep_cfg line per side, no cuda_copy lane for cuda memory."""
    for key in ("raw/source_1.13.1/gpu0-gpu1", "raw-trap/source_1.13.1/gpu0-gpu1"):
        server, client, _ = _gpu(f"{key}/{256 << 20}{suffix}")
        for text in (server, client):
            assert pt.parse_lanes(text) == [{"ep_cfg": ["1"], "tag": want}]
            assert pt.parse_proto_tables(text) == []


def test_transports_and_memunits():
    assert pt.transports_in("cuda_ipc/cuda 50% on rc_mlx5/mlx5_0:1 and 50% on path1") == ("cuda_ipc", "rc_mlx5")
    assert pt.transports_in("") == ()
    assert [pt.parse_memunits(x) for x in ("0", "6031", "8K", "1M", "inf")] == [0, 6031, 8192, 1 << 20, None]
    with pytest.raises(ValueError):
        pt.parse_memunits("lots")


# --- ucx_info -c capability probes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("d, version", [(W121, "1.21.0"), (S113, "1.13.1"), (S1201, "1.20.1")],
                         ids=lambda p: getattr(p, "name", p))
def test_proto_info_used_capability(d, version):
    plain = (d / "ucx_info-c.txt").read_text()
    probed = (d / "ucx_info-c-proto-info-used.txt").read_text()
    rejected = "Invalid value for PROTO_INFO" in probed
    assert pt.accepts_proto_info_used(probed, version) is (not rejected and version >= "1.21")
    assert pt.accepts_proto_info_used(plain, version) is False  # the default is never 'used'
    v2 = pt.config_value(plain, "PROTO_ENABLE")
    assert v2 in ("y", "n")
    assert pt.config_value(plain, "PROTO_INFO_DIR") in (None, "")
    assert pt.config_value(plain, "NO_SUCH_THING") is None


def test_versions_differ_as_documented():
    """1.21 (wheel) runs protocol v2 and takes `used`; 1.13.1 runs v1 and rejects it -- the reason for lanes+ablation."""
    assert pt.truthy(pt.config_value((W121 / "ucx_info-c.txt").read_text(), "PROTO_ENABLE"))
    assert not pt.truthy(pt.config_value((S113 / "ucx_info-c.txt").read_text(), "PROTO_ENABLE"))
    assert pt.accepts_proto_info_used((W121 / "ucx_info-c-proto-info-used.txt").read_text(), "1.21.0")
    assert not pt.accepts_proto_info_used((S113 / "ucx_info-c-proto-info-used.txt").read_text(), "1.13.1")


def test_ucx_1_20_echoes_used_but_prints_no_tables():
    """1.20.1 takes UCX_PROTO_INFO=used without complaint (a glob then) and its perftest prints no protocol table:
    verify-nvlink must ask it for selection tables (UCX_PROTO_INFO=y) instead."""
    probed = (S1201 / "ucx_info-c-proto-info-used.txt").read_text()
    assert pt.config_value(probed, "PROTO_INFO") == "used"
    assert not pt.accepts_proto_info_used(probed, "1.20.1")
    assert pt.parse_proto_tables((S1201 / "perftest-host-proto-info-used-client.txt").read_text()) == []


# --- nvidia-smi nvlink -gt d --------------------------------------------------------------------------------------

def test_nvidia_smi_gt_parse_matches_query_gpu():
    text = (FIX / "h200x2" / "nvidia-smi-nvlink-gt-d-idle.txt").read_text()
    per = gpuside.parse_nvidia_smi_gt(text)
    csv = (FIX / "h200x2" / "nvidia-smi-query-gpu.csv").read_text().splitlines()[1:]
    uuids = [line.split(",")[1].strip() for line in csv]
    assert list(per) == uuids
    n_link_lines = len(re.findall(r"Link \d+: Data Tx", text))
    assert sum(len(v) for v in per.values()) == n_link_lines
    assert all(set(v) == {"data_tx", "data_rx"} for links in per.values() for v in links.values())
    busy = text.replace("Data Tx: 0 KiB", "Data Tx: 3 KiB", 1)
    assert gpuside.parse_nvidia_smi_gt(busy)[uuids[0]][0]["data_tx"] == 3 * 1024


# --- argument helpers ----------------------------------------------------------------------------------------------

def test_sizes():
    assert verify.parse_sizes(verify.DEFAULT_SIZES) == [1 << 20, 64 << 20, 256 << 20]
    # dask's units, as every size option: 1m and 4k are decimal, 1MiB binary
    assert verify.parse_sizes("268435456, 1m,4k,1MiB,4KiB") == [4000, 4096, 10**6, 1 << 20, 1 << 28]
    for bad in ("1Q", "", "0", "-4k", "0.5"):
        with pytest.raises(UserError) as e:
            verify.parse_sizes(bad)
        assert e.value.exit_code == USAGE


def test_env_assignments_and_variants():
    assert verify.parse_variant("UCX_RNDV_FRAG_SIZE=host:1m,cuda:4m  UCX_MAX_RNDV_RAILS=1") == {
        "UCX_RNDV_FRAG_SIZE": "host:1m,cuda:4m", "UCX_MAX_RNDV_RAILS": "1"}
    for bad in ("CUDA_VISIBLE_DEVICES=0,1", "LD_LIBRARY_PATH=/x", "NOEQUALS", "1BAD=x"):
        with pytest.raises(UserError) as e:
            verify.parse_assignment(bad, "--ucx-env")
        assert e.value.exit_code == USAGE
    assert verify.parse_goals("256MiB=0.97,1MiB=0.5") == {1 << 28: 0.97, 1 << 20: 0.5}
    with pytest.raises(UserError):
        verify.parse_goals("256MiB")


def test_tls_without_cuda_ipc():
    assert verify.tls_without_cuda_ipc(None) == "^cuda_ipc"
    assert verify.tls_without_cuda_ipc("all") == "^cuda_ipc"
    assert verify.tls_without_cuda_ipc("^tcp") == "^tcp,cuda_ipc"
    assert verify.tls_without_cuda_ipc("^cuda_ipc") == "^cuda_ipc"
    assert verify.tls_without_cuda_ipc("sm,cuda_copy,cuda_ipc") == "sm,cuda_copy"


@pytest.mark.parametrize("size", [1 << 20, 64 << 20, 256 << 20, 3 << 30])
def test_iterations_make_warmup_exact_in_every_ucx(size):
    target = 128 << 30
    n, w = verify.iterations_for(size, target)
    assert n % 10 == 0 and w == n // 10
    # perftest's own rule: min(-w, max_iter/10) (1.13: floor; newer: round up) -- both give w for these n
    assert min(w, n // 10) == w == min(w, -(-n // 10))
    assert n >= 20 and (n * size >= target * 0.9 or n == 20 or n == 200_000)
    assert verify.iterations_for(size, target, fixed=33) == (40, 4)
