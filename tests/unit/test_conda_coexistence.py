"""What a user's environment gets when this project's channel comes first (strict channel priority, as the README's
install line asks): a solve with py-rattler over our channel's ucx and records shaped like conda-forge's (ucx's run
export `ucx >=X.Y,<X.(Y+1)`, its cuda-version/cuda-cudart constraints). docs/conda.md "Beside conda-forge" says it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.conda_standin.channel import solve, virtual_packages
from ucx_dask_gpu.errors import INSTALL_FAILED, UserError
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def _record(name: str, version: str, build: str, depends=(), constrains=()) -> tuple[str, dict]:
    return f"{name}-{version}-{build}.conda", {"name": name, "version": version, "build": build, "build_number": 0,
                                               "depends": list(depends), "constrains": list(constrains),
                                               "subdir": "linux-64", "sha256": "0" * 64, "md5": "0" * 32, "size": 1}


def _channel(path: Path, records: list[tuple[str, dict]]) -> Path:
    for sub in ("linux-64", "noarch"):
        (path / sub).mkdir(parents=True)
        pkgs = dict(records) if sub == "linux-64" else {}
        (path / sub / "repodata.json").write_text(json.dumps({"info": {"subdir": sub}, "packages": {},
                                                              "packages.conda": pkgs}))
    return path


@pytest.fixture
def channels(tmp_path):
    st = load(REPO / "stack.toml")
    ours_version, major = st.ucx.version, st.cuda_major
    x_y = ".".join(ours_version.split(".")[:2])
    nxt = f"{x_y.split('.')[0]}.{int(x_y.split('.')[1]) + 1}"
    cuda = [f"cuda-version >={major},<{major + 1}.0a0", f"cuda-cudart {major}.*"]
    ours = _channel(tmp_path / "ours", [_record("ucx", ours_version, f"cuda{major}_h0_0", constrains=cuda)])
    forge = _channel(tmp_path / "conda-forge", [
        _record("ucx", "1.22.0", f"cuda{major}_h1_0", constrains=cuda),
        _record("ucx", f"{x_y}.0", f"cuda{major}_h2_0", constrains=cuda),
        # Built against conda-forge's ucx at our minor (its run export), and against the pinning's newer ucx 1.22.
        _record("openmpi", "5.0.8", "h_ucx_same", depends=[f"ucx >={x_y}.0,<{nxt}.0a0"]),
        _record("openmpi", "5.0.9", "h_ucx_122", depends=["ucx >=1.22.0,<1.23.0a0"]),
        _record("cuda-version", f"{major}.0", "h0_0"),
        _record("cuda-cudart", f"{major}.0.96", "h0_0", depends=[f"cuda-version >={major},<{major + 1}.0a0"]),
        _record("cuda-cudart", f"{major + 1}.0.1", "h0_0", depends=[f"cuda-version >={major + 1},<{major + 2}.0a0"]),
    ])
    return st, ours, forge


def _names(records) -> dict[str, str]:
    return {r.name.normalized: f"{r.version}-{r.build}" for r in records}


def test_our_ucx_replaces_conda_forges_and_what_was_built_against_its_minor_installs(channels):
    st, ours, forge = channels
    got = _names(solve([ours, forge], ["ucx", "openmpi ==5.0.8"], virtual_packages("2.36", f"{st.cuda_major}.0")))
    assert got["ucx"] == f"{st.ucx.version}-cuda{st.cuda_major}_h0_0"  # ours, though conda-forge has newer


def test_a_package_built_against_a_newer_ucx_does_not_install_beside_ours(channels):
    st, ours, forge = channels
    with pytest.raises(UserError) as e:
        solve([ours, forge], ["openmpi ==5.0.9"], virtual_packages("2.36", f"{st.cuda_major}.0"))
    assert e.value.exit_code == INSTALL_FAILED
    # ... while openmpi unpinned falls back to the build that does.
    got = _names(solve([ours, forge], ["openmpi"], virtual_packages("2.36", f"{st.cuda_major}.0")))
    assert got["openmpi"] == "5.0.8-h_ucx_same"


def test_ucx_keeps_the_cuda_runtime_at_its_major(channels):
    st, ours, forge = channels
    got = _names(solve([ours, forge], ["ucx", "cuda-cudart"], virtual_packages("2.36", f"{st.cuda_major + 1}.0")))
    assert got["cuda-cudart"].startswith(f"{st.cuda_major}.")
