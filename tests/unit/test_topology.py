"""Topology parsing and the worker plan, from recorded `nvidia-smi topo -m` listings and sysfs records."""
from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu import errors, nvml
from ucx_dask_gpu.topology.machine import (PciLocation, assemble, discover_nics, materialize_sysfs, numa_cpus, pci_level,
                                           pci_location, record_sysfs)
from ucx_dask_gpu.topology.model import MAX_CPU_ID, NicInfo, format_cpulist, parse_cpulist
from ucx_dask_gpu.topology.plan import largest_nvlink_subset, make_plan, worker_settings
from ucx_dask_gpu.topology.topotext import parse_topo_text, read_topo_file
from ucx_dask_gpu.cli import main
from ucx_dask_gpu.errors import UserError

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
DGX1 = FIXTURES / "dgx1" / "nvidia-smi-topo-m.txt"
DGX1_BLOG = FIXTURES / "dgx1" / "topo-m-dask-blog-2019.txt"
H200 = FIXTURES / "h200x2" / "nvidia-smi-topo-m.txt"
BUILD_VM_SYSFS = FIXTURES / "build-vm" / "sysfs-record.txt"

SOCKET0 = list(range(0, 20)) + list(range(40, 60))      # DGX-1 "0-19,40-59"
SOCKET1 = list(range(20, 40)) + list(range(60, 80))     # DGX-1 "20-39,60-79"


def _raw_rows(path: Path) -> dict[str, list[str]]:
    """The listing's rows split naively (an independent reading to check the parser against)."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = line.replace("\t", " ").split()
        if cells and re.fullmatch(r"(GPU\d+|mlx5_\d+|ib\d+)", cells[0]) and len(cells) > 4:
            rows[cells[0]] = cells[1:]
    return rows


# --- parsing ---------------------------------------------------------------------------------------------------------

def test_dgx1_matrix_parsed_as_printed():
    topo = read_topo_file(str(DGX1))
    raw = _raw_rows(DGX1)
    assert [g.index for g in topo.gpus] == list(range(8))
    # NIC columns keep nvidia-smi's order, which is not numeric
    assert [n.name for n in topo.nics] == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]
    assert all(n.kind == "ib" and n.rdma_device == n.name and n.port == 1 for n in topo.nics)
    for i, j in itertools.permutations(range(8), 2):
        cell = raw[f"GPU{i}"][j]
        assert topo.gpu_links[(i, j)] == ("SYS" if cell == "SOC" else cell)   # old drivers' SOC is SYS
    assert topo.nvlinks(0, 3) == 2 and topo.nvlinks(0, 1) == 1 and topo.nvlinks(0, 5) == 0
    assert topo.gpu_nic[(2, "mlx5_1")] == "PIX" and topo.gpu_nic[(2, "mlx5_2")] == "SYS"
    assert [g.cpus for g in topo.gpus] == [SOCKET0] * 4 + [SOCKET1] * 4
    assert all(g.cpus_source == "topo-text" for g in topo.gpus)


def test_blog_listing_with_separate_affinity_block():
    topo = read_topo_file(str(DGX1_BLOG))
    assert [n.name for n in topo.nics] == ["ib0", "ib1", "ib2", "ib3"]
    assert all(n.kind == "ib" and n.netdev == n.name and n.rdma_device is None for n in topo.nics)
    assert [g.cpus for g in topo.gpus] == [SOCKET0] * 4 + [SOCKET1] * 4
    # the same machine as the nvidia-smi layout: identical GPU matrix
    assert topo.gpu_links == read_topo_file(str(DGX1)).gpu_links


def test_h200_recording_ansi_header_and_numa_columns():
    text = H200.read_text()
    assert "\x1b[" in text                  # the recording keeps nvidia-smi's underline escape
    topo = parse_topo_text(text)
    assert [g.index for g in topo.gpus] == [0, 1]
    assert topo.gpu_links == {(0, 1): "NV18", (1, 0): "NV18"}
    assert [g.cpus for g in topo.gpus] == [list(range(32))] * 2
    assert [g.numa_nodes for g in topo.gpus] == [[0], [0]]      # despite nvidia-smi's extra tab before GPU NUMA ID
    assert topo.nics == []


def test_nic_legend_names_nic_columns():
    # Format sample (not a recording): the H200 listing with one NIC column in the form current nvidia-smi prints
    # NICs -- numbered columns and a "NIC Legend" block that names them.
    text = (
        "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
        "GPU0\t X \tNV18\tPIX\t0-31\t0\t\tN/A\n"
        "GPU1\tNV18\t X \tNODE\t0-31\t0\t\tN/A\n"
        "NIC0\tPIX\tNODE\t X \t\t\t\t\n"
        "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
        "\nNIC Legend:\n\n  NIC0: mlx5_0\n\n")
    topo = parse_topo_text(text)
    assert [(n.name, n.kind, n.rdma_device) for n in topo.nics] == [("mlx5_0", "ib", "mlx5_0")]
    assert topo.gpu_nic == {(0, "mlx5_0"): "PIX", (1, "mlx5_0"): "NODE"}
    plan = make_plan(topo, net_devices=True)
    assert [w.env.get("UCX_NET_DEVICES") for w in plan.workers] == ["mlx5_0:1", "mlx5_0:1"]


@pytest.mark.parametrize("mutate, needle", [
    (lambda t: t.replace("GPU3\tNV2\tNV1\tNV2\t X ", "GPU3\tNV2\tNV1\tNV2\tNV9", 1), "X belongs on the diagonal"),
    (lambda t: t.replace("GPU1\tNV1\t X \tNV2", "GPU1\tNV1\t X \tQPI", 1), "unknown connection 'QPI'"),
    (lambda t: t.replace("GPU5\tSOC\tNV2", "GPU5\tSOC\tNV1", 1), "but GPU5->GPU1"),
    (lambda t: "\n".join(ln for ln in t.splitlines() if not ln.startswith("mlx5_2")), "no row for mlx5_2"),
    (lambda t: t.replace("0-19,40-59", "0-19,x", 1), "not a CPU list"),
    (lambda t: t.replace("\tPIX\tSOC\tPHB\tSOC\t0-19,40-59", "\tPIX\tSOC", 1), "matrix cells"),
    (lambda t: "garbage without a header\n" + t, "expected a header line"),
    (lambda t: "", "no topology matrix"),
])
def test_malformed_text_is_one_clear_error(mutate, needle):
    with pytest.raises(UserError) as e:
        parse_topo_text(mutate(DGX1.read_text()), source="x.txt")
    assert e.value.exit_code == errors.BAD_TOPOLOGY
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_pasted_listing_with_prompt_and_spaces():
    # as people paste it: a shell prompt, tabs turned into spaces
    text = "root@node2:~# nvidia-smi topo -m\n" + H200.read_text().replace("\t", "    ")
    topo = parse_topo_text(text)
    assert topo.gpu_links[(0, 1)] == "NV18" and [g.cpus for g in topo.gpus] == [list(range(32))] * 2
    assert [g.numa_nodes for g in topo.gpus] == [[0], [0]]


def test_no_gpu_rows_is_no_gpu():
    text = "\tmlx5_0\tmlx5_1\nmlx5_0\t X \tPIX\nmlx5_1\tPIX\t X \n"
    with pytest.raises(UserError) as e:
        parse_topo_text(text)
    assert e.value.exit_code == errors.NO_GPU


def test_cpulist_round_trip():
    for text in ("0-19,40-59", "20-39,60-79", "0", "0-31", "1,3,5-7"):
        assert format_cpulist(parse_cpulist(text)) == text
    with pytest.raises(ValueError):
        parse_cpulist("5-3")


def test_cpulists_are_bounded_before_they_are_expanded():
    assert parse_cpulist(f"0-{MAX_CPU_ID}")[-1] == MAX_CPU_ID and parse_cpulist("007") == [7]
    for text in (f"0-{MAX_CPU_ID + 1}", "0-3000000000", "1" * 5000, "0," + "9" * 100_000, "4-" + "1" * 40):
        with pytest.raises(ValueError, match=f"above {MAX_CPU_ID}"):
            parse_cpulist(text)


@pytest.mark.parametrize("column", ["CPU Affinity", "NUMA Affinity"])
def test_a_topo_listing_with_a_huge_range_is_one_line_exit_50(column, tmp_path, capsys):
    lines = H200.read_text().splitlines()
    cells = lines[1].split("\t")
    cells[3 if column == "CPU Affinity" else 4] = "0-3000000000"
    bad = tmp_path / "topo.txt"
    bad.write_text("\n".join([lines[0], "\t".join(cells), *lines[2:]]) + "\n")
    assert main(["topology", "--from-topo", str(bad)]) == errors.BAD_TOPOLOGY
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 'GPU0'" in err[0] and f"above {MAX_CPU_ID}" in err[0]


def test_a_sysfs_record_with_a_huge_cpulist_is_one_line_exit_51(tmp_path, capsys):
    record = tmp_path / "record.txt"
    record.write_text(BUILD_VM_SYSFS.read_text().replace("node0/cpulist\t0-1", "node0/cpulist\t0-3000000000"))
    with pytest.raises(UserError) as e:
        numa_cpus(materialize_sysfs(record.read_text(), tmp_path / "root"))
    assert e.value.exit_code == errors.SYSFS_UNREADABLE and "node0/cpulist" in str(e.value)


def test_nvml_affinity_mask_unpacking():
    # word 0 holds CPUs 0..63; DGX-1 socket 1 = 20-39 and 60-79 spans two words
    words = [sum(1 << c for c in SOCKET1 if c < 64), sum(1 << (c - 64) for c in SOCKET1 if c >= 64)]
    assert nvml.unpack_mask(words) == SOCKET1


# --- the plan ----------------------------------------------------------------------------------------------------------

def test_dgx1_plan_cores_and_nics_follow_the_listing():
    topo = read_topo_file(str(DGX1))
    plan = make_plan(topo, gpus="all")
    pinned = make_plan(topo, gpus="all", net_devices=True)
    assert [w.gpu for w in plan.workers] == list(range(8))
    for w, p in zip(plan.workers, pinned.workers):
        assert w.cpus == (SOCKET0 if w.gpu < 4 else SOCKET1)
        assert topo.gpu_nic[(w.gpu, w.nic)] == "PIX" and w.nic_distance == "PIX"   # the card on its own switch
        assert "UCX_NET_DEVICES" not in w.env                  # UCX pairs GPUs and NICs itself unless asked
        assert p.env["UCX_NET_DEVICES"] == f"{w.nic}:1" and {**w.env, "UCX_NET_DEVICES": f"{w.nic}:1"} == p.env
        assert w.env["UCX_TLS"] == "rc,tcp,cuda_copy,cuda_ipc"
        assert w.env["CUDA_VISIBLE_DEVICES"].split(",")[0] == str(w.gpu)
        assert sorted(map(int, w.env["CUDA_VISIBLE_DEVICES"].split(","))) == list(range(8))
    assert plan.uses("rc") and plan.uses("cuda_ipc") and not make_plan(topo, gpus="0").uses("cuda_ipc")
    assert {w.gpu: w.nic for w in plan.workers} == {0: "mlx5_0", 1: "mlx5_0", 2: "mlx5_1", 3: "mlx5_1",
                                                    4: "mlx5_2", 5: "mlx5_2", 6: "mlx5_3", 7: "mlx5_3"}


def test_dgx1_pairs_without_nvlink_and_largest_subset():
    topo = read_topo_file(str(DGX1))
    missing = {(i, j) for i, j, _ in topo.pairs_without_nvlink()}
    # hybrid cube-mesh: each GPU links to 3 in its quad and 1 across; 28 pairs - 16 linked = 12
    assert len(missing) == 12
    assert missing == {(0, 5), (0, 6), (0, 7), (1, 4), (1, 6), (1, 7), (2, 4), (2, 5), (2, 7), (3, 4), (3, 5), (3, 6)}
    subset = largest_nvlink_subset(topo)
    assert subset == [0, 1, 2, 3]
    assert all(topo.nvlinks(i, j) for i, j in itertools.combinations(subset, 2))
    # no 5-GPU subset is fully connected
    assert not any(all(topo.nvlinks(i, j) for i, j in itertools.combinations(c, 2))
                   for c in itertools.combinations(range(8), 5))
    plan = make_plan(topo, gpus="auto")
    assert plan.selected == [0, 1, 2, 3]
    assert all(set(map(int, w.env["CUDA_VISIBLE_DEVICES"].split(","))) == {0, 1, 2, 3} for w in plan.workers)
    assert not [n for n in plan.notes if "have no NVLink" in n]
    everything = make_plan(topo, gpus="all")
    assert any("12 selected GPU pair(s) have no NVLink" in n for n in everything.notes)


def test_the_dask_blogs_hand_written_table_disagrees_with_its_own_listing():
    """The Dask blog's DGX() (2019): `interface + str(i // 2)` and `list(range(20, 40)) + list(range(60, 79))`."""
    blog_affinity = {i: list(range(0, 20)) + list(range(40, 60)) for i in range(4)}
    blog_affinity.update({i: list(range(20, 40)) + list(range(60, 79)) for i in range(4, 8)})

    def blog_interface(i, interface="ib"):
        return interface + str(i // 2)

    plan = make_plan(read_topo_file(str(DGX1_BLOG)), gpus="all")
    generated = {w.gpu: w for w in plan.workers}
    wrong_card = sorted(i for i in range(8) if generated[i].interface != blog_interface(i))
    assert wrong_card == [2, 3, 4, 5]
    assert {i: generated[i].interface for i in wrong_card} == {2: "ib2", 3: "ib2", 4: "ib1", 5: "ib1"}
    assert {i: blog_interface(i) for i in wrong_card} == {2: "ib1", 3: "ib1", 4: "ib2", 5: "ib2"}
    assert all(generated[i].nic_distance == "PIX" for i in range(8))
    # the blog's cards for GPUs 2-5 hang off the other CPU socket
    topo = plan.topology
    assert [topo.gpu_nic[(i, blog_interface(i))] for i in wrong_card] == ["SYS"] * 4
    missing_cores = {i: sorted(set(generated[i].cpus) - set(blog_affinity[i])) for i in range(8)}
    extra_cores = {i: sorted(set(blog_affinity[i]) - set(generated[i].cpus)) for i in range(8)}
    assert missing_cores == {0: [], 1: [], 2: [], 3: [], 4: [79], 5: [79], 6: [79], 7: [79]}
    assert extra_cores == {i: [] for i in range(8)}


def test_h200_plan():
    plan = make_plan(read_topo_file(str(H200)), gpus="auto")
    assert plan.selected == [0, 1] and plan.largest_nvlink_subset == [0, 1]
    assert plan.topology.pairs_without_nvlink() == []
    for w in plan.workers:
        assert w.cpus == list(range(32)) and w.numa_nodes == [0]
        assert w.env["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc" and "UCX_NET_DEVICES" not in w.env
    assert [w.cuda_visible_devices for w in plan.workers] == ["0,1", "1,0"]
    assert plan.uses("cuda_ipc") and not plan.uses("rc")  # the cluster's enable_nvlink / enable_infiniband
    tcp = make_plan(plan.topology, protocol="tcp")
    assert all(not any(k.startswith("UCX_") for k in w.env) for w in tcp.workers) and not tcp.uses("cuda_ipc")


def test_gpu_selection_errors():
    topo = read_topo_file(str(H200))
    for spec in ("0,5", "0,0", "x", ""):
        with pytest.raises(UserError) as e:
            make_plan(topo, gpus=spec)
        assert e.value.exit_code == errors.USAGE
    assert make_plan(topo, gpus="1").selected == [1]


def test_worker_settings_limit_cores_and_check_interfaces():
    plan = make_plan(read_topo_file(str(DGX1_BLOG)), gpus="0,4")
    settings = worker_settings(plan, allowed_cpus={0, 1, 20, 79},
                                        ipv4=lambda ifname: "10.0.0.1" if ifname == "ib0" else None)
    s0, s4 = settings
    assert s0.cores == [0, 1] and s4.cores == [20, 79]
    assert s0.interface == "ib0" and s4.interface is None and "ib1 has no IPv4" in s4.notes[-1]
    # an interface without an address cannot carry UCX's tcp either
    mlx = make_plan(read_topo_file(str(DGX1)), gpus="0", net_devices=True)
    mlx.workers[0].interface = "ib0"
    mlx.workers[0].env["UCX_NET_DEVICES"] = "mlx5_0:1,ib0"
    (s,) = worker_settings(mlx, allowed_cpus={0}, ipv4=lambda _: None)
    assert s.env["UCX_NET_DEVICES"] == "mlx5_0:1" and s.interface is None
    h200 = read_topo_file(str(H200))
    h200.nics = [NicInfo(name="eth0", kind="eth", netdev="eth0")]
    h200.gpu_nic = {(0, "eth0"): "PHB", (1, "eth0"): "PHB"}
    eth = make_plan(h200, net_devices=True)
    assert [w.env["UCX_NET_DEVICES"] for w in eth.workers] == ["eth0", "eth0"]
    assert all("UCX_NET_DEVICES" not in s.env
               for s in worker_settings(eth, allowed_cpus={0}, ipv4=lambda _: None))
    assert all(s.env["UCX_NET_DEVICES"] == "eth0" and s.interface == "eth0"
               for s in worker_settings(eth, allowed_cpus={0}, ipv4=lambda _: "192.0.2.1"))
    none = worker_settings(plan, allowed_cpus={100}, ipv4=lambda _: None)
    assert all(s.cores is None for s in none)
    unpinned = worker_settings(plan, allowed_cpus={0}, ipv4=lambda _: None, pin=False)
    assert all(s.cores is None for s in unpinned)


# --- sysfs -------------------------------------------------------------------------------------------------------------

def test_build_vm_record_nics(tmp_path):
    root = materialize_sysfs(BUILD_VM_SYSFS.read_text(), tmp_path)
    nics, locs = discover_nics(root)
    # eth0 is a virtio device under PCI function 00:03.0; lo/ifb0/ifb1/docker0 are virtual
    assert [(n.name, n.kind, n.netdev, n.pci_bus_id) for n in nics] == [("eth0", "eth", "eth0", "0000:00:03.0")]
    assert locs["eth0"] == PciLocation(root="pci0000:00", chain=("0000:00:03.0",))
    assert numa_cpus(root) == {0: [0, 1]}


@pytest.mark.parametrize("record", sorted(FIXTURES.glob("*/sysfs-record.txt")), ids=lambda p: p.parent.name)
def test_every_sysfs_record_reads_back(record, tmp_path):
    text = record.read_text()
    root = materialize_sysfs(text, tmp_path)
    nics, _ = discover_nics(root)
    links = dict(re.findall(r"^L\tsys/class/net/(\S+)\t(\S+)$", text, re.M))
    virtual = {name for name, target in links.items() if "/virtual/" in target}
    assert {n.netdev for n in nics if n.kind == "eth"} == set(links) - virtual
    # and the record is exactly what record_sysfs writes for the tree it describes
    assert record_sysfs(root) == text


def test_pci_levels_from_a_dgx1_shaped_tree(tmp_path):
    """Distances computed from a PCI tree shaped like NCCL's dump of a DGX-1 V100 (NVIDIA/nccl#671: one PLX switch
    per GPU pair + IB card, two switches per socket) reproduce the GPU x NIC cells nvidia-smi printed for DGX-1."""
    layout = {  # host bridge -> root port -> switch upstream -> downstream port -> device  (BDFs illustrative)
        "pci0000:00": {"0000:00:02.0": ("0000:03:00.0", {"GPU0": "0000:06:00.0", "GPU1": "0000:07:00.0",
                                                         "mlx5_0": "0000:05:00.0"}),
                       "0000:00:03.0": ("0000:08:00.0", {"GPU2": "0000:0a:00.0", "GPU3": "0000:0b:00.0",
                                                         "mlx5_1": "0000:0c:00.0"})},
        "pci0000:80": {"0000:80:02.0": ("0000:83:00.0", {"GPU4": "0000:85:00.0", "GPU5": "0000:86:00.0",
                                                         "mlx5_2": "0000:84:00.0"}),
                       "0000:80:03.0": ("0000:88:00.0", {"GPU6": "0000:89:00.0", "GPU7": "0000:8a:00.0",
                                                         "mlx5_3": "0000:8b:00.0"})},
    }
    locs = {}
    for host, ports in layout.items():
        for rp, (up, devs) in ports.items():
            for k, (name, bdf) in enumerate(sorted(devs.items())):
                down = f"{up[:-7]}{int(up[5:7], 16) + 1:02x}:{k:02x}.0"
                path = tmp_path / "sys" / "devices" / host / rp / up / down / bdf
                path.mkdir(parents=True)
                (path / "numa_node").write_text("0\n" if host.endswith("00") else "1\n")
                link = tmp_path / "sys" / "bus" / "pci" / "devices" / bdf
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(os.path.relpath(path, link.parent))
                locs[name] = pci_location(tmp_path, link)
    listing = read_topo_file(str(DGX1))
    for g in range(8):
        for nic in ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"):
            numa = {n: int((tmp_path / "sys/bus/pci/devices" / locs[n].bdf / "numa_node").read_text())
                    for n in (f"GPU{g}", nic)}
            got = pci_level(locs[f"GPU{g}"], locs[nic], numa[f"GPU{g}"], numa[nic], single_numa=False)
            assert got == listing.gpu_nic[(g, nic)], (g, nic)


def test_pci_level_rules():
    P = PciLocation
    sw_a, sw_b = ("r0", "u0", "d0"), ("r0", "u0", "d1")
    assert pci_level(P("pci0", sw_a + ("g",)), P("pci0", sw_b + ("n",)), 0, 0, False) == "PIX"
    deep = ("r0", "u0", "d0", "u1", "d2")
    assert pci_level(P("pci0", deep + ("g",)), P("pci0", sw_b + ("n",)), 0, 0, False) == "PXB"
    assert pci_level(P("pci0", ("r0", "g")), P("pci0", ("r1", "n")), 0, 0, False) == "PHB"
    assert pci_level(P("pci0", ("g",)), P("pci1", ("n",)), 0, 0, False) == "NODE"
    assert pci_level(P("pci0", ("g",)), P("pci1", ("n",)), 0, 1, False) == "SYS"
    assert pci_level(P("pci0", ("g",)), P("pci1", ("n",)), None, None, True) == "NODE"
    assert pci_level(P("pci0", ("g",)), None, 0, 0, True) is None


def test_h200_sysfs_record_with_recorded_gpus(tmp_path):
    """GPUs from the recorded query-gpu/nvlink output + the H200 host's sysfs record -> the machine plan."""
    record = FIXTURES / "h200x2" / "sysfs-record.txt"
    if not record.exists():
        pytest.skip("tests/fixtures/h200x2/sysfs-record.txt not recorded yet "
                    "(`ucx-dask-gpu topology --record-sysfs FILE` on the GPU host)")
    root = materialize_sysfs(record.read_text(), tmp_path)
    lines = (FIXTURES / "h200x2" / "nvidia-smi-query-gpu.csv").read_text().splitlines()[1:]
    links = (FIXTURES / "h200x2" / "nvidia-smi-nvlink-s.txt").read_text()
    per_gpu = [len(re.findall(r"Link \d+:", block)) for block in re.split(r"^GPU \d+:.*$", links, flags=re.M)[1:]]
    gpus = []
    for line in lines:
        idx, uuid, bus, name, _ = [c.strip() for c in line.split(",")]
        gpus.append(nvml.Gpu(index=int(idx), uuid=uuid, pci_bus_id=nvml.normalise_bus_id(bus), name=name))
    for g, other in ((gpus[0], gpus[1]), (gpus[1], gpus[0])):
        g.nvlink_peers = {other.pci_bus_id: per_gpu[g.index]}
    topo = assemble(gpus, root)
    assert topo.gpu_links[(0, 1)] == "NV18"
    assert all(g.cpus_source == "sysfs" and g.cpus for g in topo.gpus)   # NVML gave no affinity on that VM
    plan = make_plan(topo, net_devices=True)
    assert all(w.nic is None or w.env.get("UCX_NET_DEVICES") for w in plan.workers)


def test_unreadable_sysfs_is_one_clear_error(tmp_path):
    with pytest.raises(UserError) as e:
        assemble([nvml.Gpu(index=0, uuid="GPU-x", pci_bus_id="00000000:00:06.0", name="x")], tmp_path)
    assert e.value.exit_code == errors.SYSFS_UNREADABLE and str(tmp_path) in str(e.value)
    (tmp_path / "sys" / "bus" / "pci" / "devices").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        assemble([nvml.Gpu(index=0, uuid="GPU-x", pci_bus_id="00000000:00:06.0", name="x")], tmp_path)
    assert e.value.exit_code == errors.SYSFS_UNREADABLE and "0000:00:06.0" in str(e.value)
    with pytest.raises(UserError) as e:
        assemble([], tmp_path)
    assert e.value.exit_code == errors.NO_GPU
    with pytest.raises(UserError) as e:
        materialize_sysfs("not a record\n", tmp_path / "x")
    assert e.value.exit_code == errors.BAD_TOPOLOGY


# --- CLI -----------------------------------------------------------------------------------------------------------------

def test_cli_topology_text_and_json(capsys):
    assert main(["topology", "--from-topo", str(DGX1), "--gpus", "auto"]) == 0
    out = capsys.readouterr().out
    assert "GPU pairs without NVLink (12)" in out and "largest fully NVLink-connected subset: GPUs 0,1,2,3" in out
    assert re.search(r"^\s+2\s+2\s+2,3,0,1\s+0-19,40-59\s.*mlx5_1\s+PIX\s", out, re.M)
    assert "UCX_NET_DEVICES" not in out and "mlx5_1:1" not in out
    assert main(["topology", "--from-topo", str(DGX1), "--gpus", "auto", "--net-devices"]) == 0
    pinned = capsys.readouterr().out
    assert re.search(r"^\s+2\s+2\s+2,3,0,1\s+0-19,40-59\s.*mlx5_1\s+PIX.*mlx5_1:1\s", pinned, re.M)
    assert main(["topology", "--from-topo", str(DGX1), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["largest_nvlink_subset"] == [0, 1, 2, 3] and len(data["pairs_without_nvlink"]) == 12
    assert data["workers"][7]["cpus"] == "20-39,60-79" and data["workers"][7]["nic"] == "mlx5_3"
    assert data["topology"]["gpu_matrix"]["GPU0"]["GPU3"] == "NV2"


def test_cli_cluster_dry_run(capsys):
    assert main(["cluster", "--dry-run", "--from-topo", str(H200), "--protocol", "ucx"]) == 0
    out = capsys.readouterr().out
    assert "UCX_TLS=tcp,cuda_copy,cuda_ipc" in out and "CUDA_VISIBLE_DEVICES=1,0" in out


@pytest.mark.parametrize("argv, code, needle", [
    (["topology", "--from-topo", "/nonexistent/topo.txt"], errors.BAD_TOPOLOGY, "cannot read"),
    (["topology", "--from-topo", str(H200), "--gpus", "3"], errors.USAGE, "GPUs [0, 1]"),
    (["cluster", "--from-topo", str(H200)], errors.USAGE, "--dry-run"),
])
def test_cli_bad_input(argv, code, needle, capsys):
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1


def test_cli_malformed_topo_file(tmp_path, capsys):
    bad = tmp_path / "topo.txt"
    bad.write_text(DGX1.read_text().replace("NV2", "NVx", 1))
    assert main(["topology", "--from-topo", str(bad)]) == errors.BAD_TOPOLOGY
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown connection 'NVx'" in err[0]


def test_cli_record_sysfs_needs_the_machine(tmp_path, capsys):
    out = tmp_path / "rec.txt"
    assert main(["topology", "--from-topo", str(H200), "--record-sysfs", str(out)]) == errors.USAGE
    assert not out.exists()


def test_exit_codes_are_distinct():
    codes = {k: v for k, v in vars(errors).items() if k.isupper() and isinstance(v, int)}
    dupes = {v: sorted(k for k in codes if codes[k] == v) for v in codes.values()
             if list(codes.values()).count(v) > 1}
    assert not dupes, dupes


@pytest.mark.parametrize("stdin, why", [
    (None, "--from-topo -: stdin is closed"),
    (b"\0" * ((1 << 20) + 1), "stdin: more than 1048576 bytes"),
])
def test_from_topo_stdin_closed_or_oversized_is_one_line(stdin, why):
    cmd = [sys.executable, "-m", "ucx_dask_gpu", "topology", "--from-topo", "-"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    if stdin is None:  # fd 0 closed, as `<&-` leaves it: Python's sys.stdin is None
        proc = subprocess.run(["sh", "-c", 'exec "$@" <&-', "sh", *cmd], capture_output=True, env=env)
    else:
        proc = subprocess.run(cmd, input=stdin, capture_output=True, env=env)
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == errors.BAD_TOPOLOGY and len(lines) == 1, lines
    assert lines[0].startswith(f"ucx-dask-gpu topology: error: {why}")
