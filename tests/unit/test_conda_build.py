"""The conda-build contract, packing, indexing and installing, with a tiny real C package built here in seconds.

`hello` is built the way a naive autotools build installs: an absolute RUNPATH into $PREFIX/lib, $PREFIX compiled into
a shared library, $PREFIX written into a text file. The chain must make it relocatable (RUNPATH -> $ORIGIN, both
files recorded for prefix replacement), pack a real .conda, index it with py-rattler, and py-rattler must solve and
install it into a fresh prefix where the recipe's tests pass and the binary prints the NEW prefix.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.conda import build as B
from ucx_dask_gpu.conda.channel import build_channel, index_channel, install_test
from ucx_dask_gpu.conda.package import pack
from ucx_dask_gpu.conda.render import render
from ucx_dask_gpu.errors import BUILD_FAILED, INSTALL_FAILED, PACKAGE_INVALID, UserError
from ucx_dask_gpu.fsutil import sha256_file
from ucx_dask_gpu.stack import load
from ucx_dask_gpu.ucxbuild.gittree import content_tree

REPO = Path(__file__).resolve().parents[2]
VARIANT = {"c_stdlib": "sysroot", "c_stdlib_version": "2.28"}
needs_tools = pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("patchelf") and shutil.which("objdump")),
                                 reason="needs gcc, patchelf, objdump (ci/install_prereqs.sh installs them)")

META = """\
package:
  name: hello
  version: 1.2.3
source:
  path: .
build:
  number: 0
  run_exports:
    - {{ pin_subpackage("hello", max_pin="x.x") }}
requirements:
  build:
    - {{ stdlib("c") }}
    - {{ compiler("c") }}
  host:
HOST
  run_constrained:
    - __cuda >=13
test:
  commands:
    - hello
    - test "$(hello)" = "prefix=$PREFIX"
    - grep -qxF "$PREFIX" "$PREFIX/share/hello/where.txt"
about:
  home: https://example.invalid/hello
  license: MIT
  license_file: LICENSE
  summary: relocation test package
extra:
  recipe-maintainers:
    - nobody
"""
BUILD = """\
set -euo pipefail
mkdir -p "$PREFIX/lib" "$PREFIX/bin" "$PREFIX/share/hello"
gcc -shared -fPIC -o "$PREFIX/lib/libhello.so.1" -Wl,-soname,libhello.so.1 hello.c -DWHERE="\\"$PREFIX\\"" EXTRA_LIBS
ln -s libhello.so.1 "$PREFIX/lib/libhello.so"
gcc -o "$PREFIX/bin/hello" main.c -L"$PREFIX/lib" -lhello -Wl,-rpath,RPATH
echo "$PREFIX" > "$PREFIX/share/hello/where.txt"
"""


def make_recipe(root: Path, *, host: str = "", extra_libs: str = "", rpath: str = "$PREFIX/lib",
                build_sh: str | None = None) -> Path:
    d = root / "hello"
    d.mkdir(parents=True)
    (d / "meta.yaml").write_text(META.replace("HOST", host))
    (d / "build.sh").write_text(build_sh if build_sh is not None else
                                BUILD.replace("EXTRA_LIBS", extra_libs).replace("RPATH", f'"{rpath}"'))
    (d / "hello.c").write_text("const char *where(void) { return WHERE; }\n")
    (d / "main.c").write_text('#include <stdio.h>\nconst char *where(void);\n'
                              'int main(void) { printf("prefix=%s\\n", where()); return 0; }\n')
    (d / "LICENSE").write_text("MIT\n")
    return d


def build_hello(tmp_path: Path, **kw) -> B.BuiltPackage:
    r = render(make_recipe(tmp_path / "recipes", **kw), VARIANT)
    return B.build(r, croot=tmp_path / "croot", sources_dir=None, caller_env=dict(os.environ),
                   log_dir=tmp_path / "logs")


def test_placeholder_prefix_is_255_characters(tmp_path):
    p = B.placeholder_prefix(tmp_path / "x")
    assert len(str(p)) == 255 and "_h_env_placehold" in str(p)


@needs_tools
def test_build_pack_index_install_relocates(tmp_path):
    pkg = build_hello(tmp_path)
    assert pkg.files == ["bin/hello", "lib/libhello.so", "lib/libhello.so.1", "share/hello/where.txt"]
    assert B._patchelf("--print-rpath", str(pkg.prefix / "bin/hello")) == "$ORIGIN/../lib"
    assert pkg.prefix_files == {"lib/libhello.so.1": "binary", "share/hello/where.txt": "text"}
    assert any(d.startswith("__glibc >=2.") for d in pkg.depends)
    assert pkg.extra["linked_outside_package"] == {"libc.so.6": "glibc (__glibc)"}

    channel = tmp_path / "channel"
    conda = pack(pkg, channel, 1764460800000, "{}\n")
    assert conda.name == f"hello-1.2.3-{pkg.rendered.pkg_hash}_0.conda" and conda.parent.name == "linux-64"
    index_channel(channel)
    assert sorted(p.name for p in channel.iterdir()) == ["linux-64", "noarch"]
    repodata = json.loads((channel / "linux-64/repodata.json").read_text())
    rec = repodata["packages.conda"][conda.name]
    assert rec["constrains"] == ["__cuda >=13"] and rec["sha256"] == sha256_file(conda)
    assert json.loads((channel / "noarch/repodata.json").read_text())["packages.conda"] == {}

    import conda_package_handling.api as cph
    unpacked = tmp_path / "unpacked"
    cph.extract(str(conda), dest_dir=str(unpacked))
    paths = {p["_path"]: p for p in json.loads((unpacked / "info/paths.json").read_text())["paths"]}
    assert paths["lib/libhello.so.1"]["file_mode"] == "binary"
    assert paths["lib/libhello.so.1"]["prefix_placeholder"] == str(pkg.prefix)
    assert paths["lib/libhello.so"]["path_type"] == "softlink"
    assert json.loads((unpacked / "info/run_exports.json").read_text()) == {"weak": ["hello >=1.2.3,<1.3.0a0"]}
    assert (unpacked / "info/has_prefix").read_text().count(str(pkg.prefix)) == 2
    assert (unpacked / "info/recipe/meta.yaml.template").read_text().startswith("package:")
    assert "hello >=1.2.3,<1.3.0a0" in (unpacked / "info/recipe/meta.yaml").read_text()
    assert (unpacked / "info/licenses/LICENSE").is_file()
    assert "test \"$(hello)\"" in (unpacked / "info/test/run_test.sh").read_text()

    res = install_test(channel, work=tmp_path / "it", cuda="13.0")
    got = res["packages"][conda.name]
    installed = Path(got["prefix"])
    out = subprocess.run([installed / "bin/hello"], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"}).stdout
    assert out == f"prefix={installed}\n"  # binary prefix replacement, padded C string
    assert got["placeholders_absent"] == [str(pkg.prefix)] and got["elf_files_checked"] == 2


@needs_tools
def test_driver_too_old_or_glibc_too_old_cannot_install(tmp_path):
    pkg = build_hello(tmp_path)
    channel = tmp_path / "channel"
    pack(pkg, channel, 1764460800000, "{}\n")
    index_channel(channel)
    with pytest.raises(UserError) as e:
        install_test(channel, work=tmp_path / "it1", cuda="12.4")
    assert e.value.exit_code == INSTALL_FAILED and "__cuda" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        install_test(channel, work=tmp_path / "it2", cuda="13.0", glibc="2.17")
    assert e.value.exit_code == INSTALL_FAILED and "__glibc" in str(e.value)


@needs_tools
def test_broken_build_script_is_one_line_with_the_log(tmp_path):
    with pytest.raises(UserError) as e:
        build_hello(tmp_path, build_sh='mkdir -p "$PREFIX/lib"; echo half > "$PREFIX/lib/half"\n'
                                       'echo "error: compiler exploded" >&2\nexit 3\n')
    msg = str(e.value)
    assert e.value.exit_code == BUILD_FAILED and "\n" not in msg
    assert "exit 3" in msg and "compiler exploded" in msg and str(tmp_path / "logs") in msg


@needs_tools
def test_runpath_to_a_build_machine_directory_is_refused(tmp_path):
    with pytest.raises(UserError) as e:
        build_hello(tmp_path, rpath="/opt/elsewhere/lib:$PREFIX/lib")
    assert e.value.exit_code == PACKAGE_INVALID and "/opt/elsewhere/lib" in str(e.value)


@needs_tools
@pytest.mark.skipif(not Path("/usr/include/numa.h").exists(), reason="libnuma-dev not installed")
def test_overlinking_needs_a_declared_requirement(tmp_path):
    with pytest.raises(UserError) as e:
        build_hello(tmp_path / "a", extra_libs="-Wl,--no-as-needed -lnuma")
    assert e.value.exit_code == PACKAGE_INVALID and "libnuma.so.1" in str(e.value)
    pkg = build_hello(tmp_path / "b", host="    - libnuma", extra_libs="-Wl,--no-as-needed -lnuma")
    assert pkg.extra["linked_outside_package"]["libnuma.so.1"] == "libnuma (via libnuma)"


def test_contract_environment_has_conda_builds_variables(tmp_path):
    r = render(make_recipe(tmp_path / "recipes"), VARIANT)
    env = B.contract_env(r, prefix=tmp_path / "p", build_prefix=tmp_path / "b", src_dir=tmp_path / "s",
                         caller_env={"HOME": "/root", "SECRET": "x", "UCX_SOURCE_DIR": "/src"})
    for key in ("PREFIX", "BUILD_PREFIX", "SRC_DIR", "RECIPE_DIR", "CPU_COUNT", "PKG_NAME", "PKG_VERSION",
                "PKG_BUILDNUM", "PKG_BUILD_STRING", "PKG_HASH", "PYTHON", "SHLIB_EXT", "target_platform"):
        assert env[key], key
    assert env["PKG_VERSION"] == "1.2.3" and env["c_stdlib_version"] == "2.28"
    assert "SECRET" not in env and "UCX_SOURCE_DIR" not in env  # only build/script_env passes through


# --- the whole chain fails cleanly ------------------------------------------------------------------------------------

@pytest.fixture
def fake_repo(tmp_path) -> tuple[Path, Path]:
    """A copy of the repository whose UCX source is a tiny local tarball, and its fetched-sources dir."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("stack.toml", "environment.yml", "pyproject.toml", "conda-forge.yml"):
        shutil.copy2(REPO / name, repo / name)
    shutil.copytree(REPO / "locks", repo / "locks")
    shutil.copytree(REPO / "recipes", repo / "recipes")
    sources = tmp_path / "sources"
    (sources / "ucx-0.0.1" / "src").mkdir(parents=True)
    (sources / "ucx-0.0.1" / "LICENSE").write_text("BSD\n")
    archive = sources / "ucx-0.0.1.tar.gz"
    subprocess.run(["tar", "-C", str(sources), "-czf", str(archive), "ucx-0.0.1"], check=True)
    shutil.rmtree(sources / "ucx-0.0.1")
    src = load(repo / "stack.toml").ucx
    text = (repo / "stack.toml").read_text()
    text = text.replace(src.sha256, sha256_file(archive)).replace(src.urls[0], archive.as_uri())
    text = text.replace(src.content_tree, content_tree(archive))
    text = text.replace(f'archive = "{src.archive}"', 'archive = "ucx-0.0.1.tar.gz"')
    text = text.replace(f'version = "{src.version}"', 'version = "0.0.1"', 1)
    (repo / "stack.toml").write_text(text)
    return repo, sources


@needs_tools
def test_broken_build_leaves_no_channel_and_keeps_the_previous_one(fake_repo, tmp_path):
    repo, sources = fake_repo
    (repo / "recipes/ucx/build.sh").write_text('mkdir -p "$PREFIX/lib"; echo half > "$PREFIX/lib/libucp.so"\n'
                                               'echo "configure: error: no verbs" >&2; exit 1\n')
    st = load(repo / "stack.toml")
    out = tmp_path / "out" / "channel"
    with pytest.raises(UserError) as e:
        build_channel(st, out=out, sources=sources, work=tmp_path / "work")
    assert e.value.exit_code == BUILD_FAILED and "no verbs" in str(e.value)
    assert not out.exists() and os.listdir(out.parent) == []

    (out / "linux-64").mkdir(parents=True)
    (out / "linux-64" / "previous.txt").write_text("the channel that was here\n")
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "conda", "--stack", str(repo / "stack.toml"),
                           "channel", "--out", str(out), "--sources", str(sources), "--work", str(tmp_path / "w2")],
                          capture_output=True, text=True)
    assert proc.returncode == BUILD_FAILED
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ucx-dask-gpu conda: error: ucx/build.sh failed (exit 1)") and "no verbs" in last
    assert sorted(os.listdir(out.parent)) == ["channel"]
    assert [p.name for p in out.rglob("*")] == ["linux-64", "previous.txt"]


@needs_tools
def test_lint_failure_stops_before_building(fake_repo, tmp_path):
    repo, sources = fake_repo
    meta = repo / "recipes/ucx/meta.yaml"
    meta.write_text(meta.read_text().replace('    sha256: {{ ucx["sha256"] }}\n', ""))
    with pytest.raises(UserError) as e:
        build_channel(load(repo / "stack.toml"), out=tmp_path / "ch", sources=sources, work=tmp_path / "work")
    assert e.value.exit_code == 60 and "no sha256" in str(e.value)
    assert not (tmp_path / "ch").exists() and not (tmp_path / "work" / "logs").exists()


@needs_tools
def test_archive_not_matching_the_recipe_sha256(fake_repo, tmp_path):
    repo, sources = fake_repo
    archive = sources / "ucx-0.0.1.tar.gz"
    archive.write_bytes(archive.read_bytes() + b"tampered")
    with pytest.raises(UserError) as e:
        build_channel(load(repo / "stack.toml"), out=tmp_path / "ch", sources=sources, work=tmp_path / "work")
    assert e.value.exit_code == 5 and re.search(r"sha256 [0-9a-f]{64} != the recipe's", str(e.value))
    assert not (tmp_path / "ch").exists()
