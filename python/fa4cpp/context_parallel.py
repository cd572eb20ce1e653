"""Context parallelism: attention over a sequence sharded across the ranks of a torch.distributed
process group (ring attention). Each rank holds a shard of the queries, keys and values; the key
and value shards travel around the ring (torch.distributed point-to-point: NCCL between GPUs, gloo
between CPU processes), each rank runs fa4cpp's kernels on its queries against every shard as it
arrives, and merges the partial results by their log-sum-exps. The backward passes the shards
around again, with their dK / dV accumulators travelling beside them back to their owners.

    q, k, v = (shard_sequence(x, rank, world) for x in (q_full, k_full, v_full))
    out = ring_flash_attn_func(q, k, v, causal=True)          # this rank's rows of the output

Causal attention with `load_balance` (the default under a causal mask) cuts the sequence into
2·world chunks and gives rank r chunks r and 2·world − 1 − r, so that every rank does the same
work (the standard zig-zag layout); `shard_sequence` / `unshard_sequence` make and undo it.
Without load balancing rank r holds the r-th contiguous slice.

Precision: each ring step's partial O and gradients come back from the library in the inputs'
dtype and are merged in fp32, so bf16 / fp16 results carry one rounding per step more than a
single-device call (fp32 inputs: none that shows)."""
import torch
import torch.distributed as dist

__all__ = ["ring_flash_attn_func", "shard_sequence", "unshard_sequence"]


def _chunks(x, parts, seq_dim):
    if x.shape[seq_dim] % parts != 0:
        raise ValueError("the sequence length (%d) must be a multiple of %d to be sharded"
                         % (x.shape[seq_dim], parts))
    return x.chunk(parts, dim=seq_dim)


def shard_sequence(x, rank, world_size, *, seq_dim=1, load_balance=True):
    """This rank's shard of a full-sequence tensor: chunks rank and 2·world − 1 − rank of
    2·world_size equal chunks (load_balance), else the rank-th of world_size slices."""
    if load_balance:
        parts = _chunks(x, 2 * world_size, seq_dim)
        return torch.cat([parts[rank], parts[2 * world_size - 1 - rank]], dim=seq_dim)
    return _chunks(x, world_size, seq_dim)[rank]


def unshard_sequence(shards, *, seq_dim=1, load_balance=True):
    """The full-sequence tensor from every rank's shard, in rank order (shard_sequence undone)."""
    world = len(shards)
    if not load_balance:
        return torch.cat(shards, dim=seq_dim)
    parts = [None] * (2 * world)
    for rank, shard in enumerate(shards):
        first, second = shard.chunk(2, dim=seq_dim)
        parts[rank], parts[2 * world - 1 - rank] = first, second
    return torch.cat(parts, dim=seq_dim)


class _Ring:
    """The process group's ring: this rank, its size, and its neighbours' global ranks."""

    def __init__(self, group):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        to_global = ((lambda r: dist.get_global_rank(group, r)) if group is not None
                     else (lambda r: r))
        self.next = to_global((self.rank + 1) % self.size)
        self.prev = to_global((self.rank - 1) % self.size)

    def start_pass(self, tensors):
        """Sends `tensors` to the next rank and receives the previous rank's into new buffers;
        returns (buffers, a wait function)."""
        sent = [t.contiguous() for t in tensors]  # alive until the sends complete
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        requests = dist.batch_isend_irecv(ops)

        def wait():
            for request in requests:
                request.wait()
            del sent[:]
            return received
        return wait


def _steps(ring, causal, load_balance):
    """Per ring step: which rows of this rank's queries meet which keys of the shard it holds,
    and whether under a causal mask. Step s holds rank (rank − s)'s keys. Entries are
    (query_half, key_half, causal): a half of None is the whole shard, 0 / 1 its first / second
    chunk (load_balance); None for a step with nothing to compute."""
    steps = []
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        if not causal:
            steps.append((None, None, False))
        elif s == 0:
            # This rank's own chunks (load_balance: r and 2W − 1 − r, in order) under the causal
            # mask, aligned on their common diagonal: exactly the pairs the full mask allows.
            steps.append((None, None, True))
        elif not load_balance:
            steps.append((None, None, False) if src < ring.rank else None)
        elif src < ring.rank:
            # The shard's first chunk (src) precedes both of ours; its second follows both.
            steps.append((None, 0, False))
        else:
            # Both of the shard's chunks precede our second chunk and follow our first.
            steps.append((1, None, False))
    return steps


def _half(x, half, seq_dim):
    return x if half is None else x.chunk(2, dim=seq_dim)[half]


def _merge(out, lse, part_out, part_lse):
    """(out, lse) and a partial (out, lse) merged by their log-sum-exps; out fp32 (batch, rows,
    heads, dim), lse (batch, heads, rows). A row without keys has LSE +inf in the library's
    convention and weighs nothing here."""
    part_lse = torch.where(torch.isinf(part_lse) & (part_lse > 0),
                           torch.full_like(part_lse, float("-inf")), part_lse)
    part_out = part_out.float()
    if out is None:
        return part_out, part_lse
    new = torch.logaddexp(lse, part_lse)
    # exp(−inf − (−inf)) would be NaN for rows no shard has reached yet: both weights are 0 then.
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_part = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    return out * w_old + part_out * w_part, new


def _ring_forward(q, k, v, ring, steps, scale, softcap, deterministic):
    out = lse = None
    kv = (k, v)
    for s, step in enumerate(steps):
        wait = ring.start_pass(kv) if s + 1 < len(steps) else None
        if step is not None:
            q_half, k_half, causal = step
            part_out, part_lse = torch.ops.fa4cpp.fwd(
                _half(q, q_half, 1).contiguous(), _half(kv[0], k_half, 1).contiguous(),
                _half(kv[1], k_half, 1).contiguous(), scale, causal, -1, -1, softcap,
                deterministic)
            if q_half is None:
                out, lse = _merge(out, lse, part_out, part_lse)
            else:
                # Only our second chunk: its rows of (out, lse), the first chunk's unchanged.
                rows = q.shape[1] // 2
                if out is None:
                    out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float32)
                    lse = q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"),
                                     dtype=torch.float32)
                merged_out, merged_lse = _merge(out[:, rows:], lse[..., rows:], part_out,
                                                part_lse)
                out = torch.cat([out[:, :rows], merged_out], dim=1)
                lse = torch.cat([lse[..., :rows], merged_lse], dim=-1)
        if wait is not None:
            kv = tuple(wait())
    # Rows no key reached keep the library's convention: O = 0, LSE = +inf.
    lse = torch.where(torch.isinf(lse) & (lse < 0), torch.full_like(lse, float("inf")), lse)
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, ring, steps, scale, softcap, deterministic):
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    held = (k, v, dk, dv)  # a shard and its gradients' accumulators, travelling together
    for s, step in enumerate(steps):
        k_held, v_held, dk_held, dv_held = held
        if step is not None:
            q_half, k_half, causal = step
            rows = slice(None) if q_half is None else slice(q.shape[1] // 2, None)
            lse_rows = lse if q_half is None else lse[..., q.shape[1] // 2:]
            dq_p, dk_p, dv_p = torch.ops.fa4cpp.bwd(
                dout[:, rows].contiguous(), q[:, rows].contiguous(),
                _half(k_held, k_half, 1).contiguous(), _half(v_held, k_half, 1).contiguous(),
                out[:, rows].contiguous(), lse_rows.contiguous(), scale, causal, -1, -1, softcap,
                deterministic)
            dq[:, rows] += dq_p.float()
            keys = slice(None) if k_half is None else (
                slice(None, k.shape[1] // 2) if k_half == 0 else slice(k.shape[1] // 2, None))
            dk_held = dk_held.clone()
            dv_held = dv_held.clone()
            dk_held[:, keys] += dk_p.float()
            dv_held[:, keys] += dv_p.float()
        # The next step's shard arrives with its accumulators; after the last step only the
        # accumulators move, one rank on, to the shard's owner.
        if s + 1 < len(steps):
            held = tuple(ring.start_pass((k_held, v_held, dk_held, dv_held))())
        else:
            dk, dv = ring.start_pass((dk_held, dv_held))()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, softcap, load_balance, deterministic):
        ring = _Ring(group)
        steps = _steps(ring, causal, load_balance)
        out, lse = _ring_forward(q, k, v, ring, steps, scale, softcap, deterministic)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, steps, scale, softcap, deterministic)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


def ring_flash_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None, softcap=0.0,
                         load_balance=None, deterministic=False, return_lse=False):
    """Attention of this rank's queries against the whole sequence's keys and values, every rank
    of `group` (default: the default group) calling it together with its own shards.

    q: (batch, rows, heads_q, dim); k, v: (batch, rows, heads_kv, dim), rows the same on every
    rank (the shards of shard_sequence). Returns this rank's rows of the output (and, with
    return_lse, their fp32 LSE (batch, heads_q, rows)). Differentiable in q, k and v."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_flash_attn_func needs an initialised torch.distributed group")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k and v must be 4-D (batch, rows, heads, dim) shards")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError("q, k and v shards must have the same rows (self-attention of one "
                         "sharded sequence)")
    load_balance = causal if load_balance is None else bool(load_balance)
    if load_balance and q.shape[1] % 2 != 0:
        raise ValueError("with load_balance each shard holds two equal chunks: its rows (%d) must "
                         "be even" % q.shape[1])
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, float(softcap),
                                    load_balance, bool(deterministic))
    return (out, lse) if return_lse else out
