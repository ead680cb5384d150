"""`ucx-dask-gpu bench`: bad input ends with one line on stderr and a distinct exit code, before anything starts;
--plan shows what a sweep would run."""
import pytest

from ucx_dask_gpu import cli
from ucx_dask_gpu.errors import BENCH_CONFIG, NO_GPU, NVML_UNAVAILABLE, OUTPUT_REFUSED, USAGE


def run(capsys, *argv):
    try:
        rc = cli.main(["bench", *argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv, code, words", [
    (["transpose", "--cpu", "--protocols", "ucx,carrier-pigeon"], USAGE, "--protocols"),
    (["transpose", "--cpu", "--protocols", "tcp,tcp"], USAGE, "--protocols"),
    (["transpose", "--cpu", "--chunks", "huge"], USAGE, "--chunks"),
    (["transpose", "--cpu", "--chunks", "0"], USAGE, "--chunks"),
    (["transpose", "--cpu", "--knob", "no-equals-sign"], USAGE, "--knob"),
    (["transpose", "--cpu", "--knob", "distributed.scheduler.bandwidht=1GB"], BENCH_CONFIG, "bandwidht"),
    (["transpose", "--cpu", "--knob", "A=1", "--knob", "A=1"], USAGE, "twice"),
    (["transpose", "--cpu", "--config", "/nonexistent/tuned.yaml"], BENCH_CONFIG, "cannot read"),
    (["transpose", "--cpu", "--goal", "speed>=9"], USAGE, "--goal"),
    (["transpose", "--cpu", "--ignore-size", "a lot"], USAGE, "--ignore-size"),
    (["transpose", "--cpu", "--gpus", "0,1"], USAGE, "--gpus"),
    (["transpose", "--cpu", "--name", "../escape"], USAGE, "--name"),
    (["transpose", "--cpu", "--runs", "0"], USAGE, "--runs"),
    (["transpose", "--cpu", "--budget", "-1"], USAGE, "--budget"),
    (["svd", "--cpu", "--size", "10", "--second-size", "100"], USAGE, "--second-size"),
    (["transpose", "--gpus", "zero"], USAGE, "--gpus"),
])
def test_bad_arguments(capsys, tmp_path, argv, code, words):
    rc, out, err = run(capsys, *argv, "--out", str(tmp_path / "out"))
    assert rc == code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], err
    assert not (tmp_path / "out").exists()  # nothing written


def test_out_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run(capsys, "transpose", "--cpu", "--out", str(f))
    assert rc == OUTPUT_REFUSED and "not a directory" in err
    assert f.read_text() == "x"


def test_gpu_mode_without_gpu(capsys, tmp_path):
    from ucx_dask_gpu import nvml
    from ucx_dask_gpu.errors import UserError

    try:
        nvml.discover()
    except UserError:
        pass
    else:
        pytest.skip("this host has GPUs: a GPU-mode run would start the benchmark")
    rc, out, err = run(capsys, "transpose", "--protocols", "tcp", "--out", str(tmp_path / "out"))
    assert rc in (NVML_UNAVAILABLE, NO_GPU)
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_plan_lists_base_reference_and_knob_variants(capsys):
    rc, out, err = run(capsys, "transpose", "--cpu", "--plan", "--reference", "--protocols", "ucx,tcp",
                       "--knob", "UCXPY_PROGRESS_MODE=thread",
                       "--knob", "ucx-dask-gpu.cluster.threads-per-worker=2;distributed.scheduler.bandwidth=1GB",
                       "--knob", "ucx-dask-gpu.cluster.rmm-pool-size=0.5")
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert [ln.split(":")[0] for ln in lines] == [
        "[0] ucx tuned-gpu", "[1] ucx reference", "[2] tcp tuned-gpu", "[3] tcp reference",
        "[4] ucx tuned-gpu + UCXPY_PROGRESS_MODE=thread",
        "[5] ucx tuned-gpu + ucx-dask-gpu.cluster.threads-per-worker=2;distributed.scheduler.bandwidth=1GB",
        "[6] ucx tuned-gpu + ucx-dask-gpu.cluster.rmm-pool-size=0.5"]
    assert "environment {'UCXPY_PROGRESS_MODE': 'blocking'}" in lines[0]  # the shipped file's (measured) choice
    assert "environment {'UCXPY_PROGRESS_MODE': 'thread'}" in lines[4]
    assert "'threads-per-worker': 2" in lines[5]
    # the shipped file sets no GPU-only key (no RMM pool since the 2xH200 measurement); a knob that does is reported
    assert "bandwidth: 1GB" in out and "ignored in CPU mode" not in lines[0]
    assert "ignored in CPU mode" in lines[6] and "rmm-pool-size" in lines[6]


def test_plan_resolves_auto_chunks_from_the_config(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("array:\n  chunk-size: 4GiB\n")
    rc, out, _ = run(capsys, "transpose", "--plan", "--size", "40000", "--chunks", "auto", "--config", str(cfg))
    assert rc == 0 and "[23170, 23170] ([2, 2] blocks)" in out.splitlines()[0]
    rc, out, _ = run(capsys, "transpose", "--plan", "--size", "40000", "--chunks", "128 MiB", "--config", str(cfg))
    assert rc == 0 and "[4096, 4096] ([10, 10] blocks)" in out.splitlines()[0]  # explicit chunks never change
