"""Files: written so that readers never see half a file (temp path in the same directory, then rename), their sha256,
and whether one is an ELF binary. Standard library only."""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

ELF_MAGIC = b"\x7fELF"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def is_elf(path: str | os.PathLike) -> bool:
    """A regular file (not a symlink) that starts with the ELF magic."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == ELF_MAGIC


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; rename it over `dest` only if the block succeeds.

    Works for files and directories (whatever the caller creates at the yielded path).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    target = tmp / dest.name
    try:
        yield target
        if dest.is_dir() and not dest.is_symlink():
            shutil.rmtree(dest)
        os.replace(target, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def atomic_write_bytes(dest: str | os.PathLike, data: bytes, mode: int = 0o644) -> Path:
    with atomic_path(dest) as tmp:
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
    return Path(dest)


def atomic_write_text(dest: str | os.PathLike, text: str, mode: int = 0o644) -> Path:
    return atomic_write_bytes(dest, text.encode(), mode)


def atomic_write_many(files: dict[str | os.PathLike, bytes | str]) -> list[Path]:
    """Write several files so that either all appear or none: render everything first, then rename each.

    Renames are individually atomic; a failure while rendering leaves nothing behind.
    """
    staged: list[tuple[Path, Path, Path]] = []
    try:
        for dest, data in files.items():
            dest = Path(dest)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmpdir = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
            tmp = tmpdir / dest.name
            tmp.write_bytes(data.encode() if isinstance(data, str) else data)
            os.chmod(tmp, 0o644)
            staged.append((tmpdir, tmp, dest))
        for _, tmp, dest in staged:
            os.replace(tmp, dest)
        return [dest for _, _, dest in staged]
    finally:
        for tmpdir, _, _ in staged:
            shutil.rmtree(tmpdir, ignore_errors=True)
