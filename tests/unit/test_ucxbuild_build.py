"""UCX build steps that run in seconds: configure line, capability detection, CUDA resolution, .deb unpacking,
relocation of a real (tiny) ELF prefix, install into a prefix. The full build is tests/integration/test_ucx_build.py.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ucx_dask_gpu.errors import MISSING_CAPABILITY, SOURCE_UNREACHABLE, USAGE, UserError
from ucx_dask_gpu.ucxbuild import build, cuda, relocate, repro

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "ucx_build"
needs_cc = pytest.mark.skipif(shutil.which("cc") is None or shutil.which("patchelf") is None,
                              reason="needs cc and patchelf (stack.toml [debian] ucx_build_packages)")


def toolkit(root: Path, version: int = 12080, nvml: bool = True, stubs: bool = True) -> Path:
    inc = root / "include"
    inc.mkdir(parents=True)
    (inc / "cuda.h").write_text(f"#define CUDA_VERSION {version}\n")
    (inc / "cuda_runtime.h").write_text("\n")
    if nvml:
        (inc / "nvml.h").write_text("\n")
    if stubs:
        (root / "lib64" / "stubs").mkdir(parents=True)
        for lib in cuda.LINK_LIBS:
            (root / "lib64" / "stubs" / lib).write_bytes(b"")
    return root


# --- configure line ---------------------------------------------------------------------------------------------

def test_configure_command_has_stack_flags_and_detected_ones(st, tmp_path, monkeypatch):
    monkeypatch.setenv("CFLAGS", "-O2 -pipe")
    monkeypatch.delenv("LDFLAGS", raising=False)
    setup = cuda.CudaSetup(kind="toolkit", home=tmp_path / "cuda", include_dir=tmp_path / "cuda/include",
                           link_dirs=[tmp_path / "link"])
    caps = {"verbs": True, "rdmacm": False, "numa": True, "cuda": True, "gdrcopy": "/opt/gdr"}
    paths = repro.PathMap.of({tmp_path / "work": "/stand-in/ucx"})
    cmd = build.configure_command(st, setup, caps, paths)
    # always configured for the image's prefix: the build installs a relocated copy wherever --prefix says
    assert cmd[0] == "contrib/configure-release" and f"--prefix={st.image.ucx_prefix}" in cmd
    pos = [cmd.index(f) for f in st.configure_flags]
    assert pos == sorted(pos), "stack.toml's flags, in stack.toml's order"
    assert {f"--with-cuda={tmp_path / 'cuda'}", "--with-verbs", "--without-rdmacm", "--with-gdrcopy=/opt/gdr"} <= set(cmd)
    cflags = next(a for a in cmd if a.startswith("CFLAGS="))
    assert cflags == f"CFLAGS=-O2 -pipe -ffile-prefix-map={tmp_path / 'work'}=/stand-in/ucx"
    assert f"NVCCFLAGS=-Xcompiler=-ffile-prefix-map={tmp_path / 'work'}=/stand-in/ucx" in cmd
    assert f"LDFLAGS=-L{tmp_path / 'link'}" in cmd
    assert f"CPPFLAGS=-I{tmp_path / 'cuda/include'}" in cmd


def test_configure_command_without_cuda(st, tmp_path):
    caps = {"verbs": False, "rdmacm": False, "numa": True, "cuda": False, "gdrcopy": None}
    cmd = build.configure_command(st, cuda.CudaSetup(kind="none"), caps, repro.PathMap.of({}))
    assert {"--without-cuda", "--without-verbs", "--without-rdmacm", "--without-gdrcopy"} <= set(cmd)


def test_the_configure_line_ucx_compiles_in_names_stand_ins(tmp_path):
    """config.h's UCX_CONFIGURE_FLAGS (what ucx_info prints) loses the work directory; nothing else changes."""
    work = tmp_path / "deep" / "work"
    text = (f'#define HAVE_CUDA 1\n#define UCX_CONFIGURE_FLAGS "--prefix=/opt/ucx --with-cuda={work}/cuda '
            f'CPPFLAGS=-I{work}/cuda/include CFLAGS=-ffile-prefix-map={work}=/s/ucx"\n#define X "{work}"\n')
    (tmp_path / "config.h").write_text(text)
    build.map_configure_line(tmp_path, repro.PathMap.of({work: "/s/ucx"}))
    assert (tmp_path / "config.h").read_text() == (
        '#define HAVE_CUDA 1\n#define UCX_CONFIGURE_FLAGS "--prefix=/opt/ucx --with-cuda=/s/ucx/cuda '
        f'CPPFLAGS=-I/s/ucx/cuda/include CFLAGS=-ffile-prefix-map=/s/ucx=/s/ucx"\n#define X "{work}"\n')


def test_configure_summary_from_a_real_configure_run():
    s = build.parse_configure_summary((FIX / "configure-summary-ucx-1.13.1.txt").read_text().splitlines())
    assert s["UCT modules"] == ["cma", "cuda", "ib", "rdmacm"]
    assert s["UCM modules"] == ["cuda"] and s["Perf modules"] == ["cuda"] and s["IB modules"] == []


def test_parse_require():
    assert build.parse_require("ib, cuda") == {"ib", "cuda"}
    assert build.parse_require(None) == frozenset()
    with pytest.raises(UserError) as e:
        build.parse_require("ib,infiniband")
    assert e.value.exit_code == USAGE and "infiniband" in str(e.value)


# --- capability detection ------------------------------------------------------------------------------------------

@needs_cc
def test_header_probe_uses_the_real_preprocessor():
    assert build.header_available("stdio.h", [])
    assert not build.header_available("ucx_dask_gpu/no/such/header.h", [])


@needs_cc
def test_required_ib_without_headers_is_fatal(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "cc -nostdinc")  # a compiler that finds no system headers at all
    opts = build.BuildOptions(prefix=tmp_path, require=frozenset({"ib"}))
    with pytest.raises(UserError) as e:
        build.detect_capabilities(cuda.CudaSetup(kind="none"), opts)
    assert e.value.exit_code == MISSING_CAPABILITY and "infiniband/verbs.h" in str(e.value)


@needs_cc
def test_missing_ib_headers_only_warn_when_not_required(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CC", "cc -nostdinc")
    caps = build.detect_capabilities(cuda.CudaSetup(kind="none"), build.BuildOptions(prefix=tmp_path))
    assert caps["verbs"] is False and caps["rdmacm"] is False
    assert "--without-verbs" in capsys.readouterr().err


def test_gdrcopy_dir_is_checked(tmp_path):
    with pytest.raises(UserError) as e:
        build.detect_capabilities(cuda.CudaSetup(kind="none"), build.BuildOptions(prefix=tmp_path, gdrcopy=tmp_path))
    assert e.value.exit_code == MISSING_CAPABILITY and "gdrapi.h" in str(e.value)


# --- CUDA -------------------------------------------------------------------------------------------------------

def test_explicit_toolkit_with_stubs(st, tmp_path):
    home = toolkit(tmp_path / "cuda")
    s = cuda.resolve(str(home), st, tmp_path / "work", link_dir=None, fetch_kw={})
    assert (s.kind, s.version, s.home) == ("toolkit", "12.8", home)
    assert s.link_dirs == [home / "lib64" / "stubs"]
    assert s.record()["kind"] == "toolkit" and s.record()["inputs"] == []


def test_conda_style_targets_include(st, tmp_path):
    home = tmp_path / "prefix"
    toolkit(home / "targets" / "x86_64-linux", version=13000)
    (home / "lib" / "stubs").mkdir(parents=True)
    for lib in cuda.LINK_LIBS:
        (home / "lib" / "stubs" / lib).write_bytes(b"")
    if cuda._arch_dirs() != ["x86_64-linux"]:
        pytest.skip("layout test written for x86_64")
    s = cuda.resolve(str(home), st, tmp_path / "work", link_dir=None, fetch_kw={})
    assert s.include_dir == home / "targets" / "x86_64-linux" / "include" and s.version == "13.0"
    assert s.link_dirs == [home / "lib" / "stubs"]


def test_explicit_toolkit_without_nvml_is_refused(st, tmp_path):
    home = toolkit(tmp_path / "cuda", nvml=False)
    with pytest.raises(UserError) as e:
        cuda.resolve(str(home), st, tmp_path / "work", link_dir=None, fetch_kw={})
    assert e.value.exit_code == MISSING_CAPABILITY and "nvml.h" in str(e.value)


def test_link_dir_must_hold_both_libraries(st, tmp_path):
    home = toolkit(tmp_path / "cuda", stubs=False)
    (tmp_path / "link").mkdir()
    (tmp_path / "link" / "libcuda.so").write_bytes(b"")
    with pytest.raises(UserError) as e:
        cuda.resolve(str(home), st, tmp_path / "work", link_dir=tmp_path / "link", fetch_kw={})
    assert "libnvidia-ml.so" in str(e.value)


def test_auto_prefers_a_complete_cuda_home(st, tmp_path, monkeypatch):
    home = toolkit(tmp_path / "cuda")
    monkeypatch.setenv("CUDA_HOME", str(home))
    s = cuda.resolve("auto", st, tmp_path / "work", link_dir=None, fetch_kw={})
    assert s.kind == "toolkit" and s.home == home and "auto" in s.note


def test_auto_skips_an_incomplete_toolkit_for_the_pinned_wheels(st, tmp_path, monkeypatch):
    """Headers incomplete -> the pinned wheels; offline with an empty cache that fails naming the first wheel."""
    monkeypatch.setenv("CUDA_HOME", str(toolkit(tmp_path / "cuda", nvml=False)))
    monkeypatch.delenv("UCX_SOURCE_DIR", raising=False)
    monkeypatch.setattr(cuda, "_auto_candidates", lambda: [tmp_path / "cuda"])  # not this host's /usr/local/cuda
    kw = {"cache": tmp_path / "cache", "dirs": [], "offline": True}
    with pytest.raises(UserError) as e:
        cuda.resolve("auto", st, tmp_path / "work", link_dir=None, fetch_kw=kw)
    assert e.value.exit_code == SOURCE_UNREACHABLE and st.cuda_header_wheels[0].name in str(e.value)


def test_cuda_none_and_missing_dir(st, tmp_path):
    assert cuda.resolve("none", st, tmp_path, link_dir=None, fetch_kw={}).kind == "none"
    with pytest.raises(UserError) as e:
        cuda.resolve(str(tmp_path / "nope"), st, tmp_path, link_dir=None, fetch_kw={})
    assert e.value.exit_code == USAGE


@pytest.mark.skipif(shutil.which("dpkg-deb") is None, reason="needs dpkg-deb to make a real .deb")
def test_extract_deb_like_dpkg_x(tmp_path):
    pkg = tmp_path / "pkg"
    libdir = pkg / "usr" / "lib" / "x86_64-linux-gnu" / "nvidia" / "current"
    libdir.mkdir(parents=True)
    (libdir / "libcuda.so.535.1").write_bytes(b"\x7fELF fake")
    (libdir / "libcuda.so.1").symlink_to("libcuda.so.535.1")
    (pkg / "DEBIAN").mkdir()
    (pkg / "DEBIAN" / "control").write_text("Package: t\nVersion: 1\nArchitecture: amd64\nMaintainer: t <t@t>\n"
                                            "Description: t\n")
    deb = tmp_path / "t.deb"
    subprocess.run(["dpkg-deb", "-Zxz", "--build", str(pkg), str(deb)], check=True, capture_output=True)
    out = tmp_path / "out"
    cuda.extract_deb(deb, out)
    got = out / "usr" / "lib" / "x86_64-linux-gnu" / "nvidia" / "current"
    assert (got / "libcuda.so.1").is_symlink() and (got / "libcuda.so.1").read_bytes() == b"\x7fELF fake"


def test_extract_deb_rejects_other_files(tmp_path):
    f = tmp_path / "x.deb"
    f.write_bytes(b"PK\x03\x04 not an ar archive")
    with pytest.raises(UserError):
        cuda.extract_deb(f, tmp_path / "out")


# --- relocation on a real ELF prefix ------------------------------------------------------------------------------

@needs_cc
def test_relocatable_prefix_runs_after_copy(tmp_path):
    """libtool-style absolute RUNPATHs -> $ORIGIN ones; the copied prefix runs with no LD_LIBRARY_PATH."""
    built = tmp_path / "built"
    (built / "bin").mkdir(parents=True)
    (built / "lib" / "ucx").mkdir(parents=True)
    (built / "lib" / "pkgconfig").mkdir()
    (built / "lib" / "cmake" / "ucx").mkdir(parents=True)
    src = tmp_path / "src"
    src.mkdir()
    (src / "lib.c").write_text("int answer(void) { return 42; }\n")
    (src / "mod.c").write_text("int answer(void); int mod(void) { return answer() + 1; }\n")
    (src / "main.c").write_text("int answer(void);\nint main(void) { return answer() == 42 ? 0 : 1; }\n")
    lib = built / "lib"
    cc = ["cc", "-fPIC"]
    subprocess.run(cc + ["-shared", "-Wl,-soname,libanswer.so.0", "-o", lib / "libanswer.so.0.0.0", src / "lib.c"],
                   check=True)
    (lib / "libanswer.so.0").symlink_to("libanswer.so.0.0.0")
    (lib / "libanswer.so").symlink_to("libanswer.so.0.0.0")
    subprocess.run(cc + ["-shared", "-Wl,-soname,libmod.so.0", "-o", lib / "ucx" / "libmod.so.0.0.0", src / "mod.c",
                         f"-L{lib}", "-lanswer", f"-Wl,-rpath,{lib}:{lib / 'ucx'}"], check=True)
    (lib / "ucx" / "libmod.so.0").symlink_to("libmod.so.0.0.0")
    (lib / "ucx" / "libmod.so").symlink_to("libmod.so.0.0.0")
    # like libuct_rdmacm.so -> libuct_ib.so.0: a module that needs its sibling in lib/ucx/
    (src / "mod2.c").write_text("int mod(void); int mod2(void) { return mod(); }\n")
    subprocess.run(cc + ["-shared", "-o", lib / "ucx" / "libmod2.so.0.0.0", src / "mod2.c", f"-L{lib / 'ucx'}",
                         "-lmod", f"-L{lib}", "-lanswer", f"-Wl,-rpath,{lib}:{lib / 'ucx'}:/elsewhere/cuda-link"],
                   check=True)
    subprocess.run(cc + ["-o", built / "bin" / "answer", src / "main.c", f"-L{lib}", "-lanswer",
                         f"-Wl,-rpath,{lib}"], check=True)
    (lib / "libanswer.la").write_text(f"libdir='{lib}'\n")
    (lib / "pkgconfig" / "ucx.pc").write_text(f"prefix = {built}\nlibdir = ${{prefix}}/lib\nName: ucx\n")
    (lib / "cmake" / "ucx" / "ucx-targets.cmake").write_text(f'set(prefix "{built}")\nset(exec_prefix "${{prefix}}")\n')

    report = relocate.make_relocatable(built, str(built))
    assert relocate.runpath_of(built / "bin" / "answer") == "$ORIGIN/../lib"
    assert relocate.runpath_of(lib / "ucx" / "libmod2.so.0.0.0") == "$ORIGIN/..:$ORIGIN", "build dirs dropped"
    assert report["libtool_archives_dropped"] == 1 and not (lib / "libanswer.la").exists()
    assert report["files_still_naming_build_prefix"] == []

    moved = tmp_path / "elsewhere" / "prefix"
    shutil.copytree(built, moved, symlinks=True)
    shutil.rmtree(built)  # the original path must not be what makes it work
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    assert subprocess.run([moved / "bin" / "answer"], env=env).returncode == 0
    ldd = subprocess.run(["ldd", moved / "lib" / "ucx" / "libmod2.so.0.0.0"], env=env, capture_output=True, text=True)
    assert "not found" not in ldd.stdout and str(moved) in ldd.stdout
    pc = subprocess.run(["pkg-config", "--variable=libdir", "ucx"], capture_output=True, text=True,
                        env={**env, "PKG_CONFIG_PATH": str(moved / "lib" / "pkgconfig")})
    if pc.returncode == 0:  # pkg-config is in ucx_build_packages; resolve it like a consumer would
        assert Path(pc.stdout.strip()).resolve() == (moved / "lib").resolve()
    assert "CMAKE_CURRENT_LIST_DIR" in (moved / "lib" / "cmake" / "ucx" / "ucx-targets.cmake").read_text()


def test_clamp_mtimes_and_manifest(tmp_path, st):
    (tmp_path / "p" / "lib").mkdir(parents=True)
    (tmp_path / "p" / "lib" / "a.so.0.0.0").write_bytes(b"a")
    (tmp_path / "p" / "lib" / "a.so.0").symlink_to("a.so.0.0.0")
    relocate.clamp_mtimes(tmp_path / "p", st.source_date_epoch)
    for p in [tmp_path / "p", *(tmp_path / "p").rglob("*")]:
        assert os.lstat(p).st_mtime == st.source_date_epoch
    m = build.file_manifest(tmp_path / "p")
    assert m["lib/a.so.0"] == "-> a.so.0.0.0" and len(m["lib/a.so.0.0.0"]) == 64


# --- install into the prefix --------------------------------------------------------------------------------------

def staged(tmp_path: Path, marker: str) -> Path:
    root = tmp_path / f"stage-{marker}"
    (root / "share" / "ucx-dask-gpu").mkdir(parents=True)
    (root / "lib").mkdir()
    (root / "lib" / f"only-in-{marker}").write_text(marker)
    (root / build.BUILD_INFO).write_text(json.dumps({"marker": marker, "files": build.file_manifest(root)}))
    return root


def test_install_new_then_replace_our_own_build(tmp_path):
    prefix = tmp_path / "prefix"
    assert build.install_into_prefix(staged(tmp_path, "one"), prefix) == "created"
    assert build.install_into_prefix(staged(tmp_path, "two"), prefix) == "replaced"
    assert sorted(p.name for p in (prefix / "lib").iterdir()) == ["only-in-two"], "an earlier build is replaced whole"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".prefix")], "no temp dirs left next to it"


def test_install_merges_into_a_foreign_prefix(tmp_path):
    prefix = tmp_path / "conda-prefix"
    (prefix / "include").mkdir(parents=True)
    (prefix / "include" / "cuda.h").write_text("host dependency")
    assert build.install_into_prefix(staged(tmp_path, "one"), prefix) == "merged"
    assert (prefix / "include" / "cuda.h").read_text() == "host dependency"
    assert (prefix / "lib" / "only-in-one").is_file()


def test_ucxbuild_needs_only_the_standard_library(tmp_path):
    """The builder stage / conda build env has a bare python3: import the build code with site-packages disabled."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from ucx_dask_gpu.ucxbuild import build, cli, cuda, fetch, relocate, verify; "
            "cli.main(['--help'])")
    r = subprocess.run(["python3", "-S", "-c", code, str(REPO / "src")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "fetch" in r.stdout and "verify" in r.stdout


# --- failures show their logs --------------------------------------------------------------------------------------

def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def test_configure_failure_prints_the_config_log_tail(st, tmp_path, capsys):
    """A configure that fails the way autoconf ones do: its config.log tail is shown, the error line is the reason."""
    src = tmp_path / "src"
    _script(src / "contrib" / "configure-release",
            'for i in $(seq 1 100); do echo "config.log line $i" >> config.log; done\n'
            'echo "checking for nvml.h... no"\n'
            'echo "configure: error: nvml header not found. Install appropriate cuda-nvml-devel package" >&2\n'
            "exit 1\n")
    with pytest.raises(UserError) as e:
        build.configure(st, src, ["contrib/configure-release"], dict(os.environ), tmp_path / "logs" / "configure.log")
    assert e.value.exit_code == build.BUILD_FAILED
    assert "nvml header not found" in str(e.value) and "config.log" in str(e.value)
    out = capsys.readouterr().out
    assert "config.log line 100" in out and f"config.log line {100 - build.CONFIG_LOG_TAIL}\n" not in out


def test_make_failure_names_the_component_and_log(tmp_path, capsys):
    src = tmp_path / "src"
    for d in build.SUBDIRS:
        (src / d).mkdir(parents=True, exist_ok=True)
        ok = d != "src/uct"
        (src / d / "Makefile").write_text("all:\n\t@echo '  CC       x.lo'\n" + ("" if ok else
                                          "\t@echo 'x.c:1:1: error: unknown type name foo' && false\n")
                                          + "install:\n\t@true\n")
    (src / "Makefile").write_text("install-data-am:\n\t@true\n")
    with pytest.raises(UserError) as e:
        build.make_and_install(src, tmp_path / "stage", 2, dict(os.environ), tmp_path / "logs")
    msg = str(e.value)
    assert e.value.exit_code == build.BUILD_FAILED and "src/uct" in msg and "unknown type name foo" in msg
    assert (tmp_path / "logs" / "make-src_uct.log").is_file() and "make-src_uct.log" in msg
    assert "[3/" not in capsys.readouterr().out, "nothing after the failing component ran"


def test_a_file_the_user_added_to_an_earlier_build_is_never_replaced_with_it(tmp_path):
    prefix = tmp_path / "prefix"
    build.install_into_prefix(staged(tmp_path, "one"), prefix)
    assert build.foreign_in_earlier_build(prefix) == []
    (prefix / "etc").mkdir()
    (prefix / "etc" / "site.conf").write_text("mine")
    assert build.foreign_in_earlier_build(prefix) == ["etc"]  # build() refuses it (exit 9) before building
    assert build.install_into_prefix(staged(tmp_path, "two"), prefix) == "merged"
    assert (prefix / "etc" / "site.conf").read_text() == "mine"
