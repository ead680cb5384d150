"""`ucx-dask-gpu bench transpose` and `svd` end to end in CPU mode: real clusters started with the launchers users run
(`dask scheduler`, `dask worker`; UCX over TCP through distributed-ucxx, and TCP), the measuring client alone in its
process, variants interleaved on live clusters (two of them sharing one), dask-cuda's local_cupy as the parity run on
a live cluster; every number in the report comes from those runs. No timing is asserted."""
import json
import re
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

from test_signals import alive
from ucx_dask_gpu.bench import options, transpose as transpose_study
from ucx_dask_gpu.bench.hosts import Host
from ucx_dask_gpu.cliutil import Progress
from ucx_dask_gpu.fsutil import MANIFEST

pytestmark = pytest.mark.integration

SIZE, CHUNK, RUNS = 400, 100, 3
VARIANTS = ["ucx@defaults:none", "ucx@split:none:split_every=2",
            "tcp@threads:none:ucx-dask-gpu.cluster.threads-per-worker=2;distributed.scheduler.bandwidth=1GB"]


def bench(*argv, timeout=400):
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "bench", *argv], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def transpose(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["transpose", "--cpu", "--size", str(SIZE), "--chunks", str(CHUNK), "--runs", str(RUNS), "--allow-few",
            "--warmup", "1", "--parity", "ucx/defaults", "--out", str(out), "--budget", "300", "--run-timeout", "120"]
    for v in VARIANTS:
        argv += ["--variant", v]
    proc = bench(*argv)
    payload = json.loads((out / "transpose.json").read_text()) if (out / "transpose.json").exists() else None
    return proc, payload, out


def test_exit_outputs_and_stdout(transpose):
    proc, p, out = transpose
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {f.name for f in out.iterdir()} == {"transpose.json", "transpose.md", "transpose.png", "command.txt",
                                               MANIFEST}
    assert (out / "transpose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ucx-dask-gpu bench transpose --cpu" in (out / "command.txt").read_text()
    rows = [ln.split()[:2] for ln in proc.stdout.splitlines() if ln.startswith(("ucx/", "tcp/"))]
    assert list(dict.fromkeys(r[0] for r in rows)) == ["ucx/defaults", "ucx/split", "tcp/threads"]
    # each variant: the fresh-input repetition and the steady state on the resident input
    assert all(sorted(r[1] for r in rows if r[0] == v) == ["steady_s", "wall_s"] for v in {r[0] for r in rows})
    assert p["schema_version"] == 2 and p["workload"] == "transpose" and p["chunk"] == [CHUNK, CHUNK]


def test_variants_took_turns_on_live_clusters(transpose):
    proc, p, _ = transpose
    assert [c["variants"] for c in p["clusters"]] == [["ucx/defaults", "ucx/split"], ["tcp/threads"]]
    order = re.findall(r"\[(\S+)\] round (\d+):", proc.stderr)
    rounds = [[n for n, r in order if r == str(i)] for i in range(1, RUNS + 1)]
    assert rounds == [["ucx/defaults", "ucx/split", "tcp/threads"], ["tcp/threads", "ucx/split", "ucx/defaults"],
                      ["ucx/defaults", "ucx/split", "tcp/threads"]]
    for r in p["runs"]:
        assert r["status"] == "ok", r["error"]
        assert len(r["wall_s"]) == RUNS and len(r["warmup_s"]) == 1 and all(w > 0 for w in r["wall_s"])
        assert all(b > 0 for b in r["bytes_moved"]["per_repetition"])
    split = next(r for r in p["runs"] if r["name"] == "ucx/split")
    assert split["client_side"] == {"split_every": 2} and split["cluster"] == "c0"
    for r in p["runs"][1:]:
        ratio = r["ratio_to_baseline"]
        if ratio["verdict"] == "different work":  # the scheduler placed tasks so that other bytes moved: no ratio
            assert ratio["median"] is None and ratio["ci95"] is None
            assert ratio["bytes_moved_median"] != ratio["baseline_bytes_moved_median"]
            continue
        assert ratio["n"] == ratio["n_baseline"] == RUNS and ratio["resamples"] == 2000
        assert ratio["ci95"][0] <= ratio["median"] <= ratio["ci95"][1]


def test_settings_reached_the_workers_and_provenance(transpose):
    _, p, _ = transpose
    ucx, tcp = p["clusters"]
    for facts in ucx["worker_facts"].values():
        assert facts["ucx"]["TLS"] == "tcp" and facts["progress_mode"] == "blocking" and facts["nthreads"] == 1
    for facts in tcp["worker_facts"].values():
        assert facts["nthreads"] == 2 and facts["distributed.scheduler.bandwidth"] == "1GB"
    libucp = p["provenance"]["libucp"]["c0"]
    assert libucp["client"] and set(libucp["workers"].values()) == {libucp["client"]} == {libucp["scheduler"]}
    assert p["provenance"]["git"]["commit"] and p["provenance"]["command"].startswith("ucx-dask-gpu bench")
    assert all(c["shutdown"]["clean"] and c["tracebacks"] == 0 for c in p["clusters"]), p["clusters"]


def test_the_sum_is_right(transpose):
    """Each variant's check: the cluster's (x + x.T).sum() equals numpy's on the same blocks, rebuilt from seeds."""
    _, p, _ = transpose
    nb = SIZE // CHUNK
    x = np.block([[np.random.RandomState(1 * 100_003 + i * nb + j).random_sample((CHUNK, CHUNK)) for j in range(nb)]
                  for i in range(nb)])
    for r in p["runs"]:
        assert r["check"]["ok"] and r["check"]["value"] == pytest.approx(float((x + x.T).sum()), rel=1e-12)


def test_parity_run_on_the_live_cluster(transpose):
    _, p, _ = transpose
    ref = p["reference"]
    assert ref["kind"] == "parity" and ref["status"] == "ok", ref.get("error")
    assert ref["against"] == "ucx/defaults" and ref["protocol"] == "ucx" and "--scheduler-address" in ref["command"]
    assert len(ref["wall_s"]) == RUNS and ref["compute_chunk_size"] == [CHUNK, CHUNK]
    assert ref["ratio_to_ours"]["n_baseline"] == RUNS


def test_svd(tmp_path):
    """The tall-skinny SVD, checked against numpy's singular values of the same blocks."""
    proc = bench("svd", "--cpu", "--size", "4000", "--second-size", "20", "--chunks", "1000", "--runs", "2",
                 "--allow-few", "--warmup", "0", "--variant", "tcp@defaults:none", "--out", str(tmp_path),
                 "--budget", "200", "--run-timeout", "120")
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = json.loads((tmp_path / "svd.json").read_text())
    assert p["shape"] == [4000, 20] and p["chunk"] == [1000, 20] and p["reference"] is None
    (run,) = p["runs"]
    x = np.concatenate([np.random.RandomState(1 * 100_003 + i).random_sample((1000, 20)) for i in range(4)])
    s = np.linalg.svd(x, compute_uv=False)
    assert run["check"]["ok"] and run["check"]["value"] == pytest.approx(float((s ** 2).sum()), rel=1e-9)


def test_the_cluster_process_holds_only_the_client(tmp_path):
    """A cluster process (hosts.Host, as the driver starts it) runs the scheduler and each worker in processes of their
    own, started by `dask scheduler` and `dask worker` (a scheduler in the client's process made submit -> result
    optimistic); closed, it leaves none of them running."""
    argv = ["--cpu", "--size", "400", "--chunks", "100", "--variant",
            "ucx@t:none:ucx-dask-gpu.cluster.threads-per-worker=2"]
    opts = options.options(transpose_study.STUDY, options.build_parser(transpose_study.STUDY).parse_args(argv))
    host = Host(0, opts.variants, opts, tmp_path, Progress(quiet=True))
    try:
        host.ready(180)
        assert host.error is None, list(host.child.stderr)[-40:]
        facts, pid = host.facts, host.child.proc.pid
        started = {p.pid: " ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)}
        scheduler, workers = facts["scheduler_facts"]["pid"], {f["pid"] for f in facts["worker_facts"].values()}
        assert facts["client_facts"]["pid"] == pid and scheduler != pid and pid not in workers and len(workers) == 2
        assert "dask scheduler" in started[scheduler] and workers <= set(started)
        assert len([c for c in started.values() if " dask worker " in c]) == 2, started
        assert facts["cluster_class"] == "launchers: dask scheduler + 2 dask worker"
        assert facts["scheduler"].startswith("ucx://")
        assert all(f["nthreads"] == 2 for f in facts["worker_facts"].values())
        host.begin_close()
        host.finish_close(time.monotonic() + 90)
        assert host.shutdown["clean"] and host.rc == 0, host.shutdown
        # the scheduler forgets the workers before their launchers close them: one closing while registered could
        # have the scheduler write to its closed stream
        assert host.shutdown["steps"][1:] == ["2 workers removed from the scheduler", "worker launchers exited",
                                              "client closed", "scheduler exited"]
        deadline = time.monotonic() + 20
        while alive(set(started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(set(started)), [started[p] for p in alive(set(started))]
    finally:
        host.child.kill()
