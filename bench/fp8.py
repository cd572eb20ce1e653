"""The FP8 (e4m3) forward beside bf16, in one process: fa4cpp's forward (through the C ABI) on
float8_e4m3fn q, k, v with fp32 descales per (batch, kv head) and a bf16 output, FlashAttention-3's
(flash_attn_interface.flash_attn_func with q_descale / k_descale / v_descale) on the same e4m3
tensors when it imports, both again on bf16 copies of the dequantized values, and cuDNN (torch
SDPA, CUDNN_ATTENTION) on those bf16 copies as the anchor: torch's SDPA offers cuDNN no FP8
attention, so cuDNN has no e4m3 column. Built on bench/sweep.py's pieces (shapes, the rotated
timing rounds, the result files). Writes <out>/<name>.json and .md, row by row.

  python3 bench/fp8.py --lib build/default/libfa4.so --sha $(git rev-parse --short HEAD) \\
      --out DIR --rounds 5

Shapes are the sweep's (16384 tokens, hidden 2048: batch 16384 / s, heads 2048 / d), at
--seqlens (1k, 4k, 16k) and --hdims (64, 128, 256), without a mask and causal (--causal).

Inputs: per (batch, kv head) a random width σ = 2^u, u uniform in [-1/2, 1/2]; x = σ · randn in
fp32; the descale is the group's largest |x| / 448, so that each (batch, kv head) of q, k and v
spans the e4m3 range up to its largest finite value, as an amax quantizer sets it; x / descale,
rounded to e4m3, is the e4m3 input. The bf16 inputs are e4m3 value × descale rounded to bf16 (at
most 2^-8 relative, against e4m3's own 2^-4): every column computes the same attention.

Each column runs once before it is timed (fa4cpp's output poisoned with NaN first; FA3 and cuDNN
allocate theirs): the row records its NaN count and its largest |O - O_cuDNN|; a NaN or a
difference above --bad-diff (0.5) marks the column bad in the table. The e4m3 columns differ from
cuDNN at the FP8 level; that is data, not a failure. A column that raises on a row (a head dim
not built, say) records the refusal for that row and is not timed; the run goes on. Then --rounds
rounds of sweep.py's median timing, the columns in an order rotated each round (over as many
rounds as there are columns, each goes first once). TFLOP/s count 4·b·h·s²·d, halved for
causal. Ratios per build: its e4m3 / FA3 e4m3, and its e4m3 / its bf16.
"""
import dataclasses
import statistics

import torch
from torch.nn.attention import SDPBackend

import sweep

fa4_ctypes = sweep.fa4_ctypes

DEVICE = "cuda"
SEQLENS = (1024, 4096, 16384)
HDIMS = (64, 128, 256)
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# The widths of the inputs per (batch, kv head): 2^u, u uniform in [-WIDTH_SPREAD, WIDTH_SPREAD].
WIDTH_SPREAD = 0.5
BAD_DIFF = 0.5
BENCHMARK = "FP8 (e4m3) forward beside bf16 (bench/fp8.py)"
CUDNN = "cuDNN bf16"
FA3 = "FA3"
CUDNN_FP8 = ("cuDNN has no FP8 attention through torch's SDPA: its column is bf16, on the "
             "dequantized values")


# -- inputs ---------------------------------------------------------------------------------------

def quantize(x, heads_kv):
    """(e4m3 tensor, fp32 (batch, heads_kv) descales) of an fp32 (batch, seq, heads, dim) x whose
    heads come in heads_kv groups (FlashAttention-3's descale layout: q's heads share their kv
    head's): descale = the group's amax / 448, the e4m3 value x / descale."""
    b, s, h, d = x.shape
    groups = x.view(b, s, heads_kv, h // heads_kv, d)
    descale = groups.abs().amax(dim=(1, 3, 4)) / E4M3_MAX
    scaled = groups / descale[:, None, :, None, None]
    # x / (amax / 448) can round a hair past 448, and torch's cast to e4m3fn (no infinity) turns
    # what rounds past 464 into NaN.
    x8 = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(b, s, h, d)
    return x8, descale.float()


def dequantize(x8, descale, dtype=torch.bfloat16):
    """x8's values times their (batch, kv head) descale, in dtype."""
    b, s, h, d = x8.shape
    heads_kv = descale.shape[1]
    x = x8.float().view(b, s, heads_kv, h // heads_kv, d) * descale[:, None, :, None, None]
    return x.view(b, s, h, d).to(dtype)


def make_inputs(b, s, hq, hkv, d, device=None):
    """{q8, k8, v8: e4m3; qd, kd, vd: fp32 (b, hkv) descales; q, k, v: the bf16 dequantized}."""
    device = device or DEVICE
    x = {}
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
        width = 2.0 ** ((torch.rand(b, 1, hkv, 1, 1, device=device) * 2 - 1) * WIDTH_SPREAD)
        values = torch.randn(b, s, hkv, heads // hkv, d, device=device) * width
        x[name + "8"], x[name + "d"] = quantize(values.view(b, s, heads, d), hkv)
        del values
        x[name] = dequantize(x[name + "8"], x[name + "d"])
    return x


# -- columns --------------------------------------------------------------------------------------

def column_names(build_names, fa3):
    """The columns in table (and first-round timing) order: each build's e4m3, FA3's e4m3, each
    build's bf16, FA3's bf16, cuDNN's bf16."""
    peer = [FA3] if fa3 else []
    return ([n + " e4m3" for n in build_names] + [p + " e4m3" for p in peer] +
            [n + " bf16" for n in build_names] + [p + " bf16" for p in peer] + [CUDNN])


def ratio_names(build_names, fa3):
    """[(ratio, numerator column, denominator column)]: per build its e4m3 over FA3's e4m3 (when
    FA3 imports) and over its own bf16; TFLOP/s over TFLOP/s (>1: the numerator is faster)."""
    out = []
    for n in build_names:
        if fa3:
            out.append((n + " e4m3 / FA3 e4m3", n + " e4m3", FA3 + " e4m3"))
        out.append((n + " e4m3 / " + n + " bf16", n + " e4m3", n + " bf16"))
    return out


def fa4cpp_column(bld, x, causal, fp8):
    """make() of a build's column: (its forward closure on the e4m3 or bf16 tensors, the bf16
    output it writes)."""
    def make():
        q, k, v = (x[n + "8"] if fp8 else x[n] for n in "qkv")
        params = bld.params(causal, q.shape[2], q.device)
        if fp8:
            params = dataclasses.replace(params, fp8=fa4_ctypes.Fp8(
                out_dtype=torch.bfloat16, q_descale=x["qd"], k_descale=x["kd"],
                v_descale=x["vd"]))
        b, s, hq, d = q.shape
        out = torch.empty(b, s, hq, v.shape[3], device=q.device, dtype=torch.bfloat16)
        lse = torch.empty(b, hq, s, device=q.device, dtype=torch.float32)
        return bld.fa4.forward_fn(q, k, v, out, lse, params=params), out
    return make


def fa3_column(func, x, causal, fp8):
    """make() of FlashAttention-3's column: (its flash_attn_func call, None: it returns its
    output)."""
    def make():
        if fp8:
            q, k, v = x["q8"], x["k8"], x["v8"]
            kw = dict(q_descale=x["qd"], k_descale=x["kd"], v_descale=x["vd"])
        else:
            q, k, v, kw = x["q"], x["k"], x["v"], {}
        return (lambda: func(q, k, v, causal=causal, **kw)), None
    return make


def columns(builds, fa3, x, causal):
    """{column: make()} of a row, in column_names' order but for cuDNN (the anchor, measure_row's
    own)."""
    cols = {}
    for fp8, dtype in ((True, "e4m3"), (False, "bf16")):
        for bld in builds:
            cols[bld.name + " " + dtype] = fa4cpp_column(bld, x, causal, fp8)
        if fa3 is not None:
            cols[FA3 + " " + dtype] = fa3_column(fa3, x, causal, fp8)
    return cols


# -- one row --------------------------------------------------------------------------------------

def check(entry, o, ref, bad_diff):
    """A first run's output o (b, s, h, d) against cuDNN's (None: no anchor in this row): NaN count
    and max |o - ref| over the other elements into entry; bad on a NaN or a difference above
    bad_diff."""
    nans = int(torch.isnan(o).sum())
    entry["nan_count"] = nans
    bad = nans > 0
    if ref is not None:
        diff = (o.float() - ref.float()).abs()
        entry["max_abs_diff_vs_cudnn"] = float(torch.where(torch.isnan(diff), 0.0, diff).max())
        bad = bad or entry["max_abs_diff_vs_cudnn"] > bad_diff
    entry["bad"] = bad


def checked_run(entry, make, ref, bad_diff):
    """A column's closure, made and run once (its written output NaN-poisoned first) and checked;
    None, with the refusal in entry, when making or running it raises."""
    try:
        run, out = make()
        if out is not None:
            out.fill_(float("nan"))
            run()
            o = out
        else:
            o = sweep._first(run())
        torch.cuda.synchronize()
    except Exception as e:  # a head dim not built, a layout refused: this column sits the row out
        entry["refused"] = sweep.first_line(e)
        return None
    check(entry, o, ref, bad_diff)
    return run


def measure_row(cols, cudnn, rounds, bad_diff=BAD_DIFF):
    """One (shape, causal) row: cudnn's run first (SDPA's (b, h, s, d) output: the reference),
    then each of cols ({column: make()}) made, run and checked; then `rounds` rotated rounds of
    every column that ran (sweep.rotated_rounds), in cols' order with cuDNN last. Returns
    {"columns": {column: entry}}."""
    row = {"columns": {name: {} for name in list(cols) + [CUDNN]}}
    ref, runs = None, {}
    try:
        ref = cudnn().transpose(1, 2)
        torch.cuda.synchronize()
    except Exception as e:  # no anchor: the other columns are checked for NaNs only
        row["columns"][CUDNN]["refused"] = sweep.first_line(e)
    for name, make in cols.items():
        run = checked_run(row["columns"][name], make, ref, bad_diff)
        if run is not None:
            runs[name] = run
    if ref is not None:
        check(row["columns"][CUDNN], ref, None, bad_diff)
        runs[CUDNN] = cudnn
    del ref

    def refused(name, e):  # a failure while timing: that column's cell says so, the others go on
        row["columns"][name]["refused"] = "while timing: " + sweep.first_line(e)
        return True
    times, _ = sweep.rotated_rounds(runs, rounds, refused)
    for name, t in times.items():
        entry = row["columns"][name]
        if t and "refused" not in entry:
            entry["ms_rounds"] = t
            entry["ms"] = statistics.median(t)
    return row


def add_rates(row, flops, ratios):
    """TFLOP/s of every timed column, and the ratios [(name, numerator, denominator)] whose two
    columns were both timed."""
    cols = row.get("columns", {})
    for entry in cols.values():
        if "ms" in entry:
            entry["tflops"] = flops / (entry["ms"] * 1e-3) / 1e12
    row["ratios"] = {name: cols[a]["tflops"] / cols[b]["tflops"] for name, a, b in ratios
                     if "tflops" in cols.get(a, {}) and "tflops" in cols.get(b, {})}


# -- tables ---------------------------------------------------------------------------------------

def rate_cell(entry):
    if "tflops" in entry:
        return "%.1f" % entry["tflops"] + (" **bad**" if entry.get("bad") else "")
    return "refused" if "refused" in entry else "—"


def check_cell(name, entry):
    """max |O - O_cuDNN| (NaNs), or the refusal."""
    if "refused" in entry:
        return "refused: " + entry["refused"][:60].replace("|", "/")
    if "nan_count" not in entry:
        return "—"
    if "max_abs_diff_vs_cudnn" in entry:
        text = "%.3g" % entry["max_abs_diff_vs_cudnn"]
    else:
        text = "reference" if name == CUDNN else "no reference"
    if entry["nan_count"]:
        text += " (%d NaN)" % entry["nan_count"]
    return "**%s**" % text if entry.get("bad") else text


def shape_cells(x):
    return "| %d | %d | %d | %d/%d | %s |" % (x["head_dim"], x["seqlen"], x["batch"], x["heads_q"],
                                               x["heads_kv"], "yes" if x["causal"] else "no")


def markdown(r):
    names = r["columns"]
    ratios = [name for name, _, _ in r["ratios"]]
    missing = r.get("others_missing", {})
    lines = [
        "# %s: TFLOP/s" % r["benchmark"], "",
        "%s; %s; FLOPs %s. Inputs: %s. %s; the anchor every column's first run is compared with. "
        "**bad**: a NaN, or max |O - O_cuDNN| above %g. Ratios: TFLOP/s over TFLOP/s, same run, "
        "same values.%s"
        % (sweep.run_facts(r), r["timing"], r["flops"], r["inputs"], r["cudnn_fp8"],
           r["bad_diff"],
           " Not importable here: %s." % "; ".join("%s (%s)" % kv for kv in sorted(missing.items()))
           if missing else ""),
    ] + sweep.partial_note(r) + [
        "",
        "| d | seqlen | b | hq/hkv | causal | %s |" % " | ".join(names + ratios),
        "|---" * (5 + len(names) + len(ratios)) + "|",
    ]
    for x in r["rows"]:
        cols = x.get("columns", {})
        cells = [rate_cell(cols.get(n, {})) for n in names]
        cells += ["%.2f" % x["ratios"][n] if n in x.get("ratios", {}) else "—" for n in ratios]
        lines.append(shape_cells(x) + " %s |" % " | ".join(cells))
    lines += ["", "First run of each column: max |O - O_cuDNN| (NaN count when any), or its "
              "refusal.",
              "", "| d | seqlen | b | hq/hkv | causal | %s |" % " | ".join(names),
              "|---" * (5 + len(names)) + "|"]
    for x in r["rows"]:
        if "error" in x:
            cells = ["row failed: " + x["error"][:80].replace("|", "/")] + [""] * (len(names) - 1)
        else:
            cells = [check_cell(n, x["columns"].get(n, {})) for n in names]
        lines.append(shape_cells(x) + " %s |" % " | ".join(cells))
    return "\n".join(lines) + "\n"


# -- main -----------------------------------------------------------------------------------------

def find_fa3():
    """(FlashAttention-3's flash_attn_func, None), or (None, why not): sweep's OTHERS import."""
    found, missing = sweep.find_others()
    if FA3 in found:
        return found[FA3], None
    return None, missing.get(FA3, "not found")


def add_args(ap):
    ap.add_argument("--hdims", default=",".join(map(str, HDIMS)))
    ap.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    ap.add_argument("--causal", default="both", choices=("both", "no", "yes"))
    ap.add_argument("--bad-diff", type=float, default=BAD_DIFF,
                    help="a first run's max |O - O_cuDNN| above this marks its column bad")


def main(argv=None):
    args, builds = sweep.script_args(__doc__, "fp8_fwd", add_args, argv)
    hdims = [int(v) for v in args.hdims.split(",")]
    seqlens = [int(v) for v in args.seqlens.split(",")]
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    fa3, fa3_missing = find_fa3()
    build_names = [b.name for b in builds]
    ratios = ratio_names(build_names, fa3 is not None)
    torch.manual_seed(0)
    run = sweep.ResultFile(args.out, args.name, markdown, BENCHMARK, args.sha,
                           builds, args.rounds, extra={
                               "columns": column_names(build_names, fa3 is not None),
                               "ratios": ratios,
                               "others": [FA3] if fa3 is not None else [],
                               "others_missing": {FA3: fa3_missing} if fa3 is None else {},
                               "cudnn_fp8": CUDNN_FP8, "bad_diff": args.bad_diff,
                               "inputs": "per (batch, kv head) x = 2^u · randn, u uniform in "
                                         "[-%g, %g]; descale = amax / 448; e4m3 = x / descale; "
                                         "bf16 = e4m3 · descale" % (WIDTH_SPREAD, WIDTH_SPREAD),
                               "flops": "4*b*h*s*s*d, halved for causal"})
    for b, s, hq, hkv, d in sweep.shapes(hdims, seqlens, ()):
        x = None  # drawn once per shape, for both masks
        for causal in causals:
            row = {"batch": b, "seqlen": s, "heads_q": hq, "heads_kv": hkv, "head_dim": d,
                   "causal": causal}
            try:
                if x is None:
                    x = make_inputs(b, s, hq, hkv, d)
                cudnn = sweep.sdpa_fn(SDPBackend.CUDNN_ATTENTION, x["q"], x["k"], x["v"], causal)
                row.update(measure_row(columns(builds, fa3, x, causal), cudnn, args.rounds,
                                       args.bad_diff))
                add_rates(row, sweep.flops(b, s, hq, d, causal), ratios)
            except Exception as e:  # out of memory, say: the row says so, the run goes on
                row["error"] = sweep.first_line(e)
            run.add(row)
        del x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run.finish()


if __name__ == "__main__":
    main()
