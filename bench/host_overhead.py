"""Per-call host overhead of the fa4cpp Python layer.

Times, on tiny problems where the kernel costs next to nothing, the wall time per call of each
layer of the Python package, from the bare library call up to flash_attn_func with autograd:

    C call       lib.fa4_forward / fa4_backward through ctypes on structs built once: the floor
                 (the library's own host work plus the kernel)
    c_abi fwd    c_abi.Library.forward() on preallocated out / lse (builds the structs, asks for
                 the workspace size, calls the library)
    c_abi bwd    c_abi.Library.backward() likewise
    op fwd       torch.ops.fa4cpp.fwd (dispatcher, input checks, can_implement, allocation)
    noop op      a custom op of fwd's schema and autograd registration whose body only allocates
                 the outputs: what torch.library costs, the floor of op fwd
    op bwd       torch.ops.fa4cpp.bwd
    fa fwd       flash_attn_func, inputs without requires_grad
    fa fwd+bwd   flash_attn_func on inputs that require grad, then torch.autograd.grad

Each number is the median over --repeat runs of --number back-to-back calls (timeit-style, after
a warm-up, garbage collector off), in microseconds per call; the paths take turns run by run, so
that a slow spell of the machine falls on all of them. On CUDA tensors every run ends with a
synchronisation, so a number is the larger of the host and the device time per call. The layers'
differences are the Python cost of each layer; `--profile PATH` runs cProfile over one path instead
and prints where its time goes. `--clock cpu` times with the process's CPU time instead of the
wall clock: on a machine that other work shares, time spent descheduled then does not count (the
CPU backend runs in the calling thread with one worker, so its work does).

    FA4CPP_LIBRARY=build/default/libfa4.so PYTHONPATH=python python bench/host_overhead.py
    ... python bench/host_overhead.py --device cuda --dtypes bf16 --heads 1,8
    ... python bench/host_overhead.py --profile "fa fwd+bwd" --seqlens 16 --heads 8

The CPU backend starts its worker threads per call; FA4_CPU_THREADS defaults to 1 here (set it to
override) so that thread start-up does not hide the Python cost."""
import argparse
import cProfile
import ctypes
import gc
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("FA4_CPU_THREADS", "1")

import torch  # noqa: E402

import fa4cpp  # noqa: E402
from fa4cpp import _library, c_abi  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PATHS = ("C call", "c_abi fwd", "c_abi bwd", "noop op", "op fwd", "op bwd", "fa fwd",
         "fa fwd+bwd")


@torch.library.custom_op("fa4cpp_bench::noop", mutates_args=())
def _noop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, causal: bool,
          window_left: int, window_right: int, softcap: float,
          deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    b, s, h, _ = q.shape
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty((b, h, s), dtype=torch.float32)


_noop.register_autograd(lambda ctx, dout, dlse: (None,) * 9,
                        setup_context=lambda ctx, inputs, output: None)


def make_calls(device, dtype, seqlen, heads, head_dim):
    """{path: a no-argument function making one call} for one problem."""
    lib = _library.library()
    shape = (1, seqlen, heads, head_dim)
    q, k, v, dout = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    out, dq, dk, dv = (torch.empty(shape, device=device, dtype=dtype) for _ in range(4))
    lse = torch.empty((1, heads, seqlen), device=device, dtype=torch.float32)
    params = c_abi.Params()
    lib.forward(q, k, v, out, lse, params)  # out / lse valid for the backward calls

    # The floor: one ctypes call on structs, workspace and stream prepared outside the loop.
    backend = c_abi.backend_of(q.device)
    p = lib.problem(q, k, v, params)
    ft = lib._forward_tensors(q, k, v, out, lse)
    bt = lib._backward_tensors(dout, q, k, v, out, lse, dq, dk, dv)
    ws_f = lib._workspace(p, backend, c_abi.PASS_FORWARD, q.device)
    ws_b = lib._workspace(p, backend, c_abi.PASS_BACKWARD, q.device)
    stream = lib._stream(q.device)
    pp, pft, pbt = ctypes.byref(p), ctypes.byref(ft), ctypes.byref(bt)

    def c_call():
        lib.lib.fa4_forward(pp, pft, ws_f[1], ws_f[2], stream, backend)

    def c_call_bwd():
        lib.lib.fa4_backward(pp, pbt, ws_b[1], ws_b[2], stream, backend)

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fa_fwd_bwd():
        o = fa4cpp.flash_attn_func(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    op = torch.ops.fa4cpp
    return {
        "C call": c_call,
        "C call bwd": c_call_bwd,
        "c_abi fwd": lambda: lib.forward(q, k, v, out, lse, params),
        "c_abi bwd": lambda: lib.backward(dout, q, k, v, out, lse, dq, dk, dv, params),
        "noop op": lambda: torch.ops.fa4cpp_bench.noop(q, k, v, 0.0, False, -1, -1, 0.0, False),
        "op fwd": lambda: op.fwd(q, k, v, 0.0, False, -1, -1, 0.0, False),
        "op bwd": lambda: op.bwd(dout, q, k, v, out, lse, 0.0, False, -1, -1, 0.0, False),
        "fa fwd": lambda: fa4cpp.flash_attn_func(q, k, v),
        "fa fwd+bwd": fa_fwd_bwd,
    }


def time_calls(fns, number, repeat, sync, clock=time.perf_counter):
    """{name: median seconds per call} of each of fns ({name: function}) over `repeat` runs of
    `number` calls, after a warm-up run; the functions take turns run by run."""
    runs = {name: [] for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for fn in fns.values():
            for _ in range(number):
                fn()
        sync()
        for _ in range(repeat):
            for name, fn in fns.items():
                start = clock()
                for _ in range(number):
                    fn()
                sync()
                runs[name].append((clock() - start) / number)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(r) for name, r in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtypes", default=None, help="comma-separated: bf16, fp16, fp32 "
                    "(default: bf16,fp32 on cpu, bf16,fp16 on cuda)")
    ap.add_argument("--seqlens", default="1,16")
    ap.add_argument("--heads", default="1,8")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--number", type=int, default=200, help="calls per timed run")
    ap.add_argument("--repeat", type=int, default=15, help="timed runs (the median is reported)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: time.perf_counter; cpu: time.process_time (see above)")
    ap.add_argument("--paths", default=",".join(PATHS), help="which of: " + ", ".join(PATHS))
    ap.add_argument("--profile", metavar="PATH", default=None,
                    help="cProfile PATH (one of the paths) on the first problem instead of timing")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtypes = args.dtypes or ("bf16,fp16" if device.type == "cuda" else "bf16,fp32")
    dtypes = [DTYPES[d] for d in dtypes.split(",")]
    seqlens = [int(s) for s in args.seqlens.split(",")]
    heads = [int(h) for h in args.heads.split(",")]
    paths = args.paths.split(",")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    clock = time.perf_counter if args.clock == "wall" else time.process_time

    if args.profile:
        fn = make_calls(device, dtypes[0], seqlens[0], heads[0], args.head_dim)[args.profile]
        for _ in range(args.number):
            fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.number * args.repeat):
            fn()
        sync()
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(30)
        return

    print("fa4cpp %s, torch %s, %s, head dim %d, FA4_CPU_THREADS=%s; median of %d x %d calls, "
          "%s clock" % (fa4cpp.__version__, torch.__version__,
                        torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                        args.head_dim, os.environ.get("FA4_CPU_THREADS"), args.repeat,
                        args.number, args.clock))
    print("microseconds per call (C call: the bare library call, fwd / bwd)")
    header = "%-5s %4s %5s " % ("dtype", "seq", "heads") + "".join(
        "%12s" % p for p in paths)
    print(header)
    for dtype in dtypes:
        for seqlen in seqlens:
            for h in heads:
                calls = make_calls(device, dtype, seqlen, h, args.head_dim)
                timed = paths + (["C call bwd"] if "C call" in paths else [])
                us = time_calls({p: calls[p] for p in timed}, args.number, args.repeat, sync,
                                clock)
                cells = []
                for path in paths:
                    if path == "C call":
                        cells.append("%12s" % ("%.1f/%.1f" % (us[path] * 1e6,
                                                              us["C call bwd"] * 1e6)))
                    else:
                        cells.append("%12.1f" % (us[path] * 1e6))
                name = [k for k, v in DTYPES.items() if v == dtype][0]
                print("%-5s %4d %5d " % (name, seqlen, h) + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
