"""The decode loop of examples/decode_loop.py: a small Llama-style GQA model (transformers,
random weights) prefilling varlen prompts and decoding 64 greedy steps through
flash_attn_with_kvcache on a paged KV cache, checked at every generated position against the same
model run by transformers in fp32 on SDPA's math backend (the rule: decode_loop.
checked_against_reference). On CPU in fp32; on the H200 in bf16, eagerly and replaying a captured
CUDA graph."""
import os
import sys

import pytest
import torch

import fa4cpp

pytest.importorskip("transformers", reason="needs transformers (FA4_PYTHON_DEPS=1 "
                    "scripts/install_deps.sh installs the pinned version)")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import decode_loop  # noqa: E402


def _prompts(model, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
            for n in lengths]


def _run(lengths, steps, page_size, dtype, device, cuda_graph=False, tolerance=1e-3, **model):
    model_args = model
    model = decode_loop.small_llama(**model_args)
    prompts = _prompts(model, lengths)
    generated, logits, _ = decode_loop.generate(model, prompts, steps, page_size, dtype, device,
                                                cuda_graph)
    assert generated.shape == (len(lengths), steps)
    reference = decode_loop.reference_logits(decode_loop.small_llama(**model_args), prompts,
                                             generated.cpu())
    return decode_loop.checked_against_reference(logits.cpu(), generated.cpu(), reference,
                                                 tolerance)


@pytest.mark.parametrize("page_size", [16, 7])
def test_cpu_decode_loop_matches_transformers(page_size):
    worst = _run([32, 29, 5], 64, page_size, torch.float32, "cpu")
    assert worst < 1e-4


def test_the_check_catches_a_wrong_rotary(monkeypatch):
    """The comparison fails when the loop rotates keys the wrong way (GPT-J pairs for Llama's)."""
    real = fa4cpp.flash_attn_with_kvcache

    def gptj(*args, **kwargs):
        kwargs["rotary_interleaved"] = True
        return real(*args, **kwargs)
    monkeypatch.setattr(decode_loop.fa4cpp, "flash_attn_with_kvcache", gptj)
    with pytest.raises(AssertionError, match="logits differ"):
        _run([12, 9], 8, 16, torch.float32, "cpu")


@pytest.mark.sm90
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_decode_loop_matches_transformers(cuda_graph):
    # bf16 activations against an fp32 reference: logits within 0.25 over a vocabulary of 512.
    # Head dim 128 (the sm90 kernels start at 64), pages of 128 keys (whole key tiles).
    _run([64, 33, 17, 1] * 16, 64, 128, torch.bfloat16, "cuda", cuda_graph, tolerance=0.25,
         hidden=1024, heads=8, kv_heads=2)
