"""Attention in plain torch ops, in fp32, with exactly the library's semantics (docs/semantics.md):
S = scale·QKᵀ; softcap·tanh(S/softcap) when softcap > 0 (on the scaled score, before masking); the
bottom-right aligned band mask; GQA (query head h reads kv head h // (heads_q / heads_kv)); varlen
and seqused_k; a row that sees no key gets O = 0 and LSE = +inf.

Score variants: ALiBi (alibi_slopes, fp32 (heads_q,) or (batch, heads_q)) subtracts
slope·|i + sk − sq − j| from each score after softcap; attention sinks (sinks, fp32 (heads_q,)
logits) join every row's softmax denominator without a value, LSE = log(Σ_j exp(s_j) + exp(sink)),
and a row that sees no key gets O = 0 and LSE = sink. The slopes are constants (no gradient); the
sinks' gradient is dsinks[h] = −Σ over the head's rows of exp(sink − LSE)·D, D = rowsum(dO ∘ O),
and autograd reaches it through attention() / varlen_attention() too.

attention() / varlen_attention() are differentiable (autograd runs through them); the
*_backward() functions compute the same gradients with the explicit formulas of the library's
backward (dV = PᵀdO, dS = P∘(dO·Vᵀ − rowsum(dO∘O)), times 1 − tanh² under softcap, dQ = scale·dS·K,
dK = scale·dSᵀ·Q), without autograd, so that they also run inside a custom op's body, where autograd
is off. Used as the oracle of the tests, by fallback mode (when the library refuses a problem) and
by verify mode (on a sample of query rows). Work is split per sequence and into chunks of kv heads
and query rows so that no score matrix exceeds _SCORE_BUDGET elements: fallback may run real
training sizes through it. float64 inputs are computed in float64.

FP8 (float8_e4m3fn) inputs come with fp32 (batch, heads_kv) descales (None = 1; varlen: one row per
sequence): their true values are the stored ones times their descales, and the functions compute
on those dequantized values in fp32 (S = scale·q_descale·k_descale·QKᵀ, O = v_descale·softmax(S)V).
A KV cache of e4m3 takes appended rows in e4m3, or in bf16 / fp16 divided by their descales and
rounded to e4m3 (round_e4m3: to nearest even, saturating at ±448); rotated e4m3 queries and keys
are rounded back to e4m3, as the library does."""
import functools
import math
import threading

import torch

# Elements of one score-matrix chunk (256 MiB in fp32); a chunk keeps a few such tensors alive.
_SCORE_BUDGET = 1 << 26

FP8_DTYPES = (torch.float8_e4m3fn,)
# e4m3's largest finite value: the library's conversions saturate there.
E4M3_MAX = 448.0


def round_e4m3(x):
    """x as float8_e4m3fn, rounded as the library rounds: to nearest, ties to even, saturating at
    ±448 (torch's own conversion makes NaN of anything past 464); NaN stays NaN."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize(x, descale, cu_seqlens=None, group=1):
    """The true values of e4m3 x in fp32: x times its descales. x (batch, seq, heads, dim), or
    (total, heads, dim) with cu_seqlens (the rows of sequence b take descale row b; rows outside
    every sequence take 1); descale fp32 (batch, heads_kv) or None (1); head h of x takes kv head
    h // group (group = heads / heads_kv: 1 for k and v)."""
    y = x.float()
    if descale is None:
        return y
    d = descale.float().repeat_interleave(group, dim=1)  # (batch, heads)
    if cu_seqlens is None:
        return y * d[:, None, :, None]
    rows = torch.arange(x.shape[0], device=x.device)
    # The sequence of each row: how many sequences end at or before it.
    seq = torch.searchsorted(cu_seqlens[1:].long().contiguous(), rows, right=True)
    inside = seq < d.shape[0]
    per_row = torch.ones(x.shape[0], d.shape[1], dtype=y.dtype, device=x.device)
    per_row[inside] = d[seq[inside]]
    return y * per_row[:, :, None]


def _dequantized(q, k, v, descales, cu_seqlens_q=None, cu_seqlens_k=None):
    """q, k, v as the functions compute with them: e4m3 ones dequantized (fp32), others as given
    (descales are then an error)."""
    if q.dtype not in FP8_DTYPES:
        if any(d is not None for d in descales):
            raise ValueError("descales scale float8_e4m3fn inputs only (q is %s)" % q.dtype)
        return q, k, v
    q_descale, k_descale, v_descale = descales
    group = q.shape[-2] // k.shape[-2]
    return (dequantize(q, q_descale, cu_seqlens_q, group), dequantize(k, k_descale, cu_seqlens_k),
            dequantize(v, v_descale, cu_seqlens_k))


# One lock for the process-wide matmul precision the reference switches (autograd runs backward
# passes on its own threads: two reference calls must not interleave their save / restore).
_PRECISION_LOCK = threading.RLock()


def _matmul_precision_scope():
    """Saves the fp32 matmul precision and sets full precision; returns the restore function.
    torch >= 2.9 has the per-backend `fp32_precision` setting, and once a program has used it the
    older global getter raises: use the new setting where it exists."""
    cuda_matmul = getattr(torch.backends.cuda, "matmul", None)
    if cuda_matmul is not None and hasattr(cuda_matmul, "fp32_precision"):
        previous = cuda_matmul.fp32_precision
        cuda_matmul.fp32_precision = "ieee"

        def restore():
            cuda_matmul.fp32_precision = previous
        return restore
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    return lambda: torch.set_float32_matmul_precision(previous)


def _exact_matmul(fn):
    """Runs fn with fp32 matmuls in full precision: a caller's TF32 setting would make the oracle
    as inexact as what it checks. The setting is process-wide; it is restored on return."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _PRECISION_LOCK:
            restore = _matmul_precision_scope()
            try:
                return fn(*args, **kwargs)
            finally:
                restore()
    return wrapper


def _fp32(x):
    """x rounded to fp32, as the library's float fields hold it."""
    return float(torch.tensor(x, dtype=torch.float32))


def effective_scale(softmax_scale, head_dim):
    """The library's Problem::scale(): softmax_scale, or (when 0) 1/sqrt(head_dim) in fp32."""
    if softmax_scale != 0:
        return _fp32(softmax_scale)
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(float(head_dim), dtype=torch.float32).sqrt())


def _compute_dtype(t):
    return torch.promote_types(t.dtype, torch.float32)


def _visible(rows, sq, sk, causal, left, right):
    """(n, sk) bool: query row rows[i] of a sequence with sq queries sees key j of sk."""
    if causal:
        right = 0
    keys = torch.arange(sk, device=rows.device)
    diagonal = rows[:, None] + (sk - sq)  # the key the query is aligned with (bottom-right)
    visible = torch.ones(rows.shape[0], sk, dtype=torch.bool, device=rows.device)
    if left >= 0:
        visible &= keys[None, :] >= diagonal - left
    if right >= 0:
        visible &= keys[None, :] <= diagonal + right
    return visible


def _distance(rows, sq, sk, dtype):
    """(n, sk): |i + sk − sq − j| of query row rows[i] and key j, ALiBi's distance (bottom-right
    aligned, both sides of the diagonal)."""
    keys = torch.arange(sk, device=rows.device)
    return (rows[:, None] + (sk - sq) - keys[None, :]).abs().to(dtype)


def _variants(alibi_slopes, sinks, b, dtype):
    """The (heads_q,) ALiBi slopes and sinks of batch entry b in the compute dtype (None where
    absent); sinks stay differentiable."""
    slopes = None
    if alibi_slopes is not None:
        slopes = (alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes).to(dtype)
    return dict(slopes=slopes, sink=None if sinks is None else sinks.to(dtype))


def _expand_heads(t, group):
    """(sk, hkv, d) -> (sk, hkv·group, d): query head h reads kv head h // group."""
    return t.repeat_interleave(group, dim=1)


def _softmax(q, k, visible, scale, softcap, slopes=None, distance=None, sink=None):
    """q (n, hq, d), k (sk, hq, d), visible (n, sk); slopes (hq,) with distance (n, sk) add
    ALiBi's bias, sink (hq,) joins the denominator. Returns P (hq, n, sk), LSE (hq, n) and, under
    softcap, tanh(s/softcap) (for the backward's 1 − tanh²), else None."""
    s = torch.einsum("nhd,khd->hnk", q, k) * scale
    capped = None
    if softcap > 0:
        capped = torch.tanh(s / softcap)
        s = softcap * capped
    if slopes is not None:
        s = s - slopes[:, None, None] * distance[None]
    s = s.masked_fill(~visible, -math.inf)
    # Rows with something in their denominator: a visible key, or the head's sink (one of −inf
    # is none, as in the library).
    alive = visible.any(dim=-1)[None, :, None]  # (1, n, 1)
    if sink is not None:
        sink = sink[:, None, None]  # (hq, 1, 1)
        alive = alive | (sink.detach() > -math.inf)
    if s.shape[-1] > 0:
        # The max only keeps exp() in range; softmax does not depend on it, so no gradient.
        m = s.detach().amax(dim=-1, keepdim=True)
    else:
        m = s.new_full(s.shape[:-1] + (1,), -math.inf)
    if sink is not None:
        m = torch.maximum(m, sink.detach())
    m = torch.where(alive, m, torch.zeros_like(m))
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - m)
    # 1 where nothing is seen: P = 0 there, and log stays finite (so does its gradient).
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    p = e / safe
    lse = torch.where(alive.squeeze(-1), (m + safe.log()).squeeze(-1),
                      torch.full_like(m.squeeze(-1), math.inf))
    return p, lse, capped


def _chunks(total, size):
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def _tiles(n, sk, hkv, group):
    """(kv-head range, row range) pairs covering one sequence within the score budget, row chunk
    by row chunk (kv-head chunks inner)."""
    rows_per_chunk = max(1, _SCORE_BUDGET // max(1, group * sk))
    kv_per_chunk = max(1, _SCORE_BUDGET // max(1, group * sk * min(n, rows_per_chunk)))
    return [(h, r) for r in _chunks(n, rows_per_chunk) for h in _chunks(hkv, kv_per_chunk)]


def _head_chunk(t, h0, h1, group):
    """Query heads h0·group .. h1·group of a (hq,) tensor, or None."""
    return None if t is None else t[h0 * group:h1 * group]


def _sequence(q, k, v, rows, sq, scale, softcap, causal, left, right, slopes=None, sink=None):
    """One sequence: q (n, hq, d) holds its query rows `rows` (absolute indices among sq rows);
    k, v its used keys; slopes / sink (hq,) its ALiBi slopes and sinks, or None. Returns
    O (n, hq, dv), LSE (hq, n), differentiable."""
    dtype = _compute_dtype(q)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    n, hq, sk, hkv = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    group = hq // hkv
    out_rows, lse_rows = [], []  # per row chunk: per kv-head chunk pieces
    for (h0, h1), (r0, r1) in _tiles(n, sk, hkv, group):
        if h0 == 0:
            out_rows.append([])
            lse_rows.append([])
        visible = _visible(rows[r0:r1], sq, sk, causal, left, right)
        distance = None if slopes is None else _distance(rows[r0:r1], sq, sk, dtype)
        p, lse, _ = _softmax(q[r0:r1, h0 * group:h1 * group],
                             _expand_heads(k[:, h0:h1], group), visible, scale, softcap,
                             _head_chunk(slopes, h0, h1, group), distance,
                             _head_chunk(sink, h0, h1, group))
        out_rows[-1].append(torch.einsum("hnk,khd->nhd", p, _expand_heads(v[:, h0:h1], group)))
        lse_rows[-1].append(lse)
    if n == 0:
        return q.new_zeros(0, hq, v.shape[2]), q.new_zeros(hq, 0)
    out = torch.cat([torch.cat(pieces, dim=1) for pieces in out_rows], dim=0)
    lse = torch.cat([torch.cat(pieces, dim=0) for pieces in lse_rows], dim=1)
    return out, lse


def _sequence_backward(dout, q, k, v, rows, sq, scale, softcap, causal, left, right,
                       magnitudes=False, slopes=None, sink=None):
    """Gradients of sum(O ∘ dout) for _sequence's rows: dq (n, hq, d), dk, dv (sk, hkv, ·), and
    with a sink dsink (hq,), in the compute dtype; dk, dv and dsink hold only these rows'
    contributions. With magnitudes, also the same sums taken over absolute values
    (|dQ| ≤ |scale|·(P∘(|dO|·|V|ᵀ + rowsum|dO∘O|))·|K|, ...): the size of the terms a gradient
    element is made of, which its rounding error scales with, even where the terms cancel to
    (nearly) 0."""
    dtype = _compute_dtype(q)
    q, k, v, dout = q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)
    if slopes is not None:
        slopes = slopes.to(dtype)
    if sink is not None:
        sink = sink.to(dtype)
    n, hq, sk, hkv = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    group = hq // hkv

    def buffers():
        bufs = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
        return bufs + [q.new_zeros(hq)] if sink is not None else bufs
    grads = buffers()
    sizes = buffers() if magnitudes else None

    def add(results, factor, heads, rows_, ds, p, qc, kc, doc):
        dq, dk, dv = results[:3]
        h0, h1 = heads
        dq[rows_, h0 * group:h1 * group] = factor * torch.einsum("hnk,khd->nhd", ds, kc)
        dk_heads = factor * torch.einsum("hnk,nhd->khd", ds, qc)
        dv_heads = torch.einsum("hnk,nhe->khe", p, doc)
        # Expanded heads g·group .. g·group + group − 1 all belong to kv head g: sum them.
        dk[:, h0:h1] += dk_heads.reshape(sk, h1 - h0, group, k.shape[2]).sum(dim=2)
        dv[:, h0:h1] += dv_heads.reshape(sk, h1 - h0, group, v.shape[2]).sum(dim=2)

    for (h0, h1), (r0, r1) in _tiles(n, sk, hkv, group):
        qc, doc = q[r0:r1, h0 * group:h1 * group], dout[r0:r1, h0 * group:h1 * group]
        kc, vc = _expand_heads(k[:, h0:h1], group), _expand_heads(v[:, h0:h1], group)
        visible = _visible(rows[r0:r1], sq, sk, causal, left, right)
        distance = None if slopes is None else _distance(rows[r0:r1], sq, sk, dtype)
        sink_c = _head_chunk(sink, h0, h1, group)
        p, lse, capped = _softmax(qc, kc, visible, scale, softcap,
                                  _head_chunk(slopes, h0, h1, group), distance, sink_c)
        out = torch.einsum("hnk,khd->nhd", p, vc)
        d_row = (doc * out).sum(dim=-1).transpose(0, 1)  # D = rowsum(dO ∘ O): (h, n)
        dp = torch.einsum("nhe,khe->hnk", doc, vc)
        cap_factor = 1 if capped is None else 1 - capped * capped
        ds = p * (dp - d_row[..., None]) * cap_factor
        add(grads, scale, (h0, h1), slice(r0, r1), ds, p, qc, kc, doc)
        # The sink's share of each row, exp(sink − LSE): dsink = −Σ_rows share · D.
        share = None if sink_c is None else torch.exp(sink_c[:, None] - lse)  # (h, n)
        if share is not None:
            grads[3][h0 * group:h1 * group] -= (share * d_row).sum(dim=-1)
        if magnitudes:
            dp_abs = torch.einsum("nhe,khe->hnk", doc.abs(), vc.abs())
            d_abs = (doc.abs() * out.abs()).sum(dim=-1).transpose(0, 1)
            ds_abs = p * (dp_abs + d_abs[..., None]) * cap_factor
            add(sizes, abs(scale), (h0, h1), slice(r0, r1), ds_abs, p, qc.abs(), kc.abs(),
                doc.abs())
            if share is not None:
                sizes[3][h0 * group:h1 * group] += (share * d_abs).sum(dim=-1)
    return (grads, sizes) if magnitudes else grads


def _mask_args(q, softmax_scale, causal, window, softcap):
    left, right = window
    return dict(scale=effective_scale(softmax_scale, q.shape[-1]), softcap=_fp32(softcap),
                causal=bool(causal), left=int(left), right=int(right))


def _as_rows(rows, n, device):
    if rows is None:
        return torch.arange(n, device=device)
    return torch.as_tensor(rows, dtype=torch.long, device=device)


def _key_counts(seqused_k, batch, default):
    return [default] * batch if seqused_k is None else [int(x) for x in seqused_k.tolist()]


@_exact_matmul
def attention(q, k, v, *, softmax_scale=0.0, causal=False, window=(-1, -1), softcap=0.0,
              seqused_k=None, rows=None, q_descale=None, k_descale=None, v_descale=None,
              alibi_slopes=None, sinks=None):
    """Fixed-length attention. q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv).
    Returns O (b, n, hq, dv) and LSE (b, hq, n) in fp32 (float64 for float64 inputs), n = sq,
    or len(rows) when rows (query row indices) selects a subset. float8_e4m3fn inputs take fp32
    (b, hkv) descales (None = 1). alibi_slopes (hq,) or (b, hq) and sinks (hq,) as the module
    docstring says."""
    args = _mask_args(q, softmax_scale, causal, window, softcap)
    q, k, v = _dequantized(q, k, v, (q_descale, k_descale, v_descale))
    sq, sk = q.shape[1], k.shape[1]
    row_idx = _as_rows(rows, sq, q.device)
    used = _key_counts(seqused_k, q.shape[0], sk)
    dtype = _compute_dtype(q)
    results = [_sequence(q[b, row_idx], k[b, :used[b]], v[b, :used[b]], row_idx, sq, **args,
                         **_variants(alibi_slopes, sinks, b, dtype))
               for b in range(q.shape[0])]
    if not results:
        dtype, n = _compute_dtype(q), row_idx.shape[0]
        return (q.new_zeros(0, n, q.shape[2], v.shape[3], dtype=dtype),
                q.new_zeros(0, q.shape[2], n, dtype=dtype))
    return torch.stack([o for o, _ in results]), torch.stack([l for _, l in results])


@torch.no_grad()
@_exact_matmul
def attention_backward(dout, q, k, v, *, softmax_scale=0.0, causal=False, window=(-1, -1),
                       softcap=0.0, seqused_k=None, rows=None, magnitudes=False,
                       alibi_slopes=None, sinks=None):
    """Gradients of sum(O ∘ dout) for attention(), by the explicit formulas: (dq, dk, dv), and
    with sinks (dq, dk, dv, dsinks), in fp32 (float64 for float64 inputs). With rows, dout holds
    those query rows only (b, n, hq, dv) and the result is (dq of those rows, None, None[, None]):
    dk, dv and dsinks sum over every row. With magnitudes, returns (gradients, magnitudes): the
    second the same sums over absolute values (what a gradient's rounding error scales with; see
    _sequence_backward)."""
    args = _mask_args(q, softmax_scale, causal, window, softcap)
    sq, sk = q.shape[1], k.shape[1]
    row_idx = _as_rows(rows, sq, q.device)
    used = _key_counts(seqused_k, q.shape[0], sk)
    dtype = _compute_dtype(q)

    def buffers():
        bufs = [q.new_zeros(q.shape[0], row_idx.shape[0], *q.shape[2:], dtype=dtype),
                k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype)]
        return bufs + [q.new_zeros(q.shape[2], dtype=dtype)] if sinks is not None else bufs
    results = [buffers(), buffers() if magnitudes else None]
    for b in range(q.shape[0]):
        parts = _sequence_backward(dout[b], q[b, row_idx], k[b, :used[b]], v[b, :used[b]],
                                   row_idx, sq, magnitudes=magnitudes, **args,
                                   **_variants(alibi_slopes, sinks, b, dtype))
        for result, part in zip(results, parts if magnitudes else [parts]):
            result[0][b], result[1][b, :used[b]], result[2][b, :used[b]] = part[:3]
            if sinks is not None:
                result[3] += part[3]
    return _backward_result(results, rows, magnitudes)


def _backward_result(results, rows, magnitudes):
    if rows is not None:  # dk, dv (and dsinks) would miss the rows not sampled
        results = [[r[0]] + [None] * (len(r) - 1) if r is not None else None for r in results]
    grads = tuple(results[0])
    return (grads, tuple(results[1])) if magnitudes else grads


def _varlen_layout(q, cu_seqlens_q, cu_seqlens_k, seqused_k, rows):
    """Per sequence with sampled rows: (its index, positions in rows, local row indices, query
    count, key slice); plus the sampled row indices."""
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    used = _key_counts(seqused_k, len(cq) - 1, None)
    row_idx = _as_rows(rows, q.shape[0], q.device)
    sequences = []
    for b in range(len(cq) - 1):
        where = ((row_idx >= cq[b]) & (row_idx < cq[b + 1])).nonzero().flatten()
        if where.numel() == 0:
            continue
        n_keys = ck[b + 1] - ck[b] if used[b] is None else used[b]
        sequences.append((b, where, row_idx[where] - cq[b], cq[b + 1] - cq[b],
                          slice(ck[b], ck[b] + n_keys)))
    return sequences, row_idx


@_exact_matmul
def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=0.0, causal=False,
                     window=(-1, -1), softcap=0.0, seqused_k=None, rows=None, q_descale=None,
                     k_descale=None, v_descale=None, alibi_slopes=None, sinks=None):
    """Variable-length attention over packed (total, heads, dim) tensors, sequence b in rows
    cu_seqlens[b] .. cu_seqlens[b+1]. Returns O (n, hq, dv) and LSE (hq, n) in fp32 for the token
    rows `rows` (default: all total_q rows; rows outside every sequence — left unwritten by the
    library — get O = 0 and LSE = +inf). float8_e4m3fn inputs take fp32 (sequences, hkv)
    descales (None = 1). alibi_slopes (hq,) or (sequences, hq) and sinks (hq,) as the module
    docstring says."""
    args = _mask_args(q, softmax_scale, causal, window, softcap)
    q, k, v = _dequantized(q, k, v, (q_descale, k_descale, v_descale), cu_seqlens_q, cu_seqlens_k)
    sequences, row_idx = _varlen_layout(q, cu_seqlens_q, cu_seqlens_k, seqused_k, rows)
    dtype = _compute_dtype(q)
    n, hq, dv = row_idx.shape[0], q.shape[1], v.shape[2]
    outs, lses, positions = [], [], []
    for b, where, local, sq, keys in sequences:
        o, l = _sequence(q[row_idx[where]], k[keys], v[keys], local, sq, **args,
                         **_variants(alibi_slopes, sinks, b, dtype))
        outs.append(o)
        lses.append(l)
        positions.append(where)
    outside = torch.ones(n, dtype=torch.bool, device=q.device)
    for where in positions:
        outside[where] = False
    outside = outside.nonzero().flatten()
    outs.append(q.new_zeros(outside.shape[0], hq, dv, dtype=dtype))
    lses.append(q.new_full((hq, outside.shape[0]), math.inf, dtype=dtype))
    # Pieces come sequence by sequence; put every row back at its position in `rows`.
    order = torch.cat(positions + [outside]).argsort()
    return torch.cat(outs, dim=0)[order], torch.cat(lses, dim=1)[:, order]


@torch.no_grad()
@_exact_matmul
def varlen_attention_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=0.0,
                              causal=False, window=(-1, -1), softcap=0.0, seqused_k=None,
                              rows=None, magnitudes=False, alibi_slopes=None, sinks=None):
    """Gradients of sum(O ∘ dout) for varlen_attention(), as attention_backward() (dsinks too,
    summed over every sequence): rows outside every sequence (and keys beyond seqused_k) get zero
    gradients; with rows, dout holds those rows only and the result is (dq of those rows, None,
    None[, None])."""
    args = _mask_args(q, softmax_scale, causal, window, softcap)
    sequences, row_idx = _varlen_layout(q, cu_seqlens_q, cu_seqlens_k, seqused_k, rows)
    dtype = _compute_dtype(q)

    def buffers():
        bufs = [q.new_zeros(row_idx.shape[0], *q.shape[1:], dtype=dtype),
                k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype)]
        return bufs + [q.new_zeros(q.shape[1], dtype=dtype)] if sinks is not None else bufs
    results = [buffers(), buffers() if magnitudes else None]
    for b, where, local, sq, keys in sequences:
        parts = _sequence_backward(dout[where], q[row_idx[where]], k[keys], v[keys], local, sq,
                                   magnitudes=magnitudes, **args,
                                   **_variants(alibi_slopes, sinks, b, dtype))
        for result, part in zip(results, parts if magnitudes else [parts]):
            result[0][where], result[1][keys], result[2][keys] = part[:3]
            if sinks is not None:
                result[3] += part[3]
    return _backward_result(results, rows, magnitudes)


# -- KV caches (flash_attn_with_kvcache's semantics, docs/semantics.md) -------------------------------

def _cache_index(k_cache, rows, positions, page_table):
    """Indices (first, second) into a cache's two leading dimensions of cache row `rows[i]`'s
    position `positions[i]`: (row, position), or (page, row in page) through the page table."""
    if page_table is None:
        return rows, positions
    page_size = k_cache.shape[1]
    return page_table[rows, positions // page_size].long(), positions % page_size


def rotate(x, cos, sin, positions, interleaved):
    """x (n, heads, d) with its first 2·cos.shape[1] dims rotated at positions (n,), in fp32 (the
    library's precision); returns fp32. Interleaved (GPT-J) pairs (2i, 2i+1), else (GPT-NeoX)
    (i, i + half)."""
    half = cos.shape[1]
    y = x.float().clone()
    c = cos.float()[positions][:, None, :]
    s = sin.float()[positions][:, None, :]
    if interleaved:
        a, b = y[..., 0:2 * half:2].clone(), y[..., 1:2 * half:2].clone()
        y[..., 0:2 * half:2] = a * c - b * s
        y[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = y[..., :half].clone(), y[..., half:2 * half].clone()
        y[..., :half] = a * c - b * s
        y[..., half:2 * half] = a * s + b * c
    return y


def _new_counts(k_new, cu_seqlens_new, batch):
    if k_new is None:
        return [0] * batch
    if cu_seqlens_new is not None:
        cu = [int(x) for x in cu_seqlens_new.tolist()]
        return [cu[b + 1] - cu[b] for b in range(batch)]
    return [k_new.shape[1]] * batch


def _stored(x, dtype):
    """x as a tensor of `dtype` holds it: e4m3 rounded as the library rounds (saturating)."""
    return round_e4m3(x) if dtype in FP8_DTYPES else x.to(dtype)


def _descale_row(descale, b, like):
    """The (heads_kv,) descales of batch entry b (ones without descales), like's dtype; like is
    a (rows, heads_kv, dim) tensor."""
    if descale is None:
        return like.new_ones(like.shape[1])
    return descale[b].to(like.dtype)


@torch.no_grad()
def kvcache_append(k_cache, v_cache, k_new, v_new, cache_seqlens, *, page_table=None,
                   cache_batch_idx=None, cu_seqlens_new=None, rotary_cos=None, rotary_sin=None,
                   rotary_interleaved=False, k_descale=None, v_descale=None):
    """Writes the new rows into the cache in place, as the library does: sequence b's rows at
    positions cache_seqlens[b] … (through the page table when paged), k rotated there when the
    tables are given. Batch entries in order (a later one's write to a shared row wins). An e4m3
    cache fed bf16 / fp16 rows stores each element (rotated first, in fp32) divided by its
    descale (batch entry b, kv head h: descale[b, h]) and rounded to e4m3."""
    batch = cache_seqlens.shape[0]
    quantize = (k_new is not None and k_cache.dtype in FP8_DTYPES
                and k_new.dtype not in FP8_DTYPES)
    counts = _new_counts(k_new, cu_seqlens_new, batch)
    lens = [int(x) for x in cache_seqlens.tolist()]
    starts = [int(x) for x in cu_seqlens_new.tolist()] if cu_seqlens_new is not None else None
    for b in range(batch):
        n = counts[b]
        if n == 0:
            continue
        kb = k_new[starts[b]:starts[b] + n] if starts is not None else k_new[b, :n]
        vb = v_new[starts[b]:starts[b] + n] if starts is not None else v_new[b, :n]
        positions = torch.arange(lens[b], lens[b] + n, device=k_cache.device)
        if rotary_cos is not None:
            kb = rotate(kb, rotary_cos, rotary_sin, positions, rotary_interleaved)
        if quantize:
            kb, vb = kb.float(), vb.float()
            kb = kb / _descale_row(k_descale, b, kb)[None, :, None]
            vb = vb / _descale_row(v_descale, b, vb)[None, :, None]
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        first, second = _cache_index(k_cache, torch.full_like(positions, row), positions,
                                     page_table)
        k_cache[first, second] = _stored(kb, k_cache.dtype)
        v_cache[first, second] = _stored(vb, v_cache.dtype)


@torch.no_grad()
@_exact_matmul
def kvcache_attention(q, k_cache, v_cache, key_lens, *, cache_seqlens, page_table=None,
                      cache_batch_idx=None, cache_leftpad=None, cu_seqlens_q=None,
                      rotary_cos=None, rotary_sin=None, rotary_interleaved=False,
                      softmax_scale=0.0, causal=False, window=(-1, -1), softcap=0.0,
                      q_descale=None, k_descale=None, v_descale=None, alibi_slopes=None,
                      sinks=None):
    """Attention of q over a KV cache the appends have already been written to: sequence b's keys
    are cache positions [leftpad[b], key_lens[b]) of its cache row; with rotary tables, q rotated
    at cache_seqlens[b] + i (causal or window) or cache_seqlens[b]. q (b, sq, hq, d) or, with
    cu_seqlens_q, (total, hq, d). Returns O and LSE in fp32, in q's layout and (b, hq, sq) /
    (hq, total). An e4m3 q and cache take fp32 (b, hkv) descales of batch entry b (not of the
    cache row it reads); rotated e4m3 queries are rounded back to e4m3. alibi_slopes ((hq,) or
    (b, hq), of batch entry b) and sinks (hq,) as the module docstring says, over each sequence's
    keys (sk = key_lens[b] − leftpad[b])."""
    fp8 = q.dtype in FP8_DTYPES
    if not fp8 and any(d is not None for d in (q_descale, k_descale, v_descale)):
        raise ValueError("descales scale float8_e4m3fn inputs only (q is %s)" % q.dtype)
    group = q.shape[-2] // k_cache.shape[-2]
    varlen = cu_seqlens_q is not None
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    cu_q = [int(x) for x in cu_seqlens_q.tolist()] if varlen else None
    lens = [int(x) for x in key_lens.tolist()]
    base = [int(x) for x in cache_seqlens.tolist()]
    pads = [int(x) for x in cache_leftpad.tolist()] if cache_leftpad is not None else [0] * batch
    banded = causal or window[0] >= 0 or window[1] >= 0
    rows_q, keys, values, cu_k = [], [], [], [0]
    for b in range(batch):
        qb = q[cu_q[b]:cu_q[b + 1]] if varlen else q[b]
        if rotary_cos is not None:
            i = torch.arange(qb.shape[0], device=q.device)
            qb = rotate(qb, rotary_cos, rotary_sin, base[b] + (i if banded else 0 * i),
                        rotary_interleaved)
            if fp8:
                qb = round_e4m3(qb)
        qb = qb.float()
        positions = torch.arange(pads[b], lens[b], device=q.device)
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        first, second = _cache_index(k_cache, torch.full_like(positions, row), positions,
                                     page_table)
        kb, vb = k_cache[first, second].float(), v_cache[first, second].float()
        if fp8:
            qb = qb * _descale_row(q_descale, b, kb).repeat_interleave(group)[None, :, None]
            kb = kb * _descale_row(k_descale, b, kb)[None, :, None]
            vb = vb * _descale_row(v_descale, b, vb)[None, :, None]
        rows_q.append(qb)
        keys.append(kb)
        values.append(vb)
        cu_k.append(cu_k[-1] + positions.shape[0])
    dev = q.device
    qq = torch.cat(rows_q) if rows_q else q.new_zeros((0,) + q.shape[-2:], dtype=torch.float32)
    cu_q_t = torch.tensor([0] + [sum(r.shape[0] for r in rows_q[:b + 1]) for b in range(batch)],
                          dtype=torch.int32, device=dev)
    kk = (torch.cat(keys) if keys
          else k_cache.new_zeros((0,) + k_cache.shape[2:], dtype=torch.float32))
    vv = (torch.cat(values) if values
          else v_cache.new_zeros((0,) + v_cache.shape[2:], dtype=torch.float32))
    cu_k_t = torch.tensor(cu_k, dtype=torch.int32, device=dev)
    scale = softmax_scale if softmax_scale != 0 else effective_scale(0.0, q.shape[-1])
    out, lse = varlen_attention(qq, kk, vv, cu_q_t, cu_k_t, softmax_scale=scale, causal=causal,
                                window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                sinks=sinks)
    if varlen:
        return out, lse
    sq = q.shape[1]
    return (out.reshape(batch, sq, *out.shape[1:]),
            lse.reshape(lse.shape[0], batch, sq).transpose(0, 1))
