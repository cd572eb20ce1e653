"""FP8 (float8_e4m3fn) inputs of the forward through the package, FlashAttention-3's interface:
q_descale / k_descale / v_descale (fp32 (batch, heads_kv)) and a bfloat16 output, on CPU tensors.

Accuracy rule: a result passes iff max|out − ref| ≤ 2·max|lp − ref| + 1e-5, where ref is attention
in float64 on the dequantized inputs (each e4m3 value times its descale) and lp the FP8 algorithm
emulated in plain torch (_lp): fp32 scores with the descales, fp32 softmax, P rounded to e4m3
before P·V, fp32 accumulation, the output rounded to bfloat16. The library keeps P in fp32, so its
error stays well inside what the FP8 algorithm itself makes; a wrong descale (or a wrong output
dtype, or a kernel reading the wrong kv head) errs by the order of the values and fails.

Also: a KV cache of e4m3 takes appended rows in bfloat16 / float16, quantised on write (the cache
holds round_e4m3(row / descale)), or in e4m3, written as given; the errors of what FP8 does not
take; the refused backward; torch.compile; the modes. Each test runs on the native ops and on the
Python implementation (the `path` fixture)."""
import dataclasses
import math

import pytest
import torch

import fa4cpp
from fa4cpp import Fa4Error, FallbackWarning, VerificationError, c_abi, ops, reference
from test_kvcache import _case, _position, _rotate

E4M3 = torch.float8_e4m3fn


# -- inputs ---------------------------------------------------------------------------------------

def _e4m3(*shape, spread=2.0):
    """Random e4m3 values over several binades (normal draws times `spread`, rounded)."""
    return reference.round_e4m3(torch.randn(*shape) * spread)


def _descale(kind, batch, heads_kv):
    """fp32 (batch, heads_kv) descales of one layout: None, a shared value broadcast by expand()
    (strides 0), one per head (batch stride 0), one per (batch, head), or a transposed view."""
    if kind == "none":
        return None
    if kind == "shared":
        return torch.tensor(0.37).expand(batch, heads_kv)
    if kind == "per_head":
        return (torch.rand(1, heads_kv) + 0.25).expand(batch, heads_kv)
    if kind == "transposed":
        return (torch.rand(heads_kv, batch) * 1.5 + 0.25).t()
    return torch.rand(batch, heads_kv) * 1.5 + 0.25


def _row(descale, b, heads_kv):
    """(heads_kv,) descales of sequence b as float64 (ones without descales)."""
    if descale is None:
        return torch.ones(heads_kv, dtype=torch.float64)
    return descale[b].double()


# -- the two oracles ------------------------------------------------------------------------------

def _visible(sq, sk, causal=False, window=(-1, -1)):
    """(sq, sk): query i sees key j (flash_attn's bottom-right aligned band)."""
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diagonal = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        visible &= j >= diagonal - left
    if right >= 0:
        visible &= j <= diagonal + right
    return visible


def _ref(q, k, v, qd, kd, vd, scale, causal, window, softcap):
    """One sequence in float64 on the dequantized inputs: q (sq, hq, d), k / v (sk, hkv, ·) e4m3,
    descales (hkv,) float64. Returns O (sq, hq, dv) float64 (0 where a row sees no key)."""
    group = q.shape[1] // k.shape[1]
    qq = q.double() * qd.repeat_interleave(group)[None, :, None]
    kk = (k.double() * kd[None, :, None]).repeat_interleave(group, dim=1)
    vv = (v.double() * vd[None, :, None]).repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qq, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_visible(q.shape[0], k.shape[0], causal, window), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vv)


def _lp(q, k, v, qd, kd, vd, scale, causal, window, softcap):
    """One sequence by the FP8 algorithm in plain torch: fp32 scores scaled by
    scale·q_descale·k_descale, fp32 softmax (running max subtracted), the unnormalised P rounded
    to e4m3 (clamped to ±448) before P·V, fp32 accumulation, O = v_descale·acc / rowsum rounded to
    bfloat16."""
    group = q.shape[1] // k.shape[1]
    score_scale = (torch.tensor(scale, dtype=torch.float32) * qd.float() * kd.float())
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) \
        * score_scale.repeat_interleave(group)[:, None, None]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    visible = _visible(q.shape[0], k.shape[0], causal, window)
    s = s.masked_fill(~visible, -math.inf)
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else s.new_zeros(s.shape[:-1] + (1,))
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    rowsum = p.sum(dim=-1)
    p8 = reference.round_e4m3(p).float()
    acc = torch.einsum("hqk,khd->qhd", p8, vv)
    denom = rowsum.transpose(0, 1)[:, :, None]
    o = torch.where(denom > 0, acc / torch.where(denom > 0, denom, torch.ones_like(denom)),
                    torch.zeros_like(acc))
    return (o * vd.float().repeat_interleave(group)[None, :, None]).to(torch.bfloat16)


def _oracles(sequences, scale, causal=False, window=(-1, -1), softcap=0.0):
    """(ref, lp) of each sequence (q, k, v, qd, kd, vd), concatenated along the query rows."""
    refs, lps = [], []
    for q, k, v, qd, kd, vd in sequences:
        refs.append(_ref(q, k, v, qd, kd, vd, scale, causal, window, softcap))
        lps.append(_lp(q, k, v, qd, kd, vd, scale, causal, window, softcap))
    return torch.cat(refs), torch.cat(lps)


def _assert_rule(out, ref, lp, what="out"):
    """The accuracy rule of the module docstring."""
    assert out.dtype in (torch.bfloat16, torch.float16), out.dtype
    assert out.shape == ref.shape, (what, tuple(out.shape), tuple(ref.shape))
    assert torch.isfinite(out).all(), what
    err = float((out.double() - ref).abs().max()) if out.numel() else 0.0
    lp_err = float((lp.double() - ref).abs().max()) if lp.numel() else 0.0
    assert err <= 2 * lp_err + 1e-5, "%s: error %.3g > 2 × %.3g (the FP8 emulation's) + 1e-5" % (
        what, err, lp_err)


# -- fixed length ---------------------------------------------------------------------------------

FIXED = {
    "plain": dict(b=2, sq=17, sk=23, hq=4, hkv=4, d=32, descales="per_batch_head"),
    "causal_gqa": dict(b=2, sq=19, sk=40, hq=8, hkv=2, d=64, causal=True, descales="per_head"),
    "window": dict(b=3, sq=33, sk=33, hq=4, hkv=2, d=32, window=(5, 2), descales="shared"),
    "softcap": dict(b=2, sq=12, sk=30, hq=6, hkv=3, d=64, softcap=5.0, descales="transposed",
                    scale=0.3),
    "mqa_more_queries": dict(b=2, sq=29, sk=11, hq=4, hkv=1, d=16, causal=True,
                             descales="none"),
    "head_dims": dict(b=1, sq=9, sk=70, hq=2, hkv=1, d=96, dv=40, descales="per_batch_head"),
}


def _fixed_inputs(b, sq, sk, hq, hkv, d, dv=None, descales="none", **_):
    q, k, v = _e4m3(b, sq, hq, d), _e4m3(b, sk, hkv, d), _e4m3(b, sk, hkv, dv or d)
    return (q, k, v) + tuple(_descale(descales, b, hkv) for _ in range(3))


def _fixed_oracles(q, k, v, qd, kd, vd, scale, **mask):
    hkv = k.shape[2]
    return _oracles([(q[b], k[b], v[b], _row(qd, b, hkv), _row(kd, b, hkv), _row(vd, b, hkv))
                     for b in range(q.shape[0])], scale, **mask)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_length_forward_meets_the_rule(name, path):
    case = FIXED[name]
    q, k, v, qd, kd, vd = _fixed_inputs(**case)
    scale = case.get("scale", q.shape[-1] ** -0.5)
    mask = dict(causal=case.get("causal", False), window=case.get("window", (-1, -1)),
                softcap=case.get("softcap", 0.0))
    out, lse, _ = fa4cpp.flash_attn_func(
        q, k, v, softmax_scale=case.get("scale"), causal=mask["causal"],
        window_size=mask["window"], softcap=mask["softcap"], return_attn_probs=True,
        q_descale=qd, k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    ref, lp = _fixed_oracles(q, k, v, qd, kd, vd, scale, **mask)
    _assert_rule(out.reshape(-1, *out.shape[2:]), ref, lp, name)


def test_a_wrong_descale_fails_the_rule():
    """The rule catches a v descale a quarter too large: the comparison can fail."""
    q, k, v, qd, kd, vd = _fixed_inputs(**FIXED["plain"])
    out = fa4cpp.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd * 1.25)
    ref, lp = _fixed_oracles(q, k, v, qd, kd, vd, q.shape[-1] ** -0.5)
    with pytest.raises(AssertionError, match="FP8 emulation"):
        _assert_rule(out.reshape(-1, *out.shape[2:]), ref, lp)


def test_no_descales_are_ones(path):
    q, k, v, _, _, _ = _fixed_inputs(**FIXED["plain"])
    ones = torch.ones(q.shape[0], k.shape[2])
    plain = fa4cpp.flash_attn_func(q, k, v, causal=True)
    assert plain.dtype == torch.bfloat16
    assert torch.equal(plain, fa4cpp.flash_attn_func(q, k, v, causal=True, q_descale=ones,
                                                     k_descale=ones, v_descale=ones))


def test_native_and_python_paths_agree():
    q, k, v, qd, kd, vd = _fixed_inputs(**FIXED["causal_gqa"])
    args = dict(causal=True, q_descale=qd, k_descale=kd, v_descale=vd)
    native = fa4cpp.flash_attn_func(q, k, v, **args)
    with ops.python_path():
        python = fa4cpp.flash_attn_func(q, k, v, **args)
    assert native.dtype == python.dtype == torch.bfloat16
    assert torch.equal(native, python)


# -- varlen ---------------------------------------------------------------------------------------

def _cu(lens):
    return torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], dtype=torch.int32)


@pytest.mark.parametrize("causal,window,seqused", [(True, (-1, -1), False), (False, (4, 1), True)])
def test_varlen_forward_meets_the_rule(causal, window, seqused, path):
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 30]
    hq, hkv, d = 4, 2, 32
    q, k, v = _e4m3(sum(lens_q), hq, d), _e4m3(sum(lens_k), hkv, d), _e4m3(sum(lens_k), hkv, d)
    batch = len(lens_q)
    qd, kd, vd = (_descale("per_batch_head", batch, hkv) for _ in range(3))
    used = [7, 2, 17, 25] if seqused else lens_k
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = fa4cpp.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal, window_size=window,
        seqused_k=torch.tensor(used, dtype=torch.int32) if seqused else None, q_descale=qd,
        k_descale=kd, v_descale=vd)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lens_q), hq, d)
    sequences = [(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b] + used[b]],
                  v[cu_k[b]:cu_k[b] + used[b]], _row(qd, b, hkv), _row(kd, b, hkv),
                  _row(vd, b, hkv)) for b in range(batch)]
    ref, lp = _oracles(sequences, d ** -0.5, causal=causal, window=window)
    _assert_rule(out, ref, lp)


# -- KV cache -------------------------------------------------------------------------------------

def _e4m3_ulp(x):
    """The spacing of e4m3 values at |x| (2^-9 in the subnormal range)."""
    mag = x.double().abs().clamp(min=2.0 ** -6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 3)


def _fp8_case(seed, new_dtype, rotary=None, **case):
    """_case's KV-cache call with q and the caches in e4m3, appended rows in new_dtype (their
    values spread so that quantising them matters, one past the e4m3 range after its descale),
    rotary tables in the output's dtype, and per-(batch, kv head) descales."""
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(seed, rotary=rotary, **case)
    q, k_cache, v_cache = (reference.round_e4m3(t * 2) for t in (q, k_cache, v_cache))
    batch, hkv = len(lens_q), k_cache.shape[2]
    descales = dict(q_descale=_descale("per_batch_head", batch, hkv),
                    k_descale=_descale("per_batch_head", batch, hkv) * 0.05,
                    v_descale=_descale("per_batch_head", batch, hkv) * 0.05)
    out_dtype = torch.bfloat16 if new_dtype == E4M3 else new_dtype
    if "k" in args:
        if new_dtype == E4M3:
            args["k"], args["v"] = (reference.round_e4m3(args[n] * 2) for n in ("k", "v"))
        else:
            args["k"], args["v"] = (args[n].to(new_dtype) * 0.1 for n in ("k", "v"))
            args["k"].view(-1)[0] = 1000.0 * 0.1  # beyond ±448 once divided: saturates
    if rotary:
        args["rotary_cos"], args["rotary_sin"] = (args[n].to(out_dtype)
                                                  for n in ("rotary_cos", "rotary_sin"))
    return q, k_cache, v_cache, cache_seqlens, args, lens_q, new, descales, out_dtype


def _kv_oracles(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, descales, causal,
                page_size):
    """(ref, lp) of a KV-cache call over the cache as the call left it; queries rotated (float64)
    and rounded to e4m3, as the library's semantics say."""
    cos, sin = args.get("rotary_cos"), args.get("rotary_sin")
    interleaved = args.get("rotary_interleaved", True)
    hkv = k_cache.shape[2]
    sequences, first = [], 0
    for b, (lq, n) in enumerate(zip(lens_q, new)):
        base = int(cache_seqlens[b])
        qb = q[first:first + lq] if q.dim() == 3 else q[b]
        first += lq
        if cos is not None:
            i = torch.arange(lq)
            positions = base + (i if causal else 0 * i)
            qb = reference.round_e4m3(_rotate(qb.double(), cos, sin, positions, interleaved))
        idx = [_position(args, b, p, page_size) for p in range(base + n)]
        first_idx = torch.tensor([f for f, _ in idx], dtype=torch.long)
        second_idx = torch.tensor([s for _, s in idx], dtype=torch.long)
        sequences.append((qb, k_cache[first_idx, second_idx], v_cache[first_idx, second_idx],
                          _row(descales["q_descale"], b, hkv), _row(descales["k_descale"], b, hkv),
                          _row(descales["v_descale"], b, hkv)))
    ref, lp = _oracles(sequences, q.shape[-1] ** -0.5, causal=causal)
    return ref, lp


def _appended_rows(args, b, n, new_rows):
    start = int(args["cu_seqlens_k_new"][b]) if "cu_seqlens_k_new" in args else 0
    return new_rows[start:start + n] if new_rows.dim() == 3 else new_rows[b, :n]


def _check_cache(k_cache, v_cache, before, cache_seqlens, args, new, descales, page_size):
    """The appended rows hold round_e4m3(row / descale) (16-bit rows) or the rows as given (e4m3
    rows), k rotated first (then within one e4m3 step: the rotation's rounding may differ); every
    other cache entry is as it was."""
    cos, sin = args.get("rotary_cos"), args.get("rotary_sin")
    interleaved = args.get("rotary_interleaved", True)
    quantize = args["k"].dtype != E4M3
    changed = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(new):
        base = int(cache_seqlens[b])
        for name, cache, descale in (("k", k_cache, "k_descale"), ("v", v_cache, "v_descale")):
            rows = _appended_rows(args, b, n, args[name])
            rotated = name == "k" and cos is not None
            if rotated:
                rows = _rotate(rows.double(), cos, sin, torch.arange(base, base + n), interleaved)
            if quantize:
                rows = rows.float() / descales[descale][b].float()[None, :, None]
            want = reference.round_e4m3(rows)
            for j in range(n):
                f, s = _position(args, b, base + j, page_size)
                changed[f, s] = True
                got = cache[f, s]
                if rotated:
                    gap = (got.double() - want[j].double()).abs()
                    assert (gap <= _e4m3_ulp(want[j])).all(), (name, b, j, float(gap.max()))
                else:
                    assert torch.equal(got.view(torch.uint8), want[j].view(torch.uint8)), \
                        (name, b, j)
    for cache, old in zip((k_cache, v_cache), before):
        assert torch.equal(cache[~changed].view(torch.uint8), old[~changed].view(torch.uint8))


KV_CASES = [
    dict(new_dtype=torch.bfloat16, page_size=16, append=3),
    dict(new_dtype=torch.float16, page_size=7, append=2, rotary="neox_half"),
    dict(new_dtype=torch.bfloat16, page_size=16, append=4, varlen_new=True, varlen_q=True, sq=4,
         rotary="gptj_full"),
    dict(new_dtype=E4M3, page_size=16, append=3),
    dict(new_dtype=E4M3, page_size=7, append=2, rotary="neox_full", batch_idx=True),
    dict(new_dtype=torch.bfloat16, append=2),  # a cache without pages
]


@pytest.mark.parametrize("n", range(len(KV_CASES)))
def test_kvcache_appends_and_attention(n, path):
    case = dict(KV_CASES[n])
    page_size = case.get("page_size")
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new, descales, out_dtype = _fp8_case(
        300 + n, **case)
    before = (k_cache.clone(), v_cache.clone())
    out, lse = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                              causal=True, return_softmax_lse=True, **args,
                                              **descales)
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    _check_cache(k_cache, v_cache, before, cache_seqlens, args, new, descales, page_size)
    ref, lp = _kv_oracles(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, descales, True,
                          page_size)
    _assert_rule(out.reshape(ref.shape), ref, lp)


def test_kvcache_saturates_quantised_appends():
    q, k_cache, v_cache, cache_seqlens, args, _, _, descales, _ = _fp8_case(
        310, torch.bfloat16, page_size=16, append=1)
    fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **args,
                                   **descales)
    f, s = _position(args, 0, int(cache_seqlens[0]), 16)
    assert float(k_cache[f, s, 0, 0].float()) == 448.0  # 100 / (descale ≤ 0.0875): past 448


@pytest.mark.parametrize("with_out", [True, False])
def test_vllm_call_with_an_fp8_paged_cache(with_out, path):
    """flash_attn_varlen_func as vLLM calls it on an FP8 cache: block_table, seqused_k, descales
    broadcast from one scale per layer by expand(), a bfloat16 out= written in place."""
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new, _, _ = _fp8_case(
        320, E4M3, page_size=16, varlen_q=True, sq=4, capacity=80)
    batch, hkv = len(lens_q), k_cache.shape[2]
    descales = {name: torch.tensor([[value]]).expand(batch, hkv)
                for name, value in (("q_descale", 0.5), ("k_descale", 0.25), ("v_descale", 2.0))}
    out = torch.full((q.shape[0] + 3, q.shape[1], v_cache.shape[-1]), float("nan"),
                     dtype=torch.bfloat16)
    result, lse = fa4cpp.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
        max_seqlen_q=4, max_seqlen_k=80, seqused_k=cache_seqlens, causal=True,
        block_table=args["page_table"], out=out[:q.shape[0]] if with_out else None,
        return_softmax_lse=True, fa_version=3, **descales)
    if with_out:
        assert result.data_ptr() == out.data_ptr()
        assert torch.isnan(out[q.shape[0]:].float()).all()  # nothing past the rows
    assert result.dtype == torch.bfloat16 and lse.shape == (q.shape[1], q.shape[0])
    ref, lp = _kv_oracles(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, descales, True,
                          16)
    _assert_rule(result, ref, lp)


# -- errors ---------------------------------------------------------------------------------------

def _bf16_qkv():
    return [torch.randn(2, 5, h, 16, dtype=torch.bfloat16) for h in (4, 2, 2)]


def _fp8_qkv():
    return [_e4m3(2, 5, h, 16) for h in (4, 2, 2)]


BAD_CALLS = {
    "descales with bf16 inputs": (
        "q_descale is given, but the inputs are torch.bfloat16",
        lambda: fa4cpp.flash_attn_func(*_bf16_qkv(), q_descale=torch.ones(2, 2))),
    "descales with bf16 varlen inputs": (
        "v_descale is given",
        lambda: fa4cpp.flash_attn_varlen_func(
            *[t[0] for t in _bf16_qkv()], _cu([2, 3]), _cu([2, 3]), 3, 3,
            v_descale=torch.ones(2, 2))),
    "descales with a bf16 cache": (
        "k_descale is given",
        lambda: fa4cpp.flash_attn_with_kvcache(*_bf16_qkv(), k_descale=torch.ones(2, 2))),
    "descale per query head": (
        r"q_descale must be a float32 tensor of shape \(batch, heads_kv\) = \(2, 2\)",
        lambda: fa4cpp.flash_attn_func(*_fp8_qkv(), q_descale=torch.ones(2, 4))),
    "descale of one dimension": (
        "k_descale must be a float32 tensor",
        lambda: fa4cpp.flash_attn_func(*_fp8_qkv(), k_descale=torch.ones(2))),
    "fp16 descale": (
        "v_descale must be a float32 tensor",
        lambda: fa4cpp.flash_attn_func(*_fp8_qkv(),
                                       v_descale=torch.ones(2, 2, dtype=torch.float16))),
    "varlen descale per token": (
        "q_descale must be a float32 tensor of shape",
        lambda: fa4cpp.flash_attn_varlen_func(
            *[t[0] for t in _fp8_qkv()], _cu([2, 3]), _cu([2, 3]), 3, 3,
            q_descale=torch.ones(5, 2))),
    "fp8 q with bf16 k": (
        "one dtype",
        lambda: fa4cpp.flash_attn_func(_fp8_qkv()[0], *_bf16_qkv()[1:])),
    "appends of two dtypes": (
        "v has shape",
        lambda: fa4cpp.flash_attn_with_kvcache(
            *_fp8_qkv(), k=torch.randn(2, 1, 2, 16, dtype=torch.bfloat16),
            v=torch.randn(2, 1, 2, 16, dtype=torch.float16), cache_seqlens=2)),
    "fp32 appends": (
        "k has shape",
        lambda: fa4cpp.flash_attn_with_kvcache(
            *_fp8_qkv(), k=torch.randn(2, 1, 2, 16), v=torch.randn(2, 1, 2, 16),
            cache_seqlens=2)),
    "rotary tables not in the output's dtype": (
        "rotary_cos must be a .* torch.float16",
        lambda: fa4cpp.flash_attn_with_kvcache(
            *_fp8_qkv(), k=torch.randn(2, 1, 2, 16, dtype=torch.float16),
            v=torch.randn(2, 1, 2, 16, dtype=torch.float16), cache_seqlens=2,
            rotary_cos=torch.ones(8, 8, dtype=torch.bfloat16),
            rotary_sin=torch.zeros(8, 8, dtype=torch.bfloat16))),
    "fp16 out= for fp8": (
        "out must be a torch.bfloat16 tensor",
        lambda: fa4cpp.flash_attn_varlen_func(
            _e4m3(5, 4, 16), _e4m3(4, 8, 2, 16), _e4m3(4, 8, 2, 16), _cu([2, 3]), None, 3, 16,
            seqused_k=torch.tensor([3, 4], dtype=torch.int32),
            block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
            out=torch.empty(5, 4, 16, dtype=torch.float16))),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_fp8_calls_raise(name, path):
    match, call = BAD_CALLS[name]
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("varlen", [False, True])
def test_backward_is_refused(varlen, path):
    """FP8 is forward-only: the forward runs under autograd, the backward raises, in fallback mode
    too (the reference could compute gradients, but not of any use to e4m3 tensors)."""
    q, k, v = _fp8_qkv()
    if varlen:
        q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))
    q.requires_grad_()
    for fallback in (False, True):
        with fa4cpp.mode(fallback=fallback):
            if varlen:
                out = fa4cpp.flash_attn_varlen_func(q, k, v, _cu([5, 5]), _cu([5, 5]), 5, 5,
                                                    q_descale=torch.ones(2, 2))
            else:
                out = fa4cpp.flash_attn_func(q, k, v, q_descale=torch.ones(2, 2))
            assert out.dtype == torch.bfloat16 and out.requires_grad
            with pytest.raises(Fa4Error, match="forward-only") as error:
                out.float().sum().backward()
            assert error.value.status == c_abi.ERROR_NOT_SUPPORTED


def test_bwd_op_refuses_fp8():
    q, k, v = _fp8_qkv()
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -1, -1, 0.0)
    with pytest.raises(Fa4Error, match="forward-only"):
        torch.ops.fa4cpp.bwd(out, q, k, v, out, lse, 0.0, False, -1, -1, 0.0, False)


@pytest.mark.sm90
def test_gpu_fp8_without_a_kernel():
    """The sm90 backend has no e4m3 kernel of these head dims (16): CUDA fp8 tensors get its
    reason, and fallback mode runs them on the reference."""
    q, k, v = (t.cuda() for t in _fp8_qkv())
    with pytest.raises(Fa4Error, match="e4m3"):
        fa4cpp.flash_attn_func(q, k, v)
    with fa4cpp.mode(fallback=True), pytest.warns(FallbackWarning, match="e4m3"):
        assert fa4cpp.flash_attn_func(q, k, v).dtype == torch.bfloat16


def test_support_names_the_sm90_refusal():
    """Where a CUDA call goes, without a GPU: the library's can_implement for the sm90 backend,
    which refuses e4m3 of head dim 16 (no kernel in any build) with its reason (the error a CUDA
    call raises, or falls back on)."""
    q, k, v = _fp8_qkv()
    assert ops.support("fwd", q, k, v) is None
    assert "e4m3" in ops.support("bwd", q, k, v)
    why = ops.support("fwd", q, k, v, backend="sm90")
    assert "e4m3" in why and "16" in why


# -- torch.compile and the modes ------------------------------------------------------------------

def test_compiled_fp8_call_matches_eager(path):
    torch._dynamo.reset()
    q, k, v, qd, kd, vd = _fixed_inputs(**FIXED["causal_gqa"])

    def step(q, k, v, qd, kd, vd):
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd)
        return out * 2

    explanation = torch._dynamo.explain(step)(q, k, v, qd, kd, vd)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(q, k, v, qd, kd, vd)
    want = step(q, k, v, qd, kd, vd)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_compiled_fp8_call_with_grads_refuses_the_backward_when_compiled():
    """torch.compile traces the backward of inputs that require grad: the refusal comes then."""
    torch._dynamo.reset()
    q, k, v = _fp8_qkv()
    q.requires_grad_()
    compiled = torch.compile(lambda q, k, v: fa4cpp.flash_attn_func(q, k, v), fullgraph=True)
    with pytest.raises(Exception, match="forward-only"):
        compiled(q, k, v)


def test_compiled_kvcache_call_outputs_the_appends_dtype(path):
    torch._dynamo.reset()
    q, k_cache, v_cache, cache_seqlens, args, _, _, descales, _ = _fp8_case(
        330, torch.float16, page_size=16, append=1, sq=1)
    k2, v2 = k_cache.clone(), v_cache.clone()

    def step(q, k_cache, v_cache, k, v, cache_seqlens, page_table, qd, kd, vd):
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                              cache_seqlens=cache_seqlens, page_table=page_table,
                                              causal=True, q_descale=qd, k_descale=kd,
                                              v_descale=vd)

    inputs = (args["k"], args["v"], cache_seqlens, args["page_table"], descales["q_descale"],
              descales["k_descale"], descales["v_descale"])
    eager = step(q, k_cache, v_cache, *inputs)
    got = torch.compile(step, fullgraph=True, backend="eager")(q, k2, v2, *inputs)
    assert got.dtype == eager.dtype == torch.float16
    assert torch.equal(got, eager)
    assert torch.equal(k2.view(torch.uint8), k_cache.view(torch.uint8))


def test_verify_mode_passes_and_catches_fp8(monkeypatch):
    q, k, v, qd, kd, vd = _fixed_inputs(**FIXED["softcap"])
    descales = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    with fa4cpp.mode(verify=1.0):
        fa4cpp.flash_attn_func(q, k, v, softcap=5.0, **descales)
        kq, k_cache, v_cache, cache_seqlens, args, _, _, kv_descales, _ = _fp8_case(
            340, torch.bfloat16, page_size=7, append=2, rotary="neox_full")
        fa4cpp.flash_attn_with_kvcache(kq, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       causal=True, **args, **kv_descales)
    real = c_abi.Library.forward

    def wrong_descale(self, q, k, v, out, lse, params, *rest):
        fp8 = dataclasses.replace(params.fp8, v_descale=params.fp8.v_descale * 3)
        real(self, q, k, v, out, lse, dataclasses.replace(params, fp8=fp8), *rest)
    monkeypatch.setattr(c_abi.Library, "forward", wrong_descale)
    with fa4cpp.mode(verify=1.0), pytest.raises(VerificationError, match="output"):
        fa4cpp.flash_attn_func(q, k, v, softcap=5.0, **descales)


def test_fallback_runs_refused_fp8_on_the_reference(monkeypatch):
    """A refused FP8 problem (support() replaced: the library would run this one) runs on the
    reference with its descales and output dtype."""
    q, k, v, qd, kd, vd = _fixed_inputs(**FIXED["window"])
    monkeypatch.setattr(ops, "support", lambda *args, **kwargs: "refused for the test")
    with ops.python_path(), fa4cpp.mode(fallback=True), \
            pytest.warns(FallbackWarning, match="refused for the test"):
        out = fa4cpp.flash_attn_func(q, k, v, window_size=(5, 2), q_descale=qd, k_descale=kd,
                                     v_descale=vd)
    assert out.dtype == torch.bfloat16
    ref, lp = _fixed_oracles(q, k, v, qd, kd, vd, q.shape[-1] ** -0.5, window=(5, 2))
    _assert_rule(out.reshape(-1, *out.shape[2:]), ref, lp)


def test_reference_quantises_as_the_library():
    """reference.round_e4m3 saturates at ±448 (torch's conversion alone gives NaN past 464) and
    rounds ties to even; dequantize() scales varlen rows by their sequence's descales."""
    x = torch.tensor([1000.0, -500.0, 449.0, 2.0 ** -10, 3 * 2.0 ** -10, float("nan")])
    got = reference.round_e4m3(x).float()
    assert got[:5].tolist() == [448.0, -448.0, 448.0, 0.0, 2.0 ** -8]
    assert math.isnan(got[5])
    rows = reference.dequantize(torch.ones(6, 2, 1, dtype=E4M3), torch.tensor([[2.0], [3.0]]),
                                _cu([4, 2]), group=2)
    assert rows[:, :, 0].tolist() == [[2.0, 2.0]] * 4 + [[3.0, 3.0]] * 2
