// The tiles a CTA runs, found once by the producer's load thread and handed to the consumer
// warpgroups through shared memory. Finding a tile (its grid entry's coordinates, its sequence,
// its mask and key tiles) is a chain of a few hundred dependent integer instructions; each
// consumer warp repeating it would stand at the start of every tile's critical path, where at 512
// keys it measures about 8 % of the forward's time (ncu, d64). The load thread finds each tile anyway, one
// tile ahead of the consumers, so its copy is ready before they need it.
//
// Two slots, guarded by CUTLASS's PipelineAsync (one producer thread, every consumer thread): the
// load thread writes a tile while the consumers run the one before. A slot holding `Item{}` with
// `!item.valid()` ends the walk.
#pragma once

#include <cutlass/pipeline/pipeline.hpp>

namespace fa4::sm90 {

template <class Item>
struct TileQueue {
  static constexpr int kSlots = 2;
  using Pipeline = cutlass::PipelineAsync<kSlots>;
  using State = typename Pipeline::PipelineState;

  struct SharedStorage {
    Item slots[kSlots];
    typename Pipeline::SharedStorage pipeline;
  };

  // Every thread of the CTA constructs it (warp 0 initialises the barriers; the kernel's
  // fence_barrier_init and __syncthreads follow); `producer` is the load thread's warpgroup.
  CUTE_DEVICE TileQueue(SharedStorage& storage, bool producer, int consumer_threads)
      : storage_(storage), pipeline_(storage.pipeline, params(producer, consumer_threads)) {}

  // The load thread: `item` for the consumers, once they have taken the one two slots back.
  CUTE_DEVICE void publish(Item const& item, State& write) {
    pipeline_.producer_acquire(write);
    storage_.slots[write.index()] = item;
    // The barriers' asm has no memory clobber: without this the compiler may sink the slot's
    // stores past the arrive (the arrive's release orders them in hardware, not in the compiler).
    compiler_fence();
    pipeline_.producer_commit(write);
    ++write;
  }
  CUTE_DEVICE void publish_end(State& write) { publish(Item{}, write); }

  // A consumer thread: the next item, copied into registers before its slot is released.
  CUTE_DEVICE Item take(State& read) {
    pipeline_.consumer_wait(read);
    compiler_fence();  // no load of the slot before the wait
    const Item item = storage_.slots[read.index()];
    compiler_fence();  // every load of the slot before the release
    pipeline_.consumer_release(read);
    ++read;
    return item;
  }

  static CUTE_DEVICE State producer_start() {
    return cutlass::make_producer_start_state<Pipeline>();
  }

 private:
  static CUTE_DEVICE typename Pipeline::Params params(bool producer, int consumer_threads) {
    typename Pipeline::Params p;
    p.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    p.producer_arv_count = 1;
    p.consumer_arv_count = uint32_t(consumer_threads);
    return p;
  }
  static CUTE_DEVICE void compiler_fence() { asm volatile("" ::: "memory"); }

  SharedStorage& storage_;
  Pipeline pipeline_;
};

}  // namespace fa4::sm90
