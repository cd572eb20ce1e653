"""bench/rescale_emulation.py, the CPU emulation of the forward's online softmax: at threshold 0 it
is lp itself and meets the rule; its reference is softmax(QKᵀ)·V; with a threshold the held max
lags, O stays a weighted mean of V, and a spiky row's error grows past lp's."""
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
    assert torch.allclose(emu.reference(q, k, v, scale), want, atol=1e-12)


@pytest.mark.parametrize("spiky", [False, True])
def test_exact_meets_the_rule(emu, spiky):
    gen = torch.Generator().manual_seed(5)
    q, k, v = emu.draw(gen, 16, 700, 64, spiky)
    scale = 1.0 / math.sqrt(64)
    ref = emu.reference(q, k, v, scale)
    out = emu.online(q, k, v, scale, 0.0, False)
    # Within bf16's rounding of O and P, and far from a wrong softmax (uniform weights).
    assert (out - ref).abs().max().item() < 0.02
    assert (v.mean(0) - ref).abs().max().item() > 0.1


def test_threshold_moves_a_spiky_row(emu):
    """With a threshold the emulation still averages V (its weights sum to one), but the lagging
    max leaves spiky rows further from the reference than the exact form."""
    gen = torch.Generator().manual_seed(11)
    worst_exact = worst_thr = 0.0
    for _ in range(6):
        q, k, v = emu.draw(gen, 32, 1024, 64, spiky=True)
        scale = 1.0 / math.sqrt(64)
        ref = emu.reference(q, k, v, scale)
        exact = emu.online(q, k, v, scale, 0.0, False)
        thr = emu.online(q, k, v, scale, 8.0, False)
        assert (thr - ref).abs().max().item() < 0.05
        worst_exact = max(worst_exact, (exact - ref).abs().max().item())
        worst_thr = max(worst_thr, (thr - ref).abs().max().item())
    assert worst_thr > worst_exact
