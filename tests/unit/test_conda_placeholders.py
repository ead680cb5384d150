"""The placeholders for conda-forge/rapidsai packages: one per dependency the channel does not provide, at the lock's
version (python at this machine's, cuda-version at the CUDA asked for), and a real py-rattler solve against them;
and the stacked variant config written as a plain rattler-build variants file."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tools.conda_standin import placeholders
from ucx_dask_gpu.conda import settings, variants
from tools.conda_standin.channel import solve, virtual_packages
from ucx_dask_gpu.errors import INSTALL_FAILED, UserError
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def _channel(tmp: Path, depends: list[str]) -> Path:
    """A channel whose repodata holds one package (what solving reads; no package file needed)."""
    ch = tmp / "channel"
    for sub in ("linux-64", "noarch"):
        (ch / sub).mkdir(parents=True)
        pkgs = {}
        if sub == "linux-64":
            pkgs = {"answer-1.0-h0_0.conda": {"name": "answer", "version": "1.0", "build": "h0_0", "build_number": 0,
                                              "depends": depends, "subdir": "linux-64", "sha256": "0" * 64,
                                              "md5": "0" * 32, "size": 1}}
        (ch / sub / "repodata.json").write_text(json.dumps({"info": {"subdir": sub}, "packages": {},
                                                            "packages.conda": pkgs}))
    return ch


def test_each_dependency_the_channel_lacks_gets_its_locked_version_and_solves(tmp_path):
    st = load(REPO / "stack.toml")
    locked = settings.lock_versions_by_conda_name(st)
    py = ".".join(map(str, sys.version_info[:2]))
    ch = _channel(tmp_path, [f"python {py}.* *_cpython", f"dask =={locked['dask']}", "rmm 26.08.*",
                             "cuda-version >=13,<14.0a0", "__glibc >=2.28"])
    made = placeholders.write(st, ch, tmp_path / "ph", "13.0")
    assert sorted(made) == ["cuda-version", "dask", "python", "rmm"]
    assert made["dask"][0] == locked["dask"] and made["cuda-version"][0] == "13.0"
    records = solve([ch, tmp_path / "ph"], ["answer", "cuda-version=13.0"], virtual_packages("2.36", "13.0"))
    got = {r.name.normalized: (str(r.version), str(r.build)) for r in records}
    assert got["answer"] == ("1.0", "h0_0") and got["python"][1].endswith("_cpython")
    assert got["dask"] == (locked["dask"], placeholders.BUILD)


def test_a_pin_the_lock_does_not_satisfy_fails_the_solve_in_one_line(tmp_path):
    st = load(REPO / "stack.toml")
    ch = _channel(tmp_path, ["dask ==1999.1.1"])
    placeholders.write(st, ch, tmp_path / "ph", "13.0")
    with pytest.raises(UserError) as e:
        solve([ch, tmp_path / "ph"], ["answer"], virtual_packages("2.36", None))
    assert e.value.exit_code == INSTALL_FAILED and "\n" not in str(e.value) and "dask" in str(e.value)


def test_a_dependency_with_no_stand_in_is_named(tmp_path):
    ch = _channel(tmp_path, ["libfoo-not-in-any-lock >=1"])
    with pytest.raises(UserError) as e:
        placeholders.write(load(REPO / "stack.toml"), ch, tmp_path / "ph", "13.0")
    assert e.value.exit_code == INSTALL_FAILED and "libfoo-not-in-any-lock" in str(e.value)


def test_the_variants_file_renders_what_the_stack_renders(tmp_path):
    """`conda variants --cuda 13.0` (one CUDA job's file) gives rattler-build's CLI the CUDA 13 variants only."""
    from rattler_build import PlatformConfig, RenderConfig, Stage0Recipe, VariantConfig

    st = load(REPO / "stack.toml")
    recipes = settings.pack(st, tmp_path / "packed", REPO / "recipes")
    stack = variants.choose(st, recipes, variants.FALLBACK)
    config = variants.config(stack, "linux-64", recipes / "ucxx" / variants.CBC)
    text = variants.as_variants_yaml(config, stack, "linux-64", "ucxx", cuda="13.0")
    data = yaml.safe_load(text)
    assert data["cuda_compiler_version"] == ["13.0"] and data["c_stdlib_version"] == ["2.28"]
    (tmp_path / "v.yaml").write_text(text)
    rendered = Stage0Recipe.from_file(recipes / "ucxx" / "recipe.yaml").render(
        VariantConfig.from_file(tmp_path / "v.yaml"), RenderConfig(platform=PlatformConfig(target_platform="linux-64")))
    assert {r.recipe.to_dict()["build"]["string"].split("_")[0] for r in rendered
            if r.recipe.package.name != "distributed-ucxx"} == {"cuda13"}
    with pytest.raises(UserError):
        variants.as_variants_yaml(config, stack, "linux-64", "ucxx", cuda="11.8")
