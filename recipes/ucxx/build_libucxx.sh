#!/bin/bash
# libucxx (C++) with cmake, offline: rapids-cmake and CPM.cmake are this recipe's own sources.
set -euxo pipefail

cmake -S cpp -B cpp/build -G Ninja \
    ${CMAKE_ARGS:-} \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" \
    -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_TESTS=OFF \
    -DBUILD_BENCHMARKS=OFF \
    -DBUILD_EXAMPLES=OFF \
    -DUCXX_ENABLE_CCCL=ON \
    -DDISABLE_DEPRECATION_WARNINGS=ON \
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
    "-DFETCHCONTENT_SOURCE_DIR_RAPIDS-CMAKE=$SRC_DIR/rapids-cmake" \
    -DCPM_DOWNLOAD_LOCATION="$SRC_DIR/cpm/cmake/CPM.cmake"
cmake --build cpp/build -j"${CPU_COUNT}"
cmake --install cpp/build
