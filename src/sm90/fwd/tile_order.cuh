// Longest-first order of a varlen batch's forward tiles.
//
// With one CTA per tile the hardware hands CTAs to SMs in grid order, so the grid's order is the
// schedule. In input order a long sequence late in the batch leaves its tiles to the last wave,
// where they run on a few SMs while the others idle, and every query tile past a short sequence's
// end still costs a CTA start. The host cannot read the lengths without synchronising, so a
// one-CTA kernel (order_tiles, before the forward kernel on the same stream) reads them, sorts the
// sequences by the keys they use (most first) and writes the index of every tile to compute, densely,
// into the caller's workspace: the forward kernel's CTA i computes the tile of entry i. Within a
// sequence the order stays the scheduler's (heads, then query tiles, heaviest first under a causal
// mask), so that the CTAs running at once share K / V in L2.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fa4/attention.hpp"
#include "sm90/fwd/query_rows.cuh"
#include "sm90/common/sequence.cuh"
#include "sm90/fwd/tile_order.hpp"
#include "sm90/fwd/tile_scheduler.cuh"

namespace fa4::sm90 {

struct TileOrderParams {
  SequenceParams sequences;
  QueryRows rows;
  TileScheduler::Params scheduler;  // the tiles' numbering, and `order`
  int entries;                      // of order to write (ordered_tile_entries)
  int batch;
  int block_m;
};

// Launches order_tiles on `stream`; the forward kernel after it waits for it with
// griddepcontrol.wait (launch_kernel_dependent), so its prologue overlaps this one.
cudaError_t launch_order_tiles(TileOrderParams const& p, void* stream);

}  // namespace fa4::sm90
