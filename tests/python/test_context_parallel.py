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

from fa4cpp.context_parallel import shard_sequence, unshard_sequence

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


def reference(q, k, v, dout, causal, softcap):
    """Attention in fp64 with its gradients (GQA by repeating K / V heads)."""
    q, k, v, dout = (t.double().requires_grad_() if t is not dout else t.double()
                     for t in (q, k, v, dout))
    group = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) * q.shape[-1] ** -0.5
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), vv)
    out.backward(dout)
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def single(q, k, v, dout, causal, softcap):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.fa4cpp.fwd(q, k, v, q.shape[-1] ** -0.5, causal, -1, -1, softcap, False)
    out.backward(dout)
    return out.detach(), lse, q.grad, k.grad, v.grad


def check(name, got, ref, lp, atol):
    err = (got.double() - ref).abs().max().item()
    allowed = 2 * (lp.double() - ref).abs().max().item() + atol
    assert err <= allowed, ("%s: max|cp - ref| = %g > 2 * max|single - ref| + atol = %g (seed %d)"
                            % (name, err, allowed, SEED))


CASES = [
    # world, causal, load_balance, heads q / kv, softcap
    (2, True, True, 4, 2, 0.0),
    (4, True, True, 4, 1, 0.0),
    (2, True, False, 2, 2, 0.0),
    (4, False, False, 8, 2, 5.0),
]


@pytest.mark.parametrize("world,causal,load_balance,heads_q,heads_kv,softcap", CASES,
                         ids=["w2_causal_lb_gqa2", "w4_causal_lb_gqa4", "w2_causal_contiguous",
                              "w4_full_softcap_gqa4"])
def test_ring_attention_matches_one_device(world, causal, load_balance, heads_q, heads_kv, softcap,
                                           tmp_path):
    case = {"batch": 2, "seqlen": 16 * world, "heads_q": heads_q, "heads_kv": heads_kv, "dim": 32,
            "dtype": "float32", "causal": causal, "load_balance": load_balance,
            "softcap": softcap}
    shards = run_ranks(world, case, tmp_path)
    full = cp_worker.draw(case, SEED, torch.float32)
    got = {n: unshard_sequence([s[n] for s in shards], load_balance=load_balance)
           for n in ("out", "dq", "dk", "dv")}
    got["lse"] = unshard_sequence([s["lse"] for s in shards], seq_dim=2, load_balance=load_balance)
    ref = reference(full["q"], full["k"], full["v"], full["dout"], causal, softcap)
    one = single(full["q"], full["k"], full["v"], full["dout"], causal, softcap)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        check(name, got[name], ref[i], one[i], 1e-5 if i < 2 else 1e-4)


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
