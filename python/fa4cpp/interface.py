"""flash_attn-compatible functions: the names, arguments, shapes and return conventions of
flash_attn 2's flash_attn_interface, over fa4cpp's custom ops. Porting code is one import:
`from fa4cpp import flash_attn_func` for `from flash_attn import flash_attn_func`.

Differences, each an error rather than a silent change: dropout_p > 0, alibi_slopes and
block_table (paged KV) raise ValueError naming the argument; so does an explicit softmax_scale of 0
(the library reads 0 as "default"). With return_attn_probs=True the result is
(out, softmax_lse, S_dmask) where S_dmask is an empty tensor of shape (0,): what flash_attn 2.7 and
later return whenever dropout_p is 0 (the only case fa4cpp runs; flash_attn computes the
probabilities only with dropout, and versions up to 2.6 returned None there).
flash_attn_varlen_func takes seqused_k as an extra keyword (flash_attn 3's name)."""
import torch

from . import ops  # noqa: F401  (registers torch.ops.fa4cpp.*)


def _refuse_unsupported(dropout_p, alibi_slopes, block_table=None):
    if dropout_p > 0:
        raise ValueError("fa4cpp: dropout_p=%r is not supported (fa4cpp computes attention "
                         "without dropout); pass dropout_p=0.0" % (dropout_p,))
    if alibi_slopes is not None:
        raise ValueError("fa4cpp: alibi_slopes is not supported (no ALiBi bias); pass "
                         "alibi_slopes=None")
    if block_table is not None:
        raise ValueError("fa4cpp: block_table (a paged KV cache) is not supported; pass "
                         "contiguous k/v and block_table=None")


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


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_k, headdim[_v]),
    nheads a multiple of nheads_k (GQA/MQA). Masks are aligned bottom-right: query i sees key j
    iff i + seqlen_k - seqlen_q - window_size[0] <= j <= i + seqlen_k - seqlen_q + window_size[1]
    (a negative side is unbounded; causal sets window_size[1] = 0); a query row that sees no key
    outputs 0. Returns out (batch, seqlen_q, nheads, headdim_v), or (out, softmax_lse
    (batch, nheads, seqlen_q) fp32, empty S_dmask) with return_attn_probs."""
    _refuse_unsupported(dropout_p, alibi_slopes)
    left, right = _window(window_size)
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, _scale(softmax_scale), bool(causal), left, right,
                                    _softcap(softcap), bool(deterministic))
    return _result(out, lse, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None, *, seqused_k=None):
    """Packed variable-length batches: q (total_q, nheads, headdim), k/v (total_k, nheads_k,
    headdim[_v]), sequence b in rows cu_seqlens[b] .. cu_seqlens[b+1] (int32, batch + 1 entries,
    on the tensors' device); max_seqlen_* bound the sequence lengths. seqused_k (int32, batch)
    optionally limits sequence b to its first seqused_k[b] keys. Returns out (total_q, nheads,
    headdim_v), or (out, softmax_lse (nheads, total_q) fp32, empty S_dmask)."""
    _refuse_unsupported(dropout_p, alibi_slopes, block_table)
    left, right = _window(window_size)
    out, lse = torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                           _length(max_seqlen_q), _length(max_seqlen_k), seqused_k,
                                           _scale(softmax_scale), bool(causal), left, right,
                                           _softcap(softcap), bool(deterministic))
    return _result(out, lse, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """qkv (batch, seqlen, 3, nheads, headdim); q, k and v are strided views of it (no copy)."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """q (batch, seqlen_q, nheads, headdim), kv (batch, seqlen_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """qkv (total, 3, nheads, headdim); one cu_seqlens for queries and keys."""
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """q (total_q, nheads, headdim), kv (total_k, 2, nheads_k, headdim)."""
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)
