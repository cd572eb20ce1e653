// The fields of fa4::Overrides, each once: its name in messages, its environment variable (with
// the spellings of a choice), and its place in the C++ and the C struct. Validation, the
// environment reader and the C ABI walk these tables, so that a new override is one row.
#pragma once

#include <cstdint>
#include <iterator>

#include "fa4/fa4.h"
#include "fa4/overrides.hpp"

namespace fa4::detail {

struct ChoiceField {
  const char* name;
  const char* env;
  const char* on;   // the variable's value for Choice::kOn
  const char* off;  // and for Choice::kOff
  Choice Overrides::*member;
  int32_t fa4_overrides::*c_member;
};

struct CountField {
  const char* name;
  const char* env;
  int Overrides::*member;
  int32_t fa4_overrides::*c_member;
};

inline constexpr ChoiceField kChoiceFields[] = {
    {"persistent", "FA4_SM90_SCHEDULE", "persistent", "per_tile", &Overrides::persistent,
     &fa4_overrides::persistent},
    {"pack_gqa", "FA4_SM90_PACK_GQA", "1", "0", &Overrides::pack_gqa, &fa4_overrides::pack_gqa},
    {"longest_first", "FA4_SM90_TILE_ORDER", "longest", "input", &Overrides::longest_first,
     &fa4_overrides::longest_first},
    {"chunked_kv", "FA4_SM90_CHUNKED_KV", "on", "off", &Overrides::chunked_kv,
     &fa4_overrides::chunked_kv},
    {"narrow", "FA4_SM90_NARROW", "on", "off", &Overrides::narrow, &fa4_overrides::narrow},
    {"unmasked", "FA4_SM90_UNMASKED", "on", "off", &Overrides::unmasked,
     &fa4_overrides::unmasked},
    {"bwd_rotate", "FA4_SM90_BWD_ROTATE", "on", "off", &Overrides::bwd_rotate,
     &fa4_overrides::bwd_rotate},
    {"bwd_pairs", "FA4_SM90_BWD_PAIRS", "on", "off", &Overrides::bwd_pairs,
     &fa4_overrides::bwd_pairs},
};

inline constexpr CountField kCountFields[] = {
    {"persistent_ctas", "FA4_SM90_PERSISTENT_CTAS", &Overrides::persistent_ctas,
     &fa4_overrides::persistent_ctas},
    {"zigzag_group", "FA4_SM90_ZIGZAG_GROUP", &Overrides::zigzag_group,
     &fa4_overrides::zigzag_group},
    {"splits", "FA4_SM90_SPLITS", &Overrides::splits, &fa4_overrides::splits},
    {"bwd_group", "FA4_SM90_BWD_GROUP", &Overrides::bwd_group, &fa4_overrides::bwd_group},
    {"cpu_threads", "FA4_CPU_THREADS", &Overrides::cpu_threads, &fa4_overrides::cpu_threads},
};

// Every field of both structs is a row of the tables above.
static_assert(sizeof(Overrides) ==
              sizeof(int) * (std::size(kChoiceFields) + std::size(kCountFields)));
static_assert(sizeof(fa4_overrides) ==
              sizeof(int32_t) * (1 + std::size(kChoiceFields) + std::size(kCountFields)));

}  // namespace fa4::detail
