"""`ucx-dask-gpu workload from-map`: Parquet/Feather files summed through a projecting `dd.from_map` reader, checked
against pyarrow/pandas on the client, and proof that every worker read exactly the projected columns (each read is
reported as a Dask event).

numpy, pandas, pyarrow and dask are imported inside functions: the CLI imports this module and starts without them."""
from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

from ..errors import DATA_INVALID, OUTPUT_REFUSED, USAGE, UserError
from ..fsutil import OutputDir, atomic_path, check_names_free, check_output_dir, record_written
from .client import LOST_AFTER_S, RTOL, Watch, start_run

READ_TOPIC = "ucx-dask-gpu-read"
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


def write_dataset(directory: str | Path, fmt: str, files: int, rows: int, seed: int,
                  overwrite: bool = False) -> list[Path]:
    """Write the files (each atomically: a reader never sees half a file) into the user's directory, beside what is
    there: a name taken by a file an earlier run did not write (fsutil's manifest) is refused before anything is
    written (exit 9), unless `overwrite`. Returns their paths."""
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    directory = OutputDir(directory)
    directory.option = "PATH"
    names = [f"part-{index:05d}{FORMATS[fmt]}" for index in range(files)]
    check_output_dir(directory)
    if not overwrite:
        check_names_free(directory, names, overwrite_flag="--overwrite")
    paths = []
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        for index, name in enumerate(names):
            path = Path(directory) / name
            table = dataset_table(index, rows, seed)
            with atomic_path(path) as tmp:
                if fmt == "parquet":
                    pq.write_table(table, tmp, row_group_size=max(1, rows // 4))
                else:
                    feather.write_feather(table, tmp)
            paths.append(path)
        record_written(directory, names)
    except OSError as e:  # a full disk midway: generated data, nothing worth keeping; what this run wrote goes
        for path in paths:
            path.unlink(missing_ok=True)
        raise UserError(f"{directory}: cannot write {len(names)} files ({e.strerror or e}); this run's files "
                        "removed, nothing else touched", OUTPUT_REFUSED) from None
    return paths


def find_dataset(directory: str | Path, fmt: str) -> list[Path]:
    paths = sorted(Path(directory).glob(f"part-*{FORMATS[fmt]}"))
    if not paths:
        raise UserError(f"{directory}: no part-*{FORMATS[fmt]} files (run without --no-write to create them)",
                        DATA_INVALID)
    return paths


def read_table(path: str, fmt: str, columns: list[str] | None):
    """One Parquet/Feather file as a pyarrow table, only `columns` read (None: all)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path, columns=columns)
    import pyarrow.feather as feather

    return feather.read_table(path, columns=columns, memory_map=True)


class ArrowFileReader:
    """`dd.from_map` function: one Parquet/Feather file -> one pandas partition. dask pushes a column selection into
    from_map through its `columns=` keyword; each call logs the columns it really read as a Dask event (topic
    READ_TOPIC), so the client can show projection happened on the workers."""

    def __init__(self, fmt: str, run: str):
        self.fmt, self.run = fmt, run

    def __call__(self, path: str, columns=None):
        table = read_table(path, self.fmt, list(columns) if columns is not None else None)
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


def _wait_for_read_events(client, run: str, files: set[str], watch: Watch, timeout: float = 15.0) -> list[dict]:
    """Events of this run, once every file has one (workers send them in batches, a few ms late)."""
    deadline = time.monotonic() + timeout
    while True:
        events = [msg for _, msg in watch.call(client.get_events, READ_TOPIC)
                  if isinstance(msg, dict) and msg.get("run") == run]
        if {e["file"] for e in events} >= files or time.monotonic() > deadline:
            return events
        time.sleep(0.1)


def from_map_expected(paths: list[Path], fmt: str, columns: list[str]) -> dict[str, float | int]:
    """Column sums with pyarrow/pandas on the client, reading every file whole (no projection involved)."""
    import pandas as pd

    frame = pd.concat([read_table(str(p), fmt, None).to_pandas() for p in paths], ignore_index=True)
    return {c: frame[c].sum().item() for c in columns}


def prepare_dataset(directory: str | Path, fmt: str = "parquet", files: int = 8, rows: int = 50_000,
                    columns: list[str] | None = None, seed: int = 0, write: bool = True,
                    overwrite: bool = False) -> tuple[list[Path], list[str]]:
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
        paths = write_dataset(directory, fmt, files, rows, seed, overwrite)
    else:
        paths = find_dataset(directory, fmt)
    expected_columns = dataset_table(0, 1, seed).column_names
    try:
        on_disk = read_table(str(paths[0]), fmt, None).schema
    except Exception as e:  # pyarrow raises several types for a foreign or damaged file
        raise UserError(f"{paths[0]}: not a readable {fmt} file: {e}", DATA_INVALID) from None
    if on_disk.names != expected_columns:
        raise UserError(f"{paths[0]}: columns {on_disk.names}, expected {expected_columns}", DATA_INVALID)
    return paths, columns


def run_from_map(client, paths: list[Path], fmt: str = "parquet", columns: list[str] | None = None,
                 retries: int = 2, timeout: float = LOST_AFTER_S) -> dict:
    """Sum `columns` over the files with a dd.from_map reader; check the sums and that workers read only them.
    Every wait bounded as proof/client.py's Watch says (`timeout`: how long it waits without any worker)."""
    import dask.dataframe as dd

    columns = list(columns or ["a", "b"])
    template = dataset_table(0, 1, 0)
    all_columns = template.column_names
    watch, common = start_run(client, "from-map", ("pandas", "pyarrow.parquet", "pyarrow.feather", "dask.dataframe"),
                              timeout)
    run = uuid.uuid4().hex
    df = dd.from_map(ArrowFileReader(fmt, run), [str(p) for p in paths], meta=_meta(template), label=f"read-{fmt}",
                     enforce_metadata=False)
    query = df[columns].sum()
    projected = _find_projection(query)
    start = time.perf_counter()
    result = watch.result(watch.call(client.compute, query, retries=retries))
    wall = time.perf_counter() - start
    events = _wait_for_read_events(client, run, {p.name for p in paths}, watch)

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
        "query": f"df[{columns!r}].sum()", **common, "workers_end": watch.workers(),
        "requested_columns": columns, "projected_columns": projected,
        "columns_read": [list(c) for c in read_sets], "all_columns": all_columns,
        "reads": len(events), "files_read": len(files_read),
        "value": value, "expected": expected, "values_ok": values_ok, "projection_ok": projection_ok,
        "ok": values_ok and projection_ok, "wall_s": round(wall, 4),
    }
