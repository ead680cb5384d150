"""The v1 recipes as the real rattler-build renders them, the checks on that rendering, and the generated lines.

Every bad input is made by editing a scratch copy of the repository the way a person would get it wrong, and must
come out as a named problem, and through the CLI as one line on stderr and exit RECIPE_INVALID.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.conda import settings
from ucx_dask_gpu.conda.recipes import PLATFORMS, check_all, render_recipe
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
    return check_all(load(repo / "stack.toml"), repo / "recipes")[0]


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

def test_committed_recipes_are_clean_and_render_every_variant():
    st = load(REPO / "stack.toml")
    found, variants = check_all(st, REPO / "recipes")
    assert found == []
    cuda = set(settings.settings(st).cuda_versions)
    for name in ("ucx", "libucxx", "ucxx"):
        for platform in PLATFORMS:
            got = {v.variant["cuda_compiler_version"] for v in variants if v.name == name and v.platform == platform}
            assert got == cuda, (name, platform)
    noarch = sorted(v.dist for v in variants if v.subdir == "noarch")
    assert [d.split("-0")[0] for d in noarch] == ["distributed-ucxx", "ucx-dask-gpu"]  # once each, not per variant


def test_ucx_rendering_carries_stack_toml_and_conda_forge_conventions():
    st = load(REPO / "stack.toml")
    s = settings.settings(st)
    (v,) = [v for v in render_recipe(REPO / "recipes", "ucx") if v.platform == "linux-64"
            and v.variant["cuda_compiler_version"] == "13.0"]
    assert (v.name, v.version, v.build_string.split("_")[0]) == ("ucx", s.ucx.version, "cuda13")
    assert v.sources[0]["url"] == s.ucx.urls[0] and v.sources[0]["sha256"] == s.ucx.sha256
    assert "cuda-version 13.0.*" in v.requirements("host")
    assert any(r.startswith("cuda-nvcc_linux-64") for r in v.requirements("build"))
    assert any(r.startswith("sysroot_linux-64 2.28") for r in v.requirements("build"))
    ignored = v.stage1["requirements"]["ignore_run_exports"]["from_package"]
    assert "cuda-cudart-dev" in ignored and any(x.startswith("cuda-nvcc_linux-64") for x in ignored)
    assert v.build["dynamic_linking"]["overlinking_behavior"] == "error"
    text = (REPO / "recipes/ucx/recipe.yaml").read_text() + (REPO / "recipes/ucx/build.sh").read_text()
    assert "x86_64" not in text and "stack.toml" in text  # no hard-coded arch; says where its values come from
    assert "PLACEHOLDER" in text and "ucx-dask-gpu-maintainer-placeholder" in text


def test_aarch64_renders_aarch64_compilers():
    vs = [v for v in render_recipe(REPO / "recipes", "ucx") if v.platform == "linux-aarch64"]
    assert vs and all(any(r.startswith("gcc_linux-aarch64") for r in v.requirements("build")) for v in vs)


def test_metapackage_pins_what_the_lock_and_the_ucxx_recipe_say():
    st = load(REPO / "stack.toml")
    locked = settings.lock_versions_by_conda_name(st)
    (v,) = render_recipe(REPO / "recipes", "ucx-dask-gpu")
    run = v.requirements("run")
    assert f"dask-cuda =={locked['dask-cuda']}" in run and f"python >={st.python.version}" in run
    assert any(r.startswith("ucx ") for r in run) and any(r.startswith("ucxx ==0.51") for r in run)


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

def test_a_hardcoded_sha256_bypassing_the_context_is_caught(repo):
    edit(repo / "recipes/ucx/recipe.yaml", "  sha256: ${{ sha256 }}", "  sha256: " + "0" * 64)
    assert any("ucx/ucx: source[0]" in p and "stack.toml pins" in p for p in problems(repo))


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
    old = settings.settings(st).ucxx.version
    edit(repo / "stack.toml", f'version = "{old}"\ntag = "v{old}"', 'version = "0.51.02"\ntag = "v0.51.02"')
    st = load(repo / "stack.toml")
    drift = settings.drift(st)
    assert drift[:2] == ["recipes/ucxx/recipe.yaml", "recipes/ucx-dask-gpu/recipe.yaml"]
    # The UCXX patches carried for the old version no longer belong to the recipe.
    assert [d.split("recipes/")[-1] for d in drift[2:]] == \
        [f"ucxx/patches/{p.name} (not a patch ucx-src-build carries)"
         for p in sorted((repo / "recipes/ucxx/patches").glob("*.patch"))]
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


def test_ucx_patches_are_copied_into_the_recipe_and_listed(repo):
    st = load(repo / "stack.toml")
    carried = [f"patches/{p.name}" for p in settings.carried_patches(st, "ucx")]
    (v, *_) = render_recipe(repo / "recipes", "ucx")
    assert v.sources[0].get("patches", []) == carried
    for rel in carried:
        assert (repo / "recipes/ucx" / rel).read_bytes() == \
            (repo / "ucx-src-build/patches" / settings.settings(st).ucx.version / rel.split("/")[1]).read_bytes()
    patch = repo / "ucx-src-build/patches" / settings.settings(st).ucx.version / "0099-fix.patch"
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text("--- a/NEWS\n+++ b/NEWS\n@@ -1 +1 @@\n-x\n+y\n")
    assert "recipes/ucx/patches/0099-fix.patch" in settings.drift(st)
    settings.regen(st)
    assert (repo / "recipes/ucx/patches/0099-fix.patch").read_bytes() == patch.read_bytes()
    (v, *_) = render_recipe(repo / "recipes", "ucx")
    assert v.sources[0]["patches"] == carried + ["patches/0099-fix.patch"]
    patch.unlink()
    assert any("not a patch ucx-src-build carries" in p for p in settings.drift(st))
    settings.regen(st)
    assert not (repo / "recipes/ucx/patches/0099-fix.patch").exists() and settings.drift(st) == []


def test_missing_end_marker_is_one_line(repo):
    edit(repo / "recipes/ucx/build.sh", "# End of generated lines.\n", "")
    line = one_line_error(cli(repo, "regen", "--check"), RECIPE_INVALID)
    assert "lack their '# End of generated lines.' line" in line


def test_bad_source_table_in_stack_toml_fails_in_the_loader(repo):
    st = load(repo / "stack.toml")
    edit(repo / "stack.toml", settings.settings(st).ucx.content_tree, "abc")
    proc = cli(repo, "lint")
    assert proc.returncode != 0 and "ucx.source.content_tree" in proc.stderr


def test_ucxx_build_scripts_carry_the_wheels_cmake_options(repo):
    st = load(repo / "stack.toml")
    (libucxx,) = [p for p in st.ucxx.packages if p.name == "libucxx"]
    assert all(a in (REPO / "recipes/ucxx/build_libucxx.sh").read_text() for a in libucxx.cmake_args
               if not a.startswith("-DCMAKE_INSTALL_"))
    edit(repo / "stack.toml", '"-DUCXX_ENABLE_CCCL=ON"', '"-DUCXX_ENABLE_CCCL=ON", "-DUCXX_ENABLE_RMM=ON"')
    assert settings.drift(load(repo / "stack.toml")) == ["recipes/ucxx/build_libucxx.sh"]


def test_ucxx_recipe_applies_the_patches_the_wheel_build_carries(repo):
    st = load(repo / "stack.toml")
    carried = [f"patches/{p.name}" for p in settings.carried_patches(st, "ucxx")]
    assert carried, "ucx-src-build carries UCXX patches"
    for v in render_recipe(repo / "recipes", "ucxx"):
        assert v.sources[0].get("patches", []) == carried  # the UCXX source, as the wheels get it
    for rel in carried:
        assert (repo / "recipes/ucxx" / rel).read_bytes() == \
            (repo / "ucx-src-build/patches" / f"ucxx-{st.ucxx.source.version}" / rel.split("/")[1]).read_bytes()
