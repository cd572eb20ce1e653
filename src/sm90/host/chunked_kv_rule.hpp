// Whether the forward takes a head dim's chunked kernel, where it has one (fwd_config.cuh,
// FwdChunkedTileSize): wider key tiles pay only when nothing but the sequence end cuts them and
// the sequences are long, since each tile's first QKᵀ and last P·V are exposed for longer.
#pragma once

#include <cstdint>

#include "fa4/attention.hpp"

namespace fa4::sm90 {

// banded: a causal or window band cuts the key tiles. min_keys: the variant's kMinKeys, compared
// with the keys per sequence (the mean over a varlen batch; seqlen_k, their bound, with
// seqused_k). forced: FA4_SM90_CHUNKED_KV as env_switch reads it (1 on, 0 off, -1 the rule).
inline bool takes_chunked_kv(const Problem& p, bool banded, int64_t min_keys, int forced) {
  if (forced >= 0) return forced == 1;
  if (banded || p.batch <= 0) return false;
  const int64_t keys = p.is_varlen() ? p.varlen.total_k / p.batch : p.seqlen_k;
  return keys >= min_keys;
}

}  // namespace fa4::sm90
