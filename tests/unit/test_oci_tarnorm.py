"""Tar normalisation: the same tree gives the same bytes, whatever order, times, owners' names or pax noise."""
from __future__ import annotations

import functools
import hashlib
import io
import os
import tarfile

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.oci import layer, tarnorm
from ucx_dask_gpu.errors import BAD_ARCHIVE, UserError

EPOCH = stack.load().source_date_epoch
LATER = EPOCH + 86400 * 400
EARLIER = EPOCH - 86400 * 700


@pytest.fixture
def make_tar(make_tar):
    """Entries without their own mtime are dated LATER (after the epoch: the normal form clamps them)."""
    return functools.partial(make_tar, mtime=LATER)


def normalise(raw: bytes, **kw) -> tuple[bytes, tarnorm.NormaliseResult]:
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(raw)) as src:
        res = tarnorm.normalise_tar(src, out, EPOCH, **kw)
    return out.getvalue(), res


TREE = [
    ("usr", "dir", {}),
    ("usr/bin", "dir", {"mtime": EARLIER}),
    ("usr/bin/tool", "file", {"data": b"#!/bin/sh\necho hi\n", "mode": 0o755}),
    ("usr/lib", "dir", {}),
    ("usr/lib/libx.so.1", "file", {"data": b"\x7fELF...", "uid": 0}),
    ("usr/lib/libx.so", "symlink", {"link": "libx.so.1"}),
    ("etc", "dir", {}),
    ("etc/old.conf", "file", {"data": b"old\n", "mtime": EARLIER}),
    ("home/dask/.profile", "file", {"data": b"x\n", "uid": 10001, "gid": 10001, "uname": "dask", "gname": "dask"}),
]


def shuffled_noisy(tree):
    """The same tree: reversed order, './' prefixes, other names and times, atime/ctime pax records."""
    out = []
    for name, kind, opts in reversed(tree):
        o = dict(opts)
        o["uname"], o["gname"] = "someone", "somegroup"
        if o.get("mtime", LATER) > EPOCH:
            o["mtime"] = LATER + 12345
        o["pax"] = {**o.get("pax", {}), "atime": "1799999999.5", "ctime": "1799999999.25", "comment": "host"}
        out.append(("./" + name, kind, o))
    return [("./", "dir", {})] + out


def test_same_tree_same_bytes_whatever_order_times_and_names(make_tar):
    a, ra = normalise(make_tar(TREE))
    b, rb = normalise(make_tar(shuffled_noisy(TREE)))
    c, _ = normalise(make_tar(TREE, fmt=tarfile.GNU_FORMAT))
    assert a == b == c
    assert ra.sha256 == hashlib.sha256(a).hexdigest() == rb.sha256
    assert ra.size == len(a)


def test_normal_form_details(make_tar):
    data, res = normalise(make_tar(shuffled_noisy(TREE)))
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        members = t.getmembers()
    names = [m.name for m in members]
    assert "" not in names and "." not in names and not any(n.startswith("./") for n in names)
    assert names == sorted(names, key=tarnorm.sort_key)
    by = {m.name: m for m in members}
    assert by["usr/bin"].mtime == EARLIER                      # older than the epoch: kept
    assert by["etc/old.conf"].mtime == EARLIER
    assert by["usr/bin/tool"].mtime == EPOCH                   # newer: clamped
    assert all(m.uname == "" and m.gname == "" for m in members)
    assert by["home/dask/.profile"].uid == 10001
    assert by["usr/bin/tool"].mode == 0o755
    assert all(not m.pax_headers for m in members)             # atime/ctime/comment gone
    assert by["usr/lib/libx.so"].issym() and by["usr/lib/libx.so"].linkname == "libx.so.1"
    listing = {e.path: e for e in res.entries}
    assert listing["usr/bin/tool"].sha256 == hashlib.sha256(b"#!/bin/sh\necho hi\n").hexdigest()
    # parents come before children, and a dir's children before a sibling with a longer name
    assert tarnorm.sort_key("a/b") < tarnorm.sort_key("a.b")


def test_hard_links_anchor_on_first_name_in_sorted_order(tmp_path, make_tar):
    raw = make_tar([("z", "dir", {}), ("z/target", "file", {"data": b"payload"}),
                    ("a", "dir", {}), ("a/link", "hardlink", {"link": "z/target"}),
                    ("m-link", "hardlink", {"link": "z/target"})])
    data, _ = normalise(raw)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        by = {m.name: m for m in t.getmembers()}
        assert by["a/link"].isfile() and by["a/link"].size == 7
        assert by["m-link"].islnk() and by["m-link"].linkname == "a/link"
        assert by["z/target"].islnk() and by["z/target"].linkname == "a/link"
        t.extractall(tmp_path, filter="tar") if hasattr(tarfile, "tar_filter") else t.extractall(tmp_path)
    for p in ("a/link", "m-link", "z/target"):
        assert (tmp_path / p).read_bytes() == b"payload"
    assert os.stat(tmp_path / "z/target").st_nlink == 3


def test_whiteouts_xattrs_devices_and_long_names_survive(make_tar):
    long = "opt/" + "d" * 120 + "/file-with-a-long-name"
    raw = make_tar([
        ("etc", "dir", {}),
        ("etc/.wh.removed.conf", "file", {}),
        ("opt", "dir", {}),
        ("opt/.wh..wh..opq", "file", {}),
        ("usr/bin/ping", "file", {"data": b"p", "pax": {"SCHILY.xattr.security.capability": "\x01\x00",
                                                          "SCHILY.xattr.user.b": "2", "atime": "5"}}),
        ("dev/null", "char", {}),
        (long, "file", {"data": b"l", "uid": 3_000_000}),
    ])
    data, res = normalise(raw)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        by = {m.name: m for m in t.getmembers()}
    assert "etc/.wh.removed.conf" in by and "opt/.wh..wh..opq" in by
    assert list(by["usr/bin/ping"].pax_headers) == ["SCHILY.xattr.security.capability", "SCHILY.xattr.user.b"]
    assert by["dev/null"].ischr() and (by["dev/null"].devmajor, by["dev/null"].devminor) == (1, 3)
    assert by[long].uid == 3_000_000 and by[long].size == 1
    ping = next(e for e in res.entries if e.path == "usr/bin/ping")
    assert ping.xattrs == {"security.capability": "\x01\x00", "user.b": "2"}


def test_duplicates_last_one_wins(make_tar):
    raw = make_tar([("f", "file", {"data": b"first"}), ("f", "file", {"data": b"second"})])
    data, res = normalise(raw)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        assert [m.name for m in t.getmembers()] == ["f"]
        assert t.extractfile("f").read() == b"second"


def test_fix_hook_drops_truncates_and_rewrites(make_tar):
    raw = make_tar([("a", "file", {"data": b"keep"}), ("b", "file", {"data": b"drop me"}),
                    ("c", "file", {"data": b"long log"}), ("d", "file", {"data": b"old"})])

    def fix(ti, read):
        return {"b": "drop", "c": b"", "d": read().upper()}.get(ti.name)

    data, res = normalise(raw, fix=fix)
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        got = {m.name: t.extractfile(m).read() for m in t.getmembers()}
    assert got == {"a": b"keep", "c": b"", "d": b"OLD"}
    assert res.dropped == ["b"] and res.rewritten == ["c", "d"]


def test_extra_entries_are_merged_in_order(make_tar):
    raw = make_tar([("a", "file", {"data": b"1"}), ("c", "file", {"data": b"3"})])
    ti = tarfile.TarInfo("b")
    ti.mtime = LATER
    data, _ = normalise(raw, extra=[(ti, b"2")])
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        assert [(m.name, m.mtime) for m in t.getmembers()] == [("a", EPOCH), ("b", EPOCH), ("c", EPOCH)]


def test_not_a_tar_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"this is not a tar archive at all" * 40)
    with pytest.raises(UserError) as e:
        layer.normalise_rootfs_tar(bad, tmp_path / "out.tar", EPOCH)
    assert e.value.exit_code == BAD_ARCHIVE and "\n" not in str(e.value)
