"""The v1 recipes as the real rattler-build renders them, the checks on that rendering, and the generated lines.

Every bad input is made by editing a scratch copy of the repository the way a person would get it wrong, and must
come out as a named problem, and through the CLI as one line on stderr and exit RECIPE_INVALID.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from ucx_dask_gpu.conda import settings, variants
from ucx_dask_gpu.conda.recipes import PLATFORMS, check_all, render_recipe
from ucx_dask_gpu.conda.variants import CONDA_FORGE, FALLBACK
from ucx_dask_gpu.errors import RECIPE_INVALID
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path) -> Path:
    for name in ("stack.toml", "pyproject.toml", "conda-forge.yml"):
        shutil.copy2(REPO / name, tmp_path / name)
    for name in ("locks", "recipes", "ucx-src-build"):
        shutil.copytree(REPO / name, tmp_path / name)
    return tmp_path


def problems(repo: Path) -> list[str]:
    return check_all(load(repo / "stack.toml"), repo / "recipes", packed=repo / "build" / "packed")[0]


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def cli(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "conda", "--stack", str(repo / "stack.toml"),
                           "--recipes", str(repo / "recipes"), *args], capture_output=True, text=True)


def one_line_error(proc: subprocess.CompletedProcess, code: int) -> str:
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# --- the committed recipes ---------------------------------------------------------------------------------------

def packed(repo: Path = REPO, tmp: Path | None = None) -> Path:
    """The recipes packed (patches copied in and listed), as check_all renders them."""
    dest = (tmp or Path(tempfile.mkdtemp())) / "packed"
    return settings.pack(load(repo / "stack.toml"), dest, repo / "recipes")


def test_committed_recipes_are_clean_and_render_every_variant(tmp_path):
    st = load(REPO / "stack.toml")
    found, variants = check_all(st, REPO / "recipes", mode=FALLBACK, packed=tmp_path / "packed")
    assert found == []
    cuda = set(st.conda.cuda_versions)
    for name in ("ucx", "libucxx", "ucxx"):
        for platform in PLATFORMS:
            got = {v.variant["cuda_compiler_version"] for v in variants if v.name == name and v.platform == platform}
            assert got == cuda, (name, platform)
    noarch = sorted(v.dist for v in variants if v.subdir == "noarch")
    assert [d.split("-0")[0] for d in noarch] == ["distributed-ucxx", "ucx-dask-gpu"]  # once each, not per variant


def _pinning(monkeypatch=None):
    """The checkout's stack; with `monkeypatch`, the pinning it finds handed on by $UCX_DASK_GPU_CONDA_PINNING to a
    copied tree (whose relative [conda].pinning leads elsewhere)."""
    st = load(REPO / "stack.toml")
    found = variants.pinning_dir(st)
    if found is None:
        pytest.skip(f"conda-forge's pinning is not at {variants.pinning_location(st)} "
                    f"(${variants.PINNING_ENV} or stack.toml [conda].pinning): not rendered under it here")
    if monkeypatch is not None:
        monkeypatch.setenv(variants.PINNING_ENV, str(found))
    return st


def test_renders_under_conda_forges_pinning_and_cuda_migrator(tmp_path):
    """The recipes under conda-forge's real stack: its global pinning, the cuda130 migrator appended as conda-smithy
    does, each recipe's own conda_build_config.yaml, CF_CUDA_ENABLED=True; linux-64 and linux-aarch64."""
    st = _pinning()
    found, vs = check_all(st, REPO / "recipes", mode=CONDA_FORGE, packed=tmp_path / "packed")
    assert found == []
    assert vs[0].stack.kind == CONDA_FORGE and [f.name for f in vs[0].stack.files] == \
        ["conda_build_config.yaml", "cuda130.yaml"]
    s = st.conda
    glibc = dict(zip(s.cuda_versions, s.c_stdlib_versions))
    for name in ("ucx", "libucxx", "ucxx"):
        for platform in PLATFORMS:
            mine = [v for v in vs if v.name == name and v.platform == platform]
            assert {v.variant["cuda_compiler_version"] for v in mine} == set(s.cuda_versions)  # no cudaNone
            for v in mine:  # the fallback's glibc floors are the pinning's
                assert v.variant["c_stdlib_version"] == glibc[v.variant["cuda_compiler_version"]]
                assert re.match(r"^cuda1[23]_(py3\d+)?h[0-9a-f]{7}_0$", v.build_string), v.build_string
    pythons = {v.variant["python"].split()[0] for v in vs if v.name == "ucxx"}
    assert pythons == {"3.11.*", "3.12.*", "3.13.*"}  # conda-forge's 3.10 is below UCXX's floor
    for v in vs:
        if v.subdir == "noarch":
            assert v.variant["python_min"] == s.python_min and v.build_string.startswith("pyh")
    assert len([v for v in vs if v.subdir == "noarch"]) == 2


def test_migrator_values_are_appended_to_the_zipped_lists():
    st = _pinning()
    stack = variants.choose(st, REPO / "recipes", CONDA_FORGE)
    config = variants.config(stack, "linux-64", None)
    assert config["cuda_compiler_version"] == ["None", "12.9", "13.0"]
    assert config["c_stdlib_version"] == ["2.17", "2.17", "2.28"]
    assert "__migrator" not in variants.migrator_variants(stack.files[1])


def test_a_zipped_key_the_recipe_overrides_alone_is_refused_as_conda_smithy_would(repo, tmp_path, monkeypatch):
    _pinning(monkeypatch)
    (repo / "recipes/ucx/conda_build_config.yaml").write_text('c_stdlib_version:\n  - "2.28"\n')
    found = check_all(load(repo / "stack.toml"), repo / "recipes", mode=CONDA_FORGE, packed=tmp_path / "p")[0]
    assert any("recipes/ucx/recipe.yaml: rattler-build rejects it" in p and "InvalidZipKeyLength" in p
               for p in found), found


def test_a_cpu_only_variant_is_caught(repo, tmp_path, monkeypatch):
    _pinning(monkeypatch)
    edit(repo / "recipes/ucx/recipe.yaml", '    - cuda_compiler_version == "None"\n', "")
    found = check_all(load(repo / "stack.toml"), repo / "recipes", mode=CONDA_FORGE, packed=tmp_path / "p")[0]
    assert any(p.startswith("ucx: renders CUDA ['12.9', '13.0', 'None'] on linux-64") for p in found), found


def test_the_python_variant_pasted_into_a_build_string_is_caught(repo, tmp_path):
    edit(repo / "recipes/ucxx/recipe.yaml", "_py${{ python | version_to_buildstring }}h", "_py${{ python }}_h")
    found = check_all(load(repo / "stack.toml"), repo / "recipes", mode=FALLBACK, packed=tmp_path / "p")[0]
    assert any("ucxx/ucxx: build string 'cuda12_py3.11.* *_cpython_h" in p for p in found), found


def test_a_cuda_expression_in_the_context_makes_the_noarch_output_one_per_cuda(repo, tmp_path):
    edit(repo / "recipes/ucxx/recipe.yaml", "context:\n", 'context:\n  cuda: ${{ cuda_compiler_version }}\n')
    found = check_all(load(repo / "stack.toml"), repo / "recipes", mode=FALLBACK, packed=tmp_path / "p")[0]
    assert "distributed-ucxx: noarch, yet rendered as 2 packages (a variable of the other outputs' variants " \
           "reaches it)" in found


def test_ucx_rendering_carries_stack_toml_and_conda_forge_conventions():
    st = load(REPO / "stack.toml")
    (v,) = [v for v in render_recipe(packed(), "ucx") if v.platform == "linux-64"
            and v.variant["cuda_compiler_version"] == "13.0"]
    assert (v.name, v.version, v.build_string.split("_")[0]) == ("ucx", st.ucx.version, "cuda13")
    assert (v.sources[0]["git"], v.sources[0]["rev"]) == (st.ucx.git, st.ucx.commit)
    assert "cuda-version 13.0.*" in v.requirements("host")
    assert "libnuma" not in " ".join(v.requirements("host"))  # UCX 1.20 has no libnuma dependency
    assert any(r.startswith("cuda-nvcc_linux-64") for r in v.requirements("build"))
    assert any(r.startswith("sysroot_linux-64 2.28") for r in v.requirements("build"))
    ignored = v.stage1["requirements"]["ignore_run_exports"]["from_package"]
    assert "cuda-cudart-dev" in ignored and any(x.startswith("cuda-nvcc_linux-64") for x in ignored)
    assert v.build["dynamic_linking"]["overlinking_behavior"] == "error"
    text = (REPO / "recipes/ucx/recipe.yaml").read_text() + (REPO / "recipes/ucx/build.sh").read_text()
    assert "x86_64" not in text and "stack.toml" in text  # no hard-coded arch; says where its values come from
    assert "PLACEHOLDER" in text and "ucx-dask-gpu-maintainer-placeholder" in text
    assert "--enable-numa" not in text


def test_aarch64_renders_aarch64_compilers():
    vs = [v for v in render_recipe(packed(), "ucx") if v.platform == "linux-aarch64"]
    assert vs and all(any(r.startswith("gcc_linux-aarch64") for r in v.requirements("build")) for v in vs)


def test_metapackage_pins_what_the_lock_and_the_ucxx_recipe_say():
    st = load(REPO / "stack.toml")
    locked = settings.lock_versions_by_conda_name(st)
    (v,) = render_recipe(packed(), "ucx-dask-gpu")
    run = v.requirements("run")
    assert f"dask-cuda =={locked['dask-cuda']}" in run and f"python >={st.conda.python_min}" in run
    assert any(r.startswith("ucx ") for r in run) and any(r.startswith("ucxx ==0.51") for r in run)


def test_metapackage_declares_every_command_the_wheel_installs():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    (v,) = render_recipe(packed(), "ucx-dask-gpu")
    assert v.build["python"]["entry_points"] == [f"{k} = {t}" for k, t in scripts.items()]


# --- what rattler-build rejects -----------------------------------------------------------------------------------

def test_unknown_key_is_rejected_by_rattler_build(repo):
    edit(repo / "recipes/ucx/recipe.yaml", "build:\n  number: 0", "build:\n  numbr: 0")
    assert any("recipes/ucx/recipe.yaml: rattler-build rejects it" in p for p in problems(repo))
    line = one_line_error(cli(repo, "lint"), RECIPE_INVALID)
    assert "rattler-build rejects it" in line


def test_undefined_jinja_variable_is_rejected(repo):
    edit(repo / "recipes/ucx-dask-gpu/recipe.yaml", "ucx ${{ ucx_version }}.*", "ucx ${{ ucx_verison }}.*")
    assert any("ucx-dask-gpu/recipe.yaml: rattler-build rejects it" in p for p in problems(repo))


# --- checks on the rendering -------------------------------------------------------------------------------------

def test_a_hardcoded_rev_bypassing_the_context_is_caught(repo):
    edit(repo / "recipes/ucx/recipe.yaml", "  rev: ${{ git_rev }}", '  rev: "' + "0" * 40 + '"')
    assert any("ucx/ucx: source[0]" in p and "stack.toml pins git" in p for p in problems(repo))


def test_a_git_source_on_a_tag_is_caught(repo):
    edit(repo / "recipes/ucxx/recipe.yaml", "    rev: ${{ cpm_git_rev }}", "    tag: v0.42.0")
    assert any("ucxx/libucxx: source[2] https://github.com/cpm-cmake/CPM.cmake.git is not pinned to a commit" in p
               for p in problems(repo))


@pytest.mark.parametrize("recipe, source, old", [
    ("ucx", "ucx", "  git: ${{ git_url }}\n  rev: ${{ git_rev }}\n  # src/ucg is a submodule (UCG, not part of UCX's "
                   "releases): its tag archive holds an empty directory there.\n  submodules: false"),
    ("ucxx", "rapids_cmake", "  - git: ${{ rapids_cmake_git_url }}\n    rev: ${{ rapids_cmake_git_rev }}"),
])
def test_a_remote_url_with_a_mirror_copys_sha256_is_caught(repo, recipe, source, old):
    """GitHub's tag archive and the mirror's `git archive` hold the same files in other bytes: a recipe pairing the
    URL with the mirror file's sha256 stops every build that downloads it."""
    st = load(repo / "stack.toml")
    src = st.ucx if source == "ucx" else st.ucxx.rapids_cmake
    indent = "  " if recipe == "ucx" else "    "
    edit(repo / f"recipes/{recipe}/recipe.yaml", old,
         old.split("git:")[0] + f"url: {src.urls[0]}\n{indent}sha256: {src.sha256}")
    found = problems(repo)
    assert any(f"pairs {src.urls[0]} with the sha256 of the mirror's {src.archive}, not of what that URL serves" in p
               for p in found), found


def test_missing_license_file_and_maintainers_are_caught(repo):
    edit(repo / "recipes/ucx/recipe.yaml", "  license_file: LICENSE\n", "")
    edit(repo / "recipes/ucx/recipe.yaml", "extra:\n  recipe-maintainers:\n", "extra:\n  not-maintainers:\n")
    found = problems(repo)
    assert any("about.license_file is missing" in p for p in found)
    assert any("extra.recipe-maintainers is missing" in p for p in found)


def test_cuda_runtime_as_a_hard_dependency_is_caught(repo):
    edit(repo / "recipes/ucx/recipe.yaml", "      - cuda-cudart-dev\n\ntests:", "\ntests:")
    assert any("ignore_run_exports.from_package must list" in p for p in problems(repo))


def test_noarch_python_without_python_min_is_caught(repo):
    edit(repo / "recipes/ucx-dask-gpu/recipe.yaml", "    - python ${{ python_min }}.*\n    - pip",
         "    - python\n    - pip")
    assert any("CFEP-25" in p for p in problems(repo))


def test_a_metapackage_pin_off_the_lock_is_caught(repo):
    edit(repo / "recipes/ucx-dask-gpu/recipe.yaml", "dask-cuda ==${{ dask_cuda_version }}", "dask-cuda >=24")
    assert any("expected 'dask-cuda ==" in p for p in problems(repo))


def test_conda_forge_yml_must_use_rattler_build(repo):
    edit(repo / "conda-forge.yml", "conda_build_tool: rattler-build", "conda_build_tool: conda-build")
    assert any("conda_build_tool must be rattler-build" in p for p in problems(repo))


# --- generated lines ----------------------------------------------------------------------------------------------

def test_committed_generated_lines_are_up_to_date():
    assert settings.drift(load(REPO / "stack.toml")) == []


def test_stack_toml_version_change_is_drift_until_regen_writes_it(repo):
    st = load(repo / "stack.toml")
    old = st.ucxx.source.version
    edit(repo / "stack.toml", f'version = "{old}"\ntag = "v{old}"', 'version = "0.51.02"\ntag = "v0.51.02"')
    st = load(repo / "stack.toml")
    assert settings.drift(st) == ["recipes/ucxx/recipe.yaml", "recipes/ucx-dask-gpu/recipe.yaml"]
    line = one_line_error(cli(repo, "regen", "--check"), RECIPE_INVALID)
    assert "recipes/ucxx/recipe.yaml is out of date with stack.toml; run `make regen`" in line
    assert any("out of date" in p for p in problems(repo))
    written = cli(repo, "regen")
    assert written.returncode == 0 and "recipes/ucxx/recipe.yaml" in written.stdout
    assert settings.drift(st) == []
    assert 'version: "0.51.02"' in (repo / "recipes/ucxx/recipe.yaml").read_text()


def test_configure_flags_are_generated_into_build_sh(repo):
    edit(repo / "stack.toml", '"--enable-mt", ', '"--enable-mt", "--enable-devel-headers", ')
    st = load(repo / "stack.toml")
    assert settings.drift(st) == ["recipes/ucx/build.sh"]
    settings.regen(st)
    build_sh = (repo / "recipes/ucx/build.sh").read_text()
    assert "    --enable-mt\n    --enable-devel-headers\n    --enable-cma\n" in build_sh
    assert (repo / "recipes/ucx/build.sh").stat().st_mode & 0o111


def test_the_patches_are_stored_once_and_packed_with_the_recipe(repo, tmp_path):
    st = load(repo / "stack.toml")
    assert not (REPO / "recipes/ucx/patches").exists() and not (REPO / "recipes/ucxx/patches").exists()
    ucx_dir = repo / "ucx-src-build/patches" / st.ucx.version
    out = settings.pack(st, tmp_path / "packed", repo / "recipes")
    (v, *_) = render_recipe(out, "ucx")
    carried = sorted(p.name for p in ucx_dir.glob("*.patch"))
    assert v.sources[0]["patches"] == [f"patches/{n}" for n in carried]
    for n in carried:
        assert (out / "ucx/patches" / n).read_bytes() == (ucx_dir / n).read_bytes()


def test_a_patch_added_to_the_folder_is_in_the_next_pack_without_regen(repo, tmp_path):
    st = load(repo / "stack.toml")
    ucxx_dir = repo / "ucx-src-build/patches" / f"ucxx-{st.ucxx.source.version}"
    patch = ucxx_dir / "0099-python-fix.patch"
    patch.write_text("--- a/VERSION\n+++ b/VERSION\n@@ -1 +1 @@\n-x\n+y\n")
    assert settings.drift(st) == []  # nothing to regenerate
    found, vs = check_all(st, repo / "recipes", mode=FALLBACK, packed=tmp_path / "packed")
    assert found == []
    for v in [v for v in vs if v.recipe_path.parent.name == "ucxx"]:
        assert v.sources[0]["patches"][-1] == "patches/0099-python-fix.patch"  # the UCXX source, as the wheels get it
    assert (tmp_path / "packed/ucxx/patches/0099-python-fix.patch").read_bytes() == patch.read_bytes()


def test_a_recipe_without_the_patches_line_is_one_line(repo):
    edit(repo / "recipes/ucxx/recipe.yaml", "    # <conda pack: patches>\n", "")
    line = one_line_error(cli(repo, "lint", "--packed", str(repo / "build" / "p")), RECIPE_INVALID)
    assert "recipes/ucxx/recipe.yaml: no '# <conda pack: patches>' line in its source" in line


def test_missing_end_marker_is_one_line(repo):
    edit(repo / "recipes/ucx/build.sh", "# End of generated lines.\n", "")
    line = one_line_error(cli(repo, "regen", "--check"), RECIPE_INVALID)
    assert "lack their '# End of generated lines.' line" in line


def test_bad_source_table_in_stack_toml_fails_in_the_loader(repo):
    st = load(repo / "stack.toml")
    edit(repo / "stack.toml", st.ucx.content_tree, "abc")
    proc = cli(repo, "lint")
    assert proc.returncode != 0 and "ucx.source.content_tree" in proc.stderr


def test_ucxx_build_scripts_carry_the_wheels_cmake_options(repo):
    st = load(repo / "stack.toml")
    (libucxx,) = [p for p in st.ucxx.packages if p.name == "libucxx"]
    assert all(a in (REPO / "recipes/ucxx/build_libucxx.sh").read_text() for a in libucxx.cmake_args
               if not a.startswith("-DCMAKE_INSTALL_"))
    edit(repo / "stack.toml", '"-DUCXX_ENABLE_CCCL=ON"', '"-DUCXX_ENABLE_CCCL=ON", "-DUCXX_ENABLE_RMM=ON"')
    assert settings.drift(load(repo / "stack.toml")) == ["recipes/ucxx/build_libucxx.sh"]


def test_the_commits_the_recipes_pin_are_the_mirrors_tags():
    """stack.toml records each source's commit beside the content the mirror's archive of that tag has: the stand-in
    build takes that archive for the recipe's git source, so the mirror must name the same commit."""
    st = load(REPO / "stack.toml")
    manifest = REPO.parent / "shared" / "sources" / "MANIFEST.tsv"
    if not manifest.is_file():
        pytest.skip(f"no source mirror manifest at {manifest}")
    rows = [ln.split("\t") for ln in manifest.read_text().splitlines()]
    by_file = {r[0]: dict(zip(rows[0], r)) for r in rows[1:]}
    for src in st.source_archives():
        row = by_file[src.archive]
        assert (row["commit"], row["tag"], row["sha256"]) == (src.commit, src.tag, src.sha256), src.archive
        assert src.git == row["upstream"] + ".git"


def test_rattler_build_and_the_pinning_are_the_recorded_ones():
    """CI installs rattler-build at stack.toml's version and clones the pinning at its commit; here py-rattler-build
    (pyproject.toml [test]) renders, and ../shared/conda-forge-pinning is a copy taken at a commit its README names."""
    st = load(REPO / "stack.toml")
    test_deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert f"py-rattler-build=={st.conda.rattler_build}" in test_deps
    readme = REPO.parent / "shared" / "conda-forge-pinning" / "README.md"
    if readme.is_file():
        assert f"at commit {st.conda.pinning_commit}" in readme.read_text()
    workflow = (REPO / ".github/workflows/conda.yml").read_text()
    assert "$(get conda.pinning_commit)" in workflow and "rattler-build=${{ steps.stack.outputs.rattler_build }}" \
        in workflow and "git clone --depth 1" not in workflow


def test_ucx_constrains_what_conda_forges_ucx_constrains(repo):
    for v in render_recipe(packed(), "ucx"):
        major = v.variant["cuda_compiler_version"].split(".")[0]
        assert f"cuda-cudart {major}.*" in v.requirements("run_constraints")
    edit(repo / "recipes/ucx/recipe.yaml", "    - cuda-cudart ${{ cuda_major }}.*\n", "")
    assert any("conda-forge's ucx constrains ['cuda-cudart', 'cuda-version']" in p for p in problems(repo))


def test_the_metapackage_installs_only_its_own_command():
    """conda-forge's distributed owns dask-scheduler and dask-worker: two packages writing one file clobber each other.
    The image keeps both names (launchers run them around its entrypoint): its Dockerfile writes them."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert list(scripts) == ["ucx-dask-gpu"]
    (v,) = render_recipe(packed(), "ucx-dask-gpu")
    contents = [t["package_contents"]["files"] for t in v.tests if "package_contents" in t]
    assert contents and {"bin/dask-scheduler", "bin/dask-worker"} <= set(contents[0]["not_exists"])
    dockerfile = (REPO / "docker/Dockerfile").read_text()
    assert "for name in dask-scheduler dask-worker" in dockerfile and "legacy_main" in dockerfile
