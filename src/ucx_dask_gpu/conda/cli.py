"""`ucx-dask-gpu conda regen|render|lint|channel|test-install`: the conda recipes and the local channel.

The channel module imports PyYAML when it is loaded, and every `ucx-dask-gpu` command must start with the standard
library alone (a fresh machine runs `stack get` before any package is installed): so `channel` and `test-install`
load it when they run, the only imports of our own modules inside functions in the package.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cliutil import WORK_DIR_HELP, add_output
from ..errors import RECIPE_INVALID, UserError
from ..fsutil import write_output_file
from ..stack import load
from . import settings
from .recipes import check_all


def _recipes(args, st) -> Path:
    return (Path(args.recipes) if args.recipes else st.root / "recipes").resolve()


def _cmd_regen(args) -> int:
    st = load(args.stack)
    if args.check:
        stale = settings.drift(st, _recipes(args, st))
        if stale:
            raise UserError(f"{stale[0]} is out of date with stack.toml; run `make regen`"
                            + (f" ({len(stale)} files)" if len(stale) > 1 else ""), RECIPE_INVALID)
        print("recipes: generated lines up to date with stack.toml")
        return 0
    for path in settings.regen(st, _recipes(args, st)):
        print(f"wrote {path}")
    return 0


def _cmd_render(args) -> int:
    st = load(args.stack)
    problems, variants = check_all(st, _recipes(args, st))
    if not variants and problems:
        raise UserError(problems[0], RECIPE_INVALID)
    for v in variants:
        if args.recipe and v.recipe_path.parent.name != args.recipe:
            continue
        print(f"# --- {v.recipe_path.parent.name}: {v.subdir}/{v.dist} variant {json.dumps(v.variant, sort_keys=True)}")
        print(json.dumps(v.stage1, indent=1, sort_keys=False))
    return 0


def _cmd_lint(args) -> int:
    st = load(args.stack)
    problems, variants = check_all(st, _recipes(args, st))
    for p in problems:
        print(p)
    if problems:
        raise UserError(f"{len(problems)} recipe problem(s), the first: {problems[0]}", RECIPE_INVALID)
    print(f"recipes ok against {st.path.name}: {len(variants)} outputs rendered by rattler-build "
          f"({', '.join(sorted({f'{v.subdir}/{v.dist}' for v in variants}))})")
    return 0


def _cmd_channel(args) -> int:
    from .channel import build_channel  # PyYAML at load: see the module docstring

    st = load(args.stack)
    res = build_channel(st, out=Path(args.out), recipes_dir=_recipes(args, st),
                        mirror=[Path(args.sources)] if args.sources else None,
                        work=Path(args.work) if args.work else None, run_install_test=not args.no_install_test)
    print(f"channel {res.channel}:")
    for p in res.packages:
        print(f"  {p.relative_to(res.channel)}  {p.stat().st_size / 1e6:.2f} MB")
    if res.rendered_only:
        print(f"  rendered + checked, not built here: {', '.join(res.rendered_only)}")
    if res.install:
        print(f"  install test ({', '.join(res.install['virtual_packages'])}): "
              f"{', '.join(res.install['packages'])} ok")
    return 0


def _cmd_test_install(args) -> int:
    from .channel import install_test  # PyYAML at load: see the module docstring

    st = load(args.stack)
    work = Path(args.work) if args.work else st.root / "build" / "conda-install-test"
    res = install_test(Path(args.channel), work=work, cuda=args.cuda or f"{st.cuda_major}.0", glibc=args.glibc)
    if args.json:
        write_output_file(args.json, json.dumps(res, indent=2, sort_keys=True) + "\n", what="the results")
    for fn, r in res["packages"].items():
        where = f"installed in {r['prefix']}" if "prefix" in r else "checked (conda-forge dependencies not here)"
        print(f"{fn}: {where}, recipe tests passed")
    print(f"virtual packages: {', '.join(res['virtual_packages'])}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conda", help="conda recipes (regen, render, lint) and the local channel (build, install test)")
    p.add_argument("--stack", help="stack.toml to read (default: the repository's)")
    p.add_argument("--recipes", help="recipes directory (default: <repo>/recipes)")
    s = p.add_subparsers(dest="conda_command", metavar="ACTION", required=True)
    g = s.add_parser("regen", help="write the recipes' generated lines from stack.toml (make regen)")
    g.add_argument("--check", action="store_true", help="fail (exit 60) if they are out of date, write nothing")
    g.set_defaults(func=_cmd_regen)
    r = s.add_parser("render", help="print every output rattler-build renders, every variant and platform")
    r.add_argument("--recipe", help="only this recipe (directory name)")
    r.set_defaults(func=_cmd_render)
    s.add_parser("lint", help="render with rattler-build, lint, check against stack.toml").set_defaults(func=_cmd_lint)
    c = s.add_parser("channel", help="build the local channel: check, build, index, install + test")
    add_output(c, "--out", kind="dir", required=True, help="channel directory to create",
               note="new or empty, or a channel this command made before, which is replaced whole once everything "
                    "passed; any other directory, or a file, is refused (exit 9)")
    c.add_argument("--sources", help="a source mirror directory searched first for the recipes' url sources (then "
                                     "$UCX_DASK_GPU_SOURCE_MIRROR and stack.toml [sources].mirror_dirs)")
    add_output(c, "--work", kind="dir", help="work directory for builds and logs (default: <repo>/build/conda-work)",
               note=WORK_DIR_HELP)
    c.add_argument("--no-install-test", action="store_true", help="skip the install test before publishing")
    c.set_defaults(func=_cmd_channel)
    t = s.add_parser("test-install", help="install the channel's packages into fresh prefixes and run their tests")
    t.add_argument("--channel", required=True)
    t.add_argument("--cuda", help="__cuda virtual package version to declare (default: <stack cuda_major>.0)")
    t.add_argument("--glibc", help="__glibc virtual package version to declare (default: this machine's)")
    add_output(t, "--work", kind="dir", help="scratch directory (default: <repo>/build/conda-install-test)",
               note=WORK_DIR_HELP)
    add_output(t, "--json", metavar="FILE", help="write the detailed results to this file")
    t.set_defaults(func=_cmd_test_install)
