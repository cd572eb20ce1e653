// fa4cpp launch-plan overrides, for tools and tests.
//
// The library plans every launch itself (tile variant, schedule, splits, order, ...), from the
// problem and the device. Tests force each choice, so that every path runs on small problems, and
// measurements time one choice against another; they pass an `Overrides` to the entry points
// below. A default-constructed Overrides leaves every choice to the library, exactly as the plain
// entry points of attention.hpp do. Nothing in the library reads the environment:
// `overrides_from_env()` is the one reader, called by the tools and tests that want it.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4 {

// A forced yes / no, or the library's own choice.
enum class Choice : int { kAuto = -1, kOff = 0, kOn = 1 };

struct Overrides {
  // sm90 forward.
  Choice persistent = Choice::kAuto;  // persistent CTAs (on) or one CTA per tile (off)
  int persistent_ctas = 0;            // > 0: that many persistent CTAs (else one per SM)
  // > 0: the persistent CTAs' zig-zag numbered in groups of this many (head, batch entry) pairs.
  int zigzag_group = 0;
  Choice pack_gqa = Choice::kAuto;    // the query heads of a kv head share a query tile
  int splits = 0;                     // > 0: each tile's keys split this many ways (1: never split)
  Choice longest_first = Choice::kAuto;  // a varlen batch's tiles ordered longest-first
  Choice chunked_kv = Choice::kAuto;     // the chunked kernel, where the head dims have one
  // sm90 backward.
  int bwd_group = 0;                  // > 0: CTAs of this many (head, batch) pairs run together
  Choice bwd_rotate = Choice::kAuto;  // kOff: key tiles walk the query tiles from the first
  Choice bwd_pairs = Choice::kAuto;   // kOff: no key-tile pairs
  // CPU backend.
  int cpu_threads = 0;                // > 0: this many threads (else every hardware thread)
  // sm90 forward, after the fields above so that their positional initialisers keep their meaning.
  Choice narrow = Choice::kAuto;  // the narrow (one consumer warpgroup) kernel, where there is one
  Choice unmasked = Choice::kAuto;  // the unmasked (wider key tiles) kernel, where there is one
};

// The overrides named by environment variables (docs/developing.md lists them):
// FA4_SM90_SCHEDULE=persistent|per_tile, FA4_SM90_PERSISTENT_CTAS=n, FA4_SM90_ZIGZAG_GROUP=g,
// FA4_SM90_PACK_GQA=1|0, FA4_SM90_SPLITS=n, FA4_SM90_TILE_ORDER=longest|input,
// FA4_SM90_CHUNKED_KV=on|off, FA4_SM90_NARROW=on|off, FA4_SM90_UNMASKED=on|off,
// FA4_SM90_BWD_GROUP=n,
// FA4_SM90_BWD_ROTATE=on|off, FA4_SM90_BWD_PAIRS=on|off, FA4_CPU_THREADS=n. Unset variables leave
// their choice to the library; a value outside these is kInvalidArgument naming the variable, and
// *overrides is left unchanged.
FA4_API Status overrides_from_env(Overrides* overrides);

// The entry points of attention.hpp with overrides. Overrides that do not apply to the problem or
// the backend are ignored; out-of-range values (a negative count) are kInvalidArgument.
FA4_API Status workspace_size(const Problem& problem, Backend backend, Pass pass,
                              const Overrides& overrides, size_t* bytes);
FA4_API Status forward(const Problem& problem, const ForwardTensors& tensors, Workspace workspace,
                       void* stream, Backend backend, const Overrides& overrides);
FA4_API Status backward(const Problem& problem, const BackwardTensors& tensors,
                        Workspace workspace, void* stream, Backend backend,
                        const Overrides& overrides);

}  // namespace fa4
