"""flash_attn_with_kvcache (FlashAttention-3's signature) on CPU tensors: the library's KV cache
against a naive attention written here (float64, one sequence at a time, the appends and the
rotary embedding spelled out), the cache's contents after the appends, the Python reference the
fallback and verify modes use, refusals of what fa4cpp does not compute, and torch.compile."""
import math

import pytest
import torch

import fa4cpp
from fa4cpp import reference


def _rotate(x, cos, sin, positions, interleaved):
    """x (n, h, d) float64, rotated at positions (n,) over its first 2·cos.shape[1] dims."""
    half = cos.shape[1]
    c = cos.double()[positions][:, None, :]
    s = sin.double()[positions][:, None, :]
    y = x.clone()
    if interleaved:
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = a * c - b * s, a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = a * c - b * s, a * s + b * c
    return y


def _naive(q, keys, values, scale, causal, window):
    """q (sq, hq, d), keys / values (sk, hkv, d) float64: O (sq, hq, dv), LSE (hq, sq)."""
    sq, hq, _ = q.shape
    sk, hkv, _ = keys.shape
    group = hq // hkv
    k = keys.repeat_interleave(group, dim=1)
    v = values.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    diagonal = i + sk - sq
    visible = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        visible &= j >= diagonal - left
    if right >= 0:
        visible &= j <= diagonal + right
    s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, v)
    return out, torch.where(visible.any(-1)[None, :], lse, torch.full_like(lse, math.inf))


def _case(seed, *, dtype=torch.float32, batch=3, sq=3, hq=4, hkv=2, d=32, capacity=96,
          page_size=None, append=0, varlen_new=False, rotary=None, varlen_q=False,
          batch_idx=False, leftpad=False):
    g = torch.Generator().manual_seed(seed)
    rows = 2 * batch + 1 if batch_idx else batch
    lens_q = ([int(x) for x in torch.randint(0, sq + 1, (batch,), generator=g)]
              if varlen_q else [sq] * batch)
    new = ([int(x) for x in torch.randint(0, append + 1, (batch,), generator=g)]
           if varlen_new else [append] * batch)
    room = [capacity - max(n, lq, 1) for n, lq in zip(new, lens_q)]
    cache_seqlens = torch.tensor([int(torch.randint(0, r + 1, (1,), generator=g)) for r in room],
                                 dtype=torch.int32)
    args = {}
    if page_size:
        pages_per_row = -(-capacity // page_size)
        num_pages = rows * pages_per_row + 3
        k_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
        v_cache = torch.randn(num_pages, page_size, hkv, d, generator=g).to(dtype)
        args["page_table"] = torch.randperm(num_pages, generator=g)[:rows * pages_per_row] \
            .reshape(rows, pages_per_row).to(torch.int32)
    else:
        k_cache = torch.randn(rows, capacity, hkv, d, generator=g).to(dtype)
        v_cache = torch.randn(rows, capacity, hkv, d, generator=g).to(dtype)
    if batch_idx:
        args["cache_batch_idx"] = torch.randperm(rows, generator=g)[:batch].to(torch.int32)
    if leftpad:
        args["cache_leftpad"] = torch.tensor(
            [int(torch.randint(0, int(n) + 1, (1,), generator=g)) for n in cache_seqlens],
            dtype=torch.int32)
    if varlen_q:
        args["cu_seqlens_q"] = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)),
                                            dtype=torch.int32)
        args["max_seqlen_q"] = sq
        q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    else:
        q = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    if append:
        if varlen_new:
            args["cu_seqlens_k_new"] = torch.tensor([0] + list(torch.tensor(new).cumsum(0)),
                                                    dtype=torch.int32)
            args["k"] = torch.randn(sum(new), hkv, d, generator=g).to(dtype)
            args["v"] = torch.randn(sum(new), hkv, d, generator=g).to(dtype)
        else:
            args["k"] = torch.randn(batch, append, hkv, d, generator=g).to(dtype)
            args["v"] = torch.randn(batch, append, hkv, d, generator=g).to(dtype)
    if rotary:
        rdim = d if rotary.endswith("full") else d // 2
        pos = torch.arange(capacity + 4, dtype=torch.float64)[:, None]
        freq = 10000.0 ** (-torch.arange(0, rdim, 2, dtype=torch.float64) / rdim)
        args["rotary_cos"] = torch.cos(pos * freq).to(dtype)
        args["rotary_sin"] = torch.sin(pos * freq).to(dtype)
        args["rotary_interleaved"] = rotary.startswith("gptj")
    return q, k_cache, v_cache, cache_seqlens, args, lens_q, new


def _position(args, b, pos, page_size):
    """(first, second) indices of cache position pos of batch entry b."""
    row = int(args["cache_batch_idx"][b]) if "cache_batch_idx" in args else b
    if page_size:
        return int(args["page_table"][row, pos // page_size]), pos % page_size
    return row, pos


def _expected(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, causal, window, page_size):
    """The naive result over the cache as the call left it, and the appended rows it should hold."""
    interleaved = args.get("rotary_interleaved", True)
    cos, sin = args.get("rotary_cos"), args.get("rotary_sin")
    banded = causal or window[0] >= 0 or window[1] >= 0
    outs, lses, appended = [], [], []
    first_q = 0
    for b, (lq, n) in enumerate(zip(lens_q, new)):
        base = int(cache_seqlens[b])
        pad = int(args["cache_leftpad"][b]) if "cache_leftpad" in args else 0
        qb = (q[first_q:first_q + lq] if q.dim() == 3 else q[b]).double()
        first_q += lq
        if cos is not None:
            i = torch.arange(lq)
            qb = _rotate(qb, cos, sin, base + (i if banded else 0 * i), interleaved)
        idx = [_position(args, b, p, page_size) for p in range(pad, base + n)]
        keys = torch.stack([k_cache[f, s] for f, s in idx]).double() if idx else \
            torch.zeros(0, *k_cache.shape[2:], dtype=torch.float64)
        values = torch.stack([v_cache[f, s] for f, s in idx]).double() if idx else \
            torch.zeros(0, *v_cache.shape[2:], dtype=torch.float64)
        o, lse = _naive(qb, keys, values, q.shape[-1] ** -0.5, causal, window)
        outs.append(o)
        lses.append(lse)
        if n:
            kn = args["k"]
            start = int(args["cu_seqlens_k_new"][b]) if "cu_seqlens_k_new" in args else 0
            rows = kn[start:start + n] if kn.dim() == 3 else kn[b, :n]
            rows = rows.double()
            if cos is not None:
                rows = _rotate(rows, cos, sin, torch.arange(base, base + n), interleaved)
            appended.append((b, base, rows))
    return outs, lses, appended


CASES = [
    dict(),
    dict(page_size=1),
    dict(page_size=7, append=3),
    dict(page_size=16, append=1, sq=1),
    dict(append=3, rotary="neox_full"),
    dict(page_size=16, append=3, rotary="gptj_half"),
    dict(page_size=16, append=5, varlen_new=True, varlen_q=True, sq=5, rotary="neox_half"),
    dict(page_size=7, append=2, batch_idx=True, leftpad=True, rotary="gptj_full"),
    dict(append=3, batch_idx=True, leftpad=True),
    dict(page_size=16, append=3, dtype=torch.bfloat16, rotary="neox_full"),
]


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (False, (8, 0))])
@pytest.mark.parametrize("n", range(len(CASES)))
def test_matches_naive_attention(n, causal, window):
    case = CASES[n]
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(100 + n, **case)
    page_size = case.get("page_size")
    k_before = k_cache.clone()
    out, lse = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                              causal=causal, window_size=window,
                                              return_softmax_lse=True, **args)
    outs, lses, appended = _expected(q, k_cache, v_cache, cache_seqlens, args, lens_q, new,
                                     causal, window, page_size)
    low = q.dtype == torch.bfloat16
    atol = 3e-2 if low else 2e-5
    for b, (o, l) in enumerate(zip(outs, lses)):
        got_o = out[sum(lens_q[:b]):sum(lens_q[:b + 1])] if q.dim() == 3 else out[b]
        got_l = (lse[:, sum(lens_q[:b]):sum(lens_q[:b + 1])] if q.dim() == 3 else lse[b])
        torch.testing.assert_close(got_o.double(), o, atol=atol, rtol=0, msg="out, sequence %d" % b)
        finite = torch.isfinite(l)
        assert torch.equal(torch.isinf(got_l.double()), ~finite)
        torch.testing.assert_close(got_l.double()[finite], l[finite], atol=atol, rtol=0)
    # The appended rows: rotated new keys (within the dtype's rounding), nothing else changed.
    changed = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, base, rows in appended:
        for j in range(rows.shape[0]):
            f, s = _position(args, b, base + j, page_size)
            changed[f, s] = True
            torch.testing.assert_close(k_cache[f, s].double(), rows[j],
                                       atol=1e-2 if low else 1e-6, rtol=1e-2 if low else 1e-6)
    assert torch.equal(k_cache[~changed], k_before[~changed])


def test_python_reference_matches_the_library():
    """The reference fallback and verify mode run (fa4cpp.reference.kvcache_*) agrees with the
    library, the cache's appends included."""
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(
        7, page_size=16, append=3, rotary="gptj_half", leftpad=True, batch_idx=True)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    out = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                         causal=True, **args)
    kn = args["k"]
    reference.kvcache_append(k_ref, v_ref, kn, args["v"], cache_seqlens,
                             page_table=args["page_table"],
                             cache_batch_idx=args["cache_batch_idx"],
                             rotary_cos=args["rotary_cos"], rotary_sin=args["rotary_sin"],
                             rotary_interleaved=True)
    torch.testing.assert_close(k_ref, k_cache, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_ref, v_cache)
    ref_out, _ = reference.kvcache_attention(
        q, k_ref, v_ref, cache_seqlens + kn.shape[1], cache_seqlens=cache_seqlens,
        page_table=args["page_table"], cache_batch_idx=args["cache_batch_idx"],
        cache_leftpad=args["cache_leftpad"], rotary_cos=args["rotary_cos"],
        rotary_sin=args["rotary_sin"], rotary_interleaved=True, causal=True)
    torch.testing.assert_close(out, ref_out.to(out.dtype), atol=2e-5, rtol=0)


def test_verify_mode_checks_kvcache_calls():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(8, page_size=7, append=2,
                                                           rotary="neox_full")
    with fa4cpp.mode(verify=1.0):
        fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       causal=True, **args)


def test_cache_seqlens_as_int_and_full_cache():
    q, k_cache, v_cache, _, args, lens_q, new = _case(9, sq=2)
    full = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache)
    as_int = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=k_cache.shape[1])
    torch.testing.assert_close(full, as_int, atol=0, rtol=0)
    outs, _, _ = _expected(q, k_cache, v_cache, torch.full((3,), k_cache.shape[1]), args, lens_q,
                           new, False, (-1, -1), None)
    torch.testing.assert_close(full[1].double(), outs[1], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name,value", [
    ("qv", torch.zeros(1)), ("rotary_seqlens", torch.zeros(1, dtype=torch.int32)),
    ("attention_chunk", 64), ("scheduler_metadata", torch.zeros(1, dtype=torch.int32)),
    ("sm_margin", 4)])
def test_unsupported_arguments_raise(name, value):
    q, k_cache, v_cache, cache_seqlens, _, _, _ = _case(10)
    with pytest.raises(ValueError, match=name):
        fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       **{name: value})


def test_bad_input_raises_and_writes_nothing():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(11, page_size=16, append=3)
    before = k_cache.clone()
    bad = dict(args)
    bad["page_table"] = args["page_table"].clone()
    bad["page_table"][1, int(cache_seqlens[1]) // 16] = k_cache.shape[0]  # a page past the last
    with pytest.raises(fa4cpp.Fa4Error, match="page_table"):
        fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **bad)
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="rotary"):
        fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       page_table=args["page_table"],
                                       rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4))


def test_torch_compile_fullgraph():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(12, page_size=16, append=1, sq=1)
    k2, v2 = k_cache.clone(), v_cache.clone()

    def step(q, k_cache, v_cache, k, v, cache_seqlens, page_table):
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v,
                                              cache_seqlens=cache_seqlens, page_table=page_table,
                                              causal=True)

    eager = step(q, k_cache, v_cache, args["k"], args["v"], cache_seqlens, args["page_table"])
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(q, k2, v2, args["k"], args["v"], cache_seqlens, args["page_table"])
    torch.testing.assert_close(got, eager, atol=0, rtol=0)
    assert torch.equal(k2, k_cache) and torch.equal(v2, v_cache)


def test_vllm_style_varlen_call():
    """flash_attn_varlen_func as vLLM calls it: a paged cache through block_table, seqused_k and
    no cu_seqlens_k, out=, return_softmax_lse, num_splits, fa_version."""
    q, k_cache, v_cache, cache_seqlens, args, lens_q, new = _case(
        13, page_size=16, varlen_q=True, sq=4, capacity=80)
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    result, lse = fa4cpp.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
        max_seqlen_q=4, max_seqlen_k=80, seqused_k=cache_seqlens, causal=True,
        window_size=None, block_table=args["page_table"], out=out, return_softmax_lse=True,
        num_splits=2, fa_version=3)
    assert result is out
    want, want_lse = fa4cpp.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=args["page_table"],
        cu_seqlens_q=args["cu_seqlens_q"], max_seqlen_q=4, causal=True, return_softmax_lse=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    outs, _, _ = _expected(q, k_cache, v_cache, cache_seqlens, args, lens_q, new, True,
                           (-1, -1), 16)
    first = 0
    for b, o in enumerate(outs):
        torch.testing.assert_close(out[first:first + lens_q[b]].double(), o, atol=2e-5, rtol=0)
        first += lens_q[b]
    with pytest.raises(ValueError, match="s_aux"):
        fa4cpp.flash_attn_varlen_func(q=q, k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"],
                                      cu_seqlens_k=None, max_seqlen_q=4, max_seqlen_k=80,
                                      seqused_k=cache_seqlens, block_table=args["page_table"],
                                      s_aux=torch.zeros(4))


def test_scheduler_metadata_is_none_and_accepted():
    """vLLM asks get_scheduler_metadata (FlashAttention-3's arguments) before capturing a step and
    passes what it returns; fa4cpp needs none and takes None."""
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(
        14, page_size=16, varlen_q=True, sq=4, capacity=80)
    metadata = fa4cpp.get_scheduler_metadata(
        3, 4, 80, q.shape[1], k_cache.shape[2], q.shape[2], cache_seqlens,
        qkv_dtype=q.dtype, cu_seqlens_q=args["cu_seqlens_q"], page_size=16, causal=True,
        num_splits=0)
    assert metadata is None
    out = fa4cpp.flash_attn_varlen_func(
        q, k_cache, v_cache, args["cu_seqlens_q"], None, 4, 80, seqused_k=cache_seqlens,
        causal=True, block_table=args["page_table"], scheduler_metadata=metadata)
    want = fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens,
                                          page_table=args["page_table"],
                                          cu_seqlens_q=args["cu_seqlens_q"], max_seqlen_q=4,
                                          causal=True)
    assert torch.equal(out, want)
