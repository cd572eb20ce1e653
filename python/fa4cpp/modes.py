"""Fallback and verify modes, both off by default.

fallback: a problem the library refuses (fa4cpp.ops.support() gives a reason: a head dim or dtype
    without a kernel, the sm90 backward that does not exist yet, a CPU-only library given CUDA
    tensors...) runs on fa4cpp.reference instead — plain torch ops in fp32, on the tensors' device,
    results cast to the inputs' dtype — with one FallbackWarning per distinct reason per process.
    With fallback off such a call raises Fa4Error carrying the library's reason.
verify: after each library call, a sample of query rows (every row when the problem is small, or
    when the fraction is 1) is recomputed with fa4cpp.reference and compared; a mismatch raises
    VerificationError with the error, the tolerance and where. The forward checks O and LSE; the
    backward checks dQ of the sampled rows, and dK, dV when every row is checked (they sum over
    all rows). It costs a reference computation and a device synchronisation per call: a
    debugging mode.

Switches: the environment variables FA4CPP_FALLBACK=1 and FA4CPP_VERIFY=<fraction in (0, 1]>
(1 = every row), read when fa4cpp is imported; fa4cpp.set_mode(fallback=..., verify=...) at run
time, or `with fa4cpp.mode(fallback=True): ...` for a block. Both act inside the custom ops (while
either is on, the native ops hand every call to the package's Python implementation), so they
apply to eager calls and to torch.compile'd graphs alike (the op body is opaque to the compiler).

Verify tolerances, as the maximum absolute error allowed:
    O:    c · max|V|, c = 2^-6 (bf16), 2^-9 (fp16), 2^-16 (fp32), 2^-3 (float8_e4m3fn, V
          dequantized: times its descales). O is a convex combination of V's rows; a kernel that
          rounds P to the input dtype before P·V and rounds O once errs by at most about 2 units
          of roundoff (2^-8 bf16, 2^-11 fp16) times max|V|: c leaves a factor of 2 above that.
          fp32 allows for summation-order differences over long rows. An FP8 kernel rounds P to
          e4m3 (3 mantissa bits: up to 2^-4 of each weight) and O to bf16 / fp16: c leaves a
          factor of 2 above the 2^-4 of P. The reference computes FP8 problems on the
          dequantized inputs (fa4cpp.reference).
    LSE:  2^-10 · (1 + |LSE|): fp32 in both, from the same scores; rows that see no key must be
          +inf in both (the head's sink with sinks).
    dQ, dK, dV: c · m elementwise, m the same gradient summed over absolute values
          (reference.attention_backward(magnitudes=True): |dQ| ≤ |scale|·(P∘(|dO||V|ᵀ +
          rowsum|dO∘O|))·|K|, ...), c = 2^-5 (bf16), 2^-8 (fp16), 2^-14 (fp32). A gradient's
          rounding error scales with the size of its terms, not with its value: dQ cancels to
          about 0 where a row sees one key, and a bound relative to |dQ| would flag rounding
          there. Plus one subnormal spacing of the dtype (fp16 gradients below 2^-14 round to
          multiples of 2^-24). Measured on the CPU backend the error stays below c/8.
    dsinks: the same c times Σ over the head's rows of exp(sink − LSE)·rowsum|dO∘O| (its terms'
          magnitudes), checked when every row is.
These catch a wrong kernel (errors of the order of the values) and let rounding pass."""
import contextlib
import math
import os
import random
import threading
import warnings
from typing import NamedTuple

import torch

from . import _library, reference
from .c_abi import Fa4Error

FALLBACK_ENV = "FA4CPP_FALLBACK"
VERIFY_ENV = "FA4CPP_VERIFY"

OUT_TOLERANCE = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9, torch.float32: 2.0 ** -16,
                 torch.float8_e4m3fn: 2.0 ** -3}
LSE_TOLERANCE = 2.0 ** -10
GRAD_TOLERANCE = {torch.bfloat16: 2.0 ** -5, torch.float16: 2.0 ** -8, torch.float32: 2.0 ** -14}
# Problems with at most this many scores (batch·heads·rows·keys) are verified on every row.
SMALL_PROBLEM_SCORES = 1 << 22


class FallbackWarning(UserWarning):
    """A call ran on the PyTorch reference because the library refused it (fallback mode)."""


class VerificationError(RuntimeError):
    """Verify mode found a library result farther from the reference than the tolerance."""


class Mode(NamedTuple):
    fallback: bool
    verify: float  # fraction of query rows checked; 0 = off


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def _parse_fallback(text):
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("%s=%r: use 1 (on) or 0 (off)" % (FALLBACK_ENV, text))


def _check_verify(value, what):
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    fraction = float(value)
    if not 0.0 <= fraction <= 1.0 or math.isnan(fraction):
        raise ValueError("%s=%r: the fraction of query rows to check must be in [0, 1] "
                         "(0 = off, 1 = every row)" % (what, value))
    return fraction


def _parse_verify(text):
    value = text.strip().lower()
    if value in _FALSE:
        return 0.0
    if value in _TRUE:
        return 1.0
    try:
        number = float(value)
    except ValueError:
        raise ValueError("%s=%r: use a fraction of query rows in (0, 1], 1 = every row, 0 = off"
                         % (VERIFY_ENV, text)) from None
    return _check_verify(number, VERIFY_ENV)


_state = Mode(fallback=_parse_fallback(os.environ.get(FALLBACK_ENV, "")),
              verify=_parse_verify(os.environ.get(VERIFY_ENV, "")))
_library.note_modes(_state.fallback or _state.verify > 0)
_warned = set()
_warned_lock = threading.Lock()
# Which rows verify samples: its own generator, so that verify mode leaves torch's RNG untouched.
_rng = random.Random(0)


def get_mode():
    """The current Mode(fallback, verify)."""
    return _state


def set_mode(fallback=None, verify=None):
    """Switches fallback (bool) and/or verify (a fraction of query rows in [0, 1], or a bool);
    None leaves a switch as it is. Returns the previous Mode."""
    global _state
    previous = _state
    _state = Mode(fallback=previous.fallback if fallback is None else bool(fallback),
                  verify=previous.verify if verify is None else _check_verify(verify, "verify"))
    _library.note_modes(_state.fallback or _state.verify > 0)
    return previous


@contextlib.contextmanager
def mode(fallback=None, verify=None):
    """set_mode() for the duration of a with-block."""
    previous = set_mode(fallback=fallback, verify=verify)
    try:
        yield get_mode()
    finally:
        set_mode(fallback=previous.fallback, verify=previous.verify)


def unsupported(what, reason):
    """Called when the library refuses `what` ("forward" / "backward") for `reason`: returns when
    fallback mode is on (warning once per reason), raises Fa4Error otherwise."""
    if not _state.fallback:
        raise Fa4Error("fa4cpp cannot run this %s: %s (fallback mode, %s=1 or "
                       "fa4cpp.set_mode(fallback=True), runs such calls on the PyTorch reference)"
                       % (what, reason, FALLBACK_ENV))
    with _warned_lock:
        first = reason not in _warned
        _warned.add(reason)
    if first:
        warnings.warn("fa4cpp: the library cannot run this %s (%s); running it on the PyTorch "
                      "reference implementation instead (fallback mode)" % (what, reason),
                      FallbackWarning, stacklevel=3)


# -- verify --------------------------------------------------------------------------------------

def _sample(n_rows, scores):
    """Sorted query rows to check out of n_rows; every row when small or when verify is 1."""
    fraction = _state.verify
    if fraction >= 1.0 or scores <= SMALL_PROBLEM_SCORES or n_rows == 0:
        return list(range(n_rows))
    count = min(n_rows, max(1, math.ceil(fraction * n_rows)))
    return sorted(_rng.sample(range(n_rows), count))


def _where(index, names, rows):
    """'batch 0, query row 17, head 3, dim 5' for a flat index into a tensor whose sampled-row axis
    is named 'query row' or 'token row' (mapped back through rows)."""
    parts = []
    for name, i in zip(names, index):
        parts.append("%s %d" % (name, rows[i] if name.endswith(" row") else i))
    return ", ".join(parts)


def _compare(what, got, ref, tolerance, names, rows):
    got = got.float()
    ref = ref.float()
    # Equal infinities (LSE of rows that see no key) and NaN in both (NaN inputs propagate) match;
    # a NaN on one side only never does.
    same = ((torch.isinf(got) & torch.isinf(ref) & (torch.sign(got) == torch.sign(ref)))
            | (torch.isnan(got) & torch.isnan(ref)))
    err = torch.where(same, torch.zeros_like(ref), (got - ref).abs())
    err = torch.nan_to_num(err, nan=math.inf)
    tolerance = torch.as_tensor(tolerance, dtype=torch.float32, device=err.device).expand_as(err)
    excess = err - tolerance
    if excess.numel() == 0 or float(excess.max()) <= 0:
        return
    flat = int(excess.argmax())
    index = []
    for size in reversed(err.shape):
        index.append(flat % size)
        flat //= size
    index = tuple(reversed(index))
    raise VerificationError(
        "fa4cpp verify: %s differs from the reference by %.6g at %s (library %.6g, reference "
        "%.6g, tolerance %.6g; max error over the %d checked values %.6g)"
        % (what, float(err[index]), _where(index, names, rows), float(got[index]),
           float(ref[index]), float(tolerance[index]), err.numel(), float(err.max())))


def _varlen_rows(params, hq, n_keys):
    """Sampled token rows of a varlen problem, only rows inside a sequence (the library leaves
    the others unwritten)."""
    rows_in_sequences = int(params.cu_seqlens_q[-1])
    return _sample(rows_in_sequences, hq * rows_in_sequences * n_keys)


def _used_value_scale(v, params):
    """max|V| over the key rows the problem reads: rows beyond seqused_k, or outside every varlen
    sequence, may hold anything (an uninitialised cache)."""
    if params.varlen:
        ck = [int(x) for x in params.cu_seqlens_k.tolist()]
        used = None if params.seqused_k is None else [int(x) for x in params.seqused_k.tolist()]
        read = torch.zeros(v.shape[0], dtype=torch.bool, device=v.device)
        for b in range(len(ck) - 1):
            read[ck[b]:ck[b + 1] if used is None else ck[b] + used[b]] = True
        v = v[read]
    elif params.seqused_k is not None:
        used = [int(x) for x in params.seqused_k.tolist()]
        v = torch.cat([v[b, :n] for b, n in enumerate(used)]) if used else v[:0]
    if v.numel() == 0:
        return 0.0
    return float(torch.nan_to_num(v.detach().float().abs(), nan=0.0, posinf=0.0).max())


def verify_forward(q, k, v, out, lse, params):
    """Checks a library forward's out / lse on a sample of query rows; raises VerificationError."""
    kw = dict(params.reference_kwargs(), **params.descale_kwargs())
    values = v
    if params.fp8 is not None:  # the values the problem means: e4m3 times the descales
        values = reference.dequantize(v, params.fp8.v_descale,
                                      params.cu_seqlens_k if params.varlen else None)
    out_tol = OUT_TOLERANCE[q.dtype] * max(_used_value_scale(values, params), 1e-30)
    if params.varlen:
        rows = _varlen_rows(params, q.shape[1], params.max_seqlen_k)
        ref_out, ref_lse = reference.varlen_attention(q, k, v, params.cu_seqlens_q,
                                                      params.cu_seqlens_k, rows=rows, **kw)
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        got_out, got_lse = out[index], lse[:, index]
        out_names, lse_names = ("token row", "head", "dim"), ("head", "token row")
    else:
        rows = _sample(q.shape[1], q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1])
        ref_out, ref_lse = reference.attention(q, k, v, rows=rows, **kw)
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        got_out, got_lse = out[:, index], lse[:, :, index]
        out_names, lse_names = ("batch", "query row", "head", "dim"), ("batch", "head", "query row")
    _compare("the forward's output", got_out, ref_out, out_tol, out_names, rows)
    lse_tol = LSE_TOLERANCE * (1.0 + torch.nan_to_num(ref_lse.abs(), posinf=0.0))
    _compare("the forward's LSE", got_lse, ref_lse, lse_tol, lse_names, rows)


def verify_backward(dout, q, k, v, dq, dk, dv, params, dsinks=None):
    """Checks a library backward's dq on a sample of query rows, and dk / dv (and dsinks, when
    given) when every row is checked (they sum over all rows); raises VerificationError."""
    kw = dict(params.reference_kwargs(), magnitudes=True)
    if params.varlen:
        rows = _varlen_rows(params, q.shape[1], params.max_seqlen_k)
        every_row = len(rows) == int(params.cu_seqlens_q[-1])
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        # Every row: the full problem (dk, dv need all of dout); else only the sampled rows.
        grads, sizes = reference.varlen_attention_backward(
            dout if every_row else dout[index], q, k, v, params.cu_seqlens_q,
            params.cu_seqlens_k, rows=None if every_row else rows, **kw)
        if every_row:
            grads, sizes = [grads[0][index]] + list(grads[1:]), [sizes[0][index]] + list(sizes[1:])
        got_dq = dq[index]
        names, key_names = ("token row", "head", "dim"), ("key row", "head", "dim")
    else:
        rows = _sample(q.shape[1], q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1])
        every_row = len(rows) == q.shape[1]
        index = torch.tensor(rows, dtype=torch.long, device=q.device)
        grads, sizes = reference.attention_backward(dout[:, index], q, k, v,
                                                    rows=None if every_row else rows, **kw)
        got_dq = dq[:, index]
        names = ("batch", "query row", "head", "dim")
        key_names = ("batch", "key row", "head", "dim")
    c = GRAD_TOLERANCE[q.dtype]
    # Values in the subnormal range round to a fixed spacing, whatever their size.
    floor = torch.finfo(q.dtype).smallest_normal * torch.finfo(q.dtype).eps
    _compare("the backward's dq", got_dq, grads[0], c * sizes[0] + floor, names, rows)
    if every_row:
        key_rows = range(k.shape[-3])
        for what, got, want, size in (("dk", dk, grads[1], sizes[1]),
                                      ("dv", dv, grads[2], sizes[2])):
            _compare("the backward's " + what, got, want, c * size + floor, key_names, key_rows)
        if dsinks is not None:
            # Its terms take D from the output in the input's dtype: that dtype's c.
            _compare("the backward's dsinks", dsinks, grads[3], c * sizes[3] + floor, ("head",),
                     range(dsinks.shape[0]))


def verify_kvcache(q, v_cache, out, lse, ref_out, ref_lse, fp8=None):
    """Checks a library KV-cache forward's out / lse against the reference's (computed on the cache
    the call left: every row); raises VerificationError. fp8: an FP8 call's c_abi.Fp8, whose
    largest v descale bounds the cache's dequantized values."""
    used = torch.nan_to_num(v_cache.detach().float().abs(), nan=0.0, posinf=0.0)
    scale = float(used.max()) if used.numel() else 0.0
    if fp8 is not None and fp8.v_descale is not None and fp8.v_descale.numel():
        scale *= float(fp8.v_descale.detach().abs().max())
    out_tol = OUT_TOLERANCE[q.dtype] * max(scale, 1e-30)
    varlen = q.dim() == 3
    rows = range(q.shape[0] if varlen else q.shape[1])
    _compare("the forward's output", out, ref_out, out_tol,
             ("token row", "head", "dim") if varlen else ("batch", "query row", "head", "dim"),
             rows)
    lse_tol = LSE_TOLERANCE * (1.0 + torch.nan_to_num(ref_lse.abs(), posinf=0.0))
    _compare("the forward's LSE", lse, ref_lse, lse_tol,
             ("head", "token row") if varlen else ("batch", "head", "query row"), rows)
