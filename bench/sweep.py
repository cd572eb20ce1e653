"""The side-by-side benchmark of docs/benchmarks.md, in one process: one or more builds of fa4cpp
(sm90, through the C ABI), cuDNN (torch SDPA, CUDNN_ATTENTION) and torch's FlashAttention-2 (SDPA
FLASH_ATTENTION) on the same tensors, each timed with triton.testing.do_bench (median). Writes
<out>/<name>.json and <out>/<name>.md; prints the markdown table last.

  python3 bench/sweep.py --lib build/default/libfa4.so --sha $(git rev-parse --short HEAD) --out DIR

A/B of library variants (exp2 split, rescale threshold, ...) in the same run: one --lib NAME=PATH
per build, each its own column and ratio to cuDNN; --rounds 2 times everything twice, the builds
in turn in a different order each round, and reports the median over the rounds:

  python3 bench/sweep.py --lib base=/tmp/base/libfa4.so --lib poly25=/tmp/poly25/libfa4.so \\
      --rounds 2 --hdims 64 --sha $(git rev-parse --short HEAD) --out DIR

FlashAttention-3 (the `flash_attn_interface` module its hopper/ build installs) and FlashAttention-4
(`flash_attn.cute`) are timed beside them when importable, each its own column; the header names
the ones that were not.

--power also records, for every timed column, the median SM clock and board power that NVML
sampled during its timings (bench/power_log.py) and the energy per call (from the GPU's energy
counter where it has one, else power × time) in a second table: under the board's power cap the
clock, and with it the time, follows the energy a kernel spends.

--sustained MS times each column as calls back to back, with nothing between them (do_bench
flushes L2 and waits between calls), in windows of at least MS ms of GPU time: the steady state
of a training step's repeated calls, where the clock has settled under the power cap. A/B runs
whose rows move by a few percent between rounds read steadier this way.

--variants none,sinks,alibi also times each build with attention sinks (fp32 logits per query
head, d(sinks) computed in the backward) and with ALiBi (flash_attn's slopes 2^(-8(h+1)/H)), each
its own column (fa4cpp+sinks, fa4cpp+alibi): what a score variant costs over the same problem
without it. FlashAttention-4 takes sinks too (learnable_sink): with sinks asked for, it gets a
FA4+sinks column.

--inputs spiky draws the inputs of the tests' spiky cases (a few query and key rows scaled up: large
logits, late maxima). Builds configured with -DFA4_SM90_RESCALE_STATS=ON also report their O
rescale counts (src/sm90/common/rescale_stats.hpp) for one forward run per row; their times include the
counting's cost, so time the same variant built without it.
"""
import argparse
import contextlib
import copy
import ctypes
import datetime
import importlib
import json
import math
import os
import statistics
import sys
import time

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

# The ctypes binding of the C ABI lives in the Python package's folder (python/fa4cpp/c_abi.py);
# import it as a plain module so that the sweep needs no package install.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "fa4cpp"))
import c_abi as fa4_ctypes  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import power_log  # noqa: E402

# A power_log.PowerLog while --power samples, else None (median_ms then records nothing).
POWER = None
# --sustained: the GPU time of one timing window in ms (None: do_bench), and windows per timing.
SUSTAINED_MS = None
SUSTAINED_WINDOWS = 3

TOKENS = 16384
HIDDEN = 2048
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# The GQA rows' lengths by default; --gqa-seqlens measures others.
GQA_SEQLENS = (2048, 16384)
DEFAULT_LIB_NAME = "fa4cpp"
# tests/common/test_util.cpp's spiky inputs: (fraction of (batch, seq, head) rows, gain).
SPIKY_Q = (0.05, 4.0)
SPIKY_K = (0.03, 8.0)
# fa4_debug_sm90_rescale_counts: StatusCode kNotSupported in builds without the counters.
STATUS_NOT_SUPPORTED = 2


def shapes(hdims, seqlens, gqa_seqlens=GQA_SEQLENS):
    """(batch, seqlen, heads_q, heads_kv, head_dim): 16k tokens, hidden 2048, plus GQA 64/8 d128
    (b=1) at the gqa_seqlens that are also in seqlens."""
    out = [(TOKENS // s, s, HIDDEN // d, HIDDEN // d, d) for d in hdims for s in seqlens]
    if 128 in hdims:
        out += [(1, s, 64, 8, 128) for s in gqa_seqlens if s in seqlens]
    return out


def repo_relative(path):
    """A build's path as results record it: relative to the repository when inside it (results
    are committed, and the machine's own folders are nobody else's business)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.abspath(path)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else os.path.basename(path)


# --pass: what is timed, and its FLOPs as a multiple of the forward's (FlashAttention's convention).
PASSES = {"fwd": ("forward", 1.0), "bwd": ("backward", 2.5), "fwdbwd": ("forward + backward", 3.5)}


def flops(b, s, hq, d, causal):
    f = 4.0 * b * hq * s * s * d
    return f / 2 if causal else f


# Other FlashAttention builds timed when importable: (column, module, its flash_attn_func).
OTHERS = (("FA3", "flash_attn_interface", "flash_attn_func"),
          ("FA4", "flash_attn.cute", "flash_attn_func"))


def find_others():
    """{column: flash_attn_func} of the OTHERS that import, and {column: why not} of the rest."""
    found, missing = {}, {}
    for name, module, attr in OTHERS:
        try:
            found[name] = getattr(importlib.import_module(module), attr)
        except Exception as e:  # ImportError, or a build that fails to load its kernels
            missing[name] = "%s: %s" % (module, str(e).splitlines()[0] if str(e) else type(e).__name__)
    return found, missing


def first_line(e):
    """An error's first line (200 characters at most), or its type's name when it has no text:
    what a table cell says of a refusal."""
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _first(result):
    """Some versions return out, others (out, lse, ...)."""
    return result[0] if isinstance(result, (tuple, list)) else result


def other_fn(func, q, k, v, causal, dout=None, with_forward=False):
    """The closure timing one of OTHERS on the sweep's (batch, seq, heads, dim) tensors: the
    forward, or (dout given) autograd's backward of one forward run / both per call. A func with
    `extra` (a function of q giving keyword tensors, e.g. FA4's learnable_sink) gets them too, and
    the backward differentiates them as well."""
    extra = getattr(func, "extra", lambda q: {})(q)
    if dout is None:
        return lambda: func(q, k, v, causal=causal, **extra)
    extra = {name: x.detach().requires_grad_() for name, x in extra.items()}
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return backward_closure(lambda: _first(func(*leaves, causal=causal, **extra)),
                            leaves + list(extra.values()), dout, with_forward)


def alibi_slopes(heads, device="cuda"):
    """flash_attn's ALiBi slopes for `heads` heads: 2^(-8(h+1)/heads)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)],
                        device=device, dtype=torch.float32)


def sink_logits(heads, device="cuda"):
    """Attention sinks' logits (fp32, one per query head), as gpt-oss learns them: around 0."""
    return torch.randn(heads, device=device, dtype=torch.float32)


# --variants: the score variants a build can be timed with, and the peers that compute them too
# ({column suffix: {peer column: keyword of its flash_attn_func}}).
VARIANTS = ("none", "sinks", "alibi")
OTHER_VARIANTS = {"sinks": {"FA4": "learnable_sink"}}


def variant_others(others, variants):
    """The OTHERS' variant columns (FA4+sinks) for the asked variants, beside the plain ones."""
    out = dict(others)
    for variant in variants:
        for name, keyword in OTHER_VARIANTS.get(variant, {}).items():
            if name in others:
                def func(*a, _f=others[name], **kw):
                    return _f(*a, **kw)
                func.extra = lambda q, _kw=keyword: {_kw: sink_logits(q.shape[2], q.device)}
                out[name + "+" + variant] = func
    return out


def backward_closure(forward, leaves, grad_out, with_forward):
    """Autograd's backward of forward() with respect to leaves: of one forward run made here
    (each call reuses its graph), or, with_forward, forward and backward in each call."""
    if with_forward:
        return lambda: torch.autograd.grad(forward(), leaves, grad_out)
    o = forward()
    return lambda: torch.autograd.grad(o, leaves, grad_out, retain_graph=True)


def checked_others(row, others, make):
    """The OTHERS' closures that run (one call each); the others' errors into the row."""
    runs = {}
    for name, func in others.items():
        try:
            run = make(func)
            run()
            torch.cuda.synchronize()
            runs[name] = run
        except Exception as e:  # an unsupported head dim or pass: that column stays empty
            row.setdefault("others", {})[name] = {"refused": str(e).splitlines()[0][:200]
                                                  if str(e) else type(e).__name__}
    return runs


def checked_builds(row, builds, first_run, diff):
    """Each build's closure, made and run once: first_run(bld, entry) makes it, poisons the
    outputs, runs it and returns it (it may add to the build's entry in the row); diff() then gives
    the max abs difference from cuDNN's result. A build's refusal goes into its entry instead, and
    it is not timed."""
    runs = {}
    for bld in builds:
        entry = row["libs"][bld.name] = {}
        try:
            run = first_run(bld, entry)
        except fa4_ctypes.Fa4Error as e:
            entry["refused"] = str(e)
            continue
        entry["max_abs_diff_vs_cudnn"] = diff()
        runs[bld.name] = run
    return runs


def sdpa_fn(backend, q, k, v, causal):
    # SDPA takes (batch, heads, seq, dim): transposed views of the same memory.
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = q.shape[2] != k.shape[2]

    def run():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=gqa)
    return run


def median_ms(fn, windows=None):
    """do_bench's median, or with --sustained sustained_ms; with --power, the clock and power
    sampled meanwhile go to `windows`."""
    start = time.time()
    if SUSTAINED_MS is None:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    else:
        ms = sustained_ms(fn, SUSTAINED_MS)
    if POWER is not None and windows is not None:
        windows.append(POWER.window(start, time.time()))
    return ms


def cuda_stopwatch(fn, calls):
    """Milliseconds of `calls` back-to-back calls of fn, between two CUDA events on the current
    stream."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)


def sustained_ms(fn, window_ms, windows=SUSTAINED_WINDOWS, stopwatch=cuda_stopwatch):
    """Milliseconds per call of fn called back to back, with nothing between the calls (no L2
    flush, no host wait): the median over `windows` windows of at least window_ms each, after one
    such window of warm-up. The calls per window come from three timed calls."""
    calls = max(3, math.ceil(window_ms / max(stopwatch(fn, 3) / 3, 1e-6)))
    stopwatch(fn, calls)  # warm-up: the clock settles under the power cap
    return statistics.median(stopwatch(fn, calls) / calls for _ in range(windows))


def nvml_uuid():
    """NVML's UUID of the GPU torch computes on: CUDA_VISIBLE_DEVICES renumbers the GPUs, NVML does
    not, and the UUID names the same GPU in both."""
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return uuid if uuid.startswith("GPU-") else "GPU-" + uuid


def gpu_facts():
    try:
        return power_log.gpu_facts(nvml_uuid())
    except Exception as e:  # the table is still worth having without the clocks
        return {"error": str(e)}


def parse_libs(specs):
    """--lib values, NAME=PATH or PATH, as [(name, path)]. A bare PATH is allowed once, named
    fa4cpp. Two names for one file (also through a link) are refused: the loader would hand back
    the library it already has, and the two columns would time the same build."""
    libs = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name:  # a path that happens to contain '='
            name, path = DEFAULT_LIB_NAME, spec
        if not name or not path:
            raise SystemExit("--lib %r: expected NAME=PATH or PATH" % spec)
        libs.append((name, path))
    names = [n for n, _ in libs]
    if len(set(names)) != len(names):
        raise SystemExit("--lib: every library needs its own NAME= (got %s)" % ", ".join(names))
    files = set()
    for _, path in libs:
        if not os.path.isfile(path):
            raise SystemExit("--lib: no such file: %s" % path)
        st = os.stat(path)  # the loader matches files by device and inode: links count as one
        if (st.st_dev, st.st_ino) in files:
            raise SystemExit("--lib: two names for the same file; copy or rebuild it to compare")
        files.add((st.st_dev, st.st_ino))
    return libs


def add_lib_env_arg(ap):
    ap.add_argument("--lib-env", action="append", default=[], metavar="NAME:VAR=VALUE",
                    help="run build NAME with the launch-plan override VAR=VALUE, an FA4_SM90_* "
                         "variable (docs/developing.md); to time one beside the default, give "
                         "the same library twice: copy the file")


def parse_lib_env(specs, names):
    """--lib-env values as {build name: {VAR: VALUE}}."""
    env = {}
    for spec in specs:
        name, sep, setting = spec.partition(":")
        var, eq, value = setting.partition("=")
        if not sep or not eq or not var:
            raise SystemExit("--lib-env %r: expected NAME:VAR=VALUE" % spec)
        if name not in names:
            raise SystemExit("--lib-env %r: no --lib named %s" % (spec, name))
        env.setdefault(name, {})[var] = value
    return env


class Build:
    """One libfa4.so, loaded beside the others (ctypes.CDLL is RTLD_LOCAL: each copy binds its
    own symbols, its own kernels and its own last-error message). env: --lib-env settings, read by
    the library's overrides reader (with the sweep's own environment beneath them) and passed to
    every call of this build."""

    def __init__(self, name, path, deterministic=False, env=None):
        self.name, self.path, self.deterministic = name, path, deterministic
        self.env = dict(env or {})
        self.variant = "none"
        self.fa4 = fa4_ctypes.Library(path)
        with self.environment():
            self.fa4.overrides = self.fa4.overrides_from_env()
        self.version = self.fa4.version()
        self._counts = getattr(self.fa4.lib, "fa4_debug_sm90_rescale_counts", None)
        if self._counts is not None:
            self._counts.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_int]
            self._counts.restype = ctypes.c_int
            if self._read_counts() is None:  # also zeroes them
                self._counts = None

    @contextlib.contextmanager
    def environment(self):
        saved = {var: os.environ.get(var) for var in self.env}
        os.environ.update(self.env)
        try:
            yield
        finally:
            for var, value in saved.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value

    def has_rescale_counts(self):
        return self._counts is not None

    def with_variant(self, variant):
        """This build (the same loaded library) timed with a score variant: its own column."""
        if variant == "none":
            return self
        other = copy.copy(self)
        other.name, other.variant = "%s+%s" % (self.name, variant), variant
        return other

    def params(self, causal, heads_q, device="cuda"):
        """The C ABI's Params of a row: the mask, the build's deterministic mode and its variant's
        tensors (fresh for each row)."""
        return fa4_ctypes.Params(
            causal=causal, deterministic=self.deterministic,
            alibi_slopes=alibi_slopes(heads_q, device) if self.variant == "alibi" else None,
            sinks=sink_logits(heads_q, device) if self.variant == "sinks" else None)

    def _read_counts(self):
        c = (ctypes.c_uint64 * 3)()
        status = self._counts(c, 1)
        if status == STATUS_NOT_SUPPORTED:
            return None
        if status != 0:
            raise RuntimeError("%s: reading the rescale counters failed (status %d)"
                               % (self.name, status))
        return {"warp_tiles": c[0], "exact_rescales": c[1], "adaptive_rescales": c[2]}

    def rescale_counts(self, run):
        """Counts of one call of run(), or None in builds without the counters."""
        if self._counts is None:
            return None
        self._read_counts()
        run()
        torch.cuda.synchronize()
        return self._read_counts()


def make_inputs(kind, b, s, hq, hkv, d, dtype):
    q = torch.randn(b, s, hq, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype)
    if kind == "spiky":
        for x, (fraction, gain) in ((q, SPIKY_Q), (k, SPIKY_K)):
            spiked = (torch.rand(x.shape[:-1], device="cuda") < fraction).to(dtype)
            x.mul_((1.0 + (gain - 1.0) * spiked).unsqueeze(-1))
    return q, k, v


def measure_row(builds, rounds, q, k, v, out, lse, causal, others=None):
    """One (shape, causal) row: per build a checked run (NaN-poisoned output, compared with cuDNN;
    rescale counts when built in), then `rounds` rounds of timing (time_rounds)."""
    row = {"libs": {}}
    cudnn = sdpa_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
    ref = cudnn()

    def first_run(bld, entry):
        run = bld.fa4.forward_fn(q, k, v, out, lse, params=bld.params(causal, q.shape[2]))
        out.fill_(float("nan"))
        counts = bld.rescale_counts(run)
        if counts is None:
            run()
            torch.cuda.synchronize()
        else:
            entry["rescale_counts"] = counts
        return run

    runs = checked_builds(row, builds, first_run,
                          lambda: (out.transpose(1, 2).float() - ref.float()).abs().max().item())

    other_runs = checked_others(row, others or {}, lambda f: other_fn(f, q, k, v, causal))
    time_rounds(row, rounds, cudnn, sdpa_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal), runs,
                other_runs)
    return row


def rotated_rounds(timed, rounds, refused=None, timer=None):
    """`rounds` rounds of timer(fn, details) over timed ({key: callable}), in an order rotated by
    one place each round, so that over len(timed) rounds every key goes first once. timer returns
    the time in ms and may append what it saw to the key's `details` list; median_ms (--power
    windows) by default. Returns ({key: [ms per round]}, {key: details}). A timing that raises
    goes to refused(key, error): true drops the key (it is not timed again), false (or no
    refused) lets the error through."""
    timer = timer or median_ms
    order = list(timed)
    times = {key: [] for key in order}
    details = {key: [] for key in order}  # median_ms: --power's clock and power per timing
    dropped = set()
    for r in range(rounds):
        shift = r % len(order) if order else 0
        for key in order[shift:] + order[:shift]:
            if key in dropped:
                continue
            try:
                times[key].append(timer(timed[key], details[key]))
            except Exception as e:
                if refused is None or not refused(key, e):
                    raise
                dropped.add(key)
    return times, details


def time_rounds(row, rounds, cudnn, fa2, runs, other_runs=None):
    """`rounds` rounds of everything that ran: cuDNN, the builds, the OTHERS and torch FA2 (None:
    refused already), in an order rotated each round so that each takes its turn to go first;
    medians into the row. At power-bound shapes whatever runs first after a lighter load starts on
    a cooler chip and at a higher clock: a fixed order would favour one column."""
    other_runs = other_runs or {}
    timed = {("cudnn",): cudnn}
    timed.update({("lib", name): run for name, run in runs.items()})
    timed.update({("other", name): run for name, run in other_runs.items()})
    if fa2 is not None and "fa2_refused" not in row:
        timed[("fa2",)] = fa2

    def refused(key, e):  # e.g. a head dim torch's FA2 lacks: only FA2 may refuse here
        if key != ("fa2",) or not isinstance(e, RuntimeError):
            return False
        row["fa2_refused"] = first_line(e)
        return True
    times, windows = rotated_rounds(timed, rounds, refused)
    row["cudnn_ms"] = statistics.median(times[("cudnn",)])
    if times.get(("fa2",)):
        row["fa2_ms"] = statistics.median(times[("fa2",)])
    power = power_log.combine(windows[("cudnn",)], row["cudnn_ms"])
    if power is not None:
        row["cudnn_power"] = power
    for name in runs:
        key = ("lib", name)
        row["libs"][name]["ms_rounds"] = times[key]
        row["libs"][name]["ms"] = statistics.median(times[key])
        power = power_log.combine(windows[key], row["libs"][name]["ms"])
        if power is not None:
            row["libs"][name]["power"] = power
    for name in other_runs:
        t = times[("other", name)]
        entry = {"ms": statistics.median(t), "ms_rounds": t}
        power = power_log.combine(windows[("other", name)], entry["ms"])
        if power is not None:
            entry["power"] = power
        row.setdefault("others", {})[name] = entry


def sdpa_backward_fn(backend, q, k, v, causal, dout, with_forward=False):
    """SDPA's backward alone: the forward runs once here (its kernel choice made under `backend`),
    each call of the closure runs autograd's backward of it; with_forward: each call runs both."""
    qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))

    def forward():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                qt, kt, vt, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
    return backward_closure(forward, (qt, kt, vt), dout.transpose(1, 2), with_forward)


def measure_row_backward(builds, rounds, q, k, v, out, lse, causal, with_forward=False,
                         others=None):
    """A backward row: per build the forward once (its out and LSE), a checked backward run (dQ,
    dK, dV NaN-poisoned, dQ compared with cuDNN's), then the timing rounds as measure_row's; with
    with_forward every timed call runs the forward and then the backward."""
    row = {"libs": {}}
    dout = torch.randn_like(q)
    try:
        cudnn = sdpa_backward_fn(SDPBackend.CUDNN_ATTENTION, q, k, v, causal, dout, with_forward)
        ref_dq = cudnn()[0].transpose(1, 2)
    except RuntimeError as e:  # no anchor: nothing to compare with in this row
        row["cudnn_refused"] = str(e).splitlines()[0]
        return row
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def first_run(bld, entry):
        params = bld.params(causal, q.shape[2])
        forward = bld.fa4.forward_fn(q, k, v, out, lse, params=params)
        forward()
        dsinks = torch.empty_like(params.sinks) if params.sinks is not None else None
        run = bld.fa4.backward_fn(dout, q, k, v, out, lse, dq, dk, dv, params=params,
                                  dsinks=dsinks)
        if with_forward:
            run = (lambda f, b: lambda: (f(), b()))(forward, run)
        for g in (dq, dk, dv):
            g.fill_(float("nan"))
        run()
        torch.cuda.synchronize()
        return run

    runs = checked_builds(row, builds, first_run,
                          lambda: (dq.float() - ref_dq.float()).abs().max().item())
    try:
        fa2 = sdpa_backward_fn(SDPBackend.FLASH_ATTENTION, q, k, v, causal, dout, with_forward)
    except RuntimeError as e:
        fa2, row["fa2_refused"] = None, str(e).splitlines()[0]
    other_runs = checked_others(row, others or {},
                                lambda f: other_fn(f, q, k, v, causal, dout, with_forward))
    time_rounds(row, rounds, cudnn, fa2, runs, other_runs)
    return row


def add_rates(row, amount, unit="tflops", per=1e12):
    """amount (FLOPs, or bytes with unit="gbps", per=1e9) per second of every timed column, under
    `unit`; the builds' ratio to cuDNN comes from the TFLOP/s."""
    for key in ("cudnn", "fa2"):
        if key + "_ms" in row:
            row[key + "_" + unit] = amount / (row[key + "_ms"] * 1e-3) / per
    for entry in row.get("others", {}).values():
        if "ms" in entry:
            entry[unit] = amount / (entry["ms"] * 1e-3) / per
    for entry in row["libs"].values():
        if "ms" in entry:
            entry[unit] = amount / (entry["ms"] * 1e-3) / per
            if unit == "tflops" and "cudnn_tflops" in row:
                entry["vs_cudnn"] = entry["tflops"] / row["cudnn_tflops"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True, action="append", metavar="[NAME=]PATH",
                    help="a libfa4.so built with CUDA; repeat with NAME= to compare builds")
    ap.add_argument("--sha", required=True, help="git sha of the fa4cpp tree the builds come from")
    ap.add_argument("--out", required=True, help="folder for the .json and .md")
    ap.add_argument("--name", default=None, help="file name (default fwd_sweep / bwd_sweep)")
    ap.add_argument("--pass", dest="pass_", default="fwd", choices=PASSES,
                    help="the forward, the backward alone (FLOPs 2.5x the forward's), or both "
                         "(fwdbwd: 3.5x)")
    ap.add_argument("--hdims", default="64,128,256")
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--gqa-seqlens", default=",".join(map(str, GQA_SEQLENS)),
                    help="lengths of the GQA 64/8 d128 rows (only those also in --seqlens)")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--inputs", default="normal", choices=("normal", "spiky"))
    ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every implementation this many times per row (median reported)")
    ap.add_argument("--deterministic", default="", metavar="NAME,...",
                    help="these builds run their backward in deterministic mode (to time it beside "
                         "the default mode, give the same library twice: copy the file)")
    ap.add_argument("--variants", default="none", metavar="NAME,...",
                    help="score variants each build is timed with, each its own column: %s"
                         % ", ".join(VARIANTS))
    ap.add_argument("--power", action="store_true",
                    help="also record the SM clock, board power and energy per call of every "
                         "timed column: the fa4cpp builds, cuDNN and the peers (NVML, sampled "
                         "every %d ms)"
                         % power_log.INTERVAL_MS)
    ap.add_argument("--sustained", type=float, default=None, metavar="MS",
                    help="time every column as calls back to back for windows of at least MS ms "
                         "of GPU time (median of %d windows after one of warm-up) instead of "
                         "do_bench's calls between L2 flushes: the steady state of repeated "
                         "calls, where the clock settles under the power cap" % SUSTAINED_WINDOWS)
    add_lib_env_arg(ap)
    args = ap.parse_args()
    args.name = args.name or args.pass_ + "_sweep"
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    if args.sustained is not None and args.sustained <= 0:
        raise SystemExit("--sustained must be > 0 ms")
    global SUSTAINED_MS
    SUSTAINED_MS = args.sustained

    deterministic = set(filter(None, args.deterministic.split(",")))
    if deterministic and args.pass_ == "fwd":
        raise SystemExit("--deterministic: the forward has no deterministic mode (use --pass bwd "
                         "or fwdbwd)")
    libs = parse_libs(args.lib)
    if deterministic - {name for name, _ in libs}:
        raise SystemExit("--deterministic: no --lib named %s" % ", ".join(sorted(
            deterministic - {name for name, _ in libs})))
    env = parse_lib_env(args.lib_env, {name for name, _ in libs})
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS) or len(set(variants)) != len(variants):
        raise SystemExit("--variants: expected distinct names of %s" % ", ".join(VARIANTS))
    builds = [Build(name, path, name in deterministic, env.get(name)) for name, path in libs]
    builds = [b.with_variant(variant) for b in builds for variant in variants]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    hdims = [int(x) for x in args.hdims.split(",")]
    seqlens = [int(x) for x in args.seqlens.split(",")]
    gqa_seqlens = [int(x) for x in args.gqa_seqlens.split(",") if x]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    torch.manual_seed(0)
    others, others_missing = find_others()
    others = variant_others(others, variants)
    run = ResultFile(args.out, args.name, markdown, PASSES[args.pass_][0] + " sweep, docs/benchmarks.md",
                     args.sha, builds, args.rounds, extra={
                         "pass": args.pass_, "others": sorted(others),
                         "others_missing": others_missing, "inputs": args.inputs,
                         "variants": variants,
                         "flops": "4*b*h*s*s*d, halved for causal" + (
                             "" if args.pass_ == "fwd" else
                             ", x%g (%s)" % (PASSES[args.pass_][1], PASSES[args.pass_][0]))})
    global POWER
    POWER = power_log.PowerLog(uuid=nvml_uuid()) if args.power else None
    try:
        for b, s, hq, hkv, d in shapes(hdims, seqlens, gqa_seqlens):
            q, k, v = make_inputs(args.inputs, b, s, hq, hkv, d, dtype)
            out = torch.empty_like(q)
            lse = torch.empty(b, hq, s, device="cuda", dtype=torch.float32)
            for causal in causals:
                row = {"batch": b, "seqlen": s, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
                       "causal": causal, "dtype": args.dtype, "inputs": args.inputs}
                if args.pass_ == "fwd":
                    row.update(measure_row(builds, args.rounds, q, k, v, out, lse, causal,
                                           others))
                else:
                    row.update(measure_row_backward(builds, args.rounds, q, k, v, out, lse,
                                                    causal, with_forward=args.pass_ == "fwdbwd",
                                                    others=others))
                add_rates(row, flops(b, s, hq, d, causal) * PASSES[args.pass_][1])
                run.add(row)
            del q, k, v, out, lse
    finally:
        # The sampling thread runs until stopped: a failing row must not leave it running.
        if POWER is not None:
            POWER.close()

    run.finish()


def script_args(doc, name, add_args=None, argv=None):
    """The command line of the smaller benchmark scripts (gqa_short.py, varlen.py, fp8.py): builds
    with their --lib-env, the git sha, where to write, rounds; add_args(parser) adds a script's
    own. Returns (args, builds)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--lib", required=True, action="append", metavar="[NAME=]PATH")
    ap.add_argument("--sha", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default=name)
    ap.add_argument("--rounds", type=int, default=1)
    add_lib_env_arg(ap)
    if add_args is not None:
        add_args(ap)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    libs = parse_libs(args.lib)
    env = parse_lib_env(args.lib_env, {n for n, _ in libs})
    return args, [Build(n, path, env=env.get(n)) for n, path in libs]


def table_head(columns, names):
    """A results table's header and rule: the row's own columns, each build, cuDNN, torch FA2, each
    build / cuDNN, and the builds' max abs diff vs cuDNN (table_cells fills the rest of a row)."""
    head = list(columns) + list(names) + ["cuDNN", "torch FA2"] + \
        [n + "/cuDNN" for n in names] + ["max abs diff vs cuDNN"]
    return ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]


def table_cells(x, names, cell, cudnn=None):
    """A row's cells after its own columns, in table_head's order: cell(entry, prefix) formats a
    rate; cudnn, if given, replaces the cuDNN cell."""
    libs = [x.get("libs", {}).get(n, {}) for n in names]
    cells = [cell(e, "") for e in libs] + [cudnn if cudnn is not None else cell(x, "cudnn_"),
                                           cell(x, "fa2_")]
    cells += ["%.2f" % e["vs_cudnn"] if "vs_cudnn" in e else "—" for e in libs]
    cells.append(" / ".join("%.3g" % e["max_abs_diff_vs_cudnn"] if "max_abs_diff_vs_cudnn" in e
                            else e.get("refused", "—")[:60] for e in libs))
    return " | ".join(cells) + " |"


def result_dict(benchmark, sha, builds, rounds):
    """What a benchmark script writes: what ran (each build with its --lib-env), where, when, how
    it was timed; rows to come, gpu_after and complete set when the run ends (ResultFile)."""
    return {
        "benchmark": benchmark,
        "git_sha": sha,
        "libs": [{"name": x.name, "path": repo_relative(x.path), "version": x.version,
                  "rescale_counts": x.has_rescale_counts(), "deterministic": x.deterministic,
                  "env": x.env, "variant": getattr(x, "variant", "none")} for x in builds],
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu_before": gpu_facts(),
        "gpu_after": None,
        "complete": False,
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "rounds": rounds,
        "timing": timing_note(rounds),
        "rows": [],
    }


class ResultFile:
    """A run's <out>/<name>.json and .md, rewritten after every row so that a run stopped by its
    time limit keeps what it measured; marked partial (complete: False, partial_note) until
    finish(). extra: the script's own top-level entries."""

    def __init__(self, out, name, to_markdown, benchmark, sha, builds, rounds, extra=None):
        self.out, self.name, self.to_markdown = out, name, to_markdown
        self.result = result_dict(benchmark, sha, builds, rounds)
        self.result.update(extra or {})

    def add(self, row):
        self.result["rows"].append(row)
        print(json.dumps(row), flush=True)
        write_result(self.result, self.out, self.name, self.to_markdown, quiet=True)

    def finish(self):
        self.result.update(gpu_after=gpu_facts(), complete=True)
        write_result(self.result, self.out, self.name, self.to_markdown)


def partial_note(r):
    """The lines a table carries below its header paragraph while its run is incomplete."""
    if r.get("complete") is not False:
        return []
    return ["", "**Partial:** the run stopped after these %d rows (its time limit or an error); "
            "the rows it had not reached are missing." % len(r["rows"])]


def run_facts(r):
    """A result's builds, git sha, GPU (clocks before the run), torch and cuDNN, for a table."""
    g = r["gpu_before"]
    return ("%s; git %s; %s, driver %s, SM clock %s (max %s) before the run; torch %s, cuDNN %s"
            % ("; ".join(build_label(x) for x in r["libs"]), r["git_sha"], g.get("name"),
               g.get("driver_version"), g.get("clocks.sm"), g.get("clocks.max.sm"), r["torch"],
               r["cudnn"]))


def timing_note(rounds):
    if SUSTAINED_MS is None:
        how = "triton.testing.do_bench median, warmup 25 ms, rep 100 ms"
    else:
        how = ("back-to-back calls (no L2 flush), median of %d windows of >= %g ms after one of "
               "warm-up" % (SUSTAINED_WINDOWS, SUSTAINED_MS))
    return how + ("; median of %d rounds, every column in rotated order" % rounds
                  if rounds > 1 else "")


def write_result(result, out, name, to_markdown, quiet=False):
    """<out>/<name>.json and <out>/<name>.md (to_markdown(result)); prints the markdown unless
    quiet."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    md = to_markdown(result)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(md)
    if not quiet:
        print(md)


def build_label(x):
    """A build as the tables name it: name, version, path and what it ran with."""
    extra = (["deterministic"] if x.get("deterministic") else []) + \
        ["%s=%s" % kv for kv in sorted(x.get("env", {}).items())]
    return "%s = fa4cpp %s (%s)" % (x["name"], x["version"], ", ".join([x["path"]] + extra))


def markdown(r):
    g = r["gpu_before"]
    names = [x["name"] for x in r["libs"]]
    builds = "; ".join(build_label(x) for x in r["libs"])
    others = r.get("others", [])
    missing = r.get("others_missing", {})
    lines = [
        "# %s, TFLOP/s (%s)" % (PASSES[r.get("pass", "fwd")][0].capitalize(), r["benchmark"]), "",
        "%s; git %s; %s, driver %s, SM clock %s (max %s) before the run; torch %s, cuDNN %s; "
        "%s inputs; %s; FLOPs %s. Ratio = fa4cpp build / cuDNN, same run, same tensors.%s"
        % (builds, r["git_sha"], g.get("name"), g.get("driver_version"), g.get("clocks.sm"),
           g.get("clocks.max.sm"), r["torch"], r["cudnn"], r.get("inputs", "normal"),
           r["timing"], r["flops"],
           " Not importable here: %s." % "; ".join("%s (%s)" % kv for kv in sorted(missing.items()))
           if missing else ""), "",
        "| d | seqlen | b | hq/hkv | causal | %s | cuDNN | torch FA2 | %s%s | max abs diff%s vs cuDNN |"
        % (" | ".join(names), "".join(o + " | " for o in others),
           " | ".join(n + "/cuDNN" for n in names),
           "" if r.get("pass", "fwd") == "fwd" else " of dQ"),
        "|---" * (8 + 2 * len(names) + len(others)) + "|",
    ]
    lines[3:3] = partial_note(r)
    for x in r["rows"]:
        libs = [x["libs"].get(n, {}) for n in names]
        fmt = lambda d, k: "%.1f" % d[k] if k in d else "—"
        diffs = ["%.3g" % e["max_abs_diff_vs_cudnn"] if "max_abs_diff_vs_cudnn" in e
                 else e.get("refused", "—")[:60] for e in libs]
        other_cells = "".join(fmt(x.get("others", {}).get(o, {}), "tflops") + " | "
                              for o in others)
        lines.append("| %d | %d | %d | %d/%d | %s | %s | %s | %s | %s%s | %s |" % (
            x["head_dim"], x["seqlen"], x["batch"], x["heads_q"], x["heads_kv"],
            "yes" if x["causal"] else "no", " | ".join(fmt(e, "tflops") for e in libs),
            fmt(x, "cudnn_tflops"), fmt(x, "fa2_tflops"), other_cells,
            " | ".join("%.2f" % e["vs_cudnn"] if "vs_cudnn" in e else "—" for e in libs),
            " / ".join(diffs)))
    lines += variant_markdown(r)
    lines += rescale_markdown(r, names)
    lines += power_markdown(r, names)
    return "\n".join(lines) + "\n"


def variant_markdown(r):
    """With --variants: each variant column's time over its plain column's (a build's, FA4's), per
    row: what the variant costs, the same run, the same tensors (>1: slower)."""
    pairs = [(x["name"], x["name"].rsplit("+", 1)[0]) for x in r["libs"]
             if x.get("variant", "none") != "none"]
    pairs += [(o, o.rsplit("+", 1)[0]) for o in r.get("others", []) if "+" in o]
    if not pairs:
        return []
    lines = ["", "Variant cost: time with the variant / time without it (same run, same tensors); "
             "the variants' max abs diff vs cuDNN is the variant's effect, not an error.", "",
             "| d | seqlen | b | hq/hkv | causal | %s |" % " | ".join(
                 "%s / %s" % pair for pair in pairs),
             "|---" * (5 + len(pairs)) + "|"]
    for x in r["rows"]:
        def ms(name):
            return (x["libs"].get(name) or x.get("others", {}).get(name) or {}).get("ms")
        cells = []
        for a, b in pairs:
            ta, tb = ms(a), ms(b)
            cells.append("%.3f" % (ta / tb) if ta and tb else "—")
        lines.append("| %d | %d | %d | %d/%d | %s | %s |" % (
            x["head_dim"], x["seqlen"], x["batch"], x["heads_q"], x["heads_kv"],
            "yes" if x["causal"] else "no", " | ".join(cells)))
    return lines


def rescale_markdown(r, names):
    """The O rescale counts of the builds that have them: per row, the share of warp tiles on which
    an exact online softmax rescales O, the share this build rescaled, and the ratio."""
    counted = [n for n in names if any("rescale_counts" in x["libs"].get(n, {}) for x in r["rows"])]
    if not counted:
        return []
    lines = ["", "## O rescales per warp tile (one forward run, %s inputs)" % r.get("inputs"), "",
             "Exact: a threshold-0 online softmax (any row max of the warp grew); built: what the "
             "build did (above exact where it rescales without checking). Reduction = exact / "
             "built; none: the build rescaled no warp tile.", "",
             "| d | seqlen | hq/hkv | causal | build | warp tiles | exact | built | reduction |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        for n in counted:
            c = x["libs"].get(n, {}).get("rescale_counts")
            if c is None:
                continue
            tiles = max(c["warp_tiles"], 1)
            lines.append("| %d | %d | %d/%d | %s | %s | %d | %.2f %% | %.2f %% | %s |" % (
                x["head_dim"], x["seqlen"], x["heads_q"], x["heads_kv"],
                "yes" if x["causal"] else "no", n, c["warp_tiles"],
                100.0 * c["exact_rescales"] / tiles, 100.0 * c["adaptive_rescales"] / tiles,
                "%.1f×" % (c["exact_rescales"] / c["adaptive_rescales"])
                if c["adaptive_rescales"] else "none"))
    return lines


def power_markdown(r, names):
    """--power's table: per row and timed column (the builds, cuDNN, then the peers that ran) the
    median SM clock and board power sampled during its timings, the energy per call
    (power_log.combine) and each build's energy / cuDNN's. Under the board's power cap a column's
    clock says how much of its time its energy per FLOP costs."""
    peers = r.get("others", [])  # the peers' columns, as markdown's main table has them

    def row_powers(x):
        return ([x["libs"].get(n, {}).get("power") for n in names] + [x.get("cudnn_power")] +
                [x.get("others", {}).get(o, {}).get("power") for o in peers])

    if not any(p for x in r["rows"] for p in row_powers(x)):
        return []
    cols = names + ["cuDNN"] + peers
    sources = {p.get("energy_source", "power") for x in r["rows"] for p in row_powers(x) if p}
    energy = {"counter": "the energy counter's average power", "power": "median power"}
    lines = ["", "## SM clock, board power, energy per call (NVML every %d ms during each timing; "
             "medians over the rounds; mJ = %s × median time)"
             % (power_log.INTERVAL_MS, " or ".join(energy.get(s, s) for s in sorted(sources))), "",
             "| d | seqlen | b | hq/hkv | causal | %s | %s |" % (
                 " | ".join(c + " MHz / W / mJ" for c in cols),
                 " | ".join(n + "/cuDNN energy" for n in names)),
             "|---" * (5 + len(cols) + len(names)) + "|"]
    for x in r["rows"]:
        powers = row_powers(x)
        cells = ["%.0f / %.0f / %.3g" % (p["sm_mhz"], p["watts"], p["mj_per_call"]) if p else "—"
                 for p in powers]
        base = powers[len(names)]
        ratios = ["%.3f" % (p["mj_per_call"] / base["mj_per_call"]) if p and base else "—"
                  for p in powers[:len(names)]]
        lines.append("| %d | %d | %d | %d/%d | %s | %s | %s |" % (
            x["head_dim"], x["seqlen"], x["batch"], x["heads_q"], x["heads_kv"],
            "yes" if x["causal"] else "no", " | ".join(cells), " | ".join(ratios)))
    return lines


if __name__ == "__main__":
    main()
