"""Who this process is, environment-wise, and how two such identities differ.

The identity of a Dask process (scheduler, worker or client) is its stack id plus the list of installed
distributions. The stack id is baked into the image (hash of stack.toml + lock + UCX build info); two processes
with the same stack id run the same software. The package list only serves to explain a mismatch.

Pure functions, no dask import: the preload (`ucx_dask_gpu.gate.guard`) and `ucx-dask-gpu guard show` share them.
"""
from __future__ import annotations

import functools
import hashlib
import os
from importlib.metadata import distributions
from pathlib import Path

from ..stack import STACK_ID_ENV, STACK_ID_FILE
from ..stack.lock import canonical

# The preload that carries the identity and refuses mismatches (gate/guard.py), as dask config names it.
GUARD = "ucx_dask_gpu.gate.guard"
# Key under which the identity travels: in a worker's startup information and in a client's `versions`.
KEY = "ucx-dask-gpu"
# A refusal lists at most this many differing packages, so the message stays one readable line.
MAX_LISTED = 20


def stack_id(environ: dict | None = None, id_file: Path | None = None) -> tuple[str | None, str]:
    """(stack id, where it came from): env UCX_DASK_GPU_STACK_ID, else the image's file, else (None, "none")."""
    environ = os.environ if environ is None else environ
    id_file = STACK_ID_FILE if id_file is None else id_file
    value = environ.get(STACK_ID_ENV, "").strip()
    if value:
        return value, f"env {STACK_ID_ENV}"
    try:
        value = id_file.read_text().strip()
    except OSError:
        value = ""
    if value:
        return value.split()[0], str(id_file)
    return None, "none"


@functools.cache
def installed_packages() -> dict[str, str]:
    """Canonical name -> version of every installed distribution; the first on sys.path wins, as for imports.

    Cached: a process's installed distributions do not change while it runs Dask.
    """
    found: dict[str, str] = {}
    for dist in distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def encode_packages(packages: dict[str, str]) -> str:
    """Compact wire form: 'name==version' sorted, space separated (~1-3 KB for a full image)."""
    return " ".join(f"{k}=={v}" for k, v in sorted(packages.items()))


def decode_packages(text: str) -> dict[str, str]:
    out = {}
    for item in text.split():
        name, sep, version = item.partition("==")
        if sep:
            out[name] = version
    return out


def packages_digest(packages: dict[str, str]) -> str:
    return hashlib.sha256(encode_packages(packages).encode()).hexdigest()[:16]


def identity() -> dict:
    """What a process sends when it registers with the scheduler (msgpack-friendly: strings and None only)."""
    sid, _ = stack_id()
    pkgs = installed_packages()
    return {"stack-id": sid, "packages-sha256": packages_digest(pkgs), "packages": encode_packages(pkgs)}


def peer_packages(ident: dict | None, versions: dict | None) -> dict[str, str | None]:
    """The peer's packages: its full list when it ran the guard, else the few distributed itself reports."""
    if ident and isinstance(ident.get("packages"), str):
        return decode_packages(ident["packages"])
    pkgs = (versions or {}).get("packages") or {}
    return {canonical(k): v for k, v in pkgs.items() if k != "python"}


def package_diff(ours: dict[str, str | None], theirs: dict[str, str | None],
                 only: set[str] | None = None) -> list[tuple[str, str | None, str | None]]:
    """[(name, our version, their version)] where they differ (None = not installed), sorted by name.

    `only` restricts the comparison to names the peer could report (a peer without the guard sends ~10).
    """
    names = set(ours) | set(theirs) if only is None else only
    return [(n, ours.get(n), theirs.get(n)) for n in sorted(names) if ours.get(n) != theirs.get(n)]


def format_diff(diff: list[tuple[str, str | None, str | None]], limit: int = MAX_LISTED) -> str:
    shown = ", ".join(f"{n}: {a or 'missing'} vs {b or 'missing'}" for n, a, b in diff[:limit])
    more = f" (+{len(diff) - limit} more)" if len(diff) > limit else ""
    return (shown + more) if diff else "none found"


def check_peer(ours: dict, role: str, peer: str, ident: dict | None, versions: dict | None) -> str | None:
    """One-line refusal message when the peer's stack id differs from ours; None when it may join."""
    their_id = (ident or {}).get("stack-id")
    if their_id == ours["stack-id"]:
        return None
    our_pkgs = decode_packages(ours["packages"])
    their_pkgs = peer_packages(ident, versions)
    only = None if ident else set(their_pkgs)
    diff = package_diff(our_pkgs, their_pkgs, only)
    if ident is None:
        their_desc = (f"none (it did not load the {GUARD} preload: run it from the image, whose dask "
                      f"config loads it; a `--preload` option replaces that list, so add `--preload {GUARD}` to it)")
    else:
        their_desc = their_id or "none (no stack id in its environment)"
    return (f"ucx-dask-gpu guard: refused {role} {peer}: stack id differs: scheduler {ours['stack-id']} vs "
            f"{role} {their_desc}; differing packages (scheduler vs {role}): {format_diff(diff)}")


def compare_versions(versions: dict) -> dict:
    """Do the client, the scheduler and every worker report the same packages (and python)?

    `versions` is Client.get_versions(); returns {"identical": bool, "differences": [{package, client,
    scheduler, workers}]} with one entry per package whose version is not the same everywhere.
    """
    def pkgs(v: dict | None) -> dict:
        return dict((v or {}).get("packages") or {})

    client, sched = pkgs(versions.get("client")), pkgs(versions.get("scheduler"))
    workers = {addr: pkgs(v) for addr, v in (versions.get("workers") or {}).items()}
    names = set(client) | set(sched)
    for w in workers.values():
        names |= set(w)
    diffs = []
    for name in sorted(names):
        seen = {client.get(name), sched.get(name)} | {w.get(name) for w in workers.values()}
        if len(seen) > 1:
            diffs.append({"package": name, "client": client.get(name), "scheduler": sched.get(name),
                          "workers": {a: w.get(name) for a, w in workers.items()}})
    return {"identical": not diffs, "differences": diffs}
