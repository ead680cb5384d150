"""The carried distributed-ucxx patches 0003-0005 on real UCXX endpoints (UCX over TCP on loopback, CPU): an echo server
and a client in two processes, each with its own dask config, exchange Dask messages of 1 to 150 frames (an empty
one among them) through distributed's comm layer; the client counts the UCX operations its comm awaits per message.

- concurrent-requests (0004): a write awaits ONE operation instead of 2 + one per frame, a read three (the two meta
  data messages, then all frames) instead of 2 + one per frame; the messages on the wire are the same, so a process
  with the setting and one without answer each other.
- multi-buffer (0005): messages go through UCXX's send_multi and come back whole (more than 100 frames: several
  headers; empty frames), received by our header parser into buffers of distributed-ucxx's own allocators.
- cuda-sync (0003) needs a GPU: tests/gpu/test_fastpath_gpu.py.
Round-trip times are printed (pytest -s), never asserted.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

UCX_OVER_TCP = {"DASK_DISTRIBUTED_UCXX__TCP": "True", "DASK_DISTRIBUTED_UCXX__NVLINK": "False",
                "DASK_DISTRIBUTED_UCXX__INFINIBAND": "False", "DASK_DISTRIBUTED_UCXX__CUDA_COPY": "False",
                "DASK_DISTRIBUTED_UCXX__CREATE_CUDA_CONTEXT": "False"}

SERVER = textwrap.dedent("""
    import asyncio, sys
    from distributed.comm import listen

    async def echo(comm):
        while True:
            try:
                msg = await comm.read()
                await comm.write(msg)
            except Exception:
                return

    async def main():
        async with listen("ucx://127.0.0.1:0", echo, deserialize=False) as listener:  # back as it came
            print(listener.contact_address, flush=True)
            await asyncio.sleep(600)

    asyncio.run(main())
""")

CLIENT = textwrap.dedent("""
    import asyncio, json, statistics, sys, time
    import numpy as np
    from distributed.comm import connect
    from distributed.protocol import to_serialize

    OPS = ("send", "recv", "send_many", "recv_many", "send_multi", "recv_multi")

    def messages():
        return {
            "plain": {"op": "x", "n": 1},
            "three-buffers": {"a": to_serialize(np.arange(2**18, dtype="u8")), "b": to_serialize(b"b" * 3000),
                              "c": to_serialize(np.zeros(5, dtype="f4"))},
            "empty-buffer": {"e": to_serialize(b""), "f": to_serialize(b"f" * 10)},
            "150-buffers": {"parts": [to_serialize(bytes([i % 256]) * (i + 1)) for i in range(150)]},
        }

    def same(a, b):
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        a = getattr(a, "data", a)
        return bytes(memoryview(np.ascontiguousarray(a)).cast("B")) == bytes(memoryview(np.asarray(b)).cast("B"))

    async def main():
        comm = await connect(sys.argv[1])
        ep = comm.ep
        counts = dict.fromkeys(OPS, 0)
        for name in OPS:
            def counted(*args, _orig=getattr(ep, name), _name=name, **kwargs):
                counts[_name] += 1
                return _orig(*args, **kwargs)
            setattr(ep, name, counted)
        out = {}
        for label, msg in messages().items():
            rows = []
            for i in range(int(sys.argv[2])):
                counts.update(dict.fromkeys(OPS, 0))
                t0 = time.perf_counter()
                await comm.write(msg)
                wrote = {k: v for k, v in counts.items() if v}
                counts.update(dict.fromkeys(OPS, 0))
                back = await comm.read()
                rows.append((time.perf_counter() - t0, wrote, {k: v for k, v in counts.items() if v}, same(msg, back)))
            out[label] = {"write": rows[-1][1], "read": rows[-1][2], "all_equal": all(r[3] for r in rows),
                          "median_us": statistics.median(r[0] for r in rows[1:] or rows) * 1e6}
        await comm.close()
        print(json.dumps(out))

    asyncio.run(main())
""")


def _env(settings: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "UCX_"))}
    return env | UCX_OVER_TCP | settings


def exchange(server: dict[str, str], client: dict[str, str], rounds: int = 20) -> dict:
    srv = subprocess.Popen([sys.executable, "-c", SERVER], env=_env(server), stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
    try:
        address = ""
        for line in srv.stdout:  # UCX writes its own warnings to stdout too
            if line.startswith("ucx://"):
                address = line.strip()
                break
        assert address, f"server did not start (exit {srv.poll()})"
        proc = subprocess.run([sys.executable, "-c", CLIENT, address, str(rounds)], env=_env(client),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        srv.kill()
        srv.wait(30)


@pytest.fixture(scope="module", autouse=True)
def patched_ucxx():
    probe = subprocess.run([sys.executable, "-c", "from ucxx._lib_async.endpoint import Endpoint; import distributed_ucxx.ucxx as d; "
                            "print(hasattr(Endpoint, 'send_many') and hasattr(d.UCXX, '_recv_multi'))"],
                           capture_output=True, text=True, env=_env({}))
    if probe.stdout.strip() != "True":
        pytest.fail("the installed UCXX lacks ucx-src-build/patches/ucxx-0.51.01/0003-0005: rebuild the wheels and the "
                    f"venv (make ucxx venv) {probe.stderr[-500:]}")


ON = {"DASK_DISTRIBUTED_UCXX__CONCURRENT_REQUESTS": "True"}
MULTI = {"DASK_DISTRIBUTED_UCXX__MULTI_BUFFER": "True"}


def _frames(result: dict, label: str) -> int:
    """Non-empty frames of a message: what one-at-a-time sends after its two meta data messages."""
    return result[label]["write"]["send"] - 2


def test_concurrent_requests_await_one_write_and_three_reads_per_message(capsys):
    off, on = exchange({}, {}), exchange(ON, ON)
    for label in off:
        assert off[label]["all_equal"] and on[label]["all_equal"], label
        n = _frames(off, label)
        assert n >= 1 and off[label]["read"] == {"recv": n + 2}
        assert on[label]["write"] == {"send_many": 1}
        assert on[label]["read"] == {"recv": 2, "recv_many": 1}
    assert _frames(off, "150-buffers") > 100
    with capsys.disabled():
        print("\nround trip (us, median of 19), one-at-a-time vs concurrent-requests:")
        for label in off:
            print(f"  {label:<14} frames {_frames(off, label):>3}: {off[label]['median_us']:9.0f} "
                  f"{on[label]['median_us']:9.0f}")


@pytest.mark.parametrize("server, client", [(ON, {}), ({}, ON)], ids=["server-on", "client-on"])
def test_the_wire_format_does_not_change(server, client):
    result = exchange(server, client, rounds=3)
    assert all(r["all_equal"] for r in result.values())


def test_multi_buffer_messages_come_back_whole(capsys):
    result = exchange(MULTI, MULTI)
    for label, r in result.items():
        assert r["all_equal"], label
        assert r["write"] == {"send_multi": 1}
        headers = r["read"]["recv"]
        assert r["read"] == {"recv": headers, "recv_many": 1}
    # a header describes up to 100 frames: 301 frames + the close flag take 4
    assert result["plain"]["read"]["recv"] == 1 and result["150-buffers"]["read"]["recv"] == 4
    with capsys.disabled():
        print("\nmulti-buffer round trip (us, median of 19): "
              + ", ".join(f"{k} {v['median_us']:.0f}" for k, v in result.items()))
