#!/bin/bash
# libucxx (C++) with cmake, offline: rapids-cmake and CPM.cmake are this recipe's own sources.
set -euxo pipefail

# Generated from stack.toml by `ucx-dask-gpu conda regen` (make regen): the from-source wheels' CMake options.
wheel_cmake_args=(-DUCXX_ENABLE_CCCL=ON)
# End of generated lines.

cmake -S cpp -B cpp/build -G Ninja \
    ${CMAKE_ARGS:-} \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" \
    -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_TESTS=OFF \
    -DBUILD_BENCHMARKS=OFF \
    -DBUILD_EXAMPLES=OFF \
    -DDISABLE_DEPRECATION_WARNINGS=ON \
    "${wheel_cmake_args[@]}" \
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON \
    "-DFETCHCONTENT_SOURCE_DIR_RAPIDS-CMAKE=$SRC_DIR/rapids-cmake" \
    -DCPM_DOWNLOAD_LOCATION="$SRC_DIR/cpm/cmake/CPM.cmake"
cmake --build cpp/build -j"${CPU_COUNT}"
cmake --install cpp/build
