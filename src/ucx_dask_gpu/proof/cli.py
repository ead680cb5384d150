"""`ucx-dask-gpu workload transpose|from-map`: run a client workload on a Dask cluster (`--scheduler ADDRESS`, or a
LocalCluster with `--protocol`) and check its answer against one computed on the client. A worker dying mid-run is
survived: inputs are generated or read by pure tasks (the scheduler recomputes lost results), `retries` covers tasks
that fail outright.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from ..cliutil import add_output
from ..errors import RESULT_KEPT, USAGE, VERDICT_FAILED, UserError
from ..fsutil import keep_result, mapped_library, write_output_file
from ..gate.peer import parse_address
from .client import connect
from .from_map import FORMATS, NUMERIC_COLUMNS, prepare_dataset, run_from_map
from .transpose import check_transpose_args, run_transpose


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
    """Send everything else written to fd 1 to stderr; return a file on the real stdout for the result. UCX logs to
    stdout from C (e.g. its UCX_MEMTYPE_CACHE warning), in this process and in LocalCluster workers started from it;
    without this, `--json > result.json` would not be JSON over UCX."""
    sys.stdout.flush()
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return results


# The client's own chatter on expected failures, silenced unless --debug: UCX's warnings (e.g. about UCXX's
# UCX_MEMTYPE_CACHE) and UCXX's error lines when a peer goes away or never answers; every failure still ends in our
# one line. Both libraries read these when they load, so only the environment can set them: UCX's only while libucs
# is not loaded yet (a venv's start-up preload of its UCX loads it before any command runs).
QUIET_UCX = {"UCX_LOG_LEVEL": "error"}
QUIET_UCXX = {"UCXX_LOG_LEVEL": "FATAL"}


def _debugging(args) -> bool:
    """--debug, or dask's own switch for it (DASK_LOGGING__DISTRIBUTED=debug)."""
    return bool(args.debug) or os.environ.get("DASK_LOGGING__DISTRIBUTED", "").lower() == "debug"


def _quiet_client(debug: bool) -> None:
    """Keep stderr to progress and the one line: distributed's INFO and WARNING lines (preloads, connections, tasks
    cancelled on close) and UCX/UCXX chatter are for --debug. Set before dask and UCX are imported (LocalCluster
    workers inherit the environment)."""
    if debug:
        os.environ["DASK_LOGGING__DISTRIBUTED"] = "debug"
        return
    quiet = dict(QUIET_UCXX)
    if mapped_library("libucs.so") is None:
        quiet.update(QUIET_UCX)
    for k, v in quiet.items():
        os.environ.setdefault(k, v)
    # distributed's WARNINGs on a run that succeeds (a task's CancelledError while the cluster closes, a slow event
    # loop on a busy host) say nothing the result does not; a failure still ends in our one line.
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")


def check_wait_args(args) -> None:
    """Every wait has a bound: refused before anything starts (USAGE)."""
    if args.scheduler is not None:
        parse_address(args.scheduler)  # a typo (or an empty value) ends here, before anything starts
    if args.min_workers < 1:
        raise UserError(f"--min-workers must be at least 1 (got {args.min_workers}): a workload needs a worker to run "
                        "on", USAGE)
    if not (0 < args.timeout < math.inf and 0 <= args.wait_workers < math.inf):
        raise UserError(f"--timeout must be a positive number of seconds and --wait-workers a number not below 0 (got "
                        f"{args.timeout:g}, {args.wait_workers:g})", USAGE)
    if args.scheduler is None and (args.n_workers < 1 or args.threads_per_worker < 1):
        raise UserError(f"--n-workers and --threads-per-worker must be at least 1 (got {args.n_workers}, "
                        f"{args.threads_per_worker})", USAGE)


def _run(args, body) -> int:
    _quiet_client(_debugging(args))
    results = _reserve_stdout_for_results()
    with connect(args.scheduler, args.protocol, args.n_workers, args.threads_per_worker, args.timeout,
                 args.min_workers, args.wait_workers) as client:
        result = body(client)
    document = json.dumps(result, indent=2) + "\n"
    try:
        results.write(document if args.json else _summary(result) + "\n")
        results.flush()
    except BrokenPipeError:
        raise
    except OSError as e:  # stdout on a full disk or a device that takes nothing (> /dev/full): keep the answer
        os.dup2(os.open(os.devnull, os.O_WRONLY), results.fileno())  # its buffered copy must not fail again at exit
        if args.output:  # where it was asked for too: there it is kept (or that write's own line says where)
            write_output_file(args.output, document, stdout=sys.stderr)
            where = f"in {args.output}"
        else:
            where = keep_result({"workload-result.json": document.encode()}, None, "workload-result", sys.stderr)
        raise UserError(f"the result could not be written to stdout ({e.strerror}); it is kept {where}",
                        RESULT_KEPT) from None
    if args.output:  # after the answer is out: a failed write keeps the JSON and says where (exit 18)
        write_output_file(args.output, json.dumps(result, indent=2) + "\n", stdout=results)
    return 0 if result["ok"] else VERDICT_FAILED


def _cmd_transpose(args) -> int:
    check_transpose_args(args.size, args.chunk, args.backend)
    check_wait_args(args)
    return _run(args, lambda c: run_transpose(c, args.size, args.chunk, args.seed, args.backend, args.retries,
                                              args.timeout))


def _cmd_from_map(args) -> int:
    check_wait_args(args)
    paths, columns = prepare_dataset(args.path, args.format, args.files, args.rows,
                                     [c for c in args.columns.split(",") if c], args.seed, not args.no_write,
                                     args.overwrite)
    return _run(args, lambda c: run_from_map(c, paths, args.format, columns, args.retries, args.timeout))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scheduler", metavar="ADDRESS", help="scheduler to use, e.g. ucx://10.0.0.1:8786 (default: "
                                                          "start a LocalCluster)")
    p.add_argument("--protocol", default="tcp", choices=["tcp", "ucx", "ucxx"],
                   help="LocalCluster protocol when no --scheduler (default tcp)")
    p.add_argument("--n-workers", type=int, default=2, help="LocalCluster workers (default 2)")
    p.add_argument("--threads-per-worker", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30,
                   help="seconds to wait for the scheduler's answer (what answers instead, or silence, ends the run "
                        "within this time), and, mid-run, for a worker to join when none is left: then 'all workers "
                        "lost' (exit 27); a lost scheduler ends the run at once (exit 28) (default 30)")
    p.add_argument("--min-workers", type=int, default=1,
                   help="workers to wait for before starting, at least 1 (default 1)")
    p.add_argument("--wait-workers", type=float, default=60, metavar="SECONDS",
                   help="give up when fewer than --min-workers workers joined by then (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--retries", type=int, default=2, help="retries per failing task (default 2)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--debug", action="store_true",
                   help="keep distributed's INFO/DEBUG log and UCX/UCXX's own lines on stderr (also: "
                        "DASK_LOGGING__DISTRIBUTED=debug)")
    add_output(p, "--output", metavar="FILE", help="also write the JSON result to FILE")


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
    f.add_argument("path", help="directory shared with the workers: part-NNNNN files are written there (unless "
                                "--no-write) beside what else it holds; a name taken by a file no earlier run wrote "
                                "is refused (exit 9)")
    f.add_argument("--format", choices=sorted(FORMATS), default="parquet")
    f.add_argument("--files", type=int, default=8, help="files to write, one partition each (default 8)")
    f.add_argument("--rows", type=int, default=50_000, help="rows per file (default 50000)")
    f.add_argument("--columns", default="a,b", help=f"columns to sum, among {','.join(NUMERIC_COLUMNS)} (default a,b)")
    f.add_argument("--no-write", action="store_true", help="read the files already in PATH")
    f.add_argument("--overwrite", action="store_true", help="replace part-NNNNN files in PATH that no earlier run wrote")
    _common(f)
    f.set_defaults(func=_cmd_from_map)
