"""fa4cpp as the flash-attention implementation of torch's scaled_dot_product_attention (SDPA).

Importing this module (``import fa4cpp`` does) registers the name "fa4cpp" in torch's
flash-attention registry (torch >= 2.11) and changes nothing else. Opt in, and back out, with

    torch.nn.attention.activate_flash_attention_impl("fa4cpp")
    torch.nn.attention.restore_flash_attention_impl()

While active, the CUDA kernels of aten::_scaled_dot_product_flash_attention and its backward (the
ops SDPA's flash backend calls) are replaced by the functions below: a call whose problem the
library accepts runs torch.ops.fa4cpp.fwd / bwd; any other call runs the stock FlashAttention-2
kernels (aten::_flash_attention_forward / _backward, which stay untouched), exactly as if fa4cpp
were not active. Both write the log-sum-exp as (batch, heads, seqlen_q) fp32 in natural log, so a
forward by one and a backward by the other combine correctly. `calls` counts where each call went.

torch's context parallelism (torch.distributed.tensor.experimental.context_parallel) calls the
same op for each ring step on the local shards, so it runs fa4cpp's kernels too while active.
"""
import collections
import logging
import warnings

import torch
import torch.nn.attention

from . import ops

NAME = "fa4cpp"
FORWARD = "fwd"
BACKWARD = "bwd"
FA4CPP = "fa4cpp"

# (pass, where): where is "fa4cpp", or "stock: <why fa4cpp did not take the call>".
calls = collections.Counter()

_log = logging.getLogger(__name__)
_OVERRIDDEN_KEY = "CUDA"


def forward_route(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                  scale=None):
    """None when fa4cpp runs this SDPA flash forward ((batch, heads, seq, dim) tensors, the op's
    arguments), else the reason the stock kernel runs it."""
    reason = _sdpa_only_reason(dropout_p, scale)
    if reason is None and return_debug_mask:
        reason = "return_debug_mask (fa4cpp does not return attention probabilities)"
    if reason is None:
        q, k, v = _bshd(query, key, value)
        reason = ops.support(FORWARD, q, k, v, softmax_scale=_library_scale(scale),
                             causal=is_causal)
    return reason


def backward_route(query, key, value, dropout_p=0.0, is_causal=False, scale=None):
    """None when fa4cpp runs this SDPA flash backward, else the reason the stock kernel runs it."""
    reason = _sdpa_only_reason(dropout_p, scale)
    if reason is None:
        q, k, v = _bshd(query, key, value)
        reason = ops.support(BACKWARD, q, k, v, softmax_scale=_library_scale(scale),
                             causal=is_causal)
    return reason


def _sdpa_only_reason(dropout_p, scale):
    """What SDPA can ask for that fa4cpp's problem cannot express."""
    if dropout_p != 0.0:
        return "dropout_p > 0 (fa4cpp has no dropout)"
    if scale is not None and scale == 0.0:
        return "scale 0 (the library reads a softmax_scale of 0 as 1/sqrt(head_dim))"
    return None


def _params(scale, is_causal, deterministic=False):
    return ops.Params(_library_scale(scale), is_causal, -1, -1, 0.0, deterministic)


def _library_scale(scale):
    # SDPA's None means 1/sqrt(head_dim); so does the library's 0.
    return 0.0 if scale is None else float(scale)


def _bshd(*tensors):
    """SDPA's (batch, heads, seq, dim) tensors as the library's (batch, seq, heads, dim): views."""
    return tuple(t.transpose(1, 2) for t in tensors)


def _laid_out_like(ref, t):
    """t (ref's shape) in the memory layout torch.empty_like(ref) has. SDPA's meta kernels promise
    that layout for the output and the gradients, and code compiled by torch.compile relies on it
    (it asserts the strides it was compiled for); the library writes (batch, seq, heads, dim)
    contiguous tensors, which is the same layout whenever ref is a (batch, seq, heads, dim) tensor
    seen through a transpose — the usual case — so the copy happens only for other layouts."""
    # t is dense, so equal strides mean ref is dense in the same layout: what empty_like keeps.
    if t.stride() == ref.stride() or t.stride() == torch.empty_like(ref, device="meta").stride():
        return t
    return torch.empty_like(ref).copy_(t)


def _count(pass_, reason):
    where = FA4CPP if reason is None else "stock: " + reason
    if reason is not None and not calls[(pass_, where)]:
        _log.debug("fa4cpp SDPA %s: stock kernel runs it: %s", pass_, reason)
    calls[(pass_, where)] += 1


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False,
                        return_debug_mask=False, *, scale=None):
    # The schema of aten::_scaled_dot_product_flash_attention: (output, logsumexp, cum_seq_q,
    # cum_seq_k, max_q, max_k, rng_state, unused, debug_attn_mask).
    reason = forward_route(query, key, value, dropout_p, is_causal, return_debug_mask, scale)
    _count(FORWARD, reason)
    q, k, v = _bshd(query, key, value)
    if reason is not None:
        out, lse, rng_state, unused, debug_mask = torch.ops.aten._flash_attention_forward(
            q, k, v, None, None, q.size(1), k.size(1), dropout_p, is_causal, return_debug_mask,
            scale=scale)
    else:
        # Inside the aten kernel (below any tracing): ops' implementation, with the modes, writing
        # O straight into the layout empty_like(query) has.
        out, lse = ops._forward(q, k, v, _params(scale, is_causal), out_like=query)
        # Shaped as FlashAttention-2's (and the meta kernel's); without dropout nothing reads them.
        rng_state = torch.empty(2, dtype=torch.uint64, device=query.device)
        unused = torch.empty((), dtype=torch.uint64, device=query.device)
        debug_mask = torch.empty(0, dtype=query.dtype, device=query.device)
    return (_laid_out_like(query, out.transpose(1, 2)), lse, None, None, query.size(2),
            key.size(2), rng_state, unused, debug_mask)


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                         max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                         scale=None):
    if grad_out is None:  # as the stock kernel: no gradient in, none out
        return None, None, None
    reason = backward_route(query, key, value, dropout_p, is_causal, scale)
    _count(BACKWARD, reason)
    go, q, k, v, o = _bshd(grad_out, query, key, value, out)
    if reason is not None:
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            go, q, k, v, o, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
            philox_seed, philox_offset, scale=scale)
    else:
        dq, dk, dv = ops._backward(
            go, q, k, v, o, logsumexp,
            _params(scale, is_causal, torch.are_deterministic_algorithms_enabled()),
            grads_like=(query, key, value))
    return tuple(_laid_out_like(ref, g.transpose(1, 2))
                 for ref, g in ((query, dq), (key, dk), (value, dv)))


class SdpaHandle:
    """Keeps the kernel overrides registered; remove() restores the stock kernels."""

    def __init__(self, library):
        self._library = library

    @property
    def active(self):
        return self._library is not None

    def remove(self):
        if self._library is not None:
            self._library._destroy()
            self._library = None


def register_kernels(dispatch_key=_OVERRIDDEN_KEY):
    """Override SDPA's flash-attention ops for `dispatch_key` (CUDA for the registry; the tests
    also use CPU, where the ops have no stock kernel, to run the round trip without a GPU)."""
    library = torch.library.Library("aten", "IMPL", dispatch_key)
    with warnings.catch_warnings():
        # torch warns (once per process) that a kernel is being overridden: that is the point here.
        warnings.filterwarnings("ignore", message="Warning only once for all operators")
        library.impl("_scaled_dot_product_flash_attention", _sdpa_flash_forward, dispatch_key)
        library.impl("_scaled_dot_product_flash_attention_backward", _sdpa_flash_backward,
                     dispatch_key)
    return SdpaHandle(library)


# torch < 2.11 has no registry: the module still imports, SDPA just cannot be routed.
_registry_api = getattr(torch.nn.attention, "register_flash_attention_impl", None)
REGISTERED = _registry_api is not None
if REGISTERED:
    _registry_api(NAME, register_fn=register_kernels)
