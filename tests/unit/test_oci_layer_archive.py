"""Image normalisation pieces without Docker: content fixes, layers over layers, config, archive, comparison."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import marshal
import py_compile
import tarfile
from pathlib import Path

import pytest

from ucx_dask_gpu import cli, stack
from ucx_dask_gpu.oci import archive
from ucx_dask_gpu.oci import layer as oci_layer
from ucx_dask_gpu.oci import compare as oci_compare
from ucx_dask_gpu.errors import BAD_ARCHIVE, NOT_REPRODUCIBLE, UserError

EPOCH = stack.load().source_date_epoch
LATER = EPOCH + 86400 * 400
EARLIER = EPOCH - 86400 * 700


@pytest.fixture
def make_tar(make_tar):
    """Entries without their own mtime are dated LATER (after the epoch: the normal form clamps them)."""
    return functools.partial(make_tar, mtime=LATER)


# --- content fixes ------------------------------------------------------------------------------------------------

def test_shadow_days_are_clamped_to_the_epoch_day():
    day = EPOCH // 86400
    text = (f"root:*:{day + 300}:0:99999:7:::\n"
            f"old:*:{day - 10}:0:99999:7:::\n"
            "nodate:*::0:99999:7:::\n").encode()
    fixed = oci_layer.fix_shadow(text, EPOCH).decode().splitlines()
    assert fixed[0] == f"root:*:{day}:0:99999:7:::"
    assert fixed[1] == f"old:*:{day - 10}:0:99999:7:::"
    assert fixed[2] == "nodate:*::0:99999:7:::"
    assert oci_layer.fix_shadow(b"old:*:1:0:99999:7:::\n", EPOCH) is None


@pytest.mark.parametrize("pyc,src", [
    ("usr/lib/python3.11/__pycache__/os.cpython-311.pyc", "usr/lib/python3.11/os.py"),
    ("a/__pycache__/m.cpython-311.opt-1.pyc", "a/m.py"),
    ("__pycache__/top.cpython-311.pyc", "top.py"),
    ("a/m.pyc", None),
    ("a/__pycache__/m.txt", None),
])
def test_pyc_source_paths(pyc, src):
    assert oci_layer.pyc_source(pyc) == src


def compiled(tmp_path: Path, source: bytes, mtime: int, mode=py_compile.PycInvalidationMode.TIMESTAMP) -> bytes:
    py = tmp_path / "m.py"
    py.write_bytes(source)
    import os
    os.utime(py, (mtime, mtime))
    out = tmp_path / "m.pyc"
    py_compile.compile(str(py), cfile=str(out), invalidation_mode=mode, doraise=True)
    return out.read_bytes()


SOURCE = b"X = frozenset({'a', 'b'})\ndef f(x):\n    return x in {'q', 'r'}\n"


def test_a_pyc_made_stale_by_clamping_becomes_a_valid_checked_hash_pyc(tmp_path):
    pyc = compiled(tmp_path, SOURCE, LATER)
    fixed = oci_layer.fix_pyc(pyc, SOURCE, LATER, EPOCH)
    assert fixed is not None and fixed[:4] == importlib.util.MAGIC_NUMBER
    assert int.from_bytes(fixed[4:8], "little") == 0b11          # hash-based, checked
    assert fixed[8:16] == importlib.util.source_hash(SOURCE)
    assert fixed[16:] == pyc[16:]                                  # same code object
    ns: dict = {}
    exec(marshal.loads(fixed[16:]), ns)
    assert ns["f"]("q") is True
    # what Python's import system itself checks for a checked-hash pyc
    from importlib._bootstrap_external import _classify_pyc, _validate_hash_pyc
    flags = _classify_pyc(fixed, "m", {})
    _validate_hash_pyc(fixed, importlib.util.source_hash(SOURCE), "m", {})
    assert flags == 0b11


def test_pycs_left_alone(tmp_path):
    early = compiled(tmp_path, SOURCE, EARLIER)
    assert oci_layer.fix_pyc(early, SOURCE, EARLIER, EPOCH) is None          # still valid after clamping
    late = compiled(tmp_path, SOURCE, LATER)
    assert oci_layer.fix_pyc(late, SOURCE + b"#", LATER, EPOCH) is None      # stale already (size)
    assert oci_layer.fix_pyc(late, SOURCE, LATER + 1, EPOCH) is None        # stale already (mtime)
    hashed = compiled(tmp_path, SOURCE, LATER, py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert oci_layer.fix_pyc(hashed, SOURCE, LATER, EPOCH) is None          # hash-based already
    assert oci_layer.fix_pyc(b"\x00\x00\r\n" + late[4:], SOURCE, LATER, EPOCH) is None  # another Python


def test_litter():
    def ti(name, type_=tarfile.REGTYPE):
        t = tarfile.TarInfo(name)
        t.type = type_
        return t
    assert oci_layer.is_litter(ti("root/.cache/pip/http/x"))
    assert oci_layer.is_litter(ti("home/dask/.cache/matplotlib/fontlist.json"))
    assert oci_layer.is_litter(ti("var/log/dpkg.log"))
    assert oci_layer.is_litter(ti("var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease"))
    assert oci_layer.is_litter(ti("var/lib/dpkg/status-old"))
    assert oci_layer.is_litter(ti("dev/null", tarfile.CHRTYPE))
    assert not oci_layer.is_litter(ti("tmp", tarfile.DIRTYPE))
    assert not oci_layer.is_litter(ti("var/log/apt", tarfile.DIRTYPE))
    assert not oci_layer.is_litter(ti("var/log/.wh.dpkg.log"))             # a whiteout is not litter
    assert not oci_layer.is_litter(ti("var/lib/dpkg/status"))
    assert not oci_layer.is_litter(ti("opt/venv/lib/python3.11/site-packages/tmp/x.py"))


# --- layers over layers -----------------------------------------------------------------------------------------

@pytest.fixture
def layer(make_tar):
    """layer(entries) -> the tar of one image layer holding `entries`, open for reading."""
    def open_layer(entries) -> tarfile.TarFile:
        return tarfile.open(fileobj=io.BytesIO(make_tar(entries)))
    return open_layer


def run_layer(tf, overlay, **kw):
    out = io.BytesIO()
    res = oci_layer.normalise_layer(tf, out, EPOCH, overlay, where="test", **kw)
    return out.getvalue(), res


def members_of(data: bytes) -> dict[str, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(data)) as t:
        return {m.name: (t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()}


def test_pyc_in_an_upper_layer_is_fixed_against_a_source_in_a_lower_one(tmp_path, layer):
    pyc = compiled(tmp_path, SOURCE, LATER)
    overlay = oci_layer.Overlay()
    run_layer(layer([("opt/app/m.py", "file", {"data": SOURCE, "mtime": LATER}),
                     ("opt/app/link.py", "symlink", {"link": "m.py"})]), overlay)
    data, res = run_layer(layer([("opt/app/__pycache__/m.cpython-311.pyc", "file", {"data": pyc}),
                                 ("opt/app/__pycache__/link.cpython-311.pyc", "file", {"data": pyc})]), overlay)
    got = members_of(data)
    for name in ("opt/app/__pycache__/m.cpython-311.pyc", "opt/app/__pycache__/link.cpython-311.pyc"):
        assert got[name][8:16] == importlib.util.source_hash(SOURCE), name
    assert sorted(res.rewritten) == ["opt/app/__pycache__/link.cpython-311.pyc", "opt/app/__pycache__/m.cpython-311.pyc"]


def test_whiteouts_remove_what_lower_layers_held(layer):
    overlay = oci_layer.Overlay()
    run_layer(layer([("var/lib/dpkg/status", "file", {"data": b"Package: a\n"}),
                     ("opt/venv/x.dist-info/METADATA", "file", {"data": b"Name: x\nVersion: 1\n"}),
                     ("opt/venv/y.dist-info/METADATA", "file", {"data": b"Name: y\nVersion: 1\n"})]), overlay)
    assert set(overlay.watched) == {"var/lib/dpkg/status", "opt/venv/x.dist-info/METADATA",
                                    "opt/venv/y.dist-info/METADATA"}
    run_layer(layer([("opt/venv/.wh.x.dist-info", "file", {}),
                     ("var/lib/dpkg/status", "file", {"data": b"Package: b\n"})]), overlay)
    assert overlay.watched["var/lib/dpkg/status"] == b"Package: b\n"
    assert "opt/venv/x.dist-info/METADATA" not in overlay.watched
    run_layer(layer([("opt/venv/.wh..wh..opq", "file", {})]), overlay)
    assert not any(p.startswith("opt/venv/") for p in overlay.watched)
    assert "opt/venv/.wh..wh..opq" in overlay.paths


def test_layer_litter_dropped_and_shadow_clamped(layer):
    day = EPOCH // 86400
    data, res = run_layer(layer([
        ("etc/shadow", "file", {"data": f"dask:!:{day + 365}:0:99999:7:::\n".encode()}),
        ("root/.cache/pip/selfcheck.json", "file", {"data": b"{}"}),
        ("var/log/apt/term.log", "file", {"data": b"log"}),
        ("tmp", "dir", {"mode": 0o1777}),
    ]), oci_layer.Overlay())
    got = members_of(data)
    assert got["etc/shadow"] == f"dask:!:{day}:0:99999:7:::\n".encode()
    assert "tmp" in got and "root/.cache/pip/selfcheck.json" not in got and "var/log/apt/term.log" not in got
    assert res.dropped == ["root/.cache/pip/selfcheck.json", "var/log/apt/term.log"]


def test_sbom_layer_creates_only_missing_directories():
    overlay = oci_layer.Overlay()
    overlay.paths.update({"usr", "usr/share"})
    out = io.BytesIO()
    res = oci_layer.sbom_layer(out, EPOCH, b"{}\n", overlay)
    got = members_of(out.getvalue())
    assert list(got) == ["usr/share/ucx-dask-gpu", "usr/share/ucx-dask-gpu/sbom.cdx.json"]
    assert res.diff_id == "sha256:" + hashlib.sha256(out.getvalue()).hexdigest()


def test_rootfs_tar_normal_form_is_independent_of_input_order(tmp_path, make_tar):
    tree = [("etc", "dir", {}), ("etc/hostname", "file", {"data": b""}),
            ("var/cache/apt/archives/x.deb", "file", {"data": b"deb"}), ("usr/bin/sh", "file", {"data": b"sh"})]
    (tmp_path / "a.tar").write_bytes(make_tar(tree))
    (tmp_path / "b.tar").write_bytes(make_tar(list(reversed(tree))))
    ra = oci_layer.normalise_rootfs_tar(tmp_path / "a.tar", tmp_path / "a.out", EPOCH)
    rb = oci_layer.normalise_rootfs_tar(tmp_path / "b.tar", tmp_path / "b.out", EPOCH)
    assert (tmp_path / "a.out").read_bytes() == (tmp_path / "b.out").read_bytes()
    assert ra.diff_id == rb.diff_id and ra.dropped == ["var/cache/apt/archives/x.deb"]
    (tmp_path / "bad.tar").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(UserError) as e:
        oci_layer.normalise_rootfs_tar(tmp_path / "bad.tar", tmp_path / "bad.out", EPOCH)
    assert e.value.exit_code == BAD_ARCHIVE and not (tmp_path / "bad.out").exists()


# --- config -----------------------------------------------------------------------------------------------------

RAW_CONFIG = {
    "architecture": "amd64", "os": "linux", "created": "2026-11-30T15:55:01.123456789Z",
    "container": "4f1d0c0ffee", "docker_version": "20.10.24+dfsg1",
    "container_config": {"Hostname": "4f1d0c0ffee", "Cmd": ["/bin/sh", "-c", "#(nop) CMD"]},
    "config": {"Hostname": "", "Domainname": "", "User": "10001", "AttachStdin": False, "Env": ["PATH=/bin"],
               "Cmd": ["python3"], "Image": "sha256:" + "ab" * 32, "Volumes": None, "WorkingDir": "/home/dask",
               "Entrypoint": None, "OnBuild": None, "Labels": {"org.opencontainers.image.created": "now",
                                                               "keep": "me"}},
    "rootfs": {"type": "layers", "diff_ids": ["sha256:old"]},
    "history": [{"created": "2026-11-30T15:50:00Z", "created_by": "", "comment": "Imported from -"},
                {"created": "2026-11-30T15:55:00Z", "created_by": "/bin/sh -c #(nop) USER 10001",
                 "empty_layer": True, "author": "x"},
                {"created": "2026-11-30T15:55:01Z", "created_by": "/bin/sh -c useradd dask"}],
}


def test_config_keeps_only_what_the_image_means():
    cfg = archive.normalise_config(RAW_CONFIG, ["sha256:a", "sha256:b"], EPOCH,
                                        {"org.opencontainers.image.created": "2025-11-30T00:00:00Z"}, [])
    assert cfg["created"] == "2025-11-30T00:00:00Z"
    assert set(cfg) == {"architecture", "os", "created", "config", "rootfs", "history"}
    assert cfg["config"] == {"User": "10001", "Env": ["PATH=/bin"], "Cmd": ["python3"], "WorkingDir": "/home/dask",
                             "Labels": {"keep": "me", "org.opencontainers.image.created": "2025-11-30T00:00:00Z"}}
    assert cfg["rootfs"] == {"type": "layers", "diff_ids": ["sha256:a", "sha256:b"]}
    assert [h["created"] for h in cfg["history"]] == ["2025-11-30T00:00:00Z"] * 3
    assert cfg["history"][1] == {"created": "2025-11-30T00:00:00Z", "created_by": "/bin/sh -c #(nop) USER 10001",
                                 "empty_layer": True}
    with pytest.raises(UserError) as e:
        archive.normalise_config(RAW_CONFIG, ["sha256:a"], EPOCH, {}, [])
    assert e.value.exit_code == BAD_ARCHIVE


# --- archive ---------------------------------------------------------------------------------------------------

def test_archive_is_deterministic_and_a_consistent_oci_layout_and_docker_archive(tmp_path, make_tar):
    l1 = tmp_path / "l1"
    l1.write_bytes(make_tar([("a", "file", {"data": b"1"})]))
    d1 = "sha256:" + hashlib.sha256(l1.read_bytes()).hexdigest()
    config = archive.canonical_json({"rootfs": {"type": "layers", "diff_ids": [d1]}})
    outs = []
    for _ in range(2):
        buf = io.BytesIO()
        digests = archive.write_archive(buf, EPOCH, config, [(d1, l1), (d1, l1)], "0.1.0",
                                             {"org.opencontainers.image.version": "0.1.0"})
        outs.append(buf.getvalue())
    assert outs[0] == outs[1]
    assert digests["archive_sha256"] == hashlib.sha256(outs[0]).hexdigest()
    assert digests["image_id"] == "sha256:" + hashlib.sha256(config).hexdigest()
    with tarfile.open(fileobj=io.BytesIO(outs[0])) as t:
        files = {m.name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
        assert all(m.mtime == EPOCH and m.uid == 0 and m.uname == "" for m in t.getmembers())
    for name, data in files.items():          # every blob is named by its digest
        if name.startswith("blobs/sha256/"):
            assert hashlib.sha256(data).hexdigest() == name.rsplit("/", 1)[1]
    assert json.loads(files["oci-layout"]) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads(files["index.json"])
    man_desc = index["manifests"][0]
    assert man_desc["annotations"]["org.opencontainers.image.ref.name"] == "0.1.0"
    manifest = json.loads(files["blobs/sha256/" + man_desc["digest"].split(":")[1]])
    assert manifest["config"]["digest"] == digests["image_id"] and manifest["mediaType"] == archive.OCI_MANIFEST
    assert [x["digest"] for x in manifest["layers"]] == [d1, d1]
    assert manifest["annotations"] == {"org.opencontainers.image.version": "0.1.0"}
    docker_manifest = json.loads(files["manifest.json"])
    assert docker_manifest[0]["Config"] in files and all(p in files for p in docker_manifest[0]["Layers"])
    assert docker_manifest[0]["RepoTags"] is None


# --- comparing two builds -------------------------------------------------------------------------------------

def write_output(d: Path, entries_per_layer, config=None):
    d.mkdir(parents=True)
    layers = []
    for entries in entries_per_layer:
        digest = "sha256:" + hashlib.sha256(json.dumps(entries).encode()).hexdigest()
        layers.append({"diff_id": digest, "size": 1, "dropped": [], "rewritten": [], "entries": entries})
    config = config or {"created": "2025-11-30T00:00:00Z"}
    config = {**config, "rootfs": {"type": "layers", "diff_ids": [x["diff_id"] for x in layers]}}
    image_id = "sha256:" + hashlib.sha256(archive.canonical_json(config)).hexdigest()
    (d / oci_compare.IMAGE_JSON).write_text(json.dumps({"image_id": image_id, "archive_sha256": image_id[7:]}))
    (d / oci_compare.LAYERS_JSON).write_text(json.dumps({"config": config, "layers": layers}))


def entry(path, sha="0" * 64, mtime=EPOCH, mode="0644"):
    return [path, "file", mode, "0:0", mtime, 10, sha, {}]


def test_compare_identical_and_different_builds(tmp_path, capsys):
    base = [entry("etc/a"), entry("etc/b")]
    write_output(tmp_path / "a", [base, [entry("opt/x", "1" * 64), entry("opt/y")]])
    write_output(tmp_path / "same", [base, [entry("opt/x", "1" * 64), entry("opt/y")]])
    write_output(tmp_path / "b", [base, [entry("opt/x", "2" * 64), entry("opt/z"), entry("opt/y", mtime=1)]],
                 config={"created": "2025-11-30T00:00:00Z", "config": {"Env": ["X=1"]}})
    assert oci_compare.compare(tmp_path / "a", tmp_path / "same")["identical"]
    r = oci_compare.compare(tmp_path / "a", tmp_path / "b")
    assert not r["identical"]
    assert [x["layer"] for x in r["layers"]] == [1]                  # layer 0 is the same
    lay = r["layers"][0]
    assert [d["path"] for d in lay["differ"]] == ["opt/x", "opt/y"]
    assert lay["differ"][0]["fields"] == ["content"] and lay["differ"][1]["fields"] == ["mtime"]
    assert lay["only_b"] == ["opt/z"] and lay["only_a"] == []
    assert [c["key"] for c in r["config"]] == ["config.Env"]
    # the CLI: a report on stdout, one line on stderr, exit NOT_REPRODUCIBLE
    rc = cli.main(["repro", "compare", str(tmp_path / "a"), str(tmp_path / "b")])
    out, err = capsys.readouterr()
    assert rc == NOT_REPRODUCIBLE
    assert "differs opt/x  (content:" in out and "only B  opt/z" in out
    assert len(err.strip().splitlines()) == 1 and "not reproducible" in err
    assert cli.main(["repro", "compare", str(tmp_path / "a"), str(tmp_path / "same")]) == 0


def test_compare_of_something_that_is_not_a_build_output(tmp_path, capsys):
    rc = cli.main(["repro", "compare", str(tmp_path), str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "not a normalised build output" in err
