"""recipes/ucx/build.sh's last step: the UCX in $PREFIX must be the package meta.yaml names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucx_dask_gpu.conda.buildcheck import check
from ucx_dask_gpu.errors import PACKAGE_INVALID, UserError
from ucx_dask_gpu.stack import load

REPO = Path(__file__).resolve().parents[2]


def prefix_with(tmp_path: Path, **override) -> Path:
    st = load(REPO / "stack.toml")
    src = st.ucx
    info = {"ucx_version": src.version, "source": {"version": src.version, "content_tree": src.content_tree,
                                                   "archive": src.archive},
            "capabilities": {"cuda": {"version": "13.0"}}, "modules": list(st.required_modules) + ["libuct_cma.so"]}
    info.update(override)
    d = tmp_path / "prefix" / "share" / "ucx-dask-gpu"
    d.mkdir(parents=True)
    (d / "build-info.json").write_text(json.dumps(info))
    return tmp_path / "prefix"


def test_matching_build_passes(tmp_path):
    st = load(REPO / "stack.toml")
    info = check(prefix_with(tmp_path), st.ucx.version, "13.0", REPO / "stack.toml")
    assert info["ucx_version"] == st.ucx.version


@pytest.mark.parametrize("override,pkg_version,cuda,needle", [
    ({}, "1.20.0", "13.0", "the build produced UCX 1.20.1 but the package is named 1.20.0"),
    ({"source": {"content_tree": "0" * 40}}, None, "13.0", "was built from content tree 000"),
    ({}, None, "12.9", "built against CUDA 13.0 but this is the cuda_compiler_version=12.9 variant"),
    ({"modules": ["libuct_cma.so"]}, None, "13.0", "lacks required modules"),
    ({"ucx_version": "9.9.9"}, None, None, "is not the version stack.toml pins"),
])
def test_mismatches_are_refused(tmp_path, override, pkg_version, cuda, needle):
    with pytest.raises(UserError) as e:
        check(prefix_with(tmp_path, **override), pkg_version, cuda, REPO / "stack.toml")
    assert e.value.exit_code == PACKAGE_INVALID and needle in str(e.value)


def test_module_entry_point_one_line_and_exit_code(tmp_path):
    prefix = prefix_with(tmp_path)
    env = {**os.environ, "PKG_VERSION": "1.20.0", "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.conda.buildcheck", str(prefix)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == PACKAGE_INVALID and len(proc.stderr.strip().splitlines()) == 1
    proc = subprocess.run([sys.executable, "-m", "ucx_dask_gpu.conda.buildcheck", str(tmp_path / "nothing")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == PACKAGE_INVALID and "build-info.json missing" in proc.stderr
