"""Context parallelism (fa4cpp.context_parallel) on the CPU backend: 2 and 4 gloo processes run
ring_flash_attn_func forward and backward on their shards; the shards put together must meet the
accuracy rule against an fp64 torch reference, with the single-process fa4cpp call on the full
tensors as the low-precision result (|X_cp − ref| ≤ 2·|X_single − ref| + atol)."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from fa4cpp.context_parallel import (shard_sequence, shard_varlen, unshard_sequence,
                                     unshard_varlen)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cp_worker  # noqa: E402  (draws the inputs as the ranks do)

SEED = int(os.environ.get("FA4_TEST_SEED", int.from_bytes(os.urandom(4), "little")))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, case, tmp_path):
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(HERE, "..", "..", "python")] + env.get("PYTHONPATH", "").split(os.pathsep))
    env["OMP_NUM_THREADS"] = env["FA4_CPU_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "cp_worker.py"), str(r),
                               str(world), str(port), str(SEED), json.dumps(case), str(tmp_path)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [p.communicate(timeout=300)[0].decode() for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, "rank %d failed (seed %d):\n%s" % (r, SEED, log)
    return [torch.load(os.path.join(tmp_path, "rank%d.pt" % r)) for r in range(world)]


def reference(q, k, v, dout, causal, softcap, sinks=None, window=(-1, -1)):
    """Attention in fp64 with its gradients (GQA by repeating K / V heads; a sliding window over
    positions, flash_attn's (left, right); sinks as one more logit per row without a value,
    gpt-oss's definition)."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    dout = dout.double()
    sinks = sinks.double().requires_grad_() if sinks is not None else None
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    n = q.shape[1]
    left, right = window[0], 0 if causal else window[1]
    offset = torch.arange(n).view(1, n) - torch.arange(n).view(n, 1)  # j − i
    hidden = torch.zeros(n, n, dtype=torch.bool)
    if left >= 0:
        hidden |= offset < -left
    if right >= 0:
        hidden |= offset > right
    s = s.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1)[..., :kk.shape[1]]
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    out.backward(dout)
    return (out.detach(), lse.detach(), q.grad, k.grad, v.grad,
            sinks.grad if sinks is not None else None)


def single(q, k, v, dout, causal, softcap, sinks=None, window=(-1, -1)):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_() if sinks is not None else None
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, q.shape[-1] ** -0.5, causal, window[0],
                                    0 if causal else window[1], softcap, False, sinks=sinks)
    out.backward(dout)
    return (out.detach(), lse, q.grad, k.grad, v.grad,
            sinks.grad if sinks is not None else None)


def check(name, got, ref, lp, atol):
    err = (got.double() - ref).abs().max().item()
    allowed = 2 * (lp.double() - ref).abs().max().item() + atol
    assert err <= allowed, ("%s: max|cp - ref| = %g > 2 * max|single - ref| + atol = %g (seed %d)"
                            % (name, err, allowed, SEED))


RESULTS = ("out", "lse", "dq", "dk", "dv")


def check_results(got, ref, one):
    """Each of RESULTS (got: name -> tensor; ref, one: tuples in RESULTS' order) to the rule."""
    for i, name in enumerate(RESULTS):
        check(name, got[name], ref[i], one[i], 1e-5 if i < 2 else 1e-4)


def check_dense(shards, case):
    """The ranks' shards of one sequence per batch entry put together and held to the rule against
    the fp64 reference, the single-process call on the full tensors as the low-precision result.
    Returns (ref, one) for what the caller checks besides."""
    lb = case["load_balance"]
    full = cp_worker.draw(case, SEED, torch.float32)
    got = {n: unshard_sequence([s[n] for s in shards], load_balance=lb)
           for n in ("out", "dq", "dk", "dv")}
    got["lse"] = unshard_sequence([s["lse"] for s in shards], seq_dim=2, load_balance=lb)
    inputs = (full["q"], full["k"], full["v"], full["dout"], case["causal"], case["softcap"],
              full.get("sinks"), tuple(case.get("window", (-1, -1))))
    ref, one = reference(*inputs), single(*inputs)
    check_results(got, ref, one)
    return ref, one


CASES = [
    # world, causal, load_balance, heads q / kv, softcap, sinks, window (chunks of 8 or 16 rows)
    (2, True, True, 4, 2, 0.0, False, (-1, -1)),
    (4, True, True, 4, 1, 0.0, False, (-1, -1)),
    (2, True, False, 2, 2, 0.0, False, (-1, -1)),
    (4, False, False, 8, 2, 5.0, False, (-1, -1)),
    (2, True, True, 8, 1, 0.0, True, (-1, -1)),
    (4, False, False, 4, 2, 0.0, True, (-1, -1)),
    # Windows narrower and wider than a chunk, across chunk and shard boundaries.
    (2, True, True, 4, 2, 0.0, False, (5, -1)),
    (4, True, True, 4, 1, 0.0, False, (19, -1)),
    (2, False, False, 2, 2, 0.0, False, (3, 6)),
    (4, False, True, 4, 2, 0.0, False, (-1, 4)),
    # gpt-oss's layers: sinks with a sliding window, GQA 8.
    (2, True, True, 8, 1, 0.0, True, (7, -1)),
]


@pytest.mark.parametrize("world,causal,load_balance,heads_q,heads_kv,softcap,sinks,window", CASES,
                         ids=["w2_causal_lb_gqa2", "w4_causal_lb_gqa4", "w2_causal_contiguous",
                              "w4_full_softcap_gqa4", "w2_causal_lb_sinks_gqa8",
                              "w4_full_sinks_gqa2", "w2_causal_lb_window5",
                              "w4_causal_lb_window19_gqa4", "w2_window3_6_contiguous",
                              "w4_window_right4_lb", "w2_causal_lb_window7_sinks_gqa8"])
def test_ring_attention_matches_one_device(world, causal, load_balance, heads_q, heads_kv, softcap,
                                           sinks, window, tmp_path):
    case = {"batch": 2, "seqlen": 16 * world, "heads_q": heads_q, "heads_kv": heads_kv, "dim": 32,
            "dtype": "float32", "causal": causal, "load_balance": load_balance,
            "softcap": softcap, "sinks": sinks, "window": window}
    shards = run_ranks(world, case, tmp_path)
    ref, one = check_dense(shards, case)
    if sinks:
        # Each rank's d(sinks) is its rows' share: the group's sum is the whole gradient.
        check("dsinks", sum(s["dsinks"] for s in shards), ref[5], one[5], 1e-4)
    else:
        assert all(s["dsinks"] is None for s in shards)


TORCH_ROUTE = [
    # world, causal, load_balance, heads q / kv, torch's rotate method
    (2, True, True, 4, 4, "alltoall"),
    (4, True, True, 4, 2, "allgather"),
    (2, True, False, 2, 2, "alltoall"),
    (4, False, False, 4, 1, "alltoall"),
]


@pytest.mark.parametrize("world,causal,load_balance,heads_q,heads_kv,rotate", TORCH_ROUTE,
                         ids=["w2_causal_lb", "w4_causal_lb_gqa2_allgather", "w2_causal_contiguous",
                              "w4_full_gqa4"])
def test_torch_context_parallel_runs_fa4cpp(world, causal, load_balance, heads_q, heads_kv, rotate,
                                            tmp_path):
    """torch's context_parallel with fa4cpp as SDPA's flash attention: every ring step, forward
    and backward, runs fa4cpp (none falls back to the stock kernel), and the assembled results
    meet the rule as ring_flash_attn_func's do."""
    case = {"batch": 2, "seqlen": 16 * world, "heads_q": heads_q, "heads_kv": heads_kv, "dim": 32,
            "dtype": "float32", "causal": causal, "load_balance": load_balance, "softcap": 0.0,
            "route": "torch", "rotate": rotate}
    shards = run_ranks(world, case, tmp_path)
    for rank, s in enumerate(shards):
        # Under a causal mask without load balance, rank r's queries see r + 1 shards.
        steps = rank + 1 if causal and not load_balance else world
        expected = {("fwd", "fa4cpp"): steps, ("bwd", "fa4cpp"): steps}
        assert s["calls"] == expected, (rank, s["calls"])
    check_dense(shards, case)


PACKED = [
    # world, causal, load_balance, heads q / kv, sinks, window; sequences of 4·world·m rows
    (2, True, True, 4, 2, False, (-1, -1)),
    (4, True, True, 4, 1, True, (-1, -1)),
    (2, False, False, 2, 2, False, (-1, -1)),
    # Windows across the sequences' chunks (2, 6 and 10 rows with load balance, 4, 12 and 20
    # without): narrower than some chunks and wider than others, so that the blocks' windows
    # differ between the sequences.
    (2, True, True, 4, 2, False, (6, -1)),
    (4, True, True, 8, 1, True, (9, -1)),
    (2, False, False, 2, 2, False, (5, 3)),
    (4, False, True, 4, 2, False, (-1, 7)),
]


@pytest.mark.parametrize("world,causal,load_balance,heads_q,heads_kv,sinks,window", PACKED,
                         ids=["w2_causal_lb_gqa2", "w4_causal_lb_sinks_gqa4", "w2_full_contiguous",
                              "w2_causal_lb_window6", "w4_causal_lb_window9_sinks_gqa8",
                              "w2_window5_3_contiguous", "w4_window_right7_lb"])
def test_packed_ring_attention_matches_one_device(world, causal, load_balance, heads_q, heads_kv,
                                                  sinks, window, tmp_path):
    lengths = [4 * world * m for m in (3, 1, 5)]
    case = {"batch": len(lengths), "seqlen": 0, "lengths": lengths, "heads_q": heads_q,
            "heads_kv": heads_kv, "dim": 32, "dtype": "float32", "causal": causal,
            "load_balance": load_balance, "softcap": 0.0, "sinks": sinks, "window": window}
    shards = run_ranks(world, case, tmp_path)
    full = cp_worker.draw(case, SEED, torch.float32)
    local_cu = shards[0]["cu"]
    got = {n: unshard_varlen([s[n] for s in shards], local_cu, load_balance=load_balance)
           for n in ("out", "dq", "dk", "dv")}
    got["lse"] = unshard_varlen([s["lse"] for s in shards], local_cu, seq_dim=1,
                                load_balance=load_balance)
    cu = cp_worker.cu_seqlens(case)
    # The reference per sequence, put together; the single-process call is one varlen call.
    parts = [reference(*(full[n][a:b].unsqueeze(0) for n in ("q", "k", "v", "dout")), causal, 0.0,
                       full.get("sinks"), window)
             for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    ref = [torch.cat([p[i][0] for p in parts], dim=1 if i == 1 else 0) for i in range(5)]
    ref.append(sum(p[5] for p in parts) if sinks else None)
    q, k, v = (full[n].clone().requires_grad_() for n in ("q", "k", "v"))
    s_ = full["sinks"].clone().requires_grad_() if sinks else None
    out, lse = torch.ops.fa4cpp.varlen_fwd(q, k, v, cu, cu, max(lengths), max(lengths), None,
                                           q.shape[-1] ** -0.5, causal, window[0],
                                           0 if causal else window[1], 0.0, False, sinks=s_)
    out.backward(full["dout"])
    one = (out.detach(), lse, q.grad, k.grad, v.grad, s_.grad if sinks else None)
    check_results(got, ref, one)
    if sinks:
        check("dsinks", sum(s["dsinks"] for s in shards), ref[5], one[5], 1e-4)


def test_packed_sharding_round_trips():
    cu = torch.tensor([0, 8, 12, 28], dtype=torch.int32)
    x = torch.arange(28 * 3).reshape(28, 3)
    for lb in (False, True):
        shards = [shard_varlen(x, cu, r, 2, load_balance=lb) for r in range(2)]
        assert all(torch.equal(local, shards[0][1]) for _, local in shards)
        assert torch.equal(unshard_varlen([t for t, _ in shards], shards[0][1], load_balance=lb), x)


def test_window_sizes():
    from fa4cpp.context_parallel import _window
    assert _window(False, (-1, -1)) is None and _window(True, (-1, -1)) is None
    assert _window(True, (5, 3)) == (5, 0)  # causal: the right side is 0
    assert _window(False, (-1, 4)) == (-1, 4)
    with pytest.raises(ValueError, match="window_size"):
        _window(False, (-2, 0))


def test_refuses_malformed_sinks():
    from fa4cpp import context_parallel
    q = torch.randn(1, 4, 2, 16)
    bad = [torch.zeros(2, dtype=torch.float64), torch.zeros(3), torch.zeros(1, 2)]
    for sinks in bad:
        with pytest.raises(ValueError, match="sinks must be a float32 tensor"):
            context_parallel._check_sinks(q, sinks)


def test_sharding_round_trips():
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    for world in (1, 2, 3):
        for lb in (False, True):
            shards = [shard_sequence(x, r, world, load_balance=lb) for r in range(world)]
            assert torch.equal(unshard_sequence(shards, load_balance=lb), x)
    # Load-balanced causal work: rank r holds chunks r and 2W − 1 − r.
    shards = [shard_sequence(x, r, 2, load_balance=True) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([x[:, 0:6], x[:, 18:24]], dim=1))


def test_refuses_without_a_process_group():
    from fa4cpp.context_parallel import ring_flash_attn_func
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="torch.distributed"):
        ring_flash_attn_func(q, q, q)
