"""Fallback and verify modes (fa4cpp.modes): switches, environment variables, the fallback path
(support() refusing, one warning per reason, reference values) and verify catching a corrupted
library result."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

import fa4cpp
from fa4cpp import Fa4Error, FallbackWarning, VerificationError, c_abi, modes, ops, reference


def _qkv(b=2, sq=9, sk=11, hq=4, hkv=2, d=16, dtype=torch.float32, requires_grad=False):
    return [t.requires_grad_(requires_grad) for t in
            (torch.randn(b, sq, hq, d, dtype=dtype), torch.randn(b, sk, hkv, d, dtype=dtype),
             torch.randn(b, sk, hkv, d, dtype=dtype))]


# -- switches -------------------------------------------------------------------------------------

def test_modes_are_off_by_default_and_set_mode_returns_the_previous():
    assert fa4cpp.get_mode() == modes.Mode(fallback=False, verify=0.0)
    previous = fa4cpp.set_mode(fallback=True, verify=0.25)
    assert previous == modes.Mode(False, 0.0)
    assert fa4cpp.get_mode() == modes.Mode(True, 0.25)
    fa4cpp.set_mode(verify=True)  # a bool: every row
    assert fa4cpp.get_mode() == modes.Mode(True, 1.0)
    with fa4cpp.mode(fallback=False, verify=False) as inside:
        assert inside == modes.Mode(False, 0.0)
    assert fa4cpp.get_mode() == modes.Mode(True, 1.0)
    with pytest.raises(ValueError, match="verify"):
        fa4cpp.set_mode(verify=1.5)


@pytest.mark.parametrize("text, value", [("", False), ("0", False), ("1", True), ("on", True),
                                         ("True", True), ("off", False)])
def test_fallback_variable(text, value):
    assert modes._parse_fallback(text) is value


@pytest.mark.parametrize("text, value", [("", 0.0), ("0", 0.0), ("1", 1.0), ("0.05", 0.05),
                                         ("on", 1.0)])
def test_verify_variable(text, value):
    assert modes._parse_verify(text) == value


@pytest.mark.parametrize("parse, text", [(modes._parse_fallback, "maybe"),
                                         (modes._parse_verify, "2"),
                                         (modes._parse_verify, "some")])
def test_bad_variables_raise(parse, text):
    with pytest.raises(ValueError, match="FA4CPP_"):
        parse(text)


def test_environment_variables_are_read_at_import():
    env = dict(os.environ, FA4CPP_FALLBACK="1", FA4CPP_VERIFY="0.5",
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(fa4cpp.__file__)),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-c", "import fa4cpp; print(fa4cpp.get_mode())"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Mode(fallback=True, verify=0.5)" in result.stdout


# -- fallback -------------------------------------------------------------------------------------

def _refuse(monkeypatch, reason, passes=("fwd", "bwd")):
    real = ops.support

    def support(pass_, *args, **kwargs):
        return reason if pass_ in passes else real(pass_, *args, **kwargs)
    monkeypatch.setattr(ops, "support", support)


def test_refused_call_raises_without_fallback(monkeypatch, python_path):
    _refuse(monkeypatch, "no kernel for this test")
    q, k, v = _qkv()
    with pytest.raises(Fa4Error, match="no kernel for this test"):
        fa4cpp.flash_attn_func(q, k, v)


def test_fallback_runs_the_reference_and_warns_once_per_reason(monkeypatch):
    fa4cpp.set_mode(fallback=True)
    _refuse(monkeypatch, "reason A")
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.warns(FallbackWarning, match="reason A"):
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, window_size=(3, 1))
    want, _ = reference.attention(q, k, v, causal=True, window=(3, 1))
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, want.to(torch.bfloat16))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason again: no second warning
        fa4cpp.flash_attn_func(q, k, v)
    _refuse(monkeypatch, "reason B")
    with pytest.warns(FallbackWarning, match="reason B"):
        fa4cpp.flash_attn_func(q, k, v)


def test_fallback_backward_only(monkeypatch, check):
    """The library runs the forward, the reference the backward (sm90 today)."""
    fa4cpp.set_mode(fallback=True)
    _refuse(monkeypatch, "no backward in this test", passes=("bwd",))
    q, k, v = _qkv(requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the forward does not fall back
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, softcap=2.0)
    dout = torch.randn_like(out)
    with pytest.warns(FallbackWarning, match="backward.*no backward in this test"):
        grads = torch.autograd.grad(out, (q, k, v), dout)
    want = reference.attention_backward(dout, q, k, v, causal=True, softcap=2.0)
    for g, w in zip(grads, want):
        assert torch.equal(g, w)


def test_fallback_varlen(monkeypatch):
    fa4cpp.set_mode(fallback=True)
    _refuse(monkeypatch, "varlen refused")
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 9, 9], dtype=torch.int32)
    q, k, v = torch.randn(8, 4, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    q.requires_grad_()
    with pytest.warns(FallbackWarning):
        out = fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, causal=True)
        (dq,) = torch.autograd.grad(out.sum(), q)
    want, _ = reference.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    assert torch.equal(out, want)
    assert torch.all(out[3:8] == 0)  # sequence 2 has no key
    want_dq = reference.varlen_attention_backward(torch.ones_like(out), q, k, v, cu_q, cu_k,
                                                  causal=True)[0]
    assert torch.equal(dq, want_dq)


def test_fallback_for_a_problem_the_library_refuses():
    """A head dim of 300 (the CPU backend stops at 256): the library's own reason is the
    warning's."""
    q = torch.randn(1, 5, 2, 300)
    with pytest.raises(Fa4Error, match="head_dim_qk is 300"):
        fa4cpp.flash_attn_func(q, q, q)
    with fa4cpp.mode(fallback=True), pytest.warns(FallbackWarning, match="head_dim_qk is 300"):
        out = fa4cpp.flash_attn_func(q, q, q)
    assert torch.equal(out, reference.attention(q, q, q)[0])


def test_fallback_for_a_dtype_the_library_lacks():
    q, k, v = _qkv(dtype=torch.float64)
    with fa4cpp.mode(fallback=True), pytest.warns(FallbackWarning, match="float64"):
        out = fa4cpp.flash_attn_func(q, k, v)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference.attention(q, k, v)[0], rtol=0, atol=0)


def test_malformed_input_raises_even_in_fallback_mode():
    q, k, v = _qkv()
    with fa4cpp.mode(fallback=True), pytest.raises(ValueError, match="batch size"):
        fa4cpp.flash_attn_func(q, k[:1], v[:1])


# -- verify ---------------------------------------------------------------------------------------

def _corrupt(monkeypatch, method, tensor_index, index, delta):
    """Makes Library.<method> add delta to one element of one of its output tensors."""
    real = getattr(c_abi.Library, method)

    def corrupted(self, *args):
        real(self, *args)
        args[tensor_index][index] += delta
    monkeypatch.setattr(c_abi.Library, method, corrupted)


def test_verify_passes_correct_results():
    fa4cpp.set_mode(verify=1.0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = _qkv(dtype=dtype, requires_grad=True)
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, window_size=(4, -1), softcap=3.0)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def test_verify_catches_a_wrong_output(monkeypatch):
    fa4cpp.set_mode(verify=1.0)
    _corrupt(monkeypatch, "forward", 3, (1, 4, 2, 5), 0.5)  # out[1, 4, 2, 5]
    q, k, v = _qkv(dtype=torch.bfloat16)
    with pytest.raises(VerificationError) as error:
        fa4cpp.flash_attn_func(q, k, v)
    message = str(error.value)
    assert "output" in message and "tolerance" in message
    assert "batch 1, query row 4, head 2, dim 5" in message
    fa4cpp.set_mode(verify=0.0)
    fa4cpp.flash_attn_func(q, k, v)  # verify off: the corruption passes unnoticed


def test_verify_catches_a_wrong_lse(monkeypatch):
    fa4cpp.set_mode(verify=1.0)
    _corrupt(monkeypatch, "forward", 4, (0, 3, 7), 0.01)  # lse[0, 3, 7]
    q, k, v = _qkv()
    with pytest.raises(VerificationError, match="LSE.*batch 0, head 3, query row 7"):
        fa4cpp.flash_attn_func(q, k, v)


@pytest.mark.parametrize("tensor_index, index, where", [
    (6, (0, 2, 1, 3), "dq.*batch 0, query row 2, head 1, dim 3"),
    (7, (1, 5, 0, 0), "dk.*batch 1, key row 5, head 0, dim 0"),
    (8, (0, 10, 1, 15), "dv.*batch 0, key row 10, head 1, dim 15"),
])
def test_verify_catches_wrong_gradients(monkeypatch, tensor_index, index, where):
    fa4cpp.set_mode(verify=1.0)
    _corrupt(monkeypatch, "backward", tensor_index, index, 0.05)
    q, k, v = _qkv(requires_grad=True)
    out = fa4cpp.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(VerificationError, match=where):
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def test_verify_varlen_catches_a_wrong_row(monkeypatch):
    fa4cpp.set_mode(verify=1.0)
    _corrupt(monkeypatch, "forward", 3, (6, 1, 0), -0.1)  # out row 6 = sequence 2's first row
    cu_q = torch.tensor([0, 3, 6, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    q, k, v = torch.randn(10, 2, 16), torch.randn(12, 1, 16), torch.randn(12, 1, 16)
    with pytest.raises(VerificationError, match="token row 6, head 1, dim 0"):
        fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 7)


def test_verify_samples_rows_of_large_problems(monkeypatch):
    """Above modes.SMALL_PROBLEM_SCORES a fraction of the rows is checked: every row corrupted
    is caught by any sample, a sample does not cover every row, and torch's RNG is untouched."""
    monkeypatch.setattr(modes, "SMALL_PROBLEM_SCORES", 0)
    checked = []
    real_attention = reference.attention

    def spy(*args, rows=None, **kwargs):
        checked.append(list(rows))
        return real_attention(*args, rows=rows, **kwargs)
    monkeypatch.setattr(reference, "attention", spy)
    fa4cpp.set_mode(verify=0.25)
    q, k, v = _qkv(sq=40, sk=40)
    state = torch.get_rng_state()
    fa4cpp.flash_attn_func(q, k, v)
    assert torch.equal(torch.get_rng_state(), state)
    assert len(checked[0]) == 10 and checked[0] == sorted(set(checked[0]))
    _corrupt(monkeypatch, "forward", 3, (slice(None),), 0.5)
    with pytest.raises(VerificationError):
        fa4cpp.flash_attn_func(q, k, v)


def test_verify_ignores_key_rows_the_problem_does_not_read(monkeypatch):
    """Key rows beyond seqused_k (and after the last sequence) may hold anything, e.g. NaN in an
    uninitialised cache: neither the result nor verify's tolerance may depend on them."""
    fa4cpp.set_mode(verify=1.0)
    cu_q = torch.tensor([0, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 14], dtype=torch.int32)
    seqused_k = torch.tensor([3, 5], dtype=torch.int32)
    q, k, v = torch.randn(9, 2, 16), torch.randn(16, 2, 16), torch.randn(16, 2, 16)
    for rows in (slice(3, 6), slice(11, 16)):
        k[rows], v[rows] = float("nan"), 1e30
    out = fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, causal=True,
                                        seqused_k=seqused_k)
    assert torch.all(torch.isfinite(out))
    # ... and a small error is still caught (a tolerance scaled by the 1e30 rows would not be).
    _corrupt(monkeypatch, "forward", 3, (2, 0, 0), 0.01)
    with pytest.raises(VerificationError, match="token row 2"):
        fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 8, causal=True, seqused_k=seqused_k)
