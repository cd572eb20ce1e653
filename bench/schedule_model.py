#!/usr/bin/env python3
"""A list-scheduling model of the sm90 forward's tile schedules under a causal mask.

Each query tile costs the key tiles it visits plus a fixed share (--overhead, in key tiles) and
the short query tile comes first (src/sm90/fwd/tile_rows.hpp). For each causal row of the benchmark
(docs/benchmarks.md: 16k tokens, hidden 2048, and GQA 64/8 at d128) it prints the busiest CTA's load
over the mean for:
  zigzag   persistent CTAs walking the static zig-zag (src/sm90/fwd/tile_scheduler.cuh);
  greedy   each tile to whichever CTA is free first, tiles numbered head by head: one CTA per
           tile as the hardware hands them out, or a dynamic schedule in that order;
  grouped  the same, tiles numbered in groups of a few heads, query tile by query tile
           (src/sm90/common/grouped_order.hpp), the group as GroupedOrder::dividing_group_for picks it;
  zz-group the zig-zag on the best of the largest four such groups that fit
           (src/sm90/host/causal_schedule.hpp tries these where the plain zig-zag does not balance).
bench/NOTES.md compares these with measurements. No GPU, no dependencies.
"""
import argparse
import heapq
import math

SMS = 132
L2_BYTES = 50 * 2**20
TOKENS, HIDDEN = 16384, 2048
# (block_m, block_n) per head dim: src/sm90/fwd/fwd_config.cuh.
TILES = {64: (192, 128), 128: (128, 128), 256: (128, 64)}


def key_tiles(seqlen, block_m, block_n):
    """Key tiles of each query tile, m = 0 first, with the short tile first (causal, sq = sk)."""
    n = math.ceil(seqlen / block_m)
    pad = (block_m - seqlen % block_m) % block_m
    return [math.ceil(min(m * block_m - pad + block_m, seqlen) / block_n) for m in range(n)]


def numbered(costs, pairs, group):
    """Tile costs in grid order: groups of `group` pairs (the short group first), in a group each
    pair's query tile n before n + 1, heaviest (last) query tile first. group 1: head by head."""
    n = len(costs)
    sizes = ([pairs % group] if pairs % group else []) + [group] * (pairs // group)
    order = []
    for size in sizes:
        for i in range(n):
            order += [costs[n - 1 - i]] * size
    return order


def zigzag(order, ctas=SMS, overhead=0.5):
    loads = [0.0] * ctas
    for c in range(min(ctas, len(order))):
        t = c
        while t < len(order):
            loads[c] += order[t] + overhead
            t = t + 2 * (ctas - c) - 1 if t % (2 * ctas) < ctas else t + 2 * c + 1
    return max(loads) / (sum(loads) / ctas)


def greedy(order, ctas=SMS, overhead=0.5):
    heap = [(0.0, c) for c in range(ctas)]
    for cost in order:
        load, c = heapq.heappop(heap)
        heapq.heappush(heap, (load + cost + overhead, c))
    total = sum(order) + overhead * len(order)
    return max(load for load, _ in heap) / (total / ctas)


def dividing_group(pairs, shared_rows, bytes_per_row, l2_bytes=L2_BYTES):
    """GroupedOrder::dividing_group_for."""
    per_pair = shared_rows * bytes_per_row
    cap = min(pairs, l2_bytes // 2 // per_pair if per_pair > 0 else pairs)
    return max([d for d in range(1, cap + 1) if pairs % d == 0] or [1])


def rows(hdims, seqlens):
    for d in hdims:
        for s in seqlens:
            yield d, s, TOKENS // s * (HIDDEN // d), 1
    if 128 in hdims:
        for s in (2048, 16384):
            if s in seqlens:
                yield 128, s, 64, 8  # GQA 64/8, batch 1


def model(d, seqlen, pairs, sharing, overhead=0.5):
    block_m, block_n = TILES[d]
    costs = key_tiles(seqlen, block_m, block_n)
    group = dividing_group(pairs, seqlen, math.ceil(2 * d * 2 / sharing))
    plain = numbered(costs, pairs, 1)
    tried = [g for g in range(group, 1, -1) if pairs % g == 0][:4]
    best = min([(zigzag(numbered(costs, pairs, g), overhead=overhead), g) for g in tried] +
               [(zigzag(plain, overhead=overhead), 1)])
    return {"tiles": len(plain), "group": group, "zigzag": zigzag(plain, overhead=overhead),
            "greedy": greedy(plain, overhead=overhead),
            "grouped": greedy(numbered(costs, pairs, group), overhead=overhead),
            "zz_group": best}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    ap.add_argument("--overhead", type=float, default=0.5, help="per tile, in key tiles")
    args = ap.parse_args()
    hdims = [int(x) for x in args.hdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    print("| d | seqlen | pairs | tiles | zigzag | greedy | grouped (group) | zz-group (group) |")
    print("|---|---|---|---|---|---|---|---|")
    for d, s, pairs, sharing in rows(hdims, seqlens):
        m = model(d, s, pairs, sharing, args.overhead)
        print(f"| {d} | {s} | {pairs}{' (GQA)' if sharing > 1 else ''} | {m['tiles']} | "
              f"{m['zigzag']:.3f} | {m['greedy']:.3f} | {m['grouped']:.3f} ({m['group']}) | "
              f"{m['zz_group'][0]:.3f} ({m['zz_group'][1]}) |")


if __name__ == "__main__":
    main()
