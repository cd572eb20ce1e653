"""bench/rescale_emulation.py, the CPU emulation of the forward's online softmax: at threshold 0 it
is lp itself and meets the rule; its reference is softmax(QKᵀ)·V and logsumexp; with a threshold
the held max lags, O stays a weighted mean of V, and a spiky row's error grows past lp's; the
rounded row sum moves the rounding into the LSE, and both sums keep the LSE exact."""
import math

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def emu(bench_script):
    return bench_script("rescale_emulation")


def test_reference_is_softmax(emu):
    gen = torch.Generator().manual_seed(3)
    q, k, v = emu.draw(gen, 8, 300, 64, spiky=False)
    scale = 1.0 / math.sqrt(64)
    s = (q @ k.T) * scale
    p = torch.exp(s - s.max(dim=1, keepdim=True).values)
    want = (p / p.sum(dim=1, keepdim=True)) @ v
    o, lse = emu.reference(q, k, v, scale)
    assert torch.allclose(o, want, atol=1e-12)
    want_lse = s.max(dim=1).values + torch.log(p.sum(dim=1))
    assert torch.allclose(lse, want_lse, atol=1e-12)


@pytest.mark.parametrize("spiky", [False, True])
def test_exact_meets_the_rule(emu, spiky):
    gen = torch.Generator().manual_seed(5)
    q, k, v = emu.draw(gen, 16, 700, 64, spiky)
    scale = 1.0 / math.sqrt(64)
    ref, ref_lse = emu.reference(q, k, v, scale)
    out, lse = emu.online(q, k, v, scale, 0.0)
    # Within bf16's rounding of O and P, and far from a wrong softmax (uniform weights).
    assert (out - ref).abs().max().item() < 0.02
    assert (v.mean(0) - ref).abs().max().item() > 0.1
    # The LSE within float32's rounding.
    assert (lse - ref_lse).abs().max().item() < 1e-4


def test_threshold_moves_a_spiky_row(emu):
    """With a threshold the emulation still averages V (its weights sum to one), but the lagging
    max leaves spiky rows further from the reference than the exact form."""
    gen = torch.Generator().manual_seed(11)
    worst_exact = worst_thr = 0.0
    for _ in range(6):
        q, k, v = emu.draw(gen, 32, 1024, 64, spiky=True)
        scale = 1.0 / math.sqrt(64)
        ref, _ = emu.reference(q, k, v, scale)
        exact, _ = emu.online(q, k, v, scale, 0.0)
        thr, _ = emu.online(q, k, v, scale, 8.0)
        assert (thr - ref).abs().max().item() < 0.05
        worst_exact = max(worst_exact, (exact - ref).abs().max().item())
        worst_thr = max(worst_thr, (thr - ref).abs().max().item())
    assert worst_thr > worst_exact


def test_rounded_sum_moves_the_error_into_the_lse(emu):
    """The LSE from the rounded row sum carries P's bf16 rounding (~1e-3); from the float sum, with
    O normalized by the rounded one (both sums), it stays within float32's rounding."""
    gen = torch.Generator().manual_seed(13)
    q, k, v = emu.draw(gen, 32, 1024, 64, spiky=False)
    scale = 1.0 / math.sqrt(64)
    _, ref_lse = emu.reference(q, k, v, scale)
    _, rsum = emu.online(q, k, v, scale, 8.0, o_sum="rounded", lse_sum="rounded")
    _, dual = emu.online(q, k, v, scale, 8.0, o_sum="rounded")
    assert (rsum - ref_lse).abs().max().item() > 1e-4
    assert (dual - ref_lse).abs().max().item() < 1e-4


def test_scaled_probabilities_leave_the_lse(emu):
    """A P scale of 2^offset is taken out of the LSE exactly."""
    gen = torch.Generator().manual_seed(17)
    q, k, v = emu.draw(gen, 16, 400, 64, spiky=False)
    scale = 1.0 / math.sqrt(64)
    _, ref_lse = emu.reference(q, k, v, scale)
    _, lse = emu.online(q, k, v, scale, 0.0, o_sum="rounded", p_log2_offset=0.37)
    assert (lse - ref_lse).abs().max().item() < 1e-4
