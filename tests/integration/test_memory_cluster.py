"""The shipped dask config does not overproduce: `(x + x.T).sum()` as the transpose workload sums it (split_every 100;
at dask's 4 the control run below saw only 69-107 MiB) of an input 1.4x the workers' memory, on a real
cluster (two worker processes, 400 MiB each, one thread) with the shipped settings in force, holds at most a fraction
of each worker's memory at any time. With root-task queuing off (`worker-saturation: inf`, once shipped) every random
block is produced as soon as it is assigned, long before the reduction can consume it (distributed#6614, #7213):
measured here 290-305 MiB managed per worker against 46-53 MiB with distributed's 1.1; a control run shows the test
sees that."""
from __future__ import annotations

import threading
import time

import dask
import dask.array as da
import pytest
from distributed import Client, LocalCluster

from ucx_dask_gpu.gate import daskconfig
from ucx_dask_gpu.proof.transpose import transpose_sum

pytestmark = pytest.mark.integration

LIMIT = 400 * 2**20
SIZE, CHUNK = 12000, 1000  # 1.15 GB of float64 over 2 x 400 MiB
# Far above what the reduction needs at once (tens of MiB), far below what producing every block first takes.
AT_MOST = 0.35


def peak_managed(settings: dict) -> dict[str, int]:
    with dask.config.set(settings):
        with LocalCluster(n_workers=2, threads_per_worker=1, memory_limit=LIMIT, dashboard_address=None,
                          processes=True) as lc, Client(lc) as c:
            peak: dict[str, int] = {}
            done = threading.Event()

            def poll():
                while not done.is_set():
                    for w, n in c.run(lambda dask_worker: dask_worker.state.nbytes).items():
                        peak[w] = max(peak.get(w, 0), n)
                    time.sleep(0.05)

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                x = da.random.RandomState(0).random_sample((SIZE, SIZE), chunks=CHUNK)
                value = transpose_sum(x).compute()
            finally:
                done.set()
                poller.join()
    assert abs(value - SIZE * SIZE) < 0.01 * SIZE * SIZE  # mean 0.5, doubled
    print({w: f"{n / 2**20:.0f} MiB" for w, n in peak.items()})
    return peak


def shipped() -> dict:
    """Every setting the shipped config gives a cluster (`config install`), as dask.config.set takes them."""
    return {k: v for k, v in daskconfig.shipped_settings().items()
            if k.startswith(("distributed.scheduler.", "distributed.worker.", "distributed.comm."))}


def test_the_shipped_config_does_not_produce_every_root_task_first():
    peak = peak_managed(shipped())
    assert len(peak) == 2 and max(peak.values()) <= AT_MOST * LIMIT, peak


def test_without_root_task_queuing_the_measurement_sees_the_overproduction():
    peak = peak_managed({**shipped(), "distributed.scheduler.worker-saturation": float("inf")})
    assert max(peak.values()) > AT_MOST * LIMIT, peak
