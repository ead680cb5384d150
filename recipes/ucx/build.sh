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

./contrib/configure-release \
    --prefix="$PREFIX" \
    "${configure_flags[@]}" \
    --with-cuda="$PREFIX" \
    --with-verbs \
    --with-rdmacm

make -j"${CPU_COUNT}"
make install
