"""Source fetching: order of locations (upstream URLs, source mirrors, the cache), verification by sha256 or by the
git tree id of the content, one line and its own exit code when nothing fits, nothing half-written.

Real fetch code against real files through file:// URLs and local directories (no network); the content tree pins
come from real `git write-tree`. The HTTP behaviour (404, refused connections, a real server) is covered by
tests/integration/test_fetch_http.py.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.errors import HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ucx_dask_gpu.fsutil import sha256_file
from ucx_dask_gpu.ucxbuild import fetch

REPO = Path(__file__).resolve().parents[2]
FILES = {"configure.ac": b"AC_INIT([ucx], [9.1.0])\n", "src/ucp/ucp.c": b"int x;\n", "autogen.sh": b"#!/bin/sh\n"}


class World:
    """One pinned source archive, mirrors as directories reached by file:// URLs or searched as mirror dirs."""

    def __init__(self, tmp: Path, make_archive, git_write_tree):
        self.tmp, self.make_archive = tmp, make_archive
        self.archive = "ucx-9.1.0.tar.gz"
        self.good = make_archive(tmp / "pristine" / self.archive, "ucx-9.1.0", FILES, executable={"autogen.sh"})
        self.tree = git_write_tree(tmp / "pristine", self.good)
        self.cache = tmp / "cache"

    def mirror(self, name: str, data: bytes | None = None) -> Path:
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        (d / self.archive).write_bytes(self.good.read_bytes() if data is None else data)
        return d

    def url(self, mirror: str) -> str:
        return (self.tmp / mirror / self.archive).as_uri()

    def stack(self, urls: list[str], mirror_dirs: list[str] = ()) -> stack.Stack:
        raw = tomllib.loads((REPO / "stack.toml").read_text())
        raw["ucx"]["source"].update(version="9.1.0", archive=self.archive, sha256=sha256_file(self.good),
                                    content_tree=self.tree, urls=urls)
        raw["sources"]["mirror_dirs"] = list(mirror_dirs)
        return stack.parse(raw, self.tmp / "stack.toml")

    def fetch(self, st, dirs=(), offline=False):
        return fetch.fetch_source(st.ucx, cache=self.cache, dirs=list(dirs), offline=offline)


@pytest.fixture
def w(tmp_path, monkeypatch, make_archive, git_write_tree):
    monkeypatch.delenv(fetch.MIRROR_ENV, raising=False)
    return World(tmp_path, make_archive, git_write_tree)


def leftovers(d: Path) -> list[str]:
    """Temp files a fetch must never leave behind."""
    return sorted(p.name for p in d.glob(".*")) if d.exists() else []


def recompressed(path: Path) -> bytes:
    """The same files in another archive: uncompressed tar re-gzipped at another level (GitHub's own archives
    need not be byte-identical to a mirror's `git archive`)."""
    return gzip.compress(gzip.decompress(path.read_bytes()), compresslevel=1, mtime=0)


def test_first_reachable_url_wins(w):
    w.mirror("m2")
    st = w.stack([w.url("m1"), w.url("m2")])
    got = w.fetch(st)
    assert (got.location.kind, got.location.where, got.verified_by) == ("url", w.url("m2"), "sha256")
    assert [a.location for a in got.attempts] == [w.url("m1"), w.url("m2")]
    assert [a.outcome == "ok" for a in got.attempts] == [False, True]
    assert (w.cache / w.archive).read_bytes() == w.good.read_bytes()
    rec = got.record()
    assert rec["content_tree"] == w.tree and rec["url"] == w.url("m2") and rec["verified_by"] == "sha256"


def test_same_content_in_another_archive_is_accepted_by_its_tree(w):
    other = recompressed(w.good)
    assert other != w.good.read_bytes()
    w.mirror("github", other)
    got = w.fetch(w.stack([w.url("github")]))
    assert got.verified_by == "content tree"
    assert got.record()["sha256"] != w.stack([]).ucx.sha256, "build info records the file actually used"


def test_changed_content_is_fatal_and_leaves_nothing(w):
    evil = w.make_archive(w.tmp / "evil" / w.archive, "ucx-9.1.0", {**FILES, "src/ucp/ucp.c": b"int y;\n"},
                        executable={"autogen.sh"})
    w.mirror("bad", evil.read_bytes())
    w.mirror("good")
    # A good copy later in the list must NOT be tried: a mismatch means tampering or a wrong pin.
    with pytest.raises(UserError) as e:
        w.fetch(w.stack([w.url("bad"), w.url("good")]))
    assert e.value.exit_code == HASH_MISMATCH
    assert "content tree" in str(e.value) and w.url("bad") in str(e.value) and w.tree in str(e.value)
    assert not (w.cache / w.archive).exists() and leftovers(w.cache) == []


def test_lost_executable_bit_changes_the_tree(w):
    plain = w.make_archive(w.tmp / "plain" / w.archive, "ucx-9.1.0", FILES, executable=set())
    w.mirror("m", plain.read_bytes())
    with pytest.raises(UserError) as e:
        w.fetch(w.stack([w.url("m")]))
    assert e.value.exit_code == HASH_MISMATCH


def test_not_an_archive_is_fatal(w):
    w.mirror("m", b"<html>404 Not Found</html>")
    with pytest.raises(UserError) as e:
        w.fetch(w.stack([w.url("m")]))
    assert e.value.exit_code == HASH_MISMATCH and "unreadable archive" in str(e.value)


def test_mirrors_are_searched_after_the_urls_in_order(w, monkeypatch):
    first, env_dir, listed = w.mirror("first"), w.mirror("env"), w.mirror("listed")
    monkeypatch.setenv(fetch.MIRROR_ENV, str(env_dir))
    st = w.stack([w.url("nowhere")], mirror_dirs=[str(listed)])
    dirs = fetch.local_dirs(st, [first])
    assert dirs == [first, env_dir, listed]
    (first / w.archive).unlink()
    got = w.fetch(st, dirs=dirs)
    assert got.location.kind == "dir" and got.location.where == str(env_dir / w.archive)
    assert [a.location for a in got.attempts] == [w.url("nowhere"), str(first / w.archive), str(env_dir / w.archive)]
    assert (w.cache / w.archive).is_file(), "a mirror hit is kept in the cache too"


def test_mirror_with_wrong_content_is_fatal(w):
    local = w.mirror("local", b"not a tarball")
    with pytest.raises(UserError) as e:
        w.fetch(w.stack([w.url("nowhere")]), dirs=[local])
    assert e.value.exit_code == HASH_MISMATCH and str(local) in str(e.value)


def test_offline_skips_urls(w):
    w.mirror("m1")
    local = w.mirror("local")
    got = w.fetch(w.stack([w.url("m1")]), dirs=[local], offline=True)
    assert got.location.kind == "dir"
    assert not any(a.location.startswith("file:") for a in got.attempts)


def test_nothing_reachable_says_what_to_put_where(w):
    mirror = w.tmp / "empty-mirror"
    mirror.mkdir()
    st = w.stack([w.url("m1")])
    with pytest.raises(UserError) as e:
        w.fetch(st, dirs=[mirror])
    msg = str(e.value)
    assert e.value.exit_code == SOURCE_UNREACHABLE and "\n" not in msg
    assert w.url("m1") in msg and str(mirror) in msg and fetch.MIRROR_ENV in msg
    assert st.ucx.tag in msg and st.ucx.commit[:12] in msg and w.archive in msg
    assert not w.cache.exists() or list(w.cache.iterdir()) == []


def test_every_missing_archive_is_named_in_one_line(w):
    """`build.sh fetch --all` (`make sources`): the archives found are kept, every missing one is named at once."""
    mirror = w.mirror("local")
    st = w.stack([w.url("nowhere")])
    ucxx = dataclasses.replace(st.ucx, name="UCXX", archive="ucxx-9.tar.gz", tag="v9",
                               urls=("https://example.invalid/ucxx/v9.tar.gz",))
    cpm = dataclasses.replace(st.ucx, name="CPM.cmake", archive="CPM.cmake-1.tar.gz", tag="v1", urls=())
    with pytest.raises(UserError) as e:
        fetch.fetch_sources((st.ucx, ucxx, cpm), cache=w.cache, dirs=[mirror], offline=True)
    msg = str(e.value)
    assert e.value.exit_code == SOURCE_UNREACHABLE and "\n" not in msg
    assert msg.startswith("2 source archives not found: ucxx-9.tar.gz (tag v9 of https://example.invalid/ucxx/v9")
    assert "CPM.cmake-1.tar.gz (tag v1" in msg and w.archive not in msg
    assert "SOURCES=DIR" in msg and fetch.MIRROR_ENV in msg and str(mirror) in msg
    assert (w.cache / w.archive).is_file()  # what was found is kept, verified
    with pytest.raises(UserError) as one:  # one missing: its own line, with where it was looked for
        fetch.fetch_sources((st.ucx, cpm), cache=w.cache, dirs=[mirror], offline=True)
    assert str(one.value).startswith(f"{cpm.name} {cpm.version} ({cpm.archive}) not found (")


def test_cache_serves_when_upstream_and_mirrors_are_gone(w):
    m = w.mirror("m1")
    st = w.stack([w.url("m1")])
    w.fetch(st)
    (m / w.archive).unlink()
    got = w.fetch(st)
    assert got.location.kind == "cache" and got.record()["url"] == w.url("m1")


def test_tampered_cache_is_fatal(w):
    w.mirror("m1")
    st = w.stack([w.url("m1")])
    w.fetch(st)
    (w.tmp / "m1" / w.archive).unlink()
    (w.cache / w.archive).write_bytes(b"changed after verification")
    with pytest.raises(UserError) as e:
        w.fetch(st)
    assert e.value.exit_code == HASH_MISMATCH


def test_fetch_all_fills_a_directory_for_offline_builds(w):
    w.mirror("m2")
    st = w.stack([w.url("m2")])
    dest = w.tmp / "ctx"
    fetch.fetch_all(st, dest, dirs=[], offline=False, cuda=False)
    m = json.loads((dest / fetch.MANIFEST).read_text())
    assert m["files"][w.archive] == {"sha256": sha256_file(w.good), "url": w.url("m2")}
    again = fetch.fetch_source(st.ucx, cache=w.tmp / "other-cache", dirs=[dest], offline=True)
    assert again.location.kind == "dir" and again.origin_url == w.url("m2")


def test_tar_members_outside_the_tree_are_refused(w):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("ucx-9.1.0/configure.ac", "ucx-9.1.0/../../etc/evil"):
            info = tarfile.TarInfo(name)
            tar.addfile(info, io.BytesIO(b""))
    w.mirror("m", buf.getvalue())
    with pytest.raises(UserError) as e:
        w.fetch(w.stack([w.url("m")]))
    assert e.value.exit_code == HASH_MISMATCH and "outside the archive" in str(e.value)
