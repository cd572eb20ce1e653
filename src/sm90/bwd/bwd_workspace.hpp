// The sm90 backward's workspace (caller-owned device memory, workspace_size bytes), shared by the
// host launcher and the kernels. fp32 but for the int32 counters, rows numbered like the packed
// query / key rows unless said otherwise:
//   dq_accum  dQ / scale, summed over key tiles by TMA reduce-adds, in one of the staging's two
//             orders (bwd_dq_reduce.cuh, bwd_dq_fragments.cuh): fragment order, [heads_q][stat
//             rows][dim] (DqFragments: each query tile's block, from the stat row of its first
//             row, holds its warpgroups' accumulator fragments as the registers hold them), or
//             row order, [heads_q][query rows][dim] (each row's 8-column blocks in the
//             staging's order, dq_accum_flip)
//   lse_log2  [heads_q][stat rows]           LSE·log2(e), +inf for a row that sees no key
//   dpsum     [heads_q][stat rows]           D = rowsum(dO ∘ O)
//             both with each 16-row block in the narrow kernel's column order (bwd_stat_slot)
//   dq_done   [batch][heads_q] int32          how many of the main kernel's CTAs of that (batch
//             entry, query head) have had all their dQ reduce-adds land (cleared by the prepare
//             kernel): without a band the dQ finish kernel's rows wait for all of them, not for
//             the whole kernel
//   dk_accum, dv_accum [heads_kv][key rows][dim]   GQA only: summed over a group's query heads
//   deterministic mode only, int32, cleared before the main kernel:
//   dq_turns  [batch][heads_q][query tiles][2]  how many key tiles (per warpgroup's part: half
//             of the head dim, or of the rows) have added their dQ to that query tile so far
//   dkv_turns [batch][heads_kv][key tiles]      GQA: how many query heads have added dK / dV
// Query rows are batch·seqlen_q (fixed length; sequence b starts at b·seqlen_q) or total_q
// (varlen; sequence b starts at cu_seqlens_q[b]); key rows likewise.
// Stat rows are the query rows with each sequence moved to a multiple of kBwdStatAlign and
// followed by its pad, the rows up to its length rounded up to kBwdStatAlign: the main kernel's
// producer fetches a query tile's LSE and D with one aligned bulk copy each (a TMA bulk copy needs
// 16-byte aligned addresses and sizes), and a tile that runs past its sequence's end reads the pad,
// where the prepare kernel wrote LSE +inf and D 0. So the main kernel reads a tile's stats with no
// bounds check: those queries' probabilities and dS come out 0 (their Q and dO rows load as zeros).
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/host_device.hpp"
#include "fa4/attention.hpp"
#include "sm90/bwd/bwd_tile_shape.hpp"

namespace fa4::sm90 {

// Each sequence's stat rows start at a multiple of this, which every bwd_block_m divides.
constexpr int kBwdStatAlign = 128;

// The stat row of row 0 of sequence b, whose rows start at packed query row `start` (b·seqlen_q,
// or cu_seqlens_q[b]): a multiple of A = kBwdStatAlign, with A more per sequence. Sequence b − 1
// (length len = start_b − start_{b−1}) and its pad end no later: since
// ⌊x/A⌋ + ⌈y/A⌉ ≤ ⌊(x + y)/A⌋ + 1, stat_row(b − 1) + padded(len) ≤ (⌊start_b/A⌋ + b)·A.
FA4_HD int64_t bwd_stat_row(int64_t start, int64_t b) {
  return (start + b * kBwdStatAlign) / kBwdStatAlign * kBwdStatAlign;
}

// A sequence's stat rows with its pad: its length rounded up to kBwdStatAlign.
FA4_HD int64_t bwd_padded_stat_rows(int64_t len) {
  return (len + kBwdStatAlign - 1) / kBwdStatAlign * kBwdStatAlign;
}

// Stat rows per head: the last sequence and its pad end before rows + batch·kBwdStatAlign, rounded
// up to a multiple of kBwdStatAlign so that each head's rows start aligned.
FA4_HD int64_t bwd_stat_rows(int64_t q_rows, int64_t batch) {
  return bwd_padded_stat_rows(q_rows + batch * kBwdStatAlign);
}

// Where stat row r's value lies: each block of 16 stat rows is stored in the order the narrow
// kernel reads it. That kernel computes Sᵀ, so a query tile's stats are needed per column, and an
// m64nN accumulator gives thread t (q = t mod 4) columns 2q, 2q + 1, 2q + 8, 2q + 9 of every
// 16-column block; stored at 4q … 4q + 3, they are one 16-byte shared-memory load (two 8-byte ones
// in row order), and the four q of a quarter-warp read 64 contiguous bytes, conflict-free. Row
// r = 16·k + 8·h + 2·q + b goes to 16·k + 4·q + 2·h + b. Blocks start at multiples of 16 (a
// sequence's stat rows start at a multiple of kBwdStatAlign), so a query tile (whose height is a
// multiple of 16) holds the same rows in either order, and a bulk copy of the tile carries them.
template <class Int>
FA4_HD Int bwd_stat_slot(Int r) {
  return (r & ~Int(15)) | (((r >> 1) & 3) << 2) | (((r >> 3) & 1) << 1) | (r & 1);
}

// dq_accum's column order in row order (BwdDqRows). The main kernel stages dQ in shared memory
// for the TMA reduce-add, one 8-byte store per column pair, and the hardware serves a warp's
// 8-byte stores a half-warp at a time: four rows of one 8-column block, 32 bytes each. Under the
// staging's swizzle (16-byte chunk c of row r at c ^ (r mod 8) for 128-byte rows; 64-byte rows:
// c ^ (r / 2 mod 4)) two of those four rows fall on the same banks. So row r (counted from its
// sequence's first row; query tiles start at multiples of 8) stores block b of each group of
// `atom` columns at block b ^ flip, where the flip (in columns) makes the four rows' banks
// distinct; the TMA carries that order into dq_accum and the finish kernel reads column c of row
// r at c ^ dq_accum_flip(r, atom).
// atom: the staging's swizzle width in floats (32: 128-byte, 16: 64-byte); 0: natural order.
FA4_HD int dq_accum_flip(int64_t row, int atom) {
  const int r = int(row & 7);
  if (atom == 32) return (((r & 3) ^ (r >> 1)) & 3) * 8;
  if (atom == 16) return ((r >> 1) & 1) * 8;
  return 0;
}

// dq_accum's fragment order. A query tile of block_m rows is added in parts of 64 rows and
// part_cols columns, one per MMA warpgroup: its two 64-row halves (block_m 128) or its two column
// halves (block_m 64). A part is one m64 wgmma's accumulator, in which thread t (warp w = t / 32,
// lane l) holds value v of row 16w + l/4 + 8·(v/2 mod 2), column 2·(l mod 4) + (v mod 2) + 8·(v/4);
// the staging stores each thread's values 4v'…4v'+3 (v' = v / 4) as 16 bytes at float
// 512·v' + 4t, so that a warp's store covers 512 contiguous bytes. The tile's parts follow one
// another from the stat row of its first row: tile m of a sequence whose stat rows start at S
// (bwd_stat_row) is the dim · block_m floats from (S + m · block_m) · dim. part_cols 0: row order.
struct DqFragments {
  int block_m = 0;
  int part_cols = 0;

  FA4_HD bool enabled() const { return part_cols != 0; }
  // The float of row r (within its tile) and column c, from the tile's first.
  FA4_HD int offset(int r, int c) const {
    const int part = block_m == 128 ? r / 64 : c / part_cols;
    const int i = r % 64, col = c % part_cols;
    const int thread = 32 * (i / 16) + 4 * (i % 8) + col % 8 / 2;
    return part * 64 * part_cols + col / 8 * 512 + 4 * thread + 2 * (i / 8 % 2) + col % 2;
  }
};

struct BwdWorkspace {
  size_t dq_accum = 0, lse_log2 = 0, dpsum = 0, dq_done = 0, dk_accum = 0, dv_accum = 0;  // bytes
  size_t dq_turns = 0, dkv_turns = 0;  // deterministic mode
  size_t bytes = 0;
  int64_t stat_rows = 0;  // per head
  bool gqa = false;

  static BwdWorkspace layout(const Problem& p) {
    constexpr size_t kAlign = 256;
    auto round = [](size_t n) { return (n + kAlign - 1) / kAlign * kAlign; };
    const size_t q_rows = size_t(p.is_varlen() ? p.varlen.total_q : p.batch * p.seqlen_q);
    const size_t k_rows = size_t(p.is_varlen() ? p.varlen.total_k : p.batch * p.seqlen_k);
    const size_t f = sizeof(float);
    BwdWorkspace w;
    w.gqa = p.heads_q != p.heads_kv;
    size_t at = 0;
    w.stat_rows = bwd_stat_rows(int64_t(q_rows), p.batch);
    // In fragment order by stat rows (more than the query rows: a whole 128 per sequence more,
    // at most), else by query rows.
    const size_t dq_rows = bwd_dq_fragments(int(p.head_dim_qk)) ? size_t(w.stat_rows) : q_rows;
    w.dq_accum = at;
    at = round(at + size_t(p.heads_q) * dq_rows * size_t(p.head_dim_qk) * f);
    w.lse_log2 = at;
    at = round(at + size_t(p.heads_q) * size_t(w.stat_rows) * f);
    w.dpsum = at;
    at = round(at + size_t(p.heads_q) * size_t(w.stat_rows) * f);
    w.dq_done = at;
    at = round(at + size_t(p.batch) * size_t(p.heads_q) * sizeof(int32_t));
    if (w.gqa) {
      w.dk_accum = at;
      at = round(at + size_t(p.heads_kv) * k_rows * size_t(p.head_dim_qk) * f);
      w.dv_accum = at;
      at = round(at + size_t(p.heads_kv) * k_rows * size_t(p.head_dim_v) * f);
    }
    if (p.deterministic) {
      const int block_m = bwd_block_m(p.head_dim_qk);
      const size_t m_tiles = size_t((p.seqlen_q + block_m - 1) / block_m);
      const int block_n = bwd_block_n(p.head_dim_qk);
      const size_t n_tiles = size_t((p.seqlen_k + block_n - 1) / block_n);
      const size_t i = sizeof(int32_t);
      w.dq_turns = at;
      at = round(at + size_t(p.batch) * size_t(p.heads_q) * m_tiles * 2 * i);
      w.dkv_turns = at;
      if (w.gqa) at = round(at + size_t(p.batch) * size_t(p.heads_kv) * n_tiles * i);
    }
    w.bytes = at;
    return w;
  }
};

}  // namespace fa4::sm90
