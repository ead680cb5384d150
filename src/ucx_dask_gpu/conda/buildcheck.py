"""`python -m ucx_dask_gpu.conda.buildcheck PREFIX`: is the UCX just built into PREFIX the package meta.yaml names?

Run by recipes/ucx/build.sh at the end of the build, inside conda-build (stdlib only: the build env has a bare python).
It compares share/ucx-dask-gpu/build-info.json with conda-build's $PKG_VERSION, with stack.toml's pinned source (its
content tree), with the CUDA variant ($cuda_compiler_version) and with stack.toml's required modules. One line and exit
PACKAGE_INVALID on a mismatch.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import PACKAGE_INVALID, UserError
from ..stack import load
from ..ucx.install import BUILD_INFO, read_build_info


def check(prefix: Path, pkg_version: str | None, cuda_variant: str | None, stack_path: Path | None = None) -> dict:
    st = load(stack_path)
    info = read_build_info(prefix)
    if info is None:
        path = prefix / BUILD_INFO
        why = "not JSON" if path.is_file() else "missing: the build did not go through ucx-src-build"
        raise UserError(f"{path} {why}", PACKAGE_INVALID)
    built = info.get("ucx_version")
    src = info.get("source") or {}
    if pkg_version and built != pkg_version:
        raise UserError(f"the build produced UCX {built} but the package is named {pkg_version} "
                        f"(source {src.get('archive')})", PACKAGE_INVALID)
    if built != st.ucx.version:
        raise UserError(f"UCX {built} is not the version {st.path.name} pins ({st.ucx.version})", PACKAGE_INVALID)
    if src.get("content_tree") != st.ucx.content_tree:
        raise UserError(f"UCX {built} was built from content tree {src.get('content_tree')}, {st.path.name} pins "
                        f"{st.ucx.content_tree}", PACKAGE_INVALID)
    cuda = (info.get("capabilities") or {}).get("cuda") or {}
    if cuda_variant and cuda_variant.lower() != "none":
        got = str(cuda.get("version") or "")
        if got.split(".")[:2] != cuda_variant.split(".")[:2]:
            raise UserError(f"built against CUDA {got or 'none'} but this is the cuda_compiler_version={cuda_variant} "
                            f"variant", PACKAGE_INVALID)
    missing = [m for m in st.required_modules if m not in (info.get("modules") or [])]
    if missing:
        raise UserError(f"UCX {built} lacks required modules {', '.join(missing)}", PACKAGE_INVALID)
    return info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m ucx_dask_gpu.conda.buildcheck PREFIX", file=sys.stderr)
        return 2
    try:
        info = check(Path(argv[0]), os.environ.get("PKG_VERSION"), os.environ.get("cuda_compiler_version"))
    except UserError as e:
        print(f"buildcheck: error: {e}", file=sys.stderr)
        return e.exit_code
    src = info.get("source") or {}
    cuda = ((info.get("capabilities") or {}).get("cuda") or {}).get("version")
    print(f"buildcheck: UCX {info['ucx_version']} from {src.get('archive')} (content tree ok), CUDA {cuda}, "
          f"modules: {' '.join(info['modules'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
