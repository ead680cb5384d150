"""`ucx-dask-gpu conda regen|pack|variants|render|lint|publishable`: the conda recipes, and what an upload may send.

The stand-in channel of a host without conda channels (`make channel`) is not a command of the product: it lives in
tools/conda_standin (`python -m tools.conda_standin channel`), which this package never imports.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..cliutil import add_output
from ..errors import RECIPE_INVALID, UserError
from ..fsutil import write_output_file
from ..stack import load
from . import settings
from .publish import check
from .recipes import check_all
from . import variants as vstack
from .variants import MODES, choose


PACKED_HELP = ("new or empty, or recipes this command packed before (its manifest), which are replaced; a directory "
               "holding anything else, or a file, is refused (exit 9) naming it")


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


def _packed(args, st) -> Path | None:
    return Path(args.packed).resolve() if getattr(args, "packed", None) else None


def _cmd_pack(args) -> int:
    st = load(args.stack)
    out = settings.pack(st, Path(args.out).resolve(), _recipes(args, st))
    print(f"recipes packed into {out} (variants: {choose(st, _recipes(args, st), 'auto').describe()})")
    return 0


def _cmd_variants(args) -> int:
    st = load(args.stack)
    recipes_dir = _recipes(args, st)
    stack = choose(st, recipes_dir, args.variants)
    config = vstack.config(stack, args.platform, recipes_dir / args.recipe / vstack.CBC)
    write_output_file(args.out, vstack.as_variants_yaml(config, stack, args.platform, args.recipe, args.cuda),
                      what="the variants")
    print(f"wrote {args.out}: recipes/{args.recipe} on {args.platform} under {stack.describe()}")
    return 0


def _cmd_render(args) -> int:
    st = load(args.stack)
    problems, variants = check_all(st, _recipes(args, st), mode=args.variants, packed=_packed(args, st))
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
    problems, variants = check_all(st, _recipes(args, st), mode=args.variants, packed=_packed(args, st))
    for p in problems:
        print(p)
    if problems:
        raise UserError(f"{len(problems)} recipe problem(s), the first: {problems[0]}", RECIPE_INVALID)
    used = variants[0].stack.describe() if variants and variants[0].stack else "?"
    print(f"recipes ok against {st.path.name}: {len(variants)} outputs rendered by rattler-build under {used}:")
    for v in sorted(variants, key=lambda v: (v.recipe_path.parent.name, v.name, v.subdir, v.build_string)):
        print(f"  {v.subdir}/{v.dist}  cuda={v.variant.get('cuda_compiler_version', '-')} "
              f"python={v.variant.get('python', v.variant.get('python_min', '-'))}")
    return 0


def _cmd_publishable(args) -> int:
    for p in check([Path(d) for d in args.dirs]):
        print(p)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("conda", help="conda recipes (regen, pack, render, lint) and what an upload may publish")
    p.add_argument("--stack", help="stack.toml to read (default: the repository's)")
    p.add_argument("--recipes", help="recipes directory (default: <repo>/recipes)")
    s = p.add_subparsers(dest="conda_command", metavar="ACTION", required=True)
    g = s.add_parser("regen", help="write the recipes' generated lines from stack.toml (make regen)")
    g.add_argument("--check", action="store_true", help="fail (exit 60) if they are out of date, write nothing")
    g.set_defaults(func=_cmd_regen)
    k = s.add_parser("pack", help="the recipes as a build or a feedstock takes them: the carried patches copied in "
                                  "and listed")
    add_output(k, "--out", kind="dir", required=True, help="directory to write", note=PACKED_HELP)
    k.set_defaults(func=_cmd_pack)
    variants_help = ("variant config: conda-forge (its global pinning + stack.toml [conda].migrations, from "
                     "$UCX_DASK_GPU_CONDA_PINNING or stack.toml [conda].pinning), fallback "
                     "(recipes/conda_build_config.yaml), auto (the first where present; default)")
    w = s.add_parser("variants", help="write one recipe's stacked variant config as a rattler-build variants file")
    w.add_argument("--recipe", required=True, choices=settings.RECIPES)
    w.add_argument("--platform", default="linux-64", help="target platform (default: linux-64)")
    w.add_argument("--cuda", help="only this CUDA version's job (cuda_compiler_version and the keys zipped with it)")
    add_output(w, "--out", required=True, help="the variants file to write")
    w.set_defaults(func=_cmd_variants)
    r = s.add_parser("render", help="print every output rattler-build renders, every variant and platform")
    r.add_argument("--recipe", help="only this recipe (directory name)")
    l_ = s.add_parser("lint", help="render with rattler-build, lint, check against stack.toml")
    for sp in (w, r, l_):
        sp.add_argument("--variants", choices=MODES, default="auto", help=variants_help)
    for sp in (r, l_):
        add_output(sp, "--packed", kind="dir", help="where the packed recipes go (default: <repo>/build/conda-recipes)",
                   note=PACKED_HELP)
    r.set_defaults(func=_cmd_render)
    l_.set_defaults(func=_cmd_lint)
    u = s.add_parser("publishable", help="list the packages an upload would send; refuse (exit 63) if any was built "
                                         "with stand-ins, and (exit 61) two files of one name or none")
    u.add_argument("dirs", nargs="+", metavar="DIR", help="directories the upload reads (searched recursively)")
    u.set_defaults(func=_cmd_publishable)
