"""`python -m tools.repro_check [options]`: two builds from two clones of this checkout (or this checkout's own and one
clone), compared (check.py); exit 30 (NOT_REPRODUCIBLE) naming the first differing file when they differ.

From the repository root, with the project's venv. Bad input ends as the product's commands do: one line on stderr,
the exit code of ucx_dask_gpu.errors.
"""
from __future__ import annotations

import json
from pathlib import Path

from ucx_dask_gpu.cliutil import Parser, add_output, run_parsed
from ucx_dask_gpu.errors import NOT_REPRODUCIBLE, UserError
from ucx_dask_gpu.fsutil import write_output_file
from ucx_dask_gpu.stack import load

from . import check

PROG = "python -m tools.repro_check"


def _cmd_check(args) -> int:
    r = check.run_check(
        load(args.stack_file), against_checkout=args.against_checkout, first_image=args.first,
        clone_dirs=[Path(d) for d in args.clone_dir], revision=args.revision, image=not args.no_image,
        fresh_bases=args.fresh_bases, require=args.require, sources=[Path(d).resolve() for d in args.sources],
        find_links=[Path(d).resolve() for d in args.find_links], keep=args.keep,
        lock=Path(args.docker_lock) if args.docker_lock else None, limit=args.limit)
    print(check.render(r))
    if args.json:
        write_output_file(args.json, json.dumps(r, indent=2, sort_keys=True) + "\n", what="the report")
    if not r["identical"]:
        raise UserError(f"not reproducible: {check.first_difference_line(r)} (kept: {r['work_dir']})",
                        NOT_REPRODUCIBLE)
    return 0


def build_parser() -> Parser:
    k = Parser(prog=PROG, description="two builds from two clones at different paths, under another umask, locale "
                                      "and time zone, nothing cached: the same UCX prefix, UCXX wheels and image id? "
                                      "The workshop's check (tools/README.md)")
    k.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    k.add_argument("--against-checkout", action="store_true",
                   help="the first build is this checkout's own (make ucx ucxx: $UCX_PREFIX, $UCXX_WHEELS; its "
                        "image): one clone, half the time (what CI runs)")
    k.add_argument("--first", metavar="IMAGE", help="with --against-checkout: this checkout's image (default: "
                                                     "[image].name:[stack].version)")
    add_output(k, "--clone-dir", kind="dir", action="append", default=[], metavar="DIR",
               help="where a clone goes, kept afterwards (repeatable; default: two depths under a new temporary "
                    "directory, removed when the builds agree)",
               note="a new or empty directory: one holding anything is refused (exit 9), nothing in it touched")
    k.add_argument("--revision", default="HEAD", help="the commit the clones build (default: HEAD)")
    k.add_argument("--no-image", action="store_true", help="the UCX prefix and the UCXX wheels only")
    k.add_argument("--fresh-bases", action="store_true",
                   help="bootstrap the Debian bases again before each image build (their tags move to the new "
                        "ones: other checkouts' next image build is cold)")
    k.add_argument("--require", default="ib,cuda", help="capabilities the UCX builds require (as make ucx)")
    k.add_argument("--sources", action="append", default=[], metavar="DIR",
                   help="a source mirror for the clones (this checkout's source cache and mirrors are added)")
    k.add_argument("--find-links", action="append", default=[], metavar="DIR",
                   help="wheels for the UCXX build venv (this checkout's .cache/wheels is added)")
    k.add_argument("--docker-lock", metavar="FILE",
                   help="hold an flock on FILE around each image build and removal (an engine shared with others)")
    k.add_argument("--keep", action="store_true", help="keep the clones and their images also when the builds agree")
    k.add_argument("--limit", type=int, default=10, help="image differences listed per layer and kind")
    add_output(k, "--json", metavar="FILE", help="also write the report as JSON")
    k.set_defaults(func=_cmd_check)
    return k


def main(argv: list[str] | None = None) -> int:
    return run_parsed(build_parser().parse_args(argv), PROG)
