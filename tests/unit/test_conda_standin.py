"""The stand-in recipe (build/host requirements that cannot be installed here) and real rattler-build builds of small
recipes through it: what the stand-in writes in, and what rattler-build still refuses (overlinking).

The small recipes compile a few lines of C with the machine's compiler; rattler-build builds them offline from an
empty local channel, so no network is used.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
from pathlib import Path

import conda_package_handling.api as cph
import pytest
import yaml
from rattler_build import Package

from tools.conda_standin import standin
from tools.conda_standin.channel import index_channel, run_recipe_tests, write_empty_channel
from ucx_dask_gpu.conda.recipes import render_recipe
from ucx_dask_gpu.errors import HASH_MISMATCH, INSTALL_FAILED, PACKAGE_INVALID, RECIPE_INVALID, UserError
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def test_pin_compatible_resolved_from_the_host_requirement():
    host = ["cuda-version 13.0.*", "rdma-core"]
    spec = '${{ pin_compatible("cuda-version", lower_bound="x", upper_bound="x") }}'
    assert standin.resolve_pin_compatible(spec, host) == "cuda-version >=13,<14.0a0"
    spec2 = '${{ pin_compatible("cuda-version", lower_bound="x.x", upper_bound="x.x") }}'
    assert standin.resolve_pin_compatible(spec2, ["cuda-version 12.9.*"]) == "cuda-version >=12.9,<12.10a0"
    assert standin.resolve_pin_compatible("numpy >=2", host) == "numpy >=2"
    with pytest.raises(UserError) as e:
        standin.resolve_pin_compatible(spec, ["rdma-core"])
    assert e.value.exit_code == RECIPE_INVALID


def test_ucx_standin_recipe_empties_only_build_and_host(tmp_path):
    (v,) = [v for v in render_recipe(REPO / "recipes", "ucx") if v.platform == "linux-64"
            and v.variant["cuda_compiler_version"] == "13.0"]
    inputs = standin.StandinInputs(env={"CPPFLAGS": "-I/x"},
                                   provided={"libibverbs.so.1": "rdma-core", "libc.so.6": "c_stdlib"})
    archive = tmp_path / "ucx-1.20.1.tar.gz"
    archive.write_bytes(b"the verified archive of the pinned commit")
    recipe = standin.standin_recipe(v, inputs, {v.sources[0]["git"]: archive}, "2.28")
    assert recipe["requirements"]["build"] == [] and recipe["requirements"]["host"] == []
    assert recipe["requirements"]["run_constraints"] == ["cuda-version >=13,<14.0a0", "cuda-cudart ${{ cuda_major }}.*"]
    assert recipe["requirements"]["run"] == ["__glibc >=2.28"]
    assert recipe["requirements"]["run_exports"] == ['${{ pin_subpackage("ucx", upper_bound="x.x") }}']
    # The git source (as a feedstock builds it) is built from the archive of that commit, by that file's sha256.
    assert recipe["source"][0]["url"] == archive.as_uri() and "git" not in recipe["source"][0]
    assert recipe["source"][0]["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert recipe["source"][0].get("patches") == v.sources[0].get("patches")
    assert recipe["extra"]["standin"]["git_sources_taken_from_archives"] == [
        {"git": v.sources[0]["git"], "rev": v.sources[0]["rev"], "taken_from": archive.name}]
    assert recipe["build"]["string"] == v.build_string + "_standin"
    assert recipe["build"]["script"] == {"file": "build.sh", "env": {"CPPFLAGS": "-I/x"}}
    allow = recipe["build"]["dynamic_linking"]["missing_dso_allowlist"]
    assert "*libibverbs.so.1" in allow and "*libc.so.6" in allow and "*libcuda.so*" in allow
    assert recipe["tests"] == yaml.safe_load((REPO / "recipes/ucx/recipe.yaml").read_text())["tests"]
    assert recipe["extra"]["standin"]["requirements_not_installed"]["host"] == v.requirements("host")


def test_a_git_source_is_taken_from_its_pinned_archive_verified_by_content(tmp_path):
    """The mirror holds a `git archive` of the commit: another compression of the same files verifies by git tree
    id; other files do not, and a commit stack.toml does not pin has no archive to stand in."""
    st = load(REPO / "stack.toml")
    src = st.ucxx.cpm
    mirror = Path(REPO / "../shared/sources").resolve()
    if not (mirror / src.archive).is_file():
        pytest.skip(f"no source mirror with {src.archive} at {mirror}")
    recompressed = tmp_path / "mirror" / src.archive
    recompressed.parent.mkdir()
    with tarfile.open(mirror / src.archive) as tin, tarfile.open(recompressed, "w:gz", compresslevel=1) as tout:
        for member in tin:
            tout.addfile(member, tin.extractfile(member) if member.isfile() else None)
    assert hashlib.sha256(recompressed.read_bytes()).hexdigest() != src.sha256
    got = standin.fetch_git_source(st, src.git, src.commit, cache=tmp_path / "cache",
                                   mirror_dirs=[recompressed.parent], offline=True)
    assert got.read_bytes() == recompressed.read_bytes()

    with tarfile.open(recompressed, "w:gz") as tout:  # other files under the same name
        tout.addfile(tarfile.TarInfo(f"{src.archive.removesuffix('.tar.gz')}/other.txt"))
    with pytest.raises(UserError) as e:
        standin.fetch_git_source(st, src.git, src.commit, cache=tmp_path / "cache2",
                                 mirror_dirs=[recompressed.parent], offline=True)
    assert e.value.exit_code == HASH_MISMATCH and "content tree" in str(e.value)
    with pytest.raises(UserError) as e:
        standin.fetch_git_source(st, src.git, "0" * 40, cache=tmp_path / "cache", mirror_dirs=[], offline=True)
    assert e.value.exit_code == RECIPE_INVALID and "not a source stack.toml pins" in str(e.value)


def test_only_declared_requirements_may_provide_system_libraries():
    (v,) = render_recipe(REPO / "recipes", "ucx-dask-gpu")
    assert standin.standin_inputs.__doc__
    reqs = {r.split()[0] for r in v.requirements("host")}
    assert "rdma-core" not in reqs  # the metapackage declares no rdma-core: libibverbs would be overlinking


# --- real rattler-build builds of small recipes ------------------------------------------------------------------

LIB_C = ("#include <numa.h>\n#include <stdlib.h>\n"
         "int answer(void) { return numa_available() < 0 || getenv(\"ANSWER\") ? 42 : 42; }\n")


def _source_archive(tmp: Path) -> tuple[Path, str]:
    src = tmp / "answer-1.0"
    src.mkdir()
    (src / "answer.c").write_text(LIB_C)
    (src / "LICENSE").write_text("MIT\n")
    archive = tmp / "mirror" / "answer-1.0.tar.gz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tf:
        tf.add(src, arcname="answer-1.0")
    return archive, hashlib.sha256(archive.read_bytes()).hexdigest()


def _recipe(tmp: Path, sha: str, host: list[str], lib: str, check: str) -> Path:
    d = tmp / "recipes" / "answer"
    d.mkdir(parents=True)
    (d / "recipe.yaml").write_text(yaml.safe_dump({
        "package": {"name": "answer", "version": "1.0"},
        "source": {"url": "https://example.invalid/answer-1.0.tar.gz", "sha256": sha},
        "build": {"number": 0, "dynamic_linking": {"overlinking_behavior": "error"}},
        "requirements": {"build": ['${{ compiler("c") }}', '${{ stdlib("c") }}'], "host": host},
        "tests": [{"script": [check]},
                  {"package_contents": {"lib": [lib]}}],
        "about": {"license": "MIT", "license_file": "LICENSE", "summary": "s", "homepage": "https://example.invalid"},
    }, sort_keys=False))
    (d / "build.sh").write_text('mkdir -p "$PREFIX/lib"\n'
                                'cc -shared -fPIC -o "$PREFIX/lib/libanswer.so" answer.c -lnuma\n')
    (tmp / "recipes" / "conda_build_config.yaml").write_text('c_stdlib:\n  - sysroot\nc_stdlib_version:\n  - "2.28"\n')
    return d


def _build(tmp: Path, host: list[str], lib: str = "answer", check: str = 'test -f "$PREFIX/lib/libanswer.so"') -> Path:
    archive, sha = _source_archive(tmp)
    _recipe(tmp, sha, host, lib, check)
    (v,) = [v for v in render_recipe(tmp / "recipes", "answer", ("linux-64",))]
    empty = write_empty_channel(tmp / "empty")
    return standin.build_variant(load(REPO / "stack.toml"), v, work=tmp / "work", output_dir=tmp / "out",
                                 mirror_dirs=[archive.parent], log_dir=tmp / "logs", channels=[empty.as_uri()],
                                 cache=tmp / "cache", offline=True, build_cache=tmp / "builds")


def test_rattler_build_builds_the_standin_with_the_declared_library(tmp_path):
    pkg = _build(tmp_path, ["libnuma"])
    p = Package.from_file(pkg)
    # Linked here against this machine's glibc: that is what it declares (the recipe's sysroot would give 2.28).
    assert p.name == "answer" and f"__glibc >={standin.host_glibc()}" in p.depends
    assert pkg.name.endswith("_standin.conda")
    assert [type(t).__name__ for t in p.tests] == ["CommandsTest"]  # package_contents is checked while packaging

    cph.extract(str(pkg), dest_dir=str(tmp_path / "x"))
    about = json.loads((tmp_path / "x/info/about.json").read_text())
    assert about["extra"]["standin"]["sonames_left_to_the_system"]["libnuma.so.1"] == "libnuma"
    assert "stand-in recipe" in (tmp_path / "x/info/recipe/recipe.yaml").read_text()
    assert (tmp_path / "x/info/recipe/original-recipe.yaml").read_text() == \
        (tmp_path / "recipes/answer/recipe.yaml").read_text()


def test_a_library_no_requirement_provides_is_overlinking(tmp_path):
    with pytest.raises(UserError) as e:
        _build(tmp_path, [])
    assert e.value.exit_code == PACKAGE_INVALID
    assert "Overlinking against: libnuma.so.1" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_file_the_recipe_lists_fails_the_build(tmp_path):
    with pytest.raises(UserError) as e:
        _build(tmp_path, ["libnuma"], lib="question")
    assert e.value.exit_code == PACKAGE_INVALID
    assert "\n" not in str(e.value) and "No match for lib glob: lib/{,lib}question.so" in str(e.value)


def _channel_with(tmp: Path, pkg: Path) -> Path:
    channel = tmp / "channel"
    (channel / "linux-64").mkdir(parents=True)
    shutil.copy2(pkg, channel / "linux-64" / pkg.name)
    index_channel(channel)
    return channel


def test_rattler_build_runs_the_recipe_tests_from_the_channel(tmp_path):
    pkg = _build(tmp_path, ["libnuma"])
    assert run_recipe_tests(pkg, [_channel_with(tmp_path, pkg)]) == ["test 0: passed"]


def test_a_failing_recipe_test_is_one_line_install_failed(tmp_path):
    pkg = _build(tmp_path, ["libnuma"], check='test -f "$PREFIX/lib/libquestion.so"')
    with pytest.raises(UserError) as e:
        run_recipe_tests(pkg, [_channel_with(tmp_path, pkg)])
    assert e.value.exit_code == INSTALL_FAILED and "recipe test 0 failed" in str(e.value) and "\n" not in str(e.value)


def test_a_package_needing_a_newer_glibc_than_it_declares_is_refused(tmp_path):
    pkg = _build(tmp_path, ["libnuma"])
    needed, where = standin.glibc_needed(_unpacked(pkg, tmp_path / "x"))
    assert needed and where == "lib/libanswer.so"
    standin.check_glibc(pkg, needed, tmp_path)  # declares what it needs: fine
    with pytest.raises(UserError) as e:
        standin.check_glibc(pkg, "2.1", tmp_path)
    assert e.value.exit_code == PACKAGE_INVALID
    assert str(e.value) == f"{pkg.name}: lib/libanswer.so needs GLIBC_{needed}, the package declares __glibc >=2.1"


def _unpacked(pkg: Path, dest: Path) -> Path:
    cph.extract(str(pkg), dest_dir=str(dest))
    return dest
