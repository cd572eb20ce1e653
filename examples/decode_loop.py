"""A serving engine's decode loop on fa4cpp: a small Llama-style GQA model (transformers'
LlamaConfig, random weights) generating greedily from a paged KV cache that a minimal block
allocator manages, every attention a call of fa4cpp.flash_attn_with_kvcache — the new keys and
values appended to the cache and rotated (rotary embedding) inside the call.

    PYTHONPATH=python python examples/decode_loop.py --device cpu --batch 4 --steps 64
    PYTHONPATH=python python examples/decode_loop.py --device cuda --batch 64 --cuda-graph

The prompt is prefilled in one varlen call per layer (each sequence's tokens packed, cu_seqlens);
then each decode step runs one token per sequence. With --cuda-graph the decode step is captured
once and replayed: each step copies the new tokens into the graph's input, and the cache lengths
and the page table (a new page whenever a sequence crosses a page boundary), which live in fixed
tensors, change in place between replays.
--check compares every generated position with the same model run by transformers in fp32 on
SDPA's math backend (checked_against_reference says how)."""
import argparse
import math
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import LlamaConfig, LlamaForCausalLM

import fa4cpp


def small_llama(seed=0, layers=2, hidden=256, heads=8, kv_heads=2, vocab=512):
    """A random-weight Llama-style model: GQA heads / kv_heads, head dim hidden / heads."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=4096,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


class BlockAllocator:
    """Pages of the KV cache handed out from a free list; a sequence's pages need not be
    contiguous or in order."""

    def __init__(self, num_pages, seed=0):
        # Shuffled, so that sequences get scattered pages as in a long-running engine.
        order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
        self.free = order.tolist()

    def allocate(self):
        if not self.free:
            raise RuntimeError("the KV cache is full")
        return self.free.pop()


class PagedKvCache:
    """Per layer, K and V pages (num_pages, page_size, kv_heads, head_dim); per sequence, its
    length and its row of the page table. lengths and page_table are fixed tensors updated in
    place, so that a captured decode step reads their current values."""

    def __init__(self, model, batch, max_len, page_size, dtype, device):
        config = model.config
        self.page_size = page_size
        self.pages_per_seq = -(-max_len // page_size)
        num_pages = batch * self.pages_per_seq + 8
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (num_pages, page_size, config.num_key_value_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device)
                  for _ in range(config.num_hidden_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.allocator = BlockAllocator(num_pages)
        self.pages = [[] for _ in range(batch)]
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(batch, self.pages_per_seq, dtype=torch.int32, device=device)
        self.host_lengths = [0] * batch

    def reserve(self, new_tokens):
        """Pages for each sequence's next new_tokens[b] rows, written into the page table."""
        changed = False
        for b, n in enumerate(new_tokens):
            need = -(-(self.host_lengths[b] + n) // self.page_size)
            while len(self.pages[b]) < need:
                self.pages[b].append(self.allocator.allocate())
                changed = True
        if changed:
            table = torch.zeros_like(self.page_table, device="cpu")
            for b, pages in enumerate(self.pages):
                table[b, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
            self.page_table.copy_(table)

    def advance(self, new_tokens):
        for b, n in enumerate(new_tokens):
            self.host_lengths[b] += n
        self.lengths.copy_(torch.tensor(self.host_lengths, dtype=torch.int32))


class Fa4Llama:
    """The model's layers with attention through fa4cpp over a PagedKvCache (`attention`: a
    function with flash_attn_with_kvcache's arguments; fa4cpp's by default)."""

    def __init__(self, model, dtype, device, attention=None):
        self.attention = attention or fa4cpp.flash_attn_with_kvcache
        self.model = model.to(device=device, dtype=dtype)
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        rotary = self.model.model.rotary_emb
        positions = torch.arange(config.max_position_embeddings, device=device,
                                 dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)
        scaling = rotary.attention_scaling
        # fa4cpp's rotary tables: (positions, head_dim / 2), GPT-NeoX pairs (i, i + head_dim / 2),
        # as Llama rotates.
        self.cos = (freqs.cos() * scaling).to(dtype)
        self.sin = (freqs.sin() * scaling).to(dtype)

    def _attention(self, layer, index, x, cache, varlen):
        attn = layer.self_attn
        lead = x.shape[:-1]
        q = attn.q_proj(x).view(*lead, self.heads, self.head_dim)
        k = attn.k_proj(x).view(*lead, self.kv_heads, self.head_dim)
        v = attn.v_proj(x).view(*lead, self.kv_heads, self.head_dim)
        extra = {}
        if varlen is not None:
            cu_seqlens, max_len = varlen
            extra = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k_new=cu_seqlens,
                         max_seqlen_q=max_len)
        out = self.attention(
            q, cache.k[index], cache.v[index], k=k, v=v, rotary_cos=self.cos,
            rotary_sin=self.sin, cache_seqlens=cache.lengths, page_table=cache.page_table,
            causal=True, rotary_interleaved=False, **extra)
        return attn.o_proj(out.reshape(*lead, self.heads * self.head_dim))

    def forward(self, tokens, cache, varlen=None):
        """Logits of every token; tokens (total,) packed with varlen = (cu_seqlens, max_len), or
        (batch, 1). The cache's lengths are those before these tokens."""
        inner = self.model.model
        x = inner.embed_tokens(tokens)
        for index, layer in enumerate(inner.layers):
            x = x + self._attention(layer, index, layer.input_layernorm(x), cache, varlen)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x))


@torch.no_grad()
def generate(model, prompts, steps, page_size=16, dtype=torch.float32, device="cpu",
             cuda_graph=False, attention=None):
    """Greedy decoding of `steps` tokens after each prompt (a list of token lists). Returns the
    generated tokens (batch, steps), each step's logits (batch, steps, vocab) in fp32, and the
    decode steps' seconds. `attention`: Fa4Llama's."""
    batch = len(prompts)
    fa4 = Fa4Llama(model, dtype, device, attention)
    cache = PagedKvCache(model, batch, max(map(len, prompts)) + steps, page_size, dtype, device)
    lens = [len(p) for p in prompts]
    cache.reserve(lens)
    tokens = torch.tensor([t for p in prompts for t in p], device=device)
    cu_seqlens = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                              device=device)
    logits = fa4.forward(tokens, cache, (cu_seqlens, max(lens)))
    cache.advance(lens)
    last = logits[cu_seqlens[1:].long() - 1]  # each sequence's last prompt token
    generated, all_logits = [], []
    step_input = torch.empty(batch, 1, dtype=torch.long, device=device)
    graph = None
    if cuda_graph:
        cache.reserve([1] * batch)  # the first step's pages, before the warm-up and capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up outside the graph, as capture requires
            step_input.copy_(last.argmax(-1, keepdim=True))
            fa4.forward(step_input, _scratch_cache(cache))
        torch.cuda.current_stream().wait_stream(stream)
    start = None
    for step in range(steps):
        next_tokens = last.float().argmax(-1)
        generated.append(next_tokens)
        all_logits.append(last.float())
        if step == steps - 1:
            break
        step_input.copy_(next_tokens[:, None])
        if graph is None and cuda_graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_logits = fa4.forward(step_input, cache)
        if start is None:
            _sync(device)
            start = time.perf_counter()
        # A new page where a sequence crosses a page boundary: the page table changes in place,
        # and a replayed graph reads the new table.
        cache.reserve([1] * batch)
        if graph is not None:
            graph.replay()
            out = static_logits
        else:
            out = fa4.forward(step_input, cache)
        cache.advance([1] * batch)
        last = out[:, -1].clone()
    _sync(device)
    seconds = time.perf_counter() - start if start is not None else 0.0
    return torch.stack(generated, 1), torch.stack(all_logits, 1), seconds


def _scratch_cache(cache):
    """A throw-away copy of the cache for a warm-up call (the real cache is left unchanged)."""
    scratch = PagedKvCache.__new__(PagedKvCache)
    scratch.__dict__.update(cache.__dict__)
    scratch.k = [k.clone() for k in cache.k]
    scratch.v = [v.clone() for v in cache.v]
    scratch.lengths = cache.lengths.clone()
    return scratch


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def reference_logits(model, prompts, generated):
    """The logits transformers computes in fp32 on SDPA's math backend, at every generated
    position, given the same tokens (teacher forcing): (batch, steps, vocab)."""
    model = model.float()
    out = []
    with sdpa_kernel(SDPBackend.MATH):
        for prompt, tokens in zip(prompts, generated.tolist()):
            ids = torch.tensor(prompt + tokens[:-1], device=model.device)[None]
            logits = model(ids).logits[0].float()
            out.append(logits[len(prompt) - 1:])
    return torch.stack(out)


def checked_against_reference(logits, generated, reference, tolerance):
    """The test's rule: every generated position's logits within `tolerance` (absolute) of the
    reference's, and every greedy token the reference's argmax, except where the reference's two
    best logits are within 2·tolerance of each other (a near-tie either side may break). Returns
    the largest logit difference; raises AssertionError with the position otherwise."""
    error = (logits - reference).abs().amax(-1)
    worst = float(error.max())
    if worst > tolerance:
        b, t = divmod(int(error.argmax()), error.shape[1])
        raise AssertionError("logits differ by %.3g > %.3g at sequence %d, step %d"
                             % (worst, tolerance, b, t))
    top2 = reference.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    wrong = (generated != reference.argmax(-1)) & (margin > 2 * tolerance)
    if wrong.any():
        b, t = [int(i) for i in wrong.nonzero()[0]]
        raise AssertionError("sequence %d, step %d: token %d, the reference's %d (margin %.3g)"
                             % (b, t, int(generated[b, t]), int(reference[b, t].argmax()),
                                float(margin[b, t])))
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                    help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32, help="the longest prompt's tokens")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--cuda-graph", action="store_true")
    ap.add_argument("--check", action="store_true",
                    help="compare with transformers in fp32 (SDPA math backend)")
    args = ap.parse_args()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    model = small_llama()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (max(1, args.prompt - 3 * b),),
                             generator=g).tolist() for b in range(args.batch)]
    generated, logits, seconds = generate(model, prompts, args.steps, args.page_size, dtype,
                                          args.device, args.cuda_graph)
    decoded = args.batch * (args.steps - 1)
    print("%d sequences, %d decode steps: %.1f tokens/s (%.3f ms per step)%s"
          % (args.batch, args.steps - 1, decoded / seconds if seconds else math.nan,
             1e3 * seconds / max(1, args.steps - 1), ", CUDA graph" if args.cuda_graph else ""))
    if args.check:
        reference = reference_logits(small_llama(), prompts, generated.cpu()).to(logits.device)
        tolerance = 1e-3 if dtype == torch.float32 else 0.25
        worst = checked_against_reference(logits, generated, reference, tolerance)
        print("matches the fp32 reference: largest logit difference %.3g (tolerance %.3g)"
              % (worst, tolerance))


if __name__ == "__main__":
    main()
