"""Variable-length batches: one or more builds of fa4cpp beside cuDNN (torch SDPA,
CUDNN_ATTENTION) and torch's FlashAttention-2 on the same packed tensors, timed like
bench/sweep.py (whose pieces this reuses). The anchors take the batch as a nested (jagged) tensor;
where cuDNN refuses one it runs on the batch padded to its longest sequence, and the table says
so. TFLOP/s count the (query, key) pairs each sequence's mask leaves visible (4·hq·d per pair).
Writes <out>/<name>.json and .md.

The batches are the ones where the order of the tiles matters (src/sm90/fwd/tile_order.cuh): lengths
drawn at random, a long sequence last or first among short ones, many short sequences. With
--lib-env (bench/sweep.py) one library, copied under two paths, measures both orders in the
same run:

  cp build/libfa4.so /tmp/input/libfa4.so
  python3 bench/varlen.py --lib longest=build/libfa4.so --lib input=/tmp/input/libfa4.so \\
      --lib-env input:FA4_SM90_TILE_ORDER=input --rounds 2 --sha $(git rev-parse --short HEAD) \\
      --out DIR
"""
import random

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import sweep

fa4_ctypes = sweep.fa4_ctypes


def _random_lengths(seed, count, lo, hi):
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(count)]


# (name, sequence lengths, heads_q, heads_kv, head_dim, causal). Self-attention: len_q = len_k.
SHAPES = (
    ("random 256-8k", _random_lengths(0, 16, 256, 8192), 16, 16, 128, False),
    ("random 256-8k", _random_lengths(0, 16, 256, 8192), 16, 16, 128, True),
    ("15x1k, 16k last", [1024] * 15 + [16384], 16, 16, 128, False),
    ("15x1k, 16k last", [1024] * 15 + [16384], 16, 16, 128, True),
    ("16k first, 15x1k", [16384] + [1024] * 15, 16, 16, 128, True),
    ("random 1k-16k GQA", _random_lengths(1, 8, 1024, 16384), 64, 8, 128, True),
    ("random 256-8k d64", _random_lengths(2, 32, 256, 8192), 32, 32, 64, True),
    ("256x 16-512", _random_lengths(3, 256, 16, 512), 16, 16, 128, True),
)


def visible_pairs(n, causal):
    """(query, key) pairs a sequence of n queries and n keys computes."""
    return n * (n + 1) // 2 if causal else n * n


def nested(x, offsets):
    """The packed (total, heads, dim) tensor as SDPA's nested (batch, heads, j, dim)."""
    return torch.nested.nested_tensor_from_jagged(x, offsets.to(torch.int64)).transpose(1, 2)


def anchor_fn(backend, q, k, v, offsets, lens, causal):
    """SDPA's closure on the nested batch; cuDNN refusing it: on the padded batch (padded=True)."""
    gqa = q.shape[1] != k.shape[1]
    qn, kn, vn = (nested(x, offsets) for x in (q, k, v))

    def run_nested():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                qn, kn, vn, is_causal=causal, enable_gqa=gqa)

    try:
        run_nested()
        torch.cuda.synchronize()
        return run_nested, False, lambda o: o.transpose(1, 2).values()
    except Exception as e:  # RuntimeError, NotImplementedError, ...: no nested support here
        if backend != SDPBackend.CUDNN_ATTENTION:
            raise RuntimeError(str(e)) from e
    longest = max(lens)
    padded = [torch.zeros(len(lens), longest, x.shape[1], x.shape[2], device=x.device,
                          dtype=x.dtype) for x in (q, k, v)]
    for b, n in enumerate(lens):
        for dst, src in zip(padded, (q, k, v)):
            dst[b, :n] = src[int(offsets[b]):int(offsets[b]) + n]
    dense = sweep.sdpa_fn(backend, *padded, causal)
    unpad = lambda o: torch.cat([o[b, :, :n].transpose(0, 1) for b, n in enumerate(lens)])
    return dense, True, unpad


def measure(builds, rounds, lens, hq, hkv, d, causal):
    total = sum(lens)
    offsets = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                           device="cuda")
    q = torch.randn(total, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(total, hkv, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    params = fa4_ctypes.Params(causal=causal, cu_seqlens_q=offsets, cu_seqlens_k=offsets,
                               max_seqlen_q=max(lens), max_seqlen_k=max(lens))
    row = {"libs": {}}
    cudnn, padded, unpack = anchor_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, offsets, lens, causal)
    row["cudnn_padded"] = padded
    ref = unpack(cudnn())

    def first_run(bld, entry):
        run = bld.fa4.forward_fn(q, k, v, out, params=params)
        out.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        return run

    runs = sweep.checked_builds(row, builds, first_run,
                                lambda: (out.float() - ref.float()).abs().max().item())
    try:
        fa2, _, _ = anchor_fn(SDPBackend.FLASH_ATTENTION, q, k, v, offsets, lens, causal)
    except RuntimeError as e:
        fa2 = None
        row["fa2_refused"] = str(e).splitlines()[0][:200]
    sweep.time_rounds(row, rounds, cudnn, fa2, runs)
    return row


def main():
    args, builds = sweep.script_args(__doc__, "varlen")
    torch.manual_seed(0)
    run = sweep.ResultFile(args.out, args.name, markdown,
                           "variable-length batches (bench/varlen.py)",
                           args.sha, builds, args.rounds)
    for name, lens, hq, hkv, d, causal in SHAPES:
        row = {"batch": name, "sequences": len(lens), "tokens": sum(lens), "longest": max(lens),
               "heads_q": hq, "heads_kv": hkv, "head_dim": d, "causal": causal, "dtype": "bf16"}
        row.update(measure(builds, args.rounds, lens, hq, hkv, d, causal))
        sweep.add_rates(row, 4.0 * hq * d * sum(visible_pairs(n, causal) for n in lens))
        run.add(row)

    run.finish()


def markdown(r):
    names = [x["name"] for x in r["libs"]]
    lines = [
        "# Variable-length batches: forward TFLOP/s", "",
        "%s; normal inputs, bf16, len_q = len_k per sequence; %s. TFLOP/s = 4·hq·d·(visible "
        "pairs) / time. Ratio = fa4cpp build / cuDNN, same run, same tensors; cuDNN* = on the "
        "batch padded to its longest sequence (it refused the nested one)."
        % (sweep.run_facts(r), r["timing"]),
    ] + sweep.partial_note(r) + [""] + \
        sweep.table_head(["batch", "seqs", "tokens", "d", "hq/hkv", "causal"], names)
    cell = lambda d, k: "%.1f" % d[k + "tflops"] if k + "tflops" in d else "—"
    for x in r["rows"]:
        cudnn = cell(x, "cudnn_") + ("*" if x.get("cudnn_padded") else "")
        lines.append("| %s | %d | %d | %d | %d/%d | %s | " % (
            x["batch"], x["sequences"], x["tokens"], x["head_dim"], x["heads_q"], x["heads_kv"],
            "yes" if x["causal"] else "no") + sweep.table_cells(x, names, cell, cudnn))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
