"""Score variants through the package, on CPU tensors: ALiBi (alibi_slopes, flash_attn 2's
argument) and gpt-oss's learnable attention sinks (learnable_sink, FlashAttention-4's name, or its
alias sinks), forward and backward, the sinks' gradient included.

Oracles, written here in plain torch, one sequence at a time:
- _gpt_oss: attention as gpt-oss's reference computes it — a softmax over the scores with the
  head's sink appended as one more column, that column dropped before the product with V — with
  flash_attn's ALiBi bias (−slope·|i + sk − sq − j|) added after softcap. Autograd through it
  gives every gradient, d(sinks) included.
- _lp_forward / _explicit_backward: the bfloat16 algorithm (fp32 scores and softmax, P rounded to
  bfloat16 before P·V, O rounded once; dS and P rounded to bfloat16 where the backward's products
  take them), and the backward's explicit formulas with D = rowsum(dO ∘ O) from the output the
  backward is given, as the C++ tests' low-precision reference does.

Accuracy rule: a result X passes iff max|X − ref| ≤ 2·max|lp − ref| + atol (1e-5 forward, 1e-4
backward), ref the oracle in float64 on the inputs' values and lp the same computation in the
inputs' precision: for float32 inputs _gpt_oss (and its autograd) in float32; for bfloat16 inputs
_lp_forward and the rounded _explicit_backward. Each test runs on the native ops and on the
Python implementation (the `path` fixture)."""
import dataclasses
import math

import pytest
import torch

import fa4cpp
from fa4cpp import FallbackWarning, VerificationError, c_abi, ops
from test_fp8 import _visible
from test_kvcache import _case, _position

FWD_ATOL = 1e-5
BWD_ATOL = 1e-4


# -- oracles --------------------------------------------------------------------------------------

def _gpt_oss_visible(n, sliding_window):
    """gpt-oss's mask of n tokens: causal, and with a sliding window a query keeps only the keys
    less than sliding_window tokens back."""
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    visible = j <= i
    if sliding_window > 0:
        visible &= i - j < sliding_window
    return visible


def _alibi_bias(slopes, sq, sk, dtype):
    """flash_attn's ALiBi bias of one sequence, (heads, sq, sk): −slope·|i + sk − sq − j|, on
    both sides of the diagonal."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    distance = (i + sk - sq - j).abs().to(dtype)
    return -slopes.to(dtype)[:, None, None] * distance[None]


def _scores(q, k, scale, softcap, slopes, visible):
    """(hq, sq, sk) scores of one sequence in q's dtype: scaled, capped, biased, −inf where not
    visible."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if slopes is not None:
        s = s + _alibi_bias(slopes, q.shape[0], k.shape[0], s.dtype)
    return s.masked_fill(~visible, -math.inf)


def _gpt_oss(q, k, v, sinks, slopes, scale, visible, softcap=0.0):
    """One sequence, q (sq, hq, d), k / v (sk, hkv, ·), sinks / slopes (hq,) or None, in the
    inputs' dtype. With sinks, gpt-oss's way: the sink a column of its own in the softmax,
    dropped before P·V. Returns O (sq, hq, dv) and LSE (hq, sq) (+inf for a row that sees
    nothing)."""
    s = _scores(q, k, scale, softcap, slopes, visible)
    hq, sq = s.shape[:2]
    if sinks is not None:
        with_sink = torch.cat([s, sinks.to(s.dtype)[:, None, None].expand(hq, sq, 1)], dim=-1)
        p = torch.softmax(with_sink, dim=-1)[..., :-1]
        lse = torch.logsumexp(with_sink, dim=-1)
    else:
        alive = visible.any(dim=-1)[None, :, None]
        p = torch.softmax(torch.where(alive, s, torch.zeros_like(s)), dim=-1) * alive
        lse = torch.where(alive[..., 0], torch.logsumexp(s, dim=-1),
                          s.new_full((hq, sq), math.inf))
    group = hq // v.shape[1]
    out = torch.einsum("hqk,khd->qhd", p, v.repeat_interleave(group, dim=1))
    return out, lse


def _bf16(x):
    return x.to(torch.bfloat16).to(x.dtype)


def _lp_forward(q, k, v, sinks, slopes, scale, visible, softcap=0.0):
    """One sequence by the bfloat16 algorithm: fp32 scores and softmax (running max and the
    sink in the denominator), exp(s − m) rounded to bfloat16 before P·V, fp32 accumulation,
    O = acc / sum rounded to bfloat16. Returns O (bfloat16) and LSE (fp32)."""
    s = _scores(q.float(), k.float(), scale, softcap, slopes, visible)
    hq, sq = s.shape[:2]
    m = s.amax(dim=-1) if s.shape[-1] else s.new_full((hq, sq), -math.inf)
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[:, None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(s - m[..., None])
    total = w.sum(dim=-1)
    if sinks is not None:
        total = total + torch.exp(sinks.float()[:, None] - m)
    group = hq // v.shape[1]
    acc = torch.einsum("hqk,khd->qhd", _bf16(w), v.float().repeat_interleave(group, dim=1))
    denom = total.transpose(0, 1)[..., None]
    out = torch.where(denom > 0, acc / torch.where(denom > 0, denom, torch.ones_like(denom)),
                      torch.zeros_like(acc))
    lse = torch.where(total > 0, m + total.log(), torch.full_like(m, math.inf))
    return out.to(torch.bfloat16), lse


def _explicit_backward(q, k, v, sinks, slopes, dout, out, scale, visible, softcap, dtype,
                       rounded):
    """One sequence's gradients by the backward's formulas in `dtype`: P = exp(s − LSE) (the
    sink in LSE), D = rowsum(dout ∘ out) from the given out, dS = P ∘ (dP − D) (times 1 − tanh²
    under softcap), dQ = scale·dS·K, dK = scale·dSᵀ·Q, dV = Pᵀ·dO, d(sinks) = −Σ_rows
    exp(sink − LSE)·D. rounded: dS and P rounded to bfloat16 before the products, dQ, dK, dV
    rounded to bfloat16 (the lp of bfloat16 inputs). Returns (dq, dk, dv, dsinks or None)."""
    q, k, v, dout, out = (t.to(dtype) for t in (q, k, v, dout, out))
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    raw = torch.einsum("qhd,khd->hqk", q, kk) * scale
    s = _scores(q, k, scale, softcap, slopes, visible)
    columns = [s]
    if sinks is not None:
        columns.append(sinks.to(dtype)[:, None, None].expand(hq, s.shape[1], 1))
    lse = torch.logsumexp(torch.cat(columns, dim=-1), dim=-1)
    lse = torch.where(torch.isfinite(lse), lse, torch.full_like(lse, math.inf))
    p = torch.exp(s - lse[..., None])
    dp = torch.einsum("qhe,khe->hqk", dout, vv)
    d_row = (dout * out).sum(dim=-1).transpose(0, 1)  # (hq, sq)
    chain = 1 - torch.tanh(raw / softcap) ** 2 if softcap > 0 else 1
    ds = p * (dp - d_row[..., None]) * chain
    p_used = p
    if rounded:
        ds, p_used = _bf16(ds), _bf16(p)
    dq = scale * torch.einsum("hqk,khd->qhd", ds, kk)
    dk = scale * torch.einsum("hqk,qhd->khd", ds, q).reshape(-1, hkv, group, q.shape[2]).sum(2)
    dv = torch.einsum("hqk,qhe->khe", p_used, dout).reshape(-1, hkv, group, v.shape[2]).sum(2)
    dsinks = None
    if sinks is not None:
        dsinks = -(torch.exp(sinks.to(dtype)[:, None] - lse) * d_row).sum(dim=-1)
    if rounded:
        dq, dk, dv = (_bf16(t) for t in (dq, dk, dv))
    return dq, dk, dv, dsinks


# -- the accuracy rule ----------------------------------------------------------------------------

def _max_error(x, ref):
    """max|x − ref| with equal infinities matching (LSE of rows that see nothing)."""
    if ref.numel() == 0:
        return 0.0
    x, ref = x.detach().double(), ref.detach().double()
    same_inf = torch.isinf(x) & torch.isinf(ref) & (x.sign() == ref.sign())
    err = torch.where(same_inf, torch.zeros_like(ref), (x - ref).abs())
    return float(torch.nan_to_num(err, nan=math.inf).max())


def _assert_rule(what, x, ref, lp, atol):
    """The module docstring's rule."""
    assert x.shape == ref.shape == lp.shape, (what, tuple(x.shape), tuple(ref.shape))
    err, lp_err = _max_error(x, ref), _max_error(lp, ref)
    assert err <= 2 * lp_err + atol, "%s: max|X - ref| = %.3g > 2 × %.3g (lp's) + %g" % (
        what, err, lp_err, atol)


def _assert_results(got, ref, lp, names, atol):
    for name, x, r, l in zip(names, got, ref, lp):
        if r is None:
            assert x is None, name
            continue
        _assert_rule(name, x, r, l, atol)


# -- inputs ---------------------------------------------------------------------------------------

def _slopes(kind, batch, heads):
    """fp32 ALiBi slopes: None, one per head (heads,), or one per (batch entry, head)."""
    if kind is None:
        return None
    if kind == "per_head":
        return torch.rand(heads) * 0.3 + 0.02
    return torch.rand(batch, heads) * 0.3 + 0.02


def _slope_row(slopes, b):
    if slopes is None:
        return None
    return slopes[b] if slopes.dim() == 2 else slopes


def _sinks(heads, grad=True):
    """fp32 sink logits around the scores' size, so that a sink takes a visible share."""
    return (torch.randn(heads) + 1.0).requires_grad_(grad)


def _leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


def _grads(out, inputs, dout):
    """Gradients of Σ out ∘ dout for the inputs (None stays None)."""
    wanted = [t for t in inputs if t is not None]
    grads = iter(torch.autograd.grad(out, wanted, dout))
    return [None if t is None else next(grads) for t in inputs]


# -- fixed length ---------------------------------------------------------------------------------

FIXED = {
    "causal_gqa8_sinks": dict(b=2, sq=37, sk=53, hq=8, hkv=1, d=64, causal=True, sinks=True),
    # gpt-oss's sliding layers: a window of 128 tokens, flash_attn's window_size (127, 0).
    "gpt_oss_window128": dict(b=1, sq=192, sk=192, hq=8, hkv=1, d=64, causal=True,
                              window=(127, 0), gpt_oss_window=128, sinks=True),
    "full_gqa8_d128": dict(b=1, sq=40, sk=40, hq=16, hkv=2, d=128, sinks=True),
    "softcap_alibi_sinks": dict(b=2, sq=23, sk=31, hq=8, hkv=2, d=64, causal=True, softcap=5.0,
                                slopes="per_batch_head", sinks=True, scale=0.2),
    "alibi_per_head_window": dict(b=2, sq=29, sk=19, hq=4, hkv=4, d=64, window=(8, 3),
                                  slopes="per_head"),
    "alibi_causal_d128": dict(b=1, sq=33, sk=33, hq=16, hkv=2, d=128, causal=True,
                              slopes="per_batch_head"),
    # The first 12 queries see no key: O = 0 there, LSE = the sink.
    "more_queries_than_keys": dict(b=1, sq=21, sk=9, hq=8, hkv=1, d=64, causal=True, sinks=True,
                                   slopes="per_head"),
}


def _fixed_inputs(case, dtype=torch.float32):
    b, sq, sk, hq, hkv, d = (case[n] for n in ("b", "sq", "sk", "hq", "hkv", "d"))
    q, k, v = (torch.randn(b, n, h, d).to(dtype).requires_grad_()
               for n, h in ((sq, hq), (sk, hkv), (sk, hkv)))
    sinks = _sinks(hq) if case.get("sinks") else None
    return q, k, v, sinks, _slopes(case.get("slopes"), b, hq)


def _fixed_mask(case):
    visible = _visible(case["sq"], case["sk"], case.get("causal", False),
                       case.get("window", (-1, -1)))
    if "gpt_oss_window" in case:
        assert torch.equal(visible, _gpt_oss_visible(case["sq"], case["gpt_oss_window"]))
    return visible


def _fixed_call(case, q, k, v, sinks, slopes, names=None):
    """flash_attn_func with the case's options; the sinks as learnable_sink, or as `names`
    (a dict of keyword arguments) gives them."""
    kwargs = dict(learnable_sink=sinks) if names is None else names
    return fa4cpp.flash_attn_func(q, k, v, softmax_scale=case.get("scale"),
                                  causal=case.get("causal", False),
                                  window_size=case.get("window", (-1, -1)),
                                  softcap=case.get("softcap", 0.0), alibi_slopes=slopes,
                                  return_attn_probs=True, **kwargs)[:2]


def _fixed_oracle(case, q, k, v, sinks, slopes, dout, dtype):
    """(out, lse, [dq, dk, dv, dsinks]) of _gpt_oss over the batch, in dtype."""
    scale = case.get("scale") or case["d"] ** -0.5
    leaves = _leaves((q, k, v, sinks), dtype)
    results = [_gpt_oss(leaves[0][b], leaves[1][b], leaves[2][b], leaves[3],
                        _slope_row(slopes, b), scale, _fixed_mask(case), case.get("softcap", 0.0))
               for b in range(q.shape[0])]
    out = torch.stack([o for o, _ in results])
    lse = torch.stack([l for _, l in results])
    return out, lse, _grads(out, leaves, dout.to(dtype))


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_length_meets_the_rule(name, path):
    case = FIXED[name]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    out, lse = _fixed_call(case, q, k, v, sinks, slopes)
    assert out.dtype == torch.float32 and lse.shape == (case["b"], case["hq"], case["sq"])
    dout = torch.randn_like(out)
    grads = _grads(out, [q, k, v, sinks], dout)
    ref = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float64)
    lp = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float32)
    _assert_results((out, lse), ref[:2], lp[:2], ("out", "lse"), FWD_ATOL)
    _assert_results(grads, ref[2], lp[2], ("dq", "dk", "dv", "dsinks"), BWD_ATOL)
    if sinks is not None:
        assert sinks.grad is None  # autograd.grad leaves .grad alone; the gradient came back
        assert grads[3].shape == sinks.shape and grads[3].dtype == torch.float32


def test_rows_without_keys_give_zero_and_the_sink(path):
    case = FIXED["more_queries_than_keys"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    out, lse = _fixed_call(case, q, k, v, sinks, slopes)
    assert torch.all(out[:, :12] == 0)
    assert torch.equal(lse[0, :, :12], sinks.detach()[:, None].expand(-1, 12))
    out.sum().backward()
    assert torch.isfinite(sinks.grad).all()


def test_bfloat16_meets_the_rule(path):
    """bfloat16 inputs: out against _lp_forward; the gradients against _explicit_backward, both
    given the library's out (as its backward is)."""
    _bfloat16_rule("cpu")


@pytest.mark.sm90
def test_gpu_bfloat16_meets_the_rule():
    """The same on the sm90 backend: its forward's ALiBi and sinks, its backward's ALiBi and its
    d(sinks) kernel, against the same oracles."""
    _bfloat16_rule("cuda")


def _bfloat16_rule(device):
    case = dict(b=2, sq=29, sk=41, hq=8, hkv=1, d=64, causal=True, softcap=4.0,
                slopes="per_batch_head", sinks=True)
    q, k, v, sinks, slopes = _fixed_inputs(case, torch.bfloat16)
    if device != "cpu":
        q, k, v, sinks = (t.detach().to(device).requires_grad_() for t in (q, k, v, sinks))
        slopes = slopes.to(device)
    out, lse = _fixed_call(case, q, k, v, sinks, slopes)
    assert out.dtype == torch.bfloat16
    dout = torch.randn_like(out)
    grads = _grads(out, [q, k, v, sinks], dout)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3 + [torch.float32]
    q, k, v, sinks, slopes, out, lse, dout = (t.detach().cpu() for t in (q, k, v, sinks, slopes,
                                                                         out, lse, dout))
    grads = [g.cpu() for g in grads]
    scale, visible = case["d"] ** -0.5, _fixed_mask(case)
    ref, lp = [], []
    for b in range(case["b"]):
        args = (q[b].detach(), k[b].detach(), v[b].detach(), sinks.detach(), slopes[b])
        ref.append(_gpt_oss(*(t.double() for t in args), scale, visible, 4.0))
        lp.append(_lp_forward(*args, scale, visible, 4.0))
    for n, (name, got) in enumerate((("out", out), ("lse", lse))):
        _assert_rule(name, got, torch.stack([r[n] for r in ref]), torch.stack([l[n] for l in lp]),
                     FWD_ATOL)
    ref_g = [_explicit_backward(q[b], k[b], v[b], sinks.detach(), slopes[b], dout[b],
                                out[b].detach(), scale, visible, 4.0, torch.float64, False)
             for b in range(case["b"])]
    lp_g = [_explicit_backward(q[b], k[b], v[b], sinks.detach(), slopes[b], dout[b],
                               out[b].detach(), scale, visible, 4.0, torch.float32, True)
            for b in range(case["b"])]
    for n, name in enumerate(("dq", "dk", "dv")):
        _assert_rule(name, grads[n], torch.stack([g[n] for g in ref_g]),
                     torch.stack([g[n] for g in lp_g]), BWD_ATOL)
    _assert_rule("dsinks", grads[3], sum(g[3] for g in ref_g), sum(g[3] for g in lp_g),
                 BWD_ATOL)


def test_explicit_backward_is_autograd_of_gpt_oss():
    """The bfloat16 test's ref formulas, given the exact out, are the gpt-oss oracle's gradients."""
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    dout = torch.randn(case["b"], case["sq"], case["hq"], case["d"])
    out, _, want = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float64)
    got = [_explicit_backward(q[b], k[b], v[b], sinks.detach(), slopes[b], dout[b], out[b],
                              0.2, _fixed_mask(case), 5.0, torch.float64, False)
           for b in range(case["b"])]
    for n in range(3):
        torch.testing.assert_close(torch.stack([g[n] for g in got]), want[n], rtol=0, atol=1e-10)
    torch.testing.assert_close(sum(g[3] for g in got), want[3], rtol=0, atol=1e-10)


def test_the_rule_catches_a_dropped_sink_and_a_wrong_slope():
    """A result without the sink, or with ALiBi slopes 10% off, fails the rule: it can fail."""
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    dout = torch.randn(case["b"], case["sq"], case["hq"], case["d"])
    ref = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float64)
    lp = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float32)
    for wrong in (dict(sinks=None, slopes=slopes), dict(sinks=sinks, slopes=slopes * 1.1)):
        out, _ = _fixed_call(case, q, k, v, wrong["sinks"], wrong["slopes"])
        with pytest.raises(AssertionError, match="lp's"):
            _assert_rule("out", out, ref[0], lp[0], FWD_ATOL)


def test_sinks_is_learnable_sinks_alias(path):
    case = FIXED["causal_gqa8_sinks"]
    q, k, v, sinks, _ = _fixed_inputs(case)
    a, lse_a = _fixed_call(case, q, k, v, sinks, None, dict(learnable_sink=sinks))
    b, lse_b = _fixed_call(case, q, k, v, sinks, None, dict(sinks=sinks))
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
    for out in (a, b):
        out.sum().backward()
    grad_twice = sinks.grad.clone()
    sinks.grad = None
    _fixed_call(case, q, k, v, sinks, None, dict(sinks=sinks))[0].sum().backward()
    assert torch.equal(grad_twice, 2 * sinks.grad)


def test_packed_variants_take_the_variants(path):
    case = dict(b=2, sq=11, sk=11, hq=4, hkv=4, d=32)
    q, k, v, _, _ = _fixed_inputs(case)
    sinks, slopes = _sinks(4), _slopes("per_batch_head", 2, 4)
    want = fa4cpp.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, sinks=sinks)
    qkv = torch.stack([q, k, v], dim=2)
    assert torch.equal(want, fa4cpp.flash_attn_qkvpacked_func(
        qkv, causal=True, alibi_slopes=slopes, learnable_sink=sinks))
    assert torch.equal(want, fa4cpp.flash_attn_kvpacked_func(
        q, torch.stack([k, v], dim=2), causal=True, alibi_slopes=slopes, sinks=sinks))
    cu = torch.tensor([0, 11, 22], dtype=torch.int32)
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    assert torch.equal(want.reshape(-1, 4, 32), fa4cpp.flash_attn_varlen_qkvpacked_func(
        torch.stack(flat, dim=1), cu, 11, causal=True, alibi_slopes=slopes, sinks=sinks))
    assert torch.equal(want.reshape(-1, 4, 32), fa4cpp.flash_attn_varlen_kvpacked_func(
        flat[0], torch.stack(flat[1:], dim=1), cu, cu, 11, 11, causal=True, alibi_slopes=slopes,
        learnable_sink=sinks))


def test_strided_slopes_and_sinks(path):
    """Slopes broadcast by expand() or transposed, and a strided sinks view, give the contiguous
    ones' results; the gradient reaches the view's base."""
    case = dict(b=3, sq=13, sk=17, hq=4, hkv=2, d=32, causal=True)
    q, k, v, _, _ = _fixed_inputs(case)
    per_head = torch.rand(4) * 0.2
    base = torch.randn(8, requires_grad=True)
    strided = base[::2]
    contiguous = strided.detach().clone().requires_grad_()
    want = fa4cpp.flash_attn_func(q, k, v, causal=True, alibi_slopes=per_head,
                                  learnable_sink=contiguous)
    for slopes in (per_head.expand(3, 4), per_head[:, None].expand(4, 3).t()):
        got = fa4cpp.flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                     learnable_sink=strided)
        assert torch.equal(got, want)
    dout = torch.randn_like(want)
    want.backward(dout)
    fa4cpp.flash_attn_func(q, k, v, causal=True, alibi_slopes=per_head,
                           learnable_sink=strided).backward(dout)
    assert torch.equal(base.grad[::2], contiguous.grad) and torch.all(base.grad[1::2] == 0)


def test_slopes_have_no_gradient_and_sinks_need_none(path):
    """ALiBi slopes are constants (flash_attn's convention): no gradient reaches them. Sinks that
    do not require grad still take part, and the other gradients come out as with a leaf."""
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    slopes.requires_grad_()
    frozen = sinks.detach()
    out, _ = _fixed_call(case, q, k, v, frozen, slopes)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert slopes.grad is None
    want, _ = _fixed_call(case, q, k, v, sinks, slopes.detach())
    assert torch.equal(out, want)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for got, w in zip((q.grad, k.grad, v.grad), want_grads):
        assert torch.equal(got, w)


# -- varlen ---------------------------------------------------------------------------------------

def _cu(lens):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)


VARLEN = [
    dict(causal=True, window=(-1, -1), seqused=False, slopes="per_batch_head", sinks=True),
    dict(causal=False, window=(6, 2), seqused=True, slopes="per_head", sinks=True),
    dict(causal=True, window=(-1, -1), seqused=True, slopes="per_batch_head", sinks=False),
]


@pytest.mark.parametrize("n", range(len(VARLEN)))
def test_varlen_meets_the_rule(n, path):
    """Packed sequences, one without queries, one whose queries see no key (O = 0, LSE = the
    sink, or +inf without sinks) and one empty; ALiBi's sk is seqused_k where given."""
    case = VARLEN[n]
    lens_q, lens_k = [5, 0, 17, 9, 4, 0], [7, 3, 17, 30, 0, 0]
    used = [7, 2, 17, 25, 0, 0] if case["seqused"] else lens_k
    hq, hkv, d = 16, 2, 64
    batch = len(lens_q)
    q = torch.randn(sum(lens_q), hq, d, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hkv, d, requires_grad=True) for _ in range(2))
    sinks = _sinks(hq) if case["sinks"] else None
    slopes = _slopes(case["slopes"], batch, hq)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = fa4cpp.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=case["causal"],
        window_size=case["window"], alibi_slopes=slopes, sinks=sinks, return_softmax_lse=True,
        seqused_k=torch.tensor(used, dtype=torch.int32) if case["seqused"] else None)
    assert out.shape == (sum(lens_q), hq, d) and lse.shape == (hq, sum(lens_q))
    dout = torch.randn_like(out)
    grads = _grads(out, [q, k, v, sinks], dout)

    def oracle(dtype):
        leaves = _leaves((q, k, v, sinks), dtype)
        outs, lses = [], []
        for b in range(batch):
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            keys = slice(int(cu_k[b]), int(cu_k[b]) + used[b])
            o, l = _gpt_oss(leaves[0][rows], leaves[1][keys], leaves[2][keys], leaves[3],
                            _slope_row(slopes, b), d ** -0.5,
                            _visible(lens_q[b], used[b], case["causal"], case["window"]))
            outs.append(o)
            lses.append(l)
        o, l = torch.cat(outs), torch.cat(lses, dim=1)
        return o, l, _grads(o, leaves, dout.to(dtype))

    ref, lp = oracle(torch.float64), oracle(torch.float32)
    _assert_results((out, lse), ref[:2], lp[:2], ("out", "lse"), FWD_ATOL)
    _assert_results(grads, ref[2], lp[2], ("dq", "dk", "dv", "dsinks"), BWD_ATOL)
    no_key = slice(int(cu_q[4]), int(cu_q[5]))  # sequence 4: queries without keys
    assert torch.all(out[no_key] == 0)
    want_lse = sinks.detach()[:, None].expand(-1, 4) if sinks is not None else math.inf
    assert torch.all(lse[:, no_key] == want_lse)


# -- KV cache -------------------------------------------------------------------------------------

def _kv_oracle(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, sinks, slopes, page_size,
               dtype):
    """_gpt_oss over each batch entry's keys in the cache as the call left it (causal)."""
    outs, lses, first = [], [], 0
    hkv = k_cache.shape[2]
    for b, (lq, n) in enumerate(zip(lens_q, new)):
        pad = int(args["cache_leftpad"][b]) if "cache_leftpad" in args else 0
        qb = q[first:first + lq] if q.dim() == 3 else q[b]
        first += lq
        idx = [_position(args, b, p, page_size) for p in range(pad, int(cache_seqlens[b]) + n)]
        gather = (torch.tensor([f for f, _ in idx], dtype=torch.long),
                  torch.tensor([s for _, s in idx], dtype=torch.long))
        keys, values = k_cache[gather].to(dtype), v_cache[gather].to(dtype)
        o, l = _gpt_oss(qb.to(dtype), keys.reshape(-1, hkv, keys.shape[-1]),
                        values.reshape(-1, hkv, values.shape[-1]),
                        None if sinks is None else sinks.to(dtype), _slope_row(slopes, b),
                        qb.shape[-1] ** -0.5, _visible(lq, len(idx), causal=True))
        outs.append(o)
        lses.append(l)
    if q.dim() == 3:
        return torch.cat(outs), torch.cat(lses, dim=1)
    return torch.stack(outs), torch.stack(lses)


KV_CASES = [
    dict(page_size=16, append=3, slopes=None),
    # ALiBi's key count with left pads: from cache_leftpad to the last appended row.
    dict(page_size=7, append=2, varlen_new=True, varlen_q=True, sq=5, slopes="per_batch_head",
         leftpad=True),
    dict(page_size=16, append=1, sq=1, batch_idx=True, slopes="per_head"),
]


@pytest.mark.parametrize("n", range(len(KV_CASES)))
def test_kvcache_with_a_paged_cache_and_sinks(n, path):
    """flash_attn_with_kvcache over a paged cache with sinks (and ALiBi): forward against
    _gpt_oss over the keys the call left in the cache."""
    case = dict(KV_CASES[n])
    slopes_kind = case.pop("slopes")
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(
        400 + n, hq=8, hkv=1, d=64, **case)
    sinks = _sinks(8, grad=False)
    slopes = _slopes(slopes_kind, len(lens_q), 8)
    out, lse = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                              causal=True, learnable_sink=sinks,
                                              alibi_slopes=slopes, return_softmax_lse=True,
                                              **args)
    page_size = case.get("page_size")
    ref = _kv_oracle(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, sinks, slopes,
                     page_size, torch.float64)
    lp = _kv_oracle(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, sinks, slopes,
                    page_size, torch.float32)
    _assert_results((out, lse), ref, lp, ("out", "lse"), FWD_ATOL)


@pytest.mark.parametrize("with_out", [True, False])
def test_vllm_paged_call_with_sinks(with_out, path):
    """flash_attn_varlen_func as vLLM calls it for gpt-oss: block_table, seqused_k, sinks=,
    a window of 128 tokens (127, 0), out= written in place."""
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(
        410, hq=8, hkv=1, d=64, page_size=16, varlen_q=True, sq=4, capacity=200)
    sinks = _sinks(8, grad=False)
    out = torch.full((q.shape[0], 8, 64), float("nan")) if with_out else None
    result, lse = fa4cpp.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
        max_seqlen_q=4, max_seqlen_k=200, seqused_k=cache_seqlens, causal=True,
        window_size=(127, 0), block_table=args["page_table"], out=out, sinks=sinks,
        return_softmax_lse=True, fa_version=3)
    if with_out:
        assert result is out

    def oracle(dtype):
        outs, lses, first = [], [], 0
        for b, lq in enumerate(lens_q):
            idx = [_position(args, b, p, 16) for p in range(int(cache_seqlens[b]))]
            gather = (torch.tensor([f for f, _ in idx], dtype=torch.long),
                      torch.tensor([s for _, s in idx], dtype=torch.long))
            o, l = _gpt_oss(q[first:first + lq].to(dtype), k_cache[gather].to(dtype),
                            v_cache[gather].to(dtype), sinks.to(dtype), None, 64 ** -0.5,
                            _visible(lq, len(idx), True, (127, 0)))
            outs.append(o)
            lses.append(l)
            first += lq
        return torch.cat(outs), torch.cat(lses, dim=1)

    _assert_results((result, lse), oracle(torch.float64), oracle(torch.float32), ("out", "lse"),
                    FWD_ATOL)


# -- errors ---------------------------------------------------------------------------------------

def _qkv(dtype=torch.float32):
    return [torch.randn(2, 5, h, 16, dtype=dtype) for h in (4, 2, 2)]


def _varlen_qkv():
    return [t.reshape(10, *t.shape[2:]) for t in _qkv()]


def _paged_call(**variants):
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(420, hq=4, hkv=2, d=16, page_size=8,
                                                           varlen_q=True, sq=2)
    return fa4cpp.flash_attn_varlen_func(q, k_cache, v_cache, args["cu_seqlens_q"], None, 2, 96,
                                         seqused_k=cache_seqlens, block_table=args["page_table"],
                                         **variants)


BAD_CALLS = {
    "both sink names": (
        "learnable_sink and sinks name the same argument",
        lambda: fa4cpp.flash_attn_func(*_qkv(), learnable_sink=torch.zeros(4),
                                       sinks=torch.zeros(4))),
    "both sink names, varlen": (
        "learnable_sink and sinks",
        lambda: fa4cpp.flash_attn_varlen_func(*_varlen_qkv(), _cu([5, 5]), _cu([5, 5]), 5, 5,
                                              learnable_sink=torch.zeros(4),
                                              sinks=torch.zeros(4))),
    "both sink names, kvcache": (
        "learnable_sink and sinks",
        lambda: fa4cpp.flash_attn_with_kvcache(*_qkv(), cache_seqlens=3,
                                               learnable_sink=torch.zeros(4),
                                               sinks=torch.zeros(4))),
    "both sink names, packed": (
        "learnable_sink and sinks",
        lambda: fa4cpp.flash_attn_qkvpacked_func(torch.randn(2, 5, 3, 4, 16),
                                                 learnable_sink=torch.zeros(4),
                                                 sinks=torch.zeros(4))),
    "sinks per kv head": (
        r"sinks.* shape \(heads_q,\) = \(4,\)",
        lambda: fa4cpp.flash_attn_func(*_qkv(), sinks=torch.zeros(2))),
    "sinks of two dimensions": (
        "sinks",
        lambda: fa4cpp.flash_attn_func(*_qkv(), learnable_sink=torch.zeros(1, 4))),
    "bfloat16 sinks": (
        "float32",
        lambda: fa4cpp.flash_attn_func(*_qkv(torch.bfloat16),
                                       learnable_sink=torch.zeros(4, dtype=torch.bfloat16))),
    "sinks on another device": (
        "sinks.* on cpu",
        lambda: fa4cpp.flash_attn_func(*_qkv(), sinks=torch.zeros(4, device="meta"))),
    "slopes per kv head": (
        r"alibi_slopes must be a float32 tensor of shape \(heads_q,\) = \(4,\) or \(batch, "
        r"heads_q\) = \(2, 4\)",
        lambda: fa4cpp.flash_attn_func(*_qkv(), alibi_slopes=torch.ones(2))),
    "slopes of another batch": (
        "alibi_slopes",
        lambda: fa4cpp.flash_attn_func(*_qkv(), alibi_slopes=torch.ones(3, 4))),
    "float64 slopes": (
        "alibi_slopes",
        lambda: fa4cpp.flash_attn_func(*_qkv(), alibi_slopes=torch.ones(4, dtype=torch.float64))),
    "varlen slopes per token": (
        "alibi_slopes",
        lambda: fa4cpp.flash_attn_varlen_func(*_varlen_qkv(), _cu([5, 5]), _cu([5, 5]), 5, 5,
                                              alibi_slopes=torch.ones(10, 4))),
    "kvcache sinks per kv head": (
        "sinks",
        lambda: fa4cpp.flash_attn_with_kvcache(*_qkv(), cache_seqlens=3,
                                               learnable_sink=torch.zeros(2))),
    "paged slopes of another batch": (
        "alibi_slopes",
        lambda: _paged_call(alibi_slopes=torch.ones(4, 4))),
    "paged int sinks": (
        "sinks",
        lambda: _paged_call(sinks=torch.zeros(4, dtype=torch.int32))),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_variant_calls_raise(name, path):
    match, call = BAD_CALLS[name]
    with pytest.raises(ValueError, match=match):
        call()


def test_bwd_op_checks_dsinks(path):
    q, k, v = _qkv()
    sinks = torch.zeros(4)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -1, -1, 0.0, sinks=sinks)
    args = (out, q, k, v, out, lse, 0.0, False, -1, -1, 0.0, False)
    with pytest.raises(ValueError, match="dsinks is given, but the problem has no sinks"):
        torch.ops.fa4cpp.bwd(*args, dsinks=torch.zeros(4))
    with pytest.raises(ValueError, match=r"dsinks must be a float32 tensor of shape \(heads_q,\)"):
        torch.ops.fa4cpp.bwd(*args, sinks=sinks, dsinks=torch.zeros(2))
    dsinks = torch.full((4,), float("nan"))
    grads = torch.ops.fa4cpp.bwd(*args, sinks=sinks, dsinks=dsinks)
    assert len(grads) == 3 and torch.isfinite(dsinks).all()
    strided = torch.full((8,), float("nan"))[::2]
    torch.ops.fa4cpp.bwd(*args, sinks=sinks, dsinks=strided)
    assert torch.equal(strided, dsinks)


# -- the sm90 backend's refusal -------------------------------------------------------------------

def test_support_takes_the_variants_on_sm90():
    """Both backends compute the variants: the sm90 backend's can_implement names neither (a
    build without CUDA says so instead), the CPU backend takes them both ways."""
    q, k, v = _qkv(torch.bfloat16)
    sinks, slopes = torch.zeros(4), torch.ones(4)
    for pass_ in ("fwd", "bwd"):
        assert ops.support(pass_, q, k, v, sinks=sinks, alibi_slopes=slopes) is None
        for kwargs in (dict(sinks=sinks), dict(alibi_slopes=slopes)):
            why = ops.support(pass_, q, k, v, backend="sm90", **kwargs) or ""
            assert "sinks" not in why and "ALiBi" not in why, why
    assert "alibi_slopes" in ops.support("fwd", q, k, v, alibi_slopes=torch.ones(3))


# -- torch.compile, the modes, the ops' registration ----------------------------------------------

def test_compiled_step_matches_eager(path):
    """torch.compile(fullgraph=True) of a forward and backward with sinks (a parameter) and
    ALiBi: no graph break, eager's results and gradients."""
    torch._dynamo.reset()
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)

    def step(q, k, v, sinks, slopes):
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, softcap=5.0, softmax_scale=0.2,
                                     alibi_slopes=slopes, learnable_sink=sinks)
        return (out * out).sum()

    explanation = torch._dynamo.explain(step)(q, k, v, sinks, slopes)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    eager = step(q, k, v, sinks, slopes)
    want = torch.autograd.grad(eager, (q, k, v, sinks))
    compiled = torch.compile(step, fullgraph=True)
    got_loss = compiled(q, k, v, sinks, slopes)
    got = torch.autograd.grad(got_loss, (q, k, v, sinks))
    torch.testing.assert_close(got_loss, eager, rtol=1e-6, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_compiled_varlen_and_kvcache_calls(path):
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_() for t in _varlen_qkv())
    sinks, cu = _sinks(4), _cu([5, 5])

    def varlen(q, k, v, sinks):
        return fa4cpp.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True, sinks=sinks)

    eager = varlen(q, k, v, sinks)
    got = torch.compile(varlen, fullgraph=True)(q, k, v, sinks)
    assert torch.equal(got, eager)
    dout = torch.randn_like(eager)
    for g, w in zip(torch.autograd.grad(got, (q, k, v, sinks), dout),
                    torch.autograd.grad(eager, (q, k, v, sinks), dout)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    kq, k_cache, v_cache, cache_seqlens, args, _, _ = _case(430, hq=8, hkv=1, d=64, page_size=16,
                                                            append=1, sq=1)
    k2, v2 = k_cache.clone(), v_cache.clone()
    kv_sinks = sinks.detach().repeat(2)

    def decode(q, k_cache, v_cache, k, v, cache_seqlens, page_table, sinks):
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                              cache_seqlens=cache_seqlens, page_table=page_table,
                                              causal=True, learnable_sink=sinks)

    inputs = (args["k"], args["v"], cache_seqlens, args["page_table"], kv_sinks)
    eager = decode(kq, k_cache, v_cache, *inputs)
    got = torch.compile(decode, fullgraph=True, backend="eager")(kq, k2, v2, *inputs)
    assert torch.equal(got, eager) and torch.equal(k2, k_cache)


def test_native_and_python_paths_agree():
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    results = []
    for context in (None, ops.python_path):
        sinks.grad = None
        if context is None:
            out, lse = _fixed_call(case, q, k, v, sinks, slopes)
        else:
            with context():
                out, lse = _fixed_call(case, q, k, v, sinks, slopes)
        dout = torch.ones_like(out)
        grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
        results.append((out, lse) + grads)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_verify_mode_passes_and_catches_a_dropped_sink(monkeypatch):
    case = FIXED["softcap_alibi_sinks"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    with fa4cpp.mode(verify=1.0):
        out, _ = _fixed_call(case, q, k, v, sinks, slopes)
        out.sum().backward()
        vq, vk, vv = _varlen_qkv()
        fa4cpp.flash_attn_varlen_func(vq, vk, vv, _cu([5, 5]), _cu([5, 5]), 5, 5, causal=True,
                                      alibi_slopes=torch.rand(2, 4), sinks=torch.randn(4))
        kq, k_cache, v_cache, cache_seqlens, args, _, _ = _case(440, hq=8, hkv=1, d=64,
                                                                page_size=16, append=2)
        fa4cpp.flash_attn_with_kvcache(kq, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       causal=True, learnable_sink=torch.randn(8),
                                       alibi_slopes=torch.rand(8), **args)
    real_forward, real_backward = c_abi.Library.forward, c_abi.Library.backward

    def without_sinks(self, q, k, v, out, lse, params, *rest):
        real_forward(self, q, k, v, out, lse, dataclasses.replace(params, sinks=None), *rest)

    def wrong_dsinks(self, *args):
        real_backward(self, *args)
        args[-1].mul_(1.5)  # dsinks, the last argument

    with fa4cpp.mode(verify=1.0):
        monkeypatch.setattr(c_abi.Library, "forward", without_sinks)
        with pytest.raises(VerificationError, match="output|LSE"):
            _fixed_call(case, q, k, v, sinks, slopes)
        monkeypatch.setattr(c_abi.Library, "forward", real_forward)
        monkeypatch.setattr(c_abi.Library, "backward", wrong_dsinks)
        out, _ = _fixed_call(case, q, k, v, sinks, slopes)
        with pytest.raises(VerificationError, match="dsinks"):
            out.sum().backward()


def test_fallback_runs_refused_variants_on_the_reference(monkeypatch):
    """A refused problem (support() replaced: the library would run this one) runs on the
    reference with its sinks and slopes, the sinks' gradient included."""
    case = FIXED["more_queries_than_keys"]
    q, k, v, sinks, slopes = _fixed_inputs(case)
    monkeypatch.setattr(ops, "support", lambda *args, **kwargs: "refused for the test")
    with ops.python_path(), fa4cpp.mode(fallback=True), \
            pytest.warns(FallbackWarning, match="refused for the test"):
        out, lse = _fixed_call(case, q, k, v, sinks, slopes)
        dout = torch.randn_like(out)
        grads = _grads(out, [q, k, v, sinks], dout)
    ref = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float64)
    lp = _fixed_oracle(case, q, k, v, sinks, slopes, dout, torch.float32)
    _assert_results((out, lse), ref[:2], lp[:2], ("out", "lse"), FWD_ATOL)
    _assert_results(grads, ref[2], lp[2], ("dq", "dk", "dv", "dsinks"), BWD_ATOL)


def test_ops_pass_opcheck(path):
    q, k, v = (t.requires_grad_() for t in _qkv())
    sinks, slopes = _sinks(4), torch.rand(2, 4)
    variants = dict(alibi_slopes=slopes, sinks=sinks)
    torch.library.opcheck(torch.ops.fa4cpp.fwd.default, (q, k, v, 0.0, True, -1, -1, 0.0),
                          variants)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, 0.0, True, -1, -1, 0.0, **variants)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, 0.0,
            True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.fa4cpp.bwd.default, args,
                          dict(alibi_slopes=slopes, sinks=sinks.detach(), dsinks=torch.empty(4)))
    vq, vk, vv = (t.requires_grad_() for t in _varlen_qkv())
    cu = _cu([5, 5])
    torch.library.opcheck(torch.ops.fa4cpp.varlen_fwd.default,
                          (vq, vk, vv, cu, cu, 5, 5, None, 0.0, True, -1, -1, 0.0), variants)
    vout, vlse = torch.ops.fa4cpp.varlen_fwd(vq, vk, vv, cu, cu, 5, 5, None, 0.0, True, -1, -1,
                                             0.0, **variants)
    torch.library.opcheck(torch.ops.fa4cpp.varlen_bwd.default,
                          (torch.randn_like(vout), vq.detach(), vk.detach(), vv.detach(),
                           vout.detach(), vlse, cu, cu, 5, 5, None, 0.0, True, -1, -1, 0.0, False),
                          dict(sinks=sinks.detach(), dsinks=torch.empty(4)))
