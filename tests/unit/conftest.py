"""Fixtures for the source-archive tests: small tag-like archives and their git tree ids from real git."""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import pytest


def _make_archive(path: Path, top: str, files: dict[str, bytes], executable: set[str] = frozenset(),
                  symlinks: dict[str, str] | None = None, empty_dirs: tuple[str, ...] = ()) -> Path:
    """A .tar.gz like `git archive --prefix=TOP/`: files (some executable), symlinks and empty directories."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for d in (top, *(f"{top}/{e}" for e in empty_dirs)):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o775
            tar.addfile(info)
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mode = len(data), 0o775 if name in executable else 0o664
            tar.addfile(info, io.BytesIO(data))
        for name, target in sorted((symlinks or {}).items()):
            info = tarfile.TarInfo(f"{top}/{name}")
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
    return path


def _git_write_tree(work: Path, archive: Path) -> str:
    """The tree id git itself gives the unpacked archive (`git add -A -f && git write-tree`)."""
    root = work / f"git-{archive.name}"
    root.mkdir(parents=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="tar")
    (top,) = list(root.iterdir())
    subprocess.run(["git", "init", "-q"], cwd=top, check=True)
    subprocess.run(["git", "add", "-A", "-f"], cwd=top, check=True)
    return subprocess.run(["git", "write-tree"], cwd=top, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def make_archive():
    return _make_archive


@pytest.fixture
def git_write_tree():
    return _git_write_tree
