"""What keeps a build's directories out of its bytes (ucxbuild/repro.py), on real compilers, files and wheels: the
prefix maps a real gcc honours, the text the builds record, the leak search, and input keys that see the tools and
flags that change the bytes but not where the build ran."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import USAGE
from ucx_dask_gpu.ucxbuild import build, repro, ucxx

REPO = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs cc (stack.toml [debian] ucx_build_packages)")

HEADER = 'static const char *where(void) { return __FILE__; }\n'
SOURCE = '#include "inc/where.h"\nconst char *file_of_main = __FILE__;\nconst char *w(void) { return where(); }\n'


def compile_in(root: Path, flags: list[str]) -> bytes:
    """A translation unit with __FILE__ from itself and from a header under -I<root>, compiled with -g."""
    (root / "inc").mkdir(parents=True)
    (root / "inc" / "where.h").write_text(HEADER)
    (root / "main.c").write_text(SOURCE)
    out = root / "main.o"
    subprocess.run(["cc", "-g", "-O0", "-c", f"-I{root}", *flags, "-o", str(out), str(root / "main.c")],
                   check=True, cwd=root)
    return out.read_bytes()


@needs_cc
def test_gcc_with_the_maps_writes_the_same_object_from_two_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "some" / "much" / "deeper" / "b"
    objs = [compile_in(d, repro.PathMap.of({d: "/stand-in/ucx"}).compiler_flags()) for d in (a, b)]
    assert objs[0] == objs[1]
    assert b"/stand-in/ucx/main.c" in objs[0] and b"/stand-in/ucx/inc/where.h" in objs[0]
    assert str(tmp_path).encode() not in objs[0]
    # without the maps the directory is in the object: what the maps are for
    plain = compile_in(tmp_path / "plain", [])
    assert str(tmp_path / "plain").encode() in plain


@needs_cc
def test_the_most_specific_map_wins_whatever_the_order_given(tmp_path):
    """A work directory inside the checkout: its own stand-in, not the checkout's."""
    checkout = tmp_path / "checkout"
    work = checkout / "build" / "work"
    paths = repro.PathMap.of({checkout: "/s/checkout", work: "/s/ucx"})
    assert paths.dirs == [str(work), str(checkout)]
    obj = compile_in(work, paths.compiler_flags())
    assert b"/s/ucx/main.c" in obj and b"/s/checkout" not in obj


def test_flag_order_follows_nesting_and_stand_ins_not_path_lengths(tmp_path):
    """UCX records its CFLAGS: a work directory outside the checkout, shorter or longer than it, gives the same
    mapped flags as one inside it."""
    checkout = str(tmp_path / "a-rather-long-checkout-path" / "ucx-dask-gpu")
    mapped = set()
    for work in (f"{checkout}/build/ucx-work", "/tmp/w", str(tmp_path / ("x" * 80) / "work")):
        paths = repro.PathMap.of({work: "/s/ucx", checkout: "/s/checkout"})
        mapped.add(paths.text(" ".join(paths.compiler_flags())))
    assert mapped == {"-ffile-prefix-map=/s/checkout=/s/checkout -ffile-prefix-map=/s/ucx=/s/ucx"}


def test_text_maps_whole_directories_in_one_pass(tmp_path):
    paths = repro.PathMap.of({"/usr/src": "/usr/src/stand/in", "/tmp/w": "/s/w"})
    assert paths.text("-I/tmp/w/include /tmp/w /tmp/wx /tmp/w.old CFLAGS=-ffile-prefix-map=/tmp/w=/s/w /usr/src/a") \
        == "-I/s/w/include /s/w /tmp/wx /tmp/w.old CFLAGS=-ffile-prefix-map=/s/w=/s/w /usr/src/stand/in/a"
    assert paths.data({"a": ["/tmp/w/x", 3, None], "/tmp/w": "/tmp/wq"}) == {"a": ["/s/w/x", 3, None],
                                                                            "/s/w": "/tmp/wq"}


def test_flag_env_keeps_the_callers_flags_first():
    paths = repro.PathMap.of({"/tmp/w": "/s/w"})
    env = paths.flag_env({"CFLAGS": "-O2", "PATH": "/bin"})
    assert env["CFLAGS"] == "-O2 -ffile-prefix-map=/tmp/w=/s/w"
    assert env["CXXFLAGS"] == "-ffile-prefix-map=/tmp/w=/s/w"
    assert env["NVCCFLAGS"] == env["CUDAFLAGS"] == "-Xcompiler=-ffile-prefix-map=/tmp/w=/s/w"
    assert env["PATH"] == "/bin"


def test_build_env_fixes_time_locale_and_zone(st, monkeypatch):
    monkeypatch.setenv("TZ", "GMT-14")
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("LANGUAGE", "fr")
    monkeypatch.setenv("MAKEFLAGS", "-j9")
    env = repro.build_env(st)
    assert (env["TZ"], env["LC_ALL"], env["LANG"], env["SOURCE_DATE_EPOCH"]) == \
        ("UTC", "C", "C", str(st.source_date_epoch))
    assert "LANGUAGE" not in env and "MAKEFLAGS" not in env


def test_fixed_umask_while_building(tmp_path):
    old = os.umask(0o077)
    try:
        with repro.fixed_umask():
            (tmp_path / "f").write_text("x")
            (tmp_path / "d").mkdir()
        (tmp_path / "g").write_text("y")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"f": 0o644, "d": 0o755, "g": 0o600}


def test_paths_in_finds_a_directory_in_a_tree_and_in_a_wheel(tmp_path):
    work = "/tmp/some/work"
    tree = tmp_path / "tree"
    (tree / "lib").mkdir(parents=True)
    (tree / "lib" / "libx.so").write_bytes(b"\x7fELF..." + work.encode() + b"/src/a.c\0more")
    (tree / "lib" / "liby.so").write_bytes(b"\x7fELF..." + work.encode() + b"er/not-it\0")
    (tree / "ok.txt").write_text("/usr/src/ucx-dask-gpu/ucx/src/a.c")
    assert repro.paths_in(tree, [work, "/"]) == {"lib/libx.so": [work]}
    whl = tmp_path / "x-1-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("x/ok.py", "print(1)")
        z.writestr("x/lib.so", b"abc" + work.encode() + b"\0")
    assert repro.paths_in(whl, [work]) == {f"{whl.name}!x/lib.so": [work]}


def test_stamp_changes_only_with_the_key(tmp_path):
    stamp = tmp_path / "p.stamp"
    repro.write_stamp(stamp, "k1")
    os.utime(stamp, (1, 1))
    repro.write_stamp(stamp, "k1")
    assert stamp.stat().st_mtime == 1, "same key: untouched, so make does not rebuild what depends on it"
    repro.write_stamp(stamp, "k2")
    assert stamp.read_text() == "k2\n" and stamp.stat().st_mtime > 1
    repro.write_stamp(None, "k3")   # no stamp asked for: nothing written


# --- input keys ---------------------------------------------------------------------------------------------------

def ucx_build_info(st, files: dict | None = None) -> dict:
    return {"ucx_version": st.ucx.version, "source": {"content_tree": st.ucx.content_tree}, "patches": [],
            "configure": {"stack_flags": list(st.configure_flags)},
            "files": files or {"include/ucp/api/ucp.h": "a" * 64, "lib/libucp.so.0.0.0": "b" * 64}}


def test_ucxx_key_sees_ucx_headers_tools_and_flags_but_no_path(st, monkeypatch):
    monkeypatch.delenv("CFLAGS", raising=False)
    info = ucx_build_info(st)
    key = ucxx.input_key(st, info, [])
    other_lib = ucx_build_info(st, {"include/ucp/api/ucp.h": "a" * 64, "lib/libucp.so.0.0.0": "c" * 64})
    assert ucxx.input_key(st, other_lib, []) == key, "the library's bytes are linked by soname, not compiled in"
    other_header = ucx_build_info(st, {"include/ucp/api/ucp.h": "d" * 64, "lib/libucp.so.0.0.0": "b" * 64})
    assert ucxx.input_key(st, other_header, []) != key
    monkeypatch.setenv("CFLAGS", "-O1")
    assert ucxx.input_key(st, info, []) != key
    monkeypatch.delenv("CFLAGS")
    monkeypatch.setenv("CC", "definitely-not-a-compiler")
    assert ucxx.input_key(st, info, []) != key, "another C compiler (here: none) is another input"
    monkeypatch.delenv("CC")
    monkeypatch.chdir("/")
    assert ucxx.input_key(st, info, []) == key


def test_ucx_key_ignores_work_dir_and_prefix_but_not_the_options(st, tmp_path, monkeypatch):
    monkeypatch.delenv("CFLAGS", raising=False)
    opts = build.BuildOptions(prefix=tmp_path / "a" / "prefix", work_dir=tmp_path / "a" / "work", cuda="none")
    key = build.input_key(st, opts, [])
    moved = build.BuildOptions(prefix=tmp_path / "x" / "y" / "prefix", work_dir=tmp_path / "x" / "work",
                               cuda="none")
    assert build.input_key(st, moved, []) == key
    assert build.input_key(st, build.BuildOptions(prefix=opts.prefix, cuda="none", keep_debug=True), []) != key
    assert build.input_key(st, build.BuildOptions(prefix=opts.prefix, cuda="auto"), []) != key
    patch = tmp_path / "0001-x.patch"
    patch.write_text("x")
    assert build.input_key(st, opts, [patch]) != key
    monkeypatch.setenv("CFLAGS", "-O1")
    assert build.input_key(st, opts, []) != key


def test_an_up_to_date_prefix_is_one_whose_files_are_as_recorded(st, tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "libucs.so").write_bytes(b"x")
    info = {"input_key": "k", "files": build.file_manifest(prefix)}
    (prefix / "share" / "ucx-dask-gpu").mkdir(parents=True)
    (prefix / "share" / "ucx-dask-gpu" / "build-info.json").write_text(json.dumps(info))
    assert build.up_to_date(prefix, "k") and not build.up_to_date(prefix, "other")
    (prefix / "lib" / "libucs.so").write_bytes(b"changed")
    assert not build.up_to_date(prefix, "k")


def test_prefix_map_prints_exports_for_build_scripts(st, tmp_path):
    proc = subprocess.run([str(REPO / "ucx-src-build" / "build.sh"), "prefix-map", "--map", f"{tmp_path}=ucx",
                           "--map", "/opt/p=/opt/ucx"], capture_output=True, text=True,
                          env={**os.environ, "CFLAGS": "-O2"})
    assert proc.returncode == 0, proc.stderr
    # neither holds the other: in the order of their stand-ins
    assert f"export CFLAGS='-O2 -ffile-prefix-map=/opt/p=/opt/ucx -ffile-prefix-map={tmp_path}=" \
           f"{st.build_root}/ucx'" in proc.stdout.splitlines()
    assert "export NVCCFLAGS='-Xcompiler=-ffile-prefix-map=" in proc.stdout
    bad = subprocess.run([str(REPO / "ucx-src-build" / "build.sh"), "prefix-map", "--map", "nonsense"],
                         capture_output=True, text=True)
    assert bad.returncode == USAGE and len(bad.stderr.strip().splitlines()) == 1
