"""UCXX patches: found under ucx-src-build/patches/ucxx-<version>/, part of the build's input hash, and every one
carried applies to the pinned UCXX source (checked against a source mirror's archive when one holds it)."""
from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.ucxbuild import ucxx
from ucx_dask_gpu.ucxbuild.fetch import local_dirs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def st() -> stack.Stack:
    return stack.load(REPO / "stack.toml")


def test_patches_live_beside_ucxs_under_their_own_version_dir(st, tmp_path):
    version = st.ucxx.source.version
    (tmp_path / f"ucxx-{version}").mkdir()
    (tmp_path / st.ucx.version).mkdir()
    for name in ("0002-b.patch", "0001-a.patch", "notes.txt"):
        (tmp_path / f"ucxx-{version}" / name).write_text(name)
    (tmp_path / st.ucx.version / "0001-ucx.patch").write_text("ucx")
    assert [p.name for p in ucxx.ucxx_patches(st, tmp_path)] == ["0001-a.patch", "0002-b.patch"]
    assert ucxx.ucxx_patches(st, tmp_path / "none") == []


def test_patches_change_the_input_key(st, tmp_path):
    info = {"ucx_version": st.ucx.version, "source": {"content_tree": "x"}, "patches": [], "configure": {}}
    p = tmp_path / "0001-a.patch"
    p.write_text("one")
    without = ucxx.input_key(st, info, [])
    with_one = ucxx.input_key(st, info, [p])
    p.write_text("two")
    assert len({without, with_one, ucxx.input_key(st, info, [p])}) == 3


def test_carried_patches_apply_to_the_pinned_source(st, tmp_path):
    """In order, as the build applies them (a later patch may build on an earlier one), each without fuzz."""
    patches = ucxx.ucxx_patches(st)
    assert patches, "ucx-src-build/patches/ucxx-<version>/ carries the UCXX patches"
    found = [d / st.ucxx.source.archive for d in local_dirs(st) if (d / st.ucxx.source.archive).is_file()]
    if not found or shutil.which("patch") is None:
        pytest.skip(f"needs {st.ucxx.source.archive} in a source mirror ([sources].mirror_dirs) and `patch`")
    archive = found[0]
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    [src] = [d for d in tmp_path.iterdir() if d.is_dir()]
    for p in patches:
        proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "--fuzz=0", "-i", str(p)], cwd=src,
                              capture_output=True, text=True)
        assert proc.returncode == 0, f"{p.name}: {proc.stdout}{proc.stderr}"
        assert "offset" not in proc.stdout and not list(src.rglob("*.rej")), f"{p.name}: {proc.stdout}"
