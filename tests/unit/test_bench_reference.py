"""Reading dask-cuda's local_cupy output into numbers (bench --reference)."""
from pathlib import Path

import pytest

from ucx_dask_gpu.bench import reference as ref
from ucx_dask_gpu.bench.stats import GB

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "bench"
GIB = 2 ** 30


def read(name: str) -> str:
    return (FIXTURES / name).read_text()


# Recorded: real local_cupy runs on a CPU host (-t cpu --scheduler-address, 2 LocalCluster workers).
RECORDED = {
    "local_cupy_cpu_tcp_transpose.txt": ("transpose_sum", "tcp", 3, [1000, 1000]),
    "local_cupy_cpu_ucx_transpose.txt": ("transpose_sum", "ucx", 3, [1000, 1000]),
    "local_cupy_cpu_tcp_svd.txt": ("svd", "tcp", 2, [2000, 100]),
    "local_cupy_cpu_tcp_transpose_markdown.txt": ("transpose_sum", "tcp", 2, [500, 500]),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_cpu_output(name):
    operation, protocol, runs, chunk = RECORDED[name]
    out = ref.parse_local_cupy(read(name))
    assert out["operation"] == operation
    assert out["protocol"] == protocol
    assert out["array_type"] == "numpy"
    assert out["compute_chunk_size"] == chunk
    assert out["workers"] == 2
    assert len(out["wall_s"]) == runs and all(0 < w < 60 for w in out["wall_s"])
    assert len(out["throughput_bytes_per_s"]) == runs
    assert {(p["src"], p["dst"]) for p in out["pairs"]} == {(0, 1), (1, 0)}
    for p in out["pairs"]:
        assert 0 < p["q25_gbps"] <= p["q50_gbps"] <= p["q75_gbps"]
        assert p["bytes"] > 2 ** 20
    q50 = sorted(p["q50_gbps"] for p in out["pairs"])
    assert out["p2p_gbps_median"] == pytest.approx(sum(q50) / 2, abs=1e-4)
    assert sorted(out["worker_addresses"]) == [0, 1]
    assert all(a.startswith(f"{protocol}://") for a in out["worker_addresses"].values())


def test_recorded_values_exactly():
    out = ref.parse_local_cupy(read("local_cupy_cpu_tcp_svd.txt"))
    assert out["wall_s"] == [pytest.approx(2.07), pytest.approx(2.13)]
    assert out["second_size"] == 100 and out["size"] == 20000
    pair = {(p["src"], p["dst"]): p for p in out["pairs"]}
    assert pair[(0, 1)]["q50_gbps"] == pytest.approx(68.10 * 2 ** 20 / GB, abs=1e-4)
    assert pair[(1, 0)]["bytes"] == int(9.23 * 2 ** 20)
    assert out["bandwidth_hmean_gbps"] == pytest.approx(37.13 * 2 ** 20 / GB, abs=1e-4)
    assert out["wall_mean_s"] == pytest.approx(2.10)


def test_constructed_gpu_output():
    """Printed by dask-cuda's own pretty_print_results for DESIGN.md's 2xH200 numbers (see the fixture's script)."""
    ucx = ref.parse_local_cupy(read("local_cupy_gpu_ucx_transpose_constructed.txt"))
    assert ucx["array_type"] == "cupy" and ucx["devices"] == "0,1" and ucx["compute_chunk_size"] == [4096, 4096]
    assert ucx["wall_s"] == [pytest.approx(0.2781), pytest.approx(0.2770), pytest.approx(0.2764)]
    assert ucx["ucx_transport_selection"] == "automatic"
    # 18.7 and 19.1 GiB/s per-pair medians -> 18.9 GiB/s = 20.29 GB/s
    assert ucx["p2p_gbps_median"] == pytest.approx(18.9 * GIB / GB, rel=1e-3)
    tcp = ref.parse_local_cupy(read("local_cupy_gpu_tcp_transpose_constructed.txt"))
    assert tcp["wall_s"] == [pytest.approx(3.91), pytest.approx(3.83), pytest.approx(3.80)]
    assert tcp["p2p_gbps_median"] == pytest.approx(0.62 * GIB / GB, rel=1e-3)


@pytest.mark.parametrize("text, seconds", [
    ("277.01 ms", 0.27701), ("3.83 s", 3.83), ("50.00 us", 5e-5), ("11m 40s", 700), ("3hr 25m", 12300),
    ("14d 6hr", 14 * 86400 + 6 * 3600),
])
def test_durations(text, seconds):
    assert ref.parse_time_text(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "fast", "12 parsecs", "ms"])
def test_bad_durations(text):
    with pytest.raises(ref.ReferenceOutputError):
        ref.parse_time_text(text)


def test_rates():
    assert ref.parse_rate("18.90 GiB/s") == pytest.approx(18.90 * GIB)
    assert ref.parse_rate("232.70 kiB/s") == pytest.approx(232.70 * 1024)
    with pytest.raises(ref.ReferenceOutputError):
        ref.parse_rate("18.90 GiB")


def test_not_local_cupy_output():
    with pytest.raises(ref.ReferenceOutputError, match="Roundtrip"):
        ref.parse_local_cupy("Traceback (most recent call last):\n  ...\nRuntimeError: no GPU\n")


def test_truncated_output():
    text = read("local_cupy_cpu_tcp_transpose.txt")
    cut = text[:text.index("Wall clock                | Throughput")]
    with pytest.raises(ref.ReferenceOutputError, match="no wall-clock rows"):
        ref.parse_local_cupy(cut)


def test_garbled_pair_line():
    text = read("local_cupy_cpu_tcp_transpose.txt").replace("(0,1)                     |",
                                                            "(0,1)                     | ???")
    with pytest.raises(ref.ReferenceOutputError):
        ref.parse_local_cupy(text)
    text = read("local_cupy_cpu_tcp_transpose.txt").replace("(0,1)                     |",
                                                            "(0,1)                     | 3 apples")
    with pytest.raises(ref.ReferenceOutputError, match="worker-pair"):
        ref.parse_local_cupy(text)


def test_command_gpu_and_cpu():
    gpu = ref.command("python3", "transpose", "ucx", 40000, 4096, 5, 1, gpus=[0, 1])
    assert gpu[1:] == ["-m", "dask_cuda.benchmarks.local_cupy", "-o", "transpose_sum", "-p", "ucx", "-s", "40000",
                       "-c", "4096", "--runs", "5", "--warmup-runs", "1", "-d", "0,1"]
    cpu = ref.command("python3", "svd", "tcp", 20000, 2000, 2, 1, second_size=100,
                      scheduler_address="tcp://127.0.0.1:1234")
    assert cpu[cpu.index("-o") + 1] == "svd" and cpu[cpu.index("-2") + 1] == "100"
    assert cpu[-4:] == ["-t", "cpu", "--scheduler-address", "tcp://127.0.0.1:1234"] and "-d" not in cpu


def test_teardown_exceptions():
    stderr = [
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in close',
        "ucxx._lib.libucxx.UCXXEndpointTimeoutError: Endpoint timeout",
        "2026-01-01 - distributed.worker - INFO - done | not an error",
    ]
    assert ref.exceptions_in(stderr) == ["UCXXEndpointTimeoutError"]


def test_printed_everything():
    from ucx_dask_gpu.bench.driver import printed_everything

    lines = read("local_cupy_cpu_ucx_transpose.txt").splitlines()
    assert printed_everything(lines)
    assert not printed_everything(lines[:-1])  # the closing rule is not there yet
    assert not printed_everything(lines[:10])


def test_reference_stuck_in_teardown_is_stopped_after_the_grace(tmp_path):
    """A local_cupy that printed its results and then hangs (UCX endpoint timeout) is stopped after the grace period;
    its numbers still count."""
    import sys
    import time

    from ucx_dask_gpu.bench.child import Child, Progress
    from ucx_dask_gpu.bench.driver import wait_reference

    fake = tmp_path / "fake_local_cupy.py"
    fake.write_text("import sys, time\nsys.stdout.write(open(sys.argv[1]).read())\nsys.stdout.flush()\n"
                    "time.sleep(120)\n")
    child = Child([sys.executable, str(fake), str(FIXTURES / "local_cupy_cpu_tcp_transpose.txt")], {}, "ref",
                  Progress(quiet=True))
    t = time.monotonic()
    rc, timed_out, teardown = wait_reference(child, timeout=60, grace=1.0, progress=Progress(quiet=True),
                                             label="ref")
    assert time.monotonic() - t < 30 and not timed_out and rc != 0
    assert teardown.startswith("stopped after 1 s")
    assert ref.parse_local_cupy("\n".join(child.stdout))["wall_s"]

