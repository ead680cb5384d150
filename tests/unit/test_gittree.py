"""The content tree id of a source archive equals what git computes, and the pins in stack.toml match the archives
upstream tags give (checked on the source mirror when this machine has one)."""
from __future__ import annotations

import csv
import tarfile
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.ucxbuild.gittree import NotASourceArchive, content_tree

REPO = Path(__file__).resolve().parents[2]


def test_tree_id_is_gits_for_files_modes_symlinks_and_empty_dirs(tmp_path, make_archive, git_write_tree):
    files = {"a.txt": b"a\n", "bin/run.sh": b"#!/bin/sh\n", "dir/sub/x.c": b"int x;\n", "dir-x": b"",
             "dir.y": b"order matters\n", "empty": b""}
    archive = make_archive(tmp_path / "t.tar.gz", "proj-1.0", files, executable={"bin/run.sh"},
                           symlinks={"link": "dir/sub/x.c"}, empty_dirs=("external/submodule",))
    assert content_tree(archive) == git_write_tree(tmp_path, archive)


def test_a_one_byte_change_changes_the_id(tmp_path, make_archive):
    a = make_archive(tmp_path / "a.tar.gz", "p", {"f": b"1"})
    b = make_archive(tmp_path / "b.tar.gz", "p", {"f": b"2"})
    assert content_tree(a) != content_tree(b)


def test_two_top_level_directories_are_refused(tmp_path):
    with tarfile.open(tmp_path / "two.tar", "w") as tar:
        for top in ("p", "q"):
            info = tarfile.TarInfo(f"{top}/f")
            tar.addfile(info)
    with pytest.raises(NotASourceArchive, match="more than one top-level"):
        content_tree(tmp_path / "two.tar")


MIRROR = REPO.parent / "shared" / "sources"


@pytest.mark.skipif(not (MIRROR / "MANIFEST.tsv").is_file(), reason=f"no source mirror at {MIRROR}")
def test_pins_match_the_mirror_and_its_manifest():
    """Every pinned archive in the mirror has the pinned sha256 and content tree; where the upstream repository has
    no submodules and no export-subst files, the content tree is the tag's own tree id (MANIFEST.tsv)."""
    st = stack.load(REPO / "stack.toml")
    manifest = {row["file"]: row for row in csv.DictReader((MIRROR / "MANIFEST.tsv").open(), delimiter="\t")}
    same_as_upstream = set()
    for src in st.source_archives():
        row = manifest[src.archive]
        assert (row["commit"], row["sha256"]) == (src.commit, src.sha256), src.name
        assert content_tree(MIRROR / src.archive) == src.content_tree, src.name
        if row["tree"] == src.content_tree:
            same_as_upstream.add(src.name)
    assert {"UCXX", "rapids-cmake"} <= same_as_upstream
