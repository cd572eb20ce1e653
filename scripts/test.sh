#!/usr/bin/env bash
# The test command: build (scripts/build.sh) and run every test with CTest, then, when the Python
# test environment .venv/ exists (FA4_PYTHON_DEPS=1 scripts/install_deps.sh makes it), the Python
# package's tests (tests/python, pytest) against the library and native ops just built. GPU tests skip, saying
# why, on a machine without a Hopper GPU. Extra arguments go to ctest (e.g. -R Forward).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/build.sh
ctest --preset default -j "${FA4_TEST_JOBS:-$(nproc)}" "$@"
if [ -x .venv/bin/python ]; then
  export FA4CPP_LIBRARY=$root/build/default/libfa4.so PYTHONPATH=$root/python
  .venv/bin/python -m pytest -p no:cacheprovider -q tests/python
  # The ops' tests once more through the package's Python implementation (what serves the ops
  # where the native ops are not built, and what they hand refusals and the modes to).
  FA4CPP_TEST_PYTHON_PATH=1 .venv/bin/python -m pytest -p no:cacheprovider -q \
    tests/python/test_ops.py tests/python/test_interface.py tests/python/test_kvcache.py \
    tests/python/test_compile.py tests/python/test_modes.py
fi
