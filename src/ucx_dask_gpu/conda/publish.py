"""What may be published: the packages of the directories an upload reads, none of them built with stand-ins
(docs/conda.md says what is refused). A package `make channel` builds on a host without channel access had its
compilers, sysroot, CUDA and libraries stood in for by that machine's (tools/conda_standin): it proves the recipes
build, it is not a package for users. Two files of one name (the same noarch package from two build jobs) are refused
too: no copy wins silently.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from ..errors import PACKAGE_INVALID, STANDIN_REFUSED, UserError

SUFFIXES = (".conda", ".tar.bz2")
# Ends the build string of every stand-in package (tools/conda_standin/standin.py gives it).
STANDIN_SUFFIX = "_standin"
# Where ci/conda_build.sh writes what it builds with conda-forge's real requirements, and what an upload reads
# (relative to the repository): a stand-in channel is never written there.
PUBLISH_DIR = "build/channel"


def packages(dirs: list[Path]) -> list[Path]:
    """Every conda package under `dirs` (a channel's subdirs, or the workflow's downloaded artifacts)."""
    return sorted(p for d in dirs for p in d.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))


def standin_mark(pkg: Path) -> str | None:
    """Why `pkg` is a stand-in build (its about.json extra.standin, or its build string), or None."""
    import conda_package_handling.api as cph

    with tempfile.TemporaryDirectory() as tmp:
        try:
            cph.extract(str(pkg), dest_dir=tmp, components="info")
            index = json.loads((Path(tmp) / "info/index.json").read_text())
            about_file = Path(tmp) / "info/about.json"
            about = json.loads(about_file.read_text()) if about_file.is_file() else {}
        except Exception as e:  # OSError, JSON errors, and cph's own types for a broken archive
            raise UserError(f"{pkg}: not a readable conda package ({e})", PACKAGE_INVALID) from None
    if "standin" in (about.get("extra") or {}):
        return "about.json extra.standin"
    if str(index.get("build", "")).endswith(STANDIN_SUFFIX):
        return f"build string {index['build']}"
    return None


def check(dirs: list[Path]) -> list[Path]:
    """The packages to publish from `dirs`; refuses (one line) none at all, two of one name, and any stand-in."""
    found = packages(dirs)
    if not found:
        raise UserError(f"no conda packages under {', '.join(map(str, dirs))}: nothing to publish", PACKAGE_INVALID)
    by_name: dict[str, Path] = {}
    for p in found:
        if p.name in by_name:
            raise UserError(f"{p.name} twice ({by_name[p.name]}, {p}): publish one of them, not whichever comes "
                            f"first", PACKAGE_INVALID)
        by_name[p.name] = p
    marked = [(p, why) for p in found if (why := standin_mark(p))]
    if marked:
        p, why = marked[0]
        more = f" (and {len(marked) - 1} more)" if len(marked) > 1 else ""
        raise UserError(f"{p}: built with stand-ins ({why}){more}; stand-in packages are never published, nothing "
                        f"was uploaded", STANDIN_REFUSED)
    return found
