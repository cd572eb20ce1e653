#!/usr/bin/env bash
# A/B of compile-time variants of the sm90 kernels, timed side by side in ONE process beside cuDNN
# (bench/sweep.py with one --lib per variant). Runs on the device: each variant is the current tree
# built with extra CUDA defines (e.g. the FA4_SM90_* tuning macros of src/sm90/fwd/fwd_config.cuh).
#
#   bench/ab_variants.sh OUT_DIR KERNELS "name[@SOURCE_DIR]=DEFINES" ... [-- sweep.py arguments]
#   (no sweep arguments: build, and test, only)
#   bench/ab_variants.sh $OUT "64:bf16;128:bf16" base= "thr8=-DFA4_SM90_RESCALE_THRESHOLD_LOG2=8" \
#       -- --hdims 64,128 --seqlens 4096,16384 --rounds 2
#
# name@SOURCE_DIR builds another source tree instead of this one (e.g. an older commit exported
# with `git archive REV | tar -x -C .devsrc/REV`, carried to the device), so that two versions of
# the kernels are timed in the same process.
#
# FA4_AB_TESTS=name,... also builds and runs the GPU tests of those variants (FA4_AB_TEST_FILTER
# narrows them). FA4_GTEST_SRC / FA4_CUTLASS_DIR as in scripts/gpu_check.sh.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=$1 kernels=$2
shift 2
variants=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do variants+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#variants[@]} -gt 0 ] || { echo "usage: see the header of $0" >&2; exit 2; }
mkdir -p "$out"

gtest_args=()
if [ -n "${FA4_GTEST_SRC:-}" ] && [ ! -d /tmp/fa4_gtest/prefix ]; then
  cmake -S "$FA4_GTEST_SRC" -B /tmp/fa4_gtest -G Ninja -DBUILD_GMOCK=OFF \
    -DCMAKE_INSTALL_PREFIX=/tmp/fa4_gtest/prefix >"$out/build_gtest.log" 2>&1 &&
    cmake --build /tmp/fa4_gtest >>"$out/build_gtest.log" 2>&1 &&
    cmake --install /tmp/fa4_gtest >>"$out/build_gtest.log" 2>&1
fi
[ -d /tmp/fa4_gtest/prefix ] && gtest_args=(-DGTest_DIR=/tmp/fa4_gtest/prefix/lib/cmake/GTest)

tested=",${FA4_AB_TESTS:-},"
jobs=$(($(nproc) / ${#variants[@]} + 1))
pids=() libs=()
for v in "${variants[@]}"; do
  name=${v%%=*} defines=${v#*=} src=$root
  if [[ $name == *@* ]]; then
    src=${name#*@}
    name=${name%%@*}
    [[ $src == /* ]] || src="$root/$src"
  fi
  dir="$root/build/ab_$name"
  targets=(fa4_shared)
  [[ $tested == *",$name,"* ]] && targets+=(fa4_gpu_tests)
  (cmake -S "$src" -B "$dir" -G Ninja "-DFA4_SM90_KERNELS=$kernels" "-DCMAKE_CUDA_FLAGS=$defines" \
     ${FA4_CUTLASS_DIR:+"-DFA4_CUTLASS_DIR=$FA4_CUTLASS_DIR"} "${gtest_args[@]}" &&
     cmake --build "$dir" -j "$jobs" --target "${targets[@]}") >"$out/build_$name.log" 2>&1 &
  pids+=($!)
  libs+=(--lib "$name=$dir/libfa4.so")
done
failed=0
for p in "${pids[@]}"; do wait "$p" || failed=1; done
for v in "${variants[@]}"; do
  name=${v%%=*}
  name=${name%%@*}
  echo "build $name: $(tail -n 1 "$out/build_$name.log")"
done
[ $failed -eq 0 ] || exit 1

# The variants' test runs in parallel: the reference (CPU, double precision) dominates them.
tests=()
for v in "${variants[@]}"; do
  name=${v%%=*}
  name=${name%%@*}
  [[ $tested == *",$name,"* ]] || continue
  timeout 300 "$root/build/ab_$name/tests/gpu/fa4_gpu_tests" --gtest_brief=1 \
    --gtest_filter="${FA4_AB_TEST_FILTER:-*}" >"$out/tests_$name.log" 2>&1 &
  tests+=("$name:$!")
done
for t in "${tests[@]}"; do
  name=${t%%:*}
  wait "${t#*:}"
  echo "tests $name: rc $? $(grep -E '^\[  (PASSED|FAILED) ' "$out/tests_$name.log" | tr '\n' ' ')"
  grep -E '^\[  FAILED  \]' "$out/tests_$name.log" | head -n 8
done

# Without sweep arguments the variants are only built (and tested): several sweeps over subsets of
# them can follow, each a bench/sweep.py call with --lib NAME=build/ab_NAME/libfa4.so.
[ $# -gt 0 ] || exit 0
PYTHONUNBUFFERED=1 python3 "$root/bench/sweep.py" "${libs[@]}" --out "$out" "$@" >"$out/sweep.log" 2>&1
echo "sweep: rc $?"
tail -n 40 "$out/sweep.log"
