"""The conda-build-style renderer: selectors, pins, context functions, variants, and the two real recipes."""
from __future__ import annotations

from pathlib import Path

import pytest

from ucx_dask_gpu.conda import render as R
from ucx_dask_gpu.conda.settings import render_conda_build_config
from ucx_dask_gpu.errors import RECIPE_INVALID

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


@pytest.fixture(scope="module")
def cbc():
    return R.load_variant_config(RECIPES / "conda_build_config.yaml")


def test_selectors_keep_linux_drop_others_and_comment_lines():
    text = "a: 1  # [linux]\nb: 2  # [win]\n# only a comment\nc: 3  # [cuda_compiler_version == '13.0']\nd: 4\n"
    out = R.select_lines(text, R.namespace({"cuda_compiler_version": "13.0"}), "t")
    assert out.splitlines() == ["a: 1", "c: 3", "d: 4"]
    out = R.select_lines(text, R.namespace({"cuda_compiler_version": "12.9"}), "t")
    assert out.splitlines() == ["a: 1", "d: 4"]


def test_selector_with_unknown_name_is_a_recipe_error():
    with pytest.raises(R.RecipeError) as e:
        R.select_lines("a: 1  # [no_such_key]\n", R.namespace({}), "meta.yaml")
    assert e.value.exit_code == RECIPE_INVALID and "no_such_key" in str(e.value)


@pytest.mark.parametrize("version,min_pin,max_pin,want", [
    ("1.20.0", "x.x.x.x.x.x", "x.x", ">=1.20.0,<1.21.0a0"),
    ("1.13.1", "x.x.x", "x", ">=1.13.1,<2.0.0a0"),
    ("2.28", "x.x", "x.x", ">=2.28,<2.29a0"),
    ("13", None, "x", "<14a0"),
])
def test_pin_expressions(version, min_pin, max_pin, want):
    assert R.apply_pin_expressions(version, min_pin, max_pin) == want


def test_pin_of_non_numeric_version_is_refused():
    with pytest.raises(R.RecipeError):
        R.apply_pin_expressions("1.2rc1", "x.x", "x")


def test_bare_compiler_version_gets_a_wildcard_like_conda_build():
    assert R.ensure_valid_spec("gcc_linux-64 14") == "gcc_linux-64 14.*"
    assert R.ensure_valid_spec("cuda-nvcc_linux-64 13.0") == "cuda-nvcc_linux-64 13.0.*"
    assert R.ensure_valid_spec("x >=1.2") == "x >=1.2"


def test_numbers_stay_strings():
    assert R.yaml_load("version: 1.10\nnumber: 0\n", "t") == {"version": "1.10", "number": "0"}


def test_zip_keys_vary_together():
    config = {"a": ["1", "2"], "b": ["x", "y"], "c": ["k"], "zip_keys": [["a", "b"]]}
    got = R.expand_variants(config)
    assert got == [{"a": "1", "b": "x", "c": "k"}, {"a": "2", "b": "y", "c": "k"}]


def test_zip_keys_of_different_lengths_are_refused():
    with pytest.raises(R.RecipeError):
        R.expand_variants({"a": ["1", "2"], "b": ["x"], "zip_keys": [["a", "b"]]})


def test_conda_build_config_is_generated_from_stack_toml(st):
    text = (RECIPES / "conda_build_config.yaml").read_text()
    assert text == render_conda_build_config(st)
    assert R.load_variant_config(RECIPES / "conda_build_config.yaml")["cuda_compiler_version"] == \
        list(st.conda.cuda_versions)


def test_ucx_recipe_renders_the_production_pin_from_stack_toml(st, cbc):
    variants = R.render_variants(RECIPES / "ucx", cbc, environ={})
    assert [r.variant["cuda_compiler_version"] for r in variants] == list(st.conda.cuda_versions)
    pin = st.ucx
    for r in variants:
        assert r.name == "ucx" and r.version == pin.version
        url = [s for s in r.sources() if "url" in s][0]
        assert url["url"] == list(pin.urls) and url["sha256"] == pin.sha256 and url["fn"] == pin.archive
        assert {"path": "../..", "folder": "ucx-dask-gpu"} in r.sources()
        assert r.build["run_exports"] == [f"ucx {R.apply_pin_expressions(pin.version, 'x.x.x.x.x.x', 'x.x')}"]
        build = r.requirements("build")
        major = r.variant["cuda_compiler_version"].split(".")[0]
        assert f"sysroot_linux-64 {r.variant['c_stdlib_version']}.*" in build
        assert f"cuda-nvcc_linux-64 {r.variant['cuda_compiler_version']}.*" in build
        assert "gcc_linux-64" in build and "gxx_linux-64" in build
        assert f"cuda-version {r.variant['cuda_compiler_version']}" in r.requirements("host")
        assert r.requirements("run_constrained") == [f"__cuda >={major}"]
        assert r.build_string == f"cuda{major}_udg_{r.pkg_hash}_0"
        assert f'ucx_info -v | grep -E "^# (Library version:|Version) {pin.version}$"' in r.meta["test"]["commands"]
    assert len({r.pkg_hash for r in variants}) == len(variants)


def test_metapackage_is_one_noarch_variant(st, cbc):
    (r,) = R.render_variants(RECIPES / "ucx-dask-gpu", cbc, environ={})
    assert r.noarch == "python" and r.subdir == "noarch" and r.variant == {"python_min": st.python.version}
    assert r.name == st.name and r.version == st.version
    assert f"ucx {st.ucx.version} *_udg_*" in r.requirements("run")


def _recipe(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "recipes" / "x"
    d.mkdir(parents=True)
    (d / "meta.yaml").write_text(body)
    return d


def test_load_file_data_reads_toml_relative_to_the_recipe(tmp_path):
    (tmp_path / "data.toml").write_text('[a]\nversion = "3.2.1"\n')
    d = _recipe(tmp_path, '{% set d = load_file_data("../../data.toml", from_recipe_dir=True) %}\n'
                          'package:\n  name: x\n  version: {{ d["a"]["version"] }}\n')
    assert R.render(d, {}).version == "3.2.1"


def test_load_file_data_of_a_missing_file_is_one_clear_error(tmp_path):
    d = _recipe(tmp_path, '{% set d = load_file_data("../../nope.toml", from_recipe_dir=True) %}\n'
                          'package:\n  name: x\n  version: 1\n')
    with pytest.raises(R.RecipeError) as e:
        R.render(d, {})
    assert "nope.toml" in str(e.value) and "\n" not in str(e.value)


def test_undefined_variable_is_an_error_not_an_empty_string(tmp_path):
    d = _recipe(tmp_path, "package:\n  name: x\n  version: {{ not_defined }}\n")
    with pytest.raises(R.RecipeError) as e:
        R.render(d, {})
    assert "not_defined" in str(e.value)


def test_stdlib_without_variant_keys_is_refused(tmp_path):
    d = _recipe(tmp_path, "package:\n  name: x\n  version: 1\nrequirements:\n  build:\n"
                          "    - {{ stdlib('c') }}\n")
    with pytest.raises(R.RecipeError) as e:
        R.render(d, {})
    assert "c_stdlib" in str(e.value)


def test_pin_subpackage_cdt_and_pin_compatible(tmp_path):
    d = _recipe(tmp_path, "package:\n  name: x\n  version: 2.5.1\nbuild:\n  run_exports:\n"
                          "    - {{ pin_subpackage('x', max_pin='x') }}\n"
                          "requirements:\n  build:\n    - {{ cdt('libx11') }}\n  run:\n"
                          "    - {{ pin_compatible('numpy', lower_bound='1.26', max_pin='x') }}\n")
    r = R.render(d, {})
    assert r.build["run_exports"] == ["x >=2.5.1,<3.0.0a0"]
    assert r.requirements("build") == ["libx11-cos7-x86_64"]
    assert r.requirements("run") == ["numpy >=1.26,<2.0a0"]


def test_pin_compatible_without_a_host_env_is_refused(tmp_path):
    d = _recipe(tmp_path, "package:\n  name: x\n  version: 1\nrequirements:\n  run:\n"
                          "    - {{ pin_compatible('numpy') }}\n")
    with pytest.raises(R.RecipeError) as e:
        R.render(d, {})
    assert "pin_compatible" in str(e.value)


def test_unknown_top_level_section_is_refused(tmp_path):
    d = _recipe(tmp_path, "package:\n  name: x\n  version: 1\nbuidl:\n  number: 0\n")
    with pytest.raises(R.RecipeError) as e:
        R.render(d, {})
    assert "buidl" in str(e.value)
