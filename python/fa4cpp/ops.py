"""The torch.library custom ops of fa4cpp (namespace "fa4cpp"), their fake (shape) implementations
and autograd formulas, and support(): whether the library runs a problem.

    torch.ops.fa4cpp.fwd(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         deterministic=False) -> (out, lse)
        q (b, sq, hq, d), k (b, sk, hkv, d), v (b, sk, hkv, dv); out (b, sq, hq, dv) in q's
        dtype, lse (b, hq, sq) fp32. softmax_scale 0 = 1/sqrt(d); window sides -1 = unbounded;
        softcap 0 = off. `deterministic` only travels to the backward autograd runs.
    torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic) -> (dq, dk, dv)
    torch.ops.fa4cpp.varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_k, softmax_scale, causal, window_left, window_right,
                                softcap, deterministic=False) -> (out, lse)
        q (total_q, hq, d), k/v (total_k, hkv, d/dv), cu_seqlens_* int32 (batch + 1),
        seqused_k int32 (batch) or None; out (total_q, hq, dv), lse (hq, total_q).
    torch.ops.fa4cpp.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
                                window_left, window_right, softcap, deterministic) -> (dq, dk, dv)

fwd's autograd formula calls bwd (varlen_fwd's calls varlen_bwd); lse is not differentiable.
Tensors may have any strides (the library takes them); one whose last dimension is not contiguous
is copied. CUDA tensors run on the sm90 backend on torch's current stream, CPU tensors on the CPU
backend. A problem the library refuses raises Fa4Error with its reason, or runs on
fa4cpp.reference in fallback mode (fa4cpp.modes); verify mode checks results after the call."""
import ctypes
import dataclasses
import math
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
    else:
        _check_fixed(q, k, v)


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
            seqused_k=None, backend=None):
    """None when the library's can_implement accepts the problem for pass_ ("fwd" or "bwd") on the
    backend the tensors' device selects (cuda -> sm90, cpu -> cpu; `backend` "cpu" / "sm90"
    overrides it), else the reason. Reads shapes, dtypes and devices only: fake and meta tensors
    are fine. Inputs fa4cpp cannot take at all (mismatched shapes, a dtype the library lacks, a
    device it does not run on) are refused with a reason too, never raised."""
    if pass_ not in _PASSES:
        raise ValueError("fa4cpp.ops.support: pass_ must be 'fwd' or 'bwd', not %r" % (pass_,))
    params = Params(softmax_scale=float(softmax_scale), causal=bool(causal),
                    window_left=int(window[0]), window_right=int(window[1]),
                    softcap=float(softcap), cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                    max_seqlen_q=int(max_seqlen_q or 0), max_seqlen_k=int(max_seqlen_k or 0),
                    seqused_k=seqused_k)
    try:
        _check(q, k, v, params)
    except ValueError as e:
        return str(e)
    return _checked_support(pass_, q, k, v, params, backend)


def _checked_support(pass_, q, k, v, params, backend=None):
    """support() past its input checks: the tail the ops run, having checked the inputs already."""
    if q.dtype not in c_abi.DTYPES:
        return "dtype %s: the library takes bfloat16, float16 or float32" % q.dtype
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
                   seqused_k=params.seqused_k)


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
    """cu_seqlens / seqused_k contiguous (the library reads them as plain int32 arrays)."""
    def fix(t):
        return t if t is None or t.is_contiguous() else t.contiguous()
    if all(t is None or t.is_contiguous()
           for t in (params.cu_seqlens_q, params.cu_seqlens_k, params.seqused_k)):
        return params  # nothing to copy (always so without varlen): dataclasses.replace is slow
    return dataclasses.replace(params, cu_seqlens_q=fix(params.cu_seqlens_q),
                               cu_seqlens_k=fix(params.cu_seqlens_k),
                               seqused_k=fix(params.seqused_k))


def _reference_kwargs(params):
    return dict(softmax_scale=params.softmax_scale, causal=params.causal,
                window=(params.window_left, params.window_right), softcap=params.softcap,
                seqused_k=params.seqused_k)


def _reference_forward(q, k, v, params):
    with torch.no_grad():
        if params.varlen:
            out, lse = reference.varlen_attention(q, k, v, params.cu_seqlens_q,
                                                  params.cu_seqlens_k, **_reference_kwargs(params))
        else:
            out, lse = reference.attention(q, k, v, **_reference_kwargs(params))
    return out.to(q.dtype), lse.to(torch.float32)


def _reference_backward(dout, q, k, v, params):
    if params.varlen:
        grads = reference.varlen_attention_backward(dout, q, k, v, params.cu_seqlens_q,
                                                    params.cu_seqlens_k,
                                                    **_reference_kwargs(params))
    else:
        grads = reference.attention_backward(dout, q, k, v, **_reference_kwargs(params))
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
    out = _like(out_like, torch.Size(out_shape), q.dtype, q.device)
    if out is None:
        out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    _library.library().forward(q, k, v, out, lse, params)
    if modes.get_mode().verify > 0:
        modes.verify_forward(q, k, v, out, lse, params)
    return out, lse


def _backward(dout, q, k, v, out, lse, params, grads_like=(None, None, None)):
    _check(q, k, v, params)
    _check_grads_inputs(dout, out, lse, q, v, params)
    params = _index_arrays(params)
    dout, q, k, v, out, lse = (_last_dim_contiguous(t) for t in (dout, q, k, v, out, lse))
    reason = _support("bwd", q, k, v, params)
    if reason is not None:
        modes.unsupported("backward", reason)
        return _reference_backward(dout, q, k, v, params)
    dout, q, k, v, out = _device_ready((dout, q, k, v, out))
    # Varlen rows outside every sequence are not written by the library: their gradient is 0.
    alloc = torch.zeros if params.varlen else torch.empty
    def grad_for(t, like):
        g = None if params.varlen else _like(like, t.shape, t.dtype, t.device)
        return alloc(t.shape, dtype=t.dtype, device=t.device) if g is None else g
    dq, dk, dv = (grad_for(t, like) for t, like in zip((q, k, v), grads_like))
    _library.library().backward(dout, q, k, v, out, lse, dq, dk, dv, params)
    if modes.get_mode().verify > 0:
        modes.verify_backward(dout, q, k, v, dq, dk, dv, params)
    return dq, dk, dv


# -- fixed-length ops -----------------------------------------------------------------------------

@torch.library.custom_op("fa4cpp::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, Params(softmax_scale, causal, window_left, window_right, softcap,
                                    deterministic))


@fwd.register_fake
def _fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
              deterministic=False):
    params = Params(softmax_scale, causal, window_left, window_right, softcap)
    _check(q, k, v, params)
    out_shape, lse_shape = _out_shapes(q, v, params)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("fa4cpp::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
        softmax_scale: float, causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, Params(softmax_scale, causal, window_left,
                                                     window_right, softcap, deterministic))


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
              deterministic):
    params = Params(softmax_scale, causal, window_left, window_right, softcap)
    _check(q, k, v, params)
    _check_grads_inputs(dout, out, lse, q, v, params)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, window_left, window_right, softcap = inputs[:8]
    deterministic = inputs[8] if len(inputs) > 8 else False
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scalars = (softmax_scale, causal, window_left, window_right, softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *ctx.scalars)
    return dq, dk, dv, None, None, None, None, None, None


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# -- variable-length ops --------------------------------------------------------------------------

def _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                   softmax_scale, causal, window_left, window_right, softcap, deterministic):
    return Params(softmax_scale, causal, window_left, window_right, softcap, deterministic,
                  cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)


@torch.library.custom_op("fa4cpp::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, seqused_k: Optional[Tensor],
               softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, seqused_k, softmax_scale, causal,
                                            window_left, window_right, softcap, deterministic))


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                     softmax_scale, causal, window_left, window_right, softcap,
                     deterministic=False):
    params = _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                            softmax_scale, causal, window_left, window_right, softcap, False)
    _check(q, k, v, params)
    out_shape, lse_shape = _out_shapes(q, v, params)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op("fa4cpp::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               seqused_k: Optional[Tensor], softmax_scale: float, causal: bool, window_left: int,
               window_right: int, softcap: float,
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(dout, q, k, v, out, lse, _varlen_params(
        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal,
        window_left, window_right, softcap, deterministic))


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, seqused_k, softmax_scale, causal, window_left, window_right,
                     softcap, deterministic):
    params = _varlen_params(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                            softmax_scale, causal, window_left, window_right, softcap, False)
    _check(q, k, v, params)
    _check_grads_inputs(dout, out, lse, q, v, params)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_fwd_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k = inputs[:8]
    softmax_scale, causal, window_left, window_right, softcap = inputs[8:13]
    deterministic = inputs[13] if len(inputs) > 13 else False
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k)
    ctx.scalars = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                   softcap, deterministic)
    ctx.mark_non_differentiable(lse)


def _varlen_fwd_backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k = ctx.saved_tensors
    max_seqlen_q, max_seqlen_k, *rest = ctx.scalars
    dq, dk, dv = torch.ops.fa4cpp.varlen_bwd(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             max_seqlen_q, max_seqlen_k, seqused_k, *rest)
    return (dq, dk, dv) + (None,) * 11


varlen_fwd.register_autograd(_varlen_fwd_backward, setup_context=_varlen_fwd_setup_context)
