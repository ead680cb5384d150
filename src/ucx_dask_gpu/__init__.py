"""ucx-dask-gpu: UCX built from verified source, one image for every Dask role, and proofs on real GPUs."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from .stack import load


def package_version() -> str:
    try:
        return version("ucx-dask-gpu")
    except PackageNotFoundError:  # running from a source tree without an install: read the one place it is written
        return load().version


def __getattr__(name: str) -> str:
    # Computed when asked for, not at import: a broken stack.toml in a source tree must reach every command's one-line
    # error (exit 3), not end the import with a traceback.
    if name == "__version__":
        return package_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
