"""Client-side workloads that prove a cluster works: the transpose sum and a projecting `dd.from_map` reader.

Both connect to `--scheduler ADDRESS` (the image's 3-role cluster) or start a LocalCluster with `--protocol`, check
their result against an answer computed on the client with plain numpy/pyarrow, and survive a worker dying
mid-run: inputs are generated or read by pure tasks (lost results are recomputed by the scheduler), and
`retries` covers tasks that fail outright.

Heavy imports (dask, numpy, pyarrow) stay inside functions so `ucx-dask-gpu --help` stays fast.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Iterator

from .errors import (DATA_INVALID, ENV_MISMATCH, SCHEDULER_UNREACHABLE, USAGE, VERDICT_FAILED, WORKLOAD_FAILED,
                     UserError)

# Relative tolerance for float sums: dask and the client add the same numbers in a different order.
RTOL = 1e-9
READ_TOPIC = "ucx-dask-gpu-read"


# --- cluster -----------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def connect(scheduler: str | None, protocol: str = "tcp", n_workers: int = 2,
            threads_per_worker: int = 1, timeout: float = 30) -> Iterator:
    """A Client to `scheduler`, or to a LocalCluster (worker processes) speaking `protocol` when None."""
    from distributed import Client, LocalCluster

    cluster = None
    try:
        try:
            if scheduler:
                client = Client(scheduler, timeout=timeout)
            else:
                cluster = LocalCluster(protocol=protocol, n_workers=n_workers,
                                       threads_per_worker=threads_per_worker, dashboard_address=":0")
                client = Client(cluster, timeout=timeout)
        except ImportError as e:  # distributed's way to refuse a client: our guard said the environments differ
            raise UserError(str(e), ENV_MISMATCH) from None
        except (OSError, TimeoutError) as e:
            where = scheduler or f"a local {protocol} cluster"
            raise UserError(f"cannot connect to {where}: {e}", SCHEDULER_UNREACHABLE) from None
        with client:
            yield client
    finally:
        if cluster is not None:
            cluster.close()


def n_workers(client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


def compare_versions(versions: dict) -> dict:
    """Do the client, the scheduler and every worker report the same packages (and python)?

    `versions` is Client.get_versions(); returns {"identical": bool, "differences": [{package, client,
    scheduler, workers}]} with one entry per package whose version is not the same everywhere.
    """
    def pkgs(v: dict | None) -> dict:
        return dict((v or {}).get("packages") or {})

    client, sched = pkgs(versions.get("client")), pkgs(versions.get("scheduler"))
    workers = {addr: pkgs(v) for addr, v in (versions.get("workers") or {}).items()}
    names = set(client) | set(sched)
    for w in workers.values():
        names |= set(w)
    diffs = []
    for name in sorted(names):
        seen = {client.get(name), sched.get(name)} | {w.get(name) for w in workers.values()}
        if len(seen) > 1:
            diffs.append({"package": name, "client": client.get(name), "scheduler": sched.get(name),
                          "workers": {a: w.get(name) for a, w in workers.items()}})
    return {"identical": not diffs, "differences": diffs}


def warm_up(client, modules: tuple[str, ...]) -> None:
    """Import the workload's libraries on every worker first, so wall time measures the work, not imports.

    As tasks (worker threads), not `client.run` (the event loop), so heartbeats keep flowing during slow imports.
    """
    addresses = list(client.scheduler_info(n_workers=-1)["workers"])
    # allow_other_workers: a worker killed during warm-up must not leave its pinned task waiting forever.
    client.gather([client.submit(_import_all, modules, workers=[a], allow_other_workers=True, pure=False)
                   for a in addresses])


def _import_all(modules):
    import importlib

    for name in modules:
        importlib.import_module(name)


def _scheme(address: str) -> str:
    return address.split("://", 1)[0] if "://" in address else "tcp"


# --- transpose: (x + x.T).sum() ------------------------------------------------------------------------------------

def _random_block(seed: int, i: int, j: int, shape: tuple[int, int]):
    """Block (i, j) of the input: its own generator stream, so any process can regenerate any block."""
    import numpy as np

    return np.random.default_rng([seed, i, j]).random(shape)


def _generate_block(seed: int, backend: str, block_info=None):
    info = block_info[None]
    i, j = info["chunk-location"]
    block = _random_block(seed, i, j, tuple(info["chunk-shape"]))
    if backend == "cupy":
        import cupy

        return cupy.asarray(block)
    return block


def _chunk_sizes(size: int, chunk: int) -> list[int]:
    return [min(chunk, size - start) for start in range(0, size, chunk)]


def transpose_expected(size: int, chunk: int, seed: int) -> float:
    """(x + x.T).sum() with numpy on the client, block pair by block pair (memory: two blocks).

    Block (i, j) of x + x.T is x[i, j] + x[j, i].T; blocks (i, j) and (j, i) of the result sum to the same value.
    """
    import numpy as np

    sizes = _chunk_sizes(size, chunk)
    total = 0.0
    for i, ri in enumerate(sizes):
        for j in range(i, len(sizes)):
            a = _random_block(seed, i, j, (ri, sizes[j]))
            b = a if i == j else _random_block(seed, j, i, (sizes[j], ri))
            s = float(np.sum(a + b.T))
            total += s if i == j else 2 * s
    return total


def check_transpose_args(size: int, chunk: int, backend: str) -> None:
    """Validate before any cluster starts."""
    if size <= 0 or chunk <= 0:
        raise UserError(f"--size and --chunk must be positive (got {size}, {chunk})", USAGE)
    if backend not in ("numpy", "cupy"):
        raise UserError(f"unknown backend {backend!r} (expected numpy or cupy)", USAGE)


def _client_meta(backend: str):
    """A cupy meta when the client itself can make one; else None (workers still make cupy blocks at run time).

    Clients often run without a GPU; nothing on the client needs one: the result comes back as a Python float.
    """
    if backend != "cupy":
        return None
    try:
        import cupy

        return cupy.empty((0, 0))
    except Exception:  # no cupy / no CUDA driver here
        return None


def _array_module(block) -> str:
    return type(block).__module__.split(".")[0]


def _as_float(value) -> float:
    return float(value)


def on_cluster(what: str, future, timeout: float | None = None):
    """A future's result; a computation that fails on the cluster is one line and its own exit code."""
    try:
        return future.result(timeout)
    except Exception as e:  # whatever the task raised, or KilledWorker after too many worker deaths
        raise UserError(f"{what} failed on the cluster: {type(e).__name__}: {e}", WORKLOAD_FAILED) from None


def ucx_loaded() -> dict:
    """Which UCX this process runs on: the libucp.so it has mapped and the version UCXX reports (None when no UCX)."""
    with open("/proc/self/maps") as maps:
        path = next((line.split()[-1] for line in maps if "/libucp.so" in line), None)
    ucxx = sys.modules.get("ucxx")
    version = ".".join(map(str, ucxx.get_ucx_version())) if ucxx is not None else None
    return {"libucp": path, "ucx_version": version}


def ucx_in_roles(client) -> dict:
    """ucx_loaded() of the client, the scheduler and every worker."""
    return {"client": ucx_loaded(), "scheduler": client.run_on_scheduler(ucx_loaded),
            "workers": client.run(ucx_loaded)}


def run_transpose(client, size: int = 4000, chunk: int = 1000, seed: int = 0, backend: str = "numpy",
                  retries: int = 2) -> dict:
    import dask.array as da
    from distributed import futures_of

    check_transpose_args(size, chunk, backend)
    versions = compare_versions(client.get_versions(check=False))
    warm_up(client, ("numpy", "dask.array") + (("cupy",) if backend == "cupy" else ()))
    workers_start = n_workers(client)
    sizes = tuple(_chunk_sizes(size, chunk))
    x = da.map_blocks(_generate_block, seed, backend, chunks=(sizes, sizes), dtype="float64",
                      meta=_client_meta(backend), name=f"random-{seed}-{size}-{chunk}-{backend}")
    start = time.perf_counter()
    # Persist, then reduce: a worker that dies takes its blocks with it, and the scheduler regenerates them.
    x = client.persist(x, retries=retries)
    total = client.compute((x + x.T).sum(), retries=retries)
    # Converted on a worker: a cupy scalar would need a GPU on the client to be deserialized.
    value = on_cluster("transpose", client.submit(_as_float, total, retries=retries, pure=False))
    wall = time.perf_counter() - start
    # What the workers really computed on (cupy on GPUs), read from a block where it lives.
    block_type = on_cluster("transpose", client.submit(_array_module, futures_of(x)[0], pure=False))
    del x, total
    expected = transpose_expected(size, chunk, seed)
    rel = abs(value - expected) / max(abs(expected), 1e-300)
    return {
        "workload": "transpose", "expression": "(x + x.T).sum()", "size": size, "chunk": chunk,
        "blocks": len(sizes) ** 2, "backend": backend, "block_type": block_type, "seed": seed,
        "protocol": _scheme(client.scheduler.address), "scheduler": client.scheduler.address,
        "workers_start": workers_start, "workers_end": n_workers(client),
        "value": value, "expected": expected, "rel_error": rel, "ok": rel <= RTOL and block_type == backend,
        "wall_s": round(wall, 4),
        "versions_identical": versions["identical"], "version_differences": versions["differences"],
        "ucx": ucx_in_roles(client) if _scheme(client.scheduler.address) == "ucx" else None,
    }


# --- from_map: a projecting Parquet / Feather reader ----------------------------------------------------------------

FORMATS = {"parquet": ".parquet", "feather": ".feather"}
NUMERIC_COLUMNS = ("id", "a", "b", "d")


def dataset_table(index: int, rows: int, seed: int):
    """File `index` of the dataset: id (int64), a (float64), b (int64), c (string), d (float64)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng([seed, index])
    first = index * rows
    return pa.table({
        "id": pa.array(np.arange(first, first + rows, dtype="int64")),
        "a": pa.array(rng.random(rows)),
        "b": pa.array(rng.integers(0, 1000, rows, dtype="int64")),
        "c": pa.array([f"s{(first + k) % 97}" for k in range(rows)], type=pa.string()),
        "d": pa.array(rng.normal(size=rows)),
    })


def write_dataset(directory: str | Path, fmt: str, files: int, rows: int, seed: int) -> list[Path]:
    """Write the files (each atomically: a reader never sees half a file); returns their paths."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    from .fsutil import atomic_path

    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {directory}: {e.strerror}", DATA_INVALID) from None
    paths = []
    for index in range(files):
        path = directory / f"part-{index:05d}{FORMATS[fmt]}"
        table = dataset_table(index, rows, seed)
        with atomic_path(path) as tmp:
            if fmt == "parquet":
                pq.write_table(table, tmp, row_group_size=max(1, rows // 4))
            else:
                feather.write_feather(table, tmp)
        paths.append(path)
    return paths


def find_dataset(directory: str | Path, fmt: str) -> list[Path]:
    paths = sorted(Path(directory).glob(f"part-*{FORMATS[fmt]}"))
    if not paths:
        raise UserError(f"{directory}: no part-*{FORMATS[fmt]} files (run without --no-write to create them)",
                        DATA_INVALID)
    return paths


class ArrowFileReader:
    """`dd.from_map` function: one Parquet/Feather file -> one pandas partition, reading only projected columns.

    dask 2026.x pushes a column selection into from_map through the function's `columns=` keyword (it warns that
    the older DataFrameIOFunction protocol is no longer used for projection); `columns` / `project_columns` are
    kept so the object also satisfies that protocol. Each call logs the columns it really read as a Dask event
    (topic READ_TOPIC), so the client can show projection happened on the workers.
    """

    def __init__(self, fmt: str, all_columns: list[str], run: str, columns: list[str] | None = None):
        self.fmt = fmt
        self.all_columns = list(all_columns)
        self.run = run
        self._columns = list(columns) if columns is not None else None

    @property
    def columns(self) -> list[str]:
        return self._columns if self._columns is not None else self.all_columns

    def project_columns(self, columns) -> "ArrowFileReader":
        return ArrowFileReader(self.fmt, self.all_columns, self.run, list(columns))

    def read_table(self, path: str, columns: list[str] | None):
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, columns=columns)
        import pyarrow.feather as feather

        return feather.read_table(path, columns=columns, memory_map=True)

    def __call__(self, path: str, columns=None):
        columns = list(columns) if columns is not None else self._columns
        table = self.read_table(path, columns)
        try:
            from distributed import get_worker

            worker = get_worker()
        except ValueError:  # not inside a worker (e.g. a local compute): nothing to report to
            worker = None
        if worker is not None:
            worker.log_event(READ_TOPIC, {"run": self.run, "file": Path(path).name,
                                          "columns": table.column_names, "rows": table.num_rows,
                                          "worker": worker.address})
        return table.to_pandas()


def _meta(all_columns_table):
    return all_columns_table.schema.empty_table().to_pandas()


def _find_projection(collection) -> list[str] | None:
    """The columns dask's optimizer pushed into from_map (None if it pushed nothing)."""
    from dask.dataframe.dask_expr.io import FromMapProjectable

    # Unfused, so the reader's expression is still a node of its own (fusing happens after projection).
    for node in collection.optimize(fuse=False).expr.walk():
        if isinstance(node, FromMapProjectable):
            return list(node.columns_operand) if node.columns_operand is not None else None
    return None


def _wait_for_read_events(client, run: str, files: set[str], timeout: float = 15.0) -> list[dict]:
    """Events of this run, once every file has one (workers send them in batches, a few ms late)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [msg for _, msg in client.get_events(READ_TOPIC) if isinstance(msg, dict) and msg.get("run") == run]
        if {e["file"] for e in events} >= files or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


def from_map_expected(paths: list[Path], fmt: str, columns: list[str]) -> dict[str, float | int]:
    """Column sums with pyarrow/pandas on the client, reading every file whole (no projection involved)."""
    import pandas as pd

    reader = ArrowFileReader(fmt, [], "client")
    frame = pd.concat([reader.read_table(str(p), None).to_pandas() for p in paths], ignore_index=True)
    return {c: frame[c].sum().item() for c in columns}


def prepare_dataset(directory: str | Path, fmt: str = "parquet", files: int = 8, rows: int = 50_000,
                    columns: list[str] | None = None, seed: int = 0, write: bool = True) -> tuple[list[Path], list[str]]:
    """Validate the arguments and write (or find) the files, before any cluster starts: (paths, columns)."""
    if fmt not in FORMATS:
        raise UserError(f"unknown format {fmt!r} (expected parquet or feather)", USAGE)
    columns = list(columns or ["a", "b"])
    bad = [c for c in columns if c not in NUMERIC_COLUMNS]
    if bad or len(set(columns)) != len(columns):
        raise UserError(f"--columns must be distinct names among {', '.join(NUMERIC_COLUMNS)} (got "
                        f"{','.join(columns)})", USAGE)
    if write:
        if files <= 0 or rows <= 0:
            raise UserError(f"--files and --rows must be positive (got {files}, {rows})", USAGE)
        paths = write_dataset(directory, fmt, files, rows, seed)
    else:
        paths = find_dataset(directory, fmt)
    expected_columns = dataset_table(0, 1, seed).column_names
    try:
        on_disk = ArrowFileReader(fmt, expected_columns, "probe").read_table(str(paths[0]), None).schema
    except Exception as e:  # pyarrow raises several types for a foreign or damaged file
        raise UserError(f"{paths[0]}: not a readable {fmt} file: {e}", DATA_INVALID) from None
    if on_disk.names != expected_columns:
        raise UserError(f"{paths[0]}: columns {on_disk.names}, expected {expected_columns}", DATA_INVALID)
    return paths, columns


def run_from_map(client, paths: list[Path], fmt: str = "parquet", columns: list[str] | None = None,
                 retries: int = 2) -> dict:
    """Sum `columns` over the files with a dd.from_map reader; check the sums and that workers read only them."""
    import dask.dataframe as dd

    columns = list(columns or ["a", "b"])
    template = dataset_table(0, 1, 0)
    all_columns = template.column_names
    versions = compare_versions(client.get_versions(check=False))
    run = uuid.uuid4().hex
    reader = ArrowFileReader(fmt, all_columns, run)
    df = dd.from_map(reader, [str(p) for p in paths], meta=_meta(template), label=f"read-{fmt}",
                     enforce_metadata=False)
    query = df[columns].sum()
    projected = _find_projection(query)
    warm_up(client, ("pandas", "pyarrow.parquet", "pyarrow.feather", "dask.dataframe"))
    workers_start = n_workers(client)
    start = time.perf_counter()
    result = on_cluster("from-map", client.compute(query, retries=retries))
    wall = time.perf_counter() - start
    events = _wait_for_read_events(client, run, {p.name for p in paths})

    expected = from_map_expected(paths, fmt, columns)
    # One dtype for the whole result Series: an int column's sum comes back as float64 next to a float column;
    # it must still equal the client's integer sum exactly.
    value = {c: result[c].item() for c in columns}
    values_ok = all(
        value[c] == expected[c] if isinstance(expected[c], int)
        else math.isclose(value[c], expected[c], rel_tol=RTOL) for c in columns)
    read_sets = sorted({tuple(e["columns"]) for e in events})
    files_read = {e["file"] for e in events}
    projection_ok = (projected is not None and set(projected) == set(columns)
                     and bool(events) and all(set(cols) == set(columns) for cols in read_sets)
                     and files_read == {p.name for p in paths})
    return {
        "workload": "from-map", "format": fmt, "directory": str(Path(paths[0]).parent), "files": len(paths),
        "query": f"df[{columns!r}].sum()",
        "protocol": _scheme(client.scheduler.address), "scheduler": client.scheduler.address,
        "workers_start": workers_start, "workers_end": n_workers(client),
        "requested_columns": columns, "projected_columns": projected,
        "columns_read": [list(c) for c in read_sets], "all_columns": all_columns,
        "reads": len(events), "files_read": len(files_read),
        "value": value, "expected": expected, "values_ok": values_ok, "projection_ok": projection_ok,
        "ok": values_ok and projection_ok, "wall_s": round(wall, 4),
        "versions_identical": versions["identical"], "version_differences": versions["differences"],
    }


# --- CLI -------------------------------------------------------------------------------------------------------------

def _summary(r: dict) -> str:
    verdict = "ok" if r["ok"] else "MISMATCH"
    versions = "versions identical" if r["versions_identical"] else \
        f"versions DIFFER ({', '.join(d['package'] for d in r['version_differences'])})"
    workers = f"{r['workers_start']} workers" + (f" -> {r['workers_end']}" if r["workers_end"] != r["workers_start"]
                                                 else "")
    if r["workload"] == "transpose":
        what = (f"transpose {r['size']}x{r['size']} chunk {r['chunk']} {r['backend']}: value {r['value']:.6f} "
                f"expected {r['expected']:.6f}")
    else:
        what = (f"from-map {r['files']} {r['format']} files: read columns "
                f"{' / '.join(','.join(c) for c in r['columns_read']) or 'none'} for projection "
                f"{','.join(r['projected_columns'] or ['none'])}; sums {'match' if r['values_ok'] else 'DIFFER'}")
    return f"{what} {verdict}, {r['wall_s']:.2f} s over {r['protocol']}, {workers}, {versions}"


def _reserve_stdout_for_results():
    """Send everything else written to fd 1 to stderr; return a file on the real stdout for the result.

    UCX logs to stdout from C (e.g. its UCX_MEMTYPE_CACHE warning), in this process and in LocalCluster workers
    started from it; without this, `--json > result.json` would not be JSON over UCX.
    """
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return results


def _run(args, body) -> int:
    results = _reserve_stdout_for_results()
    with connect(args.scheduler, args.protocol, args.n_workers, args.threads_per_worker, args.timeout) as client:
        result = body(client)
    if args.output:
        from .fsutil import atomic_write_text

        atomic_write_text(args.output, json.dumps(result, indent=2) + "\n")
    results.write((json.dumps(result, indent=2) if args.json else _summary(result)) + "\n")
    results.flush()
    return 0 if result["ok"] else VERDICT_FAILED


def _cmd_transpose(args) -> int:
    check_transpose_args(args.size, args.chunk, args.backend)
    return _run(args, lambda c: run_transpose(c, args.size, args.chunk, args.seed, args.backend, args.retries))


def _cmd_from_map(args) -> int:
    paths, columns = prepare_dataset(args.path, args.format, args.files, args.rows,
                                     [c for c in args.columns.split(",") if c], args.seed, not args.no_write)
    return _run(args, lambda c: run_from_map(c, paths, args.format, columns, args.retries))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="ADDRESS", help="scheduler to use, e.g. ucx://10.0.0.1:8786 (default: "
                                                          "start a LocalCluster)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "ucx", "ucxx"],
                   help="LocalCluster protocol when no --scheduler (default tcp)")
    p.add_argument("--n-workers", type=int, default=2, help="LocalCluster workers (default 2)")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30, help="seconds to wait for the scheduler (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retries", type=int, default=2, help="retries per failing task (default 2)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--output", metavar="FILE", help="also write the JSON result to FILE")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("workload", help="run a client workload on a Dask cluster and check its answer")
    s = p.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    t = s.add_parser("transpose", help="(x + x.T).sum() on a chunked random array, checked against numpy")
    t.add_argument("--size", type=int, default=4000, help="x is SIZE x SIZE float64 (default 4000)")
    t.add_argument("--chunk", type=int, default=1000, help="chunk edge (default 1000)")
    t.add_argument("--backend", choices=["numpy", "cupy"], default="numpy", help="array type on the workers")
    _common(t)
    t.set_defaults(func=_cmd_transpose)
    f = s.add_parser("from-map", help="dd.from_map Parquet/Feather reader with column projection, checked")
    f.add_argument("path", help="directory shared with the workers (files are written there unless --no-write)")
    f.add_argument("--format", choices=sorted(FORMATS), default="parquet")
    f.add_argument("--files", type=int, default=8, help="files to write, one partition each (default 8)")
    f.add_argument("--rows", type=int, default=50_000, help="rows per file (default 50000)")
    f.add_argument("--columns", default="a,b", help=f"columns to sum, among {','.join(NUMERIC_COLUMNS)} (default a,b)")
    f.add_argument("--no-write", action="store_true", help="read the files already in PATH")
    _common(f)
    f.set_defaults(func=_cmd_from_map)
