#!/bin/bash
# UCX from a release-tag archive (no ./configure in it): autogen, configure-release, make, install.
set -euxo pipefail

./autogen.sh

# Generated from stack.toml by `ucx-dask-gpu conda regen` (make regen): [ucx.configure] flags; edit stack.toml.
configure_flags=(
    --enable-mt
    --enable-cma
    --disable-static
    --disable-doxygen-doc
    --without-java
    --without-go
)
# End of generated lines.

# Cross-compiling (conda-forge builds linux-aarch64 on linux-64): configure for the target triplet the compiler
# activation exports ($HOST) from the build machine's ($BUILD); configure then runs no program built for the target,
# and neither does anything below. Tools (autotools, make, nvcc) come from $BUILD_PREFIX, what is linked from $PREFIX.
cross=()
if [[ "${CONDA_BUILD_CROSS_COMPILATION:-0}" == 1 ]]; then
    cross=(--host="${HOST:?cross-compiling needs \$HOST from the compiler activation}"
           --build="${BUILD:?cross-compiling needs \$BUILD from the compiler activation}")
fi

./contrib/configure-release \
    --prefix="$PREFIX" \
    "${cross[@]}" \
    "${configure_flags[@]}" \
    --with-cuda="$PREFIX" \
    --with-verbs \
    --with-rdmacm

make -j"${CPU_COUNT}"
make install
