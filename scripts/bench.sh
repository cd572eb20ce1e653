#!/usr/bin/env bash
# The main job: build, then run fa4-bench (forward + backward of one problem, checked against the
# reference) on the best backend present. Arguments go to fa4-bench (see `fa4-bench --help`).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
./scripts/build.sh >/dev/null
exec ./build/default/bench/fa4-bench "$@"
