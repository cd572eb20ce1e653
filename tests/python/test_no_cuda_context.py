"""The CPU path leaves CUDA alone: attention on CPU tensors, in a CUDA build of the library on a
machine with a GPU, must not create a CUDA context (the library asks the driver, never the
runtime, which memory a pointer is in; a runtime query would create device 0's primary context:
hundreds of milliseconds and device memory in a process that never asked for the GPU).

Runs in a fresh interpreter, since this test process has long since created contexts."""
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

SCRIPT = textwrap.dedent("""
    import ctypes
    import torch
    import fa4cpp

    q, k, v = (torch.randn(1, 64, 2, 64) for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = fa4cpp.flash_attn_func(q, k, v, causal=True)
    out.sum().backward()
    assert torch.isfinite(out).all() and q.grad is not None

    cuda = ctypes.CDLL("libcuda.so.1")
    assert cuda.cuInit(0) == 0
    flags, active = ctypes.c_uint(), ctypes.c_int()
    assert cuda.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
    print("primary context active:", active.value)
    raise SystemExit(3 if active.value else 0)
""")


@pytest.mark.sm90
def test_cpu_attention_creates_no_cuda_context():
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    run = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, (
        "CPU attention left a CUDA context behind (or failed):\n" + run.stdout + run.stderr)
