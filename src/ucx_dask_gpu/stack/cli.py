"""`ucx-dask-gpu stack …`: read stack.toml, and (re)generate the files derived from it."""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import USAGE, UserError
from ..fsutil import atomic_write_text
from . import generate
from .model import load, value


def _cmd_validate(args) -> int:
    st = load(args.file)
    print(f"{st.path}: ok ({st.name} {st.version}, UCX {st.ucx.version}, UCXX {st.ucxx.source.version}, "
          f"CUDA {st.cuda_major})")
    return 0


def _cmd_get(args) -> int:
    v = value(args.key, args.file)
    print(json.dumps(v) if isinstance(v, (dict, list)) or args.json else v)
    return 0


def _cmd_env_yml(args) -> int:
    st = load(args.file)
    target = st.root / generate.ENVIRONMENT_YML
    text = generate.render_environment_yml(st)
    if args.check:
        current = target.read_text() if target.exists() else ""
        if current != text:
            print(f"{target.name} is out of date with stack.toml; run `make regen`", file=sys.stderr)
            return 1
        print(f"{target.name}: up to date")
        return 0
    atomic_write_text(target, text)
    print(f"wrote {target}")
    return 0


def _cmd_lock(args) -> int:
    st = load(args.file)
    if args.check:
        problems = generate.check_lock_matches(st)
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{', '.join(str(rel) for rel, _ in generate.locks(st))}: satisfy stack.toml")
        return 1 if problems else 0
    chosen = [(rel, reqs) for rel, reqs in generate.locks(st) if not args.only or str(rel) in args.only]
    if args.only and len(chosen) != len(set(args.only)):
        unknown = sorted(set(args.only) - {str(r) for r, _ in chosen})
        raise UserError(f"--only: not a lock of stack.toml: {', '.join(unknown)}", USAGE)
    for rel, requirements in chosen:
        atomic_write_text(st.root / rel, generate.compile_lock(st, requirements, generate.lock_constraints(st, rel)))
        print(f"wrote {st.root / rel}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="read stack.toml and regenerate files derived from it")
    p.add_argument("--file", help="stack.toml to read (default: the repository's / the installed copy)")
    s = p.add_subparsers(dest="stack_command", metavar="ACTION", required=True)
    s.add_parser("validate", help="validate stack.toml").set_defaults(func=_cmd_validate)
    g = s.add_parser("get", help="print one value, e.g. `ucx.source.version`")
    g.add_argument("key")
    g.add_argument("--json", action="store_true", help="print as JSON")
    g.set_defaults(func=_cmd_get)
    e = s.add_parser("env-yml", help="generate environment.yml")
    e.add_argument("--check", action="store_true", help="fail if environment.yml is out of date")
    e.set_defaults(func=_cmd_env_yml)
    lk = s.add_parser("lock", help="resolve the hash-pinned Python locks (runtime, UCXX build) with uv")
    lk.add_argument("--check", action="store_true", help="fail if a lock no longer satisfies stack.toml")
    lk.add_argument("--only", action="append", metavar="LOCK", help="resolve only this lock (its path; repeatable)")
    lk.set_defaults(func=_cmd_lock)
