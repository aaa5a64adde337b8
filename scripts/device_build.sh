#!/bin/bash
# Builds and installs the wheel on a GPU machine without network: CUTLASS from the nvidia-cutlass
# wheel in .whl/ (carried), jaxlib/nanobind/scikit-build-core from the machine, 16 parallel jobs.
# Installs into /tmp/site; prints the build's last lines on failure. Usage: scripts/device_build.sh [harness]
set -u
REPO=$(cd "$(dirname "$0")/.." && pwd)
python3 -m pip install -q --no-index --no-deps --target /tmp/cutlass "$REPO"/.whl/nvidia_cutlass-*.whl || exit 1
INC=/tmp/cutlass/cutlass_library/source/include
HARNESS=OFF; [ "${1:-}" = harness ] && HARNESS=ON
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-16}
T0=$SECONDS
# A warm machine keeps the last call's wheel and install: replace both.
rm -rf /tmp/wheel
if ! python3 -m pip wheel -q --no-build-isolation --no-deps "$REPO" -w /tmp/wheel \
    -Ccmake.define.ENTWINE_CUTLASS_INCLUDE=$INC -Ccmake.define.ENTWINE_BUILD_HARNESS=$HARNESS > /tmp/build.log 2>&1; then
  tail -40 /tmp/build.log; echo "device_build: FAILED"; exit 1
fi
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site /tmp/wheel/entwine_jax-*.whl || exit 1
echo "device_build: built in $((SECONDS - T0)) s, installed in /tmp/site"
