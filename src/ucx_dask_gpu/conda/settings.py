"""The recipe-related keys of stack.toml's [conda] table, validated, and conda_build_config.yaml rendered from them.

stack.py validates what every consumer reads; the keys only the recipes read are validated here, with the same
one-line StackError, so a typo fails before any rendering starts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

from ..stack import Stack, StackError

CBC_PATH = "recipes/conda_build_config.yaml"
CBC_HEADER = "# Generated from stack.toml by `ucx-dask-gpu stack conda-build-config`; do not edit by hand.\n"


@dataclass(frozen=True)
class CondaSettings:
    cuda_versions: tuple[str, ...]
    c_stdlib_version: str
    python_min: str
    metapackage: tuple[str, ...]
    ucx_home: str
    ucx_dev_url: str
    home: str


def _url(value, where: str) -> str:
    if not isinstance(value, str) or urlparse(value).scheme not in ("http", "https") or not urlparse(value).netloc:
        raise StackError(where, f"expected an http(s) URL, got {value!r}")
    return value


def settings(st: Stack) -> CondaSettings:
    conda = st.raw.get("conda", {})
    w = f"{st.path.name}.conda"
    glibc = conda.get("c_stdlib_version")
    if not isinstance(glibc, str) or not re.match(r"^2\.\d+$", glibc):
        raise StackError(f"{w}.c_stdlib_version", f"expected a glibc version like \"2.28\", got {glibc!r}")
    meta = conda.get("metapackage")
    if not isinstance(meta, list) or not meta or not all(isinstance(n, str) and re.match(r"^[a-z0-9][a-z0-9._-]*$", n)
                                                         for n in meta):
        raise StackError(f"{w}.metapackage", f"expected a non-empty list of conda package names, got {meta!r}")
    about = conda.get("about")
    if not isinstance(about, dict):
        raise StackError(f"{w}.about", "missing (a table with ucx_home, ucx_dev_url, home)")
    return CondaSettings(
        cuda_versions=st.conda_cuda_versions,
        c_stdlib_version=glibc,
        python_min=st.python_version,
        metapackage=tuple(meta),
        ucx_home=_url(about.get("ucx_home"), f"{w}.about.ucx_home"),
        ucx_dev_url=_url(about.get("ucx_dev_url"), f"{w}.about.ucx_dev_url"),
        home=_url(about.get("home"), f"{w}.about.home"),
    )


def render_conda_build_config(st: Stack) -> str:
    """recipes/conda_build_config.yaml: the variant keys our recipes use, every value quoted (12.10 is not 12.1)."""
    s = settings(st)

    def key(name: str, values, comment: str = "") -> list[str]:
        out = [f"{name}:"]
        out += [f'  - "{v}"' + (f"  {comment}" if comment else "") for v in values]
        return out

    lines = [CBC_HEADER.rstrip(),
             "# Variant keys of recipes/ucx and recipes/ucx-dask-gpu:",
             "#   conda build -m recipes/conda_build_config.yaml recipes/ucx recipes/ucx-dask-gpu -c conda-forge",
             "# One ucx package per CUDA version below; the metapackage is noarch (python_min only)."]
    lines += key("c_stdlib", ["sysroot"], "# [linux]")
    lines += key("c_stdlib_version", [s.c_stdlib_version], "# [linux]")
    lines += key("cuda_compiler", ["cuda-nvcc"])
    lines += key("cuda_compiler_version", s.cuda_versions)
    lines += key("python_min", [s.python_min])
    return "\n".join(lines) + "\n"
