#!/usr/bin/env bash
# The one script the H200 runs (device `run` tool): the GPU tests, compute-sanitizer (memcheck and
# racecheck on one small case each), the HGMMA count of the kernels' SASS, and the forward sweep
# beside cuDNN and torch FA2 (bench/sweep.py; FA4_GIT_SHA names the build in its JSON/markdown).
# Binaries are built on the workstation and carried in .devbin/ (fa4_gpu_tests, libfa4.so), or, with
# the `build` step first, built on the device itself (its 16 cores build every kernel of the table
# in minutes; GoogleTest is built from the sources FA4_GTEST_SRC points to when the device has none).
# Logs are written to a work folder and packed into $OUT/gpu_check_logs.tgz (the device returns at
# most 8 files); a short table is printed last and saved as $OUT/summary.txt. Each line of it is
# also printed as soon as its step is done, so that a run cut short by the device's time limit
# still says how far it got.
# With FA3_SRC naming FlashAttention-3's source archive, `build` builds it too (scripts/build_fa3.sh).
#   usage: scripts/gpu_check.sh [build] [tests|sanitize|python|host|sass|bench|bench_bwd|bench_fwdbwd|decode|decode_loop]...
#          (default: all of them but decode and decode_loop); FA4_TEST_SETS=NAME,... narrows `tests` to those of its sets;
#          FA4_SHARD_TIMEOUT=s limits each of a set's eight shards (default 480: the whole suite's
#          slowest shards take ~450 s on an H100);
#          FA4_CUDA_FLAGS (with `build`): extra CUDA defines for the kernels, e.g. a compile-time
#          variant's ("-DFA4_SM90_WARP_ARRIVALS=1"), so that every step after it runs on that build
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${FA4_DEVBIN:-$root/.devbin}
out=$(mktemp -d /tmp/fa4_gpu_check.XXXXXX)
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}:$bin"
steps=("$@")
summary=()
note() {
  summary+=("$(printf '%-10s %s' "$1" "$2")")
  printf '[%4d s] %s\n' "$SECONDS" "${summary[${#summary[@]} - 1]}"
}

# FlashAttention-3 for the comparisons (scripts/build_fa3.sh), built in the background from `build`
# on when FA3_SRC names its source archive; the steps that time it wait for it (fa3_ready).
fa3_pid=
fa3_ready() {
  [ -n "$fa3_pid" ] || return 0
  if wait "$fa3_pid"; then
    export FA3_HOPPER=/tmp/fa3/fa/hopper
    note fa3 "built at $SECONDS s ($FA3_HOPPER)"
  else
    note fa3 "build failed (build_fa3.log): $(tail -n 1 "$out/build_fa3.log" | cut -c1-150)"
  fi
  fa3_pid=
}

# PYTHONPATH for the steps that time the peers: fa4cpp's package, FlashAttention-3's hopper/ folder
# (FA3_HOPPER, or built by `build`), FlashAttention-4 unpacked by scripts/fetch_fa4.sh --install
# (FA4_SITE).
peer_path() {
  local path="$root/python${FA3_HOPPER:+:$FA3_HOPPER}"
  [ -n "${FA4_SITE:-}" ] && path+=":$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:$FA4_SITE"
  echo "$path"
}

run_build() {
  local dir="$root/build/device" gtest_args=() t0=$SECONDS
  if [ -n "${FA3_SRC:-}" ]; then
    "$root/scripts/build_fa3.sh" "$FA3_SRC" /tmp/fa3 >"$out/build_fa3.log" 2>&1 &
    fa3_pid=$!
  fi
  if [ -n "${FA4_GTEST_SRC:-}" ]; then
    if cmake -S "$FA4_GTEST_SRC" -B /tmp/fa4_gtest -G Ninja -DBUILD_GMOCK=OFF \
      -DCMAKE_INSTALL_PREFIX=/tmp/fa4_gtest/prefix >"$out/build_gtest.log" 2>&1 &&
      cmake --build /tmp/fa4_gtest -j "$(nproc)" >>"$out/build_gtest.log" 2>&1 &&
      cmake --install /tmp/fa4_gtest >>"$out/build_gtest.log" 2>&1; then
      gtest_args=(-DGTest_DIR=/tmp/fa4_gtest/prefix/lib/cmake/GTest)
    else
      note build "GoogleTest from $FA4_GTEST_SRC failed to build (build_gtest.log)"
    fi
  fi
  # fa4-bench's header-only dependencies (CLI11, nlohmann/json): the device has no package
  # manager, so their Debian packages travel in .devdeb/ (`apt-get download libcli11-dev
  # nlohmann-json3-dev libopenblas-pthread-dev libhwy-dev`) and are unpacked beside the build.
  # The CPU backend's OpenBLAS and Highway (libopenblas-pthread-dev, libhwy-dev) travel the same way.
  local prefix_args=() deb deps=/tmp/fa4_deps/usr
  for deb in "$root"/.devdeb/*.deb; do
    [ -f "$deb" ] || continue
    dpkg -x "$deb" /tmp/fa4_deps && prefix_args=("-DCMAKE_PREFIX_PATH=$deps")
  done
  local blas=$deps/lib/x86_64-linux-gnu/openblas-pthread
  [ -f "$blas/libopenblas.a" ] && prefix_args+=(
    "-DFA4_OPENBLAS_INCLUDE=$deps/include/x86_64-linux-gnu/openblas-pthread"
    "-DFA4_OPENBLAS_STATIC=$blas/libopenblas.a" "-DFA4_HWY_INCLUDE=$deps/include")
  cmake -S "$root" -B "$dir" -G Ninja -DFA4_SM90_PTXAS_VERBOSE=ON -DFA4_TORCH_PYTHON="$(command -v python3)" \
    ${FA4_KERNELS:+"-DFA4_SM90_KERNELS=$FA4_KERNELS"} ${FA4_CUTLASS_DIR:+"-DFA4_CUTLASS_DIR=$FA4_CUTLASS_DIR"} \
    ${FA4_CUDA_FLAGS:+"-DCMAKE_CUDA_FLAGS=$FA4_CUDA_FLAGS"} \
    "${gtest_args[@]}" "${prefix_args[@]}" >"$out/build.log" 2>&1 &&
    cmake --build "$dir" -j "$(nproc)" --target fa4_shared fa4_gpu_tests fa4-bench >>"$out/build.log" 2>&1
  local rc=$?
  # The native torch ops, built against the device's torch (cmake/fa4_torch_ops.cmake finds it).
  if [ $rc -eq 0 ] && grep -q "native torch ops against" "$out/build.log"; then
    cmake --build "$dir" -j "$(nproc)" --target fa4_torch >>"$out/build.log" 2>&1
    rc=$?
  fi
  note build "rc $rc in $((SECONDS - t0)) s; ptxas spills: $(grep -c ' [1-9][0-9]* bytes spill' "$out/build.log")"

  [ $rc -eq 0 ] || { tail -n 30 "$out/build.log"; return 1; }
  mkdir -p "$dir/bin"
  cp "$dir/libfa4.so" "$dir/tests/gpu/fa4_gpu_tests" "$dir/bench/fa4-bench" "$dir/bin/"
  cp "$dir"/libfa4_torch.so "$dir"/libfa4_torch.torch_version "$dir/bin/" 2>/dev/null
  bin="$dir/bin"
  export LD_LIBRARY_PATH="$bin:$LD_LIBRARY_PATH"
}

if [ "${steps[0]:-}" = build ]; then
  steps=("${steps[@]:1}")
  run_build || { printf '%s\n' "${summary[@]}"; exit 1; }
fi
[ ${#steps[@]} -eq 0 ] && steps=(tests sanitize python host sass bench bench_bwd bench_fwdbwd)

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
  >"$out/gpu.txt" 2>&1
note gpu "$(tail -n 1 "$out/gpu.txt")"

# One small case first, under a short timeout: a hang or a crash here makes the longer steps
# pointless, and device time is scarce.
smoke_ok() {
  timeout 60 "$bin/fa4_gpu_tests" --gtest_brief=1 \
    --gtest_filter='Matrix/Sm90Forward.MatchesReference/d128_bf16_q113_k203_gqa4' \
    >"$out/smoke.log" 2>&1
  local rc=$?
  note smoke "rc $rc $(grep -E '^\[  (PASSED|FAILED) ' "$out/smoke.log" | head -n 1)"
  [ $rc -eq 0 ] || return 1
  # The backward on one small case (its kernels' first run).
  timeout 60 "$bin/fa4_gpu_tests" --gtest_brief=1 \
    --gtest_filter='Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_q113_k203_gqa4_causal' \
    >"$out/smoke_backward.log" 2>&1
  rc=$?
  note smoke "backward: rc $rc $(grep -E '^\[  (PASSED|FAILED) ' "$out/smoke_backward.log" | head -n 1)"
  [ $rc -eq 0 ] || { tail -n 30 "$out/smoke_backward.log"; return 1; }
  # Many tiles per CTA (persistent schedule): a hang in the tile loop shows here, in seconds.
  if [ -x "$bin/fa4-bench" ]; then
    timeout 60 "$bin/fa4-bench" --backend sm90 --batch 4 --seqlen 4096 --heads 16 --head-dim 128 \
      --pass fwd --warmup 1 --iters 3 --check 64 >"$out/smoke_persistent.log" 2>&1
    rc=$?
    note smoke "persistent 4x4096x16 d128: rc $rc"
    [ $rc -eq 0 ] || { tail -n 20 "$out/smoke_persistent.log"; return 1; }
  fi
}

# The test binary sharded over the CPU cores: the reference is double-precision and
# single-threaded (the kernels themselves take milliseconds). `sharded NAME LABEL [VAR=value ...]
# -- [test arguments]`: logs NAME_shard*.log, NAME.log and NAME_failed.txt, one summary line.
sharded() {
  local name=$1 label=$2 shards=8 pids=() failed=0 envs=() i limit=${FA4_SHARD_TIMEOUT:-480}
  shift 2
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift
  for i in $(seq 0 $((shards - 1))); do
    env "${envs[@]}" GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i timeout "$limit" \
      "$bin/fa4_gpu_tests" "$@" >"$out/${name}_shard$i.log" 2>&1 &
    pids+=($!)
  done
  # A shard stopped by its timeout names the test it was in (its last RUN line): a hang, or a
  # set too slow for the limit, rather than a failing test.
  local rc stuck=()
  for i in "${!pids[@]}"; do
    rc=0
    wait "${pids[$i]}" || rc=$?
    [ $rc -eq 0 ] && continue
    failed=$((failed + 1))
    [ $rc -eq 124 ] &&
      stuck+=("$(grep '^\[ RUN' "$out/${name}_shard$i.log" | tail -n 1 | sed 's/^\[ RUN *\] //')")
  done
  cat "$out/${name}"_shard*.log >"$out/$name.log"
  local passed skipped
  passed=$(grep -h '^\[  PASSED  \]' "$out/${name}"_shard*.log | awk '{s += $4} END {print s + 0}')
  skipped=$(grep -h '^\[  SKIPPED \]' "$out/${name}"_shard*.log | awk '{s += $4} END {print s + 0}')
  note "$label" "passed $passed, skipped $skipped, failing shards $failed/$shards"
  [ ${#stuck[@]} -gt 0 ] &&
    note "" "$(printf '%s; ' "${stuck[@]}" | sed "s/; $//; s/^/timed out ($limit s) in: /" | cut -c1-300)"
  # A shard stopped by a test that broke the CUDA context (tests/gpu/sticky_error_stop.cpp).
  local fatal
  fatal=$(grep -h '^\[  FATAL   \]' "$out/${name}"_shard*.log | sed 's/^\[  FATAL   \] //' | sort -u)
  [ -n "$fatal" ] && note "" "$(printf '%s' "$fatal" | tr '\n' ';' | cut -c1-300)"
  grep -h '^\[  FAILED  \]' "$out/${name}"_shard*.log | sort -u | head -n 20 >"$out/${name}_failed.txt"
  [ -s "$out/${name}_failed.txt" ] && note "" "$(tr '\n' ' ' <"$out/${name}_failed.txt" | cut -c1-300)"
}

# FA4_TEST_SETS=NAME,... (env) runs only those sets of run_tests (device calls are limited to
# ten minutes: the sets can be spread over several).
want() { [ -z "${FA4_TEST_SETS:-}" ] || [[ ",$FA4_TEST_SETS," == *",$1,"* ]]; }

run_tests() {
  want tests && sharded tests tests
  # The KV cache's cases alone (also part of `tests`), for a quick run after a change to them.
  want tests_kv_cache && sharded tests_kv_cache "kv cache" -- --gtest_filter='*KvCache*'
  # The forward tests again with 3 persistent CTAs, so that each CTA runs many tiles on every
  # mask and sequence layout (tile_scheduler.cuh): the hand-over of Q's buffer and V's ring.
  want tests_persistent && sharded tests_persistent "fwd 3 CTAs" FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=3 \
    -- --gtest_filter='*Sm90Forward*'
  # The same with the zig-zag's tiles numbered in groups of 2 pairs, query tile by query tile
  # (causal_schedule.hpp chooses such numberings for some causal shapes).
  want tests_persistent_grouped && sharded tests_persistent_grouped "fwd 3 CTAs, zig-zag in groups of 2" \
    FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=3 FA4_SM90_ZIGZAG_GROUP=2 -- --gtest_filter='*Sm90Forward*'
  # The forward's GQA / MQA tests with pack-GQA forced on (query_rows.cuh: by default only short
  # query sequences pack), alone and with 3 persistent CTAs.
  want tests_packed && sharded tests_packed "fwd packed" FA4_SM90_PACK_GQA=1 -- --gtest_filter='*Sm90Forward*-*_gqa1:*_gqa1_*'
  want tests_packed_persistent && sharded tests_packed_persistent "fwd packed, 3 CTAs" FA4_SM90_PACK_GQA=1 \
    FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=3 -- --gtest_filter='*Sm90Forward*-*_gqa1:*_gqa1_*'
  # The forward's varlen tests with their tiles ordered longest-first (tile_order.cuh; by default
  # only batches of more tiles than SMs are), also packed and on 3 persistent CTAs.
  want tests_ordered && sharded tests_ordered "fwd varlen ordered" FA4_SM90_TILE_ORDER=longest \
    -- --gtest_filter='*Sm90Forward*varlen*:*Sm90ForwardLong.Varlen*:*Sm90Forward*Repeat*:*Sm90TileOrder*:*Sm90SplitKv*'
  want tests_ordered_packed && sharded tests_ordered_packed "fwd varlen ordered, packed, 3 CTAs" FA4_SM90_TILE_ORDER=longest \
    FA4_SM90_PACK_GQA=1 FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=3 \
    -- --gtest_filter='*Sm90Forward*varlen*-*_gqa1:*_gqa1_*'
  # The chunked forward (fwd_config.cuh: d256 with 128-key tiles, by default only for long
  # sequences without a causal or window mask) on every forward test of its head dims, masks
  # included; then with 3 splits, pack-GQA and 3 persistent CTAs on top.
  want tests_chunked && sharded tests_chunked "fwd chunked" FA4_SM90_CHUNKED_KV=on -- --gtest_filter='*Sm90Forward*d256*'
  want tests_chunked_all && sharded tests_chunked_all "fwd chunked, 3 splits, packed, 3 CTAs" FA4_SM90_CHUNKED_KV=on \
    FA4_SM90_SPLITS=3 FA4_SM90_PACK_GQA=1 FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=3 \
    -- --gtest_filter='*Sm90Forward*d256*-*Refuses*'
  # The narrow forward (fwd_tile_shape.hpp: d128 with one consumer warpgroup, by default only for
  # decode grids that leave SMs idle) on every d128 forward and KV-cache test, masks and prefill
  # included; then with 3 splits, pack-GQA and 3 persistent CTAs on top.
  want tests_narrow && sharded tests_narrow "fwd narrow" FA4_SM90_NARROW=on \
    -- --gtest_filter='*Sm90Forward*d128*:*KvCache*'
  want tests_narrow_all && sharded tests_narrow_all "fwd narrow, 3 splits, packed, 3 CTAs" \
    FA4_SM90_NARROW=on FA4_SM90_SPLITS=3 FA4_SM90_PACK_GQA=1 FA4_SM90_SCHEDULE=persistent \
    FA4_SM90_PERSISTENT_CTAS=3 -- --gtest_filter='*Sm90Forward*d128*-*_gqa1:*_gqa1_*:*Refuses*'
  # The unmasked forward (fwd_tile_shape.hpp: d128 with 176-key tiles, by default only without a
  # mask from 8192 keys) on every d128 forward and KV-cache test that loads whole tiles, masks and
  # decode included (the narrow kernel off, which decode would take first).
  want tests_unmasked && sharded tests_unmasked "fwd unmasked" FA4_SM90_UNMASKED=on \
    FA4_SM90_NARROW=off -- --gtest_filter='*Sm90Forward*d128*:*KvCache*'
  # Every forward test through split-KV (split_kv.cuh; by default only problems of few tiles and
  # many keys split): 3 splits wherever the partials fit, empty shares included; then with the
  # varlen order, pack-GQA and 3 persistent CTAs on top.
  # (The refusal tests pass no workspace: with splits forced, the workspace check answers first.)
  want tests_split && sharded tests_split "fwd 3 splits" FA4_SM90_SPLITS=3 -- --gtest_filter='*Sm90Forward*-*Refuses*'
  want tests_split_all && sharded tests_split_all "fwd 3 splits, ordered, packed, 3 CTAs" FA4_SM90_SPLITS=3 \
    FA4_SM90_TILE_ORDER=longest FA4_SM90_PACK_GQA=1 FA4_SM90_SCHEDULE=persistent \
    FA4_SM90_PERSISTENT_CTAS=3 -- --gtest_filter='*Sm90Forward*-*_gqa1:*_gqa1_*:*Refuses*'
  # d256's backward tests without a band with its key tiles walking the query tiles from the first
  # (by default each starts at its own: QueryOrder).
  want tests_bwd_plain && sharded tests_bwd_plain "bwd d256 plain walk" FA4_SM90_BWD_ROTATE=off \
    -- --gtest_filter='*Sm90Backward*d256*-*causal*:*Causal*:*window*:*deterministic*:*Deterministic*'
  # d256's backward tests on single key tiles (by default fixed-length problems with an even
  # number of key tiles run on key-tile pairs: bwd_pair.cuh).
  want tests_bwd_single && sharded tests_bwd_single "bwd d256 single key tiles" FA4_SM90_BWD_PAIRS=off \
    -- --gtest_filter='*Sm90Backward*d256*-*deterministic*:*Deterministic*:*varlen*:*_used*'
}

# `sanitize NAME LABEL "TOOLS" FILTER [VAR=value ...]`: the GPU tests of FILTER under each
# compute-sanitizer tool, with the variables set; logs sanitize_NAME_TOOL.log, a line per tool.
# FA4_SANITIZE_SETS=NAME,... (env) runs only those sanitize sets ("core" is the unnamed first one).
sanitize() {
  local name=$1 label=$2 tools=$3 filter=$4 tool rc log
  shift 4
  [ -z "${FA4_SANITIZE_SETS:-}" ] || [[ ",$FA4_SANITIZE_SETS," == *",${name:-core},"* ]] || return 0
  for tool in $tools; do
    log="$out/sanitize${name:+_$name}_$tool.log"
    env "$@" timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 99 "$bin/fa4_gpu_tests" \
      --gtest_filter="$filter" >"$log" 2>&1
    rc=$?
    note "$tool" "${label:+$label: }rc $rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1) $(grep -h '^\[  PASSED' "$log")"
  done
}

run_sanitize() {
  # Forward: a fixed-length causal case and a varlen + seqused_k one (the per-sequence TMA
  # addressing);
  local small='Matrix/Sm90Forward.MatchesReference/d128_bf16_q113_k203_causal_*:Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_used_*'
  # and the backward: a causal GQA case and a varlen one.
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_q113_k203_gqa4_causal*'
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_varlen_*causal*'
  # and the backward's deterministic mode (counter turns, the reduce completed before each pass).
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_q300_k600_gqa4_causal_deterministic'
  # and the wide backward (P and dS through shared memory): d256 (one-stage rings), 192x128.
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d256_bf16_q113_k203_gqa4_causal'
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d192x128_bf16_q300_k600_gqa4_causal_deterministic'
  # and the wide backward without a band: key tiles starting at their own query tiles, wrapping.
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d256_bf16_q300_k600_gqa4_spiky'
  # and d256's key-tile pairs (the cases above run on them too): pairs whose key tiles see no
  # query, one or both.
  small+=':Matrix/Sm90Backward.MatchesReferenceGradients/d256_bf16_q1_k256_gqa4_window*'
  sanitize "" "" "memcheck racecheck synccheck" "$small"
  # The forward cases again on 2 persistent CTAs (many tiles each): the hand-over of Q's buffer
  # and V's ring from tile to tile.
  sanitize fwd_persistent "forward, 2 persistent CTAs" "memcheck racecheck" \
    "${small%%:Matrix/Sm90Backward*}" FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=2
  # Packed GQA tiles (Q gathered by cp.async, O stored row by row), on 2 persistent CTAs.
  local packed='Matrix/Sm90Forward.MatchesReference/d128_bf16_q113_k203_causal_gqa8*'
  packed+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_odd_causal_gqa8*:Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_used_gqa8'
  # G = 7 (a division by a non-power of two), and tiles that see no key (q_full / q_empty
  # hand-over without a QKᵀ).
  packed+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_q300_k333_causal_gqa7'
  packed+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_decode_q1_gqa7_spiky'
  packed+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_chunks_causal_gqa7_headmajor'
  sanitize fwd_packed "forward packed" "memcheck racecheck" "$packed" \
    FA4_SM90_PACK_GQA=1 FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=2
  # The varlen tile order (its kernel's shared-memory sort, the forward's wait for it).
  local ordered='Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_used_*'
  ordered+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_chunks_causal_gqa7_headmajor'
  sanitize fwd_ordered "forward ordered" "memcheck racecheck synccheck" "$ordered" \
    FA4_SM90_TILE_ORDER=longest
  # Split-KV: the partials' stores and the combine.
  local split='Matrix/Sm90Forward.MatchesReference/d128_bf16_q1_k5000_split_gqa8_spiky'
  split+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_q4_k3000_causal_split_gqa1'
  split+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_decode_q1_gqa7_spiky'
  split+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_q1_k20000_split_gqa8_spiky'
  sanitize fwd_split "forward split" "memcheck racecheck synccheck" "$split"
  # The narrow kernel (one consumer warpgroup, three stages, O staged in V's ring) on 2 persistent
  # CTAs, unsplit (O handed from tile to tile through V's ring) and split.
  local narrow='Matrix/Sm90Forward.MatchesReference/d128_bf16_q113_k203_causal_gqa4'
  narrow+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_chunks_causal_gqa7_headmajor'
  sanitize fwd_narrow "forward narrow, 2 persistent CTAs" "memcheck racecheck synccheck" "$narrow" \
    FA4_SM90_NARROW=on FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=2
  sanitize fwd_narrow_split "forward narrow, split" "memcheck racecheck synccheck" "$split" \
    FA4_SM90_NARROW=on
  # The chunked forward's one ring of K and V chunks, with and without a mask, varlen, on 2
  # persistent CTAs: the ring's hand-over from tile to tile.
  local chunked='Matrix/Sm90Forward.MatchesReference/d256_bf16_q113_k203_*'
  chunked+=':Matrix/Sm90Forward.MatchesReference/d256_bf16_q512_k256_gqa4'
  chunked+=':Matrix/Sm90Forward.MatchesReference/d256_bf16_varlen_ktiles_causal_gqa4_spiky'
  sanitize fwd_chunked "forward chunked, 2 persistent CTAs" "memcheck racecheck synccheck" "$chunked" \
    FA4_SM90_CHUNKED_KV=on FA4_SM90_SCHEDULE=persistent FA4_SM90_PERSISTENT_CTAS=2
  # KV caches: pages gathered row by row (pages of 7 and 16 keys, shared, left pads, appends with
  # rotary, 3 splits) and pages read as TMA boxes; the prepare kernel's appends before them.
  local kv='Cases/Sm90KvCache.MatchesReference/decode_d128_gqa4_page16_append1_rotary128_neox'
  kv+=':Cases/Sm90KvCache.MatchesReference/page16_spec3_append3_causal_shared_d128_split3'
  kv+=':Cases/Sm90KvCache.MatchesReference/decode_d128_gqa4_page16_as_page256_packed'
  kv+=':Cases/Sm90KvCache.MatchesReference/batch_idx_leftpad_rotary_page7'
  kv+=':Cases/Sm90KvCache.MatchesReference/appends_without_queries'
  sanitize kv_cache "kv cache" "memcheck racecheck synccheck" "$kv"
  # Score variants: ALiBi in the forward's score step and both backward tile loops (d128's on Sᵀ,
  # d256's on S), sinks in the finish, in split-KV's combine and in d(sinks)' kernel (varlen).
  local variants='Matrix/Sm90Forward.MatchesReference/d128_bf16_q300_k300_causal_gqa1_packed_spiky_sinks_alibi_per_batch'
  variants+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_q4_k3000_causal_split_gqa1_sinks'
  variants+=':Matrix/Sm90Forward.MatchesReference/d128_bf16_varlen_decode_q1_gqa8_sinks_alibi_per_batch'
  variants+=':Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_q113_k203_gqa8_causal_spiky_alibi'
  variants+=':Matrix/Sm90Backward.MatchesReferenceGradients/d128_bf16_varlen_odd_gqa4_sinks_alibi_per_batch'
  variants+=':Matrix/Sm90Backward.MatchesReferenceGradients/d256_bf16_q113_k203_gqa4_softcap30_spiky_alibi'
  variants+=':Cases/Sm90KvCache.MatchesReference/sinks_alibi_per_batch_varlen_chunks_page64_split3'
  sanitize variants "variants" "memcheck racecheck synccheck" "$variants"
  # Two and three tiles per CTA: the persistent tile loop's hand-over of Q's buffer and the rings.
  [ -z "${FA4_SANITIZE_SETS:-}" ] || [[ ",$FA4_SANITIZE_SETS," == *",persistent,"* ]] || return 0
  local tool rc
  if [ -x "$bin/fa4-bench" ]; then
    for tool in memcheck racecheck; do
      FA4_SM90_SCHEDULE=persistent timeout 120 compute-sanitizer --tool "$tool" --error-exitcode 99 \
        "$bin/fa4-bench" --backend sm90 --batch 1 --seqlen 300 --heads 140 --head-dim 128 \
        --pass fwd --warmup 0 --iters 1 --check 8 >"$out/sanitize_persistent_$tool.log" 2>&1
      rc=$?
      note "$tool" "persistent: rc $rc: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_persistent_$tool.log" | tail -n 1)"
    done
  fi
}

run_python() {
  # The PyTorch package's tests against this build (its GPU tests need the H200; torch is there).
  FA4CPP_LIBRARY="$bin/libfa4.so" PYTHONPATH="$root/python" timeout 420 python3 -m pytest -q -rs \
    -p no:cacheprovider "$root/tests/python" >"$out/python.log" 2>&1
  note python "rc $? $(tail -n 1 "$out/python.log")"
  local l
  while read -r l; do note "" "${l:0:200}"; done < <(grep "^SKIPPED" "$out/python.log" | head -n 5)
}

run_host() {
  fa3_ready
  # Host time per call (bench/host_overhead.py) beside SDPA's flash op and, with FA3_HOPPER naming
  # a built FlashAttention-3 hopper/ folder, FlashAttention-3's op; results into $OUT.
  FA4CPP_LIBRARY="$bin/libfa4.so" PYTHONPATH="$(peer_path)" \
    timeout 300 python3 "$root/bench/host_overhead.py" --device cuda --dtypes bf16 \
    --seqlens 1,128 --heads 8 --out "$out" --sha "${FA4_GIT_SHA:-unknown}" >"$out/host.log" 2>&1
  note host "rc $? (host_overhead.md; log in host.log)"
  if [ -n "${OUT:-}" ]; then cp "$out"/host_overhead.* "$OUT/" 2>/dev/null; fi
}

run_sass() {
  cuobjdump --dump-sass "$bin/libfa4.so" >"$out/sass.txt" 2>&1
  awk '/Function : /{fn=$3} /HGMMA/{n[fn]++} END {for (f in n) print n[f], f}' "$out/sass.txt" \
    >"$out/hgmma_counts.txt"
  note sass "HGMMA per kernel: $(awk '{printf "%s ", $1}' "$out/hgmma_counts.txt")"
  note "" "local memory ops (LDL/STL): $(grep -cE '\b(LDL|STL)\b' "$out/sass.txt")"
}

run_bench() {
  fa3_ready
  # The project's side-by-side sweep (bench/sweep.py): fa4cpp beside cuDNN and torch FA2, one run.
  PYTHONPATH="$(peer_path)" PYTHONUNBUFFERED=1 timeout 420 python3 "$root/bench/sweep.py" \
    --lib "$bin/libfa4.so" --sha "${FA4_GIT_SHA:-unknown}" --out "$out" --pass fwd \
    >"$out/bench.log" 2>&1
  note bench "rc $? (table below; log in bench.log)"
  [ -f "$out/fwd_sweep.md" ] && cp "$out/fwd_sweep.md" "$out/bench.txt"
  [ -f "$out/fwd_sweep.json" ] && python3 "$root/bench/plot.py" "$out/fwd_sweep.json" >/dev/null 2>&1
  if [ -n "${OUT:-}" ]; then cp "$out"/fwd_sweep.* "$OUT/" 2>/dev/null; fi
}

# The backward alone, and forward + backward, beside cuDNN's and torch FA2's, at every head dim of the
# backward table (FA4_BENCH_HDIMS narrows them).
run_bench_pass() {
  local pass=$1
  fa3_ready
  PYTHONPATH="$(peer_path)" PYTHONUNBUFFERED=1 timeout 300 python3 "$root/bench/sweep.py" \
    --lib "$bin/libfa4.so" --pass "$pass" --hdims "${FA4_BENCH_HDIMS:-64,96,128,192,256}" --sha "${FA4_GIT_SHA:-unknown}" --out "$out" \
    >"$out/bench_$pass.log" 2>&1
  note "bench_$pass" "rc $? (${pass}_sweep.md; log in bench_$pass.log)"
  [ -f "$out/${pass}_sweep.json" ] && python3 "$root/bench/plot.py" "$out/${pass}_sweep.json" >/dev/null 2>&1
  if [ -n "${OUT:-}" ]; then cp "$out/${pass}"_sweep.* "$OUT/" 2>/dev/null; fi
}
# Decode and chunked prefill over KV caches (bench/decode.py) beside FlashAttention-3 and cuDNN;
# FA4_DECODE_ARGS replaces its default rows (e.g. "--gqa 32/8 --batches 16 --pages 0,64"),
# FA4_DECODE_TIMEOUT its time limit (default 420 s).
run_decode() {
  fa3_ready
  # shellcheck disable=SC2086  # the arguments are meant to split
  FA4CPP_LIBRARY="$bin/libfa4.so" PYTHONPATH="$(peer_path)" PYTHONUNBUFFERED=1 \
    timeout "${FA4_DECODE_TIMEOUT:-420}" python3 "$root/bench/decode.py" \
    --sha "${FA4_GIT_SHA:-unknown}" --out "$out" ${FA4_DECODE_ARGS:-} >"$out/decode.log" 2>&1
  note decode "rc $? (*_decode.md; log in decode.log)"
  if [ -n "${OUT:-}" ]; then cp "$out"/*_decode.* "$OUT/" 2>/dev/null; fi
}
# An engine's decode loop (bench/decode_loop.py: tokens/s beside FlashAttention-3, eager and CUDA
# graph; needs transformers); FA4_DECODE_LOOP_ARGS adds options, FA4_DECODE_LOOP_TIMEOUT its time
# limit (default 300 s).
run_decode_loop() {
  fa3_ready
  # shellcheck disable=SC2086  # the arguments are meant to split
  FA4CPP_LIBRARY="$bin/libfa4.so" PYTHONPATH="$(peer_path)" PYTHONUNBUFFERED=1 \
    timeout "${FA4_DECODE_LOOP_TIMEOUT:-300}" python3 "$root/bench/decode_loop.py" \
    --sha "${FA4_GIT_SHA:-unknown}" --out "$out" ${FA4_DECODE_LOOP_ARGS:-} \
    >"$out/decode_loop.log" 2>&1
  note decode_loop "rc $? (*_decode_loop.md; log in decode_loop.log)"
  if [ -n "${OUT:-}" ]; then cp "$out"/*_decode_loop.* "$OUT/" 2>/dev/null; fi
}
run_bench_bwd() { run_bench_pass bwd; }
run_bench_fwdbwd() { run_bench_pass fwdbwd; }

if smoke_ok; then
  for step in "${steps[@]}"; do "run_$step"; done
else
  note "" "smoke test failed: later steps skipped (smoke.log)"
  tail -n 40 "$out/smoke.log"
fi

fa3_ready
{
  echo "==== fa4cpp gpu_check ===="
  printf '%s\n' "${summary[@]}"
  [ -f "$out/bench.txt" ] && cat "$out/bench.txt"
  [ -s "$out/tests_failed.txt" ] && { echo "-- failed tests:"; cat "$out/tests_failed.txt"; }
} | tee "$out/summary.txt"
if [ -n "${OUT:-}" ]; then
  cp "$out/summary.txt" "$OUT/summary.txt"
  tar czf "$OUT/gpu_check_logs.tgz" -C "$out" .
fi
exit 0
