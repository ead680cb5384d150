"""`make` fetches and verifies every source archive before it builds anything (`make sources`), and `make
SOURCES=DIR` hands it a source mirror: a missing archive is found in seconds, not minutes into the UCX build, and
all missing ones are named in one line. The real Makefile and fetch code, against a stack.toml whose upstream URLs
lead nowhere (file://, no network)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ucx_dask_gpu import stack
from ucx_dask_gpu.errors import SOURCE_UNREACHABLE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_sources_come_before_anything_is_installed_or_built():
    steps = [ln for ln in make("-n", "-B", "all").stdout.splitlines() if not ln.startswith(("mkdir", "touch"))]
    fetch = steps.index("ucx-src-build/build.sh fetch --all --no-cuda")
    assert fetch == 0, steps[:3]
    assert fetch < steps.index("ci/install_prereqs.sh")
    assert fetch < next(i for i, s in enumerate(steps) if s.startswith("ucx-src-build/build.sh build "))


def test_make_sources_names_every_missing_archive_in_one_line(tmp_path):
    text = (ROOT / "stack.toml").read_text()
    text = re.sub(r"^urls = \[.*\]$", f'urls = ["{(tmp_path / "upstream.tar.gz").as_uri()}"]', text, flags=re.M)
    text = re.sub(r"^mirror_dirs = \[.*\]$", "mirror_dirs = []", text, flags=re.M)
    (tmp_path / "stack.toml").write_text(text)
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    env = {stack.model.STACK_ENV: str(tmp_path / "stack.toml"), "UCX_DASK_GPU_CACHE": str(tmp_path / "cache"),
           "UCX_DASK_GPU_SOURCE_MIRROR": ""}
    r = make("-B", "sources", f"SOURCES={mirror}", env=env)  # -B: a checkout that already fetched has the stamp
    assert r.returncode != 0
    [line] = [ln for ln in r.stderr.splitlines() if not ln.startswith("make:")]
    assert "error: 4 source archives not found:" in line and f"(searched: {mirror})" in line, line
    assert all(src.archive in line for src in stack.load(ROOT / "stack.toml").source_archives())
    assert "make: *** [Makefile" in r.stderr and f"Error {SOURCE_UNREACHABLE}" in r.stderr
    assert "SOURCES=DIR" in line
