"""Shared by the GPU tests: `gpu` skips, saying why, where there is no GPU or a package of the GPU stack is missing
(a test module names the packages it needs in GPU_MODULES)."""
from __future__ import annotations

import importlib.util

import pytest

from ucx_dask_gpu import nvml
from ucx_dask_gpu.errors import UserError


@pytest.fixture(scope="module")
def gpu(request) -> None:
    modules = getattr(request.module, "GPU_MODULES", ("cupy", "ucxx", "distributed_ucxx"))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"missing packages: {', '.join(missing)}")
    try:
        nvml.discover()
    except UserError as e:
        pytest.skip(f"no GPU here: {e}")
