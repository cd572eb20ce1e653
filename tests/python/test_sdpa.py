"""fa4cpp in torch's flash-attention registry (fa4cpp.sdpa).

CPU (CI): the registration and the activate / restore round trip (read back from the dispatcher's
table), the routing decisions, and the override functions themselves: registered for the CPU key,
where aten::_scaled_dot_product_flash_attention has no stock kernel, they run the whole SDPA flash
round trip — forward, autograd, backward — on the library's CPU backend. A stand-in for the stock
FlashAttention-2 kernels (registered for CPU too, computing the backward from the forward's
log-sum-exp as FlashAttention-2 does) checks the calls that go to the stock kernels.

GPU (an sm_90 device): F.scaled_dot_product_attention under the flash backend with fa4cpp
activated, a config fa4cpp does not support, torch.compile, and a small Llama from transformers.

Tolerances. CPU round trip: fa4cpp.modes' verify tolerances (c · the largest reference value, c per
dtype, derivation in modes.py), against torch's math SDPA in fp32. GPU: fa4cpp's error against
torch's math SDPA in fp32 must stay within twice the error of the stock FlashAttention-2 kernel on
the same bf16 inputs, plus 1e-5 (the project's accuracy rule: at most twice the error of a
same-precision implementation).
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import (SDPBackend, activate_flash_attention_impl,
                                current_flash_attention_impl, list_flash_attention_impls,
                                restore_flash_attention_impl, sdpa_kernel)

import fa4cpp
from fa4cpp import modes, ops, sdpa

SDPA_OPS = ("aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward")


# GPU tests carry the "sm90" marker (conftest.py): skipped, saying why, without an sm_90 device.
needs_sm90 = pytest.mark.sm90


def _kernel_entry(op, key):
    """The dispatcher's table line of `op` for dispatch key `key` ("" when it has none)."""
    for line in torch._C._dispatch_dump_table(op).splitlines():
        if line.startswith(key + ":"):
            return line
    return ""


@pytest.fixture
def fresh_calls():
    sdpa.calls.clear()
    yield sdpa.calls
    sdpa.calls.clear()


@pytest.fixture
def activated(fresh_calls):
    activate_flash_attention_impl(sdpa.NAME)
    try:
        yield fresh_calls
    finally:
        restore_flash_attention_impl()


@pytest.fixture
def cpu_kernels(fresh_calls):
    """The override functions registered for CPU tensors."""
    handle = sdpa.register_kernels("CPU")
    try:
        yield fresh_calls
    finally:
        handle.remove()


# ---------------------------------------------------------------------------------------------
# Registration (CPU)

def test_registered_on_import_not_activated():
    assert fa4cpp.sdpa.REGISTERED
    assert sdpa.NAME in list_flash_attention_impls()
    assert current_flash_attention_impl() is None
    for op in SDPA_OPS:
        assert "sdpa.py" not in _kernel_entry(op, "CUDA"), op


def test_activate_restore_round_trip():
    before = {op: _kernel_entry(op, "CUDA") for op in SDPA_OPS}
    activate_flash_attention_impl(sdpa.NAME)
    try:
        assert current_flash_attention_impl() == sdpa.NAME
        for op in SDPA_OPS:
            assert "sdpa.py" in _kernel_entry(op, "CUDA"), _kernel_entry(op, "CUDA")
        # Activating again first restores, then overrides once more: one restore undoes it.
        activate_flash_attention_impl(sdpa.NAME)
        assert current_flash_attention_impl() == sdpa.NAME
    finally:
        restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert {op: _kernel_entry(op, "CUDA") for op in SDPA_OPS} == before


def test_handle_remove_restores():
    before = {op: _kernel_entry(op, "CUDA") for op in SDPA_OPS}
    handle = sdpa.register_kernels()
    assert handle.active
    assert all("sdpa.py" in _kernel_entry(op, "CUDA") for op in SDPA_OPS)
    handle.remove()
    handle.remove()  # idempotent
    assert not handle.active
    assert {op: _kernel_entry(op, "CUDA") for op in SDPA_OPS} == before
    assert current_flash_attention_impl() is None


# ---------------------------------------------------------------------------------------------
# Routing decisions (CPU)

def _bhsd(batch, heads, seq, dim, dtype=torch.bfloat16, device="cpu"):
    return torch.randn(batch, seq, heads, dim, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(dropout_p=0.1), "dropout"),
    (dict(return_debug_mask=True), "return_debug_mask"),
    (dict(scale=0.0), "scale 0"),
])
def test_forward_route_sdpa_only_arguments(kwargs, words, monkeypatch):
    # Decided before the library is asked: meta tensors, and a support() that must not be called.
    monkeypatch.setattr(ops, "support", lambda *a, **k: pytest.fail("support() consulted"))
    q = _bhsd(2, 4, 16, 64, device="meta")
    reason = sdpa.forward_route(q, q, q, **kwargs)
    assert reason is not None and words in reason


def test_backward_route_dropout_goes_stock():
    q = _bhsd(2, 4, 16, 64, device="meta")
    assert "dropout" in sdpa.backward_route(q, q, q, dropout_p=0.5)


def test_route_asks_the_library():
    q, k = _bhsd(1, 4, 8, 64), _bhsd(1, 2, 12, 64)
    assert sdpa.forward_route(q, k, k, is_causal=True, scale=0.125) is None
    assert sdpa.backward_route(q, k, k, is_causal=True, scale=0.125) is None
    big = _bhsd(1, 2, 8, 512)
    reason = sdpa.forward_route(big, big, big)
    assert reason == ops.support("fwd", *(t.transpose(1, 2) for t in (big, big, big)))
    assert reason


# ---------------------------------------------------------------------------------------------
# The override functions on CPU, through the dispatcher and autograd

def _math_sdpa(q, k, v, is_causal, scale):
    """torch's math SDPA in fp32 (SDPA's causal is top-left aligned: used with sq == sk only)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=is_causal, scale=scale,
            enable_gqa=q.size(1) != k.size(1))


def _lse(q, k, is_causal, scale):
    kk = k.float().repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = scale * q.float() @ kk.transpose(-1, -2)
    if is_causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
    return torch.logsumexp(s, dim=-1)


def _assert_close(got, ref, coeff, what):
    err = (got.float() - ref.float()).abs().max().item()
    tol = coeff * max(ref.float().abs().max().item(), 1.0)
    assert err <= tol, "%s: max abs error %.3g > tolerance %.3g" % (what, err, tol)


def _inputs(batch, hq, hkv, sq, sk, dim, dtype, layout):
    """SDPA-shaped (batch, heads, seq, dim) leaves: "bshd" as transformers makes them (a view of a
    (batch, seq, heads, dim) tensor), "bhsd" contiguous."""
    def make(heads, seq):
        if layout == "bshd":
            t = torch.randn(batch, seq, heads, dim, dtype=dtype).transpose(1, 2)
        else:
            t = torch.randn(batch, heads, seq, dim, dtype=dtype)
        return t.detach().requires_grad_()
    return make(hq, sq), make(hkv, sk), make(hkv, sk)


CASES = [  # batch, heads_q, heads_kv, seqlen_q, seqlen_k, head_dim, causal
    (2, 4, 4, 33, 33, 64, False),
    (2, 4, 4, 33, 33, 64, True),
    (1, 6, 2, 17, 40, 32, False),  # GQA, sq != sk
    (1, 4, 1, 24, 24, 128, True),  # MQA
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "b%dh%dkv%d_sq%dsk%d_d%d_causal%d" % c)
def test_cpu_round_trip(case, layout, dtype, cpu_kernels):
    torch.manual_seed(0)
    batch, hq, hkv, sq, sk, dim, causal = case
    q, k, v = _inputs(batch, hq, hkv, sq, sk, dim, dtype, layout)
    scale = 1.0 / math.sqrt(dim)
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                             scale=scale)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug_mask = res
    assert cum_q is None and cum_k is None and (max_q, max_k) == (sq, sk)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.stride() == torch.empty_like(q).stride()
    assert lse.shape == (batch, hq, sq) and lse.dtype == torch.float32
    assert rng_state.dtype == unused.dtype == torch.uint64 and debug_mask.numel() == 0
    assert cpu_kernels[("fwd", sdpa.FA4CPP)] == 1

    ref_q, ref_k, ref_v = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = _math_sdpa(ref_q, ref_k, ref_v, causal, scale)
    _assert_close(out, ref, modes.OUT_TOLERANCE[dtype], "O")
    _assert_close(lse, _lse(ref_q, ref_k, causal, scale), modes.LSE_TOLERANCE, "LSE")

    dout = torch.randn_like(out)
    out.backward(dout)
    ref.backward(dout.float())
    assert cpu_kernels[("bwd", sdpa.FA4CPP)] == 1
    for name, t, r in (("dQ", q, ref_q), ("dK", k, ref_k), ("dV", v, ref_v)):
        assert t.grad.stride() == torch.empty_like(t).stride(), name
        _assert_close(t.grad, r.grad, modes.GRAD_TOLERANCE[dtype], name)


class StandInFlashAttention2:
    """aten::_flash_attention_forward / _backward for CPU tensors, computed as FlashAttention-2
    does: the backward recomputes P from the forward's log-sum-exp, (batch, heads, seqlen_q) fp32,
    natural log. Records each call's arguments."""

    def __init__(self):
        self.forward_calls = []
        self.backward_calls = []

    def forward(self, q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                seqused_k=None, alibi_slopes=None):
        self.forward_calls.append(dict(shapes=(q.shape, k.shape, v.shape), max=(max_q, max_k),
                                       dropout_p=dropout_p, is_causal=is_causal, scale=scale))
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        p, lse = self._probabilities(q, k, is_causal, scale, None)
        out = (p @ self._heads(v, q).float()).transpose(1, 2).to(q.dtype)
        return (out, lse, torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64),
                torch.empty(0, dtype=q.dtype))

    def backward(self, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal,
                 philox_seed, philox_offset, *, scale=None, window_size_left=None,
                 window_size_right=None):
        self.backward_calls.append(dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale))
        scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
        p, _ = self._probabilities(q, k, is_causal, scale, lse)
        qf, kf, vf = q.float().transpose(1, 2), self._heads(k, q).float(), self._heads(v, q).float()
        do, o = dout.float().transpose(1, 2), out.float().transpose(1, 2)
        dp = do @ vf.transpose(-1, -2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True))
        dq = scale * ds @ kf
        dk = self._sum_groups(scale * ds.transpose(-1, -2) @ qf, k)
        dv = self._sum_groups(p.transpose(-1, -2) @ do, k)
        return tuple(g.transpose(1, 2).to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))

    def _probabilities(self, q, k, is_causal, scale, lse):
        s = scale * q.float().transpose(1, 2) @ self._heads(k, q).float().transpose(-1, -2)
        if is_causal:
            sq, sk = s.shape[-2:]
            s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1), -math.inf)
        if lse is None:
            lse = torch.logsumexp(s, dim=-1)
        return torch.exp(s - lse.unsqueeze(-1)), lse

    @staticmethod
    def _heads(t, q):
        """(batch, seq, heads_kv, dim) as (batch, heads_q, seq, dim)."""
        return t.transpose(1, 2).repeat_interleave(q.size(2) // t.size(2), dim=1)

    @staticmethod
    def _sum_groups(g, kv):
        b, hq, s, d = g.shape
        return g.view(b, kv.size(2), hq // kv.size(2), s, d).sum(2)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cpu_outputs_written_in_sdpa_layout(layout, cpu_kernels, monkeypatch):
    """O and the gradients are written by the library straight into the layout SDPA promises
    (empty_like of query, key, value): the final re-layout has nothing to copy, for transformers'
    (batch, seq, heads, dim) views and for contiguous (batch, heads, seq, dim) tensors alike."""
    copied = []
    laid_out_like = sdpa._laid_out_like

    def spy(ref, t):
        result = laid_out_like(ref, t)
        copied.append(result is not t)
        return result
    monkeypatch.setattr(sdpa, "_laid_out_like", spy)
    q, k, v = _inputs(2, 4, 2, 19, 23, 32, torch.float32, layout)
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)[0]
    out.backward(torch.randn_like(out))
    assert cpu_kernels[("fwd", sdpa.FA4CPP)] == 1 and cpu_kernels[("bwd", sdpa.FA4CPP)] == 1
    assert copied == [False] * 4  # O, dQ, dK, dV


@pytest.fixture
def stock_cpu(cpu_kernels):
    stock = StandInFlashAttention2()
    library = torch.library.Library("aten", "IMPL", "CPU")
    library.impl("_flash_attention_forward", stock.forward, "CPU")
    library.impl("_flash_attention_backward", stock.backward, "CPU")
    try:
        yield stock
    finally:
        library._destroy()


def test_unsupported_call_goes_to_stock_kernel(stock_cpu, cpu_kernels):
    torch.manual_seed(1)
    q, k, v = _inputs(2, 4, 2, 20, 20, 64, torch.float32, "bshd")
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                             scale=0.0)[0]
    assert stock_cpu.forward_calls == [dict(
        shapes=((2, 20, 4, 64), (2, 20, 2, 64), (2, 20, 2, 64)), max=(20, 20), dropout_p=0.0,
        is_causal=True, scale=0.0)]
    reason = sdpa.forward_route(q, k, v, 0.0, True, False, 0.0)
    assert cpu_kernels[("fwd", "stock: " + reason)] == 1
    assert cpu_kernels[("fwd", sdpa.FA4CPP)] == 0
    _assert_close(out, _math_sdpa(q, k, v, True, 0.0), 1e-5, "O")
    out.sum().backward()
    assert stock_cpu.backward_calls == [dict(dropout_p=0.0, is_causal=True, scale=0.0)]


def test_dropout_goes_to_stock_kernel(stock_cpu, cpu_kernels):
    q, k, v = _inputs(1, 2, 2, 8, 8, 32, torch.float32, "bshd")
    torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.25, False, False, scale=0.2)
    assert stock_cpu.forward_calls[0]["dropout_p"] == 0.25
    assert cpu_kernels[("fwd", sdpa.FA4CPP)] == 0


def test_fa4cpp_forward_stock_backward(stock_cpu, cpu_kernels, monkeypatch):
    # The sm90 backend today: forward by fa4cpp, backward by FlashAttention-2 from fa4cpp's O and
    # log-sum-exp.
    support = ops.support

    def no_backward(pass_, *args, **kwargs):
        return "no backward here" if pass_ == "bwd" else support(pass_, *args, **kwargs)
    monkeypatch.setattr(ops, "support", no_backward)
    torch.manual_seed(2)
    q, k, v = _inputs(2, 6, 3, 24, 24, 64, torch.float32, "bshd")
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False,
                                                             scale=0.1)[0]
    dout = torch.randn_like(out)
    out.backward(dout)
    assert cpu_kernels[("fwd", sdpa.FA4CPP)] == 1
    assert cpu_kernels[("bwd", "stock: no backward here")] == 1
    assert stock_cpu.forward_calls == [] and len(stock_cpu.backward_calls) == 1
    ref_q, ref_k, ref_v = (t.detach().requires_grad_() for t in (q, k, v))
    _math_sdpa(ref_q, ref_k, ref_v, True, 0.1).backward(dout)
    for name, t, r in (("dQ", q, ref_q), ("dK", k, ref_k), ("dV", v, ref_v)):
        _assert_close(t.grad, r.grad, modes.GRAD_TOLERANCE[torch.float32], name)


# ---------------------------------------------------------------------------------------------
# GPU (sm_90)

def _errors(outs, refs):
    return [(o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs)]


def _sdpa_run(q, k, v, dout, causal):
    """Output and input gradients of SDPA under the flash backend (fresh leaves)."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(*leaves, is_causal=causal,
                                             enable_gqa=q.size(1) != k.size(1))
    out.backward(dout)
    return [out] + [t.grad for t in leaves]


@pytest.fixture
def fwd_spy(monkeypatch):
    """Counts the calls that reach the library's forward (the SDPA route calls ops._forward, not
    the custom op, so that it can write O straight into the layout SDPA promises)."""
    seen = []
    real = ops._forward

    def spy(q, *args, **kwargs):
        seen.append(q.shape)
        return real(q, *args, **kwargs)
    monkeypatch.setattr(ops, "_forward", spy)
    return seen


@needs_sm90
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads_kv", [8, 2])
def test_gpu_sdpa_forward_backward(causal, heads_kv, fresh_calls, fwd_spy):
    torch.manual_seed(3)
    dev, bf16 = "cuda", torch.bfloat16
    q = _bhsd(2, 8, 257, 128, bf16, dev)
    k, v = _bhsd(2, heads_kv, 257, 128, bf16, dev), _bhsd(2, heads_kv, 257, 128, bf16, dev)
    dout = torch.randn_like(q)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref_out = _math_sdpa(*ref_leaves, causal, None)
    ref_out.backward(dout.float())
    refs = [ref_out] + [t.grad for t in ref_leaves]
    stock = _sdpa_run(q, k, v, dout, causal)
    activate_flash_attention_impl(sdpa.NAME)
    try:
        got = _sdpa_run(q, k, v, dout, causal)
    finally:
        restore_flash_attention_impl()
    reason = sdpa.forward_route(q, k, v, 0.0, causal, False, 1 / math.sqrt(128))
    assert len(fwd_spy) == 1 and fresh_calls[("fwd", sdpa.FA4CPP)] == 1, reason
    assert sum(n for (p, _), n in fresh_calls.items() if p == "bwd") == 1
    for name, e, s in zip(("O", "dQ", "dK", "dV"), _errors(got, refs), _errors(stock, refs)):
        assert e <= 2 * s + 1e-5, "%s: fa4cpp error %.3g, stock error %.3g" % (name, e, s)
    # Restored: the stock kernel again.
    _sdpa_run(q, k, v, dout, causal)
    assert len(fwd_spy) == 1


@needs_sm90
def test_gpu_unsupported_configs_use_stock_kernel(activated, fwd_spy):
    torch.manual_seed(4)
    q, k, v = (_bhsd(2, 4, 96, 80, torch.bfloat16, "cuda") for _ in range(3))  # head dim 80
    dout = torch.randn_like(q)
    got = _sdpa_run(q, k, v, dout, True)
    ref_leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = _math_sdpa(*ref_leaves, True, None)
    ref.backward(dout.float())
    for name, g, r in zip(("O", "dQ", "dK", "dV"), got, [ref] + [t.grad for t in ref_leaves]):
        _assert_close(g, r, modes.GRAD_TOLERANCE[torch.bfloat16], name)
    assert fwd_spy == [] and activated[("fwd", sdpa.FA4CPP)] == 0
    q, k, v = (_bhsd(2, 4, 96, 128, torch.bfloat16, "cuda") for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.isfinite(out).all() and fwd_spy == []
    assert any(w.startswith("stock: dropout") for p, w in activated if p == "fwd")


@needs_sm90
def test_gpu_sdpa_torch_compile(activated, fwd_spy):
    # Compiled code calls the aten op as an opaque kernel and asserts the output strides its meta
    # kernel promised: the override must honour them.
    torch.manual_seed(5)
    q, k, v = (_bhsd(2, 4, 128, 128, torch.bfloat16, "cuda").requires_grad_() for _ in range(3))

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        eager = attention(q, k, v)
        eager_grads = torch.autograd.grad(eager.sum(), (q, k, v))
        eager_calls = len(fwd_spy)
        compiled = torch.compile(attention, fullgraph=True)(q, k, v)
        compiled_grads = torch.autograd.grad(compiled.sum(), (q, k, v))
    assert eager_calls == 1 and len(fwd_spy) > eager_calls
    for name, c, e in zip(("O", "dQ", "dK", "dV"), (compiled, *compiled_grads),
                          (eager, *eager_grads)):
        # The stock backward's dQ accumulation order is not fixed: not bit-exact.
        _assert_close(c, e, modes.GRAD_TOLERANCE[torch.bfloat16], name)


def _llama(transformers):
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        attn_implementation="sdpa")  # head dim 128, GQA 2:1
    torch.manual_seed(6)
    return transformers.LlamaForCausalLM(config)


def _logits_and_grads(model, ids, backend):
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(backend):
        result = model(input_ids=ids, labels=ids)
        result.loss.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return result.logits.detach().float(), grads


@needs_sm90
def test_gpu_llama_matches_stock_sdpa(fresh_calls, fwd_spy):
    transformers = pytest.importorskip("transformers")
    model32 = _llama(transformers).to("cuda")
    model = copy.deepcopy(model32).to(torch.bfloat16)
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    ref_logits, ref_grads = _logits_and_grads(model32, ids, SDPBackend.MATH)
    stock_logits, stock_grads = _logits_and_grads(model, ids, SDPBackend.FLASH_ATTENTION)
    activate_flash_attention_impl(sdpa.NAME)
    try:
        logits, grads = _logits_and_grads(model, ids, SDPBackend.FLASH_ATTENTION)
    finally:
        restore_flash_attention_impl()
    assert len(fwd_spy) == 2, dict(fresh_calls)  # one forward per layer
    for name, got, stock, ref in (("logits", logits, stock_logits, ref_logits),
                                  ("gradients", grads, stock_grads, ref_grads)):
        err, stock_err = (got - ref).norm().item(), (stock - ref).norm().item()
        assert err <= 2 * stock_err + 1e-5 * ref.norm().item(), \
            "%s: fa4cpp error %.3g, stock error %.3g" % (name, err, stock_err)
