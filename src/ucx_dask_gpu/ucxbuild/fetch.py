"""Fetch pinned inputs (UCX source archive, CUDA header wheels, link .debs) and verify their sha256.

Order of locations for UCX: for each [[ucx.sources]] entry in stack.toml order — the download cache (only ever holds
verified files), its URLs (unless offline), then local directories (--sources DIR, $UCX_SOURCE_DIR). The first
verified archive wins. Unreachable or absent: try the next location. A sha256 mismatch anywhere is fatal: it means a
tampered mirror or a wrong pin, and silently trying the next location would hide either.

Downloads go to a temp file next to the cache entry, are hashed while streaming and renamed only when they match,
so the cache never holds a partial or unverified file.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ..fsutil import atomic_write_text, sha256_file
from ..stack import Artifact, Stack, UcxSource

SOURCE_DIR_ENV = "UCX_SOURCE_DIR"
CACHE_ENV = "UCX_DASK_GPU_CACHE"
MANIFEST = "manifest.json"
# GitHub fails DNS instantly where it is blocked; a silently dropping firewall must not stall the build for minutes.
CONNECT_TIMEOUT_S = 15.0
USER_AGENT = "ucx-dask-gpu-fetch/1"


def say(msg: str) -> None:
    """Progress: stdout, flushed (stderr is kept for the one-line error and the fallback warning)."""
    print(f"[ucx-src-build] {msg}", flush=True)


def warn(msg: str) -> None:
    print(f"ucx-src-build: WARNING: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Location:
    kind: str  # "cache" | "url" | "dir"
    where: str  # URL or file path

    def __str__(self) -> str:
        return self.where


@dataclass
class Attempt:
    location: str
    outcome: str  # "ok" or why it was skipped


@dataclass
class FetchedSource:
    source: UcxSource
    path: Path
    location: Location
    origin_url: str | None  # where a cached copy was first downloaded from
    fallback: bool
    fallback_reason: str | None
    attempts: list[Attempt] = field(default_factory=list)

    def record(self) -> dict:
        """The `source` block of build-info.json (sorted keys, no timestamps)."""
        return {
            "version": self.source.version,
            "archive": self.source.archive,
            "sha256": self.source.sha256,
            "layout": self.source.layout,
            "location": self.location.where if self.location.kind == "url" else self.location.kind,
            "url": self.origin_url,
            "fallback": self.fallback,
            "fallback_reason": self.fallback_reason,
        }


class HashMismatch(UserError):
    def __init__(self, what: str, location: str, want: str, got: str):
        super().__init__(f"sha256 mismatch for {what} from {location}: expected {want}, got {got} "
                         f"(tampered mirror or wrong pin in stack.toml; nothing was kept)", HASH_MISMATCH)


class Unreachable(Exception):
    """This location does not have the file (network error, HTTP error, missing file); try the next one."""


# --- directories ---------------------------------------------------------------------------------------------------

def default_cache_dir(stack: Stack) -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else stack.root / ".cache" / "sources"


def local_dirs(extra: list[Path] | None = None) -> list[Path]:
    """--sources directories first, then $UCX_SOURCE_DIR."""
    dirs = list(extra or [])
    env = os.environ.get(SOURCE_DIR_ENV)
    if env:
        dirs.append(Path(env))
    return dirs


def read_manifest(d: Path) -> dict:
    try:
        return json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def _update_manifest(d: Path, filename: str, sha256: str, url: str | None) -> None:
    """Remember where a cached file came from, so build-info can name the URL even on a cache hit."""
    m = read_manifest(d)
    files = m.setdefault("files", {})
    old = files.get(filename, {})
    files[filename] = {"sha256": sha256, "url": url or old.get("url")}
    m["files"] = dict(sorted(files.items()))
    atomic_write_text(d / MANIFEST, json.dumps(m, indent=2, sort_keys=True) + "\n")


# --- one file -----------------------------------------------------------------------------------------------------

def _download(url: str, dest_dir: Path, filename: str, sha256: str, what: str) -> Path:
    """Stream `url` into dest_dir/.filename.XXXX, verify, rename to dest_dir/filename."""
    req = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    t0 = time.monotonic()
    try:
        resp = urllib.request.urlopen(req, timeout=CONNECT_TIMEOUT_S)
    except urllib.error.HTTPError as e:
        raise Unreachable(f"HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, socket.gaierror):
            raise Unreachable("name lookup failed") from None
        raise Unreachable(str(getattr(reason, "strerror", None) or reason)) from None
    except (OSError, ValueError) as e:  # timeouts, connection resets, malformed URL
        raise Unreachable(str(e) or type(e).__name__) from None
    dest_dir.mkdir(parents=True, exist_ok=True)  # only now: an unreachable source leaves no empty directory
    fd, tmp = tempfile.mkstemp(prefix=f".{filename}.", dir=dest_dir)
    h = hashlib.sha256()
    size = 0
    try:
        with resp, os.fdopen(fd, "wb") as out:
            while block := resp.read(1 << 20):
                h.update(block)
                out.write(block)
                size += len(block)
        got = h.hexdigest()
        if got != sha256:
            raise HashMismatch(what, url, sha256, got)
        os.chmod(tmp, 0o644)
        final = dest_dir / filename
        os.replace(tmp, final)
    except (OSError, http.client.HTTPException) as e:  # reset / timeout / truncated body mid-transfer
        raise Unreachable(f"transfer failed: {e or type(e).__name__}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    say(f"  downloaded {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s, sha256 ok")
    return final


def _check_local(path: Path, sha256: str, what: str) -> Path:
    if not path.is_file():
        raise Unreachable("not present")
    got = sha256_file(path)
    if got != sha256:
        raise HashMismatch(what, str(path), sha256, got)
    return path


def fetch_file(filename: str, sha256: str, urls: tuple[str, ...] | list[str], what: str, *, cache: Path,
               dirs: list[Path], offline: bool, attempts: list[Attempt] | None = None) -> tuple[Path, Location]:
    """First verified copy of one file: cache, then urls (unless offline), then local dirs. Raises Unreachable."""
    attempts = attempts if attempts is not None else []
    locations = [Location("cache", str(cache / filename))]
    locations += [] if offline else [Location("url", u) for u in urls]
    locations += [Location("dir", str(d / filename)) for d in dirs]
    for loc in locations:
        try:
            if loc.kind == "url":
                say(f"{what}: trying {loc.where}")
                path = _download(loc.where, cache, filename, sha256, what)
                _update_manifest(cache, filename, sha256, loc.where)
            else:
                path = _check_local(Path(loc.where), sha256, what)
                if loc.kind == "dir":
                    say(f"{what}: found {loc.where}, sha256 ok")
                    # Keep a copy in the cache so one directory (the cache / `fetch --dest`) holds every input used.
                    origin = read_manifest(path.parent).get("files", {}).get(filename, {}).get("url")
                    path = _copy_verified(path, cache)
                    _update_manifest(cache, filename, sha256, origin)
        except Unreachable as e:
            if loc.kind != "cache":  # a cache miss is routine, not worth a line
                say(f"  {loc.where}: {e}")
            attempts.append(Attempt(loc.where, str(e)))
            continue
        attempts.append(Attempt(loc.where, "ok"))
        return path, loc
    tried = "; ".join(f"{a.location}: {a.outcome}" for a in attempts if not a.location.startswith(str(cache)))
    if offline and not dirs:
        tried = tried or "offline and no --sources/$UCX_SOURCE_DIR given"
    raise Unreachable(tried or "no location to try")


def fetch_ucx_source(stack: Stack, *, cache: Path, dirs: list[Path], offline: bool) -> FetchedSource:
    """Walk [[ucx.sources]] in order; return the first verified archive. Exit SOURCE_UNREACHABLE if none."""
    skipped: list[str] = []
    all_attempts: list[Attempt] = []
    for i, src in enumerate(stack.ucx_sources):
        what = f"UCX {src.version} ({src.archive})"
        attempts: list[Attempt] = []
        try:
            path, loc = fetch_file(src.archive, src.sha256, src.urls, what, cache=cache, dirs=dirs,
                                   offline=offline, attempts=attempts)
        except Unreachable as e:
            skipped.append(f"{src.version}: {e}")
            all_attempts += attempts
            continue
        all_attempts += attempts
        origin = read_manifest(cache).get("files", {}).get(src.archive, {}).get("url")
        fallback = i > 0
        reason = ("; ".join(f"pinned {s}" if j == 0 else s for j, s in enumerate(skipped))) if fallback else None
        if fallback:  # an offline build from a `fetch --dest` directory: add why the fetch itself fell back
            for d in dirs:
                earlier = read_manifest(d).get("ucx", {})
                if earlier.get("version") == src.version and earlier.get("fallback_reason"):
                    reason += f"; when {d} was fetched: {earlier['fallback_reason']}"
                    break
        fetched = FetchedSource(src, path, loc, origin, fallback, reason, all_attempts)
        say(f"using UCX {src.version} from {loc.where} (sha256 {src.sha256[:12]}… verified)")
        if fallback:
            warn(f"FALLBACK: building UCX {src.version}, NOT the pinned {stack.ucx.version} — {reason}")
        return fetched
    detail = " | ".join(skipped)
    raise UserError(f"no UCX source archive reachable: {detail}", SOURCE_UNREACHABLE)


def fetch_artifact(art: Artifact, *, cache: Path, dirs: list[Path], offline: bool) -> Path:
    what = f"{art.name} {art.version}"
    try:
        path, _ = fetch_file(art.filename, art.sha256, (art.url,), what, cache=cache, dirs=dirs, offline=offline)
    except Unreachable as e:
        raise UserError(f"{what} not reachable: {e}", SOURCE_UNREACHABLE) from None
    return path


def fetch_all(stack: Stack, dest: Path, *, dirs: list[Path], offline: bool, cuda: bool = True) -> dict:
    """`ucx fetch --dest DIR`: UCX archive + (optionally) CUDA wheels and link .debs, verified, into DIR.

    DIR doubles as a cache (already verified files are not downloaded again) and, with its manifest.json, as the
    input of an offline build (`build --sources DIR --offline`, e.g. inside `docker build --network none`).
    """
    src = fetch_ucx_source(stack, cache=dest, dirs=dirs, offline=offline)
    if cuda:
        for art in stack.cuda_header_wheels + stack.cuda_link_debs:
            fetch_artifact(art, cache=dest, dirs=dirs, offline=offline)
    m = read_manifest(dest)
    # Which source this directory was filled for, and why: an offline build from it reports the original reason.
    m["ucx"] = {k: v for k, v in src.record().items() if k != "location"}
    atomic_write_text(dest / MANIFEST, json.dumps(m, indent=2, sort_keys=True) + "\n")
    return m


def _copy_verified(path: Path, dest: Path) -> Path:
    """Copy an already verified file into dest (temp name, then rename); no-op when it is already there."""
    final = dest / path.name
    if final.exists() and final.resolve() == path.resolve():
        return final
    dest.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=dest)
    os.close(fd)
    try:
        shutil.copyfile(path, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final
