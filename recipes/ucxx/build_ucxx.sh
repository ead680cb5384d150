#!/bin/bash
# The ucxx Python package: libucxx_python (C++, per Python) and the Cython extension, against this recipe's libucxx
# in $PREFIX; offline as libucxx is (rapids-cmake and CPM.cmake are this recipe's own sources).
set -euxo pipefail

# Generated from stack.toml by `ucx-dask-gpu conda regen` (make regen): the from-source wheels' CMake options.
wheel_cmake_args=(-DFIND_UCXX_CPP=ON)
# End of generated lines.

offline=(
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON
    "-DFETCHCONTENT_SOURCE_DIR_RAPIDS-CMAKE=$SRC_DIR/rapids-cmake"
    -DCPM_DOWNLOAD_LOCATION="$SRC_DIR/cpm/cmake/CPM.cmake"
)

cmake -S cpp/python -B cpp/python/build -G Ninja \
    ${CMAKE_ARGS:-} \
    -DCMAKE_INSTALL_PREFIX="$PREFIX" \
    -DCMAKE_INSTALL_LIBDIR=lib \
    -DCMAKE_BUILD_TYPE=Release \
    "${wheel_cmake_args[@]}" \
    "${offline[@]}"
cmake --build cpp/python/build -j"${CPU_COUNT}"
cmake --install cpp/python/build

SKBUILD_CMAKE_ARGS="-DCMAKE_PREFIX_PATH=$PREFIX;$(IFS=';'; echo "${wheel_cmake_args[*]};${offline[*]}")" \
    "$PYTHON" -m pip install python/ucxx -vv \
        --no-deps --no-build-isolation \
        --config-settings rapidsai.disable-cuda=true \
        --config-settings skbuild.install.components=ucxx
