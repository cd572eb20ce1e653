// The sm90 forward kernel against the double reference (docs/testing.md's rule), on device copies
// of the test utilities' inputs: the (sq, sk) pairs of that rule, causal or not, GQA 1/4/8, sliding windows,
// softcap, contiguous / head-major / packed-qkv inputs, normal and spiky values; varlen batches
// (empty, single-token and tile-edge sequences, lens_q ≠ lens_k both ways, decode-like) and
// seqused_k, fixed-length and varlen, with every input row no query may read set to NaN; outputs
// poisoned (NaN) before every run, guard bytes around them. Every built bf16 / fp16 kernel (head
// dims 64 … 256, 192x128) gets a share; head dim 128 bf16 gets the full matrix (e4m3 kernels:
// test_sm90_fp8.cpp). Plus: a repeated run (and a
// CUDA-graph replay) must give bitwise-identical results, and problems without a kernel must be
// refused.
#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <ostream>
#include <string>
#include <vector>

#include "common/numeric.hpp"
#include "common/test_util.hpp"
#include "device_buffer.hpp"
#include "sm90/fwd/fwd_tile_shape.hpp"
#include "sm90_test_support.hpp"

namespace fa4::test {
namespace {

bool is_built(int64_t dim_qk, int64_t dim_v, DType dtype) {
  return kernel_listed(built_kernels(), dim_qk, dim_v, dtype);
}

struct Heads {
  int64_t q, kv;
};
constexpr Heads kGqa[] = {{4, 4}, {8, 2}, {8, 1}};  // ratios 1, 4, 8

// Packed qkv slices one token row into q, k and v heads of one width: only for dim_qk == dim_v.
bool packable(const Kernel& k) { return k.dim_qk == k.dim_v; }

// ---- Fixed-length shapes: docs/testing.md's (sq, sk) pairs and a few more.

// The forward matrix in full: the d128 bf16 kernel, and d64 bf16 while its three-warpgroup
// structure is new (192-row query tiles).
bool tested_in_full(const Kernel& k) {
  return is_full_kernel(k) || (k.dim_qk == 64 && k.dim_v == 64 && k.dtype == DType::kBF16);
}

std::vector<Case> fixed_cases(const Kernel& k) {
  static const Shape kShapes[] = {
      {"q1_k1", 2, 1, 1},         {"q1_k4096", 1, 1, 4096},  {"q113_k203", 2, 113, 203},
      {"q128_k217", 1, 128, 217}, {"q512_k256", 1, 512, 256}, {"q2048_k1", 1, 2048, 1},
      {"q203_k113", 2, 203, 113}, {"q300_k300", 2, 300, 300}, {"q1000_k1500", 1, 1000, 1500},
  };
  const bool full = tested_in_full(k);
  std::vector<Case> cases;
  int rotation = 0;
  for (const Shape& s : kShapes) {
    // q203 under the causal diagonal: a short first tile of 75 rows, whose first 64-row slice
    // goes out in one box and its second row by row (FwdEpilogue::store_own_o at d64, d96, d128).
    if (!full && std::string(s.tag) != "q113_k203" && std::string(s.tag) != "q512_k256" &&
        std::string(s.tag) != "q1_k4096" && std::string(s.tag) != "q300_k300" &&
        std::string(s.tag) != "q203_k113")
      continue;
    for (bool causal : {false, true}) {
      Case c = base_case(k, s);
      const int r = rotation++;
      c.causal = causal;
      c.heads_q = kGqa[r % 3].q;
      c.heads_kv = kGqa[r % 3].kv;
      c.spiky = r % 2 == 1;
      if (s.sq == s.sk && r % 3 != 1 && packable(k)) {
        c.packed_qkv = true;
      } else {
        c.layout = r % 3 == 2 ? Layout::kHeadMajor : Layout::kContiguous;
      }
      c.name = kernel_tag(k) + "_" + s.tag + (causal ? "_causal" : "") + gqa_tag(c) +
               (c.packed_qkv ? "_packed" : "") +
               (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "");
      cases.push_back(c);
    }
  }
  // Band and score variants on shapes whose tiles the band cuts in several ways.
  struct Variant {
    const char* tag;
    Shape shape;
    Window window;
    float softcap, scale;
  };
  const Variant variants[] = {
      {"window100_20", {"", 2, 113, 203}, {100, 20}, 0.0f, 0.0f},
      {"window300_0", {"", 1, 1000, 1500}, {300, 0}, 0.0f, 0.0f},
      {"windowleft64", {"", 1, 512, 256}, {64, -1}, 0.0f, 0.0f},
      {"softcap30", {"", 1, 128, 217}, {-1, -1}, 30.0f, 0.0f},
      {"softcap5_scale2", {"", 2, 300, 300}, {-1, -1}, 5.0f, 2.0f},
      {"scale0_5", {"", 2, 113, 203}, {-1, -1}, 0.0f, 0.5f},
  };
  for (const Variant& v : variants) {
    if (!full && std::string(v.tag) != "softcap5_scale2" && std::string(v.tag) != "window100_20")
      continue;
    Case c = base_case(k, v.shape);
    c.window = v.window;
    c.softcap = v.softcap;
    c.scale = v.scale;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.spiky = true;
    c.name = kernel_tag(k) + "_" + v.tag;
    cases.push_back(c);
  }
  return cases;
}

// ---- Varlen batches and seqused_k. Every sequence is a separate problem packed into one token
// axis: lengths of 0 and 1, odd ones, lengths around multiples of the 128-row query tile and of the
// key tile (128 for d ≤ 128, 64 for d256; 64..128 in steps of 16 assumed for the others), and
// lens_q ≠ lens_k both ways, with causal and window masks aligned to each sequence's bottom-right
// corner (moved by seqused_k). Key rows past seqused_k and rows past the last sequence hold NaN
// (poison_unused_rows).

struct VarlenShape {
  const char* tag;
  std::vector<int32_t> lens_q, lens_k, used_k;
};

Case varlen_case(const Kernel& k, const VarlenShape& s) {
  Case c = base_case(k, {"", 0, 0, 0});
  c.lens_q = s.lens_q;
  c.lens_k = s.lens_k;
  c.seqused_k = s.used_k;
  return c;
}

// The full kernel's varlen matrix: mask {none, causal, window, softcap} × GQA {1, 4, 8} × input
// {normal, spiky}, the length sets rotating so that each meets every mask kind.
std::vector<Case> varlen_matrix(const Kernel& k) {
  static const VarlenShape kSets[] = {
      {"odd", {177, 366, 479}, {257, 0, 766}, {}},
      {"tiles", {127, 128, 129, 255, 256, 257}, {129, 128, 127, 257, 256, 255}, {}},
      // Empty queries before keys, one-by-one, queries without keys, trailing empty sequence.
      {"short", {0, 1, 1, 64, 2, 33, 0}, {5, 1, 300, 0, 129, 130, 0}, {}},
      {"q_longer", {300, 513, 65, 129}, {100, 191, 1, 128}, {}},
      {"k_longer", {63, 64, 65, 200}, {640, 1000, 1025, 383}, {}},
      {"self", {177, 0, 383, 1, 128, 257}, {177, 0, 383, 1, 128, 257}, {}},
  };
  constexpr size_t kSetCount = std::size(kSets);
  // Windows relative to each sequence's diagonal: a band, the diagonal alone, left only, right
  // only, a long causal-like band, a wide right side.
  static const Window kWindows[] = {{100, 20}, {0, 0}, {64, -1}, {-1, 7}, {200, 0}, {17, 130}};
  enum Mask { kNone, kCausal, kWindow, kSoftcap };
  static const char* const kMaskTags[] = {"nomask", "causal", "window", "softcap"};

  std::vector<Case> cases;
  int rotation = 0;
  for (int mask : {kNone, kCausal, kWindow, kSoftcap})
    for (int g = 0; g < 3; ++g)
      for (int spiky = 0; spiky < 2; ++spiky) {
        const int turn = g * 2 + spiky;
        const VarlenShape& set = kSets[size_t(turn + mask) % kSetCount];
        Case c = varlen_case(k, set);
        c.heads_q = kGqa[g].q;
        c.heads_kv = kGqa[g].kv;
        c.spiky = spiky == 1;
        std::string mask_tag = kMaskTags[mask];
        if (mask == kCausal) c.causal = true;
        if (mask == kWindow) {
          c.window = kWindows[size_t(turn)];
          mask_tag += window_tag(c.window);
        }
        if (mask == kSoftcap) {
          c.softcap = spiky ? 5.0f : 30.0f;
          c.causal = g == 1;
          mask_tag += std::to_string(int(c.softcap)) + (c.causal ? "_causal" : "");
        }
        const int r = rotation++;
        if (r % 3 == 2 && set.lens_q == set.lens_k && packable(k)) {
          c.packed_qkv = true;
        } else if (r % 3 == 1) {
          c.layout = Layout::kHeadMajor;
        }
        c.name = kernel_tag(k) + "_varlen_" + set.tag + "_" + mask_tag + gqa_tag(c) +
                 (c.packed_qkv ? "_packed" : "") +
                 (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "");
        cases.push_back(c);
      }
  return cases;
}

// Decode-like batches: one query per sequence against up to ~3000 keys, GQA 8.
std::vector<Case> decode_cases(const Kernel& k) {
  const std::vector<int32_t> lens_k = {1, 17, 127, 128, 129, 255, 256, 257, 1000, 2048, 2999, 0};
  std::vector<Case> cases;
  for (bool used : {false, true}) {
    Case c = varlen_case(
        k, {"", std::vector<int32_t>(lens_k.size(), 1), lens_k,
            used ? std::vector<int32_t>{1, 0, 64, 128, 100, 255, 1, 200, 999, 2048, 1500, 0}
                 : std::vector<int32_t>{}});
    c.heads_q = 32;
    c.heads_kv = 4;
    c.causal = used;  // one query, bottom-right aligned: it sees every used key either way
    c.spiky = used;
    c.name = kernel_tag(k) + "_varlen_decode_q1" + (used ? "_seqused_causal" : "") + gqa_tag(c);
    cases.push_back(c);
  }
  // Few tiles and many keys: the launcher shares each tile's keys out among CTAs (split_kv.cuh),
  // here into about 11-20 splits: decode with GQA, and four causal query rows (speculative
  // decoding), whose rows see different keys of the last split.
  Case few = base_case(k, {"", 2, 1, 5000});
  few.heads_q = 16;
  few.heads_kv = 2;
  few.spiky = true;
  few.name = kernel_tag(k) + "_q1_k5000_split" + gqa_tag(few) + "_spiky";
  cases.push_back(few);
  Case rows4 = base_case(k, {"", 1, 4, 3000});
  rows4.heads_q = rows4.heads_kv = 8;
  rows4.causal = true;
  rows4.name = kernel_tag(k) + "_q4_k3000_causal_split" + gqa_tag(rows4);
  cases.push_back(rows4);
  // One sequence of one kv head over 20k keys: one packed tile in 78 splits (d256: 128), so that
  // the combine shares each row's splits out among 8 warps (the cases above take 2 and 4).
  Case one = base_case(k, {"", 1, 1, 20000});
  one.heads_q = 8;
  one.heads_kv = 1;
  one.spiky = true;
  one.name = kernel_tag(k) + "_q1_k20000_split" + gqa_tag(one) + "_spiky";
  cases.push_back(one);
  return cases;
}

// seqused_k of 0, 1, the full length and values in between, fixed-length and varlen, with the
// masks it moves (causal, window) and without.
std::vector<Case> seqused_cases(const Kernel& k) {
  struct Used {
    const char* tag;
    Shape shape;                     // fixed-length when lens are empty
    std::vector<int32_t> lens_q, lens_k, used;
    bool causal;
    Window window;
  };
  const std::vector<int32_t> lq = {150, 64, 1, 257, 100, 0, 129};
  const std::vector<int32_t> lk = {300, 64, 500, 256, 0, 10, 128};
  const std::vector<int32_t> uk = {0, 64, 1, 129, 0, 10, 127};
  const Used kUsed[] = {
      {"fixed_q200_k300_used", {"", 5, 200, 300}, {}, {}, {0, 1, 300, 150, 129}, false, {}},
      {"fixed_q200_k300_used_causal", {"", 5, 200, 300}, {}, {}, {0, 1, 300, 150, 129}, true, {}},
      {"fixed_q200_k300_used_windowL50R10", {"", 5, 200, 300}, {}, {}, {300, 150, 0, 1, 129},
       false, {50, 10}},
      {"fixed_q257_k129_used_causal", {"", 3, 257, 129}, {}, {}, {129, 64, 1}, true, {}},
      {"fixed_decode_q1_k3000_used", {"", 8, 1, 3000}, {}, {},
       {0, 1, 128, 129, 3000, 2999, 1024, 700}, false, {}},
      {"varlen_used", {}, lq, lk, uk, false, {}},
      {"varlen_used_causal", {}, lq, lk, uk, true, {}},
      {"varlen_used_windowL30R0", {}, lq, lk, uk, false, {30, 0}},
      {"varlen_used_windowR16", {}, lq, lk, uk, false, {-1, 16}},
  };
  std::vector<Case> cases;
  int rotation = 0;
  for (const Used& u : kUsed) {
    Case c = u.lens_q.empty() ? base_case(k, u.shape)
                              : varlen_case(k, {"", u.lens_q, u.lens_k, {}});
    c.seqused_k = u.used;
    c.causal = u.causal;
    c.window = u.window;
    const int r = rotation++;
    const bool decode = u.shape.sq == 1;
    c.heads_q = decode ? 32 : kGqa[r % 3].q;
    c.heads_kv = decode ? 4 : kGqa[r % 3].kv;
    c.spiky = r % 2 == 0;
    if (r % 4 == 3) c.layout = Layout::kHeadMajor;
    c.name = kernel_tag(k) + "_" + u.tag + gqa_tag(c) +
             (c.layout == Layout::kHeadMajor ? "_headmajor" : "") + (c.spiky ? "_spiky" : "");
    cases.push_back(c);
  }
  return cases;
}

// The other kernels: lengths around their key tiles, one causal varlen batch, one with seqused_k
// and a window, one fixed-length batch with seqused_k.
std::vector<Case> other_kernel_varlen_cases(const Kernel& k) {
  std::vector<Case> cases;
  Case causal =
      varlen_case(k, {"", {65, 127, 1, 200, 96, 33, 0}, {63, 129, 81, 193, 112, 145, 7}, {}});
  causal.causal = true;
  causal.heads_q = 8;
  causal.heads_kv = 2;
  causal.spiky = true;
  causal.name = kernel_tag(k) + "_varlen_ktiles_causal" + gqa_tag(causal) + "_spiky";
  cases.push_back(causal);

  Case used = varlen_case(k, {"", {64, 100, 1, 130, 17, 250}, {192, 160, 97, 224, 0, 80},
                              {64, 159, 96, 113, 0, 80}});
  used.window = {40, 8};
  used.heads_q = 4;
  used.heads_kv = 4;
  used.layout = Layout::kHeadMajor;
  used.name = kernel_tag(k) + "_varlen_ktiles_used_windowL40R8" + gqa_tag(used) + "_headmajor";
  cases.push_back(used);

  Case fixed = base_case(k, {"", 4, 177, 241});
  fixed.seqused_k = {241, 0, 1, 144};
  fixed.causal = true;
  fixed.heads_q = 8;
  fixed.heads_kv = 1;
  fixed.spiky = true;
  fixed.name = kernel_tag(k) + "_fixed_q177_k241_used_causal" + gqa_tag(fixed) + "_spiky";
  cases.push_back(fixed);
  return cases;
}

// GQA ratios 7 (odd: the packed rows' divisions are not shifts) and 64/8 on short query
// sequences, which the launcher packs (query_rows.cuh: G heads share a query tile), with the
// masks read through the rows' positions; and one longer causal shape, q300, which it packs
// too (its positions fill 78 % of the 128-row tiles' rows, packed 97 %; a shape left unpacked is
// on wip/fwd-q-release-keyless). scripts/gpu_check.sh reruns them all with FA4_SM90_PACK_GQA=1.
// The full kernel gets all, the others the first two.
std::vector<Case> gqa_ratio_cases(const Kernel& k) {
  std::vector<Case> cases;
  Case decode = varlen_case(k, {"", {1, 1, 0, 1, 1}, {1, 300, 5, 0, 2049}, {}});
  decode.heads_q = 14;
  decode.heads_kv = 2;
  decode.spiky = true;
  decode.name = kernel_tag(k) + "_varlen_decode_q1" + gqa_tag(decode) + "_spiky";
  cases.push_back(decode);

  Case chunk = varlen_case(k, {"", {5, 0, 17, 1, 40, 19}, {300, 10, 17, 2000, 41, 0}, {}});
  chunk.causal = true;
  chunk.heads_q = 14;
  chunk.heads_kv = 2;
  chunk.layout = Layout::kHeadMajor;
  chunk.name = kernel_tag(k) + "_varlen_chunks_causal" + gqa_tag(chunk) + "_headmajor";
  cases.push_back(chunk);
  if (!tested_in_full(k)) return cases;

  Case window = base_case(k, {"", 3, 3, 700});
  window.window = {40, 0};
  window.softcap = 20.0f;
  window.heads_q = 7;
  window.heads_kv = 1;
  window.name = kernel_tag(k) + "_q3_k700_windowL40R0_softcap20" + gqa_tag(window);
  cases.push_back(window);

  Case wide = base_case(k, {"", 2, 16, 1000});
  wide.causal = true;
  wide.heads_q = 64;
  wide.heads_kv = 8;
  wide.spiky = true;
  wide.name = kernel_tag(k) + "_q16_k1000_causal_h64_" + gqa_tag(wide).substr(1) + "_spiky";
  cases.push_back(wide);

  Case longer = base_case(k, {"", 2, 300, 333});
  longer.causal = true;
  longer.heads_q = 14;
  longer.heads_kv = 2;
  longer.name = kernel_tag(k) + "_q300_k333_causal" + gqa_tag(longer);
  cases.push_back(longer);

  // Long enough that the launcher does not pack it (query_rows.cuh): G = 7 on unpacked tiles.
  Case unpacked = base_case(k, {"", 1, 1000, 1100});
  unpacked.causal = true;
  unpacked.heads_q = 14;
  unpacked.heads_kv = 2;
  unpacked.name = kernel_tag(k) + "_q1000_k1100_causal" + gqa_tag(unpacked);
  cases.push_back(unpacked);

  // More query heads than a tile has rows: one packed position spans two tiles.
  Case many = base_case(k, {"", 2, 3, 200});
  many.heads_q = 256;
  many.heads_kv = 1;
  many.name = kernel_tag(k) + "_q3_k200" + gqa_tag(many);
  cases.push_back(many);
  return cases;
}

// The score variants (ALiBi, sinks) over a share of a kernel's fixed-length cases and its decode
// cases (pack-GQA and split-KV, whose combine joins the sinks): sinks, ALiBi per head, both with
// ALiBi per (batch, head), in turn.
std::vector<Case> variant_cases(const Kernel& k) {
  std::vector<Case> from = fixed_cases(k);
  if (tested_in_full(k)) {
    const std::vector<Case> decode = decode_cases(k);
    from.insert(from.end(), decode.begin(), decode.end());
  }
  std::vector<Case> cases;
  for (size_t n = 0; n < from.size(); n += 3) cases.push_back(with_variant(from[n], n / 3));
  return cases;
}

// The problems the plan gives the unmasked kernel of its own accord (fwd_tile_shape.hpp: no
// causal or window mask, no ALiBi, query rows that fill a tile, at least min_keys keys per
// sequence): last key tiles cut short, GQA with softcap, sinks with head-major inputs, seqused_k
// (0, 1 and the full length), a varlen batch with empty and one-row sequences, split-KV. The
// plan paths below force it onto the other cases, masks included.
std::vector<Case> unmasked_cases(const Kernel& k) {
  if (!sm90::fwd_tile_shape(int(k.dim_qk), int(k.dim_v)).has_unmasked()) return {};
  std::vector<Case> cases;
  Case ragged = base_case(k, {"", 2, 300, 8300});
  ragged.heads_q = ragged.heads_kv = 4;
  ragged.spiky = true;
  ragged.name = kernel_tag(k) + "_q300_k8300_unmasked" + gqa_tag(ragged) + "_spiky";
  cases.push_back(ragged);

  Case softcap = base_case(k, {"", 1, 128, 8192});
  softcap.heads_q = 8;
  softcap.heads_kv = 2;
  softcap.softcap = 20.0f;
  softcap.name = kernel_tag(k) + "_q128_k8192_unmasked_softcap20" + gqa_tag(softcap);
  cases.push_back(softcap);

  Case sinks = base_case(k, {"", 2, 200, 8500});
  sinks.heads_q = 8;
  sinks.heads_kv = 1;
  sinks.sinks = true;
  sinks.layout = Layout::kHeadMajor;
  sinks.name = kernel_tag(k) + "_q200_k8500_unmasked" + gqa_tag(sinks) + "_sinks_headmajor";
  cases.push_back(sinks);

  Case used = base_case(k, {"", 3, 160, 8400});
  used.seqused_k = {8400, 1, 0};
  used.heads_q = used.heads_kv = 2;
  used.spiky = true;
  used.name = kernel_tag(k) + "_q160_k8400_used_unmasked" + gqa_tag(used) + "_spiky";
  cases.push_back(used);

  Case batch = varlen_case(k, {"", {0, 1, 300, 129, 0}, {9000, 9500, 8200, 14300, 0}, {}});
  batch.heads_q = 8;
  batch.heads_kv = 2;
  batch.name = kernel_tag(k) + "_varlen_unmasked" + gqa_tag(batch);
  cases.push_back(batch);

  // Two tiles of 20k keys: split among CTAs, each split's last tile cut by its end.
  Case split = base_case(k, {"", 1, 128, 20000});
  split.heads_q = split.heads_kv = 2;
  split.spiky = true;
  split.name = kernel_tag(k) + "_q128_k20000_split_unmasked" + gqa_tag(split) + "_spiky";
  cases.push_back(split);
  return cases;
}

// The full matrix for the full kernel (head dim 128, bf16, when built); a smaller one for the
// others.
std::vector<Case> forward_cases() {
  std::vector<Case> cases;
  auto append = [&](std::vector<Case> more) {
    cases.insert(cases.end(), more.begin(), more.end());
  };
  for (const Kernel& k : built_16bit_kernels()) {
    append(fixed_cases(k));
    append(gqa_ratio_cases(k));
    append(variant_cases(k));
    if (tested_in_full(k)) {
      append(varlen_matrix(k));
      append(decode_cases(k));
      append(seqused_cases(k));
      append(unmasked_cases(k));
    } else {
      append(other_kernel_varlen_cases(k));
    }
  }
  return cases;
}

void check_forward(const Case& c, const std::vector<ref::RowSample>& sample = {},
                   const Overrides& overrides = test_overrides()) {
  FA4_SKIP_WITHOUT_HOPPER();
  SCOPED_TRACE(seed_note());
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  poison_unused_rows(*setup);
  const Problem& p = setup->problem;
  DeviceRun run(*setup);
  run.overrides = overrides;
  std::vector<unsigned char> rows;
  run_and_check_writes(run, &rows);
  if (::testing::Test::HasFatalFailure()) return;

  const TensorView q = setup->q.view(), k = setup->k.view(), v = setup->v.view();
  const ref::ForwardResult exact = ref::forward(p, q, k, v, ref::Precision::kExact, sample);
  const ref::ForwardResult lp = ref::forward(p, q, k, v, ref::Precision::kLowPrecision, sample);
  const FlashRule rule = flash_rule(p, Pass::kForward);
  const int64_t rows_checked =
      sample.empty() ? std::count(rows.begin(), rows.end(), 1) * p.heads_q : int64_t(sample.size());

  const double max_out = max_finite_abs(exact.out);
  const double score_abs_max = max_finite_abs(exact.score_abs);
  const CheckResult o = check_flash_rule("out", tensor_shape(run.out.dims()), run.out.dense(),
                                         exact.out, lp.out, rule.multiplier,
                                         rule.atol + alibi_slack(p, max_out, score_abs_max));
  EXPECT_TRUE(o.ok) << o.message;
  EXPECT_EQ(o.compared, rows_checked * p.head_dim_v) << "reference rows missing";
  // LSE ≈ the row's largest scaled score, which spiky inputs push to |LSE| ≈ 100, where the rule's
  // atol (1e-5) is about one fp32 ulp. The kernel reaches LSE through a few fp32 roundings the lp
  // reference does not share (tensor-core accumulation of the scores, the scale FFMA, the log2 →
  // ln conversion, the final add), each up to half an ulp of |LSE|: allow kLseUlps ulps of the
  // largest |LSE| on top of the rule.
  constexpr double kLseUlps = 4.0;
  const double max_lse = max_finite_abs(exact.lse);
  const double lse_atol = rule.atol + kLseUlps * std::numeric_limits<float>::epsilon() * max_lse +
                          alibi_slack(p, 1.0, score_abs_max);
  const CheckResult l = check_flash_rule("lse", lse_shape(p), run.lse.dense(), exact.lse, lp.lse,
                                         rule.multiplier, lse_atol);
  EXPECT_TRUE(l.ok) << l.message;
  EXPECT_EQ(l.compared, rows_checked) << "reference rows missing";
}

class Sm90Forward : public ::testing::TestWithParam<Case> {};

TEST_P(Sm90Forward, MatchesReference) { check_forward(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Matrix, Sm90Forward, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<Case>& info) { return info.param.name; });

// Each launch-plan path forced through Overrides on a few cases of every mask and layout, so that
// the default test run covers them (scripts/gpu_check.sh reruns the whole matrix under each, through
// the FA4_SM90_* variables).
struct PlanPath {
  const char* name;
  Overrides overrides;
};
// GoogleTest prints a parameter by its name, not its bytes.
void PrintTo(const PlanPath& path, std::ostream* os) { *os << path.name; }

std::vector<PlanPath> plan_paths() {
  auto with = [](auto set) {
    Overrides o;
    set(o);
    return o;
  };
  // Every schedule choice forced at once; the "everything" paths add a kernel variant on top.
  auto all_schedules = [](Overrides& o) {
    o.persistent = Choice::kOn;
    o.persistent_ctas = 2;
    o.pack_gqa = Choice::kOn;
    o.longest_first = Choice::kOn;
    o.splits = 3;
  };
  // The unmasked kernel wherever keys load as whole tiles: decode too, which the narrow kernel
  // would take first.
  auto unmasked_everywhere = [](Overrides& o) {
    o.unmasked = Choice::kOn;
    o.narrow = Choice::kOff;
  };
  return {
      {"persistent_3ctas", with([](Overrides& o) {
         o.persistent = Choice::kOn;
         o.persistent_ctas = 3;
       })},
      {"persistent_3ctas_zigzag2", with([](Overrides& o) {
         o.persistent = Choice::kOn;
         o.persistent_ctas = 3;
         o.zigzag_group = 2;
       })},
      {"per_tile", with([](Overrides& o) { o.persistent = Choice::kOff; })},
      {"packed", with([](Overrides& o) { o.pack_gqa = Choice::kOn; })},
      {"unpacked", with([](Overrides& o) { o.pack_gqa = Choice::kOff; })},
      {"ordered", with([](Overrides& o) { o.longest_first = Choice::kOn; })},
      {"split3", with([](Overrides& o) { o.splits = 3; })},
      {"chunked", with([](Overrides& o) { o.chunked_kv = Choice::kOn; })},
      {"narrow", with([](Overrides& o) { o.narrow = Choice::kOn; })},
      // The unmasked kernel (d128's 176-key tiles) under every mask, decode included.
      {"unmasked", with(unmasked_everywhere)},
      {"unmasked_everything", with([&](Overrides& o) {
         all_schedules(o);
         unmasked_everywhere(o);
       })},
      // Unsplit tiles one after the other on 2 CTAs: O staged in V's ring handed from tile to tile.
      {"narrow_persistent_2ctas", with([](Overrides& o) {
         o.persistent = Choice::kOn;
         o.persistent_ctas = 2;
         o.narrow = Choice::kOn;
       })},
      {"narrow_everything", with([&](Overrides& o) {
         all_schedules(o);
         o.narrow = Choice::kOn;
       })},
      {"everything", with([&](Overrides& o) {
         all_schedules(o);
         o.chunked_kv = Choice::kOn;
       })},
  };
}

// Of the matrix's cases, those whose names end in one of these: causal and windowed GQA tiles,
// varlen batches with empty sequences and seqused_k, decode, and the d256 ones (the chunked kernel).
bool plan_path_case(const Case& c) {
  static const char* const kPicked[] = {"_q113_k203_causal_gqa4", "_varlen_decode_q1_gqa7_spiky",
                                        "_varlen_chunks_causal_gqa7_headmajor",
                                        "_q3_k700_windowL40R0_softcap20_gqa7",
                                        "_q300_k333_causal_gqa7", "_varlen_used_gqa8"};
  for (const char* end : kPicked) {
    const std::string e(end);
    if (c.name.size() >= e.size() && c.name.compare(c.name.size() - e.size(), e.size(), e) == 0)
      return true;
  }
  return false;
}

class Sm90ForwardPlanPath : public ::testing::TestWithParam<PlanPath> {};

TEST_P(Sm90ForwardPlanPath, MatchesReference) {
  int checked = 0;
  for (const Case& c : forward_cases()) {
    if (!plan_path_case(c) && !(c.dim_qk == 256 && c.name.find("_q113_k203") != std::string::npos))
      continue;
    SCOPED_TRACE(c.name);
    check_forward(c, {}, GetParam().overrides);
    if (HasFatalFailure() || IsSkipped()) return;
    ++checked;
  }
  if (checked == 0) GTEST_SKIP() << "none of the picked cases' kernels is built";
}

INSTANTIATE_TEST_SUITE_P(Overrides, Sm90ForwardPlanPath, ::testing::ValuesIn(plan_paths()),
                         [](const ::testing::TestParamInfo<PlanPath>& info) {
                           return std::string(info.param.name);
                         });

// Rows of one (sequence, head) for a sampled check: `picked` (those outside [0, len) dropped) and
// `random` more drawn from rng, each once, in order.
void sample_rows(std::vector<ref::RowSample>& sample, int64_t batch, int64_t head, int64_t len,
                 std::vector<int64_t> picked, int random, std::mt19937_64& rng) {
  std::uniform_int_distribution<int64_t> any_row(0, len - 1);
  for (int n = 0; n < random; ++n) picked.push_back(any_row(rng));
  std::sort(picked.begin(), picked.end());
  picked.erase(std::unique(picked.begin(), picked.end()), picked.end());
  for (int64_t row : picked)
    if (row >= 0 && row < len) sample.push_back({batch, head, row});
}

// A long causal sequence (33 query tiles, 33 key tiles): every tile of the band, many rescales with
// spiky inputs. The reference checks rows at the start, at tile boundaries, at the end, at random.
TEST(Sm90ForwardLong, Seq4224CausalSampledRows) {
  for (const Kernel& k : built_16bit_kernels()) {
    for (bool causal : {true, false}) {
      Case c = base_case(k, {"", 1, 4224, 4224});
      c.name = kernel_tag(k) + "_long_q4224_k4224" + (causal ? "_causal" : "");
      c.heads_q = 8;
      c.heads_kv = 1;
      c.causal = causal;
      c.spiky = true;
      std::mt19937_64 rng = make_rng(c.name + "/rows");
      std::vector<ref::RowSample> sample;
      for (int64_t h = 0; h < c.heads_q; h += 3)
        sample_rows(sample, 0, h, c.seqlen_q,
                    {0, 1, 63, 64, 127, 128, 129, 2111, 2112, 4095, 4096, 4223}, 8, rng);
      SCOPED_TRACE(c.name);
      check_forward(c, sample);
    }
  }
}

// Many more tiles than SMs, fixed lengths: the persistent schedule (one CTA per SM, several tiles
// each, in the zig-zag order of tile_scheduler.cuh), with and without the causal diagonal. Rows
// checked: around query-tile boundaries and at random, in every fifth head of each batch entry.
TEST(Sm90ForwardLong, PersistentManyTilesSampledRows) {
  for (const Kernel& k : built_16bit_kernels()) {
    for (bool causal : {true, false}) {
      Case c = base_case(k, {"", 3, 1000, 1200});
      c.name = kernel_tag(k) + "_persistent_b3_h48_q1000_k1200" + (causal ? "_causal" : "");
      c.heads_q = 48;
      c.heads_kv = 8;
      c.causal = causal;
      std::mt19937_64 rng = make_rng(c.name + "/rows");
      std::vector<ref::RowSample> sample;
      for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t h = b; h < c.heads_q; h += 5)
          sample_rows(sample, b, h, c.seqlen_q, {0, 127, 128, 191, 192, 383, 384, 999}, 3, rng);
      SCOPED_TRACE(c.name);
      check_forward(c, sample);
    }
  }
}

// Long varlen sequences beside short ones, seqused_k cutting the long ones, causal: the tile
// schedule walks many query tiles per sequence. Rows checked: each sequence's first and last, those
// around query-tile boundaries, and random ones.
TEST(Sm90ForwardLong, VarlenSequsedCausalSampledRows) {
  for (const Kernel& k : built_16bit_kernels()) {
    Case c = varlen_case(k, {"", {4224, 1, 2000, 129, 3001}, {4224, 3000, 4100, 0, 2900},
                             {4100, 2999, 4100, 0, 2900}});
    c.name = kernel_tag(k) + "_long_varlen_used_causal";
    c.heads_q = 8;
    c.heads_kv = 2;
    c.causal = true;
    c.spiky = true;
    std::mt19937_64 rng = make_rng(c.name + "/rows");
    std::vector<ref::RowSample> sample;
    for (size_t b = 0; b < c.lens_q.size(); ++b) {
      const int64_t len = c.lens_q[b];
      if (len == 0) continue;
      for (int64_t h = int64_t(b) % 3; h < c.heads_q; h += 3)
        sample_rows(sample, int64_t(b), h, len,
                    {0, 1, 127, 128, 129, 2047, 2048, len - 2, len - 1}, 6, rng);
    }
    SCOPED_TRACE(c.name);
    check_forward(c, sample);
  }
}

// The same inputs must give the same bits: twice directly, and once replayed from a CUDA graph
// (the launch captures without allocating or synchronizing). A difference means a race.
TEST(Sm90Forward, RepeatedRunsAreBitwiseIdentical) {
  FA4_SKIP_WITHOUT_HOPPER();
  std::vector<Case> cases;
  for (const Kernel& k : built_16bit_kernels()) {
    Case c = base_case(k, {"", 2, 1000, 1500});
    c.name = kernel_tag(k) + "_repeat";
    c.causal = true;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.spiky = true;
    cases.push_back(c);
    // Sequences of many lengths: the varlen tile schedule has more ways to race.
    c = varlen_case(k,
                    {"", {177, 0, 1000, 1, 129}, {257, 5, 1500, 0, 128}, {200, 5, 1400, 0, 128}});
    c.name = kernel_tag(k) + "_repeat_varlen_used";
    c.causal = true;
    c.heads_q = 8;
    c.heads_kv = 2;
    c.spiky = true;
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(seed_note());
    SCOPED_TRACE(describe(c));
    std::mt19937_64 rng = make_rng(c.name);
    const std::unique_ptr<CaseData> setup = make_setup(c, rng);
    poison_unused_rows(*setup);
    DeviceRun run(*setup);
    ASSERT_CUDA(run.upload());
    Stream stream;
    std::vector<uint64_t> first_out;
    std::vector<double> first_lse;  // fp32 values widened exactly: equal bits ⇔ equal doubles' bits
    for (int attempt = 0; attempt < 3; ++attempt) {
      Status status;
      ASSERT_CUDA(run.run(stream.get(), /*graph=*/attempt == 2, &status));
      ASSERT_TRUE(status.ok()) << status.message;
      std::vector<uint64_t> out_bits(size_t(run.out.size()));
      for (int64_t i = 0; i < run.out.size(); ++i) out_bits[size_t(i)] = run.out.bits(i);
      const std::vector<double> lse = run.lse.dense();
      if (attempt == 0) {
        first_out = out_bits;
        first_lse = lse;
        continue;
      }
      const char* how = attempt == 2 ? " (CUDA graph replay)" : "";
      EXPECT_TRUE(out_bits == first_out) << "out differs on run " << attempt + 1 << how;
      EXPECT_EQ(std::memcmp(lse.data(), first_lse.data(), lse.size() * sizeof(double)), 0)
          << "lse differs on run " << attempt + 1 << how;
    }
  }
}

// Problems without a kernel get kNotSupported with a reason, never a wrong answer; varlen batches,
// seqused_k and every built kernel's head dims are accepted. These are host-side answers: they
// hold with or without a GPU (without one, accepted problems get kBackendUnavailable).
TEST(Sm90Forward, RefusesWhatItDoesNotImplement) {
  ASSERT_FALSE(built_kernels().empty()) << "FA4_SM90_KERNELS built no forward kernel";
  // A bf16 / fp16 base where the build has one; every built kernel, e4m3 too, is accepted below.
  const Kernel k =
      built_16bit_kernels().empty() ? built_kernels().front() : built_16bit_kernels().front();
  Problem base;
  base.batch = 1;
  base.seqlen_q = base.seqlen_k = 64;
  base.heads_q = base.heads_kv = 2;
  base.head_dim_qk = k.dim_qk;
  base.head_dim_v = k.dim_v;
  base.dtype = k.dtype;

  const Status ok = can_implement(base, Backend::kSm90, Pass::kForward);
  EXPECT_TRUE(ok.ok() || ok.code == StatusCode::kBackendUnavailable) << ok.message;

  // can_implement must not read the arrays (they live in device memory): these are never read.
  int32_t cu[2] = {0, 64};
  int32_t used[1] = {32};
  struct Variant {
    std::string what;
    Problem p;
  };
  std::vector<Variant> accepted;
  accepted.push_back({"varlen", base});
  accepted.back().p.varlen = {cu, cu, 64, 64};
  accepted.push_back({"seqused_k", base});
  accepted.back().p.seqused_k = used;
  accepted.push_back({"varlen with seqused_k", accepted.front().p});
  accepted.back().p.seqused_k = used;
  for (const Kernel& built : built_kernels()) {
    accepted.push_back({"built kernel " + kernel_tag(built), base});
    accepted.back().p.head_dim_qk = built.dim_qk;
    accepted.back().p.head_dim_v = built.dim_v;
    accepted.back().p.dtype = built.dtype;
  }
  for (const Variant& a : accepted) {
    SCOPED_TRACE(a.what);
    const Status s = can_implement(a.p, Backend::kSm90, Pass::kForward);
    EXPECT_EQ(s.code, ok.code) << to_string(s.code) << ": " << s.message;
  }

  std::vector<Variant> refusals;
  refusals.push_back({"fp32", base});
  refusals.back().p.dtype = DType::kFP32;
  refusals.push_back({"fp32 varlen", accepted.front().p});
  refusals.back().p.dtype = DType::kFP32;
  // Head dims no table entry has, and table entries this build may have left out.
  const struct {
    int64_t qk, v;
  } kDims[] = {{32, 32},   {80, 80},   {160, 160}, {128, 64},  {64, 128}, {96, 96},
               {192, 192}, {192, 128}, {256, 128}, {128, 192}, {64, 64},  {128, 128}, {256, 256}};
  for (DType dtype : {DType::kBF16, DType::kFP16})
    for (const auto& d : kDims) {
      if (is_built(d.qk, d.v, dtype)) continue;
      const Kernel missing{d.qk, d.v, dtype};
      refusals.push_back({"no kernel " + kernel_tag(missing), base});
      refusals.back().p.head_dim_qk = d.qk;
      refusals.back().p.head_dim_v = d.v;
      refusals.back().p.dtype = dtype;
    }
  for (const Variant& r : refusals) {
    SCOPED_TRACE(r.what);
    const Status s = can_implement(r.p, Backend::kSm90, Pass::kForward);
    EXPECT_EQ(s.code, StatusCode::kNotSupported) << to_string(s.code) << ": " << s.message;
    EXPECT_FALSE(s.message.empty());
  }
  // What the backward accepts: Sm90Backward.CanImplementAnswers.
}

// Host pointers handed to the GPU backend are refused before any launch.
TEST(Sm90Forward, RefusesHostMemory) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_16bit_kernels().empty()) GTEST_SKIP() << "this build has no bf16 / fp16 sm90 kernel";
  const Kernel k = built_16bit_kernels().front();
  Case c = base_case(k, {"", 1, 64, 64});
  c.name = "host_memory";
  c.heads_q = c.heads_kv = 2;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  HostTensor out(c.dtype, query_dims(setup->problem, 2, k.dim_v));
  HostLse lse = make_lse(setup->problem, false);
  ForwardTensors t;
  t.q = setup->q.view();
  t.k = setup->k.view();
  t.v = setup->v.view();
  t.out = out.view();
  t.lse = lse.view();
  const Status s = forward(setup->problem, t, {}, nullptr, Backend::kSm90, test_overrides());
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument) << s.message;
}

// Device tensors with host cu_seqlens / seqused_k: the kernel would read host memory and fault the
// context, so the call must be refused up front, naming the array, with nothing written.
TEST(Sm90Forward, RefusesHostSequenceArrays) {
  FA4_SKIP_WITHOUT_HOPPER();
  if (built_16bit_kernels().empty()) GTEST_SKIP() << "this build has no bf16 / fp16 sm90 kernel";
  const Kernel k = built_16bit_kernels().front();
  Case c = varlen_case(k, {"", {70, 0, 130}, {90, 5, 140}, {80, 5, 100}});
  c.name = "host_sequence_arrays";
  c.heads_q = c.heads_kv = 2;
  std::mt19937_64 rng = make_rng(c.name);
  const std::unique_ptr<CaseData> setup = make_setup(c, rng);
  DeviceRun run(*setup);
  ASSERT_CUDA(run.upload());
  for (const char* array : {"cu_seqlens_q", "cu_seqlens_k", "seqused_k"}) {
    SCOPED_TRACE(array);
    Problem p = run.problem;  // device arrays, but for the one under test
    const std::string name = array;
    if (name == "cu_seqlens_q") p.varlen.cu_seqlens_q = setup->cu_q.data();
    if (name == "cu_seqlens_k") p.varlen.cu_seqlens_k = setup->cu_k.data();
    if (name == "seqused_k") p.seqused_k = setup->used_k.data();
    expect_refused(run, p, run.workspace.view(), StatusCode::kInvalidArgument, name);
  }
}

}  // namespace
}  // namespace fa4::test
