"""Short query sequences against long key sequences with GQA: decode (one query row), speculative
steps and chunked prefill, where pack-GQA matters (docs/sm90_forward.md). One or more builds of
fa4cpp beside cuDNN (torch SDPA, CUDNN_ATTENTION) and torch's FlashAttention-2 on the same tensors,
no mask, timed like bench/sweep.py (whose pieces this reuses). Reports TFLOP/s (4·b·hq·sq·sk·d)
and, for decode, GB/s of K and V read (docs/benchmarks.md). Writes <out>/<name>.json and .md.

  python3 bench/gqa_short.py --lib base=/tmp/base/libfa4.so --lib new=build/libfa4.so \\
      --rounds 2 --sha $(git rev-parse --short HEAD) --out DIR
"""

import torch

import sweep

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim). Decode at b·s_kv = 256k
# (docs/benchmarks.md; few sequences: split-KV), then a few query rows (speculative decoding) and chunks of a
# prefill.
SHAPES = (
    (64, 1, 4096, 32, 8, 128),
    (8, 1, 32768, 32, 8, 128),
    (4, 1, 65536, 32, 8, 128),
    (1, 1, 262144, 32, 8, 128),
    (32, 1, 8192, 64, 8, 128),
    (64, 4, 4096, 32, 8, 128),
    (32, 16, 8192, 32, 8, 128),
    (16, 64, 4096, 32, 8, 128),
    (8, 128, 8192, 64, 8, 128),
    (64, 1, 4096, 16, 2, 64),
    (64, 1, 4096, 16, 4, 256),
)


def main():
    args, builds = sweep.script_args(__doc__, "gqa_short")
    torch.manual_seed(0)
    run = sweep.ResultFile(args.out, args.name, markdown,
                           "short queries against long keys with GQA (bench/gqa_short.py)",
                           args.sha, builds, args.rounds)
    for b, sq, sk, hq, hkv, d in SHAPES:
        q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
        row = {"batch": b, "seqlen_q": sq, "seqlen_k": sk, "heads_q": hq, "heads_kv": hkv,
               "head_dim": d, "causal": False, "dtype": "bf16"}
        try:
            row.update(sweep.measure_row(builds, args.rounds, q, k, v, out, lse, False))
        except RuntimeError as e:  # cuDNN refused the shape: no anchor, so the row keeps no rates
            row["cudnn_refused"] = str(e).splitlines()[0][:200]
            run.add(row)
            continue
        sweep.add_rates(row, 4.0 * b * hq * sq * sk * d)
        sweep.add_rates(row, 2.0 * b * sk * hkv * d * k.element_size(), "gbps", 1e9)
        run.add(row)
        del q, k, v, out, lse

    run.finish()


def markdown(r):
    names = [x["name"] for x in r["libs"]]
    lines = [
        "# Short queries, long keys, GQA: forward, GB/s of K + V (TFLOP/s)", "",
        "%s; normal inputs, bf16, no mask; %s. GB/s = bytes of K and V / time; TFLOP/s = "
        "4·b·hq·sq·sk·d / time. Ratio = fa4cpp build / cuDNN, same run, same tensors."
        % (sweep.run_facts(r), r["timing"]),
    ] + sweep.partial_note(r) + [""] + sweep.table_head(["d", "sq", "sk", "b", "hq/hkv"], names)
    cell = lambda d, k: ("%.0f (%.1f)" % (d[k + "gbps"], d[k + "tflops"])
                         if k + "gbps" in d else "—")
    for x in r["rows"]:
        cudnn = x["cudnn_refused"][:60] if "cudnn_refused" in x else None
        lines.append("| %d | %d | %d | %d | %d/%d | " % (
            x["head_dim"], x["seqlen_q"], x["seqlen_k"], x["batch"], x["heads_q"], x["heads_kv"])
            + sweep.table_cells(x, names, cell, cudnn))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
