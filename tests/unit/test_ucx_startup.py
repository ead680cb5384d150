"""The transports preload in real Dask processes (in-process scheduler and workers): each worker logs its one line and
registers its facts; the scheduler warns once about same-kernel GPU workers in different namespaces."""
from __future__ import annotations

import asyncio
import logging

import pytest
from distributed import Scheduler, Worker

from ucx_dask_gpu.ucx import startup

FACTS = {"boot_id": "b0b0b0b0-1", "ipc_ns": 4026532001, "pid_ns": 4026532002, "cuda_ipc": True}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_a_worker_logs_its_transports_line_and_registers_its_facts(caplog):
    async def main():
        async with Scheduler(port=0, dashboard_address=":0") as s:
            async with Worker(s.address, preload=["ucx_dask_gpu.ucx.startup"], dashboard_address=":0") as w:
                return s.workers[w.address].extra.get(startup.KEY)

    with caplog.at_level(logging.INFO, logger="distributed.ucx_dask_gpu.transports"):
        facts = run(main())
    lines = [r.getMessage() for r in caplog.records if "ucx-dask-gpu transports" in r.getMessage()]
    assert len([ln for ln in lines if "transports automatic" in ln or "UCX_TLS=" in ln]) == 1, lines
    assert facts and set(facts) == {"boot_id", "ipc_ns", "pid_ns", "cuda_ipc"} and facts["cuda_ipc"] is False


@pytest.mark.parametrize("other, warned", [
    (dict(FACTS, ipc_ns=4026532101, pid_ns=4026532102), True),    # another container on this kernel
    (dict(FACTS), False),                                         # the same namespaces
    (dict(FACTS, boot_id="c0c0c0c0-2", ipc_ns=1), False),         # another host
])
def test_the_scheduler_warns_once_per_blocked_pair(caplog, other, warned):
    async def main():
        async with Scheduler(port=0, dashboard_address=":0") as s:
            s.add_plugin(startup.SameHostCuda())
            async with Worker(s.address, startup_information={startup.KEY: lambda w: FACTS}, dashboard_address=":0"):
                async with Worker(s.address, startup_information={startup.KEY: lambda w: other},
                                  dashboard_address=":0"):
                    return [e for _, e in s.get_events(startup.KEY)]

    with caplog.at_level(logging.WARNING, logger="distributed.ucx_dask_gpu.transports"):
        events = run(main())
    warnings = [r.getMessage() for r in caplog.records if "different IPC/PID namespaces" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0) and len(events) == len(warnings)
    if warned:
        assert "boot id b0b0b0b0" in warnings[0] and "--ipc container:NAME --pid container:NAME" in warnings[0]
        assert events[0]["action"] == "cuda-ipc-blocked" and len(events[0]["workers"]) == 2
