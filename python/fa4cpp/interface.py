"""flash_attn-compatible functions: the names, arguments, shapes and return conventions of
flash_attn 2's flash_attn_interface, over fa4cpp's custom ops. Porting code is one import:
`from fa4cpp import flash_attn_func` for `from flash_attn import flash_attn_func`.

Differences, each an error rather than a silent change: dropout_p > 0 raises ValueError naming
the argument; so does an explicit softmax_scale of 0 (the library reads 0 as "default"). With
return_attn_probs=True the result is
(out, softmax_lse, S_dmask) where S_dmask is an empty tensor of shape (0,): what flash_attn 2.7 and
later return whenever dropout_p is 0 (the only case fa4cpp runs; flash_attn computes the
probabilities only with dropout, and versions up to 2.6 returned None there).
flash_attn_varlen_func takes seqused_k as an extra keyword (flash_attn 3's name).
flash_attn_with_kvcache has FlashAttention-3's signature (hopper/flash_attn_interface.py).

FP8, as FlashAttention-3 takes it: q, k and v of dtype torch.float8_e4m3fn, with the keywords
q_descale, k_descale and v_descale (fp32 (batch, nheads_k), one row per sequence when varlen, any
strides: expand() broadcasts a shared value; None = 1) that scale them, give a bfloat16 output.
Forward only: a backward through it raises Fa4Error. Descales with other dtypes raise ValueError.

Score variants (docs/semantics.md), in every function: alibi_slopes (fp32, (nheads,) or
(batch, nheads), flash_attn 2's argument) subtracts slope·|i + seqlen_k − seqlen_q − j| from each
score after softcap; the slopes are constants, without a gradient, as in flash_attn. Learnable
attention sinks (gpt-oss): learnable_sink (FlashAttention-4's name) or its alias sinks (one of
the two), fp32 (nheads,) logits that join every row's softmax denominator without a value; a row
that sees no key outputs 0 with softmax_lse = its head's sink. Their gradient flows through
autograd. Both run on the CPU backend; CUDA calls raise Fa4Error (not supported) until the sm90
kernels compute them (fallback mode runs them on the reference)."""
import torch

from . import ops  # registers torch.ops.fa4cpp.*


def _refuse_unsupported(dropout_p):
    if dropout_p > 0:
        raise ValueError("fa4cpp: dropout_p=%r is not supported (fa4cpp computes attention "
                         "without dropout); pass dropout_p=0.0" % (dropout_p,))


def _variants(alibi_slopes, learnable_sink, sinks):
    """The ops' score-variant arguments (only those given): the slopes, and the sinks under
    either name, never both."""
    if learnable_sink is not None and sinks is not None:
        raise ValueError("fa4cpp: learnable_sink and sinks name the same argument (the attention "
                         "sinks); give one of them")
    return ops._variant_kwargs(alibi_slopes, learnable_sink if sinks is None else sinks)


def _scale(softmax_scale):
    """flash_attn's None means 1/sqrt(head_dim): the op's 0."""
    if softmax_scale is None:
        return 0.0
    if softmax_scale == 0:
        raise ValueError("fa4cpp: softmax_scale=0 is not supported (the library reads 0 as "
                         "1/sqrt(head_dim)); pass None for that default")
    return float(softmax_scale)


def _window(window_size):
    """flash_attn treats any negative side as unbounded; the library wants exactly -1."""
    left, right = window_size
    return (-1 if left < 0 else int(left)), (-1 if right < 0 else int(right))


def _softcap(softcap):
    """flash_attn: anything > 0 activates softcapping, <= 0 deactivates it."""
    return float(softcap) if softcap > 0 else 0.0


def _length(n):
    """A max_seqlen given as a one-element tensor (some callers keep it so) as an int."""
    return int(n.item()) if isinstance(n, torch.Tensor) else n


def _result(out, lse, return_attn_probs):
    if not return_attn_probs:
        return out
    return out, lse, torch.empty((0,), dtype=out.dtype, device=out.device)


def _descales(q_descale, k_descale, v_descale):
    """The ops' descale arguments: passed only when one is given, so that calls without them keep
    the ops' shorter argument lists."""
    if q_descale is None and k_descale is None and v_descale is None:
        return {}
    return dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, q_descale=None, k_descale=None, v_descale=None,
                    learnable_sink=None, sinks=None):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim[_v]),
    nheads a multiple of nheads_k (GQA/MQA). Masks are aligned bottom-right: query i sees key j
    iff i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1]
    (a negative side is unbounded; causal sets window_size[1] = 0); a query row that sees no key
    outputs 0. Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse
    (batch, nheads, seqlen_q) fp32, empty S_dmask) with return_attn_probs. float8_e4m3fn q, k, v
    take q_descale / k_descale / v_descale ((batch, nheads_k) fp32) and give a bfloat16 out.
    alibi_slopes ((nheads,) or (batch, nheads) fp32) and learnable_sink / sinks ((nheads,) fp32)
    as the module docstring says."""
    _refuse_unsupported(dropout_p)
    variants = _variants(alibi_slopes, learnable_sink, sinks)
    left, right = _window(window_size)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, _scale(softmax_scale), bool(causal), left, right,
                                    _softcap(softcap), bool(deterministic),
                                    **_descales(q_descale, k_descale, v_descale), **variants)
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None,
                           return_softmax_lse=False, out=None, num_splits=0,
                           scheduler_metadata=None, q_descale=None, k_descale=None,
                           v_descale=None, fa_version=None, s_aux=None, learnable_sink=None,
                           sinks=None):
    """Packed variable-length batches: q (total_q, nheads, headdim), k/v (total_k, nheads_k,
    headdim[_v]), sequence b in rows cu_seqlens[b] .. cu_seqlens[b+1] (int32, batch + 1 entries,
    on the tensors' device); max_seqlen_* bound the sequence lengths. seqused_k (int32, batch)
    optionally limits sequence b to its first seqused_k[b] keys. Returns out (total_q, nheads,
    headdim_v), or (out, softmax_lse (nheads, total_q) fp32, empty S_dmask).

    vLLM's call is accepted too (keywords): block_table (batch, max_blocks) int32 with k / v a
    paged cache (num_blocks, block_size, nheads_k, headdim), seqused_k the sequences' key counts
    and cu_seqlens_k None; out= receives the result (also returned; written in place with
    block_table, copied into otherwise); return_softmax_lse returns
    (out, softmax_lse); num_splits bounds the split-KV of a paged call (0: the library's choice);
    fa_version is ignored. scheduler_metadata and s_aux raise ValueError.

    float8_e4m3fn q, k, v (or a paged e4m3 cache) take q_descale / k_descale / v_descale
    ((batch, nheads_k) fp32, batch the number of sequences) and give a bfloat16 output (out=
    must be bfloat16 then). alibi_slopes ((nheads,) or (batch, nheads) fp32, one row per
    sequence) and learnable_sink / sinks ((nheads,) fp32) as the module docstring says, in both
    call forms."""
    for name, value in (("scheduler_metadata", scheduler_metadata), ("s_aux", s_aux)):
        if value is not None:
            raise ValueError("fa4cpp: %s is not supported by flash_attn_varlen_func (pass None)"
                             % name)
    _refuse_unsupported(dropout_p)
    window_size = (-1, -1) if window_size is None else window_size
    left, right = _window(window_size)
    descales = dict(_descales(q_descale, k_descale, v_descale),
                    **_variants(alibi_slopes, learnable_sink, sinks))
    if block_table is not None:
        if cu_seqlens_k is not None:
            raise ValueError("fa4cpp: with block_table the keys are the paged cache's: pass "
                             "seqused_k and cu_seqlens_k=None")
        args = (q, k, v, None, None, None, None, seqused_k, None, None, block_table,
                cu_seqlens_q, None, _length(max_seqlen_q), _scale(softmax_scale), bool(causal),
                left, right, _softcap(softcap), False, int(num_splits))
        if out is not None:  # written in place
            lse = torch.ops.fa4cpp.fwd_kvcache_out(*args, out, **descales)
            return (out, lse) if return_softmax_lse else _result(out, lse, return_attn_probs)
        result, lse = torch.ops.fa4cpp.fwd_kvcache(*args, **descales)
    else:
        result, lse = torch.ops.fa4cpp.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, _length(max_seqlen_q), _length(max_seqlen_k),
            seqused_k, _scale(softmax_scale), bool(causal), left, right, _softcap(softcap),
            bool(deterministic), **descales)
    if out is not None:
        out.copy_(result)
        result = out
    if return_softmax_lse:
        return result, lse
    return _result(result, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, sinks=None):
    """qkv (batch, seqlen, 3, nheads, headdim); q, k and v are strided views of it (no copy)."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink, sinks=sinks)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, sinks=None):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs,
                           learnable_sink=learnable_sink, sinks=sinks)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None,
                                     sinks=None):
    """qkv (total, 3, nheads, headdim); one cu_seqlens for queries and keys."""
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink, sinks=sinks)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None, sinks=None):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs,
                                  learnable_sink=learnable_sink, sinks=sinks)


# FlashAttention-3 arguments fa4cpp does not compute: given anything but their default, they raise.
_KVCACHE_UNSUPPORTED = (("qv", None), ("rotary_seqlens", None), ("attention_chunk", 0),
                        ("scheduler_metadata", None), ("sm_margin", 0))


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                            cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                            rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                            pack_gqa=None, sm_margin=0, return_softmax_lse=False,
                            alibi_slopes=None, learnable_sink=None, sinks=None):
    """Attention over a KV cache, FlashAttention-3's flash_attn_with_kvcache. q (batch, seqlen_q,
    nheads, headdim), or (total_q, nheads, headdim) with cu_seqlens_q and max_seqlen_q.
    k_cache / v_cache (batch_cache, seqlen_cache, nheads_k, headdim[_v]), or with page_table
    (batch, max_pages) int32: (num_pages, page_size, nheads_k, headdim[_v]), any page size.
    cache_seqlens (int, or (batch,) int32): each cache row's current length. k / v (batch,
    seqlen_new, nheads_k, headdim[_v]), or (total_new, ...) with cu_seqlens_k_new: written into
    the cache (in place) at cache_seqlens, k rotated there by rotary_cos / rotary_sin
    ((seqlen_ro, rotary_dim / 2)) when given, then attended to with the rest. Queries are rotated
    too: at cache_seqlens + i under a causal or window mask, all at cache_seqlens otherwise.
    cache_batch_idx (batch,) picks the cache row (or page-table row) of each batch entry;
    cache_leftpad (batch,) the first valid key of each. Masks are aligned bottom-right over each
    sequence's keys. num_splits: 0 the library's choice, 1 none, n at most n. pack_gqa is a
    performance hint the library decides by itself (ignored). Returns out (q's shape with
    headdim_v), or (out, softmax_lse) with return_softmax_lse ((batch, nheads, seqlen_q), or
    (nheads, total_q) when varlen). Forward only.

    FP8: q and the caches float8_e4m3fn, with q_descale / k_descale / v_descale ((batch,
    nheads_k) fp32, of the batch entry, not of the cache row it reads). New rows k / v in
    float8_e4m3fn are written as given and the output is bfloat16; in bfloat16 or float16 (as a
    model computes them) each element is divided by its descale and rounded to e4m3 as it is
    written (saturating at ±448), and the output is in their dtype. The rotary tables are in the
    output's dtype.

    alibi_slopes ((nheads,) or (batch, nheads) fp32, of the batch entry) and learnable_sink /
    sinks ((nheads,) fp32) as the module docstring says, over each sequence's keys
    (cache_leftpad to the last appended row: seqlen_k is their count)."""
    given = dict(qv=qv, rotary_seqlens=rotary_seqlens, attention_chunk=attention_chunk,
                 scheduler_metadata=scheduler_metadata, sm_margin=sm_margin)
    for name, default in _KVCACHE_UNSUPPORTED:
        if given[name] is not default and given[name] != default:
            raise ValueError("fa4cpp: %s is not supported by flash_attn_with_kvcache (pass %r)"
                             % (name, default))
    if cu_seqlens_q is not None and max_seqlen_q is None:
        raise ValueError("fa4cpp: max_seqlen_q must be given with cu_seqlens_q")
    variants = _variants(alibi_slopes, learnable_sink, sinks)
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None else q.shape[0]
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    left, right = _window(window_size)
    out, lse = torch.ops.fa4cpp.fwd_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
        cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
        _length(max_seqlen_q) if max_seqlen_q is not None else 0, _scale(softmax_scale),
        bool(causal), left, right, _softcap(softcap), bool(rotary_interleaved), int(num_splits),
        **_descales(q_descale, k_descale, v_descale), **variants)
    return (out, lse) if return_softmax_lse else out


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv,
                           headdim, cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None,
                           cu_seqlens_q=None, cu_seqlens_k_new=None, cache_leftpad=None,
                           page_size=None, max_seqlen_k_new=0, causal=False,
                           window_size=(-1, -1), attention_chunk=0, has_softcap=False,
                           num_splits=0, pack_gqa=None, sm_margin=0):
    """FlashAttention-3's get_scheduler_metadata, for engines that call it before capturing a
    step in a CUDA graph. fa4cpp needs no metadata: it plans each launch on the host from the
    shapes and the caller's bounds (max_seqlen_q / max_seqlen_k, the page table's width,
    num_splits), never from the contents of cache_seqlens or cu_seqlens, so a captured call stays
    right for any lengths within those bounds. Returns None, which the functions take as
    scheduler_metadata."""
    return None
