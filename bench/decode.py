"""Decode and chunked prefill over a KV cache: fa4cpp (fa4cpp.flash_attn_with_kvcache, one build
or several), FlashAttention-3 (flash_attn_interface.flash_attn_with_kvcache, same arguments, when it
imports), FlashAttention-4 (flash_attn.cute.flash_attn_varlen_func with seqused_k and page_table,
when it imports) and cuDNN (torch SDPA under CUDNN_ATTENTION, contiguous caches only) on the same
caches, in one process. Writes <out>/<date>_<sha>_decode.json, .md and .png (bench/sweep.py's
result files, rewritten after every row).

  FA4CPP_LIBRARY=build/default/libfa4.so PYTHONPATH=python:$FA3_HOPPER \\
      python3 bench/decode.py --sha $(git rev-parse --short HEAD) --out DIR
  ... bench/decode.py --gqa 32/8,8/1 --batches 1,64 --cache-lens 4k,64k --pages 0,64 --rounds 3 ...
  ... bench/decode.py --kv-dtypes bf16,e4m3 ...   # decode with an FP8 cache beside bf16
  ... bench/decode.py --dry-run ...      # the rows and a rough time estimate; no GPU needed
  ... bench/decode.py --smoke ...        # two tiny decode rows and one tiny prefill row (and a
                                         # tiny e4m3 decode row when --kv-dtypes has e4m3)

A/B of fa4cpp builds in the same run (bench/sweep.py's --lib): one --lib NAME=PATH per build, each
its own columns (GB/s, ratios to cuDNN and FA3, and to the first build), all on the same caches and
in the same rotated rounds:

  PYTHONPATH=python:$FA3_HOPPER python3 bench/decode.py --lib main=A/libfa4.so \\
      --lib gather=B/libfa4.so --sha $(git rev-parse --short HEAD) --out DIR --rounds 3 ...

One --lib PATH (or none: $FA4CPP_LIBRARY, else the installed package's library) is the single build
fa4cpp, called through the package (its native torch ops when built). Several builds cannot all
serve the package's ops, which bind one library per process: each is then called through its own C
ABI (ctypes, bench/sweep.py's Build, --lib-env NAME:VAR=VALUE for its launch-plan overrides) with
the checks and parameters of the package's Python implementation of the op, the same path for every
build (c_abi_kvcache). The GPU's time is comparable across the two paths; the host's time per call
is not.

Rows (bf16 caches unless --kv-dtypes adds e4m3 decode rows, --hdim 128):
- decode: one query row per sequence, GQA --gqa (32/8, 64/8, 8/1) × --batches (1 … 256) ×
  --cache-lens (1k … 128k) × --pages (0 = contiguous, 16, 64, 256 = paged with that page size);
  rows whose K + V exceed --max-gb are skipped (listed in the JSON). Every sequence holds the full
  cache length (cache_seqlens = length) unless --ragged (lengths drawn in [length/2, length]).
  Paged caches get their pages in a random order. No mask (one query row: FlashAttention's
  bottom-right causal mask would change nothing, SDPA's is_causal is top-left).
- decode with an FP8 cache (--kv-dtypes bf16,e4m3; default bf16): each decode shape again, next
  to its bf16 row, with q and the caches in float8_e4m3fn: randn values drawn in bf16 (as a bf16
  cache holds them), divided by fp32 descales of shape (batch, kv heads), 2^u / 32 with u uniform
  in [-1/2, 1/2] per (batch, kv head), and rounded to e4m3 (saturating at 448, which these values
  never reach). Each library's flash_attn_with_kvcache takes q_descale / k_descale / v_descale
  (FlashAttention-3's keywords and layout; fa4cpp's the same) and returns bf16. The e4m3 row draws
  its lengths and page order with its bf16 row's seed, so the two read the same sequences. Plain
  calls only (no append: FA3 takes its rotary tables in q's dtype, e4m3, where fa4cpp takes them
  in the output's, bf16); cuDNN has no FP8 path through SDPA and is not run, nor is FA4 (FP8 on
  sm100 only: FA4_FP8). fa4cpp runs them where its build has the e4m3 kernel of the head dim
  (FA4_SM90_KERNELS, e.g. 128:e4m3) and refuses them (n/a) elsewhere. Rows over --max-gb are
  judged on their own bytes, so an e4m3 row can run where its bf16 row is skipped.
- decode with append (--parts append): the same call with one new token per sequence (k, v of
  (b, 1, hkv, d)) and NeoX rotary tables (rotary_cos / rotary_sin of (cache capacity, d/2)):
  reported as "append+rotary µs over plain" for fa4cpp and FA3 (FA4's call takes no new keys and
  no rotary: FA4_APPEND). The cache has room for the token; the call does not advance
  cache_seqlens, so repeated calls write the same position.
- chunked prefill: --chunk (512) queries, causal with FlashAttention's bottom-right alignment,
  against --prefill-cache (8k) keys that include the chunk's own (its K / V already written to
  the cache, as engines do), GQA --prefill-gqa 32/8, batch --prefill-batch 4, --prefill-pages
  0,64,256: TFLOP/s and each library's paged / contiguous ratio. cuDNN is not run here: SDPA's
  is_causal is aligned top-left, and its bottom-right bias (causal_lower_right) dispatches to
  FlashAttention-2 / memory-efficient kernels, never to cuDNN.

Metrics: decode GB/s of K + V read (sum of cache_seqlens · hkv · d · 2 tensors · 2 bytes / time;
1 byte per element for e4m3 caches, the bytes actually read); prefill TFLOP/s = 4 · b · hq · d ·
(visible (query, key) pairs) / time. Ratios of each build to cuDNN, FA3 and FA4 per row, and of
each later build to the first (B/A); on each e4m3 row, each library's e4m3 time / its time on the
shape's bf16 row (time_vs_bf16: half the bytes should take close to half the time). Each library
runs once per row before timing: its output against the first build's (whole batch) and against a
float32 torch reference on the first sequence (max abs diff; rows over --tol, 2e-2, are flagged).
An e4m3 row's reference computes on the dequantized q, K and V (value × descale), and the row
is flagged over --fp8-tol, 6e-2: a GPU kernel rounds P to e4m3 (relative error up to 2^-4) for
P·V (FP8_TOL says more). A library that raises for a row gets n/a and the first line of its
error; the run goes on. That first call is also where FA4 compiles its kernels (JIT): never timed.
FA4 is called with num_splits=1, unsplit: its sm90 forward has no split-KV (--fa4-num-splits;
FA4_NUM_SPLITS says more).

Timing: --rounds rounds; in each round every (library, call) is timed once (each build's plain and
append calls among them), their order rotated by one place per round; the median over rounds is
reported (every round's time is in the JSON). One timing: back-to-back plain calls (no CUDA graph)
in windows of at least --window-us (CUDA events around each window), at least --reps calls and
--min-windows windows, the median window's time per call. Before each window the stream is held by
a spin kernel (torch.cuda._sleep) long enough for the host to queue the window's calls, so a window
times the GPU's work, not the host's launch rate (each library's host time per call is recorded
too). A window counts only if the GPU had not reached it when the host finished queuing it (its
start event still pending); otherwise the hold doubles and the window is repeated, and a timing
that never got ahead is marked host-bound (†). The caches are copied until the copies outweigh the
L2 cache three times over, and consecutive calls read different copies: a small cache is read from
memory, as in a model where the other layers' work evicts it.
"""
import argparse
import datetime
import importlib
import importlib.metadata
import itertools
import math
import os
import statistics
import sys
import time
import types

import torch
from torch.nn.attention import SDPBackend

import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GQAS = ((32, 8), (64, 8), (8, 1))
BATCHES = (1, 4, 16, 64, 256)
CACHE_LENS = (1024, 4096, 16384, 65536, 131072)
PAGES = (0, 16, 64, 256)
PREFILL_PAGES = (0, 64, 256)
PARTS = ("decode", "append", "prefill")
DEFAULT_BUILD = sweep.DEFAULT_LIB_NAME  # the one build's column: "fa4cpp"
PEERS = ("FA3", "FA4", "cuDNN")  # the columns that are not fa4cpp builds
ELEMENT_BYTES = 2  # bf16
# The KV caches' dtypes (--kv-dtypes) and the bytes a call reads per cached element.
KV_DTYPES = {"bf16": torch.bfloat16, "e4m3": torch.float8_e4m3fn}
KV_ELEMENT_BYTES = {"bf16": 2, "e4m3": 1}
# The descale of each (batch, kv head) of an e4m3 q and cache: 2^u / FP8_SCALE, u uniform in
# [-FP8_SPREAD, FP8_SPREAD]. e4m3 is floating point, so the scale costs no precision (3 mantissa
# bits anywhere from 2^-6 to 448); it sets where a value saturates: past 448 / (FP8_SCALE ·
# 2^FP8_SPREAD) = 9.9 for the randn values of the caches and q (about 10^-22 of them), so none
# does. The spread gives each (batch, kv head) its own descale, so that a kernel that applies
# another's fails the check.
FP8_SCALE = 32.0
FP8_SPREAD = 0.5
# The e4m3 rows' tolerance (--fp8-tol). The reference is exact on the dequantized values, so the
# inputs' quantisation is no part of the difference; a GPU kernel that rounds P to e4m3 for P·V
# (relative error up to 2^-4, against bf16's 2^-9) moves an output by at most 2^-4 times the
# P-weighted mean |v|: 0.05 for these randn values (mean |v| 0.8) if every rounding errs the same
# way, far less as they mostly cancel. 6e-2 is about 2^-4 · 1.
FP8_TOL = 6e-2
# An e4m3 cache is drawn (bf16) and quantised this many bytes of fp32 at a time, so that a cache
# near --max-gb needs no bf16 copy of itself.
QUANTIZE_CHUNK_BYTES = 1 << 28
CONTIGUOUS_ROOM = 256  # a contiguous cache's rows are the length + 1 rounded up to this
L2_FACTOR = 3  # copies of a cache until they outweigh the L2 cache this many times
MAX_COPIES = 64
MAX_CALLS_PER_WINDOW = 128
ROTARY_BASE = 10000.0
CUDNN_PREFILL = ("not run: SDPA's is_causal is aligned top-left; the bottom-right variant "
                 "(torch.nn.attention.bias.causal_lower_right) dispatches to FlashAttention-2 or "
                 "the memory-efficient kernel, never to cuDNN")
CUDNN_PAGED = "contiguous caches only (SDPA takes no page table)"
CUDNN_RAGGED = "--ragged: SDPA's dense call has no per-sequence key lengths"
CUDNN_FP8 = "not run: torch's SDPA has no FP8 (e4m3) attention for cuDNN"
FP8_APPEND = ("e4m3 rows time the plain call only: FA3 takes its rotary tables in q's dtype (e4m3) "
              "and fa4cpp in the output's (bf16), so the two append calls would differ")
# FlashAttention-4 (flash_attn.cute): its varlen call over the same caches (fa4_kvcache), and
# what it is not run for.
FA4_MODULE = next(m for n, m, _ in sweep.OTHERS if n == "FA4")  # flash_attn.cute
FA4_FUNC = "flash_attn_varlen_func"
# FA4's sm90 forward (4.0.0b36) has no split-KV kernel: with num_splits < 1 (its split heuristic)
# a decode of few sequences × kv heads over a long cache asks for splits and the call raises
# "SplitKV not supported on SM 9.0". So its calls take its default, 1 (never split), which is what
# its users on Hopper get; --fa4-num-splits 0 asks for the heuristic (sm100).
FA4_NUM_SPLITS = 1
FA4_FP8 = ("not run: FA4 (flash_attn.cute) has FP8 (e4m3) attention on sm100 only (its interface "
           "asserts compute capability 10.x for FP8 inputs)")
FA4_APPEND = ("FA4 times the plain call only: flash_attn.cute.flash_attn_varlen_func takes no new "
              "keys / values to append and no rotary tables")
# A rough allowance for FA4's first call of each kernel it compiles (CuTe DSL, JIT, in the row's
# check call, before any timing) in estimate_seconds.
FA4_COMPILE_S = 10.0


# -- rows, bytes and FLOPs (no GPU needed) ---------------------------------------------------------

def parse_len(text):
    """'4k' -> 4096, '128K' -> 131072, '1000' -> 1000."""
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def parse_ints(text, parse=int):
    return [parse(x) for x in text.split(",") if x.strip()]


def parse_gqa(text):
    """'32/8,8/1' -> [(32, 8), (8, 1)]."""
    out = []
    for item in text.split(","):
        if not item.strip():
            continue
        hq, sep, hkv = item.partition("/")
        if not sep or int(hq) % int(hkv):
            raise SystemExit("--gqa %r: expected HQ/HKV with HQ a multiple of HKV" % item)
        out.append((int(hq), int(hkv)))
    return out


def length_label(n):
    return "%dk" % (n // 1024) if n >= 1024 and n % 1024 == 0 else str(n)


def layout_label(page_size):
    return "contiguous" if page_size == 0 else "paged %d" % page_size


def kv_bytes(seqlens, heads_kv, head_dim, element_bytes=ELEMENT_BYTES):
    """Bytes of K and V a call reads: every sequence's cached keys, both tensors."""
    return sum(seqlens) * heads_kv * head_dim * 2 * element_bytes


def kv_dtype(row):
    """A row's cache dtype label: its kv_dtype (decode rows), else bf16."""
    return row.get("kv_dtype", "bf16")


def row_element_bytes(row):
    """Bytes per cached element a row's calls read: 2 for bf16, 1 for e4m3."""
    return KV_ELEMENT_BYTES[kv_dtype(row)]


def row_kv_bytes(row, seqlens=None):
    """Bytes of K and V a row's call reads (every sequence at the full length unless seqlens)."""
    if seqlens is None:
        seqlens = [row["cache_len"]] * row["batch"]
    return kv_bytes(seqlens, row["heads_kv"], row["head_dim"], row_element_bytes(row))


def visible_pairs(seqlen_q, seqlen_k, causal):
    """(query, key) pairs one head of one sequence computes; causal aligned bottom-right (query i
    sees keys j <= i + seqlen_k - seqlen_q), as FlashAttention aligns it."""
    if not causal:
        return seqlen_q * seqlen_k
    # Query i sees i + seqlen_k - seqlen_q + 1 keys when that is positive (never more than
    # seqlen_k: the last query sees them all); an arithmetic series from the first query that
    # sees one.
    first = max(0, seqlen_q - seqlen_k)
    terms = seqlen_q - first
    return terms * (first + seqlen_k - seqlen_q + 1 + seqlen_k) // 2


def attention_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal):
    return 4.0 * batch * heads_q * head_dim * visible_pairs(seqlen_q, seqlen_k, causal)


def capacity(cache_len, page_size):
    """Rows of one sequence's cache: room for the appended token, in whole pages when paged."""
    need = cache_len + 1
    if page_size == 0:
        return -(-need // CONTIGUOUS_ROOM) * CONTIGUOUS_ROOM
    return -(-need // page_size) * page_size


def decode_rows(gqas, batches, cache_lens, pages, head_dim, max_gb, kv_dtypes=("bf16",)):
    """(rows, skipped): decode rows in table order (GQA, batch, cache length, layout, cache dtype:
    a shape's bf16 and e4m3 rows side by side) whose K + V fit in max_gb (decimal GB, in the
    row's dtype), and the others with their size."""
    rows, skipped = [], []
    for hq, hkv in gqas:
        for b in batches:
            for n in cache_lens:
                for p in pages:
                    for dt in kv_dtypes:
                        row = {"kind": "decode", "heads_q": hq, "heads_kv": hkv,
                               "head_dim": head_dim, "batch": b, "seqlen_q": 1, "cache_len": n,
                               "page_size": p, "kv_dtype": dt}
                        gb = row_kv_bytes(row) / 1e9
                        if gb > max_gb:
                            skipped.append(dict(row, kv_gb=round(gb, 3), reason=(
                                "K + V %.1f GB > --max-gb %g" % (gb, max_gb))))
                        else:
                            rows.append(row)
    return rows, skipped


def prefill_rows(gqa, batch, chunk, cache_len, pages, head_dim):
    hq, hkv = gqa
    return [{"kind": "prefill", "heads_q": hq, "heads_kv": hkv, "head_dim": head_dim,
             "batch": batch, "seqlen_q": chunk, "cache_len": cache_len, "page_size": p,
             "causal": True} for p in pages]


def window_plan(est_ms, reps, window_us, min_windows, max_ms):
    """(calls per window, windows) for a call of est_ms: windows of at least window_us (at most
    MAX_CALLS_PER_WINDOW calls), at least reps calls and min_windows windows, and no more windows
    than fit in max_ms beyond min_windows."""
    est_ms = max(est_ms, 1e-4)
    calls = max(1, min(MAX_CALLS_PER_WINDOW, math.ceil(window_us / 1000.0 / est_ms)))
    windows = math.ceil(reps / calls)
    windows = min(windows, max(1, int(max_ms / (calls * est_ms))))
    return calls, max(min_windows, windows)


def kv_copies(alloc_bytes, l2_bytes):
    """Copies of a cache whose round robin outweighs the L2 cache L2_FACTOR times."""
    if alloc_bytes <= 0:
        return 1
    return max(1, min(MAX_COPIES, math.ceil(L2_FACTOR * l2_bytes / alloc_bytes)))


def row_alloc_bytes(row):
    """Bytes of one copy of a row's K and V caches as allocated (with room and page rounding)."""
    return (row["batch"] * capacity(row["cache_len"], row["page_size"]) * row["heads_kv"]
            * row["head_dim"] * 2 * row_element_bytes(row))


def timed_calls(row, parts, fa3=True, builds=(DEFAULT_BUILD,), fa4=False):
    """The (library, call) pairs a row times (builds: the fa4cpp builds' names; fa4: FA4's plain
    call too, on bf16 rows: FA4_FP8, FA4_APPEND)."""
    fp8 = kv_dtype(row) == "e4m3"  # no cuDNN (no FP8 through SDPA), no append (FP8_APPEND)
    calls = [(b, "plain") for b in builds] + ([("FA3", "plain")] if fa3 else [])
    calls += [("FA4", "plain")] if fa4 and not fp8 else []
    if row["kind"] == "decode" and row["page_size"] == 0 and not row.get("ragged") and not fp8:
        calls.append(("cuDNN", "plain"))
    if row["kind"] == "decode" and "append" in parts and not fp8:
        calls += [(b, "append") for b in builds] + ([("FA3", "append")] if fa3 else [])
    return calls


def estimate_seconds(rows, args, fa3=True, bandwidth=3.5e12, tflops=450e12, host_us=50.0,
                     l2_bytes=50e6, builds=(DEFAULT_BUILD,), fa4=False):
    """A rough wall-time estimate of a run: memory-bound decode at `bandwidth`, prefill at
    `tflops`, host time per call `host_us` (Timer's spin kernel holds the stream 1.5 times the
    host's time per window), set-up and first calls per row (cuDNN's plan 0.3 s, FA4's compile
    FA4_COMPILE_S per kernel: per GQA group, layout and causal), for the fa4cpp builds named in
    `builds`."""
    total = 0.0
    fa4_kernels = set()
    host = host_us * 1e-6
    for row in rows:
        if row["kind"] == "decode":
            t = row_kv_bytes(row) / bandwidth + 4e-6
        else:
            t = attention_flops(row["batch"], row["heads_q"], row["seqlen_q"], row["cache_len"],
                                row["head_dim"], True) / tflops + 5e-6
        calls, windows = window_plan(t * 1e3, args.reps, args.window_us, args.min_windows,
                                     args.max_timing_ms)
        per_timing = (5e-3 + 5 * max(t, host)
                      + windows * (1.5 * calls * host + calls * t + 30e-6))
        timed = timed_calls(row, args.parts, fa3, builds, fa4)
        alloc = row_alloc_bytes(row) * kv_copies(row_alloc_bytes(row), l2_bytes)
        total += len(timed) * (args.rounds * per_timing + 2 * t)
        total += alloc / 0.5e12 + 0.1 + (0.3 if ("cuDNN", "plain") in timed else 0.0)
        if ("FA4", "plain") in timed:
            fa4_kernels.add((row["heads_q"] // row["heads_kv"], row["page_size"], row["kind"]))
    return total + FA4_COMPILE_S * len(fa4_kernels)


# -- command line ---------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", metavar="[NAME=]PATH",
                    help="libfa4.so to load (sets FA4CPP_LIBRARY; default: $FA4CPP_LIBRARY, else "
                         "the installed package's); repeat with NAME= to time several builds "
                         "side by side, each its own columns (bench/sweep.py's --lib)")
    sweep.add_lib_env_arg(ap)
    ap.add_argument("--sha", help="git sha of the fa4cpp tree (required unless --dry-run)")
    ap.add_argument("--out", help="folder for the .json, .md and .png (required unless --dry-run)")
    ap.add_argument("--name", help="file name without extension (default <date>_<sha>_decode)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20,
                    help="timed calls per timing, at least (fewer where --max-timing-ms stops "
                         "the windows, never fewer than --min-windows windows)")
    ap.add_argument("--window-us", type=float, default=200.0,
                    help="a timed window of back-to-back calls lasts at least this long")
    ap.add_argument("--min-windows", type=int, default=5)
    ap.add_argument("--max-timing-ms", type=float, default=100.0,
                    help="windows beyond --min-windows stop at this much GPU time per timing")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--gqa", default=",".join("%d/%d" % g for g in GQAS))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--cache-lens", default=",".join(length_label(n) for n in CACHE_LENS))
    ap.add_argument("--pages", default=",".join(map(str, PAGES)),
                    help="page sizes; 0 = contiguous cache")
    ap.add_argument("--max-gb", type=float, default=40.0, help="skip decode rows whose K + V "
                                                                "exceed this (decimal GB)")
    ap.add_argument("--ragged", action="store_true",
                    help="decode sequences of lengths drawn in [length/2, length]")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="what to run: decode (plain), append (+ append and rotary), prefill")
    ap.add_argument("--chunk", type=int, default=512, help="chunked prefill: queries per chunk")
    ap.add_argument("--prefill-cache", default="8k",
                    help="chunked prefill: keys per sequence, the chunk's included")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-gqa", default="32/8")
    ap.add_argument("--prefill-pages", default=",".join(map(str, PREFILL_PAGES)))
    ap.add_argument("--tol", type=float, default=2e-2,
                    help="flag rows whose max abs difference exceeds this")
    ap.add_argument("--kv-dtypes", default="bf16",
                    help="the decode rows' cache dtypes, some of %s: each shape once per dtype, "
                         "side by side; e4m3 = float8_e4m3fn q and caches with fp32 descales per "
                         "(batch, kv head), a bf16 output, the plain call only"
                         % ",".join(KV_DTYPES))
    ap.add_argument("--fp8-tol", type=float, default=FP8_TOL,
                    help="--tol of the e4m3 rows (P is rounded to e4m3 for P·V)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true",
                    help="two tiny decode rows (contiguous, paged 64), one tiny e4m3 decode row "
                         "(contiguous) when --kv-dtypes has e4m3, and one tiny prefill row")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the rows and a rough time estimate, run nothing")
    ap.add_argument("--fa3-version", help="FlashAttention-3's version or commit for the header, "
                                          "where its module does not say")
    ap.add_argument("--fa4-version", help="FlashAttention-4's (flash_attn.cute) version or commit "
                                          "for the header, where its package does not say")
    ap.add_argument("--fa4-num-splits", type=int, default=FA4_NUM_SPLITS,
                    help="num_splits of FA4's calls (default %d: unsplit, as its sm90 forward "
                         "has no split-KV; 0: FA4's own split heuristic; FA4_NUM_SPLITS says "
                         "more)" % FA4_NUM_SPLITS)
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if set(args.parts) - set(PARTS):
        raise SystemExit("--parts: expected some of %s" % ",".join(PARTS))
    args.kv_dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]
    if (not args.kv_dtypes or set(args.kv_dtypes) - set(KV_DTYPES)
            or len(set(args.kv_dtypes)) != len(args.kv_dtypes)):
        raise SystemExit("--kv-dtypes: expected some of %s, each once" % ",".join(KV_DTYPES))
    if "e4m3" in args.kv_dtypes and "decode" not in args.parts:
        raise SystemExit("--kv-dtypes e4m3 times the plain decode call: --parts needs decode")
    if args.smoke:
        args.gqa, args.batches, args.cache_lens, args.pages = "32/8", "2", "1k", "0,64"
        args.chunk, args.prefill_cache, args.prefill_batch = 128, "1k", 1
        args.prefill_pages, args.rounds = "0", min(args.rounds, 2)
    args.gqa = parse_gqa(args.gqa)
    args.batches = parse_ints(args.batches)
    args.cache_lens = parse_ints(args.cache_lens, parse_len)
    args.pages = parse_ints(args.pages)
    args.prefill_cache = parse_len(args.prefill_cache)
    args.prefill_gqa = parse_gqa(args.prefill_gqa)[0]
    args.prefill_pages = parse_ints(args.prefill_pages)
    if args.rounds < 1 or args.reps < 1 or args.min_windows < 1:
        raise SystemExit("--rounds, --reps and --min-windows must be >= 1")
    if any(p < 0 for p in args.pages + args.prefill_pages):
        raise SystemExit("--pages: page sizes are >= 0 (0 = contiguous)")
    if args.chunk > args.prefill_cache:
        raise SystemExit("--chunk: the chunk's keys are part of --prefill-cache")
    if not args.dry_run and (not args.sha or not args.out):
        raise SystemExit("--sha and --out are required (except with --dry-run)")
    # [(name, path)] of the fa4cpp builds; without --lib one, path None (the package's library).
    args.libs = sweep.parse_libs(args.lib) if args.lib else [(DEFAULT_BUILD, None)]
    clash = [n for n, _ in args.libs if n in PEERS + ("row",)]
    if clash:
        raise SystemExit("--lib: %s names another column; choose another NAME=" % clash[0])
    args.lib_env = sweep.parse_lib_env(args.lib_env, {n for n, _ in args.libs})
    return args


def plan(args):
    """(rows, skipped) of the run the arguments ask for."""
    rows, skipped = [], []
    if "decode" in args.parts or "append" in args.parts:
        rows, skipped = decode_rows(args.gqa, args.batches, args.cache_lens, args.pages,
                                    args.hdim, args.max_gb, args.kv_dtypes)
        if args.smoke:  # one tiny e4m3 row shows the FP8 path runs
            rows = [r for r in rows if kv_dtype(r) != "e4m3" or r["page_size"] == 0]
        for row in rows:
            row["ragged"] = args.ragged
    if "prefill" in args.parts:
        rows += prefill_rows(args.prefill_gqa, args.prefill_batch, args.chunk,
                             args.prefill_cache, args.prefill_pages, args.hdim)
    return rows, skipped


# -- the float32 reference and the rotary tables ---------------------------------------------------

def rotary_tables(length, rotary_dim, dtype=torch.bfloat16, device="cuda"):
    """NeoX-style cos / sin tables of (length, rotary_dim / 2)."""
    inv = 1.0 / (ROTARY_BASE ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64,
                                               device=device) / rotary_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64, device=device), inv)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_neox(x, cos, sin, position):
    """x (n, heads, d) in float32 with its first 2·cos.shape[1] dims rotated at `position`
    (pairs i, i + half: GPT-NeoX)."""
    half = cos.shape[1]
    y = x.float().clone()
    c, s = cos[position].float(), sin[position].float()
    a, b = y[..., :half].clone(), y[..., half:2 * half].clone()
    y[..., :half] = a * c - b * s
    y[..., half:2 * half] = a * s + b * c
    return y


def reference_attention(q, k, v, causal):
    """float32 attention of one sequence: q (sq, hq, d), k / v (sk, hkv, d), causal aligned
    bottom-right; query head h reads kv head h // (hq / hkv). Returns (sq, hq, d) float32."""
    q, k, v = q.float(), k.float(), v.float()
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    group = hq // hkv
    out = torch.empty(sq, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        hidden = j > i + (sk - sq)
    for g in range(hkv):
        qg = q[:, g * group:(g + 1) * group]  # (sq, G, d)
        s = torch.einsum("qhd,kd->hqk", qg, k[:, g]) / math.sqrt(d)
        if causal:
            s = s.masked_fill(hidden, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that see no key: zero output
        out[:, g * group:(g + 1) * group] = torch.einsum("hqk,kd->qhd", p, v[:, g])
    return out


def first_sequence(cache, page_table, length):
    """The first sequence's `length` cached rows (length, hkv, d) of a contiguous or paged cache."""
    if page_table is None:
        return cache[0, :length]
    if cache.dtype == torch.float8_e4m3fn:  # gathered as bytes: indexing need not know the dtype
        return first_sequence(cache.view(torch.uint8), page_table, length).view(cache.dtype)
    page = cache.shape[1]
    pages = page_table[0, :-(-length // page)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def max_abs_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


# -- e4m3 inputs: descales, quantisation, the dequantized values (no GPU needed) -------------------

def fp8_descales(batch, heads_kv, generator=None):
    """fp32 (batch, heads_kv) descales, 2^u / FP8_SCALE with u uniform in [-FP8_SPREAD,
    FP8_SPREAD] (FP8_SCALE says why), on the CPU: FlashAttention-3's layout, one per batch entry
    and kv head, shared by the query heads of the group."""
    u = (torch.rand(batch, heads_kv, generator=generator, dtype=torch.float64) * 2 - 1) * FP8_SPREAD
    return (2.0 ** u / FP8_SCALE).float()


def quantize(x, descale, owner=None, group=1):
    """x (n, rows, heads, d), a bf16 cache or q, as e4m3: each element divided by its descale and
    rounded as fa4cpp rounds the rows it quantises (the package's reference.round_e4m3; the
    package is imported with the builds, load_builds). x[i] takes the descales of batch entry
    owner[i] (None: i; a paged cache's pages take their sequence's, page_owners), head h those of
    kv head h // group (group = hq / hkv for q)."""
    from fa4cpp import reference
    per = descale.to(x.device).repeat_interleave(group, dim=1)  # (batch, heads)
    if owner is not None:
        per = per[owner]
    return reference.round_e4m3(x.float() / per[:, None, :, None])


def page_owners(page_table, num_pages):
    """(num_pages,) int64: the batch entry whose page table lists each page (every page is listed
    once)."""
    b, per_seq = page_table.shape
    owner = torch.zeros(num_pages, dtype=torch.int64, device=page_table.device)
    owner[page_table.reshape(-1).long()] = torch.arange(
        b, device=page_table.device).repeat_interleave(per_seq)
    return owner


def quantized_cache(shape, descale, owner, device, chunk_bytes=QUANTIZE_CHUNK_BYTES):
    """An e4m3 cache of `shape` (contiguous (b, capacity, hkv, d), or paged (pages, page size,
    hkv, d)): randn drawn in bf16, as a bf16 cache holds it, then quantised with the descales of
    each leading index's batch entry (owner: (shape[0],) int64). Drawn in pieces of at most
    chunk_bytes of fp32, so that the cache never has a bf16 copy of itself alongside."""
    cache = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
    per_index = 4 * math.prod(shape[1:])
    step = max(1, chunk_bytes // max(1, per_index))
    for i in range(0, shape[0], step):
        j = min(shape[0], i + step)
        x = torch.randn((j - i,) + tuple(shape[1:]), device=device, dtype=torch.bfloat16)
        cache[i:j] = quantize(x, descale, owner[i:j])
    return cache


# -- timing ---------------------------------------------------------------------------------------

class Timer:
    """Back-to-back calls in windows timed with CUDA events, the stream held by a spin kernel
    while the host queues each window (module docstring). A window counts only if its start event
    was still pending when the host had queued all its calls (the GPU had not started it, so it
    never waited for the host); otherwise the hold is doubled and the window repeated. A timing
    whose windows never got ahead of the GPU is host-bound: its windows are kept and it says so."""

    HOLD_FACTOR = 1.5  # hold = this × the host's time to queue a window (doubled when short)

    def __init__(self, reps, window_us, min_windows, max_ms, cycles_per_us=None):
        self.reps, self.window_us, self.min_windows, self.max_ms = (reps, window_us, min_windows,
                                                                    max_ms)
        self.factor = self.HOLD_FACTOR
        self.cycles_per_us = cycles_per_us or self.calibrate()

    @staticmethod
    def calibrate():
        """The spin kernel's cycles per µs."""
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        for _ in range(50):  # some load first: the clock the spin kernel counts at rises
            x @ x
        cycles, rates = 2_000_000, []
        for _ in range(3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            torch.cuda.synchronize()
            rates.append(cycles / (start.elapsed_time(end) * 1e3))
        return max(rates)  # the fastest clock seen: a hold is never shorter than asked

    def hold(self, us):
        torch.cuda._sleep(int(min(us, 500_000.0) * self.cycles_per_us))

    def __call__(self, fn):
        """(ms per call: the median window's, details)."""
        Event = torch.cuda.Event
        fn()
        fn()
        torch.cuda.synchronize()
        start, end = Event(enable_timing=True), Event(enable_timing=True)
        self.hold(5000.0)
        start.record()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        host_us = (time.perf_counter() - t0) / 3 * 1e6
        end.record()
        torch.cuda.synchronize()
        est_ms = start.elapsed_time(end) / 3
        calls, windows = window_plan(est_ms, self.reps, self.window_us, self.min_windows,
                                     self.max_ms)
        marks, covered, hosts = [], [], []
        while len(marks) < 3 * windows and sum(covered) < windows:
            s, e = Event(enable_timing=True), Event(enable_timing=True)
            self.hold(host_us * calls * self.factor + 50.0)
            s.record()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            ahead = not s.query()  # the GPU is still in the hold: it never waited for the host
            e.record()
            host = (time.perf_counter() - t0) / calls * 1e6
            hosts.append(host)
            host_us = max(host_us, host)
            marks.append((s, e))
            covered.append(ahead)
            if not ahead:
                self.factor = min(self.factor * 2, 64.0)
        torch.cuda.synchronize()
        valid = [m for m, ok in zip(marks, covered) if ok] or marks
        per_call = [s.elapsed_time(e) / calls for s, e in valid]
        return statistics.median(per_call), {"calls_per_window": calls, "windows": len(valid),
                                             "host_us": statistics.median(hosts),
                                             "host_bound": not any(covered)}


def time_rounds(fns, rounds, timer):
    """fns {key: callable}; every round times each once, the order rotated by one place per
    round (sweep.rotated_rounds). Returns ({key: [ms per round]}, {key: [details]}, {key: error
    of a timing that raised}); a key whose timing raised is not timed again."""
    failed = {}

    def refused(key, e):  # a failure while timing: n/a, the others go on
        failed[key] = sweep.first_line(e)
        return True

    def timed(fn, details):
        ms, detail = timer(fn)
        details.append(detail)
        return ms
    times, details = sweep.rotated_rounds(fns, rounds, refused, timed)
    return times, details, failed


def rotating(fns):
    """A callable that calls fns in turn (one per cache copy)."""
    it = itertools.cycle(fns)
    return lambda: next(it)()


# -- one row on the GPU ---------------------------------------------------------------------------

class Bench:
    """What every row needs: the libraries ({column: flash_attn_with_kvcache}, the fa4cpp builds
    first), the timer, the options. builds: the columns of libs that are fa4cpp builds (default:
    all but FA3), the first one the others' outputs are compared with. device: where the tensors
    live (the tests run rows on the CPU backend)."""

    def __init__(self, args, libs, timer, l2_bytes, device="cuda", builds=None):
        self.args, self.libs, self.timer, self.l2_bytes = args, libs, timer, l2_bytes
        self.device = device
        self.builds = list(builds) if builds is not None else [n for n in libs if n not in PEERS]

    def measure(self, row, index):
        args = self.args
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + index)  # lengths, pages
        b, hq, hkv, d = row["batch"], row["heads_q"], row["heads_kv"], row["head_dim"]
        n, page, sq = row["cache_len"], row["page_size"], row["seqlen_q"]
        cap = capacity(n, page)
        decode = row["kind"] == "decode"
        if decode and row.get("ragged"):
            lens = torch.randint(max(1, n // 2), n + 1, (b,), generator=gen)
        else:
            lens = torch.full((b,), n, dtype=torch.int64)
        row["seqlens"] = {"min": int(lens.min()), "max": int(lens.max()), "sum": int(lens.sum())}
        alloc = row_alloc_bytes(row)
        copies = kv_copies(alloc, self.l2_bytes)
        row["kv_bytes"] = row_kv_bytes(row, lens.tolist())
        row["kv_copies"] = copies
        row["capacity"] = cap
        dev, dt = self.device, torch.bfloat16
        fp8 = kv_dtype(row) == "e4m3"
        cache_seqlens = lens.to(torch.int32).to(dev)
        seqlens_before = cache_seqlens.clone()  # no call may advance them (checked at the end)
        if page:
            pages_per_seq = cap // page
            perm = torch.randperm(b * pages_per_seq, generator=gen)
            page_table = perm.view(b, pages_per_seq).to(torch.int32).to(dev)
            shape = (b * pages_per_seq, page, hkv, d)
        else:
            page_table, shape = None, (b, cap, hkv, d)
        if fp8:
            # Drawn after the lengths and pages, so that a shape's e4m3 row (measured with its
            # bf16 row's index) reads the same lengths through the same page order.
            descales = {name: fp8_descales(b, hkv, gen).to(dev)
                        for name in ("q_descale", "k_descale", "v_descale")}
            owner = (page_owners(page_table, shape[0]) if page
                     else torch.arange(b, device=dev))
            caches = [tuple(quantized_cache(shape, descales[name], owner, dev)
                            for name in ("k_descale", "v_descale")) for _ in range(copies)]
            q = quantize(torch.randn(b, sq, hq, d, device=dev, dtype=dt),
                         descales["q_descale"], group=hq // hkv)
        else:
            descales = {}
            caches = [(torch.randn(shape, device=dev, dtype=dt),
                       torch.randn(shape, device=dev, dtype=dt)) for _ in range(copies)]
            q = torch.randn(b, sq, hq, d, device=dev, dtype=dt)
        causal = not decode
        row["libs"] = {}

        def call(func, kc, vc, extra):
            return lambda: sweep._first(func(q, kc, vc, cache_seqlens=cache_seqlens,
                                             page_table=page_table, causal=causal, **descales,
                                             **extra))

        variants = {"plain": {}}
        if fp8 and "append" in args.parts:
            row["append_skipped"] = FP8_APPEND
        elif decode and "append" in args.parts:
            cos, sin = rotary_tables(cap, d, dt, dev)
            k_new = torch.randn(b, 1, hkv, d, device=dev, dtype=dt)
            v_new = torch.randn(b, 1, hkv, d, device=dev, dtype=dt)
            variants["append"] = dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                                      rotary_interleaved=False)
        if decode and "decode" not in args.parts:
            del variants["plain"]
        fns = {}
        for name, func in self.libs.items():
            for variant, extra in variants.items():
                why = not_run(name, variant, fp8)
                if why:  # recorded, like cuDNN's: FA4 on e4m3 rows, FA4's append
                    key = "skipped" if variant == "plain" else variant + "_skipped"
                    row["libs"].setdefault(name, {})[key] = why
                    continue
                fns[(name, variant)] = [call(func, kc, vc, extra) for kc, vc in caches]
        if "plain" in variants:
            reason = (CUDNN_PREFILL if not decode else CUDNN_FP8 if fp8 else
                      CUDNN_PAGED if page else CUDNN_RAGGED if row.get("ragged") else None)
            if reason:
                row["libs"]["cuDNN"] = {"skipped": reason}
            else:
                fns[("cuDNN", "plain")] = [
                    (lambda run: lambda: run().transpose(1, 2))(
                        sweep.sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, kc[:, :n], vc[:, :n], False))
                    for kc, vc in caches]

        # Once each before timing: outputs against fa4cpp's and the float32 reference (of e4m3
        # rows on the dequantized values: value × descale). This is also each (library, call)'s
        # first call of the row, where FA4 compiles its kernel (JIT): never timed.
        k0, v0 = (first_sequence(c, page_table, int(lens[0])) for c in caches[0])
        q0 = q[0]
        if fp8:
            from fa4cpp import reference
            k0 = reference.dequantize(k0[None], descales["k_descale"][:1])[0]
            v0 = reference.dequantize(v0[None], descales["v_descale"][:1])[0]
            q0 = reference.dequantize(q[:1], descales["q_descale"][:1], group=hq // hkv)[0]
        refs = {}
        if "plain" in variants:
            refs["plain"] = reference_attention(q0, k0, v0, causal)
        if "append" in variants:
            extra = variants["append"]
            pos = int(lens[0])
            k_app = torch.cat([k0.float(), rotate_neox(extra["k"][0], extra["rotary_cos"],
                                                       extra["rotary_sin"], pos)])
            v_app = torch.cat([v0.float(), extra["v"][0].float()])
            q_rot = rotate_neox(q[0], extra["rotary_cos"], extra["rotary_sin"], pos)
            refs["append"] = reference_attention(q_rot, k_app, v_app, causal)
        del k0, v0, q0
        outs, runs = {}, {}
        for (name, variant), per_copy in fns.items():
            entry = row["libs"].setdefault(name, {})
            prefix = "" if variant == "plain" else "append_"
            try:
                out = per_copy[0]()
                torch.cuda.synchronize()
            except Exception as e:  # the library refuses this row: n/a
                entry[prefix + "refused"] = sweep.first_line(e)
                continue
            outs[(name, variant)] = out
            entry[prefix + "max_abs_diff_vs_ref"] = max_abs_diff(out[0], refs[variant])
            runs[(name, variant)] = rotating(per_copy)
        first = self.builds[0]
        for (name, variant), out in outs.items():
            base = outs.get((first, variant))
            if name != first and base is not None:
                prefix = "" if variant == "plain" else "append_"
                row["libs"][name][prefix + "max_abs_diff_vs_" + first] = max_abs_diff(out, base)
        del outs, refs

        times, details, failed = time_rounds(runs, args.rounds, self.timer)
        for (name, variant), ms_rounds in times.items():
            entry = row["libs"][name]
            prefix = "" if variant == "plain" else "append_"
            if (name, variant) in failed:
                entry[prefix + "refused"] = "while timing: " + failed[(name, variant)]
            if not ms_rounds:
                continue
            ms = statistics.median(ms_rounds)
            entry[prefix + "ms_rounds"] = ms_rounds
            entry[prefix + "ms"] = ms
            entry[prefix + "us"] = ms * 1e3
            entry[prefix + "host_us"] = statistics.median(x["host_us"] for x in details[(name,
                                                                                        variant)])
            entry[prefix + "calls_per_window"] = details[(name, variant)][-1]["calls_per_window"]
            if any(x.get("host_bound") for x in details[(name, variant)]):
                entry[prefix + "host_bound"] = True
        if not torch.equal(cache_seqlens, seqlens_before):
            row["cache_seqlens_changed"] = True
        add_rates(row, args.fp8_tol if fp8 else args.tol, self.builds)
        return row


def not_run(name, variant, fp8):
    """Why a library's call is not made on a row (None: it is): FA4 has no FP8 on sm90
    (FA4_FP8) and no append (FA4_APPEND)."""
    if name != "FA4":
        return None
    return FA4_FP8 if fp8 else FA4_APPEND if variant == "append" else None


def add_rates(row, tol, builds=(DEFAULT_BUILD,)):
    """GB/s (decode) or TFLOP/s (prefill) of every timed library, the append cost over plain,
    the ratios of each fa4cpp build to cuDNN, FA3 and FA4 (<build>_vs_cudnn, <build>_vs_fa3,
    <build>_vs_fa4) and of each later build to the first (<build>_vs_<first>), and the flags of
    differences over tol."""
    libs = row["libs"]
    if row["kind"] == "decode":
        amount, unit, per = row["kv_bytes"], "gbps", 1e9
    else:
        amount = attention_flops(row["batch"], row["heads_q"], row["seqlen_q"], row["cache_len"],
                                 row["head_dim"], True)
        row["flops"] = amount
        unit, per = "tflops", 1e12
    for entry in libs.values():
        if "ms" in entry:
            entry[unit] = amount / (entry["ms"] * 1e-3) / per
        if "ms" in entry and "append_ms" in entry:
            entry["append_over_plain_us"] = (entry["append_ms"] - entry["ms"]) * 1e3
    for build in builds:
        mine = libs.get(build, {}).get(unit)
        for name, key in (("cuDNN", "_vs_cudnn"), ("FA3", "_vs_fa3"), ("FA4", "_vs_fa4")):
            other = libs.get(name, {}).get(unit)
            if mine and other:
                row[build + key] = mine / other
    first = libs.get(builds[0], {}).get(unit)
    for build in builds[1:]:
        mine = libs.get(build, {}).get(unit)
        if mine and first:
            row["%s_vs_%s" % (build, builds[0])] = mine / first
    flagged = []
    for name, entry in libs.items():
        for k, value in entry.items():
            if "max_abs_diff_vs_" in k:  # against the reference or the first build
                if not value <= tol:  # NaN is flagged too
                    flagged.append("%s %s %.3g" % (name, k, value))
    row["flagged"] = flagged


def prefill_ratios(rows):
    """Each library's paged / contiguous TFLOP/s in the prefill rows (same run)."""
    base = {}
    for row in rows:
        if row.get("kind") != "prefill":
            continue
        for name, entry in row.get("libs", {}).items():
            if row["page_size"] == 0 and "tflops" in entry:
                base[name] = entry["tflops"]
            elif row["page_size"] and "tflops" in entry and name in base:
                entry["vs_contiguous"] = entry["tflops"] / base[name]


def shape_key(row):
    """A row's shape, its cache dtype aside: a shape's bf16 and e4m3 rows share it."""
    return tuple(sorted((k, v) for k, v in row.items()
                        if k in ("kind", "heads_q", "heads_kv", "head_dim", "batch", "seqlen_q",
                                 "cache_len", "page_size", "ragged", "causal")))


def seed_indices(rows):
    """The index each row's lengths, pages and descales are drawn with: the first row of its
    shape's (its position when every shape has one row), so that a shape's e4m3 row reads the
    lengths and pages of its bf16 row and their times compare."""
    first = {}
    return [first.setdefault(shape_key(row), i) for i, row in enumerate(rows)]


def kv_dtype_ratios(rows):
    """Each library's e4m3 time / bf16 time (time_vs_bf16, below 1 where e4m3 is faster) in the
    e4m3 decode rows whose shape also has a bf16 row where the library ran (same run)."""
    base = {}
    for row in rows:
        if row.get("kind") == "decode" and kv_dtype(row) == "bf16":
            base[shape_key(row)] = row
    for row in rows:
        if row.get("kind") != "decode" or kv_dtype(row) != "e4m3":
            continue
        twin = base.get(shape_key(row))
        if twin is None:
            continue
        for name, entry in row.get("libs", {}).items():
            other = twin.get("libs", {}).get(name, {})
            if "ms" in entry and "ms" in other:
                entry["time_vs_bf16"] = entry["ms"] / other["ms"]


# -- result files ---------------------------------------------------------------------------------

def fmt_rate(entry, unit, digits):
    if unit in entry:
        return "%.*f (%.1f)%s" % (digits, entry[unit], entry["us"],
                                  "†" if entry.get("host_bound") else "")
    if "refused" in entry:
        return "n/a"
    return "—"


def fmt_ratio(row, key):
    return "%.2f" % row[key] if key in row else "—"


def na_notes(rows, names):
    """Lines listing each library's distinct refusal reasons in these rows, with counts."""
    seen = {}
    for row in rows:
        for name in names:
            entry = row.get("libs", {}).get(name, {})
            for key in ("refused", "append_refused"):
                if key in entry:
                    what = "append" if key.startswith("append") else "plain"
                    seen.setdefault((name, what, entry[key]), 0)
                    seen[(name, what, entry[key])] += 1
        if "error" in row:
            seen.setdefault(("row", "error", row["error"]), 0)
            seen[("row", "error", row["error"])] += 1
    return ["- n/a: %s (%s, %d row%s): %s" % (name, what, count, "" if count == 1 else "s",
                                               reason)
            for (name, what, reason), count in sorted(seen.items())]


def host_bound_note(rows):
    if any(e.get("host_bound") or e.get("append_host_bound") for x in rows
           for e in x.get("libs", {}).values()):
        return ["", "† host-bound: in some round the GPU caught up with the host in every window "
                "of this timing (the call synchronizes, or the hold was too short), so the time "
                "includes host time."]
    return []


def check_cell(row):
    if "error" in row:
        return "error"
    return "**over tol**: " + "; ".join(row["flagged"]) if row.get("flagged") else "ok"


def diff_cell(row, names, prefix=""):
    cells = []
    for name in names:
        entry = row.get("libs", {}).get(name, {})
        value = entry.get(prefix + "max_abs_diff_vs_ref")
        cells.append("%.2g" % value if value is not None else "—")
    return " / ".join(cells)


def fp8_note(r, names):
    """The paragraph on the e4m3 rows of a result that has some (names: the libraries with an
    e4m3 call, cuDNN and FA4 aside)."""
    info = r.get("fp8", {})
    fa4 = " FA4: — (%s)." % FA4_FP8 if r.get("fa4", {}).get("available") else ""
    return ("e4m3 rows (kv e4m3, --kv-dtypes): q and the caches in float8_e4m3fn, randn values "
            "drawn in bf16 (as the bf16 rows' are) divided by fp32 descales per (batch, kv head), "
            "2^u / %g with u uniform in [−%g, %g], and rounded to e4m3; each library's "
            "flash_attn_with_kvcache takes them with q_descale / k_descale / v_descale ((batch, "
            "kv heads)) and returns bf16. GB/s counts the bytes read, 1 B per element: half a "
            "bf16 row's. e4m3/bf16 time: each library's (%s) time on the e4m3 row over its time "
            "on the shape's bf16 row, which reads the same lengths through the same pages (0.5: "
            "the time halves with the bytes). Max abs diff: against the float32 reference on "
            "the dequantized values (value × descale); over %g flags the row (a GPU kernel "
            "rounds P to e4m3 for P·V). cuDNN: — (%s).%s Append+rotary: bf16 rows only (%s)." % (
                info.get("scale", FP8_SCALE), info.get("spread", FP8_SPREAD),
                info.get("spread", FP8_SPREAD), " / ".join(names), info.get("tol", FP8_TOL),
                CUDNN_FP8, fa4, FP8_APPEND))


def header(r):
    fa3 = r.get("fa3", {})
    if fa3.get("available"):
        fa3_text = "FA3 = flash_attn_interface.flash_attn_with_kvcache, version %s" % fa3.get(
            "version", "unknown")
    else:
        fa3_text = ("FA3 not importable here (%s): its columns are omitted"
                    % fa3.get("missing", "flash_attn_interface"))
    fa4 = r.get("fa4")  # absent from results written before FA4's columns
    if fa4 is None:
        fa4_text = ""
    elif fa4.get("available"):
        fa4_text = "FA4 = %s (num_splits=%s), version %s; " % (
            fa4.get("function", "%s.%s" % (FA4_MODULE, FA4_FUNC)),
            fa4.get("num_splits", FA4_NUM_SPLITS), fa4.get("version", "unknown"))
    else:
        fa4_text = ("FA4 not importable here (%s): its columns are omitted; "
                    % fa4.get("missing", FA4_MODULE))
    native = r.get("fa4cpp_ops", "")
    builds = build_names(r)
    if len(builds) == 1:
        call = "%s through fa4cpp.flash_attn_with_kvcache%s" % (
            builds[0], " (%s)" % native if native else "")
    else:
        call = "%s each through its own C ABI (%s)" % (", ".join(builds), native or "ctypes")
    dtypes = "bf16"
    if any(x.get("kind") == "decode" and kv_dtype(x) == "e4m3" for x in r.get("rows", [])):
        dtypes = "bf16 (decode also e4m3)"
    return ("%s; %s; %s; %scuDNN = SDPA under CUDNN_ATTENTION (contiguous caches). %s, d%s; "
            "%d rounds; %s" % (sweep.run_facts(r), call, fa3_text, fa4_text, dtypes,
                               r.get("head_dim", "?"), r["rounds"], r["timing"]))


def build_names(r):
    """The fa4cpp builds' column names of a result, in --lib order."""
    return [x["name"] for x in r.get("libs", [])] or [DEFAULT_BUILD]


def ratio_columns(builds, fa3, peers=("cuDNN",), fa4=False):
    """(header, row key) of a table's ratio columns: each later build / the first (the A/B), then
    each build / each peer (cuDNN, FA3, FA4)."""
    cols = [("%s/%s" % (b, builds[0]), "%s_vs_%s" % (b, builds[0])) for b in builds[1:]]
    for peer in list(peers) + (["FA3"] if fa3 else []) + (["FA4"] if fa4 else []):
        cols += [("%s/%s" % (b, peer), "%s_vs_%s" % (b, peer.lower())) for b in builds]
    return cols


def fa4_note(r):
    """The lines on FA4's calls of a result where FA4 ran (none otherwise)."""
    if not r.get("fa4", {}).get("available"):
        return []
    info = r["fa4"]
    splits = info.get("num_splits", FA4_NUM_SPLITS)
    return ["", "FA4: %s(q, k_cache, v_cache, seqused_k=cache_seqlens, page_table=page_table, "
            "causal=causal, num_splits=%s) on the same caches (%s); a row's first call, where "
            "FA4 compiles its kernel, is the row's check, before any timing. Append+rotary: no "
            "FA4 column (%s). e4m3 rows: FA4 — (%s)." % (
                info.get("function", "%s.%s" % (FA4_MODULE, FA4_FUNC)), splits,
                "FA4's own split heuristic" if splits < 1 else
                "never split: FA4's sm90 forward has no split-KV" if splits == 1 else
                "%d splits" % splits,
                info.get("append", FA4_APPEND), info.get("fp8", FA4_FP8))]


def markdown(r):
    fa3 = r.get("fa3", {}).get("available", False)
    fa4 = r.get("fa4", {}).get("available", False)
    builds = build_names(r)
    names = builds + (["FA3"] if fa3 else []) + (["FA4"] if fa4 else []) + ["cuDNN"]
    rows = r["rows"]
    if len(builds) == 1:
        ratios = "Ratios = %s's GB/s / the other's, same row." % builds[0]
    else:
        peers = ["cuDNN"] + (["FA3"] if fa3 else []) + (["FA4"] if fa4 else [])
        ratios = ("Ratios X/Y = X's GB/s / Y's, same row: %s against the first build, then each "
                  "build against %s; the builds ran on the same caches in the same rotated "
                  "rounds." % (", ".join("%s/%s" % (b, builds[0]) for b in builds[1:]),
                               ", ".join(peers[:-1]) + " and " + peers[-1] if len(peers) > 1
                               else peers[0]))
    lines = ["# Decode and chunked prefill over a KV cache (bench/decode.py)", "", header(r),
             "", "Decode: GB/s = bytes of K + V read (sum of cache_seqlens · hkv · d · 2 · 2 B) "
             "/ time, µs per call in parentheses; %s. %s Append+rotary: one new token per "
             "sequence written into the cache (k rotated, NeoX) and q rotated, µs over the plain "
             "call. Max abs diff: each library's output for the first sequence against a float32 "
             "torch reference (%s); the JSON also has each library's against %s's over the whole "
             "batch. A difference over %g in either flags the row." % (
                 "sequence lengths drawn in [length/2, length]" if r.get("ragged") else
                 "every sequence holds the full cache length", ratios, " / ".join(names),
                 builds[0], r.get("tol", 2e-2))]
    lines += fa4_note(r)
    decode = [x for x in rows if x.get("kind") == "decode"]
    fp8 = any(kv_dtype(x) == "e4m3" for x in decode)
    if fp8:
        lines += ["", fp8_note(r, [n for n in names if n not in ("cuDNN", "FA4")])]
    lines += sweep.partial_note(r)
    skipped = r.get("skipped_rows", [])
    if skipped:
        lines += ["", "Skipped (K + V over --max-gb %g): %s." % (
            r.get("max_gb", 0), ", ".join("%d/%d b%d %s %s%s" % (
                s["heads_q"], s["heads_kv"], s["batch"], length_label(s["cache_len"]),
                layout_label(s["page_size"]), "" if kv_dtype(s) == "bf16" else " " + kv_dtype(s))
                for s in skipped))]
    gqas = []
    for x in decode:
        if (x["heads_q"], x["heads_kv"]) not in gqas:
            gqas.append((x["heads_q"], x["heads_kv"]))
    for hq, hkv in gqas:
        group = [x for x in decode if (x["heads_q"], x["heads_kv"]) == (hq, hkv)]
        ratio_cols = ratio_columns(builds, fa3, fa4=fa4)
        lnames = [n for n in names if n not in ("cuDNN", "FA4")]  # FA4: plain bf16 calls only
        head = (["b", "cache", "layout"] + (["kv"] if fp8 else [])
                + ["%s GB/s (µs)" % n for n in names]
                + [h for h, _ in ratio_cols]
                + ["append+rotary µs over plain: %s" % n for n in lnames]
                + (["e4m3/bf16 time: %s" % n for n in lnames] if fp8 else [])
                + ["max abs diff vs ref (%s)" % " / ".join(names), "check"])
        lines += ["", "## Decode, GQA %d/%d, d%d" % (hq, hkv, group[0]["head_dim"]), "",
                  "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for x in group:
            libs = x.get("libs", {})
            cells = [str(x["batch"]), length_label(x["cache_len"]),
                     layout_label(x["page_size"])] + ([kv_dtype(x)] if fp8 else [])
            cells += [fmt_rate(libs.get(n, {}), "gbps", 0) for n in names]
            cells += [fmt_ratio(x, key) for _, key in ratio_cols]
            for n in lnames:
                e = libs.get(n, {})
                cells.append("%+.1f" % e["append_over_plain_us"] if "append_over_plain_us" in e
                             else "n/a" if "append_refused" in e else "—")
            if fp8:
                cells += ["%.2f" % libs[n]["time_vs_bf16"]
                          if "time_vs_bf16" in libs.get(n, {}) else "—" for n in lnames]
            cells += [diff_cell(x, names), check_cell(x)]
            lines.append("| " + " | ".join(cells) + " |")
        notes = na_notes(group, names)
        lines += [""] + notes if notes else []
    prefill = [x for x in rows if x.get("kind") == "prefill"]
    if prefill:
        p = prefill[0]
        lnames = [n for n in names if n != "cuDNN"]
        pairs = visible_pairs(p["seqlen_q"], p["cache_len"], True)
        ratio_cols = ratio_columns(builds, fa3, peers=(), fa4=fa4)
        head = (["layout"] + ["%s TFLOP/s (µs)" % n for n in lnames]
                + [h for h, _ in ratio_cols]
                + ["%s paged/contiguous" % n for n in lnames]
                + ["max abs diff vs ref (%s)" % " / ".join(lnames), "check"])
        lines += ["", "## Chunked prefill: %d queries against %s keys, causal (bottom-right), "
                  "GQA %d/%d, b %d, d%d" % (p["seqlen_q"], length_label(p["cache_len"]),
                                            p["heads_q"], p["heads_kv"], p["batch"],
                                            p["head_dim"]), "",
                  "The chunk is the last %d positions of each sequence; its keys are in the "
                  "cache. TFLOP/s = 4 · b · hq · d · %d visible (query, key) pairs per head / "
                  "time (sq · (sk − sq) + sq · (sq + 1) / 2). cuDNN: %s." % (
                      p["seqlen_q"], pairs, CUDNN_PREFILL), "",
                  "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for x in prefill:
            libs = x.get("libs", {})
            cells = [layout_label(x["page_size"])]
            cells += [fmt_rate(libs.get(n, {}), "tflops", 1) for n in lnames]
            cells += [fmt_ratio(x, key) for _, key in ratio_cols]
            cells += ["%.2f" % libs[n]["vs_contiguous"] if "vs_contiguous" in libs.get(n, {})
                      else "—" for n in lnames]
            cells += [diff_cell(x, lnames), check_cell(x)]
            lines.append("| " + " | ".join(cells) + " |")
        notes = na_notes(prefill, lnames)
        lines += [""] + notes if notes else []
    lines += host_bound_note(rows)
    return "\n".join(lines) + "\n"


PLOT_BATCHES = (1, 64)
PLOT_GQA = (32, 8)


def plot(result, path):
    """GB/s against cache length at GQA 32/8 for batch 1 and 64: one line per library, layout and
    cache dtype (e4m3 lines thinner, square markers). Returns the path, or None when matplotlib is
    missing or there is nothing to draw."""
    rows = [x for x in result["rows"] if x.get("kind") == "decode"
            and (x["heads_q"], x["heads_kv"]) == PLOT_GQA and x["batch"] in PLOT_BATCHES]
    if not rows:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batches = [b for b in PLOT_BATCHES if any(x["batch"] == b for x in rows)]
    fig, axes = plt.subplots(1, len(batches), figsize=(6.0 * len(batches), 4.6), squeeze=False)
    builds = build_names(result)
    order = builds + ["FA3", "FA4", "cuDNN"]
    colors = {"FA3": "C1", "cuDNN": "C2", "FA4": "C9"}  # builds: C0, C3, C4, ...
    colors.update({b: "C%d" % (0 if i == 0 else i + 2) for i, b in enumerate(builds)})
    styles = {0: "-", 16: ":", 64: "--", 256: "-."}
    for ax, b in zip(axes[0], batches):
        lines = {}
        for x in rows:
            if x["batch"] != b:
                continue
            for name, entry in x.get("libs", {}).items():
                if "gbps" in entry:
                    lines.setdefault((name, x["page_size"], kv_dtype(x)), []).append(
                        (x["cache_len"], entry["gbps"]))
        for (name, page, dt), points in sorted(lines.items(), key=lambda kv: (
                order.index(kv[0][0]) if kv[0][0] in order else 99, kv[0][1], kv[0][2])):
            points.sort()
            fp8 = dt == "e4m3"
            ax.plot([s for s, _ in points], [g for _, g in points], marker="s" if fp8 else "o",
                    color=colors.get(name), linestyle=styles.get(page, "-"),
                    linewidth=1.0 if fp8 else 1.5,
                    label="%s, %s%s" % (name, layout_label(page), ", e4m3" if fp8 else ""))
        lens = sorted({x["cache_len"] for x in rows if x["batch"] == b})
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens, [length_label(n) for n in lens])
        ax.set_title("batch %d, GQA %d/%d, d%d" % ((b,) + PLOT_GQA + (rows[0]["head_dim"],)))
        ax.set_xlabel("cache length")
        ax.set_ylabel("GB/s of K + V")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=7)
    gpu = result.get("gpu_before", {}).get("name", "GPU")
    dtypes = "bf16 and e4m3" if any(kv_dtype(x) == "e4m3" for x in rows) else "bf16"
    fig.suptitle("Decode over a KV cache, %s, %s — fa4cpp %s, one run"
                 % (dtypes, gpu, result["git_sha"]), fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- main -----------------------------------------------------------------------------------------

def find_peer(name, func_name, dists, placeholders=()):
    """(the function, version) of peer `name` of sweep.OTHERS (FA3, FA4) through sweep's import,
    or (None, why not); the version as module_version reads it from the module or dists."""
    found, missing = sweep.find_others()
    module_name = next(m for n, m, _ in sweep.OTHERS if n == name)
    if name not in found:
        return None, missing.get(name, "%s: not found" % module_name)
    module = importlib.import_module(module_name)
    func = getattr(module, func_name, None)
    if func is None:
        return None, "%s has no %s" % (module_name, func_name)
    return func, module_version(module, dists, placeholders)


def find_fa3():
    """FlashAttention-3's flash_attn_with_kvcache and version (find_peer)."""
    return find_peer("FA3", "flash_attn_with_kvcache",
                     ("flash_attn_3", "flash-attn-3", "flashattn-hopper"))


def module_version(module, dists, placeholders=()):
    """A module's __version__ (unless one of placeholders), else the first of the distributions
    dists that is installed, else "unknown"."""
    version = getattr(module, "__version__", None)
    if version in placeholders:
        version = None
    for dist in dists:
        if version:
            break
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return version or "unknown"


def find_fa4():
    """FlashAttention-4's (flash_attn.cute) flash_attn_varlen_func and version (find_peer).
    flash_attn.cute sets __version__ from a distribution named fa4 and to "0.0.0" without one (the
    flash-attn-4 wheel is not so named): that placeholder reads as no version, and the wheel's own
    is looked up instead."""
    return find_peer("FA4", FA4_FUNC, ("flash-attn-4", "flash_attn_4", "fa4"),
                     placeholders=("0.0.0",))


def fa4_kvcache(func, num_splits=FA4_NUM_SPLITS):
    """flash_attn_with_kvcache's plain call, with the arguments this script passes, through FA4's
    flash_attn_varlen_func (func): q (b, sq, hq, d) and the caches as they are, contiguous (b,
    capacity, hkv, d) or paged (pages, page size, hkv, d) with page_table (b, pages) int32;
    cache_seqlens (int32, (b,)) as seqused_k, the keys each sequence reads. FA4's causal mask is
    aligned bottom-right, as FlashAttention-3's. num_splits: FA4_NUM_SPLITS says why 1. It
    returns (out, lse) (lse None unless asked for), which Bench's call reduces to out. No
    descales and no append (not_run keeps those rows and calls from it)."""
    def call(q, k_cache, v_cache, cache_seqlens=None, page_table=None, causal=False):
        return func(q, k_cache, v_cache, seqused_k=cache_seqlens, page_table=page_table,
                    causal=causal, num_splits=num_splits)
    return call


def c_abi_kvcache(fa4):
    """flash_attn_with_kvcache, with the arguments this script passes, through one build's C ABI
    (fa4: its c_abi.Library): the checks and parameters of the package's Python implementation
    of the op (fa4cpp.ops), the output and LSE allocated per call, the build's forward. A refusal
    raises the library's Fa4Error. Every build of a several-build run is called so: the package's
    torch ops bind one library per process."""
    from fa4cpp import ops

    def call(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
             cache_seqlens=None, page_table=None, causal=False, rotary_interleaved=True,
             q_descale=None, k_descale=None, v_descale=None):
        descales = (q_descale, k_descale, v_descale)
        ops._check_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                           None, None, page_table, None, None, 0, descales)
        params = ops._kvcache_params(q, k, rotary_cos, cache_seqlens, None, None, page_table,
                                     None, None, 0, 0.0, bool(causal), -1, -1, 0.0,
                                     bool(rotary_interleaved), 0, descales)
        ops._check_params(params)
        out_shape, lse_shape = ops._kvcache_shapes(q, v_cache, None)
        out = q.new_empty(out_shape, dtype=ops.output_dtype(q, k))
        lse = q.new_empty(lse_shape, dtype=torch.float32)
        fa4.forward(q, k_cache, v_cache, out, lse, params, k, v,
                    (rotary_cos, rotary_sin) if rotary_cos is not None else None)
        return out
    return call


def load_libraries(args):
    """The fa4cpp builds of args.libs: ({column: flash_attn_with_kvcache}, [build as
    sweep.ResultFile records it], how they are called). One build goes through the package
    (FA4CPP_LIBRARY set to its --lib, its --lib-env in the environment the package reads its
    overrides from); several through their own C ABI each (c_abi_kvcache; sweep.Build, which
    passes each its --lib-env), the package imported with the first one's library for its
    checks."""
    first_path = args.libs[0][1]
    if first_path:
        os.environ["FA4CPP_LIBRARY"] = os.path.abspath(first_path)
    if len(args.libs) == 1:
        os.environ.update(args.lib_env.get(args.libs[0][0], {}))
    sys.path.insert(0, os.path.join(REPO, "python"))
    import fa4cpp
    from fa4cpp import _library, ops

    fa4cpp.set_mode(fallback=False, verify=0.0)  # a refusal must raise, never run the reference
    if len(args.libs) == 1:
        name = args.libs[0][0]
        build = types.SimpleNamespace(name=name, path=_library.library_path(),
                                      version=fa4cpp.__version__, deterministic=False,
                                      env=dict(args.lib_env.get(name, {})),
                                      has_rescale_counts=lambda: False)
        how = ("native torch ops" if ops.native_ops()[0] else
               "the package's Python implementation of the ops")
        return {name: fa4cpp.flash_attn_with_kvcache}, [build], how
    builds = [sweep.Build(name, path, env=args.lib_env.get(name)) for name, path in args.libs]
    how = ("ctypes; the checks and parameters of the package's Python implementation of "
           "flash_attn_with_kvcache, the same for every build")
    return {b.name: c_abi_kvcache(b.fa4) for b in builds}, builds, how


def main(argv=None):
    args = parse_args(argv)
    rows, skipped = plan(args)
    if args.dry_run:
        for row in rows:
            print("%-7s %d/%d b%-3d %5s %-10s %-4s K+V %.3f GB" % (
                row["kind"], row["heads_q"], row["heads_kv"], row["batch"],
                length_label(row["cache_len"]), layout_label(row["page_size"]), kv_dtype(row),
                row_kv_bytes(row) / 1e9))
        for s in skipped:
            print("skipped %d/%d b%d %s %s%s: %s" % (
                s["heads_q"], s["heads_kv"], s["batch"], length_label(s["cache_len"]),
                layout_label(s["page_size"]), "" if kv_dtype(s) == "bf16" else " " + kv_dtype(s),
                s["reason"]))
        names = [n for n, _ in args.libs]
        print("%d rows, %d skipped; roughly %.0f s with FA3 and FA4 (%d rounds%s)"
              % (len(rows), len(skipped), estimate_seconds(rows, args, builds=names, fa4=True),
                 args.rounds, "" if len(names) == 1 else ", builds " + ", ".join(names)))
        return
    libs, builds, how = load_libraries(args)
    names = list(libs)
    fa3, fa3_info = find_fa3()
    if fa3 is not None and args.fa3_version:
        fa3_info = args.fa3_version
    if fa3 is not None:
        libs["FA3"] = fa3
    fa4, fa4_info = find_fa4()
    if fa4 is not None and args.fa4_version:
        fa4_info = args.fa4_version
    if fa4 is not None:
        libs["FA4"] = fa4_kvcache(fa4, args.fa4_num_splits)
    torch.manual_seed(args.seed)
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    l2 = getattr(props, "L2_cache_size", 50 * 2 ** 20)
    timer = Timer(args.reps, args.window_us, args.min_windows, args.max_timing_ms)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = args.name or "%s_%s_decode%s" % (date, args.sha, "_smoke" if args.smoke else "")
    timing = ("back-to-back calls in windows of >= %g µs (CUDA events per window, the stream "
              "held by a spin kernel while the host queues the window), >= %d calls and >= %d "
              "windows per timing, median window; median of %d rounds, the (library, call) pairs "
              "in rotated order; caches copied %d× past the L2 (%d MB) and read in turn"
              % (args.window_us, args.reps, args.min_windows, args.rounds, L2_FACTOR,
                 l2 // 2 ** 20))
    opts = {k: v for k, v in vars(args).items()
            if k not in ("sha", "out", "name", "lib", "libs", "lib_env")}
    extra_fp8 = {}
    if "e4m3" in args.kv_dtypes:
        extra_fp8 = {"fp8": {
            "tol": args.fp8_tol, "scale": FP8_SCALE, "spread": FP8_SPREAD,
            "descales": "fp32 (batch, heads_kv) 2^u / scale, u uniform in [-spread, spread]; "
                        "e4m3 = randn drawn in bf16 / descale, rounded (saturating at 448)",
            "bytes": "1 byte per cached element", "cudnn": CUDNN_FP8, "append": FP8_APPEND}}
    run = sweep.ResultFile(args.out, name, markdown, "decode and chunked prefill over a KV cache "
                           "(bench/decode.py)", args.sha, builds, args.rounds, extra={
                               "timing": timing, "head_dim": args.hdim, "ragged": args.ragged,
                               "tol": args.tol, "max_gb": args.max_gb, "options": opts,
                               "skipped_rows": skipped,
                               "fa3": {"available": True, "version": fa3_info} if fa3 else
                               {"available": False, "missing": fa3_info},
                               "fa4": {"available": True, "version": fa4_info,
                                       "function": "%s.%s" % (FA4_MODULE, FA4_FUNC),
                                       "num_splits": args.fa4_num_splits, "fp8": FA4_FP8,
                                       "append": FA4_APPEND} if fa4 else
                               {"available": False, "missing": fa4_info},
                               "fa4cpp_ops": how,
                               "l2_bytes": l2,
                               "bytes": "sum(cache_seqlens) * hkv * d * 2 tensors * 2 bytes "
                                        "(1 byte for e4m3 caches)",
                               "flops": "4 * b * hq * d * visible pairs (bottom-right causal)",
                               "cudnn_prefill": CUDNN_PREFILL, **extra_fp8})
    print("%d rows, %d skipped; roughly %.0f s" % (len(rows), len(skipped),
                                                    estimate_seconds(rows, args, fa3 is not None,
                                                                     l2_bytes=l2, builds=names,
                                                                     fa4=fa4 is not None)),
          flush=True)
    bench = Bench(args, libs, timer, l2, builds=names)
    done = []
    for index, row in zip(seed_indices(rows), rows):
        try:
            bench.measure(row, index)
        except Exception as e:  # out of memory, or anything else: the row says so, the run goes on
            row["error"] = sweep.first_line(e)
        done.append(row)
        prefill_ratios(done)
        kv_dtype_ratios(done)
        torch.cuda.empty_cache()
        run.add(row)
    run.finish()
    if not args.no_plot:
        path = plot(run.result, os.path.join(args.out, name + ".png"))
        print(path or "no plot (no GQA %d/%d rows at batch 1 or 64, or no matplotlib)" % PLOT_GQA)


if __name__ == "__main__":
    main()
