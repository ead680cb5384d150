"""`ucx-dask-gpu stack …`: read stack.toml, and (re)generate the files derived from it.

Generated files (lock, environment.yml) carry a header saying so; `--check` fails when they have drifted.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from . import stack as stackmod
from .errors import BAD_STACK, USAGE, UserError
from .fsutil import atomic_write_text
from .lockfile import canonical, load_lock

GENERATED = "# Generated from stack.toml by `ucx-dask-gpu stack {cmd}`; do not edit by hand.\n"


def _lookup(data, dotted: str):
    cur = data
    for part in dotted.split("."):
        if isinstance(cur, list):
            if not part.isdigit() or int(part) >= len(cur):
                raise UserError(f"{dotted!r}: {part!r} is not an index of a {len(cur)}-item list", USAGE)
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise UserError(f"no key {dotted!r} in stack.toml", USAGE)
    return cur


def render_environment_yml(st: stackmod.Stack) -> str:
    """Conda dev environment: tools unpinned, every top-level requirement pinned at its locked version."""
    from packaging.requirements import Requirement

    pins = load_lock(st.lock_path())
    lines = [GENERATED.format(cmd="env-yml").rstrip(), f"name: {st.name}-dev", "channels:"]
    lines += [f"  - {c}" for c in st.conda_channels]
    lines += ["dependencies:", f"  - python={st.python_version}", f"  - cuda-version={st.cuda_major}.0"]
    lines += [f"  - {tool}" for tool in st.conda_dev_tools]
    names = {canonical(k): v for k, v in st.conda_names.items()}
    seen = set()
    for spec in st.python_requirements:
        pypi = canonical(Requirement(spec).name)
        conda = names.get(pypi, pypi)
        if not conda or conda in seen:
            continue
        if pypi not in pins:
            raise UserError(f"{st.python_lock}: {pypi} (a stack.toml requirement) is not in the lock; run `make lock`",
                            BAD_STACK)
        seen.add(conda)
        # CUDA libraries follow the cuda-version pin above: conda-forge numbers them differently from PyPI.
        lines.append(f"  - {conda}" if conda in st.conda_cuda_managed else f"  - {conda}={pins[pypi].version}")
    lines += ["  - pip:", "      - -e ."]
    return "\n".join(lines) + "\n"


def locks(st: stackmod.Stack) -> list[tuple[Path, tuple[str, ...]]]:
    """(lock path relative to the repository, its top-level requirements): the image/runtime lock and the UCXX
    build environment's."""
    return [(st.python_lock, st.python_requirements), (st.ucxx.lock, st.ucxx.requirements)]


def check_lock_matches(st: stackmod.Stack) -> list[str]:
    """Problems where a lock no longer satisfies stack.toml's requirements (empty when in sync)."""
    from packaging.requirements import Requirement

    problems = []
    for rel, requirements in locks(st):
        pins = load_lock(st.root / rel)
        for spec in requirements:
            req = Requirement(spec)
            pin = pins.get(canonical(req.name))
            if pin is None:
                problems.append(f"{req.name} is required by stack.toml but missing from {rel}")
            elif not req.specifier.contains(pin.version, prereleases=True):
                problems.append(f"{req.name}: {rel} has {pin.version}, stack.toml wants {req.specifier}")
    return problems


def compile_lock(st: stackmod.Stack, requirements: tuple[str, ...]) -> str:
    """Resolve requirements into a hash-pinned lock with uv (needs PyPI)."""
    with tempfile.TemporaryDirectory() as tmp:
        req_in = Path(tmp) / "requirements.in"
        req_in.write_text("\n".join(requirements) + "\n")
        out = Path(tmp) / "lock.txt"
        cmd = ["uv", "pip", "compile", str(req_in), "--python-version", st.python_version,
               "--python-platform", st.python_platform, "--generate-hashes", "--no-header",
               "--no-annotate", "-o", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError("stack lock: `uv` not found (pip install uv)", USAGE) from None
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"stack lock: uv pip compile failed: {tail[0]}", BAD_STACK)
        return GENERATED.format(cmd="lock") + out.read_text()


def _cmd_validate(args) -> int:
    st = stackmod.load(args.file)
    print(f"{st.path}: ok ({st.name} {st.version}, UCX {st.ucx.version}, UCXX {st.ucxx.source.version}, "
          f"CUDA {st.cuda_major})")
    return 0


def _cmd_get(args) -> int:
    st = stackmod.load(args.file)
    value = _lookup(st.raw, args.key)
    print(json.dumps(value) if isinstance(value, (dict, list)) or args.json else value)
    return 0


def _cmd_id(args) -> int:
    for p in [args.build_info, *args.extra_lock]:
        if p is not None and not p.is_file():
            raise UserError(f"stack id: {p} does not exist", USAGE)
    print(stackmod.load(args.file).stack_id(build_info=args.build_info, extra_locks=tuple(args.extra_lock)))
    return 0


def _regen(args, path: Path, render) -> int:
    st = stackmod.load(args.file)
    target = st.root / path
    text = render(st)
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


def _cmd_env_yml(args) -> int:
    return _regen(args, Path("environment.yml"), render_environment_yml)


def _cmd_lock(args) -> int:
    st = stackmod.load(args.file)
    if args.check:
        problems = check_lock_matches(st)
        for p in problems:
            print(p, file=sys.stderr)
        if not problems:
            print(f"{', '.join(str(rel) for rel, _ in locks(st))}: satisfy stack.toml")
        return 1 if problems else 0
    for rel, requirements in locks(st):
        atomic_write_text(st.root / rel, compile_lock(st, requirements))
        print(f"wrote {st.root / rel}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="read stack.toml and regenerate files derived from it")
    p.add_argument("--file", help="stack.toml to read (default: the repository's / the installed copy)")
    s = p.add_subparsers(dest="stack_command", metavar="ACTION", required=True)
    s.add_parser("validate", help="validate stack.toml").set_defaults(func=_cmd_validate)
    g = s.add_parser("get", help="print one value, e.g. `ucx.sources.0.version`")
    g.add_argument("key")
    g.add_argument("--json", action="store_true", help="print as JSON")
    g.set_defaults(func=_cmd_get)
    i = s.add_parser("id", help="print the stack id (hash of stack.toml + lock [+ extra locks] [+ UCX build info])")
    i.add_argument("--build-info", type=Path, help="the UCX prefix's share/ucx-dask-gpu/build-info.json (image id)")
    i.add_argument("--extra-lock", type=Path, action="append", default=[],
                   help="hashed requirements installed on top of the lock (repeatable)")
    i.set_defaults(func=_cmd_id)
    e = s.add_parser("env-yml", help="generate environment.yml")
    e.add_argument("--check", action="store_true", help="fail if environment.yml is out of date")
    e.set_defaults(func=_cmd_env_yml)
    lk = s.add_parser("lock", help="resolve the hash-pinned Python locks (runtime, UCXX build) with uv")
    lk.add_argument("--check", action="store_true", help="fail if a lock no longer satisfies stack.toml")
    lk.set_defaults(func=_cmd_lock)
