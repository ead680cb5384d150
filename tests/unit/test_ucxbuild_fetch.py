"""Source selection for the UCX build: order of locations, verification, fallback reporting, nothing half-written.

Real fetch code against real files through file:// URLs and local directories (no network). The HTTP behaviour
(404, refused connections, a real server) is covered by tests/integration/test_fetch_http.py.
"""
from __future__ import annotations

import hashlib
import io
import json
import tarfile
import tomllib
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.errors import HASH_MISMATCH, SOURCE_UNREACHABLE, UserError
from ucx_dask_gpu.ucxbuild import fetch

REPO = Path(__file__).resolve().parents[2]


def tarball(name: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(f"{name}/configure.ac")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return buf.getvalue()


class World:
    """Two versions of a fake UCX archive, mirrors as directories reached by file:// URLs."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.data = {v: tarball(f"ucx-{v}", f"release {v}".encode()) for v in ("9.1.0", "9.0.0")}
        self.sha = {v: hashlib.sha256(d).hexdigest() for v, d in self.data.items()}
        self.cache = tmp / "cache"

    def archive(self, v: str) -> str:
        return f"ucx-{v}.tar.gz"

    def mirror(self, name: str, *versions: str, corrupt: bool = False) -> Path:
        d = self.tmp / name
        d.mkdir(exist_ok=True)
        for v in versions:
            (d / self.archive(v)).write_bytes(self.data[v] + (b"tampered" if corrupt else b""))
        return d

    def url(self, mirror: str, v: str) -> str:
        return (self.tmp / mirror / self.archive(v)).as_uri()

    def stack(self, urls: dict[str, list[str]]) -> stack.Stack:
        raw = tomllib.loads((REPO / "stack.toml").read_text())
        raw["ucx"]["sources"] = [{"version": v, "archive": self.archive(v), "sha256": self.sha[v], "layout": "release",
                                  "urls": urls[v]} for v in ("9.1.0", "9.0.0")]
        return stack.parse(raw, self.tmp / "stack.toml")

    def fetch(self, st, dirs=(), offline=False):
        return fetch.fetch_ucx_source(st, cache=self.cache, dirs=list(dirs), offline=offline)


@pytest.fixture
def w(tmp_path, monkeypatch):
    monkeypatch.delenv(fetch.SOURCE_DIR_ENV, raising=False)
    return World(tmp_path)


def leftovers(d: Path) -> list[str]:
    """Temp files a fetch must never leave behind."""
    return sorted(p.name for p in d.glob(".*")) if d.exists() else []


def test_first_reachable_url_of_the_pinned_source_wins(w, capsys):
    w.mirror("m2", "9.1.0", "9.0.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0"), w.url("m2", "9.1.0")], "9.0.0": [w.url("m2", "9.0.0")]})
    got = w.fetch(st)
    assert (got.source.version, got.location.kind, got.location.where) == ("9.1.0", "url", w.url("m2", "9.1.0"))
    assert [a.location for a in got.attempts] == [str(w.cache / w.archive("9.1.0")), w.url("m1", "9.1.0"),
                                                  w.url("m2", "9.1.0")]
    assert [a.outcome == "ok" for a in got.attempts] == [False, False, True]
    assert not got.fallback and got.record()["fallback_reason"] is None
    assert (w.cache / w.archive("9.1.0")).read_bytes() == w.data["9.1.0"]
    assert "FALLBACK" not in capsys.readouterr().err


def test_fallback_is_announced_and_recorded(w, capsys):
    w.mirror("m2", "9.0.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m2", "9.0.0")]})
    got = w.fetch(st)
    assert got.source.version == "9.0.0" and got.fallback
    rec = got.record()
    assert rec["fallback"] is True and w.url("m1", "9.1.0") in rec["fallback_reason"]
    err = capsys.readouterr().err
    assert "FALLBACK" in err and "9.0.0" in err and "9.1.0" in err


def test_hash_mismatch_is_fatal_and_leaves_nothing(w):
    w.mirror("bad", "9.1.0", corrupt=True)
    w.mirror("good", "9.1.0", "9.0.0")
    # A good copy later in the list must NOT be tried: a mismatch means tampering or a wrong pin.
    st = w.stack({"9.1.0": [w.url("bad", "9.1.0"), w.url("good", "9.1.0")], "9.0.0": [w.url("good", "9.0.0")]})
    with pytest.raises(UserError) as e:
        w.fetch(st)
    assert e.value.exit_code == HASH_MISMATCH
    assert "sha256 mismatch" in str(e.value) and w.url("bad", "9.1.0") in str(e.value)
    assert not (w.cache / w.archive("9.1.0")).exists()
    assert leftovers(w.cache) == []


def test_source_dir_is_tried_after_the_urls(w, monkeypatch):
    local = w.mirror("local", "9.1.0")
    monkeypatch.setenv(fetch.SOURCE_DIR_ENV, str(local))
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m1", "9.0.0")]})
    got = w.fetch(st, dirs=fetch.local_dirs())
    assert got.location.kind == "dir" and got.location.where == str(local / w.archive("9.1.0"))
    assert [a.location for a in got.attempts][1:] == [w.url("m1", "9.1.0"), str(local / w.archive("9.1.0"))]
    assert (w.cache / w.archive("9.1.0")).is_file(), "a directory hit is kept in the cache too"


def test_source_dir_with_wrong_hash_is_fatal(w, monkeypatch):
    local = w.mirror("local", "9.1.0", corrupt=True)
    monkeypatch.setenv(fetch.SOURCE_DIR_ENV, str(local))
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m1", "9.0.0")]})
    with pytest.raises(UserError) as e:
        w.fetch(st, dirs=fetch.local_dirs())
    assert e.value.exit_code == HASH_MISMATCH and str(local) in str(e.value)


def test_offline_skips_urls(w):
    w.mirror("m1", "9.1.0")
    local = w.mirror("local", "9.0.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m1", "9.0.0")]})
    got = w.fetch(st, dirs=[local], offline=True)
    assert got.source.version == "9.0.0" and got.fallback and got.location.kind == "dir"
    assert not any(a.location.startswith("file:") for a in got.attempts)


def test_nothing_reachable_names_every_source(w):
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m2", "9.0.0")]})
    with pytest.raises(UserError) as e:
        w.fetch(st)
    msg = str(e.value)
    assert e.value.exit_code == SOURCE_UNREACHABLE
    assert "9.1.0" in msg and "9.0.0" in msg and w.url("m2", "9.0.0") in msg and "\n" not in msg
    assert not w.cache.exists() or list(w.cache.iterdir()) == []


def test_cache_hit_needs_no_url_and_keeps_the_origin(w):
    m = w.mirror("m1", "9.1.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m1", "9.0.0")]})
    w.fetch(st)
    (m / w.archive("9.1.0")).unlink()  # the mirror is gone; the verified cache copy still serves
    got = w.fetch(st)
    assert got.location.kind == "cache" and len(got.attempts) == 1
    assert got.record()["url"] == w.url("m1", "9.1.0")


def test_tampered_cache_is_fatal(w):
    w.mirror("m1", "9.1.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m1", "9.0.0")]})
    w.fetch(st)
    (w.cache / w.archive("9.1.0")).write_bytes(b"changed after verification")
    with pytest.raises(UserError) as e:
        w.fetch(st)
    assert e.value.exit_code == HASH_MISMATCH


def test_fetch_all_writes_a_manifest_for_offline_builds(w):
    w.mirror("m2", "9.0.0")
    st = w.stack({"9.1.0": [w.url("m1", "9.1.0")], "9.0.0": [w.url("m2", "9.0.0")]})
    dest = w.tmp / "ctx"
    fetch.fetch_all(st, dest, dirs=[], offline=False, cuda=False)
    m = json.loads((dest / fetch.MANIFEST).read_text())
    assert m["ucx"]["version"] == "9.0.0" and m["ucx"]["fallback"] is True
    assert m["files"][w.archive("9.0.0")]["sha256"] == w.sha["9.0.0"]
    # The offline build from that directory carries the fetch-time reason along.
    again = fetch.fetch_ucx_source(st, cache=w.tmp / "other-cache", dirs=[dest], offline=True)
    assert again.source.version == "9.0.0" and f"when {dest} was fetched" in again.fallback_reason
