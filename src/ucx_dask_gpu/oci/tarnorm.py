"""Deterministic tar archives: the same file tree always gives the same bytes.

`normalise_tar` rewrites a tar (a Docker layer, a debootstrap root filesystem) so that its bytes depend only on the
files' paths, types, contents, permission bits, numeric owners, link targets, device numbers and extended
attributes:

- entries sorted by path (component-wise, so a directory comes before what it holds), duplicates resolved as an
  extractor would (the last one wins), `./` prefixes and the root entry dropped;
- mtimes clamped to SOURCE_DATE_EPOCH (never raised), as whole seconds;
- numeric uid/gid only (user/group names emptied), no atime/ctime, no pax headers except `SCHILY.xattr.*`
  (capabilities, ACLs) written in sorted order; POSIX pax format, so long names and big files stay exact;
- hard links re-anchored on the first name in sorted order (an extractor needs the target before the link);
- Docker whiteouts (`.wh.NAME`, `.wh..wh..opq`) kept as the empty files they are;
- sparse / contiguous / old-style regular files written as plain regular files.
A fix hook (`Fix`, below) may drop or rewrite entries on the way: layer.py's fixes.
"""
from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass, field
from typing import BinaryIO, Callable, Iterable

from ..errors import BAD_ARCHIVE, UserError

WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
_KEEP_PAX_PREFIX = "SCHILY.xattr."
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE, tarfile.GNUTYPE_SPARSE)
_TYPE_NAMES = {tarfile.REGTYPE: "file", tarfile.LNKTYPE: "hardlink", tarfile.SYMTYPE: "symlink",
               tarfile.CHRTYPE: "char", tarfile.BLKTYPE: "block", tarfile.DIRTYPE: "dir", tarfile.FIFOTYPE: "fifo"}


def clean_name(name: str) -> str:
    """`./usr/bin/` -> `usr/bin`; `.` and `./` -> `` (the root)."""
    while name.startswith("./"):
        name = name[2:]
    name = name.lstrip("/").rstrip("/")
    return "" if name == "." else name


def sort_key(name: str) -> tuple[bytes, ...]:
    """Component-wise byte order: `a` < `a/b` < `a.b` (GNU tar --sort=name order; parents before children)."""
    return tuple(part.encode("utf-8", "surrogateescape") for part in name.split("/"))


@dataclass
class Entry:
    """What the listing records for one written entry (also what two builds are compared on)."""

    path: str
    type: str
    mode: int
    uid: int
    gid: int
    mtime: int
    size: int
    sha256: str = ""      # regular files
    link: str = ""        # symlink / hardlink target
    dev: str = ""         # char/block "major:minor"
    xattrs: dict[str, str] = field(default_factory=dict)

    def as_list(self) -> list:
        return [self.path, self.type, f"{self.mode:04o}", f"{self.uid}:{self.gid}", self.mtime, self.size,
                self.sha256 or self.link or self.dev, self.xattrs]


# A fix hook sees every entry (a cleaned TarInfo, mtime not yet clamped) and a function that reads its contents
# (regular files only; call it only for small files you need), and returns:
#   None            -> keep unchanged
#   "drop"          -> leave the entry out
#   bytes           -> keep the entry, with these contents (size adjusted; b"" truncates)
Fix = Callable[[tarfile.TarInfo, Callable[[], bytes]], "str | bytes | None"]


@dataclass
class NormaliseResult:
    sha256: str                 # digest of the uncompressed output (a Docker diff_id)
    size: int
    entries: list[Entry]
    dropped: list[str]          # paths the fix hook left out
    rewritten: list[str]        # paths whose contents the fix hook replaced


class HashingWriter(io.RawIOBase):
    """Writes through to `out`, counting the bytes and hashing them (sha256)."""

    def __init__(self, out: BinaryIO):
        self.out, self.h, self.n = out, hashlib.sha256(), 0

    def writable(self):
        return True

    def write(self, b):
        b = bytes(b)
        self.out.write(b)
        self.h.update(b)
        self.n += len(b)
        return len(b)


class _HashingReader(io.RawIOBase):
    def __init__(self, src: BinaryIO):
        self.src, self.h = src, hashlib.sha256()

    def readable(self):
        return True

    def readinto(self, b):
        data = self.src.read(len(b))
        n = len(data)
        b[:n] = data
        self.h.update(data)
        return n


def _open_members(src: tarfile.TarFile, where: str) -> dict[str, tarfile.TarInfo]:
    """Cleaned name -> last member with that name (the one an extractor would leave on disk)."""
    latest: dict[str, tarfile.TarInfo] = {}
    try:
        for m in src.getmembers():
            name = clean_name(m.name)
            if not name:
                continue
            if m.type not in _REGULAR + (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE,
                                         tarfile.DIRTYPE, tarfile.FIFOTYPE):
                raise UserError(f"{where}: unsupported tar entry type {m.type!r} for {name}", BAD_ARCHIVE)
            latest.pop(name, None)   # re-insert so the dict keeps the last occurrence
            latest[name] = m
    except (tarfile.TarError, EOFError, OSError) as e:
        raise UserError(f"{where}: not a readable tar archive: {e}", BAD_ARCHIVE) from None
    return latest


def normalise_tar(src: tarfile.TarFile, out: BinaryIO, epoch: int, *, where: str = "archive",
                  fix: Fix | None = None, extra: Iterable[tuple[tarfile.TarInfo, bytes]] = ()) -> NormaliseResult:
    """Write the normalised form of `src` (a random-access TarFile) to `out`; see the module docstring. `extra` entries
    (TarInfo with a clean name, bytes) are merged in as if they were part of `src`."""
    members = _open_members(src, where)
    extras: dict[str, tuple[tarfile.TarInfo, bytes]] = {}
    for ti, data in extra:
        extras[clean_name(ti.name)] = (ti, data)
        members.pop(clean_name(ti.name), None)
    kept, replaced, dropped, rewritten = _apply_fix(src, members, fix)
    anchor_of, content_of = _hardlink_anchors(kept)

    entries: list[Entry] = []
    writer = HashingWriter(out)
    buffered = io.BufferedWriter(writer, buffer_size=1 << 20)
    try:
        dst = tarfile.open(fileobj=buffered, mode="w|", format=tarfile.PAX_FORMAT)
        dst.copybufsize = 1 << 20
    except tarfile.TarError as e:  # pragma: no cover - writing to a stream does not fail here
        raise UserError(f"{where}: {e}", BAD_ARCHIVE) from None
    try:
        for name in sorted(set(kept) | set(extras), key=sort_key):
            if name in extras:
                ti, data = extras[name]
                _write(dst, _cleaned(ti, name, epoch), data, entries)
            else:
                _write_kept(dst, src, name, kept, replaced, anchor_of, content_of, epoch, entries)
        dst.close()
        buffered.flush()
    except (tarfile.TarError, EOFError) as e:
        raise UserError(f"{where}: cannot read entry: {e}", BAD_ARCHIVE) from None
    return NormaliseResult(writer.h.hexdigest(), writer.n, entries, sorted(dropped, key=sort_key),
                           sorted(rewritten, key=sort_key))


def _apply_fix(src: tarfile.TarFile, members: dict[str, tarfile.TarInfo], fix: Fix | None):
    """The fix hook's verdict on every member: (kept members, name -> replaced contents, dropped, rewritten)."""
    dropped: list[str] = []
    rewritten: list[str] = []
    replaced: dict[str, bytes] = {}
    kept: dict[str, tarfile.TarInfo] = {}
    for name, m in members.items():
        action = None
        if fix:
            def read(m=m) -> bytes:
                f = src.extractfile(m) if m.type in _REGULAR else None
                return f.read() if f else b""
            action = fix(_cleaned(m, name), read)
        if action == "drop":
            dropped.append(name)
            continue
        if isinstance(action, bytes):
            replaced[name] = action
            rewritten.append(name)
        kept[name] = m
    return kept, replaced, dropped, rewritten


def _hardlink_anchors(kept: dict[str, tarfile.TarInfo]) -> tuple[dict[str, str], dict[str, str]]:
    """(link name -> anchor name, anchor name -> member whose data it carries)."""
    # Hard links: group every name of one file, anchor the group on its first name in sorted order.
    anchor_of: dict[str, str] = {}
    content_of: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for name, m in kept.items():
        if m.type == tarfile.LNKTYPE:
            target = clean_name(m.linkname)
            # follow chains (a link to a link) to the member that has the data
            seen = set()
            while target in kept and kept[target].type == tarfile.LNKTYPE and target not in seen:
                seen.add(target)
                target = clean_name(kept[target].linkname)
            if target not in kept or kept[target].type not in _REGULAR:
                # Target outside this archive (or dropped): keep the link as written; extractors will decide.
                continue
            groups.setdefault(target, [target]).append(name)
    for target, names in groups.items():
        names.sort(key=sort_key)
        anchor = names[0]
        content_of[anchor] = target
        for n in names[1:]:
            anchor_of[n] = anchor
    return anchor_of, content_of


def _write_kept(dst: tarfile.TarFile, src: tarfile.TarFile, name: str, kept: dict[str, tarfile.TarInfo],
                replaced: dict[str, bytes], anchor_of: dict[str, str], content_of: dict[str, str], epoch: int,
                entries: list[Entry]) -> None:
    """One member of `src` in its normal form: a link to its anchor, the anchor with the group's data, or itself."""
    m = kept[name]
    ti = _cleaned(m, name, epoch)
    if name in anchor_of:
        ti.type, ti.linkname, ti.size = tarfile.LNKTYPE, anchor_of[name], 0
        _write(dst, ti, None, entries)
        return
    data_member = kept[content_of[name]] if name in content_of else m
    if name in content_of:
        # This name becomes the anchor: a regular file with the group's data and metadata.
        ti = _cleaned(data_member, name, epoch)
        ti.type, ti.linkname = tarfile.REGTYPE, ""
    if ti.type not in _REGULAR:
        ti.size = 0
        _write(dst, ti, None, entries)
        return
    ti.type = tarfile.REGTYPE
    data = replaced.get(name) if name in replaced else replaced.get(content_of.get(name, ""))
    if data is not None:
        _write(dst, ti, data, entries)
    else:
        ti.size = data_member.size
        _write_stream(dst, ti, src.extractfile(data_member), entries)


def _cleaned(m: tarfile.TarInfo, name: str, epoch: int | None = None) -> tarfile.TarInfo:
    """A fresh TarInfo carrying only what the normal form keeps (with `epoch`: its mtime clamped to it)."""
    ti = tarfile.TarInfo(name)
    ti.type = tarfile.REGTYPE if m.type in _REGULAR else m.type
    ti.mode = m.mode & 0o7777
    ti.uid, ti.gid = int(m.uid), int(m.gid)
    ti.uname = ti.gname = ""
    ti.mtime = int(m.mtime) if epoch is None else min(int(m.mtime), epoch)
    ti.size = m.size if m.type in _REGULAR else 0
    if m.type in (tarfile.SYMTYPE,):
        ti.linkname = m.linkname
    elif m.type == tarfile.LNKTYPE:
        ti.linkname = clean_name(m.linkname)
    if m.type in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = m.devmajor, m.devminor
    ti.pax_headers = {k: m.pax_headers[k] for k in sorted(m.pax_headers) if k.startswith(_KEEP_PAX_PREFIX)}
    return ti


def _entry(ti: tarfile.TarInfo, sha: str) -> Entry:
    return Entry(path=ti.name, type=_TYPE_NAMES.get(ti.type, ti.type), mode=ti.mode, uid=ti.uid, gid=ti.gid,
                 mtime=int(ti.mtime), size=ti.size if ti.type == tarfile.REGTYPE else 0, sha256=sha,
                 link=ti.linkname if ti.type in (tarfile.SYMTYPE, tarfile.LNKTYPE) else "",
                 dev=f"{ti.devmajor}:{ti.devminor}" if ti.type in (tarfile.CHRTYPE, tarfile.BLKTYPE) else "",
                 xattrs={k[len(_KEEP_PAX_PREFIX):]: v for k, v in ti.pax_headers.items()})


def _write(dst: tarfile.TarFile, ti: tarfile.TarInfo, data: bytes | None, entries: list[Entry]):
    if data is None:
        dst.addfile(ti)
        entries.append(_entry(ti, ""))
        return
    ti.size = len(data)
    dst.addfile(ti, io.BytesIO(data))
    entries.append(_entry(ti, hashlib.sha256(data).hexdigest()))


def _write_stream(dst: tarfile.TarFile, ti: tarfile.TarInfo, f, entries: list[Entry]):
    reader = _HashingReader(f)
    dst.addfile(ti, io.BufferedReader(reader, buffer_size=1 << 20))
    entries.append(_entry(ti, reader.h.hexdigest()))
