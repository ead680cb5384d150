"""`ucx-dask-gpu bench transpose|svd|transfer|idle|render`: one subcommand per study (each also runs alone as
`python -m ucx_dask_gpu.bench.<study>`, which a bare GPU host can run without the CLI's other commands)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import BENCH_CONFIG, UserError
from . import common, idle, options, render, svd, transfer, transpose

STUDIES = (transpose.STUDY, svd.STUDY, transfer.STUDY)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: transpose, svd, one transfer; variants interleaved, bootstrap "
                                     "ratios, dask-cuda's local_cupy beside them",
                       description="Dask over UCX vs TCP on dask-cuda workers (dask workers with --cpu): each "
                                   "study's variants take turns within one run; see docs/benchmarks.md.")
    s = p.add_subparsers(dest="bench_study", metavar="STUDY", required=True)
    for study in STUDIES:
        sp = s.add_parser(study.name, help=study.help, description=study.help,
                          epilog=options.build_parser(study).epilog, formatter_class=argparse.RawTextHelpFormatter)
        options.add_arguments(sp, study)
        sp.set_defaults(func=common.cli_run(study))
    idle.register(s)
    r = s.add_parser("render", help="draw NAME.md and NAME.png again from NAME.json (e.g. where matplotlib is)")
    r.add_argument("json", help="a NAME.json written by a study")
    r.set_defaults(func=_render)


def _render(args) -> int:
    path = Path(args.json)
    try:
        payload = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not a readable benchmark result: {e}", BENCH_CONFIG) from None
    if not isinstance(payload, dict) or payload.get("schema_version") != common.SCHEMA_VERSION:
        raise UserError(f"{path}: not a bench result of schema {common.SCHEMA_VERSION}", BENCH_CONFIG)
    payload["notes"] = [n for n in payload.get("notes", []) if not n.startswith("no PNG")]  # drawn now, if it can be
    print("wrote " + ", ".join(str(p) for p in render.write(payload, path.parent, path.stem, None)))
    return 0
