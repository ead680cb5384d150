"""`ucx-dask-gpu conda render|lint|channel|test-install`: the conda recipes and the local channel.

The recipe renderer imports Jinja2 and PyYAML when it is loaded, and every `ucx-dask-gpu` command must start with
the standard library alone (a fresh machine runs `stack get` before any package is installed): so each command here
loads the module it runs, and only this module of the package imports its own modules inside functions.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import RECIPE_INVALID, UserError
from ..fsutil import atomic_write_text
from ..stack import load


def _stack(args):
    return load(args.stack)


def _recipes(args, st) -> Path:
    return Path(args.recipes) if args.recipes else st.root / "recipes"


def _cmd_render(args) -> int:
    from .lint import lint_all

    st = _stack(args)
    problems, rendered = lint_all(st, _recipes(args, st))
    shown = [r for r in rendered if not args.recipe or r.recipe_dir.name == args.recipe]
    if not rendered and problems:
        raise UserError(problems[0], RECIPE_INVALID)
    for r in shown:
        print(f"# --- {r.recipe_dir.name}: {r.dist} ({r.subdir}) variant {json.dumps(r.variant, sort_keys=True)}")
        print(r.text.strip("\n"))
    return 0


def _cmd_lint(args) -> int:
    from .lint import lint_all

    st = _stack(args)
    problems, rendered = lint_all(st, _recipes(args, st))
    for p in problems:
        print(p)
    if problems:
        raise UserError(f"{len(problems)} recipe problem(s) (listed above)", RECIPE_INVALID)
    print(f"recipes ok against {st.path.name}: {', '.join(r.dist for r in rendered)}")
    return 0


def _cmd_channel(args) -> int:
    from .channel import build_channel

    st = _stack(args)
    res = build_channel(st, out=Path(args.out), recipes_dir=Path(args.recipes) if args.recipes else None,
                        sources=Path(args.sources) if args.sources else None,
                        work=Path(args.work) if args.work else None, run_install_test=not args.no_install_test)
    print(f"channel {res.channel} (UCX {res.ucx_version}):")
    for p in res.packages:
        print(f"  {p.relative_to(res.channel)}  {p.stat().st_size / 1e6:.2f} MB")
    if res.rendered_only:
        print(f"  rendered + linted, not built here: {', '.join(res.rendered_only)}")
    if res.install:
        print(f"  install test ({', '.join(res.install['virtual_packages'])}): "
              f"{', '.join(res.install['packages'])} ok")
    return 0


def _cmd_test_install(args) -> int:
    from .channel import install_test

    st = _stack(args)
    work = Path(args.work) if args.work else st.root / "build" / "conda-install-test"
    res = install_test(Path(args.channel), work=work, cuda=args.cuda or f"{st.cuda_major}.0", glibc=args.glibc)
    if args.json:
        atomic_write_text(args.json, json.dumps(res, indent=2, sort_keys=True) + "\n")
    for fn, r in res["packages"].items():
        where = f"installed in {r['prefix']}" if "prefix" in r else "checked (conda-forge dependencies not here)"
        print(f"{fn}: {where}, recipe tests passed")
    print(f"virtual packages: {', '.join(res['virtual_packages'])}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conda", help="conda recipes (render, lint) and the local channel (build, install test)")
    p.add_argument("--stack", help="stack.toml to read (default: the repository's)")
    p.add_argument("--recipes", help="recipes directory (default: <repo>/recipes)")
    s = p.add_subparsers(dest="conda_command", metavar="ACTION", required=True)
    for name, func, text in (("render", _cmd_render, "print every rendered recipe variant"),
                             ("lint", _cmd_lint, "lint the recipes and check them against stack.toml")):
        a = s.add_parser(name, help=text)
        if name == "render":
            a.add_argument("--recipe", help="only this recipe (directory name)")
        a.set_defaults(func=func)
    c = s.add_parser("channel", help="build the local channel: render, lint, build, pack, index, install-test")
    c.add_argument("--out", required=True, help="channel directory to create (replaced only when everything passed)")
    c.add_argument("--sources", help="a `ucx-src-build/build.sh fetch --dest` directory (default: fetch into "
                                     "<repo>/.cache/sources)")
    c.add_argument("--work", help="work directory for builds and logs (default: <repo>/build/conda-work)")
    c.add_argument("--no-install-test", action="store_true", help="skip the install test before publishing")
    c.set_defaults(func=_cmd_channel)
    t = s.add_parser("test-install", help="install the channel's packages into fresh prefixes and run their tests")
    t.add_argument("--channel", required=True)
    t.add_argument("--cuda", help="__cuda virtual package version to declare (default: <stack cuda_major>.0)")
    t.add_argument("--glibc", help="__glibc virtual package version to declare (default: this machine's)")
    t.add_argument("--work", help="scratch directory (default: <repo>/build/conda-install-test)")
    t.add_argument("--json", help="write the detailed results to this file")
    t.set_defaults(func=_cmd_test_install)
