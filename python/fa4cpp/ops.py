"""The torch.library custom ops of fa4cpp (namespace "fa4cpp"), their fake (shape) implementations
and autograd formulas, and support(): whether the library runs a problem.

    torch.ops.fa4cpp.fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         deterministic=False, q_descale=None, k_descale=None,
                         v_descale=None, alibi_slopes=None, sinks=None) -> (out, lse)
        q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv); out (b, sq, hq, dv) in q's
        dtype, lse (b, hq, sq) fp32. softmax_scale 0 = 1/sqrt(d); window sides -1 = unbounded;
        softcap 0 = off. `deterministic` only travels to the backward autograd runs.
        float8_e4m3fn q, k, v: out is bfloat16, and the descales (fp32 (b, hkv), any strides,
        None = 1) scale them: S = softmax_scale·q_descale·k_descale·QKᵀ, O = v_descale·PV.
        Forward only: the backward of FP8 inputs raises Fa4Error.
        The score variants (docs/semantics.md): alibi_slopes, fp32 (hq,) or (b, hq) with any
        strides, subtract slope·|i + sk − sq − j| after softcap; sinks, fp32 (hq,) logits, join
        every row's softmax denominator without a value (a row that sees no key: O = 0,
        lse = sink).
    torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic, alibi_slopes=None, sinks=None,
                         dsinks=None) -> (dq, dk, dv)
        the forward's variants again; dsinks (fp32 (hq,), a problem with sinks only) is written
        with the sinks' gradient, −Σ over the head's rows of exp(sink − lse)·rowsum(dout ∘ out).
    torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_k, softmax_scale, causal, window_left, window_right,
                                softcap, deterministic=False, q_descale=None, k_descale=None,
                                v_descale=None, alibi_slopes=None, sinks=None) -> (out, lse)
        q (total_q, hq, d), k/v (total_k, hkv, d/dv), cu_seqlens_* int32 (batch + 1),
        seqused_k int32 (batch) or None; out (total_q, hq, dv), lse (hq, total_q). Descales and
        (batch, hq) ALiBi slopes as fwd's, one row per sequence.
    torch.ops.fa4cpp.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                                window_left, window_right, softcap, deterministic,
                                alibi_slopes=None, sinks=None, dsinks=None) -> (dq, dk, dv)

    torch.ops.fa4cpp.fwd_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                                 cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                 cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale,
                                 causal, window_left, window_right, softcap, rotary_interleaved,
                                 num_splits, q_descale=None, k_descale=None,
                                 v_descale=None, alibi_slopes=None, sinks=None) -> (out, lse)
        attention over a KV cache (flash_attn_with_kvcache), appending k_new / v_new to it in
        place first; forward only. An e4m3 cache (and q) takes descales as fwd's, one row per
        batch entry; its appended rows are e4m3 (written as given) or bfloat16 / float16
        (quantised on write: divided by their descale, rounded to e4m3), and the output is
        bfloat16, or the appended rows' dtype when they are 16-bit (the rotary tables' too). The
        score variants as fwd's, ALiBi slopes of (batch, hq) one row per batch entry.
    torch.ops.fa4cpp.fwd_kvcache_out(<fwd_kvcache's arguments but the trailing ones>, out,
                                     q_descale=None, k_descale=None, v_descale=None,
                                     alibi_slopes=None, sinks=None) -> lse
        the same, writing into the caller's `out` (vLLM's out=).

These are the native ops (C++, python/csrc, docs/python.md) when libfa4_torch.so is loaded; the
functions below are then their Python implementation, registered as fa4cpp::<name>_py, which the
native ops hand refusals, bad input and the modes to. Without the native ops they are the ops.

fwd's autograd formula calls bwd (varlen_fwd's calls varlen_bwd), with dsinks when the sinks
require grad; lse, the descales and the ALiBi slopes are not differentiable (the slopes are
constants, as in flash_attn). The descale and score-variant arguments come last, with defaults, so
that calls written for the schemas without them keep working.
Tensors may have any strides (the library takes them); one whose last dimension is not contiguous
is copied. CUDA tensors run on the sm90 backend on torch's current stream, CPU tensors on the CPU
backend. A problem the library refuses raises Fa4Error with its reason, or runs on
fa4cpp.reference in fallback mode (fa4cpp.modes); verify mode checks results after the call."""
import contextlib
import ctypes
import dataclasses
import math
import warnings
from typing import Optional

import torch

from . import _library, c_abi, modes, reference
from .c_abi import Params

Tensor = torch.Tensor

_PASSES = {"fwd": c_abi.PASS_FORWARD, "bwd": c_abi.PASS_BACKWARD}
# sm90 loads with TMA: 16-byte aligned base addresses and strides, no broadcast (0) strides.
_TMA_ALIGN_BYTES = 16


# -- input checks ---------------------------------------------------------------------------------

def _fail(message, *args):
    raise ValueError("fa4cpp: " + message % args)


_FP8 = c_abi.FP8_DTYPES
_DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def output_dtype(q, k_new=None):
    """The dtype of the output of inputs of q's dtype: q's own, or bfloat16 for float8_e4m3fn
    (FlashAttention-3's rule); a KV cache call whose appended rows k_new are bfloat16 / float16
    (quantised on write) outputs in their dtype."""
    if q.dtype not in _FP8:
        return q.dtype
    if k_new is not None and k_new.dtype in c_abi.FP8_OUT_DTYPES:
        return k_new.dtype
    return torch.bfloat16


def _fp8(q, descales, k_new=None):
    """Params.fp8 of a call: None for inputs of another dtype without descales; otherwise the
    output dtype and the descales (which _check_fp8 checks)."""
    if q.dtype not in _FP8 and all(d is None for d in descales):
        return None
    quantize = q.dtype in _FP8 and k_new is not None and k_new.dtype not in _FP8
    return c_abi.Fp8(output_dtype(q, k_new), quantize, *descales)


def _check_fp8(q, params, batch, heads_kv):
    """Descales only with float8_e4m3fn inputs; each fp32 (batch, heads_kv) on q's device."""
    fp8 = params.fp8
    if fp8 is None:
        return
    given = [(name, t) for name, t in zip(_DESCALE_NAMES, (fp8.q_descale, fp8.k_descale,
                                                            fp8.v_descale)) if t is not None]
    if q.dtype not in _FP8:
        _fail("%s is given, but the inputs are %s: descales scale float8_e4m3fn inputs only "
              "(pass None)", given[0][0], q.dtype)
    for name, t in given:
        if t.dtype != torch.float32 or tuple(t.shape) != (batch, heads_kv) or t.device != q.device:
            _fail("%s must be a float32 tensor of shape (batch, heads_kv) = %s on %s (got %s %s on "
                  "%s); expand() broadcasts a shared value", name, (batch, heads_kv), q.device,
                  t.dtype, tuple(t.shape), t.device)


def _check_variants(q, alibi_slopes, sinks, batch):
    """ALiBi slopes fp32 (heads_q,) or (batch, heads_q), sinks fp32 (heads_q,), on q's device."""
    heads = q.shape[-2]
    if alibi_slopes is not None:
        t = alibi_slopes
        if (t.dtype != torch.float32 or tuple(t.shape) not in ((heads,), (batch, heads))
                or t.device != q.device):
            _fail("alibi_slopes must be a float32 tensor of shape (heads_q,) = %s or (batch, "
                  "heads_q) = %s on %s (got %s %s on %s)", (heads,), (batch, heads), q.device,
                  t.dtype, tuple(t.shape), t.device)
    if sinks is not None:
        t = sinks
        if t.dtype != torch.float32 or tuple(t.shape) != (heads,) or t.device != q.device:
            _fail("the sinks (learnable_sink / sinks) must be a float32 tensor of shape (heads_q,) "
                  "= %s on %s, one logit per query head (got %s %s on %s)", (heads,), q.device,
                  t.dtype, tuple(t.shape), t.device)


def _check_dsinks(dsinks, params, q):
    """The backward's dsinks: fp32 (heads_q,) on q's device, for a problem with sinks."""
    if dsinks is None:
        return
    if params.sinks is None:
        _fail("dsinks is given, but the problem has no sinks (pass sinks, or dsinks=None)")
    heads = q.shape[-2]
    if dsinks.dtype != torch.float32 or tuple(dsinks.shape) != (heads,) or \
            dsinks.device != q.device:
        _fail("dsinks must be a float32 tensor of shape (heads_q,) = %s on %s (got %s %s on %s)",
              (heads,), q.device, dsinks.dtype, tuple(dsinks.shape), dsinks.device)


def _refuse_fp8_backward(q):
    """FP8 is forward-only (the library has no e4m3 backward): refused whatever the mode, since
    gradients of e4m3 tensors would be e4m3 too."""
    if q.dtype in _FP8:
        raise c_abi.Fa4Error(
            "fa4cpp: the backward of float8_e4m3fn (FP8) inputs is not supported: FP8 attention "
            "is forward-only (run it under torch.no_grad(), or compute gradients from bfloat16 / "
            "float16 inputs)", c_abi.ERROR_NOT_SUPPORTED)


def _check_params(params):
    for side, value in (("window_left", params.window_left),
                        ("window_right", params.window_right)):
        if value < -1:
            _fail("%s is %d; it must be >= 0, or -1 for unbounded", side, value)
    if not math.isfinite(params.softcap) or params.softcap < 0:
        _fail("softcap is %r; it must be 0 (off) or a finite positive number", params.softcap)
    if not math.isfinite(params.softmax_scale):
        _fail("softmax_scale is %r; it must be finite (0 selects 1/sqrt(head_dim))",
              params.softmax_scale)
    # The library holds the scale in fp32: a value that rounds to 0 there would silently become
    # the default scale, one that rounds to inf is not finite. c_float rounds as the fa4_problem
    # field does (a C cast; torch.tensor(x, dtype=float32) gives the same value at ~30x the cost).
    if params.softmax_scale != 0:
        scale32 = ctypes.c_float(params.softmax_scale).value
        if scale32 == 0 or not math.isfinite(scale32):
            _fail("softmax_scale is %r, which is %r in fp32 (the library's precision); give one "
                  "that fp32 represents as a finite non-zero value", params.softmax_scale,
                  scale32)


def _check_common(q, k, v, rank, layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            _fail("%s has shape %s; expected %s", name, tuple(t.shape), layout)
    if not q.dtype == k.dtype == v.dtype:
        _fail("q, k and v must have one dtype (got %s, %s, %s)", q.dtype, k.dtype, v.dtype)
    if not q.device == k.device == v.device:
        _fail("q, k and v must be on one device (got %s, %s, %s)", q.device, k.device, v.device)
    qs, ks, vs = q.shape, k.shape, v.shape  # each .shape builds a new torch.Size
    if ks[-2] != vs[-2] or ks[-3] != vs[-3]:
        _fail("k %s and v %s must have the same key rows and heads", tuple(ks), tuple(vs))
    if qs[-1] != ks[-1]:
        _fail("q and k must have one head dim (got %d and %d)", qs[-1], ks[-1])
    if ks[-2] < 1 or qs[-2] % ks[-2] != 0:
        _fail("q's heads (%d) must be a multiple of k's and v's heads (%d)", qs[-2], ks[-2])
    if qs[-1] < 1 or vs[-1] < 1:
        _fail("head dims must be >= 1 (q %d, v %d)", qs[-1], vs[-1])


def _check_fixed(q, k, v):
    _check_common(q, k, v, 4, "(batch, seqlen, heads, head_dim)")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        _fail("q, k and v must have one batch size (got %d, %d, %d)", q.shape[0], k.shape[0],
              v.shape[0])


def _check_index(name, t, length, device):
    if t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] != length:
        _fail("%s must be a 1-D int32 tensor of %d entries (got %s %s)", name, length, t.dtype,
              tuple(t.shape))
    if t.device != device:
        _fail("%s must be on the tensors' device %s (got %s)", name, device, t.device)


def _check_varlen(q, k, v, params):
    _check_common(q, k, v, 3, "(total, heads, head_dim)")
    batch = params.cu_seqlens_q.shape[0] - 1 if params.cu_seqlens_q.dim() == 1 else -1
    if batch < 0:
        _fail("cu_seqlens_q must be 1-D with batch + 1 entries (got shape %s)",
              tuple(params.cu_seqlens_q.shape))
    _check_index("cu_seqlens_q", params.cu_seqlens_q, batch + 1, q.device)
    _check_index("cu_seqlens_k", params.cu_seqlens_k, batch + 1, q.device)
    if params.seqused_k is not None:
        _check_index("seqused_k", params.seqused_k, batch, q.device)
    if params.max_seqlen_q < 0 or params.max_seqlen_k < 0:
        _fail("max_seqlen_q (%d) and max_seqlen_k (%d) must be >= 0", params.max_seqlen_q,
              params.max_seqlen_k)


def _check(q, k, v, params):
    _check_params(params)
    if (params.cu_seqlens_q is None) != (params.cu_seqlens_k is None):
        _fail("varlen needs both cu_seqlens_q and cu_seqlens_k (one of them is None)")
    if params.varlen:
        _check_varlen(q, k, v, params)
        batch = params.cu_seqlens_q.shape[0] - 1
    else:
        _check_fixed(q, k, v)
        batch = q.shape[0]
    _check_fp8(q, params, batch, k.shape[-2])
    _check_variants(q, params.alibi_slopes, params.sinks, batch)


def _check_grads_inputs(dout, out, lse, q, v, params):
    qs, dtype, device = q.shape, q.dtype, q.device
    out_shape = tuple(qs[:-1]) + (v.shape[-1],)
    lse_shape = (qs[1], qs[0]) if params.varlen else (qs[0], qs[2], qs[1])
    for name, t in (("dout", dout), ("out", out)):
        if tuple(t.shape) != out_shape or t.dtype != dtype or t.device != device:
            _fail("%s must be a %s tensor of shape %s on %s (got %s %s on %s)", name, dtype,
                  out_shape, device, t.dtype, tuple(t.shape), t.device)
    if tuple(lse.shape) != lse_shape or lse.dtype != torch.float32 or lse.device != device:
        _fail("lse must be a float32 tensor of shape %s on %s (got %s %s on %s)", lse_shape,
              device, lse.dtype, tuple(lse.shape), lse.device)


# -- support --------------------------------------------------------------------------------------

def support(pass_, q, k, v, *, softmax_scale=0.0, causal=False, window=(-1, -1), softcap=0.0,
            cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
            seqused_k=None, alibi_slopes=None, sinks=None, backend=None):
    """None when the library's can_implement accepts the problem for pass_ ("fwd" or "bwd") on the
    backend the tensors' device selects (cuda -> sm90, cpu -> cpu; `backend` "cpu" / "sm90"
    overrides it), else the reason. Reads shapes, dtypes and devices only: fake and meta tensors
    are fine. Inputs fa4cpp cannot take at all (mismatched shapes, a dtype the library lacks, a
    device it does not run on) are refused with a reason too, never raised. alibi_slopes and sinks
    (the score variants) as the ops take them."""
    if pass_ not in _PASSES:
        raise ValueError("fa4cpp.ops.support: pass_ must be 'fwd' or 'bwd', not %r" % (pass_,))
    params = Params(softmax_scale=float(softmax_scale), causal=bool(causal),
                    window_left=int(window[0]), window_right=int(window[1]),
                    softcap=float(softcap), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=int(max_seqlen_q or 0), max_seqlen_k=int(max_seqlen_k or 0),
                    seqused_k=seqused_k, alibi_slopes=alibi_slopes, sinks=sinks)
    try:
        _check(q, k, v, params)
    except ValueError as e:
        return str(e)
    return _checked_support(pass_, q, k, v, params, backend)


def _checked_support(pass_, q, k, v, params, backend=None):
    """support() past its input checks: the tail the ops run, having checked the inputs already."""
    if q.dtype not in c_abi.DTYPES:
        return ("dtype %s: the library takes bfloat16, float16, float32 or float8_e4m3fn"
                % q.dtype)
    if backend is None:
        code = c_abi.backend_of(q.device)
        if code is None:
            return "tensors on device %s: the library runs on cpu and cuda tensors" % q.device
    elif backend in c_abi.BACKEND_NAMES:
        code = c_abi.BACKEND_NAMES[backend]
    else:
        raise ValueError("fa4cpp.ops.support: backend must be 'cpu' or 'sm90', not %r" % (backend,))
    status, message = _library.library().can_implement(_PASSES[pass_], q, k, v, params, code)
    return None if status == c_abi.SUCCESS else message


_SUPPORT = support


def _support(pass_, q, k, v, params):
    """support() for the ops, whose callers have run _check(q, k, v, params): unless support() has
    been replaced, its checks (and the Params it rebuilds) are skipped, having passed already."""
    if support is _SUPPORT:
        return _checked_support(pass_, q, k, v, params)
    # Through the module attribute, so that tests (and users) can replace support().
    return support(pass_, q, k, v, softmax_scale=params.softmax_scale, causal=params.causal,
                   window=(params.window_left, params.window_right), softcap=params.softcap,
                   cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_k=params.cu_seqlens_k,
                   max_seqlen_q=params.max_seqlen_q, max_seqlen_k=params.max_seqlen_k,
                   seqused_k=params.seqused_k, alibi_slopes=params.alibi_slopes,
                   sinks=params.sinks)


# -- running --------------------------------------------------------------------------------------

def _last_dim_contiguous(t):
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def _tma_ready(t):
    """t itself when the sm90 backend can load it with TMA, else a fresh contiguous copy (which
    the caching allocator aligns)."""
    elem = t.element_size()
    misaligned = t.numel() > 0 and (
        t.data_ptr() % _TMA_ALIGN_BYTES != 0
        or any((s * elem) % _TMA_ALIGN_BYTES != 0 or (s == 0 and n > 1)
               for s, n in zip(t.stride()[:-1], t.shape[:-1])))
    if not misaligned:
        return t
    copy = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    copy.copy_(t)
    return copy


def _device_ready(tensors):
    """What the backend of the tensors' device needs beyond a contiguous last dim (sm90: TMA)."""
    if tensors[0].device.type != "cuda":
        return tensors
    return tuple(_tma_ready(t) for t in tensors)


def _out_shapes(q, v, params):
    out = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse = (q.shape[1], q.shape[0]) if params.varlen else (q.shape[0], q.shape[2], q.shape[1])
    return out, lse


def _index_arrays(params):
    """cu_seqlens / seqused_k contiguous (the library reads them as plain int32 arrays), and the
    sinks (a plain fp32 array to it)."""
    def fix(t):
        return t if t is None or t.is_contiguous() else t.contiguous()
    if all(t is None or t.is_contiguous()
           for t in (params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_k, params.sinks)):
        return params  # nothing to copy (always so without varlen): dataclasses.replace is slow
    return dataclasses.replace(params, cu_seqlens_q=fix(params.cu_seqlens_q),
                               cu_seqlens_k=fix(params.cu_seqlens_k),
                               seqused_k=fix(params.seqused_k), sinks=fix(params.sinks))


def _out_dtype(q, params):
    """The output dtype of a checked call (params.fp8 is set only for FP8 inputs then)."""
    return q.dtype if params.fp8 is None else params.fp8.out_dtype


def _reference_forward(q, k, v, params):
    kwargs = dict(params.reference_kwargs(), **params.descale_kwargs())
    with torch.no_grad():
        if params.varlen:
            out, lse = reference.varlen_attention(q, k, v, params.cu_seqlens_q,
                                                  params.cu_seqlens_k, **kwargs)
        else:
            out, lse = reference.attention(q, k, v, **kwargs)
    return out.to(_out_dtype(q, params)), lse.to(torch.float32)


def _reference_backward(dout, q, k, v, params, dsinks=None):
    if params.varlen:
        grads = reference.varlen_attention_backward(dout, q, k, v, params.cu_seqlens_q,
                                                    params.cu_seqlens_k,
                                                    **params.reference_kwargs())
    else:
        grads = reference.attention_backward(dout, q, k, v, **params.reference_kwargs())
    if dsinks is not None:
        dsinks.copy_(grads[3])
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))


def _like(ref, shape, dtype, device):
    """A (batch, seq, heads, dim) output of `shape` laid out as torch.empty_like(ref) lays out
    ref's transpose (ref a (batch, heads, seq, dim) SDPA tensor), when the backend can write that
    layout, so that SDPA gets its promised layout without a copy; None otherwise."""
    if ref is None or ref.transpose(1, 2).shape != shape or ref.device != device:
        return None
    t = torch.empty_like(ref, dtype=dtype).transpose(1, 2)
    return t if device.type != "cuda" or _tma_ready(t) is t else None


def _forward(q, k, v, params, out_like=None):
    _check(q, k, v, params)
    params = _index_arrays(params)
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    reason = _support("fwd", q, k, v, params)
    if reason is not None:
        modes.unsupported("forward", reason)
        return _reference_forward(q, k, v, params)
    q, k, v = _device_ready((q, k, v))
    out_shape, lse_shape = _out_shapes(q, v, params)
    out_dtype = _out_dtype(q, params)
    out = _like(out_like, torch.Size(out_shape), out_dtype, q.device)
    if out is None:
        out = q.new_empty(out_shape, dtype=out_dtype)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    _library.library().forward(q, k, v, out, lse, params)
    if modes.get_mode().verify > 0:
        modes.verify_forward(q, k, v, out, lse, params)
    return out, lse


def _backward(dout, q, k, v, out, lse, params, grads_like=(None, None, None), dsinks=None):
    """dsinks (fp32 (heads_q,), a problem with sinks only) receives the sinks' gradient."""
    _check(q, k, v, params)
    _refuse_fp8_backward(q)
    _check_grads_inputs(dout, out, lse, q, v, params)
    _check_dsinks(dsinks, params, q)
    params = _index_arrays(params)
    dout, q, k, v, out, lse = (_last_dim_contiguous(t) for t in (dout, q, k, v, out, lse))
    reason = _support("bwd", q, k, v, params)
    if reason is not None:
        modes.unsupported("backward", reason)
        return _reference_backward(dout, q, k, v, params, dsinks)
    dout, q, k, v, out = _device_ready((dout, q, k, v, out))
    # Varlen rows outside every sequence are not written by the library: their gradient is 0.
    alloc = torch.zeros if params.varlen else torch.empty
    def grad_for(t, like):
        g = None if params.varlen else _like(like, t.shape, t.dtype, t.device)
        return alloc(t.shape, dtype=t.dtype, device=t.device) if g is None else g
    dq, dk, dv = (grad_for(t, like) for t, like in zip((q, k, v), grads_like))
    # The library writes a plain fp32 array: a strided dsinks takes a copy.
    direct = dsinks is None or dsinks.is_contiguous()
    written = dsinks if direct else torch.empty(dsinks.shape, dtype=torch.float32,
                                                device=dsinks.device)
    _library.library().backward(dout, q, k, v, out, lse, dq, dk, dv, params, written)
    if not direct:
        dsinks.copy_(written)
    if modes.get_mode().verify > 0:
        modes.verify_backward(dout, q, k, v, dq, dk, dv, params, dsinks)
    return dq, dk, dv


# -- op registration ------------------------------------------------------------------------------

# With the native ops (libfa4_torch.so) loaded, torch.ops.fa4cpp.* are theirs and the functions
# below register as fa4cpp::<name>_py: the Python implementation they hand calls to (refusals,
# errors, the modes). Without them, the functions below are torch.ops.fa4cpp.* themselves.
_NATIVE = _library.native()[0]


def native_ops():
    """(True, the library's path) when C++ ops (libfa4_torch.so) serve torch.ops.fa4cpp.*,
    else (False, why not): the package's Python implementation serves them then."""
    return _library.native()


@contextlib.contextmanager
def python_path():
    """Within the block, the native ops hand every call to the Python implementation (as they
    do while a mode is on): for comparing the two paths, or for code that replaces support() or
    the c_abi calls. No effect without the native ops."""
    previous = _library.use_python_path(True)
    try:
        yield
    finally:
        _library.use_python_path(previous)


def _name(op):
    return "fa4cpp::%s_py" % op if _NATIVE else "fa4cpp::" + op


# A fragment of the namespace for kernels registered beside torch.library.custom_op's.
_FRAGMENT = torch.library.Library("fa4cpp", "FRAGMENT")


def _plain_write(op):
    """For an op that writes an optional trailing argument (the backward ops' dsinks): the
    ADInplaceOrView key falls through. custom_op's kernel there bumps the written argument's
    version counter by its position among the call's arguments, which a call that leaves it at
    its default does not pass (an IndexError); the native ops leave that counter alone as well
    (dsinks is a buffer the caller has just made)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch notes the replaced kernel
        _FRAGMENT.impl(_name(op).split("::")[1], torch.library.fallthrough_kernel,
                       "ADInplaceOrView", allow_override=True)


def _fake(python_op, op):
    """Registers fn as the fake (shape) kernel of the Python op and of the native one."""
    def register(fn):
        python_op.register_fake(fn)
        if _NATIVE:
            torch.library.register_fake("fa4cpp::" + op)(fn)
        return fn
    return register


# -- fixed-length ops -----------------------------------------------------------------------------

def _fixed_params(q, softmax_scale, causal, window_left, window_right, softcap, deterministic,
                  descales, alibi_slopes=None, sinks=None):
    return Params(softmax_scale, causal, window_left, window_right, softcap, deterministic,
                  fp8=_fp8(q, descales), alibi_slopes=alibi_slopes, sinks=sinks)


def _variant_kwargs(alibi_slopes, sinks):
    """The score variants' op arguments: passed only when given, so that calls without them keep
    the ops' shorter argument lists."""
    kwargs = {}
    if alibi_slopes is not None:
        kwargs["alibi_slopes"] = alibi_slopes
    if sinks is not None:
        kwargs["sinks"] = sinks
    return kwargs


@torch.library.custom_op(_name("fwd"), mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, deterministic: bool = False,
        q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
        v_descale: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, _fixed_params(q, softmax_scale, causal, window_left, window_right,
                                           softcap, deterministic,
                                           (q_descale, k_descale, v_descale), alibi_slopes,
                                           sinks))


@_fake(fwd, "fwd")
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
              deterministic=False, q_descale=None, k_descale=None, v_descale=None,
              alibi_slopes=None, sinks=None):
    params = _fixed_params(q, softmax_scale, causal, window_left, window_right, softcap, False,
                           (q_descale, k_descale, v_descale), alibi_slopes, sinks)
    _check(q, k, v, params)
    out_shape, lse_shape = _out_shapes(q, v, params)
    return (q.new_empty(out_shape, dtype=_out_dtype(q, params)),
            q.new_empty(lse_shape, dtype=torch.float32))


@torch.library.custom_op(_name("bwd"), mutates_args=("dsinks",))
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool, alibi_slopes: Optional[Tensor] = None,
        sinks: Optional[Tensor] = None,
        dsinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse,
                     Params(softmax_scale, causal, window_left, window_right, softcap,
                            deterministic, alibi_slopes=alibi_slopes, sinks=sinks),
                     dsinks=dsinks)


@_fake(bwd, "bwd")
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
              deterministic, alibi_slopes=None, sinks=None, dsinks=None):
    params = Params(softmax_scale, causal, window_left, window_right, softcap,
                    alibi_slopes=alibi_slopes, sinks=sinks)
    _check(q, k, v, params)
    _refuse_fp8_backward(q)
    _check_grads_inputs(dout, out, lse, q, v, params)
    _check_dsinks(dsinks, params, q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_plain_write("bwd")

# Where fwd's and varlen_fwd's score variants sit among their inputs.
_FWD_VARIANTS = 12
_VARLEN_FWD_VARIANTS = 17


def _save_variants(ctx, inputs, first):
    """The score variants of a forward's inputs (None past a shorter call's arguments), for the
    backward: the slopes and the sinks as saved tensors, which input the sinks are."""
    alibi_slopes, sinks = (tuple(inputs[first:first + 2]) + (None, None))[:2]
    ctx.sinks_input = first + 1
    return alibi_slopes, sinks


def _sink_grad(ctx, sinks):
    """A fresh fp32 buffer for the sinks' gradient when autograd wants it, else None."""
    if sinks is None or not ctx.needs_input_grad[ctx.sinks_input]:
        return None
    return torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)


def _gradients(ctx, dq, dk, dv, dsinks):
    grads = [dq, dk, dv] + [None] * (ctx.inputs - 3)
    if dsinks is not None:
        grads[ctx.sinks_input] = dsinks
    return tuple(grads)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap = inputs[:8]
    deterministic = inputs[8] if len(inputs) > 8 else False
    alibi_slopes, sinks = _save_variants(ctx, inputs, _FWD_VARIANTS)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
    ctx.scalars = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    ctx.inputs = len(inputs)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
    dsinks = _sink_grad(ctx, sinks)
    # FP8 inputs: bwd refuses them with its error. The slopes and descales have no gradient.
    dq, dk, dv = torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *ctx.scalars,
                                      **_variant_kwargs(alibi_slopes, sinks),
                                      **({} if dsinks is None else {"dsinks": dsinks}))
    return _gradients(ctx, dq, dk, dv, dsinks)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# -- variable-length ops --------------------------------------------------------------------------

def _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                   softmax_scale, causal, window_left, window_right, softcap, deterministic,
                   fp8=None, alibi_slopes=None, sinks=None):
    return Params(softmax_scale, causal, window_left, window_right, softcap, deterministic,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, fp8=fp8,
                  alibi_slopes=alibi_slopes, sinks=sinks)


@torch.library.custom_op(_name("varlen_fwd"), mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor],
               softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool = False, q_descale: Optional[Tensor] = None,
               k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
               alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, seqused_k, softmax_scale, causal,
                                            window_left, window_right, softcap, deterministic,
                                            _fp8(q, (q_descale, k_descale, v_descale)),
                                            alibi_slopes, sinks))


@_fake(varlen_fwd, "varlen_fwd")
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                     softmax_scale, causal, window_left, window_right, softcap,
                     deterministic=False, q_descale=None, k_descale=None, v_descale=None,
                     alibi_slopes=None, sinks=None):
    params = _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                            softmax_scale, causal, window_left, window_right, softcap, False,
                            _fp8(q, (q_descale, k_descale, v_descale)), alibi_slopes, sinks)
    _check(q, k, v, params)
    out_shape, lse_shape = _out_shapes(q, v, params)
    return (q.new_empty(out_shape, dtype=_out_dtype(q, params)),
            q.new_empty(lse_shape, dtype=torch.float32))


@torch.library.custom_op(_name("varlen_bwd"), mutates_args=("dsinks",))
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               seqused_k: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
               window_right: int, softcap: float, deterministic: bool,
               alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
               dsinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, _varlen_params(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
        window_left, window_right, softcap, deterministic, alibi_slopes=alibi_slopes,
        sinks=sinks), dsinks=dsinks)


@_fake(varlen_bwd, "varlen_bwd")
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, seqused_k, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic, alibi_slopes=None, sinks=None, dsinks=None):
    params = _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                            softmax_scale, causal, window_left, window_right, softcap, False,
                            alibi_slopes=alibi_slopes, sinks=sinks)
    _check(q, k, v, params)
    _refuse_fp8_backward(q)
    _check_grads_inputs(dout, out, lse, q, v, params)
    _check_dsinks(dsinks, params, q)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_plain_write("varlen_bwd")


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k = inputs[:8]
    softmax_scale, causal, window_left, window_right, softcap = inputs[8:13]
    deterministic = inputs[13] if len(inputs) > 13 else False
    alibi_slopes, sinks = _save_variants(ctx, inputs, _VARLEN_FWD_VARIANTS)
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
                          sinks)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                   softcap, deterministic)
    ctx.inputs = len(inputs)
    ctx.mark_non_differentiable(lse)


def _varlen_fwd_backward(ctx, dout, _dlse):
    (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, alibi_slopes,
     sinks) = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, *rest = ctx.scalars
    dsinks = _sink_grad(ctx, sinks)
    dq, dk, dv = torch.ops.fa4cpp.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, seqused_k, *rest,
                                             **_variant_kwargs(alibi_slopes, sinks),
                                             **({} if dsinks is None else {"dsinks": dsinks}))
    return _gradients(ctx, dq, dk, dv, dsinks)


varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)


# -- KV cache op ----------------------------------------------------------------------------------

def _check_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                   max_seqlen_q, descales=(None, None, None), variants=(None, None)):
    """Shapes, dtypes and devices of a KV-cache call (the library checks sizes and contents)."""
    varlen = cu_seqlens_q is not None
    if q.dim() != (3 if varlen else 4):
        _fail("q has shape %s; expected %s", tuple(q.shape),
              "(total_q, heads, head_dim) with cu_seqlens_q" if varlen
              else "(batch, seqlen_q, heads, head_dim)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            _fail("%s has shape %s; expected (batch_cache, seqlen_cache, heads_k, head_dim), or "
                  "(num_pages, page_size, heads_k, head_dim) with page_table", name,
                  tuple(t.shape))
        if t.dtype != q.dtype or t.device != q.device:
            _fail("%s must be a %s tensor on %s like q (got %s on %s)", name, q.dtype, q.device,
                  t.dtype, t.device)
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            _fail("%s's last dimension must be contiguous (the cache is read and written in "
                  "place)", name)
    if tuple(k_cache.shape[:3]) != tuple(v_cache.shape[:3]):
        _fail("k_cache %s and v_cache %s must have the same rows and heads", tuple(k_cache.shape),
              tuple(v_cache.shape))
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-2] % k_cache.shape[-2] != 0:
        _fail("q %s and k_cache %s: one head dim, and q's heads a multiple of the cache's",
              tuple(q.shape), tuple(k_cache.shape))
    batch = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
    if (k_new is None) != (v_new is None):
        _fail("k and v (the new rows) go together: give both or neither")
    if k_new is not None:
        rank = 3 if cu_seqlens_k_new is not None else 4
        # An e4m3 cache also takes 16-bit rows (both of one dtype), quantised on write.
        new_dtype = k_new.dtype if q.dtype in _FP8 and k_new.dtype in c_abi.FP8_OUT_DTYPES \
            else q.dtype
        for name, t, cache in (("k", k_new, k_cache), ("v", v_new, v_cache)):
            if (t.dim() != rank or t.shape[-2:] != cache.shape[-2:] or t.dtype != new_dtype
                    or t.device != q.device or (rank == 4 and t.shape[0] != batch)):
                _fail("%s has shape %s %s; expected %s of %s on %s", name, tuple(t.shape),
                      t.dtype, "(total_new, heads_k, head_dim) with cu_seqlens_k_new"
                      if rank == 3 else "(batch, seqlen_new, heads_k, head_dim)",
                      "float8_e4m3fn (or both bfloat16 / both float16, quantised on write)"
                      if q.dtype in _FP8 else q.dtype, q.device)
    elif cu_seqlens_k_new is not None:
        _fail("cu_seqlens_k_new is given without k and v")
    if (rotary_cos is None) != (rotary_sin is None):
        _fail("rotary_cos and rotary_sin go together: give both or neither")
    if rotary_cos is not None:
        if k_new is None:
            _fail("rotary_cos / rotary_sin need k and v: the rotary embedding applies to the new "
                  "keys and the queries")
        # The tables are in the output's dtype (q's, unless FP8).
        table_dtype = output_dtype(q, k_new)
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if (t.dim() != 2 or t.shape != rotary_cos.shape or t.dtype != table_dtype
                    or t.device != q.device):
                _fail("%s must be a (seqlen_ro, rotary_dim / 2) %s tensor on %s like rotary_cos "
                      "(got %s %s)", name, table_dtype, q.device, t.dtype, tuple(t.shape))
    for name, t, n in (("cache_seqlens", cache_seqlens, batch),
                       ("cache_batch_idx", cache_batch_idx, batch),
                       ("cache_leftpad", cache_leftpad, batch),
                       ("cu_seqlens_q", cu_seqlens_q, batch + 1),
                       ("cu_seqlens_k_new", cu_seqlens_k_new, batch + 1)):
        if t is not None:
            _check_index(name, t, n, q.device)
    if page_table is not None and (page_table.dim() != 2 or page_table.dtype != torch.int32
                                   or page_table.device != q.device):
        _fail("page_table must be a 2-D int32 tensor (batch_cache, max_pages) on %s (got %s %s "
              "on %s)", q.device, page_table.dtype, tuple(page_table.shape), page_table.device)
    if varlen and max_seqlen_q < 0:
        _fail("max_seqlen_q is %d; it must be >= 0", max_seqlen_q)
    _check_fp8(q, Params(fp8=_fp8(q, descales, k_new)), batch, k_cache.shape[-2])
    _check_variants(q, *variants, batch)


def _kvcache_params(q, k_new, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad,
                    page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal,
                    window_left, window_right, softcap, rotary_interleaved, num_splits,
                    descales=(None, None, None), variants=(None, None)):
    def contiguous(t):
        return t if t is None or t.is_contiguous() else t.contiguous()
    appends = k_new is not None
    kv = c_abi.KvCache(
        page_table=None if page_table is None else (
            page_table if page_table.stride(-1) == 1 else page_table.contiguous()),
        cache_batch_idx=contiguous(cache_batch_idx), cache_leftpad=contiguous(cache_leftpad),
        cu_seqlens_new=contiguous(cu_seqlens_k_new),
        # Varlen appends: their total bounds every sequence's rows (no device read for the max).
        seqlen_new=(k_new.shape[0] if cu_seqlens_k_new is not None else k_new.shape[1])
        if appends else 0,
        total_new=k_new.shape[0] if appends and cu_seqlens_k_new is not None else 0,
        rotary_dim=2 * rotary_cos.shape[1] if rotary_cos is not None else 0,
        rotary_interleaved=bool(rotary_interleaved) if rotary_cos is not None else False,
        rotary_seqlen=rotary_cos.shape[0] if rotary_cos is not None else 0)
    alibi_slopes, sinks = variants
    return Params(softmax_scale, causal, window_left, window_right, softcap, False,
                  contiguous(cu_seqlens_q), None, int(max_seqlen_q), 0, contiguous(cache_seqlens),
                  kv, int(num_splits), _fp8(q, descales, k_new), alibi_slopes, contiguous(sinks))


def _kvcache_key_lens(q, k_cache, k_new, params):
    """Each sequence's cache length before and after the appends (the reference's key ends)."""
    kv = params.kv
    batch = (params.cu_seqlens_q.shape[0] - 1) if params.varlen else q.shape[0]
    lens = params.seqused_k
    if lens is None:  # a full cache
        capacity = (kv.page_table.shape[1] * k_cache.shape[1] if kv.page_table is not None
                    else k_cache.shape[1])
        lens = torch.full((batch,), capacity, dtype=torch.int32, device=k_cache.device)
    if k_new is None:
        return lens, lens
    if kv.cu_seqlens_new is not None:
        added = kv.cu_seqlens_new[1:] - kv.cu_seqlens_new[:-1]
    else:
        added = torch.full_like(lens, k_new.shape[1])
    return lens, lens + added


def _reference_kvcache(q, k_cache, v_cache, k_new, v_new, rotary, params, append):
    kv = params.kv
    before, after = _kvcache_key_lens(q, k_cache, k_new, params)
    cos, sin = rotary if rotary is not None else (None, None)
    descales = params.descale_kwargs()
    if append and k_new is not None:
        reference.kvcache_append(k_cache, v_cache, k_new, v_new, before,
                                 page_table=kv.page_table, cache_batch_idx=kv.cache_batch_idx,
                                 cu_seqlens_new=kv.cu_seqlens_new, rotary_cos=cos,
                                 rotary_sin=sin, rotary_interleaved=kv.rotary_interleaved,
                                 k_descale=descales.get("k_descale"),
                                 v_descale=descales.get("v_descale"))
    return reference.kvcache_attention(
        q, k_cache, v_cache, after, cache_seqlens=before, page_table=kv.page_table,
        cache_batch_idx=kv.cache_batch_idx, cache_leftpad=kv.cache_leftpad,
        cu_seqlens_q=params.cu_seqlens_q, rotary_cos=cos, rotary_sin=sin,
        rotary_interleaved=kv.rotary_interleaved, softmax_scale=params.softmax_scale,
        causal=params.causal, window=(params.window_left, params.window_right),
        softcap=params.softcap, alibi_slopes=params.alibi_slopes, sinks=params.sinks, **descales)


def _forward_kvcache(q, k_cache, v_cache, k_new, v_new, rotary, params):
    q = _last_dim_contiguous(q)
    if k_new is not None:
        k_new, v_new = _last_dim_contiguous(k_new), _last_dim_contiguous(v_new)
    if rotary is not None:
        rotary = tuple(t if t.stride(-1) == 1 else t.contiguous() for t in rotary)
        if rotary[0].shape[0] > 1 and rotary[0].stride(0) != rotary[1].stride(0):
            rotary = tuple(t.contiguous() for t in rotary)  # the library takes one row stride
    code = c_abi.backend_of(q.device)
    reason = ("tensors on device %s: the library runs on cpu and cuda tensors" % q.device
              if code is None else None)
    if reason is None:
        status, message = _library.library().can_implement(c_abi.PASS_FORWARD, q, k_cache,
                                                           v_cache, params, code)
        reason = None if status == c_abi.SUCCESS else message
    if reason is not None:
        modes.unsupported("forward", reason)
        out, lse = _reference_kvcache(q, k_cache, v_cache, k_new, v_new, rotary, params, True)
        return out.to(_out_dtype(q, params)), lse.to(torch.float32)
    out_shape, lse_shape = _kvcache_shapes(q, v_cache, params.cu_seqlens_q)
    out = q.new_empty(out_shape, dtype=_out_dtype(q, params))
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    _library.library().forward(q, k_cache, v_cache, out, lse, params, k_new, v_new, rotary)
    if modes.get_mode().verify > 0:
        ref_out, ref_lse = _reference_kvcache(q, k_cache, v_cache, k_new, v_new, rotary, params,
                                              False)
        modes.verify_kvcache(q, v_cache, out, lse, ref_out, ref_lse, params.fp8)
    return out, lse


def _kvcache_call(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                  cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                  max_seqlen_q, softmax_scale, causal, window_left, window_right, softcap,
                  rotary_interleaved, num_splits, descales, variants):
    _check_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                   max_seqlen_q, descales, variants)
    params = _kvcache_params(q, k_new, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad,
                             page_table, cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q,
                             softmax_scale, causal, window_left, window_right, softcap,
                             rotary_interleaved, num_splits, descales, variants)
    _check_params(params)
    rotary = (rotary_cos, rotary_sin) if rotary_cos is not None else None
    return _forward_kvcache(q, k_cache, v_cache, k_new, v_new, rotary, params)


def _kvcache_shapes(q, v_cache, cu_seqlens_q):
    out = tuple(q.shape[:-1]) + (v_cache.shape[-1],)
    lse = ((q.shape[1], q.shape[0]) if cu_seqlens_q is not None
           else (q.shape[0], q.shape[2], q.shape[1]))
    return out, lse


def _check_out(out, q, v_cache, cu_seqlens_q, k_new=None):
    shape = _kvcache_shapes(q, v_cache, cu_seqlens_q)[0]
    dtype = output_dtype(q, k_new)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != q.device:
        _fail("out must be a %s tensor of shape %s on %s (got %s %s on %s)", dtype, shape,
              q.device, out.dtype, tuple(out.shape), out.device)


@torch.library.custom_op(_name("fwd_kvcache"), mutates_args=("k_cache", "v_cache"))
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                v_new: Optional[Tensor], rotary_cos: Optional[Tensor],
                rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                page_table: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                cu_seqlens_k_new: Optional[Tensor], max_seqlen_q: int, softmax_scale: float,
                causal: bool, window_left: int, window_right: int, softcap: float,
                rotary_interleaved: bool, num_splits: int, q_descale: Optional[Tensor] = None,
                k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
                alibi_slopes: Optional[Tensor] = None,
                sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Attention of q over a KV cache, the new rows k_new / v_new appended to it first (in place:
    the op mutates k_cache and v_cache), flash_attn_with_kvcache's semantics (docs/semantics.md).
    Forward only."""
    return _kvcache_call(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                         cache_seqlens, cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q,
                         cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, window_left,
                         window_right, softcap, rotary_interleaved, num_splits,
                         (q_descale, k_descale, v_descale), (alibi_slopes, sinks))


@_fake(fwd_kvcache, "fwd_kvcache")
def _fwd_kvcache_fake(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                      cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                      max_seqlen_q, softmax_scale, causal, window_left, window_right, softcap,
                      rotary_interleaved, num_splits, q_descale=None, k_descale=None,
                      v_descale=None, alibi_slopes=None, sinks=None):
    _check_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                   max_seqlen_q, (q_descale, k_descale, v_descale), (alibi_slopes, sinks))
    out, lse = _kvcache_shapes(q, v_cache, cu_seqlens_q)
    return (q.new_empty(out, dtype=output_dtype(q, k_new)),
            q.new_empty(lse, dtype=torch.float32))


@torch.library.custom_op(_name("fwd_kvcache_out"), mutates_args=("k_cache", "v_cache", "out"))
def fwd_kvcache_out(q: Tensor, k_cache: Tensor, v_cache: Tensor, k_new: Optional[Tensor],
                    v_new: Optional[Tensor], rotary_cos: Optional[Tensor],
                    rotary_sin: Optional[Tensor], cache_seqlens: Optional[Tensor],
                    cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor],
                    page_table: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
                    cu_seqlens_k_new: Optional[Tensor], max_seqlen_q: int, softmax_scale: float,
                    causal: bool, window_left: int, window_right: int, softcap: float,
                    rotary_interleaved: bool, num_splits: int, out: Tensor,
                    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                    v_descale: Optional[Tensor] = None, alibi_slopes: Optional[Tensor] = None,
                    sinks: Optional[Tensor] = None) -> Tensor:
    """fwd_kvcache writing its output into `out` (the caller's tensor, q's shape with the cache's
    head dim, any strides, the output's dtype); returns lse. The native op writes out directly
    (through a copy only when its last dimension is not contiguous); this implementation copies.
    The descales and the score variants follow `out`, so that the arguments before it keep their
    places."""
    _check_out(out, q, v_cache, cu_seqlens_q, k_new)
    result, lse = _kvcache_call(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                                cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, softmax_scale,
                                causal, window_left, window_right, softcap, rotary_interleaved,
                                num_splits, (q_descale, k_descale, v_descale),
                                (alibi_slopes, sinks))
    out.copy_(result)
    return lse


@_fake(fwd_kvcache_out, "fwd_kvcache_out")
def _fwd_kvcache_out_fake(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                          cache_seqlens, cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q,
                          cu_seqlens_k_new, max_seqlen_q, softmax_scale, causal, window_left,
                          window_right, softcap, rotary_interleaved, num_splits, out,
                          q_descale=None, k_descale=None, v_descale=None, alibi_slopes=None,
                          sinks=None):
    _check_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin, cache_seqlens,
                   cache_batch_idx, cache_leftpad, page_table, cu_seqlens_q, cu_seqlens_k_new,
                   max_seqlen_q, (q_descale, k_descale, v_descale), (alibi_slopes, sinks))
    _check_out(out, q, v_cache, cu_seqlens_q, k_new)
    return q.new_empty(_kvcache_shapes(q, v_cache, cu_seqlens_q)[1], dtype=torch.float32)


# -- the native ops against this package's ---------------------------------------------------------

_OPS = ("fwd", "bwd", "varlen_fwd", "varlen_bwd", "fwd_kvcache", "fwd_kvcache_out")


def schema_mismatch(native_schema, python_schema):
    """How two op schemas differ in their arguments (names and types) or returns; None when they
    do not. The names of the ops themselves are not compared."""
    def shape(schema):
        return ([(a.name, str(a.type)) for a in schema.arguments],
                [str(r.type) for r in schema.returns])
    native, python = shape(native_schema), shape(python_schema)
    if native == python:
        return None
    return "the native op takes %s and returns %s; this package's takes %s and returns %s" % (
        native[0], native[1], python[0], python[1])


def _check_native_schemas():
    """The native ops hand calls to the Python implementation (modes, errors) with their own
    arguments: a libfa4_torch.so built from other sources than this package would pass the wrong
    ones and crash the process. Refuse it at import instead."""
    for op in _OPS:
        try:
            native = getattr(torch.ops.fa4cpp, op).default._schema
        except (AttributeError, RuntimeError):
            native, why = None, "the native library does not register it"
        if native is not None:
            why = schema_mismatch(native, getattr(torch.ops.fa4cpp, op + "_py").default._schema)
        if why is not None:
            raise ImportError("%s does not match this fa4cpp package (torch.ops.fa4cpp.%s: %s): "
                              "rebuild it from the same sources (pip install "
                              "--no-build-isolation .)" % (_library.native()[1], op, why))


if _NATIVE:
    _check_native_schemas()
