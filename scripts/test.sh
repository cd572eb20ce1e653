#!/usr/bin/env bash
# The test command: build (scripts/build.sh) and run every test with CTest. GPU tests skip, saying
# why, on a machine without a Hopper GPU. Extra arguments go to ctest (e.g. -R Forward).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/build.sh
ctest --preset default -j "${FA4_TEST_JOBS:-$(nproc)}" "$@"
