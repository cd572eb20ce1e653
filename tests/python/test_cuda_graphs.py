"""CUDA graphs on the H200: fa4cpp's calls captured once and replayed with new inputs written into
the captured tensors give what eager calls give on the same inputs — the forward, the forward and
backward, and varlen batches whose sequence lengths change between replays — on the native ops
and on the Python implementation. (A KV-cache decode step under a graph: test_decode_loop.py.)"""
import contextlib

import pytest
import torch

import fa4cpp
from fa4cpp import ops

pytestmark = pytest.mark.sm90

PATHS = {"native": contextlib.nullcontext, "python": ops.python_path}


def _capture(fn):
    """fn() warmed up on a side stream (as capture requires), then captured: (graph, outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


@pytest.mark.parametrize("path", sorted(PATHS))
def test_forward_and_backward_replay_with_new_inputs(path):
    shape_q, shape_kv = (2, 300, 8, 128), (2, 300, 2, 128)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16)

    def step():
        out = fa4cpp.flash_attn_func(q, k, v, causal=True, deterministic=True)
        return (out,) + torch.autograd.grad(out, (q, k, v), dout)

    with PATHS[path]():
        graph, captured = _capture(step)
        for round_ in range(3):
            with torch.no_grad():
                for t in (q, k, v, dout):
                    t.copy_(torch.randn_like(t))
            graph.replay()
            want = step()
            for name, got, ref in zip(("out", "dq", "dk", "dv"), captured, want):
                assert torch.equal(got, ref), "%s differs in round %d" % (name, round_)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_varlen_replays_with_new_sequence_lengths(path):
    batch, max_len = 4, 160
    total = batch * max_len
    q, k, v = (torch.randn(total, h, 64, device="cuda", dtype=torch.bfloat16)
               for h in (8, 4, 4))
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros_like(cu_q)

    def lengths(seed):
        g = torch.Generator().manual_seed(seed)
        cuts = torch.randint(1, max_len + 1, (batch,), generator=g)
        return torch.cat([torch.zeros(1, dtype=torch.long), cuts.cumsum(0)]).to(torch.int32)

    def step():
        return fa4cpp.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_len, max_len, causal=True)

    with PATHS[path]():
        cu_q.copy_(lengths(0))
        cu_k.copy_(lengths(1))
        graph, captured = _capture(step)
        for seed in range(2, 8, 2):
            cu_q.copy_(lengths(seed))
            cu_k.copy_(lengths(seed + 1))
            graph.replay()
            want = step()
            rows = int(cu_q[-1])
            assert torch.equal(captured[:rows], want[:rows]), "lengths of seeds %d, %d" % (
                seed, seed + 1)
