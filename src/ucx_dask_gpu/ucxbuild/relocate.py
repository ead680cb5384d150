"""Make an installed UCX prefix relocatable and byte-stable.

libtool bakes RUNPATH=<prefix>/lib (modules: also <prefix>/lib/ucx) into every binary; we rewrite it relative to
$ORIGIN (bin -> ../lib, lib -> ., lib/ucx -> ..:.). UCX itself finds lib/ucx/ modules relative to libucs.so (dladdr), so a copied prefix works
without LD_LIBRARY_PATH. pkg-config and CMake files get prefixes computed from their own location; libtool .la files
(absolute paths, not needed by anyone linking against a shared UCX) are dropped.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import BUILD_FAILED, UserError
from ..fsutil import is_elf

RPATHS = {"bin": "$ORIGIN/../lib", "lib": "$ORIGIN", "lib/ucx": "$ORIGIN/.."}
PC_PREFIX = "${pcfiledir}/../.."
CMAKE_PREFIX = 'get_filename_component(prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)'


def elf_files(root: Path) -> dict[str, list[Path]]:
    """Regular ELF files per directory that gets a RUNPATH (symlinks point at these)."""
    return {sub: sorted(p for p in (root / sub).iterdir() if is_elf(p)) if (root / sub).is_dir() else []
            for sub in RPATHS}


def _run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"{cmd[0]} failed on {cmd[-1]}: {last}", BUILD_FAILED)
    return proc.stdout


def strip_debug(root: Path) -> int:
    """Drop debug sections (they hold build paths and most of the size); symbols stay for backtraces."""
    strip = os.environ.get("STRIP") or "strip"
    n = 0
    for files in elf_files(root).values():
        for f in files:
            _run([strip, "--strip-debug", "--enable-deterministic-archives", str(f)])
            n += 1
    return n


def relative_runpath(original: str, build_prefix: str, sub: str) -> str:
    """RPATHS[sub] first, then each original entry inside the build prefix as an $ORIGIN path (libtool gives
    lib/ucx/ modules <prefix>/lib:<prefix>/lib/ucx: libuct_rdmacm.so needs its sibling libuct_ib.so.0).
    Entries outside the prefix (the build's CUDA link dir) are dropped."""
    entries = [RPATHS[sub]]
    for e in filter(None, original.split(":")):
        if e == build_prefix or e.startswith(build_prefix.rstrip("/") + "/"):
            rel = os.path.relpath(os.path.join("/", os.path.relpath(e, build_prefix)), os.path.join("/", sub))
            new = "$ORIGIN" if rel == "." else f"$ORIGIN/{rel}"
            if new not in entries:
                entries.append(new)
    return ":".join(entries)


def set_runpaths(root: Path, build_prefix: str) -> dict[str, str]:
    """Rewrite RUNPATH of every ELF under bin/, lib/, lib/ucx/. Returns {relative path: new runpath}."""
    done = {}
    for sub, files in elf_files(root).items():
        for f in files:
            new = relative_runpath(runpath_of(f), build_prefix, sub)
            _run(["patchelf", "--set-rpath", new, str(f)])
            done[str(f.relative_to(root))] = new
    return done


def runpath_of(path: Path) -> str:
    return _run(["patchelf", "--print-rpath", str(path)]).strip()


def _rewrite(files: list[Path], pattern: str, replacement: str) -> list[Path]:
    """Every file whose text `pattern` changes, rewritten."""
    changed = []
    for f in files:
        text = f.read_text()
        new = re.sub(pattern, replacement, text)
        if new != text:
            f.write_text(new)
            changed.append(f)
    return changed


def drop_libtool_archives(root: Path) -> list[Path]:
    gone = sorted(root.glob("lib/*.la")) + sorted(root.glob("lib/ucx/*.la"))
    for f in gone:
        f.unlink()
    return gone


def text_files_mentioning(root: Path, needle: str) -> list[str]:
    """Non-ELF files that still name `needle` (the build-time prefix): what relocation did not cover."""
    raw = needle.encode()
    return [str(p.relative_to(root)) for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and not is_elf(p) and raw in p.read_bytes()]


def clamp_mtimes(root: Path, epoch: int) -> None:
    """Every path's mtime = SOURCE_DATE_EPOCH, so archives/images of the prefix do not depend on build time."""
    for dirpath, dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames + dirnames:
            os.utime(os.path.join(dirpath, name), (epoch, epoch), follow_symlinks=False)
    os.utime(root, (epoch, epoch))


def make_relocatable(root: Path, build_prefix: str) -> dict:
    """All of the above on an installed tree `root` that was configured for `build_prefix`."""
    if shutil.which("patchelf") is None:
        raise UserError("patchelf not found (Debian: apt-get install patchelf)", BUILD_FAILED)
    dropped = drop_libtool_archives(root)
    runpaths = set_runpaths(root, build_prefix)
    pcs = _rewrite(sorted((root / "lib" / "pkgconfig").glob("*.pc")), r"(?m)^prefix\s*=.*$", f"prefix={PC_PREFIX}")
    cmakes = _rewrite(sorted((root / "lib" / "cmake").rglob("*.cmake")), r'(?m)^set\(prefix "[^"]*"\)$', CMAKE_PREFIX)
    return {
        "runpaths": dict(sorted(runpaths.items())),
        "pkgconfig_rewritten": [str(p.relative_to(root)) for p in pcs],
        "cmake_rewritten": [str(p.relative_to(root)) for p in cmakes],
        "libtool_archives_dropped": len(dropped),
        "files_still_naming_build_prefix": text_files_mentioning(root, build_prefix),
    }
