"""Build UCX from verified source into a relocatable prefix (`ucx-dask-gpu ucx fetch|build|verify`).

Stdlib only, Python >= 3.11: the same code runs in the Docker builder stage, in a conda-build environment and on bare
metal through `ucx-src-build/build.sh`, none of which has the package's runtime dependencies.
"""
