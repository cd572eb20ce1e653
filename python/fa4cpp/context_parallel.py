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

A packed batch (ring_flash_attn_varlen_func) shards every sequence the same way
(shard_varlen); each ring step is then one varlen call over every sequence's share.

A sliding window (window_size) turns each pair of a query chunk and a key chunk into one call of
the library on the rows and keys the window joins, under that block's own window.

Attention sinks (gpt-oss's learnable sinks: one logit per query head that joins every row's
softmax denominator without a value) join once, after the last step's merge; their gradient is
this rank's rows' share (sum it over the group, as for any parameter the ranks replicate).

Precision: each ring step's partial O and gradients come back from the library in the inputs'
dtype and are merged in fp32, so bf16 / fp16 results carry one rounding per step more than a
single-device call (fp32 inputs: none that shows)."""
import torch
import torch.distributed as dist

__all__ = ["ring_flash_attn_func", "ring_flash_attn_varlen_func", "shard_sequence",
           "unshard_sequence", "shard_varlen", "unshard_varlen"]


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


def shard_varlen(x, cu_seqlens, rank, world_size, *, load_balance=True, seq_dim=0):
    """This rank's shard of a packed batch (sequences one after another along seq_dim, where
    cu_seqlens says): every sequence cut as shard_sequence cuts one, the shards packed in turn.
    Returns (shard, the shards' cu_seqlens), the latter the same on every rank."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    parts = [shard_sequence(x.narrow(seq_dim, a, b - a), rank, world_size, seq_dim=seq_dim,
                            load_balance=load_balance) for a, b in zip(cu[:-1], cu[1:])]
    local = [0]
    for part in parts:
        local.append(local[-1] + part.shape[seq_dim])
    return (torch.cat(parts, dim=seq_dim),
            torch.tensor(local, dtype=torch.int32, device=cu_seqlens.device))


def unshard_varlen(shards, cu_seqlens, *, load_balance=True, seq_dim=0):
    """The packed batch from every rank's shard (shard_varlen undone); cu_seqlens: the shards'."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    return torch.cat([unshard_sequence([t.narrow(seq_dim, a, b - a) for t in shards],
                                       seq_dim=seq_dim, load_balance=load_balance)
                      for a, b in zip(cu[:-1], cu[1:])], dim=seq_dim)


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


_FAR = 1 << 62  # an unbounded window side, as a key offset


def _steps(ring, rows, causal, load_balance):
    """Per ring step (step s holds rank (rank − s)'s keys): the blocks to compute, each
    (q0, q1, k0, k1, window_left, window_right): rows [q0, q1) of this rank's queries against
    rows [k0, k1) of the shard held, under the library's window (−1: unbounded; causal is
    (−1, 0)). A step without blocks computes nothing."""
    steps = []
    half = rows // 2
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        if not causal:
            steps.append([(0, rows, 0, rows, -1, -1)])
        elif s == 0:
            # This rank's own chunks (load_balance: r and 2W − 1 − r, in order) under the causal
            # mask, aligned on their common diagonal: exactly the pairs the full mask allows.
            steps.append([(0, rows, 0, rows, -1, 0)])
        elif not load_balance:
            steps.append([(0, rows, 0, rows, -1, -1)] if src < ring.rank else [])
        elif src < ring.rank:
            # The shard's first chunk (src) precedes both of ours; its second follows both.
            steps.append([(0, rows, 0, half, -1, -1)])
        else:
            # Both of the shard's chunks precede our second chunk and follow our first.
            steps.append([(half, rows, 0, rows, -1, -1)])
    return steps


def _window_steps(ring, rows, load_balance, left, right):
    """_steps for a sliding window: key j_g visible to query i_g when i_g − left ≤ j_g ≤
    i_g + right (global positions; −1: that side unbounded). Each pair of a query chunk and a key
    chunk becomes one block, cut to the rows that see a key and the keys some row sees, so that
    the band is the library's window of that block (both sides ≥ 0 or unbounded)."""
    chunks = 2 if load_balance else 1
    size = rows // chunks

    def chunk_ids(rank):
        return (rank, 2 * ring.size - 1 - rank) if load_balance else (rank,)

    steps = []
    for s in range(ring.size):
        src = (ring.rank - s) % ring.size
        blocks = []
        for qi, cq in enumerate(chunk_ids(ring.rank)):
            for ki, ck in enumerate(chunk_ids(src)):
                # Within the pair, key j is visible to row i when i + lo ≤ j ≤ i + hi.
                d = (cq - ck) * size
                lo = d - left if left >= 0 else -_FAR
                hi = d + right if right >= 0 else _FAR
                r0, r1 = max(0, -hi), min(size, size - lo)
                k0, k1 = max(0, lo), min(size, size + hi)
                if r0 >= r1 or k0 >= k1:
                    continue
                # The block's diagonal offset is (k1 − k0) − (r1 − r0): its window sides are the
                # band's edges from there.
                diag = (k1 - k0) - (r1 - r0)
                wl = diag - (lo + r0 - k0) if left >= 0 else -1
                wr = (hi + r0 - k0) - diag if right >= 0 else -1
                blocks.append((qi * size + r0, qi * size + r1, ki * size + k0, ki * size + k1,
                               wl, wr))
        steps.append(blocks)
    return steps


def _merge(out, lse, part_out, part_lse):
    """(out, lse) and a partial (out, lse) merged by their log-sum-exps; out fp32 (batch, rows,
    heads, dim), lse (batch, heads, rows), −inf for rows nothing has reached. A row without keys
    has LSE +inf in the library's convention and weighs nothing here."""
    part_lse = torch.where(torch.isinf(part_lse) & (part_lse > 0),
                           torch.full_like(part_lse, float("-inf")), part_lse)
    new = torch.logaddexp(lse, part_lse)
    # exp(−inf − (−inf)) would be NaN for rows no shard has reached yet: both weights are 0 then.
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    w_part = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    return out * w_old + part_out.float() * w_part, new


def _join_sinks(out, lse, sinks):
    """The sinks' logits (fp32, heads_q) joined to a merged (out fp32, lse): each row's
    denominator gains exp(sinks[h]) and O shrinks by the keys' share of it. A row no key reached
    (LSE −inf here) gets LSE = sinks[h] and keeps O = 0."""
    total = torch.logaddexp(lse, sinks.view(1, -1, 1).to(lse.dtype))
    return out * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1), total


def _cut(ring, rows, causal, window, load_balance):
    """The blocks of every ring step over shards of `rows` rows: _window_steps under a window,
    else _steps."""
    if window is not None:
        return _window_steps(ring, rows, load_balance, *window)
    return _steps(ring, rows, causal, load_balance)


class _Dense:
    """Shards of one length per batch entry, (batch, rows, heads, dim): a block's rows are a slice
    of dim 1, and each block is one call of the library's fixed-length ops. plan() gives every
    ring step's blocks as (query rows, key rows, window left, window right), each rows a
    (selector of the accumulators' rows, what the call needs besides)."""

    def __init__(self, scale, softcap, deterministic):
        self.args = (scale, softcap, deterministic)

    def plan(self, ring, q, causal, window, load_balance):
        return [[(self.rows(q0, q1), self.rows(k0, k1), wl, wr) for q0, q1, k0, k1, wl, wr in step]
                for step in _cut(ring, self.step_rows(q), causal, window, load_balance)]

    @staticmethod
    def step_rows(q):
        """The rows _steps and _window_steps cut into blocks."""
        return q.shape[1]

    @staticmethod
    def rows(lo, hi):
        return slice(lo, hi), None

    def fwd(self, q, k, v, q_rows, k_rows, wl, wr):
        scale, softcap, deterministic = self.args
        qr, kr = q_rows[0], k_rows[0]
        return torch.ops.fa4cpp.fwd(q[:, qr].contiguous(), k[:, kr].contiguous(),
                                    v[:, kr].contiguous(), scale, False, wl, wr, softcap,
                                    deterministic)

    def bwd(self, dout, q, k, v, out, lse, q_rows, k_rows, wl, wr):
        scale, softcap, deterministic = self.args
        qr, kr = q_rows[0], k_rows[0]
        take = (lambda x, r: x[:, r].contiguous())
        return torch.ops.fa4cpp.bwd(take(dout, qr), take(q, qr), take(k, kr), take(v, kr),
                                    take(out, qr), lse[..., qr].contiguous(), scale, False, wl,
                                    wr, softcap, deterministic)


class _Packed(_Dense):
    """Varlen shards: every sequence's shard packed, (1, total, heads, dim) here (the library's
    (total, heads, dim) with a batch of one in front, so that the ring's merges and accumulators
    are the dense ones). A block's rows are row ranges of several sequences: an index over the
    packed rows, with the block's cu_seqlens and longest range. Without a window, blocks come
    from _steps over rows 2 (halves), each sequence's same share of its own rows, so a step is
    one varlen call. With one, each sequence's chunks are cut by _window_steps over its own rows;
    a block's window depends on the sequence's chunk length, so a step makes one varlen call per
    window and pair of chunks among the batch's sequences (a pair's ranges never share a row, so
    the merge and the accumulators see each row once per call). cu: the shards' offsets as a list
    (read from the device once)."""

    def __init__(self, cu, device, scale, softcap, deterministic):
        super().__init__(scale, softcap, deterministic)
        self.cu = cu
        self.device = device

    def plan(self, ring, q, causal, window, load_balance):
        if window is None:
            return super().plan(ring, q, causal, window, load_balance)
        chunks = 2 if load_balance else 1
        bounds = list(zip(self.cu[:-1], self.cu[1:]))
        cut = [_window_steps(ring, end - start, load_balance, *window) for start, end in bounds]
        steps = []
        for s in range(ring.size):
            calls = {}  # (window left, window right, query chunk, key chunk) -> the ranges
            for (start, end), seq in zip(bounds, cut):
                size = (end - start) // chunks
                for q0, q1, k0, k1, wl, wr in seq[s]:
                    ranges = calls.setdefault((wl, wr, q0 // size, k0 // size), ([], []))
                    ranges[0].append((start + q0, start + q1))
                    ranges[1].append((start + k0, start + k1))
            steps.append([(self._select(qr), self._select(kr), wl, wr)
                          for (wl, wr, _, _), (qr, kr) in calls.items()])
        return steps

    @staticmethod
    def step_rows(q):
        return 2  # halves of every sequence

    def rows(self, lo, hi):
        return self._select([(start + (end - start) * lo // 2, start + (end - start) * hi // 2)
                             for start, end in zip(self.cu[:-1], self.cu[1:])])

    def _select(self, ranges):
        """Row ranges [a, b) of the packed rows as (their index, (their cu_seqlens, longest))."""
        cu = [0]
        for a, b in ranges:
            cu.append(cu[-1] + b - a)
        index = torch.cat([torch.arange(a, b) for a, b in ranges])
        longest = max(b - a for a, b in ranges)
        return (index.to(self.device),
                (torch.tensor(cu, dtype=torch.int32, device=self.device), longest))

    def fwd(self, q, k, v, q_rows, k_rows, wl, wr):
        scale, softcap, deterministic = self.args
        (qi, (cu_q, max_q)), (ki, (cu_k, max_k)) = q_rows, k_rows
        out, lse = torch.ops.fa4cpp.varlen_fwd(q[0, qi], k[0, ki], v[0, ki], cu_q, cu_k, max_q,
                                               max_k, None, scale, False, wl, wr, softcap,
                                               deterministic)
        return out.unsqueeze(0), lse.unsqueeze(0)

    def bwd(self, dout, q, k, v, out, lse, q_rows, k_rows, wl, wr):
        scale, softcap, deterministic = self.args
        (qi, (cu_q, max_q)), (ki, (cu_k, max_k)) = q_rows, k_rows
        grads = torch.ops.fa4cpp.varlen_bwd(dout[0, qi], q[0, qi], k[0, ki], v[0, ki], out[0, qi],
                                            lse[0][:, qi].contiguous(), cu_q, cu_k, max_q, max_k,
                                            None, scale, False, wl, wr, softcap, deterministic)
        return tuple(g.unsqueeze(0) for g in grads)


def _ring_forward(q, k, v, ring, steps, layout, sinks=None):
    out = q.new_zeros(q.shape[:3] + (v.shape[-1],), dtype=torch.float32)
    lse = q.new_full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32)
    kv = (k, v)
    for s, blocks in enumerate(steps):
        wait = ring.start_pass(kv) if s + 1 < len(steps) else None
        for q_rows, k_rows, wl, wr in blocks:
            part_out, part_lse = layout.fwd(q, kv[0], kv[1], q_rows, k_rows, wl, wr)
            r = q_rows[0]
            out[:, r], lse[..., r] = _merge(out[:, r], lse[..., r], part_out, part_lse)
        if wait is not None:
            kv = tuple(wait())
    if sinks is not None:
        return _join_sinks(out, lse, sinks)
    # Rows no key reached keep the library's convention: O = 0, LSE = +inf.
    lse = torch.where(torch.isinf(lse) & (lse < 0), torch.full_like(lse, float("inf")), lse)
    return out, lse


def _sinks_grad(dout, out, lse, sinks):
    """d(sinks) of this rank's rows: −Σ over a head's rows of exp(sinks[h] − LSE)·rowsum(dO ∘ O)
    (the sink's probability times D, as the library's backward defines it)."""
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, rows)
    share = torch.exp(sinks.view(1, -1, 1) - lse)
    return -(share * d).sum(dim=(0, 2))


def _ring_backward(dout, q, k, v, out, lse, ring, steps, layout):
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    held = (k, v, dk, dv)  # a shard and its gradients' accumulators, travelling together
    for s, blocks in enumerate(steps):
        k_held, v_held, dk_held, dv_held = held
        if blocks:
            dk_held = dk_held.clone()
            dv_held = dv_held.clone()
        for q_rows, k_rows, wl, wr in blocks:
            dq_p, dk_p, dv_p = layout.bwd(dout, q, k_held, v_held, out, lse, q_rows, k_rows, wl,
                                          wr)
            r, c = q_rows[0], k_rows[0]
            dq[:, r] += dq_p.float()
            dk_held[:, c] += dk_p.float()
            dv_held[:, c] += dv_p.float()
        # The next step's shard arrives with its accumulators; after the last step only the
        # accumulators move, one rank on, to the shard's owner.
        if s + 1 < len(steps):
            held = tuple(ring.start_pass((k_held, v_held, dk_held, dv_held))())
        else:
            dk, dv = ring.start_pass((dk_held, dv_held))()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, causal, window, layout, load_balance):
        ring = _Ring(group)
        steps = layout.plan(ring, q, causal, window, load_balance)
        out, lse = _ring_forward(q, k, v, ring, steps, layout, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (ring, steps, layout)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        # With sinks the LSE holds the sink's share, so each step's P = exp(s − LSE) is the
        # whole softmax's and the library's backward needs no sinks of its own.
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, *ctx.args)
        dsinks = _sinks_grad(dout, out, lse, sinks) if sinks is not None else None
        return dq, dk, dv, dsinks, None, None, None, None, None


def _check_group(q, k, v, dims):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring attention needs an initialised torch.distributed group")
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise ValueError("q, k and v must be %d-D shards" % dims)


def _check_sinks(q, sinks):
    heads = q.shape[-2]  # (batch, rows, heads, dim) or packed (total, heads, dim)
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (heads,)
                              or sinks.device != q.device):
        raise ValueError("sinks must be a float32 tensor of shape (heads_q,) = (%d,) on %s (got %s "
                         "%s on %s)" % (heads, q.device, sinks.dtype, tuple(sinks.shape),
                                        sinks.device))


def _window(causal, window_size):
    """The window's (left, right) for _window_steps, or None for the plain full or causal ring."""
    left, right = (int(x) for x in window_size)
    if left < -1 or right < -1:
        raise ValueError("window_size sides must be -1 (unbounded) or >= 0 (got %r)"
                         % (tuple(window_size),))
    if causal:
        right = 0
    # A causal mask without a left side is the plain causal ring.
    return None if left < 0 and (right < 0 or causal) else (left, right)


def ring_flash_attn_func(q, k, v, *, group=None, causal=False, softmax_scale=None,
                         window_size=(-1, -1), softcap=0.0, load_balance=None,
                         deterministic=False, return_lse=False, sinks=None):
    """Attention of this rank's queries against the whole sequence's keys and values, every rank
    of `group` (default: the default group) calling it together with its own shards.

    q: (batch, rows, heads_q, dim); k, v: (batch, rows, heads_kv, dim), rows the same on every
    rank (the shards of shard_sequence). window_size: (left, right) as flash_attn's, over the
    whole sequence's positions (−1: unbounded; causal makes right 0). sinks: optional fp32
    (heads_q,) attention-sink logits, the same on every rank. Returns this rank's rows of the
    output (and, with return_lse, their fp32 LSE (batch, heads_q, rows), the sinks' share
    included). Differentiable in q, k, v and sinks (this rank's rows' share of d(sinks))."""
    _check_group(q, k, v, 4)
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError("q, k and v shards must have the same rows (self-attention of one "
                         "sharded sequence)")
    load_balance = causal if load_balance is None else bool(load_balance)
    if load_balance and q.shape[1] % 2 != 0:
        raise ValueError("with load_balance each shard holds two equal chunks: its rows (%d) must "
                         "be even" % q.shape[1])
    _check_sinks(q, sinks)
    window = _window(causal, window_size)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    layout = _Dense(scale, float(softcap), bool(deterministic))
    out, lse = _RingAttention.apply(q, k, v, sinks, group, bool(causal), window, layout,
                                    load_balance)
    return (out, lse) if return_lse else out


def ring_flash_attn_varlen_func(q, k, v, cu_seqlens, *, group=None, causal=False,
                                softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                                load_balance=None, deterministic=False, return_lse=False,
                                sinks=None):
    """ring_flash_attn_func for a packed batch of sequences, each sharded over the group as
    shard_varlen cuts it: q (total, heads_q, dim), k, v (total, heads_kv, dim) this rank's
    shards packed, cu_seqlens (int32, batch + 1) their offsets, the same on every rank. Returns
    this rank's rows of the output (total, heads_q, dim_v) (and, with return_lse, their fp32 LSE
    (heads_q, total)). window_size: as ring_flash_attn_func's, over each sequence's own
    positions. Each ring step is one varlen call of the library over every sequence's share of
    its rows (under a window, one per distinct block window among the sequences)."""
    _check_group(q, k, v, 3)
    if k.shape[0] != q.shape[0] or v.shape[0] != q.shape[0]:
        raise ValueError("q, k and v shards must have the same rows (self-attention of the packed "
                         "sequences)")
    cu = [int(c) for c in cu_seqlens.tolist()] if cu_seqlens.dim() == 1 else []
    if cu_seqlens.dtype != torch.int32 or not cu or cu[-1] != q.shape[0]:
        raise ValueError("cu_seqlens must be int32 (batch + 1) offsets ending at the shards' rows "
                         "(%d)" % q.shape[0])
    load_balance = causal if load_balance is None else bool(load_balance)
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    if load_balance and any(n % 2 for n in lengths):
        raise ValueError("with load_balance each sequence's shard holds two equal chunks: its rows "
                         "must be even (got %s)" % lengths)
    _check_sinks(q, sinks)
    window = _window(causal, window_size)
    scale = float(softmax_scale) if softmax_scale is not None else q.shape[-1] ** -0.5
    layout = _Packed(cu, cu_seqlens.device, scale, float(softcap), bool(deterministic))
    out, lse = _RingAttention.apply(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), sinks, group,
                                    bool(causal), window, layout, load_balance)
    out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
