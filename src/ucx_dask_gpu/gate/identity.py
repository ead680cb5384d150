"""Who this process is, environment-wise: the environment contract (CONTRACT; docs/environment-gate.md says what
it admits), the stack id derived from it, and how two identities differ.

The stack id hashes exactly the contract terms, computed from the installed distributions (`importlib.metadata`), so
a host venv, the image and a conda environment at the lock's versions share it; the image build predicts it from the
lock (image/build.py). The scheduler never trusts a peer's own id: it derives the terms from the distributions the
peer sends (accidents, not liars: mutual TLS, gate/tls.py, keeps strangers out).

Pure functions, no dask import: the preload (`ucx_dask_gpu.gate.guard`) and `ucx-dask-gpu guard` share them.
"""
from __future__ import annotations

import functools
import hashlib
import platform
import re
from importlib.metadata import distributions

from ..stack.lock import canonical
from . import peermsg

# The preload that carries the identity and refuses mismatches (gate/guard.py), as dask config names it.
GUARD = "ucx_dask_gpu.gate.guard"
# Key under which the identity travels: in a worker's startup information, in a client's `versions`, in the
# scheduler's answer to "identity" (there it says that the scheduler runs the guard).
KEY = "ucx-dask-gpu"
# A refusal lists at most this many differing packages, so the message stays one readable line.
MAX_LISTED = 20
# How every refusal begins: a client tells the guard's refusal (an ImportError from Client(...), as distributed
# raises it) from an import that failed.
REFUSAL_PREFIX = "ucx-dask-gpu guard: refused"

# The environment contract (docs/environment-gate.md), by distribution name without CUDA suffix:
# - cloudpickle, msgpack: how graphs, functions and messages are serialised;
# - dask, distributed: the graph format, the protocol and the scheduler's own code (the scheduler unpickles graphs);
# - numpy, pandas, pyarrow, cupy, rmm: the data that travels, and how it is serialised (rmm: GPU buffers);
# - dask-cuda: serialisers and worker code on GPU clusters;
# - ucxx, distributed-ucxx: both ends of a UCX connection (their wire protocol and frame handling);
# - ucx-dask-gpu: this guard and the functions our workloads ship to the workers.
# Plus the Python minor version (bytecode of pickled functions, pickle protocol). The C++ libucxx/librmm are left
# out: conda ships them without Python metadata, and they move in lockstep with ucxx/rmm.
CONTRACT = ("cloudpickle", "msgpack", "dask", "distributed", "numpy", "pandas", "pyarrow", "cupy", "rmm",
            "dask-cuda", "ucxx", "distributed-ucxx", "ucx-dask-gpu")
PYTHON = "python"
_CUDA_SUFFIX = re.compile(r"-(cu\d+|cuda\d+x)$")


def contract_name(name: str) -> str:
    """The contract term a distribution counts as: its canonical name without a CUDA suffix (`cupy-cuda13x` ->
    `cupy`, `rmm-cu13` -> `rmm`, `distributed-ucxx-cu13` -> `distributed-ucxx`)."""
    return _CUDA_SUFFIX.sub("", canonical(name))


_RELEASE = re.compile(r"^(\d+(?:\.\d+)*)(.*)$")


def normal_version(version: str) -> str:
    """Leading zeros of the release numbers dropped, as PEP 440 compares them: a conda package built from the tag
    0.51.01 and the wheel 0.51.1 are one version."""
    m = _RELEASE.match(version.strip())
    return ".".join(str(int(p)) for p in m.group(1).split(".")) + m.group(2) if m else version.strip()


def contract(packages: dict[str, str | None], python: str) -> dict[str, str | None]:
    """The contract terms of an environment: python minor + the version of each CONTRACT distribution (None when
    not installed). Two distributions of one term (cupy-cuda12x and cupy-cuda13x) give both versions, joined."""
    found: dict[str, set[str]] = {}
    for name, version in packages.items():
        term = contract_name(name)
        if term in CONTRACT and version:
            found.setdefault(term, set()).add(normal_version(version))
    terms: dict[str, str | None] = {PYTHON: ".".join(python.split(".")[:2])}  # 3.11.7(.final.0) -> 3.11
    for term in CONTRACT:
        terms[term] = ",".join(sorted(found[term])) if term in found else None
    return terms


def contract_id(terms: dict[str, str | None]) -> str:
    """The stack id: a hash of the contract terms (16 hex digits)."""
    text = "".join(f"{k}=={v or 'missing'}\n" for k, v in sorted(terms.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def installed_packages() -> dict[str, str]:
    """Canonical name -> version of every installed distribution; the first on sys.path wins, as for imports. Cached:
    a process's installed distributions do not change while it runs Dask."""
    found: dict[str, str] = {}
    for dist in distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(canonical(name), dist.version)
    return found


def own_contract() -> dict[str, str | None]:
    return contract(installed_packages(), platform.python_version())


def stack_id() -> str:
    """This environment's stack id, computed from its installed distributions (`ucx-dask-gpu guard id`)."""
    return contract_id(own_contract())


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
    """What a process sends when it registers with the scheduler (msgpack-friendly: strings only)."""
    pkgs = installed_packages()
    return {"stack-id": stack_id(), "python": platform.python_version(), "packages-sha256": packages_digest(pkgs),
            "packages": encode_packages(pkgs)}


def _their_python(ident: dict | None, versions: dict | None) -> str | None:
    if ident and isinstance(ident.get("python"), str):
        return ident["python"]
    v = versions or {}
    return (v.get("host") or {}).get("python") or (v.get("packages") or {}).get("python")


def package_diff(ours: dict[str, str | None], theirs: dict[str, str | None],
                 only: set[str] | None = None) -> list[tuple[str, str | None, str | None]]:
    """[(name, our version, their version)] where they differ (None = not installed), sorted by name."""
    names = set(ours) | set(theirs) if only is None else only
    return [(n, ours.get(n), theirs.get(n)) for n in sorted(names) if ours.get(n) != theirs.get(n)]


def format_diff(diff: list[tuple[str, str | None, str | None]], limit: int = MAX_LISTED) -> str:
    # Names and versions may come from a peer: escaped and cut short, so the refusal stays one line.
    shown = ", ".join(f"{peermsg.shown(n, 60)}: {peermsg.shown(a or 'missing', 60)} vs "
                      f"{peermsg.shown(b or 'missing', 60)}" for n, a, b in diff[:limit])
    more = f" (+{len(diff) - limit} more)" if len(diff) > limit else ""
    return (shown + more) if diff else "none"


def how_to_load_guard(role: str) -> str:
    """What a peer without the guard has to do, by role."""
    if role == "client":
        return (f"import {GUARD} before creating the Client, or install the client config once with "
                "`ucx-dask-gpu config install --dest <python prefix>/etc/dask`")
    return (f"start it with the image's dask config, or add `--preload {GUARD}` (a `--preload` option replaces the "
            "configured list)")


def check_peer(ours: dict, role: str, peer: str, ident: dict | None, versions: dict | None) -> str | None:
    """One-line refusal message when the peer breaks the contract; None when it may join. The peer's terms come from
    the distributions it sent; a peer without the guard sent only the handful distributed reports itself, too few to
    check the contract: it is refused, with what could be compared."""
    our_terms = contract(decode_packages(ours["packages"]), ours["python"])
    python = _their_python(ident, versions)
    if ident and isinstance(ident.get("packages"), str):
        their_terms = contract(decode_packages(ident["packages"]), python or "unknown")
        diff = package_diff(our_terms, their_terms)
        if not diff:
            return None
        return (f"{REFUSAL_PREFIX} {role} {peer}: its environment breaks the contract: stack id "
                f"scheduler {contract_id(our_terms)} vs {role} {contract_id(their_terms)}; differing (scheduler vs "
                f"{role}): {format_diff(diff)}")
    reported = {canonical(k): v for k, v in ((versions or {}).get("packages") or {}).items() if k != PYTHON}
    their_terms = contract(reported, python or "unknown")
    only = {t for t in CONTRACT if t in {contract_name(n) for n in reported}} | ({PYTHON} if python else set())
    diff = package_diff(our_terms, their_terms, only)
    return (f"{REFUSAL_PREFIX} {role} {peer}: it did not send its environment (the {GUARD} preload is "
            f"not loaded there: {how_to_load_guard(role)}); of what dask reports itself, differing (scheduler vs "
            f"{role}): {format_diff(diff)}")


def other_differences(ours: dict, ident: dict | None) -> list[tuple[str, str | None, str | None]]:
    """Distributions outside the contract that differ from ours (an accepted peer's, for an info line)."""
    if not ident or not isinstance(ident.get("packages"), str) or \
            ident.get("packages-sha256") == ours["packages-sha256"]:
        return []
    diff = package_diff(decode_packages(ours["packages"]), decode_packages(ident["packages"]))
    return [d for d in diff if contract_name(d[0]) not in CONTRACT]


def compare_versions(versions: dict) -> dict:
    """Do the client, the scheduler and every worker report the same packages (and python)? `versions` is
    Client.get_versions(); one difference per package whose version is not the same everywhere."""
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
