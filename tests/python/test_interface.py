"""flash_attn-compatible functions: values and gradients against torch's math SDPA in fp32 (where
SDPA can express the case) and against fa4cpp.reference (softcap, varlen, seqused_k), the
arguments fa4cpp refuses, and flash_attn's return conventions. CPU tensors; the GPU variants at
the end run on an sm90 device only."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa4cpp
from fa4cpp import Fa4Error, ops, reference


def band_mask(sq, sk, causal, window):
    """flash_attn's bottom-right aligned mask, built independently of fa4cpp.reference: query i
    sees key j iff i + sk - sq - left <= j <= i + sk - sq + right (causal: right = 0)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def sdpa_math(q, k, v, *, mask=None, is_causal=False, scale=None):
    """torch's math SDPA in fp32 on (batch, seq, heads, dim) tensors (differentiable)."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2)


def leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def make(b, sq, sk, hq, hkv, d, dv, dtype, device="cpu"):
    return leaves(torch.randn(b, sq, hq, d, dtype=dtype, device=device),
                  torch.randn(b, sk, hkv, d, dtype=dtype, device=device),
                  torch.randn(b, sk, hkv, dv, dtype=dtype, device=device))


# name: (shape (b, sq, sk, hq, hkv, d, dv), flash_attn kwargs, how SDPA expresses it)
SDPA_CASES = {
    "full": ((2, 13, 21, 4, 4, 32, 32), {}, {}),
    "causal-square": ((2, 19, 19, 4, 2, 16, 16), {"causal": True}, {"is_causal": True}),
    "causal-bottom-right": ((1, 7, 23, 6, 2, 16, 24), {"causal": True}, {"mask": (True, (-1, -1))}),
    "window": ((2, 17, 17, 4, 1, 32, 32), {"window_size": (5, 2)}, {"mask": (False, (5, 2))}),
    "window-causal": ((1, 12, 30, 2, 2, 8, 8), {"causal": True, "window_size": (4, 3)},
                      {"mask": (True, (4, 3))}),
    "scale": ((1, 9, 9, 2, 2, 64, 64), {"softmax_scale": 0.05}, {"scale": 0.05}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SDPA_CASES))
def test_flash_attn_func_matches_sdpa_math(name, dtype, check):
    shape, kwargs, sdpa_kwargs = SDPA_CASES[name]
    sdpa_kwargs = dict(sdpa_kwargs)
    q, k, v = make(*shape, dtype)
    out = fa4cpp.flash_attn_func(q, k, v, **kwargs)
    if "mask" in sdpa_kwargs:
        causal, window = sdpa_kwargs.pop("mask")
        sdpa_kwargs["mask"] = band_mask(shape[1], shape[2], causal, window)
    qf, kf, vf = leaves(q, k, v)
    want = sdpa_math(qf, kf, vf, **sdpa_kwargs)
    check.out(out, want, v)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (qf, kf, vf), dout.float())
    options = dict(softmax_scale=kwargs.get("softmax_scale", 0.0),
                   causal=kwargs.get("causal", False), window=kwargs.get("window_size", (-1, -1)))
    _, sizes = reference.attention_backward(dout, q, k, v, magnitudes=True, **options)
    check.grads(grads, want_grads, sizes, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_matches_reference(dtype, check):
    q, k, v = make(2, 11, 15, 4, 2, 16, 16, dtype)
    out, lse, probs = fa4cpp.flash_attn_func(q, k, v, causal=True, softcap=1.5,
                                             return_attn_probs=True)
    want, want_lse = reference.attention(q, k, v, causal=True, softcap=1.5)
    check.out(out, want, v)
    check.lse(lse, want_lse)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads, sizes = reference.attention_backward(dout, q, k, v, causal=True, softcap=1.5,
                                                     magnitudes=True)
    check.grads(grads, want_grads, sizes, dtype)


def test_lse_matches_logsumexp_of_scores():
    q, k, v = make(1, 6, 10, 2, 2, 16, 16, torch.float32)
    _, lse, _ = fa4cpp.flash_attn_func(q, k, v, return_attn_probs=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0  # 1/sqrt(16)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=0, atol=1e-5)


# -- varlen ---------------------------------------------------------------------------------------

def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_matches_sdpa_per_sequence(dtype, check):
    lengths_q, lengths_k = [5, 0, 8, 3], [9, 6, 8, 0]  # a query-less and a key-less sequence
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    q, k, v = leaves(torch.randn(int(cu_q[-1]), 4, 16, dtype=dtype),
                     torch.randn(int(cu_k[-1]), 2, 16, dtype=dtype),
                     torch.randn(int(cu_k[-1]), 2, 16, dtype=dtype))
    out = fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                        causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    _, sizes = reference.varlen_attention_backward(dout, q, k, v, cu_q, cu_k, causal=True,
                                                   magnitudes=True)
    want_grads = [torch.zeros(t.shape) for t in (q, k, v)]
    for b in range(4):
        qs = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ks = slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lengths_q[b] == 0:
            continue
        if lengths_k[b] == 0:  # no key: out 0, no gradient
            assert torch.all(out[qs] == 0)
            continue
        qf, kf, vf = leaves(q[qs][None], k[ks][None], v[ks][None])
        mask = band_mask(lengths_q[b], lengths_k[b], True, (-1, -1))
        want = sdpa_math(qf, kf, vf, mask=mask)
        check.out(out[qs], want[0], v, what="out of sequence %d" % b)
        g = torch.autograd.grad(want, (qf, kf, vf), dout[qs][None].float())
        want_grads[0][qs], want_grads[1][ks], want_grads[2][ks] = (x[0] for x in g)
    check.grads(grads, want_grads, sizes, dtype)


def test_varlen_seqused_k(check):
    lengths_q, lengths_k, used = [4, 6, 3], [8, 6, 5], [5, 0, 2]
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    seqused_k = torch.tensor(used, dtype=torch.int32)
    q, k, v = leaves(torch.randn(13, 2, 16), torch.randn(19, 2, 16), torch.randn(19, 2, 16))
    out, lse, _ = fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 8, causal=True,
                                                return_attn_probs=True, seqused_k=seqused_k)
    want, want_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True,
                                                seqused_k=seqused_k)
    check.out(out, want, v)
    check.lse(lse, want_lse)
    # Sequence 0 equals a problem whose keys stop at seqused_k (alignment included).
    qf, kf, vf = leaves(q[:4][None], k[:5][None], v[:5][None])
    torch.testing.assert_close(out[:4], sdpa_math(qf, kf, vf, mask=band_mask(4, 5, True,
                                                                             (-1, -1)))[0],
                               rtol=0, atol=1e-5)
    assert torch.all(out[4:10] == 0)  # sequence 1 uses no key
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want_grads, sizes = reference.varlen_attention_backward(
        dout, q, k, v, cu_q, cu_k, causal=True, seqused_k=seqused_k, magnitudes=True)
    check.grads(grads, want_grads, sizes, torch.float32)
    assert torch.all(grads[1][5:8] == 0) and torch.all(grads[2][5:8] == 0)


# -- arguments fa4cpp refuses, and flash_attn's conventions --------------------------------------

def test_unsupported_arguments_raise_naming_them():
    q, k, v = make(1, 4, 4, 2, 2, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        fa4cpp.flash_attn_func(q, k, v, dropout_p=0.1)
    # ALiBi is computed (test_variants.py); slopes it cannot take raise naming the argument.
    with pytest.raises(ValueError, match="alibi_slopes"):
        fa4cpp.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="softmax_scale"):
        fa4cpp.flash_attn_func(q, k, v, softmax_scale=0.0)
    cu = _cu([4])
    with pytest.raises(ValueError, match="block_table"):
        fa4cpp.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4,
                                      block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        fa4cpp.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 4, 4, dropout_p=0.5)
    with pytest.raises(ValueError, match="alibi_slopes"):
        fa4cpp.flash_attn_qkvpacked_func(torch.stack([q, k, v], dim=2),
                                         alibi_slopes=torch.ones(2, dtype=torch.float64))
    fa4cpp.flash_attn_func(q, k, v, dropout_p=0.0)  # the eval-mode value is fine


def test_return_conventions():
    q, k, v = make(2, 5, 7, 4, 2, 16, 8, torch.float32)
    out = fa4cpp.flash_attn_func(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5, 4, 8)
    result = fa4cpp.flash_attn_func(q, k, v, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    out2, lse, probs = result
    assert torch.equal(out2, out)
    assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    # flash_attn >= 2.7 returns an empty S_dmask when dropout_p == 0 (None up to 2.6)
    assert probs.shape == (0,) and probs.dtype == q.dtype
    cu_q, cu_k = _cu([2, 3]), _cu([3, 4])
    qv, kv, vv = torch.randn(5, 4, 16), torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    out, lse, probs = fa4cpp.flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 3, 4,
                                                    return_attn_probs=True)
    assert out.shape == (5, 4, 16) and lse.shape == (4, 5) and probs.numel() == 0


def test_flash_attn_argument_conventions():
    """Negative window sides are unbounded and softcap <= 0 is off, as in flash_attn; None scale
    is 1/sqrt(head_dim)."""
    q, k, v = make(1, 8, 8, 2, 2, 16, 16, torch.float32)
    base = fa4cpp.flash_attn_func(q, k, v)
    assert torch.equal(fa4cpp.flash_attn_func(q, k, v, window_size=(-7, -3)), base)
    assert torch.equal(fa4cpp.flash_attn_func(q, k, v, softcap=-1.0), base)
    assert torch.equal(fa4cpp.flash_attn_func(q, k, v, softmax_scale=0.25), base)
    assert not torch.equal(fa4cpp.flash_attn_func(q, k, v, softmax_scale=0.3), base)
    assert torch.equal(fa4cpp.flash_attn_func(q, k, v, deterministic=True), base)


def test_packed_variants_equal_unpacked():
    q, k, v = make(2, 6, 6, 4, 4, 16, 16, torch.float32)
    qkv = torch.stack([q, k, v], dim=2).detach().requires_grad_()
    out = fa4cpp.flash_attn_qkvpacked_func(qkv, causal=True)
    want = fa4cpp.flash_attn_func(q, k, v, causal=True)
    assert torch.equal(out, want)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(want, (q, k, v), dout), dim=2))
    kv = torch.stack([k, v], dim=2)
    assert torch.equal(fa4cpp.flash_attn_kvpacked_func(q, kv, causal=True), want)
    cu = _cu([2, 4])
    qkv_var = qkv.detach()[0]  # 6 tokens as sequences of 2 and 4
    out_var = fa4cpp.flash_attn_varlen_qkvpacked_func(qkv_var, cu, 4, causal=True)
    q0, k0, v0 = qkv_var.unbind(dim=1)
    assert torch.equal(out_var, fa4cpp.flash_attn_varlen_func(q0, k0, v0, cu, cu, 4, 4,
                                                              causal=True))
    out_kv = fa4cpp.flash_attn_varlen_kvpacked_func(q0, qkv_var[:, 1:], cu, cu, 4, 4, causal=True)
    assert torch.equal(out_kv, out_var)


# -- GPU (sm90) ------------------------------------------------------------------------------------

def _require(pass_, q, k, v, **kwargs):
    # A problem without a kernel for pass_ ("fwd" / "bwd") in this build (FA4_SM90_KERNELS)
    # skips; any other refusal (no CUDA in the library, backend unavailable) is a broken GPU path
    # and fails.
    name = {"fwd": "forward", "bwd": "backward"}[pass_]
    reason = ops.support(pass_, q, k, v, **kwargs)
    if reason is not None:
        if "has no %s kernel" % name not in reason:
            pytest.fail("the sm90 backend refuses a %s it has kernels for: %s" % (name, reason))
        pytest.skip("this build's sm90 backend has no %s kernel for the problem: %s"
                    % (name, reason))


def _options(kwargs):
    """The reference's mask / softcap arguments for flash_attn keyword arguments."""
    return dict(causal=kwargs.get("causal", False), window=kwargs.get("window_size", (-1, -1)),
                softcap=kwargs.get("softcap", 0.0))


GPU_CASES = [
    # (shape (b, sq, sk, hq, hkv, d, dv), flash_attn kwargs)
    ((2, 300, 300, 8, 8, 128, 128), {"causal": True}),
    ((1, 200, 777, 8, 2, 64, 64), {"causal": True}),
    ((2, 257, 129, 4, 1, 128, 128), {}),
    ((1, 500, 500, 4, 4, 128, 128), {"window_size": (100, 0), "softcap": 30.0}),
    ((1, 128, 384, 4, 2, 192, 128), {"causal": True}),
    ((1, 64, 64, 2, 2, 256, 256), {}),
]


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_forward_matches_reference(case, dtype, check):
    shape, kwargs = case
    q, k, v = make(*shape, dtype, device="cuda")
    options = _options(kwargs)
    _require("fwd", q, k, v, **options)
    out, lse, _ = fa4cpp.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    want, want_lse = reference.attention(q, k, v, **options)
    check.out(out, want, v)
    check.lse(lse, want_lse)


@pytest.mark.sm90
def test_gpu_forward_on_a_side_stream_and_packed_qkv(check):
    q, k, v = make(2, 256, 256, 8, 8, 128, 128, torch.bfloat16, device="cuda")
    _require("fwd", q, k, v, causal=True)
    qkv = torch.stack([q, k, v], dim=2).detach()
    want = fa4cpp.flash_attn_func(q, k, v, causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fa4cpp.flash_attn_qkvpacked_func(qkv, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.sm90
def test_gpu_varlen_forward_matches_reference(check):
    lengths_q, lengths_k = [100, 0, 257, 31], [300, 17, 257, 0]
    cu_q, cu_k = _cu(lengths_q).cuda(), _cu(lengths_k).cuda()
    q = torch.randn(int(cu_q[-1]), 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16, device="cuda")
    v = torch.randn(int(cu_k[-1]), 2, 128, dtype=torch.bfloat16, device="cuda")
    seqused_k = torch.tensor([250, 17, 100, 0], dtype=torch.int32, device="cuda")
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=257, max_seqlen_k=300,
                  seqused_k=seqused_k)
    _require("fwd", q, k, v, causal=True, **varlen)
    out, lse, _ = fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 257, 300, causal=True,
                                                return_attn_probs=True, seqused_k=seqused_k)
    want, want_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True,
                                                seqused_k=seqused_k)
    check.out(out, want, v)
    check.lse(lse, want_lse)


GPU_BACKWARD_CASES = [
    # (shape (b, sq, sk, hq, hkv, d, dv), flash_attn kwargs): every head dim of the sm90
    # backward table, the wide kernel's (d > 128) with GQA and dv != d among them.
    ((2, 200, 300, 4, 4, 64, 64), {"causal": True}),
    ((1, 257, 129, 6, 2, 96, 96), {}),
    ((2, 300, 300, 4, 1, 128, 128), {"window_size": (64, 0), "softcap": 20.0}),
    ((1, 129, 400, 4, 2, 192, 192), {"causal": True}),
    ((2, 200, 200, 4, 2, 192, 128), {"causal": True}),
    ((1, 300, 257, 4, 4, 256, 256), {"softcap": 30.0}),
]


@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_BACKWARD_CASES)
def test_gpu_backward_matches_reference(case, dtype, check):
    shape, kwargs = case
    q, k, v = make(*shape, dtype, device="cuda")
    options = _options(kwargs)
    _require("fwd", q, k, v, **options)
    _require("bwd", q, k, v, **options)
    out = fa4cpp.flash_attn_func(q, k, v, **kwargs)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, sizes = reference.attention_backward(dout, q, k, v, magnitudes=True, **options)
    check.grads(grads, want, sizes, dtype)


@pytest.mark.sm90
def test_gpu_backward_raises_or_falls_back(check):
    """Without a backward kernel for a problem the gradient raises with the library's reason;
    with fallback it comes from the reference. With one (this d128 problem, in a full build)
    the gradients are checked either way."""
    q, k, v = make(2, 128, 128, 4, 2, 128, 128, torch.bfloat16, device="cuda")
    _require("fwd", q, k, v, causal=True)
    out = fa4cpp.flash_attn_func(q, k, v, causal=True)
    dout = torch.randn_like(out)
    reason = ops.support("bwd", q, k, v, causal=True)
    if reason is not None:
        with pytest.raises(Fa4Error, match="backward"):
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    with fa4cpp.mode(fallback=True):
        grads = torch.autograd.grad(out, (q, k, v), dout)
    want, sizes = reference.attention_backward(dout, q, k, v, causal=True, magnitudes=True)
    check.grads(grads, want, sizes, torch.bfloat16)
