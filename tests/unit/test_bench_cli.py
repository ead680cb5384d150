"""`ucx-dask-gpu bench` and `python -m ucx_dask_gpu.bench.<study>`: bad input ends with one line on stderr and a
distinct exit code before anything starts; --plan shows which variants share a cluster."""
import subprocess
import sys

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
    (["transpose", "--cpu", "--variant", "carrier-pigeon@x:none"], USAGE, "protocols"),
    (["transpose", "--cpu", "--chunks", "huge"], USAGE, "--chunks"),
    (["transpose", "--cpu", "--variant", "x:none:no-equals-sign"], USAGE, "KEY=VALUE"),
    (["transpose", "--cpu", "--variant", "x:none:distributed.scheduler.bandwidht=1GB"], BENCH_CONFIG, "bandwidht"),
    (["transpose", "--cpu", "--variant", "x:/nonexistent/tuned.yaml"], BENCH_CONFIG, "cannot read"),
    (["transpose", "--cpu", "--runs", "5"], USAGE, "--allow-few"),
    (["transpose", "--cpu", "--runs", "0", "--allow-few"], USAGE, "--runs"),
    (["transpose", "--cpu", "--resamples", "100"], USAGE, "--resamples"),
    (["transpose", "--cpu", "--baseline", "nope"], USAGE, "--baseline"),
    (["transpose", "--cpu", "--parity", "nope"], USAGE, "--parity"),
    (["transpose", "--cpu", "--gpus", "0,1"], USAGE, "exclude"),
    (["transpose", "--cpu", "--name", "../escape"], USAGE, "--name"),
    (["transpose", "--cpu", "--budget", "-1"], USAGE, "--budget"),
    (["svd", "--cpu", "--size", "10", "--second-size", "100"], USAGE, "--second-size"),
    (["transfer", "--cpu", "--sizes", "8,lots"], USAGE, "--sizes"),
    (["transfer", "--cpu", "--workers", "3"], USAGE, "2 workers"),
    (["transfer", "--cpu", "--peer"], USAGE, "local_cupy"),
    (["transpose", "--gpus", "zero"], USAGE, "--gpus"),
])
def test_bad_arguments(capsys, tmp_path, argv, code, words):
    rc, out, err = run(capsys, *argv, "--out", str(tmp_path / "out"))
    assert rc == code
    lines = err.strip().splitlines()
    assert len(lines) == 1 and words in lines[-1], err
    assert not (tmp_path / "out").exists()  # nothing written


def test_out_must_be_a_directory(capsys, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run(capsys, "transpose", "--cpu", "--out", str(f))
    assert rc == OUTPUT_REFUSED and "not a directory" in err and f.read_text() == "x"


def test_gpu_mode_without_gpu(capsys, tmp_path):
    from ucx_dask_gpu import nvml
    from ucx_dask_gpu.errors import UserError

    try:
        nvml.discover()
    except UserError:
        pass
    else:
        pytest.skip("this host has GPUs: a GPU-mode run would start the benchmark")
    rc, out, err = run(capsys, "transfer", "--shared-gpu", "0", "--out", str(tmp_path / "out"))
    assert rc in (NVML_UNAVAILABLE, NO_GPU)
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_plan_groups_variants_by_the_cluster_they_need(capsys):
    rc, out, err = run(capsys, "transpose", "--cpu", "--plan", "--variant", "ucx@defaults:none",
                       "--variant", "ucx,tcp@shipped:shipped:split_every=100",
                       "--variant", "ucx@split:shipped:split_every=4",
                       "--variant", "ucx@pool:shipped:ucx-dask-gpu.cluster.rmm-pool-size=8GiB")
    assert rc == 0, err
    clusters = [ln for ln in out.splitlines() if ln.startswith("cluster")]
    members = [ln.split(":")[0].strip() for ln in out.splitlines() if ln.startswith("  ")]
    assert len(clusters) == 4  # defaults, shipped (+ split_every), tcp, pool
    assert members == ["ucx/defaults", "ucx/shipped", "ucx/split", "tcp/shipped", "ucx/pool"]
    # client-side keys go to dask.config.set in the client, per variant
    assert "client-side {'split_every': 100}" in out
    assert "client-side {'split_every': 4}" in out
    assert "baseline ucx/defaults" in out.splitlines()[0]


@pytest.mark.parametrize("study, shipped_settings", [("transpose", {"split_every": 100}), ("transfer", {})])
def test_the_default_shipped_variant_runs_the_study_as_the_product_does(capsys, study, shipped_settings):
    """The shipped config sets no split_every (dask applies it to every reduction); the transpose's default `shipped`
    variant adds the one `ucx-dask-gpu workload transpose` sums with, so it measures what users run."""
    rc, out, err = run(capsys, study, "--cpu", "--plan")
    assert rc == 0, err
    members = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if ln.startswith("  ")}
    assert sorted(members) == ["tcp/shipped", "ucx/defaults", "ucx/shipped"]
    for name in ("ucx/shipped", "tcp/shipped"):
        assert members[name].endswith(f"shipped {shipped_settings} client-side {shipped_settings}"), members[name]


def test_each_study_runs_alone_with_the_standard_library_for_its_help():
    for study in ("transpose", "svd", "transfer"):
        proc = subprocess.run([sys.executable, "-S", "-m", f"ucx_dask_gpu.bench.{study}", "--help"],
                              capture_output=True, text=True, env={"PYTHONPATH": cli.__file__.rsplit("/", 2)[0]})
        assert proc.returncode == 0, proc.stderr
        assert "--variant" in proc.stdout and "[PROTOCOLS@]LABEL:CONFIG" in proc.stdout
