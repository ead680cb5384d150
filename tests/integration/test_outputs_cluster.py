"""`workload transpose --output` on real clusters: a directory named as the output is refused before the cluster
starts and keeps everything in it; a result file is written beside the user's files; a write that fails after the
computation keeps the answer (stdout) and ends with exit 18 in one line."""
from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from ucx_dask_gpu.errors import OUTPUT_REFUSED, RESULT_KEPT

pytestmark = pytest.mark.integration

SMALL = ("--size", "400", "--chunk", "100")


def users_files(where):
    where.mkdir(parents=True)
    (where / "notes.txt").write_text("mine")
    (where / "older-result.json").write_text('{"mine": true}')
    return sorted(p.name for p in where.iterdir())


def test_a_directory_named_as_output_is_refused_before_the_cluster_and_kept(procs, tmp_path):
    out = tmp_path / "results"
    before = users_files(out)
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--protocol", "tcp", *SMALL,
                          "--output", str(out), timeout=120)
    assert proc.returncode == OUTPUT_REFUSED, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--output {out}: is a directory" in lines[0] and proc.stdout == ""
    assert sorted(p.name for p in out.iterdir()) == before and (out / "notes.txt").read_text() == "mine"


def test_an_output_under_proc_is_refused_before_the_cluster(procs, tmp_path):
    proc = procs.workload(procs.env_for(tmp_path, None), "transpose", "--protocol", "tcp", *SMALL,
                          "--output", "/proc/x/result.json", timeout=120)
    assert proc.returncode == OUTPUT_REFUSED and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "ucx-dask-gpu workload: error: --output /proc/x/result.json: no directory /proc/x (refused before anything "
        "ran; nothing written or removed)"]


def test_the_result_file_is_written_beside_the_users_files(procs, shipped_config, tmp_path):
    out = tmp_path / "results"
    before = users_files(out)
    proc = procs.workload(procs.env_for(tmp_path, shipped_config), "transpose", "--protocol", "tcp", *SMALL,
                          "--output", str(out / "result.json"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "result.json").read_text())["ok"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*before, "result.json"])
    assert (out / "notes.txt").read_text() == "mine" and (out / "older-result.json").read_text() == '{"mine": true}'


def test_a_write_failing_after_the_computation_keeps_the_answer(procs, shipped_config, tmp_path):
    """The client may write no byte to any file (RLIMIT_FSIZE 0; the scheduler and worker run without the limit):
    the output's check passes (an empty file can be made), the computation runs on the cluster, the write fails
    with EFBIG, and neither beside it nor in the temporary directory can a copy be made: the JSON comes on stdout
    after the summary line, and the one line says so, exit 18."""
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env)
    worker = procs.start_worker(tmp_path, env, address, "w1")
    try:
        def no_file_bytes():
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))

        out = tmp_path / "results"
        before = users_files(out)
        proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "workload", "transpose", "--scheduler", address,
                               *SMALL, "--output", str(out / "result.json")], env=env, capture_output=True, text=True,
                              timeout=300, preexec_fn=no_file_bytes)
    finally:
        worker.stop()
        sched.stop()
    assert proc.returncode == RESULT_KEPT, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]  # after the progress lines while the worker joins
    assert "Traceback" not in proc.stderr and "error" not in proc.stderr.replace(last, "")
    assert last.startswith(f"ucx-dask-gpu workload: error: --output {out / 'result.json'}: cannot write (File too "
                           "large)") and last.endswith("the result is kept on stdout")
    summary, _, kept = proc.stdout.partition("\n")
    assert "transpose 400x400 chunk 100 numpy" in summary and " ok," in summary
    assert json.loads(kept)["ok"] is True
    assert sorted(p.name for p in out.iterdir()) == before
