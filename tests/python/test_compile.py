"""torch.compile(fullgraph=True) over fa4cpp's custom ops: a small attention module, forward and
backward, compiles without a graph break and gives eager's values; fallback and verify still act
inside the compiled graph. CPU with inductor; the GPU variant runs on an sm90 device only."""
import pytest
import torch
import torch._dynamo

import fa4cpp
from fa4cpp import FallbackWarning, VerificationError, c_abi, ops


class Attention(torch.nn.Module):
    """A pre-projection / attention / output-projection block with GQA, as a model would call
    flash_attn_func."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, causal=True, window=(-1, -1)):
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.q = torch.nn.Linear(hidden, heads * self.dim, bias=False)
        self.kv = torch.nn.Linear(hidden, 2 * kv_heads * self.dim, bias=False)
        self.o = torch.nn.Linear(heads * self.dim, hidden, bias=False)
        self.causal, self.window = causal, window

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.dim)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.dim).unbind(dim=2)
        out = fa4cpp.flash_attn_func(q, k, v, causal=self.causal, window_size=self.window)
        return self.o(out.reshape(b, s, -1))


class VarlenAttention(torch.nn.Module):
    def __init__(self, hidden=32, heads=2):
        super().__init__()
        self.heads, self.dim = heads, hidden // heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, x, cu_seqlens, max_seqlen):
        qkv = self.qkv(x).view(x.shape[0], 3, self.heads, self.dim)
        out = fa4cpp.flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, causal=True)
        return out.reshape(x.shape[0], -1)


def _step(model, *inputs):
    """Loss, input gradient and parameter gradients of one forward + backward."""
    for p in model.parameters():
        p.grad = None
    x = inputs[0].detach().requires_grad_()
    loss = model(x, *inputs[1:]).square().mean()
    loss.backward()
    return [loss.detach(), x.grad] + [p.grad for p in model.parameters()]


def _assert_same(compiled, eager, atol):
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=0, atol=atol)


def test_no_graph_break():
    model = Attention()
    x = torch.randn(2, 16, 64)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_compiled_module_matches_eager():
    torch._dynamo.reset()
    model = Attention(window=(6, -1))
    x = torch.randn(2, 24, 64)
    eager = _step(model, x)
    compiled = torch.compile(model, fullgraph=True)
    # The op's values are the library's either way; only the projections around it may round
    # differently once inductor fuses them.
    _assert_same(_step(compiled, x), eager, atol=1e-5)
    x2 = torch.randn(2, 24, 64)
    _assert_same(_step(compiled, x2), _step(model, x2), atol=1e-5)


def test_compiled_varlen_matches_eager():
    torch._dynamo.reset()
    model = VarlenAttention()
    cu = torch.tensor([0, 5, 5, 12, 20], dtype=torch.int32)
    x = torch.randn(20, 32)
    eager = _step(model, x, cu, 8)
    compiled = torch.compile(model, fullgraph=True)
    _assert_same(_step(compiled, x, cu, 8), eager, atol=1e-5)


def test_modes_act_inside_the_compiled_graph(monkeypatch):
    torch._dynamo.reset()
    model = Attention()
    x = torch.randn(1, 8, 64)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x)  # compiled with the library path

    monkeypatch.setattr(ops, "support", lambda *args, **kwargs: "refused inside the graph")
    # A replaced support() is the Python implementation's: the native ops take it on that path.
    with ops.python_path(), pytest.raises(c_abi.Fa4Error, match="refused inside the graph"):
        compiled(x)
    with fa4cpp.mode(fallback=True), pytest.warns(FallbackWarning, match="inside the graph"):
        out = compiled(x)
    monkeypatch.undo()
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-5)

    real = c_abi.Library.forward

    def corrupted(self, q, k, v, out, lse, params):
        real(self, q, k, v, out, lse, params)
        out.add_(1.0)
    monkeypatch.setattr(c_abi.Library, "forward", corrupted)
    with fa4cpp.mode(verify=1.0), pytest.raises(VerificationError):
        compiled(x)


@pytest.mark.sm90
def test_gpu_compiled_module_matches_eager():
    torch._dynamo.reset()
    model = Attention(hidden=1024, heads=8, kv_heads=2).cuda().to(torch.bfloat16)
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
    q = torch.empty(2, 256, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    reason = ops.support("fwd", q, k, k, causal=True)
    if reason is not None:
        # No kernel for d128 bf16 in this build skips; any other refusal is a broken GPU path.
        if "has no forward kernel" not in reason:
            pytest.fail("the sm90 backend refuses a problem it has kernels for: " + reason)
        pytest.skip("this build's sm90 backend has no kernel for the problem: " + reason)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=0, atol=2e-2)
    # Forward on sm90; the backward runs where support() says (the reference until sm90 has one).
    with fa4cpp.mode(fallback=True):
        eager = _step(model, x)
        got = _step(compiled, x)
    for c, e in zip(got, eager):
        torch.testing.assert_close(c.float(), e.float(), rtol=2e-2, atol=2e-2)
