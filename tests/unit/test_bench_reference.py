"""Reading dask-cuda's local_cupy output into numbers (bench --reference)."""
import json
from pathlib import Path

import pytest

from ucx_dask_gpu.cliutil import Progress
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


# Recorded: local_cupy's stdout on the 2xH200 host (nvidia-h200-x2, 2026-11-30), as `bench --reference` kept it
# verbatim in benchmarks/results/h200x2-2026-11-30/ (extracted by tests/fixtures/bench/extract_local_cupy_gpu.py).
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200x2-2026-11-30"
RECORDED_GPU = {
    "local_cupy_gpu_ucx_transpose.txt": ("transpose-128MiB.json", "ucx"),
    "local_cupy_gpu_tcp_transpose.txt": ("transpose-128MiB.json", "tcp"),
    "local_cupy_gpu_ucx_transpose_c11585.txt": ("transpose-auto.json", "ucx"),
    "local_cupy_gpu_ucx_svd.txt": ("svd.json", "ucx"),
    "local_cupy_gpu_tcp_svd.txt": ("svd.json", "tcp"),
}


def host_reference(results: str, protocol: str) -> dict:
    (r,) = [r for r in json.loads((RESULTS / results).read_text())["references"] if r["protocol"] == protocol]
    return r


@pytest.mark.parametrize("name", sorted(RECORDED_GPU))
def test_recorded_gpu_output_parses_as_on_the_host(name):
    """The fixture is the JSON's stdout, and parsing it here gives every number the host's bench wrote beside it."""
    host = host_reference(*RECORDED_GPU[name])
    text = read(name)
    assert text == host["stdout"]
    out = json.loads(json.dumps(ref.parse_local_cupy(text)))  # as the JSON stores it (tuples -> lists, int keys)
    # sizes are read with dask's parse_bytes now: whole bytes where the host's reader kept fractions of one
    rounded = ("data_processed_bytes", "throughput_bytes_per_s")
    assert {k: v for k, v in out.items() if k not in rounded} == {k: host[k] for k in out if k not in rounded}
    assert out["data_processed_bytes"] == pytest.approx(host["data_processed_bytes"], abs=1)
    assert out["throughput_bytes_per_s"] == pytest.approx(host["throughput_bytes_per_s"], abs=1)
    assert out["array_type"] == "cupy" and out["devices"] == "0,1" and out["workers"] == 2
    assert out["protocol"] == RECORDED_GPU[name][1]
    assert {(p["src"], p["dst"]) for p in out["pairs"]} == {(0, 1), (1, 0)}
    q50 = sorted(p["q50_gbps"] for p in out["pairs"])
    assert out["p2p_gbps_median"] == pytest.approx(sum(q50) / 2, abs=1e-4)


def test_recorded_gpu_transpose_values():
    """dask-cuda 26.10 local_cupy transpose_sum 40000^2, chunk 4096, 2xH200: the printed rows, read exactly."""
    ucx = ref.parse_local_cupy(read("local_cupy_gpu_ucx_transpose.txt"))
    assert read("local_cupy_gpu_ucx_transpose.txt").startswith("[")  # UCX's own WARN lines come first: skipped
    assert ucx["compute_chunk_size"] == [4096, 4096] and ucx["ucx_transport_selection"] == "automatic"
    assert ucx["wall_s"] == [pytest.approx(x) for x in (0.34133, 0.58789, 0.35559, 0.33704, 0.37410)]
    pair = {(p["src"], p["dst"]): p for p in ucx["pairs"]}
    assert pair[(0, 1)]["q50_gbps"] == pytest.approx(17.45 * GIB / GB, abs=1e-4)
    assert pair[(1, 0)]["bytes"] == int(13.83 * GIB)
    assert ucx["p2p_gbps_median"] == pytest.approx((17.45 + 16.50) / 2 * GIB / GB, abs=1e-4)  # 18.23 GB/s
    tcp = ref.parse_local_cupy(read("local_cupy_gpu_tcp_transpose.txt"))
    assert tcp["wall_s"] == [pytest.approx(x) for x in (4.09, 3.90, 3.94, 4.26, 3.37)]
    assert "ucx_transport_selection" not in tcp
    auto = ref.parse_local_cupy(read("local_cupy_gpu_ucx_transpose_c11585.txt"))
    assert auto["compute_chunk_size"] == [11585, 11585] and auto["p2p_gbps_median"] > 5 * ucx["p2p_gbps_median"]


def test_recorded_gpu_svd_values():
    svd = ref.parse_local_cupy(read("local_cupy_gpu_tcp_svd.txt"))
    assert svd["operation"] == "svd" and svd["size"] == 200000 and svd["second_size"] == 1000
    assert svd["compute_shape"] == [200000, 1000] and svd["compute_chunk_size"] == [20000, 1000]
    assert svd["wall_s"] == [pytest.approx(x) for x in (0.59317, 0.53229, 0.50483)]
    assert svd["bandwidth_hmean_gbps"] == pytest.approx(437.55 * 2 ** 20 / GB, abs=1e-4)


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
    assert ref.parse_rate("232.70 kiB/s") == pytest.approx(232.70 * 1024, abs=1)
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
    gpu = ref.command("python3", "transpose_sum", "ucx", 40000, 4096, 15, 1, gpus=[0, 1])
    assert gpu[1:] == ["-m", "dask_cuda.benchmarks.local_cupy", "-o", "transpose_sum", "-p", "ucx", "-s", "40000",
                       "-c", "4096", "--runs", "15", "--warmup-runs", "1", "-d", "0,1"]
    cpu = ref.command("python3", "svd", "tcp", 20000, 2000, 15, 1, ["-2", "100"], scheduler="tcp://127.0.0.1:1234",
                      cpu=True)
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
    lines = read("local_cupy_cpu_ucx_transpose.txt").splitlines()
    assert ref.printed_everything(lines)
    assert not ref.printed_everything(lines[:-1])  # the closing rule is not there yet
    assert not ref.printed_everything(lines[:10])


def test_reference_stuck_in_teardown_is_stopped_after_the_grace(tmp_path, monkeypatch):
    """A local_cupy that printed its results and then hangs (UCX endpoint timeout) is stopped after the grace period;
    its numbers still count."""
    import sys
    import time

    monkeypatch.setattr(ref, "GRACE_S", 1.0)
    fake = tmp_path / "fake_local_cupy.py"
    fake.write_text("import sys, time\nsys.stdout.write(open(sys.argv[1]).read())\nsys.stdout.flush()\n"
                    "time.sleep(120)\n")
    t = time.monotonic()
    out = ref.run_local_cupy([sys.executable, str(fake), str(FIXTURES / "local_cupy_cpu_tcp_transpose.txt")], {},
                             60, Progress(quiet=True), "ref")
    assert time.monotonic() - t < 30
    assert out["status"] == "ok" and out["teardown"].startswith("stopped in its teardown") and out["wall_s"]
