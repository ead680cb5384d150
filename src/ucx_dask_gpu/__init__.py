"""ucx-dask-gpu: UCX built from verified source, one image for every Dask role, and proofs on real GPUs."""
from __future__ import annotations


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("ucx-dask-gpu")
    except Exception:  # running from a source tree without an install: read the one place it is written
        from .stack import load

        return load().version


__version__ = _version()
