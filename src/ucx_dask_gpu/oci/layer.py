"""One image layer (or a root filesystem tar) in its normal form (`tarnorm`), and the fixes it needs on the way
(docs/reproducibility.md lists them): a timestamp .pyc that the mtime clamp would make stale becomes a checked-hash
.pyc with the same code, /etc/shadow days are clamped, build litter is dropped and reported. `Overlay` follows what
the layers seen so far hold. Pure: tar files in, tar files out; no Docker.
"""
from __future__ import annotations

import importlib.util
import io
import posixpath
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import BAD_ARCHIVE, UserError
from ..fsutil import atomic_path
from ..stack import STACK_ID_FILE
from ..ucx.install import BUILD_INFO, INSTALLED_UCXX_BUILD_INFO
from . import tarnorm
from .sbom import SBOM_IN_IMAGE

# Build litter: files below these directories are dropped from every layer (directories themselves stay, and so
# do whiteouts: deleting a lower file is not litter). A Dockerfile should not leave them; the normaliser reports
# each one it drops, so the cause can be fixed where it is made.
LITTER_DIRS = ("root/.cache/", "tmp/", "var/tmp/", "var/cache/apt/", "var/lib/apt/lists/", "var/log/",
               "var/cache/ldconfig/", "run/", "dev/", "proc/", "sys/")
LITTER_RE = re.compile(r"^(home/[^/]+/\.cache/|var/cache/debconf/[^/]+-old$|var/lib/dpkg/[^/]+-old$)")
# The image's stack id as its layers name it (no leading slash).
STACK_ID_IN_LAYER = str(STACK_ID_FILE).lstrip("/")


# --- content fixes --------------------------------------------------------------------------------------------------

def fix_shadow(data: bytes, epoch: int) -> bytes | None:
    """Clamp the "last password change" field (days since 1970) of shadow(5) lines to SOURCE_DATE_EPOCH's day."""
    days = epoch // 86400
    changed = False
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        f = line.split(b":")
        if len(f) >= 3 and f[2].isdigit() and int(f[2]) > days:
            f[2] = str(days).encode()
            lines[i] = b":".join(f)
            changed = True
    return b"\n".join(lines) if changed else None


def pyc_source(pyc_path: str) -> str | None:
    """`d/__pycache__/m.cpython-311.opt-1.pyc` -> `d/m.py` (None for legacy or sourceless layouts)."""
    head, _, fname = pyc_path.rpartition("/")
    if not fname.endswith(".pyc") or not (head == "__pycache__" or head.endswith("/__pycache__")):
        return None
    parent = head[: -len("__pycache__")].rstrip("/")
    module = fname.split(".", 1)[0]
    return f"{parent}/{module}.py" if parent else f"{module}.py"


def fix_pyc(pyc: bytes, source: bytes, source_mtime: int, epoch: int) -> bytes | None:
    """A timestamp .pyc that is valid for `source` but would be stale once the source's mtime is clamped to `epoch`
    becomes a checked-hash .pyc with the same code object (PEP 552). Anything else is left alone (None):
    hash-based already, stale already (recompiling it is Python's business), still valid after clamping, or
    compiled by a different Python than this one (its source hash key would differ)."""
    if len(pyc) < 16 or pyc[:4] != importlib.util.MAGIC_NUMBER:
        return None
    if int.from_bytes(pyc[4:8], "little") != 0:
        return None
    mtime, size = int.from_bytes(pyc[8:12], "little"), int.from_bytes(pyc[12:16], "little")
    if mtime != (source_mtime & 0xFFFFFFFF) or size != (len(source) & 0xFFFFFFFF):
        return None
    if source_mtime <= epoch:
        return None
    return pyc[:4] + (0b11).to_bytes(4, "little") + importlib.util.source_hash(source) + pyc[16:]


def is_litter(ti: tarfile.TarInfo) -> bool:
    name = ti.name
    base = name.rpartition("/")[2]
    if ti.type == tarfile.DIRTYPE or base.startswith(tarnorm.WHITEOUT_PREFIX):
        return False
    return name.startswith(LITTER_DIRS) or bool(LITTER_RE.match(name))


# --- the files of an image, layer over layer ----------------------------------------------------------------------

class Overlay:
    """What the union of the layers seen so far holds, for the few things the normaliser needs to know:
    every path (to avoid re-creating existing directories), the Python sources (for .pyc fixes) and the
    contents of the files the SBOM is made from."""

    def __init__(self):
        self.paths: set[str] = set()
        self.sources: dict[str, tuple[tarfile.TarFile, tarfile.TarInfo]] = {}
        self.watched: dict[str, bytes] = {}

    @staticmethod
    def watch(name: str) -> bool:
        return (name in ("var/lib/dpkg/status", "usr/lib/os-release", STACK_ID_IN_LAYER)
                or name.endswith(f"/{BUILD_INFO}")
                or name.endswith(f"/{INSTALLED_UCXX_BUILD_INFO}")
                or (name.endswith(".dist-info/METADATA") and name.count("/") >= 1))

    def whiteout(self, name: str) -> None:
        """Apply one whiteout entry of an upper layer to what the lower layers hold."""
        head, _, base = name.rpartition("/")
        if base == tarnorm.OPAQUE_WHITEOUT:
            prefix = f"{head}/" if head else ""
            gone = lambda p: p.startswith(prefix)  # noqa: E731
        else:
            target = f"{head}/{base[len(tarnorm.WHITEOUT_PREFIX):]}" if head else base[len(tarnorm.WHITEOUT_PREFIX):]
            gone = lambda p: p == target or p.startswith(target + "/")  # noqa: E731
        self.paths = {p for p in self.paths if not gone(p)}
        self.sources = {p: v for p, v in self.sources.items() if not gone(p)}
        self.watched = {p: v for p, v in self.watched.items() if not gone(p)}


# --- one layer --------------------------------------------------------------------------------------------------------

@dataclass
class LayerResult:
    diff_id: str
    size: int
    entries: list[tarnorm.Entry]
    dropped: list[str]
    rewritten: list[str]


def normalise_layer(src: tarfile.TarFile, out, epoch: int, overlay: Overlay, where: str) -> LayerResult:
    members = {tarnorm.clean_name(m.name): m for m in src.getmembers()}
    # Whiteouts act on the lower layers, before this layer's own files are added.
    for name in sorted(members, key=tarnorm.sort_key):
        if name.rpartition("/")[2].startswith(tarnorm.WHITEOUT_PREFIX):
            overlay.whiteout(name)
    seen: dict[str, bytes] = {}

    def source_of(py: str) -> tuple[bytes, int] | None:
        """(contents, mtime) of the file Python would stat for `py`: symlinks and hard links followed, this layer
        first, then the layers below."""
        for _ in range(16):
            m = members.get(py)
            tf = src
            if m is None and py in overlay.sources:
                tf, m = overlay.sources[py]
            if m is None:
                return None
            if m.type == tarfile.LNKTYPE and tf is src:
                py = tarnorm.clean_name(m.linkname)
            elif m.type == tarfile.SYMTYPE:
                target = m.linkname if m.linkname.startswith("/") else f"{py.rpartition('/')[0]}/{m.linkname}"
                py = tarnorm.clean_name(posixpath.normpath("/" + target))
            elif m.isfile():
                return tf.extractfile(m).read(), int(m.mtime)
            else:
                return None
        return None

    def fix(ti: tarfile.TarInfo, read: Callable[[], bytes]):
        name = ti.name
        if is_litter(ti):
            return "drop"
        if ti.type != tarfile.REGTYPE:
            return None
        if Overlay.watch(name):
            seen[name] = read()
        if name in ("etc/shadow", "etc/shadow-"):
            return fix_shadow(read(), epoch)
        if name.endswith(".pyc"):
            py = pyc_source(name)
            if py is None:
                return None
            src_data = source_of(py)
            if src_data is None:
                return None
            return fix_pyc(read(), src_data[0], src_data[1], epoch)
        return None

    result = tarnorm.normalise_tar(src, out, epoch, where=where, fix=fix)
    for e in result.entries:
        overlay.paths.add(e.path)
    for name, m in members.items():
        if name.endswith(".py") and (m.isfile() or m.issym()):
            overlay.sources[name] = (src, m)
    overlay.watched.update(seen)
    return LayerResult(f"sha256:{result.sha256}", result.size, result.entries, result.dropped, result.rewritten)


def sbom_layer(out, epoch: int, sbom: bytes, overlay: Overlay) -> LayerResult:
    """A layer holding only the SBOM (and the directories above it that the image does not have yet)."""
    extra = []
    parts = SBOM_IN_IMAGE.split("/")
    for i in range(1, len(parts)):
        d = "/".join(parts[:i])
        if d not in overlay.paths:
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, epoch
            extra.append((ti, b""))
    ti = tarfile.TarInfo(SBOM_IN_IMAGE)
    ti.mode, ti.mtime = 0o644, epoch
    extra.append((ti, sbom))
    empty = io.BytesIO()
    tarfile.open(fileobj=empty, mode="w").close()
    empty.seek(0)
    with tarfile.open(fileobj=empty) as src:
        result = tarnorm.normalise_tar(src, out, epoch, where="sbom layer", extra=extra)
    return LayerResult(f"sha256:{result.sha256}", result.size, result.entries, [], [])


def normalise_rootfs_tar(src: Path, dest: Path, epoch: int) -> LayerResult:
    """The normal form of a root filesystem tar, with the same fixes as an image layer (litter, shadow days, .pyc
    headers); `dest` is written whole or not at all."""
    try:
        tf = tarfile.open(src)
    except (tarfile.TarError, OSError) as e:
        raise UserError(f"{src}: not a readable tar archive: {e}", BAD_ARCHIVE) from None
    with tf, atomic_path(dest) as tmp, open(tmp, "wb") as out:
        return normalise_layer(tf, out, epoch, Overlay(), where=str(src))
