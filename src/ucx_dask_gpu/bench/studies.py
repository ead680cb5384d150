"""The Study interface (the model is dask-cuda's benchmarks: one small module per benchmark on a shared runner): what a
study says of itself on the driver's side (its arguments, parameters, report fields, local_cupy's arguments) and does
on the cluster's side (prepare, one repetition, the check); and ArrayStudy, the dask.array studies' common half.
dask is imported inside the methods that build graphs: the CLI imports this module and starts without it.
"""
from __future__ import annotations

import argparse
import math
import re

from ..cliutil import SIZE_HELP, number_type, parse_bytes
from ..errors import USAGE, UserError
from . import cluster


class Study:
    """One benchmarked study (a module: transpose.py, svd.py, transfer.py). The driver-side half parses its arguments
    and describes it; the cluster-side half (prepare, repetition, check) runs in a cluster process."""

    name: str                    # `ucx-dask-gpu bench NAME`
    module: str                  # `python -m MODULE`
    help: str
    reference_operation: str | None = None   # local_cupy's -o, where it has one
    workers: int | None = None   # a fixed number of workers (the transfer study: 2)
    default_variants = ("ucx@defaults:none", "ucx,tcp@shipped:shipped")

    def add_arguments(self, p: argparse.ArgumentParser) -> None: ...

    def params(self, args, cpu: bool) -> dict:
        """The study's parameters (JSON), validated; UserError USAGE otherwise."""
        raise NotImplementedError

    def describe(self, params: dict) -> dict:
        """Fields of the report's top level: workload, expression, size, shape, chunk, ..."""
        raise NotImplementedError

    def reference_args(self, params: dict, overlay: dict) -> tuple[int, int, list[str]]:
        """local_cupy's -s and -c under a variant's client-side config, and what else it needs for this study."""
        raise NotImplementedError

    def primary(self, params: dict) -> str:
        """The metric `wall_s` and `ratio_to_baseline` report."""
        return "wall_s"

    def prepare(self, client, params: dict, workers: list[str], gpu: bool):
        return {"params": params, "workers": workers, "gpu": gpu}

    def repetition(self, client, ctx, seed: int) -> dict:
        """One repetition: {"metrics": {name: seconds}, "bytes": moved, "transfers": [...]}."""
        raise NotImplementedError

    def check(self, client, ctx, seed: int) -> dict:
        return {"ok": True}


class ArrayStudy(Study):
    """A dask.array computation on a random float64 input pinned to the workers (cluster.pinned_array), timed as
    local_cupy times it: wait(client.persist(result)) + a device sync on every worker, a fresh input per repetition
    (created untimed): `wall_s`; then the same again on the resident input: `steady_s`. Subclasses say the shape,
    the graph and the identity that checks it."""

    expression: str              # the report's `expression`
    persisted: str               # what the timed persist is given, in the report's words
    placement: str               # which blocks of the input go to worker i mod n
    second_size: bool = False
    gpu_defaults: tuple = ()     # (size, second size, chunks)
    cpu_defaults: tuple = ()

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        g, c, count = self.gpu_defaults, self.cpu_defaults, number_type(int, 1, "an integer")
        p.add_argument("--size", type=count, help=f"rows; default {g[0]} ({c[0]} with --cpu)")
        if self.second_size:
            p.add_argument("--second-size", type=count, help=f"columns; default {g[1]} ({c[1]} with --cpu)")
        p.add_argument("--chunks", help=f"block edge(s) in elements (4096 or 4096,2048) or a size ('128 MiB'); "
                                        f"default {g[2]!r} ({c[2]!r} with --cpu); {SIZE_HELP}")

    def params(self, args, cpu: bool) -> dict:
        from dask.array.core import normalize_chunks

        size, second, text = self.cpu_defaults if cpu else self.gpu_defaults
        size, second = args.size or size, getattr(args, "second_size", None) or second
        shape = self.shape(size, second)
        text = args.chunks or text
        try:
            given = "auto" if text == "auto" else tuple(int(e) for e in text.split(",")) \
                if re.fullmatch(r"\d+(,\d+)?", text) else parse_bytes(text)
            chunks = self.chunks(given, shape)
            norm = normalize_chunks(chunks, shape, dtype="float64")
        except (ValueError, TypeError):
            raise UserError(f"--chunks {text!r}: expected auto, block edges like 4096 or 4096,2048, or a size like "
                            "'128 MiB'", USAGE) from None
        if second and second > size:
            raise UserError(f"--second-size {second} must not exceed --size {size} (tall-skinny)", USAGE)
        # "auto" is resolved per repetition under the variant's array.chunk-size; `chunk` is dask's default one
        return {"size": size, "second_size": second if self.second_size else None, "shape": list(shape),
                "chunks": chunks, "chunk": [norm[0][0], norm[1][0]], "blocks": [len(norm[0]), len(norm[1])]}

    def describe(self, params: dict) -> dict:
        return {"expression": self.expression, "dtype": "float64", **params,
                "measured": f"Timed: `wait(client.persist({self.persisted}))` plus a device sync on every worker, per "
                            f"repetition, on a fresh input created (untimed) with {self.placement} on worker i mod n."}

    def shape(self, size: int, second: int | None) -> tuple[int, int]:
        return (size, size)

    def chunks(self, given, shape):
        """--chunks as dask.array takes it for this input."""
        return given if not isinstance(given, tuple) or len(given) == 2 else given * 2

    def build(self, x) -> list:
        raise NotImplementedError

    def identity(self, client, x, outputs) -> tuple[float, float]:
        raise NotImplementedError

    def reference_args(self, params: dict, overlay: dict) -> tuple[int, int, list[str]]:
        import dask
        from dask.array.core import normalize_chunks

        with dask.config.set(overlay):  # the variant's array.chunk-size decides "auto"
            edge = normalize_chunks(array_chunks(params), tuple(params["shape"]), dtype="float64")[0][0]
        return params["size"], edge, (["-2", str(params["second_size"])] if self.second_size else [])

    def pinned_input(self, client, ctx, seed: int):
        """The input of a repetition or a check: (x, the futures holding its blocks), block (i, j) on worker i mod n."""
        p = ctx["params"]
        return cluster.pinned_array(client, ctx["workers"], tuple(p["shape"]), array_chunks(p), seed, ctx["gpu"])

    def repetition(self, client, ctx, seed: int) -> dict:
        x, blocks = self.pinned_input(client, ctx, seed)
        if ctx["gpu"]:
            client.run(cluster.sync_device)
        wall, futures, transfers = cluster.timed_persist(client, self.build(x), ctx["gpu"])
        # Steady state: the same graph again on the same, resident input once the first result is released. The
        # blocks a worker fetched stay there as replicas while x is held, so this moves next to nothing: what is left
        # is Dask's control path per task (`steady_s`, its bytes in `steady_bytes`).
        from distributed import futures_of

        keys = [f.key for f in futures_of(futures)]
        del futures
        cluster.settle(client, keys)
        steady, again, steady_transfers = cluster.timed_persist(client, self.build(x), ctx["gpu"])
        chunk = list(x.chunksize)
        del again, blocks, x
        return {"metrics": {"wall_s": wall, "steady_s": steady}, "bytes": sum(t["bytes"] for t in transfers),
                "steady_bytes": sum(t["bytes"] for t in steady_transfers), "chunk": chunk,
                "transfers": [{k: t[k] for k in ("src", "dst", "bytes", "duration")} for t in transfers]}

    def check(self, client, ctx, seed: int) -> dict:
        x, blocks = self.pinned_input(client, ctx, seed)
        value, expected = self.identity(client, x, self.build(x))
        del blocks, x
        rel = abs(value - expected) / max(abs(expected), 1e-300)
        return {"identity": self.identity_text, "value": value, "expected": expected, "rel_error": rel,
                "ok": bool(math.isfinite(value) and rel <= self.rtol)}


def array_chunks(params: dict):
    """--chunks as the params hold them (JSON lists) back in the form dask.array takes."""
    c = params["chunks"]
    return tuple(tuple(e) if isinstance(e, list) else e for e in c) if isinstance(c, list) else c


def scalar(v) -> float:
    return float(v.get() if hasattr(v, "get") else v)  # a CuPy 0-d array comes back to the host
