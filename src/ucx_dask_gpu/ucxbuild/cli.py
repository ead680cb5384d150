"""`ucx-dask-gpu ucx fetch|build|ucxx|install-ucxx|verify|prefix-map` (also `python3 -m ucx_dask_gpu.ucxbuild ...`,
which ucx-src-build/build.sh uses: it needs nothing outside the standard library). Stable interface: recipes, the
Dockerfile and hosts call it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cliutil import WORK_DIR_HELP, Parser, add_output, number_type, run_parsed
from ..errors import USAGE, VERDICT_FAILED, UserError
from ..stack import load
from ..ucx.install import BUILD_INFO
from .build import BuildOptions, build, parse_require
from .fetch import default_cache_dir, fetch_all, local_dirs, say
from .repro import PathMap, stand_in
from .ucxx import UcxxOptions, build_ucxx, install_ucxx
from .verify import verify_prefix


JOBS = number_type(int, 1, "a number of parallel jobs")
STAMP_HELP = ("write the build's input key to FILE, only when it changed (a make prerequisite whose time changes "
              "exactly when the output does)")


def _cmd_fetch(args) -> int:
    st = load(args.stack_file)
    dest = Path(args.dest).resolve() if args.dest else default_cache_dir(st).resolve()
    sources = st.source_archives() if args.all else (st.ucx,)
    m = fetch_all(st, dest, dirs=local_dirs(st, [Path(p) for p in args.sources]), offline=args.offline,
                  cuda=not args.no_cuda, sources=sources)
    say(f"{dest}: {len(m.get('files', {}))} verified files, manifest {dest / 'manifest.json'}")
    for src in sources:
        print(dest / src.archive)
    return 0


def _cmd_build(args) -> int:
    st = load(args.stack_file)
    opts = BuildOptions(
        prefix=Path(args.prefix),
        work_dir=Path(args.work_dir) if args.work_dir else None,
        cache=Path(args.cache) if args.cache else None,
        sources=local_dirs(st, [Path(p) for p in args.sources]),
        offline=args.offline,
        cuda=args.cuda,
        cuda_link_dir=Path(args.cuda_link_dir).resolve() if args.cuda_link_dir else None,
        gdrcopy=Path(args.gdrcopy).resolve() if args.gdrcopy else None,
        jobs=args.jobs,
        require=parse_require(args.require),
        keep_debug=args.keep_debug,
        stamp=Path(args.stamp) if args.stamp else None,
    )
    build(st, opts)
    return 0


def _cmd_ucxx(args) -> int:
    st = load(args.stack_file)
    build_ucxx(st, UcxxOptions(
        ucx_prefix=Path(args.ucx_prefix),
        out=Path(args.out),
        work_dir=Path(args.work_dir) if args.work_dir else None,
        cache=Path(args.cache) if args.cache else None,
        sources=local_dirs(st, [Path(p) for p in args.sources]),
        find_links=[Path(p) for p in args.find_links],
        offline=args.offline,
        jobs=args.jobs,
        stamp=Path(args.stamp) if args.stamp else None,
    ))
    return 0


def _cmd_install_ucxx(args) -> int:
    pth = install_ucxx(Path(args.python), Path(args.wheels), Path(args.ucx_prefix))
    print(f"{args.python}: UCXX wheels from {args.wheels} installed; our UCX preloaded by {pth}")
    return 0


def _cmd_verify(args) -> int:
    st = load(args.stack_file)
    modules = tuple(m for m in args.modules.split(",") if m) if args.modules is not None else None
    checks = verify_prefix(Path(args.prefix), st, modules=modules, perftest=not args.no_perftest,
                           keep_ld_library_path=args.keep_ld_library_path)
    if args.json:
        print(json.dumps({"prefix": str(Path(args.prefix).resolve()), "ok": all(c.ok for c in checks),
                          "checks": [c.__dict__ for c in checks]}, indent=2))
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            print(f"{'PASS' if c.ok else 'FAIL'}  {c.name.ljust(width)}  {c.detail}")
    failed = [c.name for c in checks if not c.ok]
    if failed:
        print(f"ucx verify: {len(failed)} check(s) failed: {', '.join(failed)}", file=sys.stderr)
        return VERDICT_FAILED
    return 0


def _cmd_prefix_map(args) -> int:
    """The compile flags every build of ours uses to keep its directories out of its output, for build scripts that
    run their own compilers (the conda recipes): `eval "$(build.sh prefix-map --map "$SRC_DIR=ucx")"`."""
    st = load(args.stack_file)
    mapping = {}
    for item in args.map:
        real, sep, name = item.partition("=")
        if not sep or not real or not name:
            raise UserError(f"--map {item!r}: expected DIR=NAME", USAGE)
        mapping[real] = name if name.startswith("/") else stand_in(st, name)
    print(PathMap.of(mapping).shell_exports(), end="")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    add_actions(sub.add_parser("ucx", help="fetch, build and verify UCX from pinned, verified source"))


def add_actions(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stack-file", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="ucx_command", metavar="ACTION", parser_class=type(p))
    s.required = True
    for add in (_add_fetch, _add_build, _add_ucxx, _add_install_ucxx, _add_verify, _add_prefix_map):
        add(s)


def _add_sources(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sources", action="append", default=[], metavar="DIR",
                   help="a source mirror: look for inputs in DIR after their URLs (repeatable; then "
                        "$UCX_DASK_GPU_SOURCE_MIRROR and stack.toml [sources].mirror_dirs)")


def _add_work_dir(p: argparse.ArgumentParser) -> None:
    add_output(p, "--work-dir", kind="dir", help="build directory, kept for inspection (default: a temp dir, removed "
                                                 "on success)", note=WORK_DIR_HELP)


def _add_fetch(s) -> None:
    f = s.add_parser("fetch", help="download + verify the UCX archive (--all: every pinned source archive), CUDA "
                                   "header wheels and link .debs into DIR")
    add_output(f, "--dest", kind="dir", help="directory to fill, also reused as a cache (default: the download cache, "
                                             "$UCX_DASK_GPU_CACHE or <repo>/.cache/sources, where `build` and `ucxx` "
                                             "look)")
    f.add_argument("--all", action="store_true",
                   help="every pinned source archive (UCX, UCXX, rapids-cmake, CPM.cmake), not only UCX's: all "
                        "missing ones are named in one line")
    _add_sources(f)
    f.add_argument("--offline", action="store_true", help="no network: only source mirrors and DIR itself")
    f.add_argument("--no-cuda", action="store_true", help="skip the CUDA wheels/.debs (builder has a toolkit)")
    f.set_defaults(func=_cmd_fetch)


def _add_build(s) -> None:
    b = s.add_parser("build", help="build UCX into a relocatable prefix")
    add_output(b, "--prefix", kind="dir", required=True,
               help="install prefix (new, an earlier build of ours, or a conda $PREFIX)",
               note="a directory, created when missing; an earlier build of ours (it has "
                    f"{BUILD_INFO}) is replaced whole, into any other the files are merged; a file there is refused "
                    "(exit 9)")
    _add_work_dir(b)
    b.add_argument("--cache", help="verified download cache (default: $UCX_DASK_GPU_CACHE or <repo>/.cache/sources)")
    _add_sources(b)
    b.add_argument("--offline", action="store_true", help="no network: source mirrors and the cache only")
    b.add_argument("--cuda", default="auto", metavar="auto|none|DIR",
                   help="CUDA toolkit / conda prefix; auto: $CUDA_HOME or /usr/local/cuda if complete, else the "
                        "pinned wheels + .debs")
    b.add_argument("--cuda-link-dir", metavar="DIR", help="directory with libcuda.so and libnvidia-ml.so to link with")
    b.add_argument("--gdrcopy", metavar="DIR", help="gdrcopy install prefix (adds --with-gdrcopy=DIR)")
    b.add_argument("--jobs", "-j", type=JOBS, default=0, help="parallel make jobs (default: CPUs + 1)")
    b.add_argument("--require", metavar="CAPS", help="comma list of ib,cuda,gdrcopy that must be built, else fail")
    b.add_argument("--keep-debug", action="store_true", help="do not strip debug info")
    add_output(b, "--stamp", metavar="FILE", help=STAMP_HELP)
    b.set_defaults(func=_cmd_build)


def _add_ucxx(s) -> None:
    x = s.add_parser("ucxx", help="build the UCXX wheels (libucxx, ucxx, distributed-ucxx) against a UCX prefix")
    x.add_argument("--ucx-prefix", required=True, help="a UCX prefix built by `build` (its version must be stack.toml's)")
    add_output(x, "--out", kind="dir", required=True, help="directory to receive the wheels + ucxx-build-info.json",
               note="new or empty, or the output of an earlier run (only its build info and wheels), which is "
                    "replaced whole; any other directory, or a file, is refused (exit 9)")
    _add_work_dir(x)
    x.add_argument("--cache", help="verified download cache (default: $UCX_DASK_GPU_CACHE or <repo>/.cache/sources); "
                                   "finished builds are kept beside it by input hash")
    _add_sources(x)
    x.add_argument("--find-links", action="append", default=[], metavar="DIR",
                   help="wheels for the build venv (its lock's); with --offline the only place they come from")
    x.add_argument("--offline", action="store_true", help="no network for fetching either")
    x.add_argument("--jobs", "-j", type=JOBS, default=0, help="parallel compile jobs (default: CPUs + 1)")
    add_output(x, "--stamp", metavar="FILE", help=STAMP_HELP)
    x.set_defaults(func=_cmd_ucxx)


def _add_install_ucxx(s) -> None:
    u = s.add_parser("install-ucxx", help="put a venv on our stack: the UCXX wheels (--no-deps) and a start-up "
                                           "preload of our UCX (no LD_LIBRARY_PATH)")
    u.add_argument("--python", required=True, help="the venv's python")
    u.add_argument("--wheels", required=True, help="the output directory of `ucxx`")
    u.add_argument("--ucx-prefix", required=True, help="the UCX prefix those wheels were built against")
    u.set_defaults(func=_cmd_install_ucxx)


def _add_verify(s) -> None:
    v = s.add_parser("verify", help="check a prefix: modules, ucx_info, host-memory ucx_perftest loopback")
    v.add_argument("--prefix", required=True)
    v.add_argument("--modules", help="comma list of lib/ucx modules that must exist (default: stack.toml's list)")
    v.add_argument("--no-perftest", action="store_true", help="skip the ucx_perftest loopback")
    v.add_argument("--keep-ld-library-path", action="store_true",
                   help="keep LD_LIBRARY_PATH (default: removed, to prove the prefix finds its own libraries)")
    v.add_argument("--json", action="store_true")
    v.set_defaults(func=_cmd_verify)


def _add_prefix_map(s) -> None:
    m = s.add_parser("prefix-map", help="print `export CFLAGS=... CXXFLAGS=... NVCCFLAGS=... CUDAFLAGS=...` with the "
                                        "-ffile-prefix-map flags our builds use (for build scripts of their own)")
    m.add_argument("--map", action="append", default=[], metavar="DIR=NAME", required=True,
                   help="a build directory and its stand-in: NAME under stack.toml [stack].build_root, or an "
                        "absolute path (repeatable)")
    m.set_defaults(func=_cmd_prefix_map)


def main(argv: list[str] | None = None) -> int:
    """Entry point that needs only this subpackage (no other command modules are imported)."""
    parser = Parser(prog="ucx-src-build", description="Fetch, build and verify UCX from pinned, verified source.")
    add_actions(parser)
    args = parser.parse_args(argv)
    return run_parsed(args, f"ucx-src-build {args.ucx_command}")
