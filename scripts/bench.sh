#!/usr/bin/env bash
# The main job: build, then run fa4-bench (forward + backward of one problem, checked against the
# reference) on the best backend present. Arguments go to fa4-bench (see `fa4-bench --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# Build what this machine runs: with a Hopper GPU (or FA4_WITH_CUDA=ON asking for the kernels)
# the default build, every Hopper kernel included; elsewhere the CPU backend alone, which is ready
# in a minute or two where the kernels would take a quarter of an hour on two cores.
preset=cpu
if [ "${FA4_WITH_CUDA:-}" = ON ] ||
  nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | grep -q '^9\.'; then
  preset=default
fi
FA4_PRESET=$preset FA4_BUILD_TARGETS=fa4-bench ./scripts/build.sh >/dev/null
exec "./build/$preset/bench/fa4-bench" "$@"
