"""The git tree id of a source archive's content: how a tag archive is verified whatever its compression (GitHub's
tag archive and a mirror's `git archive` of the tag hold the same files in other bytes). The result equals `git add
-A -f && git write-tree` on the unpacked archive; ucx-src-build/README.md says when that differs from the upstream
tag's tree id (submodules, `export-subst`), which is why stack.toml pins the archived content's id.

Standard library only: the UCX build runs it in the image's builder stage and in conda build environments.
"""
from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path, PurePosixPath

_FILE, _EXEC, _LINK, _TREE = b"100644", b"100755", b"120000", b"40000"


class NotASourceArchive(ValueError):
    """The archive holds something a git tree cannot (devices, hard links, paths outside its top directory)."""


def _blob_id(data: bytes) -> bytes:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).digest()


def _tree_id(entries: dict) -> bytes | None:
    """entries: name -> (mode, id) for blobs or name -> dict for directories. None for an empty tree."""
    rows = []
    for name, value in entries.items():
        if isinstance(value, dict):
            sub = _tree_id(value)
            if sub is not None:
                rows.append((name.encode() + b"/", _TREE, name.encode(), sub))
        else:
            rows.append((name.encode(), value[0], name.encode(), value[1]))
    if not rows:
        return None
    rows.sort(key=lambda r: r[0])  # git orders a directory's entries by name, a tree's name taken with a trailing '/'
    body = b"".join(mode + b" " + name + b"\0" + oid for _, mode, name, oid in rows)
    return hashlib.sha1(b"tree %d\0" % len(body) + body).digest()


def content_tree(archive: Path) -> str:
    """Tree id (40 hex digits) of the files below the archive's single top-level directory."""
    root: dict = {}
    top: str | None = None
    with tarfile.open(archive) as tar:
        for member in tar:
            if member.type in (tarfile.XGLTYPE, tarfile.XHDTYPE):
                continue
            parts = PurePosixPath(member.name).parts
            if not parts or parts[0] in ("/", "..") or ".." in parts:
                raise NotASourceArchive(f"member {member.name!r} points outside the archive")
            if top is None:
                top = parts[0]
            elif parts[0] != top:
                raise NotASourceArchive(f"more than one top-level directory ({top!r}, {parts[0]!r})")
            rel = parts[1:]
            if not rel:
                continue
            node = root
            for part in rel[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise NotASourceArchive(f"{member.name!r} is below a file")
            name = rel[-1]
            if member.isdir():
                node.setdefault(name, {})
            elif member.issym():
                node[name] = (_LINK, _blob_id(member.linkname.encode()))
            elif member.isfile():
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                node[name] = (_EXEC if member.mode & 0o111 else _FILE, _blob_id(data))
            else:
                raise NotASourceArchive(f"member {member.name!r} is neither a file, a directory nor a symlink")
    tree = _tree_id(root)
    if tree is None:
        raise NotASourceArchive("the archive holds no files")
    return tree.hex()
