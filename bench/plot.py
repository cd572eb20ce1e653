"""Plots of a bench/sweep.py (or bench/fp8.py) result: TFLOP/s against sequence length, one
panel per head dim, full and causal attention in two rows, every implementation of the run (the
fa4cpp builds, cuDNN, torch's FlashAttention-2, and FlashAttention-3 / -4 where the run could
import them) as one line each. GQA rows (heads_q != heads_kv) are left out: they are single
points. Only numbers of one run are drawn together, so every line has its anchors beside it.

    python3 bench/plot.py bench/results/<date>_<sha>_fwd_sweep.json [--out FILE.png]
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(rows):
    """{(head_dim, causal): {name: [(seqlen, tflops)]}} of the MHA rows."""
    out = {}
    for r in rows:
        if r["heads_q"] != r["heads_kv"]:
            continue
        lines = out.setdefault((r["head_dim"], r["causal"]), {})
        for name, lib in r.get("libs", {}).items():
            if "tflops" in lib:
                lines.setdefault(name, []).append((r["seqlen"], lib["tflops"]))
        for name, key in (("cuDNN", "cudnn_tflops"), ("torch FA2", "fa2_tflops")):
            if r.get(key) is not None:
                lines.setdefault(name, []).append((r["seqlen"], r[key]))
        for name, other in r.get("others", {}).items():  # FA3 / FA4 when they were importable
            if "tflops" in other:
                lines.setdefault(name, []).append((r["seqlen"], other["tflops"]))
        for name, column in r.get("columns", {}).items():  # bench/fp8.py: every column by name
            if "tflops" in column:
                lines.setdefault(name, []).append((r["seqlen"], column["tflops"]))
    return out


def plot(result, path):
    data = series(result["rows"])
    hdims = sorted({d for d, _ in data})
    fig, axes = plt.subplots(2, len(hdims), figsize=(4.2 * len(hdims), 7.5), squeeze=False,
                             sharey=True)
    # One colour per implementation in every panel (a panel may lack a line: a refused head dim).
    names = sorted({name for lines in data.values() for name in lines})
    colours = {name: f"C{i % 10}" for i, name in enumerate(names)}
    for col, d in enumerate(hdims):
        for row, causal in enumerate((False, True)):
            ax = axes[row][col]
            for name, points in sorted(data.get((d, causal), {}).items()):
                points.sort()
                ax.plot([s for s, _ in points], [t for _, t in points], marker="o", label=name,
                        color=colours[name])
            ax.set_xscale("log", base=2)
            seqlens = sorted({s for pts in data.get((d, causal), {}).values() for s, _ in pts})
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.set_title(f"head dim {d}, {'causal' if causal else 'full'}")
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("TFLOP/s")
            if row == 1:
                ax.set_xlabel("sequence length (16k tokens per batch)")
    handles = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    axes[0][0].legend([handles[n] for n in names if n in handles],
                      [n for n in names if n in handles], loc="lower right", fontsize=8)
    gpu = result.get("gpu_before", {}).get("name", "GPU")
    dtype = result["rows"][0].get("dtype", "bf16") if result["rows"] else "bf16"
    what = {"bwd": "Backward", "fwdbwd": "Forward + backward"}.get(result.get("pass"), "Forward")
    inputs = f"{result.get('inputs', 'normal')} inputs, "
    if result.get("benchmark", "").startswith("FP8"):  # bench/fp8.py: its inputs are its header's
        dtype, inputs = "e4m3 beside bf16", ""
    fig.suptitle(f"{what}, {dtype}, {inputs}{gpu} — fa4cpp {result['git_sha']}, one run",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", help="a bench/sweep.py or bench/fp8.py result")
    ap.add_argument("--out", help="PNG to write (default: the JSON's name with .png)")
    args = ap.parse_args()
    with open(args.json) as f:
        result = json.load(f)
    path = args.out or os.path.splitext(args.json)[0] + ".png"
    plot(result, path)
    print(path)


if __name__ == "__main__":
    main()
