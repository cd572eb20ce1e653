"""The forward's online softmax emulated on the CPU (torch, float32 and bfloat16), to see how far
FlashAttention-4's adaptive rescale (O rescaled only when a row's max grows by more than a
threshold, in log2 units) moves O from the exact result, against the test rule of
docs/testing.md: max|X − ref| ≤ 2·max|lp − ref| + atol for O (atol 1e-5) and for LSE (atol
1e-5 + 4·ε_fp32·max|LSE|, the GPU forward's), ref in float64, lp the exact online softmax computed
the kernels' way (P in float32 relative to the row's max, rounded to bf16 for P·V, row sums of the
float32 P). A way fails a draw when O or LSE breaks the rule.

Five ways are emulated per draw, as the sm90 kernel would compute them (128-key tiles, scores
and sums in float32, P rounded to bf16 for P·V, O accumulated in float32, rounded once at the end):
  exact      threshold 0: the held max is the running max (the kernels' default);
  thr        threshold --threshold: the held max moves only past it (FA4_SM90_RESCALE_THRESHOLD_LOG2);
  thr+rsum   the same, each row summing its probabilities as rounded for P·V
             (FA4_SM90_ROUNDED_ROW_SUM): O and LSE from that sum;
  thr+dual   the same with both sums: O normalized by the rounded one, LSE from the float one;
  exact*c    threshold 0 with every probability scaled by 2^0.37 (a constant, not a power of
             two) and O normalized by its rounded sum: an exact softmax that rounds P at another
             scale than lp, which is what any held max other than the running one amounts to.
The emulation moves a row's max on its own (the kernel moves a warp's 16 rows together when one
of them must: that only moves more often). Inputs: normal, and "spiky" (a few keys whose logits
stand far above the rest, as the GPU tests' spiky inputs do).

  .venv/bin/python bench/rescale_emulation.py --draws 200
"""
import argparse
import math

import torch

LOG2E = 1.0 / math.log(2.0)


def draw(gen, rows, keys, dim, spiky):
    q = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    if spiky:
        # A few keys per row block aligned with the queries' mean direction, scaled up: their
        # logits stand 20-60 above the rest, each one dominating some rows.
        direction = q.mean(0)
        direction /= direction.norm()
        picks = torch.randint(0, keys, (4,), generator=gen)
        for i, j in enumerate(picks.tolist()):
            k[j] = direction * (8.0 + 4.0 * i) + 0.1 * k[j]
    # Inputs as the kernels see them: bf16.
    return [t.to(torch.bfloat16).to(torch.float64) for t in (q, k, v)]


def reference(q, k, v, scale):
    """O and the natural-log LSE in float64."""
    s = (q @ k.T) * scale
    p = torch.softmax(s, dim=-1)
    return p @ v, torch.logsumexp(s, dim=-1)


def online(q, k, v, scale, threshold, o_sum="float", lse_sum="float", p_log2_offset=0.0,
           tile=128):
    """The kernel's online softmax: float32 scores and sums, bf16 P, float32 O; returns O (rounded
    to bf16) and the LSE the kernel writes (held max and the log of a row sum, float32). o_sum /
    lse_sum: which row sum ("float": of the float32 P; "rounded": of P as rounded for P·V)
    normalizes O / gives the LSE. p_log2_offset: every P scaled by 2^offset (taken out of the
    LSE exactly)."""
    q32, k32, v32 = q.float(), k.float(), v.float()
    rows = q.shape[0]
    held = torch.full((rows,), -math.inf)
    sums = {"float": torch.zeros(rows), "rounded": torch.zeros(rows)}
    out = torch.zeros(rows, v.shape[1])
    for start in range(0, k.shape[0], tile):
        s = (q32 @ k32[start:start + tile].T)  # raw scores, float32
        m = torch.maximum(held, s.max(dim=1).values)
        move = ((m - held) * scale * LOG2E > threshold) | torch.isinf(held)
        new_held = torch.where(move, m, held)
        factor = torch.where(torch.isinf(held), torch.zeros(rows),
                             torch.exp2((held - new_held) * scale * LOG2E))
        out *= factor[:, None]
        for t in sums.values():
            t *= factor
        held = new_held
        p = torch.exp2(s * (scale * LOG2E) - (held * (scale * LOG2E))[:, None] + p_log2_offset)
        p_v = p.to(torch.bfloat16).float()
        sums["float"] += p.sum(dim=1)
        sums["rounded"] += p_v.sum(dim=1)
        out += p_v @ v32[start:start + tile]
    lse = held * scale + torch.log(sums[lse_sum]) - p_log2_offset * math.log(2.0)
    return (out / sums[o_sum][:, None]).to(torch.bfloat16).double(), lse.double()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--keys", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--threshold", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    scale = 1.0 / math.sqrt(args.dim)
    t = args.threshold
    ways = {"exact": dict(threshold=0.0), "thr": dict(threshold=t),
            "thr+rsum": dict(threshold=t, o_sum="rounded", lse_sum="rounded"),
            "thr+dual": dict(threshold=t, o_sum="rounded"),
            "exact*c": dict(threshold=0.0, o_sum="rounded", p_log2_offset=0.37)}
    print("| inputs | way | rule failures (O / LSE) | worst error / allowed (O / LSE) |")
    print("|---|---|---|---|")
    for spiky in (False, True):
        fails = {w: [0, 0] for w in ways}
        worst = {w: [0.0, 0.0] for w in ways}
        for _ in range(args.draws):
            q, k, v = draw(gen, args.rows, args.keys, args.dim, spiky)
            refs = reference(q, k, v, scale)
            lps = online(q, k, v, scale, 0.0)
            eps32 = torch.finfo(torch.float32).eps
            atols = (1e-5, 1e-5 + 4 * eps32 * refs[1].abs().max().item())
            allowed = [2.0 * (lp - ref).abs().max().item() + atol
                       for lp, ref, atol in zip(lps, refs, atols)]
            for w, how in ways.items():
                outs = online(q, k, v, scale, **how)
                for i in range(2):
                    err = (outs[i] - refs[i]).abs().max().item()
                    fails[w][i] += err > allowed[i]
                    worst[w][i] = max(worst[w][i], err / allowed[i])
        for w in ways:
            print("| %s | %s | %d / %d of %d | %.2f / %.2f |"
                  % ("spiky" if spiky else "normal", w, fails[w][0], fails[w][1], args.draws,
                     worst[w][0], worst[w][1]))


if __name__ == "__main__":
    main()
