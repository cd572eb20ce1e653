#!/usr/bin/env bash
# Installs the pinned dependencies, configures and builds fa4cpp (preset "default": CUDA sm_90a when
# a toolkit is found, else CPU-only). Extra arguments go to CMake's configure step, e.g.
#   scripts/build.sh -DFA4_WITH_CUDA=OFF
# FA4_SM90_KERNELS (env), e.g. "128:bf16", builds only those Hopper forward kernels (CI does this).
# FA4_PRESET (env) picks another preset of CMakePresets.json (e.g. cpu); FA4_BUILD_TARGETS (env,
# space-separated) builds only those targets.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/install_deps.sh
jobs=${FA4_BUILD_JOBS:-$(nproc)}
args=()
[ -n "${FA4_SM90_KERNELS:-}" ] && args+=("-DFA4_SM90_KERNELS=$FA4_SM90_KERNELS")
# The native torch ops build against the Python test environment's torch when it exists.
[ -x .venv/bin/python ] && args+=("-DFA4_TORCH_PYTHON=$root/.venv/bin/python")
preset=${FA4_PRESET:-default}
targets=()
for t in ${FA4_BUILD_TARGETS:-}; do targets+=(--target "$t"); done
cmake --preset "$preset" "${args[@]}" "$@" >/dev/null
cmake --build --preset "$preset" -j "$jobs" "${targets[@]}"
