// Whether a paged KV cache's pages hold whole key tiles: then each key tile of a sequence lies in
// one page and the forward loads it with one TMA box; otherwise the producer warpgroup gathers its
// rows through the page table (fwd_load.cuh). Host code (the plan, the launcher) decides with it.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// Pages of a multiple of `block_n` keys, each sequence starting at the first row of its first
// page (no left pad); true for caches that are not paged.
inline bool pages_hold_key_tiles(const Problem& p, int64_t block_n) {
  const KvCache& c = p.kv_cache;
  return !c.paged() || (block_n > 0 && c.page_size % block_n == 0 && c.leftpad == nullptr);
}

}  // namespace fa4::sm90
