"""Fetch pinned inputs (source archives of release tags, CUDA header wheels, link .debs) and verify them, where and
how ucx-src-build/README.md ("Where the sources come from") says: upstream URLs (unless offline), source mirrors,
then the download cache (which only ever holds verified files); the first verified copy wins. A copy that fails
verification is fatal: silently trying the next location would hide a tampered mirror or a wrong pin.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import socket
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..cliutil import Progress
from ..errors import HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ..fsutil import atomic_path, atomic_write_text, read_json, sha256_file
from ..stack import Artifact, SourceArchive, Stack
from .gittree import NotASourceArchive, content_tree

MIRROR_ENV = "UCX_DASK_GPU_SOURCE_MIRROR"
CACHE_ENV = "UCX_DASK_GPU_CACHE"
MANIFEST = "manifest.json"
# GitHub fails DNS instantly where it is blocked; a silently dropping firewall must not stall the build for minutes.
CONNECT_TIMEOUT_S = 15.0
USER_AGENT = "ucx-dask-gpu-fetch/1"


# Progress on stdout (stderr is kept for the one-line error and warnings).
say = Progress("[ucx-src-build] ", stream="stdout")
warn = Progress("ucx-src-build: WARNING: ")


@dataclass(frozen=True)
class Location:
    kind: str  # "cache" | "url" | "dir"
    where: str  # URL or file path


@dataclass
class Attempt:
    location: str
    outcome: str  # "ok" or why it was skipped


@dataclass
class FetchedSource:
    source: SourceArchive
    path: Path
    location: Location
    origin_url: str | None  # where a cached or mirrored copy was first downloaded from, when known
    verified_by: str  # "sha256" (the pinned archive file) or "content tree" (same files, another archive)
    attempts: list[Attempt] = field(default_factory=list)

    def record(self) -> dict:
        """The `source` block of a build-info.json (sorted keys, no timestamps, no machine paths): what the file is
        and where it was first downloaded from, not where this build found it (a URL, a mirror, a cache: the build
        log says), so two builds of the same file write the same build info."""
        return {
            "name": self.source.name,
            "version": self.source.version,
            "tag": self.source.tag,
            "commit": self.source.commit,
            "archive": self.source.archive,
            "content_tree": self.source.content_tree,
            "sha256": sha256_file(self.path),
            "verified_by": self.verified_by,
            "url": self.origin_url,
        }


class HashMismatch(UserError):
    def __init__(self, what: str, location: str, want: str, got: str):
        super().__init__(f"{what} from {location} does not match stack.toml: expected {want}, got {got} "
                         f"(tampered mirror or wrong pin; nothing was kept)", HASH_MISMATCH)


class Unreachable(Exception):
    """This location does not have the file (network error, HTTP error, missing file); try the next one."""


# --- directories ---------------------------------------------------------------------------------------------------

def default_cache_dir(stack: Stack) -> Path:
    return Path(os.environ.get(CACHE_ENV) or stack.root / ".cache" / "sources")


def local_dirs(stack: Stack, extra: list[Path] | None = None) -> list[Path]:
    """Source mirrors in the order they are searched: --sources directories, $UCX_DASK_GPU_SOURCE_MIRROR, then
    stack.toml's [sources].mirror_dirs."""
    dirs = list(extra or [])
    env = os.environ.get(MIRROR_ENV)
    if env:
        dirs.append(Path(env))
    return dirs + stack.mirror_paths()


def read_manifest(d: Path) -> dict:
    return read_json(d / MANIFEST, {})


def _update_manifest(d: Path, filename: str, sha256: str, url: str | None) -> None:
    """Remember where a cached file came from, so build-info can name the URL even on a cache hit."""
    m = read_manifest(d)
    files = m.setdefault("files", {})
    old = files.get(filename, {})
    files[filename] = {"sha256": sha256, "url": url or old.get("url")}
    m["files"] = dict(sorted(files.items()))
    atomic_write_text(d / MANIFEST, json.dumps(m, indent=2, sort_keys=True) + "\n")


# --- verification ----------------------------------------------------------------------------------------------

Verifier = Callable[[Path, str], str]  # (file, where it came from) -> how it was verified; raises HashMismatch


def sha256_verifier(sha256: str, what: str) -> Verifier:
    def verify(path: Path, location: str) -> str:
        got = sha256_file(path)
        if got != sha256:
            raise HashMismatch(f"{what}: sha256", location, sha256, got)
        return "sha256"
    return verify


def source_verifier(src: SourceArchive) -> Verifier:
    """The pinned archive file by sha256, else any archive whose content has the pinned git tree id."""
    what = f"{src.name} {src.version} ({src.archive})"

    def verify(path: Path, location: str) -> str:
        if sha256_file(path) == src.sha256:
            return "sha256"
        try:
            tree = content_tree(path)
        except (OSError, EOFError, tarfile.TarError, NotASourceArchive) as e:
            raise HashMismatch(f"{what}: content", location, f"a source archive of tree {src.content_tree}",
                               f"an unreadable archive ({e})") from None
        if tree != src.content_tree:
            raise HashMismatch(f"{what}: content tree", location, src.content_tree, tree)
        return "content tree"
    return verify


# --- one file -----------------------------------------------------------------------------------------------------

def _download(url: str, dest_dir: Path, filename: str, verify: Verifier) -> tuple[Path, str]:
    """Stream `url` into a temporary file beside dest_dir/filename, verify it, rename it there: the cache never holds
    a partial or unverified file."""
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
    final = dest_dir / filename
    size = 0
    with resp, atomic_path(final) as tmp:  # dest_dir made only now: an unreachable source leaves no empty directory
        try:
            with open(tmp, "wb") as out:
                while block := resp.read(1 << 20):
                    out.write(block)
                    size += len(block)
        except (OSError, http.client.HTTPException) as e:  # reset / timeout / truncated body mid-transfer
            raise Unreachable(f"transfer failed: {e or type(e).__name__}") from None
        how = verify(tmp, url)
        os.chmod(tmp, 0o644)
    say(f"  downloaded {size / 1e6:.1f} MB in {time.monotonic() - t0:.1f} s, {how} ok")
    return final, how


def fetch_file(filename: str, urls: tuple[str, ...] | list[str], verify: Verifier, what: str, *, cache: Path,
               dirs: list[Path], offline: bool,
               attempts: list[Attempt] | None = None) -> tuple[Path, Location, str]:
    """First verified copy of one file: urls (unless offline), then mirror dirs, then the cache.
    Returns (path in the cache, where it came from, how it was verified). Raises Unreachable."""
    attempts = attempts if attempts is not None else []
    locations = [] if offline else [Location("url", u) for u in urls]
    locations += [Location("dir", str(d / filename)) for d in dirs]
    locations.append(Location("cache", str(cache / filename)))
    for loc in locations:
        try:
            if loc.kind == "url":
                say(f"{what}: trying {loc.where}")
                path, how = _download(loc.where, cache, filename, verify)
                _update_manifest(cache, filename, sha256_file(path), loc.where)
            else:
                path = Path(loc.where)
                if not path.is_file():
                    raise Unreachable("not present")
                how = verify(path, loc.where)
                if loc.kind == "dir":
                    say(f"{what}: found {loc.where}, {how} ok")
                    # Keep a copy in the cache so one directory (the cache / `fetch --dest`) holds every input used.
                    origin = read_manifest(path.parent).get("files", {}).get(filename, {}).get("url")
                    path = _copy_verified(path, cache)
                    _update_manifest(cache, filename, sha256_file(path), origin)
        except Unreachable as e:
            if loc.kind != "cache":  # a cache miss is routine, not worth a line
                say(f"  {loc.where}: {e}")
            attempts.append(Attempt(loc.where, str(e)))
            continue
        attempts.append(Attempt(loc.where, "ok"))
        return path, loc, how
    tried = "; ".join(f"{a.location}: {a.outcome}" for a in attempts if not a.location.startswith(str(cache)))
    raise Unreachable(tried or "no location to try")


def fetch_source(src: SourceArchive, *, cache: Path, dirs: list[Path], offline: bool) -> FetchedSource:
    """The verified archive of one pinned source; exit SOURCE_UNREACHABLE with one line naming where to put it."""
    what = f"{src.name} {src.version} ({src.archive})"
    attempts: list[Attempt] = []
    try:
        path, loc, how = fetch_file(src.archive, src.urls, source_verifier(src), what, cache=cache, dirs=dirs,
                                    offline=offline, attempts=attempts)
    except Unreachable as e:
        raise UserError(f"{what} not found ({e}): put upstream's archive of tag {src.tag} (commit "
                        f"{src.commit[:12]}, or `git archive` of it) named {src.archive} into {_where_to_put(dirs)}",
                        SOURCE_UNREACHABLE) from None
    origin = read_manifest(cache).get("files", {}).get(src.archive, {}).get("url")
    say(f"using {src.name} {src.version} from {loc.where} ({how} verified)")
    return FetchedSource(src, path, loc, origin, how, attempts)


def _where_to_put(dirs: list[Path]) -> str:
    mirrors = ", ".join(str(d) for d in dirs) or "none"
    return (f"a source mirror: --sources DIR (make: SOURCES=DIR), ${MIRROR_ENV}, or stack.toml [sources].mirror_dirs "
            f"(searched: {mirrors})")


def fetch_sources(sources: tuple[SourceArchive, ...], *, cache: Path, dirs: list[Path],
                  offline: bool) -> list[FetchedSource]:
    """Every archive of `sources`, verified, before anything is built: one line naming every missing archive (exit
    SOURCE_UNREACHABLE), not one missing archive per attempt. A copy that fails verification stops at once."""
    fetched, missing = [], []
    for src in sources:
        try:
            fetched.append(fetch_source(src, cache=cache, dirs=dirs, offline=offline))
        except UserError as e:
            if e.exit_code != SOURCE_UNREACHABLE:
                raise
            missing.append((src, e))
    if len(missing) == 1:
        raise missing[0][1]
    if missing:
        names = "; ".join(f"{s.archive} (tag {s.tag} of {s.urls[0] if s.urls else s.name}, commit {s.commit[:12]})"
                          for s, _ in missing)
        raise UserError(f"{len(missing)} source archives not found: {names}: put each, under that name (upstream's "
                        f"tag archive, or `git archive` of the tag), into {_where_to_put(dirs)}", SOURCE_UNREACHABLE)
    return fetched


def fetch_artifact(art: Artifact, *, cache: Path, dirs: list[Path], offline: bool) -> Path:
    what = f"{art.name} {art.version}"
    try:
        path, _, _ = fetch_file(art.filename, (art.url,), sha256_verifier(art.sha256, what), what, cache=cache,
                                dirs=dirs, offline=offline)
    except Unreachable as e:
        raise UserError(f"{what} not reachable: {e}", SOURCE_UNREACHABLE) from None
    return path


def fetch_all(stack: Stack, dest: Path, *, dirs: list[Path], offline: bool, cuda: bool = True,
              sources: tuple[SourceArchive, ...] | None = None) -> dict:
    """`ucx fetch --dest DIR`: source archives (default: UCX's) + (optionally) CUDA wheels and link .debs, verified,
    into DIR. DIR doubles as a cache and, with its manifest.json, as the input of an offline build
    (`build --sources DIR --offline`, e.g. inside `docker build --network none`)."""
    fetch_sources(sources or (stack.ucx,), cache=dest, dirs=dirs, offline=offline)
    if cuda:
        for art in stack.cuda_header_wheels + stack.cuda_link_debs:
            fetch_artifact(art, cache=dest, dirs=dirs, offline=offline)
    return read_manifest(dest)


def _copy_verified(path: Path, dest: Path) -> Path:
    """Copy an already verified file into dest (whole or not at all); no-op when it is already there."""
    final = dest / path.name
    if final.exists() and final.resolve() == path.resolve():
        return final
    with atomic_path(final) as tmp:
        shutil.copyfile(path, tmp)
        os.chmod(tmp, 0o644)
    return final
