"""Per-call host overhead of the fa4cpp Python layer, beside FlashAttention-3's op and SDPA's flash op.

Times, on tiny problems where the kernel costs next to nothing, the wall time per call of each
path from the bare library call up to a flash_attn_func forward + backward:

    C call       lib.fa4_forward / fa4_backward through ctypes on structs built once: the floor
                 (the library's own host work plus the kernel), forward / backward
    op fwd       torch.ops.fa4cpp.fwd: the native op when it is loaded (fa4cpp.ops.native_ops())
    op bwd       torch.ops.fa4cpp.bwd
    py op fwd    the package's Python implementation of the op (fa4cpp::fwd_py, ctypes), which
    py op bwd    serves the ops where the native ops are not built; absent without them
    fa fwd       fa4cpp.flash_attn_func, inputs without requires_grad
    fa fwd+bwd   fa4cpp.flash_attn_func on inputs that require grad, then torch.autograd.grad
    fa3 fwd      FlashAttention-3's flash_attn_func (flash_attn_interface, when it imports; CUDA)
    fa3 fwd+bwd  likewise with the backward
    sdpa fwd     F.scaled_dot_product_attention restricted to the flash backend ((b, h, s, d)
    sdpa fwd+bwd views of the same tensors); likewise with the backward

Each number is the median over --repeat runs of --number back-to-back calls (timeit-style, after
a warm-up, garbage collector off), in microseconds per call; the paths take turns run by run, so
that a slow spell of the machine falls on all of them. On CUDA tensors every run ends with a
synchronisation, so a number is the larger of the host and the device time per call. `--profile
PATH` runs cProfile over one path instead and prints where its time goes. `--clock cpu` times with
the process's CPU time instead of the wall clock: on a machine that other work shares, time spent
descheduled then does not count (the CPU backend runs in the calling thread with one worker, so
its work does). `--out DIR --sha SHA` also writes DIR/host_overhead.json and .md.

    FA4CPP_LIBRARY=build/default/libfa4.so PYTHONPATH=python python bench/host_overhead.py
    ... python bench/host_overhead.py --device cuda --dtypes bf16 --heads 1,8
    ... python bench/host_overhead.py --profile "fa fwd+bwd" --seqlens 16 --heads 8

The CPU backend starts its worker threads per call; FA4_CPU_THREADS defaults to 1 here (set it to
override) so that thread start-up does not hide the Python cost."""
import argparse
import cProfile
import ctypes
import datetime
import gc
import json
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("FA4_CPU_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import fa4cpp  # noqa: E402
from fa4cpp import _library, c_abi, ops  # noqa: E402

try:
    import flash_attn_interface as fa3  # FlashAttention-3 (hopper/), when on the path
except ImportError:
    fa3 = None

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PATHS = ("C call", "op fwd", "op bwd", "py op fwd", "py op bwd", "fa fwd", "fa fwd+bwd",
         "fa3 fwd", "fa3 fwd+bwd", "sdpa fwd", "sdpa fwd+bwd")


def _first(result):
    """FlashAttention-3 returns out, or (out, lse, ...) depending on its version."""
    return result[0] if isinstance(result, tuple) else result


def make_calls(device, dtype, seqlen, heads, head_dim):
    """{path: a no-argument function making one call} for one problem; paths that cannot run
    here (FA3 not importable or not on CUDA, no native ops) are left out."""
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
    stream = ctypes.c_void_p(lib._stream(q.device))
    pp, pft, pbt = ctypes.byref(p), ctypes.byref(ft), ctypes.byref(bt)
    # Typed here: fa4_forward / fa4_backward have no argtypes in c_abi (it calls the
    # *_with_overrides entry points), and a bare Python int would pass as a 32-bit int.
    ws_f_ptr, ws_f_size = ctypes.c_void_p(ws_f[1]), ctypes.c_size_t(ws_f[2])
    ws_b_ptr, ws_b_size = ctypes.c_void_p(ws_b[1]), ctypes.c_size_t(ws_b[2])

    def c_call():
        lib.lib.fa4_forward(pp, pft, ws_f_ptr, ws_f_size, stream, backend)

    def c_call_bwd():
        lib.lib.fa4_backward(pp, pbt, ws_b_ptr, ws_b_size, stream, backend)
    # The structs hold raw pointers: the calls keep the tensors and workspace behind them alive.
    c_call.keep = (q, k, v, out, lse, ws_f[0])
    c_call_bwd.keep = (dout, q, k, v, out, lse, dq, dk, dv, ws_b[0])

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def fa_fwd_bwd():
        o = fa4cpp.flash_attn_func(qg, kg, vg)
        torch.autograd.grad(o, (qg, kg, vg), dout)

    op = torch.ops.fa4cpp
    calls = {
        "C call": c_call,
        "C call bwd": c_call_bwd,
        "op fwd": lambda: op.fwd(q, k, v, 0.0, False, -1, -1, 0.0, False),
        "op bwd": lambda: op.bwd(dout, q, k, v, out, lse, 0.0, False, -1, -1, 0.0, False),
        "fa fwd": lambda: fa4cpp.flash_attn_func(q, k, v),
        "fa fwd+bwd": fa_fwd_bwd,
    }
    if ops.native_ops()[0]:
        calls["py op fwd"] = lambda: op.fwd_py(q, k, v, 0.0, False, -1, -1, 0.0, False)
        calls["py op bwd"] = lambda: op.bwd_py(dout, q, k, v, out, lse, 0.0, False, -1, -1, 0.0,
                                               False)
    if fa3 is not None and device.type == "cuda":
        def fa3_fwd_bwd():
            o = _first(fa3.flash_attn_func(qg, kg, vg))
            torch.autograd.grad(o, (qg, kg, vg), dout)
        calls["fa3 fwd"] = lambda: fa3.flash_attn_func(q, k, v)
        calls["fa3 fwd+bwd"] = fa3_fwd_bwd
    # SDPA takes (b, h, s, d): views of the same memory.
    qt, kt, vt, dt = (t.transpose(1, 2) for t in (q, k, v, dout))
    qgt, kgt, vgt = (t.transpose(1, 2) for t in (qg, kg, vg))

    def sdpa_fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt)

    def sdpa_fwd_bwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            o = F.scaled_dot_product_attention(qgt, kgt, vgt)
        torch.autograd.grad(o, (qg, kg, vg), dt)
    calls["sdpa fwd"] = sdpa_fwd
    calls["sdpa fwd+bwd"] = sdpa_fwd_bwd
    return calls


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


def environment(device, args):
    """What a result file records about the run."""
    native, detail = ops.native_ops()
    return {
        "benchmark": "host_overhead",
        "git_sha": args.sha,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "fa4cpp": fa4cpp.__version__,
        "fa4cpp_native_ops": native,
        "fa4cpp_native_detail": os.path.basename(detail) if native else detail,
        "fa3": getattr(fa3, "__version__", "imported") if fa3 is not None else None,
        "head_dim": args.head_dim,
        "cpu_threads": os.environ.get("FA4_CPU_THREADS"),
        "timing": "median of %d runs of %d calls, %s clock, paths taking turns run by run; "
                  "CUDA runs end with a synchronisation" % (args.repeat, args.number, args.clock),
        "rows": [],
    }


def markdown(result, paths):
    lines = ["# Host overhead per call (µs), %s" % result["device"], "",
             "git %s, torch %s, fa4cpp %s (native ops: %s), FlashAttention-3: %s; head dim %d; %s."
             % (result["git_sha"], result["torch"], result["fa4cpp"],
                "yes" if result["fa4cpp_native_ops"] else "no — " + result["fa4cpp_native_detail"],
                result["fa3"] or "not importable", result["head_dim"], result["timing"]), "",
             "| dtype | seq | heads | " + " | ".join(paths) + " |",
             "|---|---|---|" + "---|" * len(paths)]
    for row in result["rows"]:
        cells = []
        for path in paths:
            if path == "C call":
                cells.append("%.1f / %.1f" % (row["us"]["C call"], row["us"]["C call bwd"]))
            else:
                value = row["us"].get(path)
                cells.append("—" if value is None else "%.1f" % value)
        lines.append("| %s | %d | %d | %s |" % (row["dtype"], row["seqlen"], row["heads"],
                                                 " | ".join(cells)))
    return "\n".join(lines) + "\n"


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
    ap.add_argument("--out", default=None, help="write host_overhead.json and .md here")
    ap.add_argument("--sha", default="unknown", help="the build's git sha, for --out's files")
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

    result = environment(device, args)
    for dtype in dtypes:
        for seqlen in seqlens:
            for h in heads:
                calls = make_calls(device, dtype, seqlen, h, args.head_dim)
                timed = [p for p in paths if p in calls]
                if "C call" in timed:
                    timed.append("C call bwd")
                seconds = time_calls({p: calls[p] for p in timed}, args.number, args.repeat,
                                     sync, clock)
                name = [k for k, v in DTYPES.items() if v == dtype][0]
                result["rows"].append({"dtype": name, "seqlen": seqlen, "heads": h,
                                       "us": {p: t * 1e6 for p, t in seconds.items()}})
                print("%s seq %d heads %d: %s" % (name, seqlen, h, ", ".join(
                    "%s %.1f" % (p, t * 1e6) for p, t in seconds.items())), flush=True)
    table = markdown(result, paths)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
