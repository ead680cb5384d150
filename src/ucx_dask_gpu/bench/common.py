"""The runner every study shares (the model is dask-cuda's benchmarks/common.py): a Study (studies.py) handed to
`main` or `cli_run`. The command line is checked before anything starts (options.py); one cluster process per group
of variants that can share one starts, all at once (hosts.py, cluster.py); the variants take turns within --budget
(rounds.py), dask-cuda's local_cupy in chunks among their rounds (reference.py); each is checked on its cluster; the
report (render.py) carries every sample, bootstrap ratios against the baseline and the provenance (provenance.py).
dask is imported where a run needs it: `ucx-dask-gpu --help` and bad arguments need none of it.
"""
from __future__ import annotations

import shlex
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from ..cliutil import Progress, run_parsed
from ..errors import BENCH_FAILED, REFERENCE_FAILED, UserError
from ..report import command_line
from . import cluster, provenance, reference, render
from .hosts import Host
from .options import Options, build_parser, check_environment, group_variants, options, plan_text
from .rounds import Budget, Record, run_rounds
from .studies import Study

SCHEMA_VERSION = 2


def execute(opts: Options, command: str) -> dict:
    """Run everything; returns the report payload."""
    progress, budget = Progress(quiet=opts.quiet, timed=True), Budget(opts.budget)
    started = datetime.now(timezone.utc)
    prov = provenance.collect(command, opts.gpus if opts.mode != "cpu" else None)
    hosts: list[Host] = []
    with tempfile.TemporaryDirectory(prefix="ucx-dask-gpu-bench-") as tmpname:
        tmp = Path(tmpname)
        try:
            hosts += [Host(i, g, opts, tmp, progress) for i, g in enumerate(group_variants(opts))]
            peer = reference.peer_host(opts, len(hosts), tmp, progress)
            hosts += [peer] if peer else []
            progress(f"{opts.study.name}: {len(opts.variants)} variant(s) on {len(hosts)} cluster(s), budget "
                     f"{opts.budget:.0f} s")
            records, notes, refs = measure(opts, hosts, peer, tmp, budget, progress, prov)
        finally:  # also when interrupted: a cluster process lives in its own session, nothing else would stop it
            for h in hosts:
                if h.child.proc.poll() is None:
                    h.child.kill()
    payload = render.assemble(opts, records, hosts, refs, notes, prov)
    payload.update(schema_version=SCHEMA_VERSION, date=started.strftime("%Y-%m-%dT%H:%M:%SZ"),
                   duration_s=round(opts.budget - budget.left(), 1), command=command)
    return payload


def measure(opts: Options, hosts: list[Host], peer: Host | None, tmp: Path, budget: Budget, progress: Progress,
            prov: dict):
    for h in hosts:
        h.ready(min(opts.run_timeout, budget.left()))
    records = {v.name: Record(v, h, v.split(opts.client_keys)[1]) for h in hosts if h is not peer for v in h.variants}
    beside = reference.beside(opts, records, peer, tmp)
    notes = run_rounds(records, opts, budget, progress, beside)
    for rec in records.values():
        if rec.active:
            ans = rec.host.request({"op": "check", "overlay": rec.overlay, "seed": 1}, opts.run_timeout)
            rec.check = {k: v for k, v in ans.items() if k not in ("op", "traceback")}
    if opts.mode != "cpu":
        prov["clocks_after"] = provenance.gpu_facts(opts.gpus).get("gpus")
    for h in hosts:
        h.begin_close()
    deadline = time.monotonic() + max(20.0, min(90.0, budget.left()))
    for h in hosts:
        h.finish_close(deadline)
    return records, notes, [b.report() for b in beside]


def failures(payload: dict) -> tuple[int, str] | None:
    bad = [r for r in payload["runs"] if r["status"] == "error"]
    if bad:
        return BENCH_FAILED, f"{bad[0]['name']}: {bad[0]['error']}"
    bad = [r for r in payload["references"] if r.get("status") == "error"]
    if bad:
        return REFERENCE_FAILED, f"{bad[0]['kind']} local_cupy: {bad[0].get('error')}"
    return None


def run(study: Study, args, command: str) -> int:
    opts = options(study, args)
    if args.plan:
        print(plan_text(opts))
        return 0
    check_environment(opts)
    payload = execute(opts, command)
    print(render.text(payload), flush=True)
    if opts.out is not None:
        print("wrote " + ", ".join(map(str, render.write(payload, opts.out, opts.name, command))), flush=True)
    failed = failures(payload)
    if failed:
        where = f" (report: {Path(opts.out) / opts.name}.json)" if opts.out else ""
        raise UserError(failed[1] + where, failed[0])
    return 0


def main(study: Study, argv: list[str] | None = None) -> int:
    """`python -m ucx_dask_gpu.bench.<study> ...`; `--serve SPEC` is a cluster process (cluster.serve)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"] and len(argv) == 2:
        return cluster.serve(study, argv[1])
    args = build_parser(study).parse_args(argv)
    command = shlex.join(["python", "-m", study.module, *argv])
    args.func = lambda a: run(study, a, command)
    return run_parsed(args, study.module)


def cli_run(study: Study):
    """The `ucx-dask-gpu bench STUDY` handler."""
    return lambda args: run(study, args, command_line())
