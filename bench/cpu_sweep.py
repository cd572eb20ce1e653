"""fa4cpp's CPU backend beside torch's CPU attention, on the same machine and tensors, in one run:
the forward against F.scaled_dot_product_attention (torch's CPU flash-attention kernel), the
backward against its autograd backward, at each thread count (fa4cpp's cpu_threads override and
torch.set_num_threads). Writes <out>/cpu_sweep.json and .md; prints the markdown table last.

    FA4CPP_LIBRARY=build/cpu/libfa4.so PYTHONPATH=python python bench/cpu_sweep.py \\
        --sha $(git rev-parse --short HEAD) --out bench/results/...

Each time is the median of --rounds rounds, each round timing every library in turn (the order
rotated round by round) as the median of --reps calls after a warm-up call. GFLOP/s use
FlashAttention's count (4·b·h·sq·sk·d forward, halved with a causal mask; the backward 2.5×).
Shapes: batch 2, 16 heads unless --heads, d64 and d128, 512 to 4k (--seqlens)."""
import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from fa4cpp import _library, c_abi  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def flops(b, h, s, d, causal, backward):
    f = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return f * (2.5 if backward else 1.0)


def time_median(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_row(lib, b, h, s, d, dtype, causal, threads, backward, rounds, reps):
    g = torch.Generator().manual_seed(s * 131 + d)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g).to(dtype) for _ in range(4))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, dtype=torch.float32)
    grads = [torch.empty_like(q) for _ in range(3)]
    params = c_abi.Params(causal=causal)
    lib.overrides = lib.make_overrides(cpu_threads=threads)
    lib.forward(q, k, v, out, lse, params)

    def fa4():
        if backward:
            lib.backward(dout, q, k, v, out, lse, *grads, params)
        else:
            lib.forward(q, k, v, out, lse, params)

    # torch wants (b, h, s, d): views of the same memory.
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))
    leaves = [t.detach().requires_grad_() for t in (qt, kt, vt)]

    def torch_sdpa():
        torch.set_num_threads(threads)
        if backward:
            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(o, leaves, dt)
        else:
            with torch.no_grad():
                F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    libs = {"fa4cpp": fa4, "torch": torch_sdpa}
    samples = {name: [] for name in libs}
    names = list(libs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].append(time_median(libs[name], reps))
    work = flops(b, h, s, d, causal, backward)
    row = {"pass": "backward" if backward else "forward", "dtype": [k for k, v in DTYPES.items()
                                                                   if v == dtype][0],
           "batch": b, "heads": h, "seqlen": s, "head_dim": d, "causal": causal,
           "threads": threads}
    for name, times in samples.items():
        sec = statistics.median(times)
        row[name + "_ms"] = sec * 1e3
        row[name + "_gflops"] = work / sec / 1e9
    row["ratio"] = row["torch_ms"] / row["fa4cpp_ms"]
    return row


def markdown(result):
    lines = ["# fa4cpp CPU backend beside torch's CPU SDPA", "",
             "git %s, %s, %d cores (%s), torch %s; %s." % (
                 result["git_sha"], result["cpu"], result["cores"], result["machine"],
                 result["torch"], result["timing"]), "",
             "| pass | dtype | d | seqlen | causal | threads | fa4cpp GFLOP/s | torch GFLOP/s | "
             "fa4cpp / torch |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append("| %s | %s | %d | %d | %s | %d | %.1f | %.1f | %.2f |" % (
            r["pass"], r["dtype"], r["head_dim"], r["seqlen"], "yes" if r["causal"] else "no",
            r["threads"], r["fa4cpp_gflops"], r["torch_gflops"], r["ratio"]))
    return "\n".join(lines) + "\n"


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="512,1024,2048,4096")
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--threads", default=None,
                    help="comma-separated thread counts (default: 1, 2 and all cores)")
    ap.add_argument("--passes", default="forward,backward")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sha", default="unknown")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    threads = ([int(t) for t in args.threads.split(",")] if args.threads
               else sorted({1, min(2, cores), cores}))
    lib = c_abi.Library(_library.library_path())
    result = {
        "benchmark": "cpu_sweep", "git_sha": args.sha, "cpu": cpu_name(), "cores": cores,
        "machine": platform.machine(), "torch": torch.__version__,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "timing": "median of %d rounds (libraries in rotated order), each the median of %d calls "
                  "after a warm-up" % (args.rounds, args.reps),
        "rows": []}
    for backward in [p == "backward" for p in args.passes.split(",")]:
        for dtype in (DTYPES[d] for d in args.dtypes.split(",")):
            for d in (int(x) for x in args.hdims.split(",")):
                for s in (int(x) for x in args.seqlens.split(",")):
                    for causal in (False, True):
                        for t in threads:
                            row = make_row(lib, args.batch, args.heads, s, d, dtype, causal, t,
                                           backward, args.rounds, args.reps)
                            result["rows"].append(row)
                            print(json.dumps(row), flush=True)
    md = markdown(result)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cpu_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "cpu_sweep.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
