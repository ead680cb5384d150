"""Link attribution when NVML cannot name an NVLink peer (seen on the 2xH200 Firecracker VM: every link's remote
PCI info read ffffffff:ff:ff.0, so discovery found "no NVLink" although nvidia-smi topo -m shows NV18)."""
from ucx_dask_gpu.nvml import Gpu, attribute_unnamed_links, nvlink_count

UNKNOWN = "ffffffff:ff:ff.0"  # as recorded on the H200 host


def _gpu(i, bus, links):
    g = Gpu(index=i, uuid=f"GPU-{i}", pci_bus_id=bus, name="NVIDIA H200")
    for ln, peer in links.items():
        g.links[ln] = peer
        g.nvlink_peers[peer] = g.nvlink_peers.get(peer, 0) + 1
    return g


def test_vm_links_go_to_the_only_p2p_peer():
    a = _gpu(0, "00000000:00:06.0", {ln: UNKNOWN for ln in range(18)})
    b = _gpu(1, "00000000:00:07.0", {ln: UNKNOWN for ln in range(18)})
    attribute_unnamed_links([a, b], lambda x, y: True)
    assert nvlink_count(a, b) == 18 and nvlink_count(b, a) == 18
    assert UNKNOWN not in a.nvlink_peers
    assert a.link_attribution == b.link_attribution == "p2p-status"


def test_ambiguous_peers_stay_unattributed():
    gpus = [_gpu(i, f"00000000:00:0{6 + i}.0", {0: UNKNOWN, 1: UNKNOWN}) for i in range(3)]
    attribute_unnamed_links(gpus, lambda x, y: True)  # two candidates each: cannot tell which link goes where
    assert all(g.nvlink_peers == {UNKNOWN: 2} and g.link_attribution == "remote-pci" for g in gpus)


def test_no_p2p_means_no_nvlink_claimed():
    a = _gpu(0, "00000000:00:06.0", {0: UNKNOWN})
    b = _gpu(1, "00000000:00:07.0", {})
    attribute_unnamed_links([a, b], lambda x, y: False)
    assert nvlink_count(a, b) == 0


def test_named_peers_untouched():
    a = _gpu(0, "00000000:18:00.0", {0: "00000000:3b:00.0"})
    b = _gpu(1, "00000000:3b:00.0", {0: "00000000:18:00.0"})
    attribute_unnamed_links([a, b], lambda x, y: (_ for _ in ()).throw(AssertionError("not asked")))
    assert nvlink_count(a, b) == 1 and a.link_attribution == "remote-pci"
