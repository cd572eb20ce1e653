"""The custom ops torch.ops.fa4cpp.{fwd,bwd,varlen_fwd,varlen_bwd} and ops.support() on CPU
tensors (the CPU backend), against fa4cpp.reference."""
import pytest
import torch

import fa4cpp
from fa4cpp import c_abi, ops, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, head_dim_v, causal, window, softcap,
#  softmax_scale)
CASES = [
    (2, 17, 17, 4, 4, 32, 32, False, (-1, -1), 0.0, 0.0),
    (2, 13, 29, 6, 2, 16, 24, True, (-1, -1), 0.0, 0.0),      # GQA, dv != d, causal sq < sk
    (1, 21, 9, 4, 1, 8, 8, True, (-1, -1), 0.0, 0.0),         # MQA, sq > sk: rows see no key
    (2, 19, 23, 4, 2, 16, 16, False, (4, 2), 2.5, 0.3),       # window, softcap, explicit scale
    (1, 11, 11, 2, 2, 64, 64, False, (0, 0), 0.0, -0.2),      # diagonal only, negative scale
    (1, 5, 0, 2, 1, 16, 16, False, (-1, -1), 0.0, 0.0),       # no keys at all
]


def _inputs(case, dtype, requires_grad=False):
    b, sq, sk, hq, hkv, d, dv = case[:7]
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _options(case):
    causal, window, softcap, scale = case[7:]
    return dict(softmax_scale=scale, causal=causal, window=window, softcap=softcap)


def _op_args(case):
    causal, window, softcap, scale = case[7:]
    return (scale, causal, window[0], window[1], softcap)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_fwd_matches_reference(case, dtype, check):
    q, k, v = _inputs(case, dtype)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, *_op_args(case))
    ref_out, ref_lse = reference.attention(q, k, v, **_options(case))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape[:-1] + (v.shape[-1],)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    check.out(out, ref_out, v)
    check.lse(lse, ref_lse)


def test_rows_without_keys_give_zero_and_infinite_lse():
    case = CASES[2]  # causal, sq 21 > sk 9: the first 12 query rows see no key
    q, k, v = _inputs(case, torch.float32)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, *_op_args(case))
    assert torch.all(out[:, :12] == 0)
    assert torch.all(lse[:, :, :12] == float("inf"))
    assert torch.all(torch.isfinite(lse[:, :, 12:]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_bwd_matches_reference(case, dtype, check):
    q, k, v = _inputs(case, dtype, requires_grad=True)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, *_op_args(case))
    assert not lse.requires_grad  # LSE is not differentiable
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, sizes = reference.attention_backward(dout, q, k, v, magnitudes=True, **_options(case))
    check.grads(grads, want, sizes, dtype)


def test_reference_backward_matches_autograd():
    """The explicit formulas fallback runs are the gradients of the differentiable reference."""
    case = CASES[3]
    q, k, v = _inputs(case, torch.float64, requires_grad=True)
    out, _ = reference.attention(q, k, v, **_options(case))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for g, w in zip(grads, reference.attention_backward(dout, q, k, v, **_options(case))):
        torch.testing.assert_close(g, w)


def test_bwd_op_directly(check):
    """bwd with the forward's out / lse, called as the SDPA integration calls it."""
    case = CASES[1]
    q, k, v = _inputs(case, torch.bfloat16)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, *_op_args(case))
    dout = torch.randn_like(out)
    grads = torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *_op_args(case), False)
    want, sizes = reference.attention_backward(dout, q, k, v, magnitudes=True, **_options(case))
    check.grads(grads, want, sizes, torch.bfloat16)


def test_deterministic_backward_is_bitwise_reproducible():
    case = CASES[1]
    q, k, v = _inputs(case, torch.bfloat16)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, *_op_args(case))
    dout = torch.randn_like(out)
    first = torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *_op_args(case), True)
    second = torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *_op_args(case), True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_strided_inputs_need_no_copy_and_match_contiguous():
    """q/k/v as slices of one packed buffer and as transposes of (b, h, s, d) tensors."""
    b, s, h, d = 2, 12, 4, 16
    qkv = torch.randn(b, s, 3, h, d)
    q, k, v = qkv.unbind(dim=2)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, 0.0, True, -1, -1, 0.0)
    want_out, want_lse = torch.ops.fa4cpp.fwd(q.contiguous(), k.contiguous(), v.contiguous(),
                                              0.0, True, -1, -1, 0.0)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    bhsd = torch.randn(b, h, s, d)
    out_t, _ = torch.ops.fa4cpp.fwd(bhsd.transpose(1, 2), k, v, 0.0, True, -1, -1, 0.0)
    out_c, _ = torch.ops.fa4cpp.fwd(bhsd.transpose(1, 2).contiguous(), k, v, 0.0, True, -1, -1,
                                    0.0)
    assert torch.equal(out_t, out_c)


def test_non_contiguous_last_dim_is_copied():
    q = torch.randn(1, 8, 2, 16).transpose(-1, -3)  # last dim has stride != 1: (1, 16, 2, 8)
    assert q.stride(-1) != 1
    k, v = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    out, _ = torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -1, -1, 0.0)
    want, _ = torch.ops.fa4cpp.fwd(q.contiguous(), k, v, 0.0, False, -1, -1, 0.0)
    assert torch.equal(out, want)


# -- varlen ---------------------------------------------------------------------------------------

def _varlen_inputs(dtype, lengths_q, lengths_k, hq=4, hkv=2, d=16, dv=16, extra_rows=0,
                   requires_grad=False):
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0).to(torch.int32)
    total_q, total_k = int(cu_q[-1]) + extra_rows, int(cu_k[-1])
    q = torch.randn(total_q, hq, d, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(total_k, hkv, d, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(total_k, hkv, dv, dtype=dtype, requires_grad=requires_grad)
    return q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k)


VARLEN_CASES = [
    # lengths_q, lengths_k, causal, window, seqused_k
    ([5, 0, 9, 3], [7, 4, 9, 0], True, (-1, -1), None),   # zero-length q, zero-length k
    ([6, 8], [10, 8], False, (3, 1), [4, 8]),             # window and seqused_k
    ([4, 7, 1], [4, 7, 6], True, (-1, -1), [0, 5, 6]),    # a sequence using no key
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_matches_reference(case, dtype, check):
    lengths_q, lengths_k, causal, window, used = case
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(dtype, lengths_q, lengths_k,
                                                       extra_rows=2, requires_grad=True)
    seqused_k = None if used is None else torch.tensor(used, dtype=torch.int32)
    out, lse = torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, seqused_k, 0.0,
                                           causal, window[0], window[1], 0.0)
    opts = dict(causal=causal, window=window, seqused_k=seqused_k)
    ref_out, ref_lse = reference.varlen_attention(q, k, v, cu_q, cu_k, **opts)
    rows = int(cu_q[-1])  # the 2 rows after the last sequence are left unwritten
    assert out.shape == (q.shape[0], 4, 16) and lse.shape == (4, q.shape[0])
    check.out(out[:rows], ref_out[:rows], v)
    check.lse(lse[:, :rows], ref_lse[:, :rows])
    dout = torch.randn_like(out)
    dout[rows:] = 0
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, sizes = reference.varlen_attention_backward(dout, q, k, v, cu_q, cu_k, magnitudes=True,
                                                      **opts)
    check.grads(grads, want, sizes, dtype)
    assert torch.all(grads[0][rows:] == 0)  # rows outside every sequence: zero gradient
    if used is not None:
        for b, n in enumerate(used):  # keys beyond seqused_k: dK = dV = 0
            start, end = int(cu_k[b]) + n, int(cu_k[b + 1])
            assert torch.all(grads[1][start:end] == 0) and torch.all(grads[2][start:end] == 0)


def test_varlen_equals_fixed_length_per_sequence():
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(torch.float32, [6, 9], [8, 9])
    out, lse = torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, None, 0.0, True,
                                           -1, -1, 0.0)
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        o, l = torch.ops.fa4cpp.fwd(q[qs][None], k[ks][None], v[ks][None], 0.0, True, -1, -1, 0.0)
        torch.testing.assert_close(out[qs], o[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(lse[:, qs], l[0], rtol=0, atol=1e-6)


def test_varlen_sequence_longer_than_max_seqlen_is_refused():
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(torch.float32, [6, 9], [8, 9])
    with pytest.raises(c_abi.Fa4Error, match="seqlen_q"):
        torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_q, cu_k, max_q - 1, max_k, None, 0.0, False,
                                    -1, -1, 0.0)


# -- support() and errors -------------------------------------------------------------------------

def test_support_accepts_what_the_cpu_backend_runs():
    q, k, v = _inputs(CASES[1], torch.bfloat16)
    assert ops.support("fwd", q, k, v, causal=True) is None
    assert ops.support("bwd", q, k, v, causal=True, window=(3, 0), softcap=1.0) is None
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs(torch.float32, [3, 4], [5, 0])
    assert ops.support("fwd", qv, kv, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                       max_seqlen_q=max_q, max_seqlen_k=max_k,
                       seqused_k=torch.tensor([2, 0], dtype=torch.int32)) is None


def test_support_gives_the_library_reason():
    q = torch.randn(1, 4, 2, 300)  # the CPU backend takes head dims up to 256
    k = v = torch.randn(1, 4, 2, 300)
    reason = ops.support("fwd", q, k, v)
    assert reason is not None and "head_dim_qk is 300" in reason
    # fp32 has no sm90 kernel, and a CPU-only library has no sm90 backend at all: refused either way
    q, k, v = _inputs(CASES[0], torch.float32)
    assert ops.support("fwd", q, k, v, backend="sm90") is not None


def test_support_refuses_without_raising():
    q, k, v = _inputs(CASES[0], torch.float32)
    assert "dtype" in ops.support("fwd", q.double(), k.double(), v.double())
    assert "multiple" in ops.support("fwd", q[:, :, :3], k, v)
    meta = [t.to("meta") for t in (q, k, v)]
    assert "meta" in ops.support("fwd", *meta)
    assert ops.support("fwd", *meta, backend="cpu") is None  # shapes only: meta is fine
    with pytest.raises(ValueError, match="pass_"):
        ops.support("forward", q, k, v)


def test_unsupported_problem_raises_with_the_library_reason():
    q = torch.randn(1, 4, 2, 300)
    with pytest.raises(c_abi.Fa4Error, match="head_dim_qk is 300"):
        torch.ops.fa4cpp.fwd(q, q, q, 0.0, False, -1, -1, 0.0)


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q, k[:, :, :1], v), "same key rows and heads"),
    (lambda q, k, v: (q, k, v.to(torch.bfloat16)), "one dtype"),
    (lambda q, k, v: (q[0], k, v), "expected"),
    (lambda q, k, v: (q, k[:1], v[:1]), "batch size"),
    (lambda q, k, v: (q[..., :8], k, v), "head dim"),
])
def test_malformed_inputs_raise_value_error(bad, message):
    q, k, v = _inputs(CASES[0], torch.float32)
    with pytest.raises(ValueError, match=message):
        torch.ops.fa4cpp.fwd(*bad(q, k, v), 0.0, False, -1, -1, 0.0)


def test_malformed_scalars_raise_value_error():
    q, k, v = _inputs(CASES[0], torch.float32)
    with pytest.raises(ValueError, match="window_left"):
        torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -2, -1, 0.0)
    with pytest.raises(ValueError, match="softcap"):
        torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -1, -1, -1.0)
    qv, kv, vv, cu_q, cu_k, max_q, max_k = _varlen_inputs(torch.float32, [3, 4], [5, 2])
    with pytest.raises(ValueError, match="cu_seqlens_k"):
        torch.ops.fa4cpp.varlen_fwd(qv, kv, vv, cu_q, cu_k.long(), max_q, max_k, None, 0.0, False,
                                    -1, -1, 0.0)
    with pytest.raises(ValueError, match="seqused_k"):
        torch.ops.fa4cpp.varlen_fwd(qv, kv, vv, cu_q, cu_k, max_q, max_k,
                                    torch.tensor([1], dtype=torch.int32), 0.0, False, -1, -1, 0.0)


# -- registration: schema, fake tensors, autograd (torch.library.opcheck) ------------------------

def test_opcheck_fixed_length():
    q, k, v = _inputs(CASES[1], torch.float32, requires_grad=True)
    torch.library.opcheck(torch.ops.fa4cpp.fwd.default, (q, k, v, 0.0, True, -1, -1, 0.0))
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, 0.0, True, -1, -1, 0.0)
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse,
            0.0, True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.fa4cpp.bwd.default, args)


def test_opcheck_varlen():
    q, k, v, cu_q, cu_k, max_q, max_k = _varlen_inputs(torch.float32, [3, 0, 5], [4, 2, 5],
                                                       requires_grad=True)
    used = torch.tensor([2, 2, 5], dtype=torch.int32)
    torch.library.opcheck(torch.ops.fa4cpp.varlen_fwd.default,
                          (q, k, v, cu_q, cu_k, max_q, max_k, used, 0.0, True, -1, -1, 0.0))
    out, lse = torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, used, 0.0, True,
                                           -1, -1, 0.0)
    torch.library.opcheck(torch.ops.fa4cpp.varlen_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(),
                           out.detach(), lse, cu_q, cu_k, max_q, max_k, used, 0.0, True, -1, -1,
                           0.0, False))


def test_version_comes_from_the_library():
    from fa4cpp import _library
    assert fa4cpp.__version__ == _library.library().version()
    assert fa4cpp.__version__.count(".") >= 1
