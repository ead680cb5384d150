"""ucx-dask-gpu: UCX built from verified source, one image for every Dask role, and proofs on real GPUs."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .stack import load


def _version() -> str:
    try:
        return version("ucx-dask-gpu")
    except PackageNotFoundError:  # running from a source tree without an install: read the one place it is written
        return load().version


__version__ = _version()
