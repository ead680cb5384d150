"""`python -m ucx_dask_gpu.conda.buildcheck PREFIX`: is the UCX just built into PREFIX the package meta.yaml names?

Run by recipes/ucx/build.sh at the end of the build, inside conda-build (stdlib only: the build env has a bare python).
It compares share/ucx-dask-gpu/build-info.json with conda-build's $PKG_VERSION, with stack.toml's sha256 for that
version, with the CUDA variant ($cuda_compiler_version) and with stack.toml's required modules. A fallback source would
otherwise be packaged under the pinned version's name. One line and exit PACKAGE_INVALID on a mismatch.
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
                        f"(source {src.get('archive')}; set UCX_DASK_GPU_UCX_VERSION={built} when rendering, "
                        f"or make the pinned source reachable)", PACKAGE_INVALID)
    pinned = {s.version: s for s in st.ucx_sources}
    if built not in pinned:
        raise UserError(f"UCX {built} is not a [[ucx.sources]] version in {st.path.name}", PACKAGE_INVALID)
    if src.get("sha256") != pinned[built].sha256:
        raise UserError(f"UCX {built} was built from sha256 {src.get('sha256')}, {st.path.name} pins "
                        f"{pinned[built].sha256}", PACKAGE_INVALID)
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
    print(f"buildcheck: UCX {info['ucx_version']} from {src.get('archive')} (sha256 ok"
          f"{', FALLBACK source' if src.get('fallback') else ''}), CUDA {cuda}, modules: {' '.join(info['modules'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
