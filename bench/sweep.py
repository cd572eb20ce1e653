"""The side-by-side forward benchmark of DESIGN.md §5, in one process: fa4cpp (sm90, through the
C ABI), cuDNN (torch SDPA, CUDNN_ATTENTION) and torch's FlashAttention-2 (SDPA FLASH_ATTENTION) on
the same tensors, each timed with triton.testing.do_bench (median). Writes <out>/<name>.json and
<out>/<name>.md; prints the markdown table last.

  python3 bench/sweep.py --lib build/default/libfa4.so --sha $(git rev-parse --short HEAD) --out DIR
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

# The ctypes binding of the C ABI lives in the Python package's folder (python/fa4cpp/c_abi.py);
# import it as a plain module so that the sweep needs no package install.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "fa4cpp"))
import c_abi as fa4_ctypes  # noqa: E402

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)


def shapes(hdims, seqlens):
    """(batch, seqlen, heads_q, heads_kv, head_dim): 16k tokens, hidden 2048, plus GQA 64/8 d128."""
    out = [(TOKENS // s, s, HIDDEN // d, HIDDEN // d, d) for d in hdims for s in seqlens]
    if 128 in hdims:
        out += [(1, s, 64, 8, 128) for s in (2048, 16384) if s in seqlens]
    return out


def flops(b, s, hq, d, causal):
    f = 4.0 * b * hq * s * s * d
    return f / 2 if causal else f


def sdpa_fn(backend, q, k, v, causal):
    # SDPA takes (batch, heads, seq, dim): transposed views of the same memory.
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    return run


def median_ms(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def gpu_facts():
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
    try:
        line = subprocess.run(["nvidia-smi", "--query-gpu=" + q, "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
        return dict(zip(q.split(","), [x.strip() for x in line.split(",")]))
    except Exception as e:  # the table is still worth having without the clocks
        return {"error": str(e)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, help="libfa4.so built with CUDA")
    ap.add_argument("--sha", required=True, help="git sha of the fa4cpp build")
    ap.add_argument("--out", required=True, help="folder for the .json and .md")
    ap.add_argument("--name", default="fwd_sweep")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    args = ap.parse_args()

    fa4 = fa4_ctypes.Library(args.lib)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    hdims = [int(x) for x in args.hdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    torch.manual_seed(0)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    facts_before = gpu_facts()

    rows = []
    for b, s, hq, hkv, d in shapes(hdims, seqlens):
        q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
        for causal in (False, True):
            row = {"batch": b, "seqlen": s, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
                   "causal": causal, "dtype": args.dtype}
            fl = flops(b, s, hq, d, causal)
            cudnn = sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
            ref = cudnn()
            try:
                run = fa4.forward_fn(q, k, v, out, lse, causal=causal)
                out.fill_(float("nan"))
                run()
                torch.cuda.synchronize()
                row["fa4_max_abs_diff_vs_cudnn"] = (out.transpose(1, 2).float() - ref.float()) \
                    .abs().max().item()
                row["fa4_ms"] = median_ms(run)
            except fa4_ctypes.Fa4Error as e:
                row["fa4_refused"] = str(e)
            row["cudnn_ms"] = median_ms(cudnn)
            try:
                row["fa2_ms"] = median_ms(sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal))
            except RuntimeError as e:  # e.g. a head dim torch's FA2 lacks
                row["fa2_refused"] = str(e).splitlines()[0]
            for key in ("fa4", "cudnn", "fa2"):
                if key + "_ms" in row:
                    row[key + "_tflops"] = fl / (row[key + "_ms"] * 1e-3) / 1e12
            if "fa4_tflops" in row:
                row["fa4_vs_cudnn"] = row["fa4_tflops"] / row["cudnn_tflops"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del q, k, v, out, lse

    result = {
        "benchmark": "forward sweep, DESIGN.md §5",
        "git_sha": args.sha,
        "fa4cpp_version": fa4.version(),
        "started_utc": started,
        "gpu_before": facts_before,
        "gpu_after": gpu_facts(),
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "timing": "triton.testing.do_bench median, warmup 25 ms, rep 100 ms",
        "flops": "4*b*h*s*s*d, halved for causal",
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, args.name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    md = markdown(result)
    with open(os.path.join(args.out, args.name + ".md"), "w") as f:
        f.write(md)
    print(md)


def markdown(r):
    g = r["gpu_before"]
    lines = [
        "# Forward, TFLOP/s (%s)" % r["benchmark"], "",
        "fa4cpp %s (git %s), %s, driver %s, SM clock %s (max %s) before the run; torch %s, "
        "cuDNN %s; %s; FLOPs %s. Ratio = fa4cpp / cuDNN, same run, same tensors."
        % (r["fa4cpp_version"], r["git_sha"], g.get("name"), g.get("driver_version"),
           g.get("clocks.sm"), g.get("clocks.max.sm"), r["torch"], r["cudnn"], r["timing"],
           r["flops"]), "",
        "| d | seqlen | b | hq/hkv | causal | fa4cpp | cuDNN | torch FA2 | fa4/cuDNN | max abs diff vs cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["rows"]:
        fmt = lambda k: "%.1f" % x[k] if k in x else "—"
        lines.append("| %d | %d | %d | %d/%d | %s | %s | %s | %s | %s | %s |" % (
            x["head_dim"], x["seqlen"], x["batch"], x["heads_q"], x["heads_kv"],
            "yes" if x["causal"] else "no", fmt("fa4_tflops"), fmt("cudnn_tflops"),
            fmt("fa2_tflops"), "%.2f" % x["fa4_vs_cudnn"] if "fa4_vs_cudnn" in x else "—",
            "%.3g" % x["fa4_max_abs_diff_vs_cudnn"] if "fa4_max_abs_diff_vs_cudnn" in x
            else x.get("fa4_refused", "—")[:60]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
