"""`python -m tools.conda_standin channel|test-install`: the stand-in channel of a host without conda channels.

From the repository root (`make channel` runs it). Bad input ends as the product's commands do: one line on stderr,
the exit code of ucx_dask_gpu.errors.
"""
from __future__ import annotations

import json
from pathlib import Path

from ucx_dask_gpu.cliutil import WORK_DIR_HELP, Parser, add_output, run_parsed
from ucx_dask_gpu.conda.variants import MODES
from ucx_dask_gpu.fsutil import write_output_file
from ucx_dask_gpu.stack import load

from .channel import build_channel, install_test

PROG = "python -m tools.conda_standin"


def _cmd_channel(args) -> int:
    st = load(args.stack)
    res = build_channel(st, out=Path(args.out),
                        recipes_dir=Path(args.recipes).resolve() if args.recipes else None,
                        mirror=[Path(args.sources)] if args.sources else None,
                        work=Path(args.work) if args.work else None, run_install_test=not args.no_install_test,
                        mode=args.variants)
    print(f"stand-in channel {res.channel} (variants: {res.variants}; never published):")
    for p in res.packages:
        print(f"  {p.relative_to(res.channel)}  {p.stat().st_size / 1e6:.2f} MB")
    if res.rendered_only:
        print(f"  rendered + checked, not built here: {', '.join(res.rendered_only)}")
    if res.install:
        _print_install(res.install)
    print("  seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in res.seconds.items()))
    return 0


def _print_install(res: dict) -> None:
    print(f"  install check ({', '.join(res['virtual_packages'])}):")
    for fn, r in res["packages"].items():
        print(f"    {fn}: installed in {r['prefix']}, recipe tests passed")
    env = res.get("environment")
    if env:
        print(f"    `{' '.join(env['specs'])}` -> {env['prefix']}: {env['ucx_info']} ({env['ucx_info_path']}); "
              f"ucxx maps {env['libucp']}; stack id {env['stack_id']}")
    print("    stood in (conda-forge/rapidsai, not reachable here): " +
          ", ".join(f"{n} {p['version']}" for n, p in sorted(res["placeholders"].items())))


def _cmd_test_install(args) -> int:
    st = load(args.stack)
    work = Path(args.work) if args.work else st.root / "build" / "conda-install-test"
    res = install_test(st, Path(args.channel), work=work, cuda=args.cuda or f"{st.cuda_major}.0", glibc=args.glibc)
    if args.json:
        write_output_file(args.json, json.dumps(res, indent=2, sort_keys=True) + "\n", what="the results")
    _print_install(res)
    return 0


def build_parser() -> Parser:
    p = Parser(prog=PROG, description="conda packages built with stand-ins where no conda channel is reachable; "
                                      "they prove the recipes build and are never published (docs/conda.md)")
    p.add_argument("--stack", help="stack.toml to read (default: the repository's)")
    s = p.add_subparsers(dest="command", metavar="ACTION", required=True, parser_class=Parser)
    c = s.add_parser("channel", help="build the stand-in channel: check, build, index, install + test")
    c.add_argument("--recipes", help="recipes directory (default: <repo>/recipes)")
    c.add_argument("--variants", choices=MODES, default="auto",
                   help="variant config: conda-forge, fallback, auto (as `ucx-dask-gpu conda lint`)")
    add_output(c, "--out", kind="dir", required=True, help="channel directory to create",
               note="new or empty, or a channel this command made before, which is replaced whole once everything "
                    "passed; any other directory, a file, or build/channel (where uploads read) is refused (exit 9)")
    c.add_argument("--sources", help="a source mirror directory searched first for the recipes' sources (then "
                                     "$UCX_DASK_GPU_SOURCE_MIRROR and stack.toml [sources].mirror_dirs)")
    add_output(c, "--work", kind="dir", help="work directory for builds and logs (default: <repo>/build/conda-work)",
               note=WORK_DIR_HELP)
    c.add_argument("--no-install-test", action="store_true", help="skip the install test")
    c.set_defaults(func=_cmd_channel)
    t = s.add_parser("test-install", help="install the channel's packages into fresh prefixes and run their tests")
    t.add_argument("--channel", required=True)
    t.add_argument("--cuda", help="__cuda and cuda-version to install for (default: <stack cuda_major>.0)")
    t.add_argument("--glibc", help="__glibc virtual package version to declare (default: this machine's)")
    add_output(t, "--work", kind="dir", help="scratch directory (default: <repo>/build/conda-install-test)",
               note=WORK_DIR_HELP)
    add_output(t, "--json", metavar="FILE", help="write the detailed results to this file")
    t.set_defaults(func=_cmd_test_install)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_parsed(args, f"{PROG} {args.command}")
