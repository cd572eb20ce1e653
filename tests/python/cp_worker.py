"""One rank of a context-parallel run for test_context_parallel.py: joins a gloo group, draws the
full inputs from the shared seed, runs ring_flash_attn_func on its shards forward and backward,
and saves its shards of O, LSE, dQ, dK and dV. Usage:
    cp_worker.py RANK WORLD PORT SEED CASE_JSON OUT_DIR"""
import json
import os
import sys

import torch
import torch.distributed as dist


def main():
    rank, world, port, seed = (int(x) for x in sys.argv[1:5])
    case = json.loads(sys.argv[5])
    out_dir = sys.argv[6]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from fa4cpp.context_parallel import ring_flash_attn_func, shard_sequence

    dtype = getattr(torch, case["dtype"])
    full = draw(case, seed, dtype)
    sinks = full.pop("sinks", None)
    if sinks is not None:
        sinks.requires_grad_()
    if "lengths" in case:
        return packed(case, full, sinks, rank, world, out_dir)
    if case.get("route") == "torch":
        return torch_route(case, full, rank, world, out_dir)
    lb = case["load_balance"]
    shards = {name: shard_sequence(t, rank, world, load_balance=lb) for name, t in full.items()}
    q, k, v = (shards[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = ring_flash_attn_func(q, k, v, causal=case["causal"], softcap=case["softcap"],
                                    window_size=tuple(case.get("window", (-1, -1))),
                                    load_balance=lb, return_lse=True, sinks=sinks)
    finish(out, lse, shards["dout"], (q, k, v), sinks, {}, rank, out_dir)


def finish(out, lse, dout, qkv, sinks, extra, rank, out_dir):
    """The backward, then leave()."""
    out.backward(dout)
    q, k, v = qkv
    leave({"out": out.detach(), "lse": lse, "dq": q.grad, "dk": k.grad, "dv": v.grad,
           "dsinks": sinks.grad if sinks is not None else None, **extra}, rank, out_dir)


def leave(results, rank, out_dir):
    """This rank's results saved for the test, and the group left."""
    torch.save(results, os.path.join(out_dir, "rank%d.pt" % rank))
    dist.barrier()
    dist.destroy_process_group()


def packed(case, full, sinks, rank, world, out_dir):
    """The packed batch's run: every sequence sharded, ring_flash_attn_varlen_func."""
    from fa4cpp.context_parallel import ring_flash_attn_varlen_func, shard_varlen

    lb = case["load_balance"]
    cu = cu_seqlens(case)
    shards = {}
    for name, t in full.items():
        shards[name], local_cu = shard_varlen(t, cu, rank, world, load_balance=lb)
    q, k, v = (shards[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = ring_flash_attn_varlen_func(q, k, v, local_cu, causal=case["causal"],
                                           window_size=tuple(case.get("window", (-1, -1))),
                                           softcap=case["softcap"], load_balance=lb,
                                           return_lse=True, sinks=sinks)
    finish(out, lse, shards["dout"], (q, k, v), sinks, {"cu": local_cu}, rank, out_dir)


def torch_route(case, full, rank, world, out_dir):
    """torch's own context parallelism with fa4cpp as SDPA's flash attention: context_parallel
    shards the (batch, heads, seq, dim) buffers (head-tail load balance under a causal mask) and
    routes aten::_scaled_dot_product_flash_attention on sequence-sharded DTensors to its ring, whose
    every step's forward and backward run fa4cpp's override. On CUDA, SDPA's flash backend calls
    that op; on the CPU, SDPA picks its own CPU kernel, so the worker calls the op itself, with the
    override registered for the CPU key."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method

    from fa4cpp import sdpa

    mesh = init_device_mesh("cpu", (world,))
    handle = sdpa.register_kernels("CPU")
    _cp_options.enable_load_balance = case["load_balance"]
    set_rotate_method(case["rotate"])
    q, k, v, dout = (full[n].transpose(1, 2).contiguous() for n in ("q", "k", "v", "dout"))
    with context_parallel(mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2] * 4):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        dq, dk, dv = (DTensor.from_local(t, mesh, [Shard(2)], run_check=False) for t in leaves)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            dq, dk, dv, 0.0, case["causal"], scale=case["dim"] ** -0.5)[:2]
        out.backward(DTensor.from_local(dout, mesh, [Shard(2)], run_check=False))
        out, lse = out.to_local().detach(), lse.to_local()
    handle.remove()
    # Back to the (batch, seq, heads, dim) layout the test's references use.
    out, dq, dk, dv = (t.transpose(1, 2) for t in (out, *(t.grad for t in leaves)))
    leave({"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv, "dsinks": None,
           "calls": dict(sdpa.calls)}, rank, out_dir)


def cu_seqlens(case):
    lengths = torch.tensor([0] + list(case["lengths"]), dtype=torch.int32)
    return lengths.cumsum(0).to(torch.int32)


def draw(case, seed, dtype):
    """The full inputs every rank (and the test) draws alike."""
    g = torch.Generator().manual_seed(seed)
    b, s, hq, hkv, d = case["batch"], case["seqlen"], case["heads_q"], case["heads_kv"], case["dim"]
    # A packed batch: (total, heads, dim), its sequences' lengths in case["lengths"].
    lead = (sum(case["lengths"]),) if "lengths" in case else (b, s)
    full = {"q": torch.randn(*lead, hq, d, generator=g).to(dtype),
            "k": torch.randn(*lead, hkv, d, generator=g).to(dtype),
            "v": torch.randn(*lead, hkv, d, generator=g).to(dtype),
            "dout": torch.randn(*lead, hq, d, generator=g).to(dtype)}
    if case.get("sinks"):
        # Logits about the size of a row's log-sum-exp, so that the sink's share is sizeable.
        full["sinks"] = (2.0 * torch.randn(hq, generator=g) + 2.0).float()
    return full


if __name__ == "__main__":
    main()
