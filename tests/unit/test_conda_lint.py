"""Recipe lint (conda-smithy rules) and the checks against stack.toml, on a copy of the repository's recipes.

Every bad input is made by editing the copy the way a person would get it wrong, and must come out as a named
problem, and through the CLI as one line and exit RECIPE_INVALID.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.conda.lint import lint_all, lock_versions_by_conda_name
from ucx_dask_gpu.errors import BAD_STACK, RECIPE_INVALID
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path) -> Path:
    for name in ("stack.toml", "environment.yml", "pyproject.toml", "conda-forge.yml"):
        shutil.copy2(REPO / name, tmp_path / name)
    shutil.copytree(REPO / "locks", tmp_path / "locks")
    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    return tmp_path


def problems(repo: Path) -> list[str]:
    return lint_all(load(repo / "stack.toml"), repo / "recipes")[0]


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def cli(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "conda", "--stack", str(repo / "stack.toml"),
                           *args], capture_output=True, text=True)


def test_repository_recipes_are_clean(repo):
    assert problems(repo) == []


def test_cli_lint_ok(repo):
    proc = cli(repo, "lint")
    assert proc.returncode == 0, proc.stderr
    assert "ucx-dask-gpu-" in proc.stdout and "ucx-" in proc.stdout


def test_hardcoded_version_drifts_from_stack_toml(repo):
    edit(repo / "recipes/ucx/meta.yaml", 'version: {{ ucx["version"] }}', "version: 1.19.0")
    found = problems(repo)
    assert any("package version 1.19.0 but stack.toml wants 1.20.1" in p for p in found)
    proc = cli(repo, "lint")
    assert proc.returncode == RECIPE_INVALID
    assert len(proc.stderr.strip().splitlines()) == 1 and "recipe problem" in proc.stderr


def test_stack_toml_sha256_change_reaches_the_recipe_but_a_hardcoded_sha_is_caught(repo):
    st = load(repo / "stack.toml")
    edit(repo / "recipes/ucx/meta.yaml", 'sha256: {{ ucx["sha256"] }}', "sha256: " + "0" * 64)
    assert any("differs from stack.toml's" in p and st.ucx.sha256 in p for p in problems(repo))


def test_missing_sha256_on_the_url_source(repo):
    edit(repo / "recipes/ucx/meta.yaml", '    sha256: {{ ucx["sha256"] }}\n', "")
    assert any("has a url but no sha256" in p for p in problems(repo))


def test_malformed_sha256_in_stack_toml_fails_in_the_loader(repo):
    st = load(repo / "stack.toml")
    edit(repo / "stack.toml", st.ucx.sha256, "abc123")
    proc = cli(repo, "lint")
    assert proc.returncode == BAD_STACK and "sha256" in proc.stderr


def test_conda_build_config_drift(repo):
    edit(repo / "stack.toml", 'cuda_versions = ["12.9", "13.0"]', 'cuda_versions = ["12.8", "13.0"]')
    assert any("conda_build_config.yaml is out of date" in p for p in problems(repo))
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "stack", "--file", str(repo / "stack.toml"),
                           "conda-build-config", "--check"], capture_output=True, text=True)
    assert proc.returncode == 1 and "out of date" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu", "stack", "--file", str(repo / "stack.toml"),
                           "conda-build-config"], capture_output=True, text=True)
    assert proc.returncode == 0 and '"12.8"' in (repo / "recipes/conda_build_config.yaml").read_text()
    assert problems(repo) == []


def test_metapackage_pin_drifting_from_the_lock(repo):
    locked = lock_versions_by_conda_name(load(repo / "stack.toml"))
    meta = repo / "recipes/ucx-dask-gpu/meta.yaml"
    edit(meta, '    - {{ name }} =={{ locked[name] }}\n',
         '    - {{ name }} =={{ "0.0.1" if name == "dask" else locked[name] }}\n')
    assert any(f"run requirement for dask is 'dask ==0.0.1', the lock says 'dask =={locked['dask']}'" in p
               for p in problems(repo))


def test_metapackage_must_pin_our_ucx(repo):
    edit(repo / "recipes/ucx-dask-gpu/meta.yaml", "- ucx {{ ucx_version }} *_udg_*", "- ucx >=1.17")
    assert any("run requirement for ucx is 'ucx >=1.17'" in p for p in problems(repo))


def test_compiler_without_stdlib(repo):
    edit(repo / "recipes/ucx/meta.yaml", '    - {{ stdlib("c") }}\n', "")
    assert any("stdlib" in p and "compiler" in p for p in problems(repo))


def test_recipe_without_tests_and_without_license_file(repo):
    meta = repo / "recipes/ucx/meta.yaml"
    text = meta.read_text()
    text = re.sub(r"\ntest:\n(.*\n)*?\nabout:", "\nabout:", text)
    meta.write_text(text.replace("  license_file: ucx/LICENSE\n", ""))
    found = problems(repo)
    assert any("no tests" in p for p in found)
    assert any("about/license_file is missing" in p for p in found)


def test_required_modules_are_tested(repo):
    # The recipe's tests loop over stack.toml's list, so a newly required module is tested without a recipe edit...
    edit(repo / "stack.toml", "required_modules = [", 'required_modules = ["libuct_gdrcopy.so", ')
    st = load(repo / "stack.toml")
    found, rendered = lint_all(st, repo / "recipes")
    assert not any("required module" in p for p in found)
    ucx = [r for r in rendered if r.name == "ucx"][0]
    assert 'test -f "$PREFIX/lib/ucx/libuct_gdrcopy.so"' in ucx.meta["test"]["commands"]
    # ...and a recipe that stops testing them is caught.
    edit(repo / "recipes/ucx/meta.yaml", 'stack["ucx"]["configure"]["required_modules"]', '["libuct_cma.so"]')
    assert any("do not check required module libuct_ib.so" in p for p in problems(repo))


def test_selector_form_and_noarch_selectors(repo):
    edit(repo / "recipes/ucx/meta.yaml", "skip: true  # [not linux]", "skip: true #[not linux]")
    edit(repo / "recipes/ucx-dask-gpu/meta.yaml", "  noarch: python\n", "  noarch: python\n  skip: true  # [win]\n")
    found = problems(repo)
    assert any("selectors take the form" in p for p in found)
    assert any("noarch recipes cannot use selectors" in p for p in found)


def test_noarch_python_without_python_min(repo):
    edit(repo / "recipes/ucx-dask-gpu/meta.yaml", "- python >={{ python_min }}", "- python >=3.8")
    assert any("python >={{ python_min }}" in p for p in problems(repo))


def test_invalid_matchspec_in_requirements(repo):
    edit(repo / "recipes/ucx/meta.yaml", "    - libnuma\n", "    - libnuma >=>2\n")
    assert any("is not a valid MatchSpec" in p and "libnuma" in p for p in problems(repo))


def test_compiler_in_host_is_refused(repo):
    edit(repo / "recipes/ucx/meta.yaml", "    - rdma-core\n", '    - rdma-core\n    - {{ compiler("c") }}\n')
    assert any("belongs in requirements/build" in p for p in problems(repo))


def test_cuda_variant_missing_from_config(repo):
    cbc = repo / "recipes/conda_build_config.yaml"
    edit(cbc, '  - "12.9"\n', "")
    found = problems(repo)
    assert any("out of date" in p for p in found)
    assert any("ucx renders for CUDA ['13.0']" in p for p in found)


def test_conda_forge_yml_build_image_older_than_the_stdlib(repo):
    edit(repo / "conda-forge.yml", "linux_64: alma8", "linux_64: cos7")
    assert any("os_version linux_64 cos7 has glibc 2.17, older than c_stdlib_version 2.28" in p
               for p in problems(repo))
    edit(repo / "conda-forge.yml", "recipe_dir: recipes/ucx", "recipe_dir: recipe")
    assert any("recipe_dir 'recipe' has no meta.yaml" in p for p in problems(repo))


def test_hash_before_brackets_is_read_as_a_selector(repo):
    # conda-build reads `# ... ["x"]` at the end of a line as a selector and cuts the line there.
    edit(repo / "recipes/ucx/meta.yaml", "{{ ucx_version }}$\"'", '{{ ucx["version"] }}$"\'')
    assert any("reads as a selector" in p for p in problems(repo))
