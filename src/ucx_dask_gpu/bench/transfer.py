"""`ucx-dask-gpu bench transfer` / `python -m ucx_dask_gpu.bench.transfer`: what ONE worker-to-worker transfer costs,
per block size, over each variant (common.py runs it). One repetition takes every size in turn, one transfer at a time
on an otherwise idle cluster: a fresh block made on worker A (untimed), read by a task on worker B. `e2e_s@N` is the
client's submit -> result; `transfer_s@N` is B's transfer_incoming_log stop - start for the block (distributed floors
its `duration` field at 1 ms, which would hide everything below it).
"""
from __future__ import annotations

import sys
import time

from ..cliutil import SIZE_HELP, parse_bytes
from ..errors import USAGE, UserError
from . import cluster, common, studies, trace

SAMPLE_TIMEOUT_S = 30.0  # one transfer that takes longer is a hang, not a measurement


def make_bytes(nbytes: int, fill: int, gpu: bool):
    """A fresh block of `nbytes` bytes on this worker (device memory on a GPU worker)."""
    block = cluster.array_module(gpu).full(nbytes, fill % 251, dtype="uint8")
    if gpu:
        cluster.sync_device()
    return block


def read_block(block) -> tuple[int, int]:
    """(bytes, last byte) of the block that arrived: the task reads what it received."""
    return int(block.nbytes), int(block[-1])


def one_transfer(client, a: str, b: str, nbytes: int, fill: int, gpu: bool) -> dict:
    from distributed import wait

    fa = client.submit(make_bytes, nbytes, fill, gpu, workers=[a], allow_other_workers=False, pure=False)
    wait(fa, timeout=SAMPLE_TIMEOUT_S)
    t0 = time.perf_counter()
    fb = client.submit(read_block, fa, workers=[b], allow_other_workers=False, pure=False)
    got = fb.result(timeout=SAMPLE_TIMEOUT_S)
    e2e = time.perf_counter() - t0
    log = client.run(cluster.pop_transfer_log, workers=[b])[b]
    key = str(fa.key)
    fa.release()
    fb.release()
    cluster.settle(client)
    if tuple(got) != (nbytes, fill % 251):
        raise RuntimeError(f"worker B read {got} from a block of {nbytes} bytes filled with {fill % 251}")
    entry = next((e for e in log if key in e["keys"]), None)
    if entry is None:
        raise RuntimeError(f"no transfer_incoming_log entry on B for the {nbytes}-byte block")
    return {"e2e_s": e2e, "transfer_s": max(0.0, entry["stop"] - entry["start"]), "bytes": entry["bytes"],
            "submit": t0, "result": t0 + e2e}


class Transfer(studies.Study):
    name = "transfer"
    module = "ucx_dask_gpu.bench.transfer"
    help = "the cost of one worker-to-worker transfer per block size, variants interleaved"
    workers = 2

    def add_arguments(self, p) -> None:
        p.add_argument("--sizes", help=f"block sizes (default 8,1MiB,128MiB; 8,1MiB,32MiB with --cpu); {SIZE_HELP}")
        p.add_argument("--trace", type=int, default=0, metavar="N",
                       help="after the timed rounds, N untimed rounds with every step of each transfer traced inside "
                            "the workers: where its time goes, how many UCX operations it needs (default 0)")

    def params(self, args, cpu: bool) -> dict:
        text = args.sizes or ("8,1MiB,32MiB" if cpu else "8,1MiB,128MiB")
        try:
            sizes = [parse_bytes(s.strip()) for s in text.split(",")]
        except (ValueError, TypeError):
            raise UserError(f"--sizes {text!r}: expected sizes like 8,1MiB,128MiB", USAGE) from None
        if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
            raise UserError(f"--sizes {text!r}: expected distinct sizes of 1 byte or more", USAGE)
        if args.trace < 0:
            raise UserError(f"--trace {args.trace}: expected a number of rounds >= 0", USAGE)
        return {"sizes": sizes, "trace": args.trace}

    def primary(self, params: dict) -> str:
        return f"e2e_s@{min(params['sizes'])}"  # submit -> result reading the smallest block: the fixed cost

    def describe(self, params: dict) -> dict:
        return {"expression": "one block from worker A read by a task on worker B, one transfer at a time",
                "sizes": params["sizes"],
                "measured": "Per repetition, each size in turn on an idle cluster: `transfer_s@N` = B's "
                            "transfer_incoming_log stop - start for the block (unfloored), `e2e_s@N` = the client's "
                            "submit -> result of the task on B that reads it."}

    def prepare(self, client, params: dict, workers: list[str], gpu: bool):
        a, b = workers[:2]
        for n in params["sizes"]:  # connections open both ways, allocators and UCX set up, before anything counts
            one_transfer(client, a, b, n, 0, gpu)
            one_transfer(client, b, a, n, 0, gpu)
        return {"params": params, "a": a, "b": b, "gpu": gpu}

    def repetition(self, client, ctx, seed: int) -> dict:
        metrics, moved = {}, 0
        for k, n in enumerate(ctx["params"]["sizes"]):
            s = one_transfer(client, ctx["a"], ctx["b"], n, seed + k + 1, ctx["gpu"])
            metrics[f"transfer_s@{n}"], metrics[f"e2e_s@{n}"] = s["transfer_s"], s["e2e_s"]
            moved += s["bytes"]
        return {"metrics": metrics, "bytes": moved, "transfers": []}

    def check(self, client, ctx, seed: int) -> dict:
        """Every block was checked as it arrived; with --trace, the traced rounds (after the timed ones: the tracer
        stays installed)."""
        out = {"ok": True, "identity": "every block arrived whole (its size and last byte read by the task on B)"}
        rounds, sizes, a, b = ctx["params"]["trace"], ctx["params"]["sizes"], ctx["a"], ctx["b"]
        if rounds:
            client.run(trace.install)
            client.run(trace.pop_events)
            samples = []
            for r in range(rounds):
                for k, n in enumerate(sizes):
                    s = one_transfer(client, a, b, n, seed + 100 * r + k, ctx["gpu"])
                    events = client.run(trace.pop_events)
                    samples.append({"bytes": n, "submit": s["submit"], "result": s["result"],
                                    "events": {"A": events[a], "B": events[b]}})
            out["phases"] = trace.phase_table(samples, sizes)
        return out


STUDY = Transfer()

if __name__ == "__main__":
    from ucx_dask_gpu.bench import transfer  # this module by its name: what workers unpickle is importable

    sys.exit(common.main(transfer.STUDY))
