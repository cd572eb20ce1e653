"""The kernels of one short-cache decode call and their durations, fa4cpp beside FlashAttention-3
and cuDNN: batch 1 (and 4), d128, 1k keys, GQA 8/1 and 32/8, a contiguous cache and pages of 16.
torch.profiler (CUPTI) over 40 calls, medians. Under the profiler the host issues calls more
slowly than the GPU runs them, so the gaps between a call's kernels are the host's wherever the
second kernel is not a dependent launch; the kernels' own durations are what this is for (the
decode benchmark, bench/decode.py, times the calls).

    PYTHONPATH=python:<FA3's build> FA4CPP_LIBRARY=<libfa4.so> python3 bench/decode_kernels.py

(run as a script from the tree: it takes sweep.py's SDPA call from beside it)
"""
import statistics

import torch
from torch.nn.attention import SDPBackend

import fa4cpp
import flash_attn_interface as fa3
import sweep

torch.manual_seed(0)
dev, dt, d = "cuda", torch.bfloat16, 128


def calls(b, hq, hkv, n, page):
    """{library: one decode call} over a cache of n keys (pages of `page` keys, 0: contiguous)."""
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
    if page:
        per = n // page
        table = torch.randperm(b * per, device=dev).view(b, per).to(torch.int32)
        kc, vc = (torch.randn(b * per, page, hkv, d, device=dev, dtype=dt) for _ in range(2))
    else:
        table = None
        kc, vc = (torch.randn(b, n, hkv, d, device=dev, dtype=dt) for _ in range(2))
    def kvcache(func):
        return lambda: sweep._first(func(q, kc, vc, cache_seqlens=seqlens, page_table=table))
    out = {"fa4cpp": kvcache(fa4cpp.flash_attn_with_kvcache),
           "FA3": kvcache(fa3.flash_attn_with_kvcache)}
    if not page:  # cuDNN through SDPA reads contiguous caches only
        out["cuDNN"] = sweep.sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, kc, vc, False)
    return out


def profile(fn, reps=40):
    """The kernels of one call: names, median durations, median gaps between them, and the
    median span from the first kernel's start to the last's end (µs)."""
    for _ in range(10): fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events()
                 if e.device_type == torch.autograd.DeviceType.CUDA
                 and e.time_range.elapsed_us() >= 0
                 and "Memcpy" not in e.name and "Memset" not in e.name),
                key=lambda e: e.time_range.start)
    per = len(ev) // reps
    names = [e.name[:38] for e in ev[:per]]
    durs = [[ev[r * per + i].time_range.elapsed_us() for r in range(reps)] for i in range(per)]
    gaps = [[ev[r * per + i].time_range.start - ev[r * per + i - 1].time_range.end
             for r in range(reps)] for i in range(1, per)]
    span = [ev[r * per + per - 1].time_range.end - ev[r * per].time_range.start
            for r in range(reps)]
    med = statistics.median
    return names, [med(x) for x in durs], [med(x) for x in gaps], med(span)


for b, hq, hkv, page in ((1, 8, 1, 0), (1, 8, 1, 16), (1, 32, 8, 0), (4, 32, 8, 0), (1, 32, 8, 16)):
    for name, fn in calls(b, hq, hkv, 1024, page).items():
        names, durs, gaps, span = profile(fn)
        kernels = " + ".join(f"{n.split('<')[0][-24:]} {t:.2f}" for n, t in zip(names, durs))
        print(f"b{b} {hq}/{hkv} pages {page} {name:7s} first kernel's start to last's end "
              f"{span:5.2f} us | {kernels} | gaps " + " ".join(f"{g:.2f}" for g in gaps),
              flush=True)
