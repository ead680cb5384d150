"""Files generated from stack.toml: environment.yml and the hash-pinned locks (the conda recipes: `conda regen`).

Each carries a header saying so; `ucx-dask-gpu stack … --check` fails when the committed file has drifted.
"""
from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

from ..errors import BAD_STACK, USAGE, UserError
from .lock import canonical, load_lock
from .model import Stack

GENERATED = "# Generated from stack.toml by `ucx-dask-gpu stack {cmd}`; do not edit by hand.\n"
ENVIRONMENT_YML = "environment.yml"


def _requirement(spec: str):
    # packaging is third-party: imported only where a requirement is read, so `stack get` runs on a bare python3.
    from packaging.requirements import Requirement

    return Requirement(spec)


def render_environment_yml(st: Stack) -> str:
    """Conda dev environment: tools unpinned, every top-level requirement pinned at its locked version."""
    pins = load_lock(st.lock_path())
    lines = [GENERATED.format(cmd="env-yml").rstrip(),
             "# The channels of README's install line, in its order; like its --strict-channel-priority, create it after",
             "# `conda config --set channel_priority strict`. UCX and UCXX come from this project's channel (recipes/).",
             f"name: {st.name}-dev", "channels:"]
    lines += [f"  - {c}" for c in st.conda.channels]
    lines += ["dependencies:", f"  - python={st.python.version}", f"  - cuda-version={st.cuda_major}.0"]
    lines += [f"  - ucx={st.ucx.version}", f"  - ucxx={st.ucxx.source.version}",
              f"  - distributed-ucxx={st.ucxx.source.version}"]
    lines += [f"  - {tool}" for tool in st.conda.dev_tools]
    names = {canonical(k): v for k, v in st.conda.names.items()}
    seen = set()
    for spec in st.python.requirements:
        pypi = canonical(_requirement(spec).name)
        conda = names.get(pypi, pypi)
        if not conda or conda in seen:
            continue
        if pypi not in pins:
            raise UserError(f"{st.python.lock}: {pypi} (a stack.toml requirement) is not in the lock; run `make lock`",
                            BAD_STACK)
        seen.add(conda)
        # CUDA libraries follow the cuda-version pin above: conda-forge numbers them differently from PyPI.
        lines.append(f"  - {conda}" if conda in st.conda.cuda_managed else f"  - {conda}={pins[pypi].version}")
    lines += ["  - pip:", "      - -e ."]
    return "\n".join(lines) + "\n"


def locks(st: Stack) -> list[tuple[Path, tuple[str, ...]]]:
    """(lock path relative to the repository, its top-level requirements): the image/runtime lock, the UCXX build
    environment's and the test tooling's."""
    return [(st.python.lock, st.python.requirements), (st.ucxx.lock, st.ucxx.requirements),
            (st.test_tools.lock, st.test_tools.requirements)]


def lock_constraints(st: Stack, rel: Path) -> Path | None:
    """The lock another lock is resolved against: the test tooling installs into the runtime venv, so it takes the
    runtime lock's versions of what they share."""
    return st.lock_path() if rel == st.test_tools.lock else None


def check_lock_matches(st: Stack) -> list[str]:
    """Problems where a lock no longer satisfies stack.toml's requirements (empty when in sync)."""
    problems = []
    for rel, requirements in locks(st):
        pins = load_lock(st.root / rel)
        for spec in requirements:
            req = _requirement(spec)
            pin = pins.get(canonical(req.name))
            if pin is None:
                problems.append(f"{req.name} is required by stack.toml but missing from {rel}")
            elif not req.specifier.contains(pin.version, prereleases=True):
                problems.append(f"{req.name}: {rel} has {pin.version}, stack.toml wants {req.specifier}")
    return problems


def compile_lock(st: Stack, requirements: tuple[str, ...], constraints: Path | None = None) -> str:
    """Resolve requirements into a hash-pinned lock with uv (needs PyPI), within `constraints` (a lock) if given."""
    with tempfile.TemporaryDirectory() as tmp:
        req_in = Path(tmp) / "requirements.in"
        req_in.write_text("\n".join(requirements) + "\n")
        out = Path(tmp) / "lock.txt"
        cmd = ["uv", "pip", "compile", str(req_in), "--python-version", st.python.version,
               "--python-platform", st.python.platform, "--generate-hashes", "--no-header",
               "--no-annotate", "-o", str(out)]
        if constraints is not None:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("".join(f"{p.name}=={p.version}\n" for p in load_lock(constraints).values()))
            cmd += ["-c", str(pins)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError("stack lock: `uv` not found (pip install uv)", USAGE) from None
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise UserError(f"stack lock: uv pip compile failed: {tail[0]}", BAD_STACK)
        return GENERATED.format(cmd="lock") + out.read_text()
