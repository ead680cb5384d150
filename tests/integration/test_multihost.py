"""The one image across two "hosts": two network + IPC namespaces (pod holder containers) on an internal network;
scheduler + worker in one, worker + client in the other, over ucx and tcp, with the environment gate on.

A pod here is what Kubernetes makes of one: containers sharing a network and an IPC namespace, each with its own PID
namespace. Between the two pods there is only the network, as between two hosts.
"""
from __future__ import annotations

import pytest

from ucx_dask_gpu.errors import ENV_MISMATCH
from ucx_dask_gpu.image.cluster import has_traceback

from pods import Net

pytestmark = [pytest.mark.integration, pytest.mark.docker]


@pytest.fixture(params=["ucx", "tcp"])
def two_hosts(request, image):
    proto = request.param
    net = Net(image["tag"], f"2host-{proto}")
    address = f"{proto}://host-a:8786"
    try:
        host_a, host_b = net.pod("host-a"), net.pod("host-b")
        sched = net.run("scheduler", ["dask", "scheduler", "--protocol", proto, "--port", "8786", "--no-dashboard",
                                      "--interface", "eth0"], pod=host_a)
        net.wait_log(sched, "Scheduler at:")
        workers = []
        for pod, name in ((host_a, "worker-a"), (host_b, "worker-b")):
            workers.append(net.run(name, ["dask", "worker", address, "--name", name, "--interface", "eth0",
                                          "--nthreads", "2", "--memory-limit", "2GiB", "--no-dashboard"], pod=pod))
        net.wait_log(sched, "Register worker", count=2)
        yield proto, net, address, host_b, sched, workers
    finally:
        report = net.stop()
        assert not report["tracebacks"], {n: report["logs"][n][-2000:] for n in report["tracebacks"]}


def test_a_cluster_across_two_hosts(two_hosts, image, st):
    proto, net, address, host_b, sched, workers = two_hosts
    r = net.workload(address, "--size", "4000", "--chunk", "1000", pod=host_b)
    assert r["ok"] and r["protocol"] == proto and r["workers_start"] == 2 and r["versions_identical"]
    if proto == "ucx":
        roles = [r["ucx"]["client"], r["ucx"]["scheduler"], *r["ucx"]["workers"].values()]
        assert len(roles) == 4 and all(x["libucp"].startswith(f"{st.image.ucx_prefix}/lib/libucp.so") for x in roles)
    # The gate is on: the scheduler accepts only the image's stack id ...
    assert f"scheduler accepts only stack id {image['stack_id']}" in net.logs(sched)
    # ... and every worker said which transports it uses: left to UCX, other hosts over TCP on its pod's interface.
    for w in workers:
        line = next(ln for ln in net.logs(w).splitlines() if "ucx-dask-gpu transports" in ln)
        assert "transports automatic" in line and "other hosts: tcp (" in line and "IPC private" in line, line


def test_a_client_of_another_environment_is_refused_across_hosts(two_hosts, tmp_path):
    """The client on host B has one contract distribution at another version (first on its sys.path, as a patched
    install would be): the scheduler on host A refuses it, in one line naming the difference."""
    proto, net, address, host_b, sched, workers = two_hosts
    site = tmp_path / "site"
    info = site / "cloudpickle-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: cloudpickle\nVersion: 0.0.1\n")
    for d in (tmp_path, site, info):
        d.chmod(0o755)
    proc = net.client(["ucx-dask-gpu", "workload", "transpose", "--scheduler", address], pod=host_b,
                      env={"PYTHONPATH": "/site"}, volumes=(f"{site}:/site:ro",))
    assert proc.returncode == ENV_MISMATCH, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused client" in lines[0] and "cloudpickle: " in lines[0] and \
        "vs 0.0.1" in lines[0], proc.stderr[-2000:]
    assert not has_traceback(proc.stderr)
    assert len([ln for ln in net.logs(sched).splitlines() if "refused client" in ln]) == 1
