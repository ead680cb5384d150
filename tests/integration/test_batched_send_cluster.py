"""The shipped dask config on real processes (`dask scheduler`, two `dask worker`s with nannies, a client script): the
BatchedSend intervals of tuned-gpu.yaml are in force on every role's stream, each worker's start-up line names the
config; then benchmarks/fastpath_cpu.py measures submit -> result against distributed's own intervals on that
cluster (variants interleaved; printed, not asserted: no timed assertions)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import dask.config
import pytest

from ucx_dask_gpu.gate import daskconfig, tuning

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]

CLIENT = textwrap.dedent("""
    import json, sys, time
    from distributed import Client
    from ucx_dask_gpu.gate import tuning
    with Client(sys.argv[1], timeout=60) as c:
        c.wait_for_workers(2, timeout=90)
        time.sleep(0.2)  # the scheduler sets a new client's stream on the loop turn after making it
        out = {"client": tuning.intervals_in_force(c),
               "scheduler": c.run_on_scheduler(tuning.intervals_in_force),
               "workers": c.run(tuning.intervals_in_force), "id": c.id}
    print(json.dumps(out))
""")


def test_the_shipped_intervals_are_in_force_on_every_role(procs, tmp_path, shipped_config):
    shipped = {k.rsplit(".", 1)[1]: v for k, v in daskconfig.shipped_settings().items()
               if k.startswith(tuning.PREFIX + ".")}
    assert set(shipped) == set(tuning.INTERVALS)
    with dask.config.set({f"{tuning.PREFIX}.{k}": v for k, v in shipped.items()}):
        want = {k: tuning.interval(k) for k in shipped}
    env = procs.env_for(tmp_path, shipped_config)
    sched, address = procs.start_scheduler(tmp_path, env)
    workers = [procs.start_worker(tmp_path, env, address, f"w{i}") for i in range(2)]
    try:
        code = CLIENT.replace("sys.argv[1]", repr(address))
        proc = procs.run_python(code, env, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["client"] == {"client-interval": want["client-interval"]}
        assert len(got["workers"]) == 2
        assert all(w == {"worker-interval": want["worker-interval"]} for w in got["workers"].values())
        to_workers = {k: v for k, v in got["scheduler"].items() if k.startswith("scheduler-interval ")}
        assert sorted(k.split()[1] for k in to_workers) == sorted(got["workers"])
        assert set(to_workers.values()) == {want["scheduler-interval"]}
        assert got["scheduler"][f"scheduler-client-interval {got['id']}"] == want["scheduler-client-interval"]
        for w in workers:  # each worker's start-up line names the dask config in force
            deadline = time.monotonic() + 30
            while "dask config tuned-gpu.yaml@" not in w.text() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "dask config tuned-gpu.yaml@" in w.text() and "in force (" in w.text()

        bench = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fastpath_cpu.py"), "--scheduler", address,
                                "--study", "batched-send", "--reps", "15", "--inner", "10"],
                               env=env, capture_output=True, text=True, timeout=900)
        assert bench.returncode == 0, bench.stderr[-3000:]
        print("\n" + bench.stdout)  # the measurement, for the record (pytest -s)
    finally:
        for w in workers:
            w.stop()
        sched.stop()
