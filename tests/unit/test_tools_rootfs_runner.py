"""Tests of tools/rootfs_runner (the workshop's no-Docker runner, not the product): an exported filesystem in parts:
packing a real tar stream (tar + zstd/xz), receiving batches, refusing damaged or missing parts, unpacking with owners
kept; the chroot runner's pure parts (driver libraries from `ldconfig -p`, the image user, UCX's protocol tables); and
what its outputs do to the user's files beside them."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_owned_dirs import (full_disk, in_process, one_line,  # noqa: F401 (full_disk: fixture)
                             users_files_survive_two_runs)
from tools.rootfs_runner import chroot, cli, rootfs
from ucx_dask_gpu.cliutil import SIZE_HELP, parse_size
from ucx_dask_gpu.errors import OUTPUT_REFUSED, ROOTFS_INVALID, USAGE, UserError

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
MIB = 1 << 20


@pytest.fixture
def tree(tmp_path) -> Path:
    """A small root filesystem: a few MiB of incompressible data, a file owned by another user, a symlink."""
    t = tmp_path / "tree"
    (t / "opt/ucx/lib").mkdir(parents=True)
    (t / "opt/ucx/lib/libucp.so.0").write_bytes(os.urandom(3 * MIB))
    (t / "etc").mkdir()
    (t / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\ndask:x:10001:10001::/home/dask:/bin/bash\n")
    (t / "home/dask").mkdir(parents=True)
    (t / "home/dask/owned").write_text("mine\n")
    (t / "opt/ucx/lib/libucp.so").symlink_to("libucp.so.0")
    if os.geteuid() == 0:
        os.chown(t / "home/dask/owned", 10001, 10001)
    return t


def export(tree: Path, out: Path, compression: str = "zstd") -> dict:
    return rootfs.pack(["tar", "-c", "--numeric-owner", "-C", str(tree), "-f", "-", "."], out,
                       {"image": "img:1", "image_id": "sha256:" + "0" * 64, "stack_id": "abc"},
                       {"User": "10001:10001", "Entrypoint": ["/usr/bin/tini", "-s", "--"]}, part_size=MIB,
                       level=3, compression=compression)


@pytest.mark.parametrize("compression", ["zstd", "xz"])
def test_parts_travel_batch_by_batch_and_unpack_to_the_same_tree(tree, tmp_path, compression):
    m = export(tree, tmp_path / "export", compression)
    assert len(m["parts"]) >= 3 and all(p["bytes"] <= MIB for p in m["parts"])
    assert m["archive_bytes"] == sum(p["bytes"] for p in m["parts"]) and m["compression"] == compression
    parts = tmp_path / "parts"
    for i, batch in enumerate(m["batches"]):
        r = rootfs.receive(tmp_path / "export" / batch, parts)
        assert r["moved"] == [m["parts"][i]["name"]] and len(r["missing"]) == len(m["parts"]) - i - 1
    assert rootfs.read_image_config(parts)["User"] == "10001:10001"
    if os.geteuid() != 0:
        pytest.skip("unpacking keeps owners: root only")
    out = rootfs.unpack(tmp_path / "root", parts)
    root = Path(out["root"])
    assert not out["reused"] and out["bytes"] == m["rootfs_bytes"]
    assert (root / "opt/ucx/lib/libucp.so.0").read_bytes() == (tree / "opt/ucx/lib/libucp.so.0").read_bytes()
    assert os.readlink(root / "opt/ucx/lib/libucp.so") == "libucp.so.0"
    assert (root / "home/dask/owned").stat().st_uid == 10001
    assert rootfs.unpack(tmp_path / "root", parts)["reused"]


def test_xz_unpacks_with_the_standard_library_alone(tree, tmp_path, monkeypatch):
    """A GPU host may have neither an xz nor a zstd command (nor the zstandard module): with only `tar` on PATH the
    archive is decoded by Python's lzma."""
    if os.geteuid() != 0:
        pytest.skip("unpacking keeps owners: root only")
    m = export(tree, tmp_path / "export", "xz")
    parts = tmp_path / "parts"
    for batch in m["batches"]:
        rootfs.receive(tmp_path / "export" / batch, parts)
    only_tar = tmp_path / "bin"
    only_tar.mkdir()
    (only_tar / "tar").symlink_to(shutil.which("tar"))
    monkeypatch.setenv("PATH", str(only_tar))
    assert shutil.which("xz") is None and shutil.which("zstd") is None
    out = rootfs.unpack(tmp_path / "root", parts)
    assert out["bytes"] == m["rootfs_bytes"]
    assert (tmp_path / "root/opt/ucx/lib/libucp.so.0").read_bytes() == (tree / "opt/ucx/lib/libucp.so.0").read_bytes()
    monkeypatch.undo()
    zst = export(tree, tmp_path / "export-zst", "zstd")
    for batch in zst["batches"]:
        rootfs.receive(tmp_path / "export-zst" / batch, tmp_path / "parts-zst")
    monkeypatch.setenv("PATH", str(only_tar))
    try:
        import zstandard  # noqa: F401  (where the module is installed, it decodes)
    except ImportError:
        with pytest.raises(UserError) as err:
            rootfs.unpack(tmp_path / "root-zst", tmp_path / "parts-zst")
        assert err.value.exit_code == ROOTFS_INVALID and "--compression xz" in str(err.value)
        assert not (tmp_path / "root-zst").exists()


def test_nothing_half_written_when_the_source_fails(tmp_path):
    with pytest.raises(UserError) as err:
        rootfs.pack(["tar", "-c", "-C", str(tmp_path / "absent"), "-f", "-", "."], tmp_path / "export",
                    {"image": "x"}, {}, part_size=MIB, level=1)
    assert err.value.exit_code == USAGE
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the export or its temporary directory left behind"
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "mine.txt").write_text("kept")
    with pytest.raises(UserError, match="holds mine.txt, which this command did not write") as err:
        rootfs.pack(["true"], tmp_path / "export", {}, {}, part_size=MIB)
    assert err.value.exit_code == OUTPUT_REFUSED and (tmp_path / "export" / "mine.txt").read_text() == "kept"


def test_damaged_missing_and_foreign_parts_are_refused(tree, tmp_path):
    m = export(tree, tmp_path / "export")
    parts = tmp_path / "parts"
    batch = tmp_path / "export" / m["batches"][0]
    part = batch / m["parts"][0]["name"]
    data = part.read_bytes()
    part.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # the last byte changed, whatever it was
    with pytest.raises(UserError) as err:
        rootfs.receive(batch, parts)
    assert err.value.exit_code == ROOTFS_INVALID and "sha256 differs" in str(err.value)
    assert not (parts / part.name).exists()
    with pytest.raises(UserError) as err:
        rootfs.verify_parts(parts)
    assert err.value.exit_code == ROOTFS_INVALID and f"{len(m['parts'])} of {len(m['parts'])} parts" in str(err.value)
    (tree / "etc/hostname").write_text("another\n")
    other = export(tree, tmp_path / "export2")
    with pytest.raises(UserError, match="another export"):
        rootfs.receive(tmp_path / "export2" / other["batches"][1], parts)
    with pytest.raises(UserError, match="no readable manifest.json"):
        rootfs.receive(tmp_path, parts)


def test_a_corrupt_archive_with_valid_part_hashes_is_caught_at_unpack(tree, tmp_path):
    """The tar stream's own sha256 is checked too (a manifest edited to match damaged parts)."""
    if os.geteuid() != 0:
        pytest.skip("unpacking keeps owners: root only")
    m = export(tree, tmp_path / "export")
    parts = tmp_path / "parts"
    for batch in m["batches"]:
        rootfs.receive(tmp_path / "export" / batch, parts)
    manifest = json.loads((parts / "manifest.json").read_text())
    manifest["rootfs_sha256"] = "f" * 64
    (parts / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError) as err:
        rootfs.unpack(tmp_path / "root", parts)
    assert err.value.exit_code == ROOTFS_INVALID and "sha256 differs" in str(err.value)
    assert not (tmp_path / "root").exists()


def test_part_sizes_are_dasks_units(tmp_path):
    """--part-size as every size option: 56MiB = 56*2^20, 58M = 58*10^6; a bad one is one line, exit 2."""
    for text, part in (("56MiB", 56 * MIB), ("58M", 58 * 10**6), ("1048576", MIB)):
        assert cli.build_parser().parse_args(["export", "img", str(tmp_path / "x"), "--part-size",
                                              text]).part_size == text
        assert parse_size(text, "--part-size") == part
    proc = subprocess.run([sys.executable, "-m", "tools.rootfs_runner", "export", "img", str(tmp_path / "x"),
                           "--part-size", "lots"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == USAGE and proc.stderr.strip().endswith("--part-size 'lots': not a byte size "
                                                                     f"({SIZE_HELP})")


def test_part_size_is_the_users_option_with_a_default_of_one_gib():
    help_text = subprocess.run([sys.executable, "-m", "tools.rootfs_runner", "export", "--help"],
                               capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "--part-size" in help_text and "default 1GiB" in " ".join(help_text.split())
    assert parse_size(rootfs.DEFAULT_PART_SIZE, "--part-size") == 1 << 30


LDCONFIG = """\
1234 libs found in cache `/etc/ld.so.cache'
\tlibnvidia-ml.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1
\tlibcuda.so.1 (libc6) => /usr/lib/i386-linux-gnu/libcuda.so.1
\tlibc.so.6 (libc6,x86-64, OS ABI: Linux 3.2.0) => /lib/x86_64-linux-gnu/libc.so.6
"""


def test_driver_libraries_as_the_toolkit_finds_them(tmp_path):
    assert chroot.parse_ldconfig(LDCONFIG)["libcuda.so.1"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    drv = tmp_path / "nvidia" / "lib64"
    drv.mkdir(parents=True)
    (drv / "libcuda.so.580.159.04").write_bytes(b"\x7fELF")
    (drv / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (drv / "libnvidia-ptxjitcompiler.so.580.159.04").write_bytes(b"\x7fELF")
    (drv / "libcudart.so.13").write_bytes(b"\x7fELF")  # a toolkit library, not the driver's
    (drv / "libcuda.so").symlink_to("libcuda.so.1")  # the development link: not what programs load
    found = chroot.find_driver_libraries("", extra_dirs=(str(drv),))
    # by soname, resolved to the versioned file, and versioned files that are their own soname; the toolkit's own
    # libraries are not the driver's
    assert {k: v for k, v in found.items() if str(v).startswith(str(drv))} == {
        "libcuda.so.1": (drv / "libcuda.so.580.159.04").resolve(),
        "libcuda.so.580.159.04": (drv / "libcuda.so.580.159.04").resolve(),
        "libnvidia-ptxjitcompiler.so.580.159.04": (drv / "libnvidia-ptxjitcompiler.so.580.159.04").resolve()}


def test_the_image_user_is_read_from_the_root(tree):
    assert chroot.image_user(tree, "10001:10001") == chroot.ImageUser(10001, 10001, "/home/dask")
    assert chroot.image_user(tree, "dask") == chroot.ImageUser(10001, 10001, "/home/dask")
    assert chroot.image_user(tree, None).uid == 0
    with pytest.raises(UserError):
        chroot.image_user(tree, "nobody")


def test_protocol_tables_name_cuda_ipc_for_cuda_memory():
    log = (FIXTURES / "verify_nvlink/h200x2/raw/pip_1.21.0/gpu0-gpu1/1048576/client.txt").read_text()
    p = chroot.summarise_proto(log)
    assert p["tables"] >= 2 and "cuda_ipc" in p["cuda_transports"] and "sysv" in p["transports"]
    assert chroot.summarise_proto("no tables\n") == {"tables": 0, "transports": [], "cuda_transports": [],
                                                     "cuda_operations": []}


def test_checks_need_every_process_on_the_roots_ucx(tmp_path):
    root, inside = tmp_path, "/opt/ucx/lib/libucp.so.0.0.0"
    good = {"client_exit": 0,
            "workload": {"ok": True, "value": 1.0, "expected": 1.0, "workers_start": 2,
                         "ucx": {"client": {"libucp": inside}, "scheduler": {"libucp": inside},
                                 "workers": {"a": {"libucp": inside}, "b": {"libucp": inside}}}},
            "libraries": {"scheduler": {"1 dask": f"{root}{inside}"}, "worker-a": {"2 dask": f"{root}{inside}",
                                                                                   "3 python": f"{root}{inside}"}},
            "proto": {"worker-a": {"transports": ["tcp"], "cuda_transports": ["cuda_ipc"]}}}
    c = chroot.checks(good, chroot.Proof(gpu=True), root, "/opt/ucx")
    assert all(v["ok"] for v in c.values()) and set(c) == {"answer", "libucp", "cuda_ipc"}
    host_ucx = json.loads(json.dumps(good))
    host_ucx["libraries"]["worker-a"]["3 python"] = "/usr/lib/libucp.so.0"
    assert not chroot.checks(host_ucx, chroot.Proof(gpu=True), root, "/opt/ucx")["libucp"]["ok"]
    no_ipc = dict(good, proto={"worker-a": {"transports": ["tcp"], "cuda_transports": ["cuda_copy"]}})
    assert not chroot.checks(no_ipc, chroot.Proof(gpu=True), root, "/opt/ucx")["cuda_ipc"]["ok"]
    assert chroot.checks(good, chroot.Proof(gpu=False), root, "/opt/ucx")["proto_info"]["ok"]


def test_the_session_script_is_a_thin_wrapper():
    script = REPO / "tools/gpu-host/image_rootfs.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage:" in proc.stderr
    assert shutil.which("bash")


def test_driver_libraries_land_in_the_root_as_files_with_their_soname_links(tmp_path):
    """A driver directory as the GPU host has it: versioned files, soname links to them, and a versioned file that is
    its own soname. Every real file must end up in the root once, every soname resolving to it."""
    drv = tmp_path / "nvidia" / "lib64"
    drv.mkdir(parents=True)
    for name in ("libcuda.so.580.159.04", "libnvidia-ml.so.580.159.04", "libnvidia-gpucomp.so.580.159.04"):
        (drv / name).write_bytes(name.encode() * 3)
    (drv / "libcuda.so.1").symlink_to("libcuda.so.580.159.04")
    (drv / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.159.04")
    libraries = chroot.find_driver_libraries(ldconfig_text="", extra_dirs=(str(drv),))
    assert {"libcuda.so.1", "libnvidia-ml.so.1", "libcuda.so.580.159.04"} <= set(libraries)
    dest = tmp_path / "root" / chroot.LIB_DIR
    added = chroot.copy_driver_libraries(dest, libraries)
    assert set(added) == set(libraries)
    for soname, real in libraries.items():
        assert (dest / soname).read_bytes() == real.read_bytes(), soname
    assert not (dest / "libcuda.so.580.159.04").is_symlink()
    assert os.readlink(dest / "libnvidia-ml.so.1") == "libnvidia-ml.so.580.159.04"


# --- what the runner writes: the user's files beside its own survive it (as test_owned_dirs checks for the product) --

def runner(*args, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.rootfs_runner", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def small_export(scratch: Path) -> Path:
    """A small export (one part), as `export` makes from an image's filesystem."""
    t = scratch / "tree"
    (t / "etc").mkdir(parents=True)
    (t / "etc" / "hostname").write_text("image\n")
    rootfs.pack(["tar", "-c", "-C", str(t), "-f", "-", "."], scratch / "export",
                {"image": "t:1", "image_id": "sha256:" + "0" * 64, "stack_id": "s"}, {}, part_size=MIB, level=1,
                compression="xz")
    return scratch / "export"


def _export_once(scratch: Path) -> Path:
    return scratch / "export" if (scratch / "export").exists() else small_export(scratch)


def _receive(d: Path, scratch: Path) -> int:
    batch = scratch / f"batch-{len(list(scratch.glob('batch-*')))}"  # each run receives a fresh copy of the batch
    shutil.copytree(_export_once(scratch) / "batch-01", batch)
    return runner("receive", batch, "--parts", d).returncode


# Each writer of a directory: how it writes D (its exit code), and names it writes there.
WRITERS = {
    "receive --parts": (_receive, ["manifest.json", "rootfs.tar.xz.000", "image-config.json"]),
    "export DIR": (lambda d, s: in_process(lambda: rootfs.pack(
        ["tar", "-c", "-C", str(REPO / "docker"), "-f", "-", "."], d, {"image": "t"}, {}, part_size=MIB, level=1,
        compression="xz")), ["batch-01", "manifest.json", "batch-01/manifest.json"]),
    "run --root": (lambda d, s: in_process(lambda: rootfs.unpack(d, _export_once(s) / "batch-01")),
                   ["etc", "etc/hostname"]),
}


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_the_users_files_survive_every_run(writer):
    users_files_survive_two_runs(*WRITERS[writer])


def _outputs() -> dict[tuple[str, str], argparse.Action]:
    """Every option of the runner's parser marked as an output (add_output), by (command, option)."""
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {(name, a.option_strings[-1] if a.option_strings else a.dest): a for name, p in sub.choices.items()
            for a in p._actions if getattr(a.type, "output_kind", None)}


def test_every_directory_the_runner_writes_is_covered():
    assert set(_outputs()) == {("export", "dir"), ("receive", "--parts"), ("run", "--root"), ("run", "out")}
    assert all(_outputs()[k].type.output_kind == "dir" for k in _outputs())


@pytest.mark.parametrize("key", sorted(_outputs()), ids=" ".join)
def test_a_file_where_a_directory_goes_is_refused_before_anything_runs(key, tmp_path):
    wrong = tmp_path / "results.json"
    wrong.write_text("mine")
    command, option = key
    given_ = {"export": ["img", "x"], "receive": ["x"], "run": ["x"]}[command]
    argv = [command, *given_, option, wrong] if option.startswith("-") else \
        [command, *given_[:-1], wrong] if command == "export" else [command, wrong]
    proc = runner(*argv)
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and str(wrong) in proc.stderr, proc.stderr
    assert wrong.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_run_refuses_a_root_it_did_not_unpack(tmp_path):
    parts = tmp_path / "parts"
    shutil.copytree(small_export(tmp_path) / "batch-01", parts)
    root = tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    proc = runner("run", tmp_path / "out", "--parts", parts, "--root", root, "--cpu", "--no-unshare")
    if os.geteuid() != 0:
        pytest.skip("run runs as root")
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "notes.txt" in proc.stderr, proc.stderr
    assert [p.name for p in root.iterdir()] == ["notes.txt"]


def test_export_into_a_missing_parent_makes_it(tmp_path):
    out = tmp_path / "missing" / "parent" / "export"
    rootfs.pack(["tar", "-c", "-C", str(REPO / "docker"), "-f", "-", "."], out, {"image": "t"}, {}, part_size=MIB,
                level=1, compression="xz")
    assert (out / "batch-01" / "manifest.json").is_file()


def test_export_on_a_full_disk_is_one_line_and_leaves_nothing(full_disk):
    with pytest.raises(UserError) as err:
        rootfs.pack(["tar", "-c", "-C", str(REPO / "docker"), "-f", "-", "."], full_disk / "export", {"image": "t"},
                    {}, part_size=MIB, level=0, compression="xz")
    assert err.value.exit_code == OUTPUT_REFUSED and "No space left" in str(err.value)
    assert [p.name for p in full_disk.iterdir()] == ["fill"]


@pytest.mark.parametrize("what", ["file", "read-only directory"])
def test_receive_into_parts_that_cannot_be_written(tmp_path, what):
    batch = small_export(tmp_path) / "batch-01"
    parts = tmp_path / "parts"
    if what == "file":
        parts.write_text("mine")
    else:
        parts.mkdir()
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(parts)],
                                               capture_output=True).returncode != 0:
            pytest.skip("a read-only mount needs root")
    try:
        proc = runner("receive", batch, "--parts", parts)
    finally:
        if what != "file":
            subprocess.run(["umount", str(parts)], capture_output=True)
    assert proc.returncode == OUTPUT_REFUSED and one_line(proc) and "--parts" in proc.stderr, proc.stderr
    assert (batch / "rootfs.tar.xz.000").is_file()  # nothing moved
    if what == "file":
        assert parts.read_text() == "mine"
