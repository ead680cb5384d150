"""Where an image build keeps its work, and what the images are called.

Image names come from stack.toml [image] (`name`, `base_name`, `builder_name`) with [stack].version as the tag.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from ..stack import Stack, find_stack_file

CACHE_ENV = "UCX_DASK_GPU_BUILD_CACHE"
UCX_SOURCES = "ucx-sources"   # <cache>/ucx-sources: what `ucx-src-build/build.sh fetch` verified for the UCX stage
UCXX_WHEELS_ENV = "UCXX_WHEELS"


def repo_root() -> Path:
    """The source checkout this package runs from (image and cluster commands build from a checkout)."""
    return find_stack_file().resolve().parent


def default_cache() -> Path:
    """$UCX_DASK_GPU_BUILD_CACHE, else <checkout>/build/cache (ignored by git; reused by warm rebuilds)."""
    return Path(os.environ.get(CACHE_ENV) or repo_root() / "build" / "cache")


def default_ucxx_wheels() -> Path:
    """$UCXX_WHEELS (the Makefile's), else <checkout>/build/ucxx-wheels: where `make ucxx` puts the UCXX wheels."""
    return Path(os.environ.get(UCXX_WHEELS_ENV) or repo_root() / "build" / "ucxx-wheels")


def work_dir(cache: Path, tag: str) -> Path:
    """<cache>/image/<tag>: one per tag, so building another tag (a test's variant image) never touches this one."""
    return cache / "image" / re.sub(r"[^A-Za-z0-9_.-]", "_", tag)


def image_ref(st: Stack) -> str:
    """The image every role runs: [image].name:[stack].version."""
    return f"{st.image.name}:{st.version}"


def stage_ref(st: Stack, tag: str) -> str:
    """The image of the Dockerfile's `ucx` stage (UCX built offline) of the image `tag`, kept to read its build info:
    <name>-ucx-stage:<tag's own tag> (…:<version> for the default image), so a build of another tag never moves it."""
    _, sep, version = tag.rpartition(":")
    return f"{st.image.name}-ucx-stage:{version if sep and '/' not in version else st.version}"


def base_ref(st: Stack, kind: str) -> str:
    """The Debian base of `kind`: runtime ([image].base_name) or builder ([image].builder_name)."""
    name = st.image.base_name if kind == "runtime" else st.image.builder_name
    return f"{name}:{st.version}"
