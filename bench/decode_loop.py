"""An engine's decode loop as a benchmark: examples/decode_loop.py's Llama-style GQA model (random
weights) prefilled from prompts, then decoding greedily from a paged KV cache, every attention one
call of flash_attn_with_kvcache: fa4cpp's, and FlashAttention-3's (same arguments) when it
imports; eagerly and under CUDA graph replay (the step captured once). Reports decode tokens per
second (sequences · decode steps / their seconds, host included: what an engine sees) per batch
size, in one process. Writes <out>/<name>.json and .md (bench/sweep.py's result files).

  FA4CPP_LIBRARY=build/default/libfa4.so PYTHONPATH=python:$FA3_HOPPER \\
      python3 bench/decode_loop.py --sha $(git rev-parse --short HEAD) --out DIR

Default model: 4 layers, hidden 2048, 16 query heads over 4 kv heads (head dim 128), vocab 32000,
bf16; prompts of 512 tokens, 64 generated tokens (63 timed decode steps), pages of 16 keys,
batches 1 and 64. Timing: --rounds rounds; in each round every (library, mode) runs the whole
loop once, in an order rotated by one place per round; the median per decode step is reported
(every round's in the JSON). Each library's greedy tokens are compared with fa4cpp's eager ones:
the positions that differ, the sequences that differ and the first step at which one does.
Greedy decoding carries a difference on: once a near-tie flips (bf16 rounding may flip one,
random weights make them common), the rest of that sequence differs too, so the first step says
more than the count (a wrong attention differs from the first steps on, in most sequences). A
(library, mode) that raises gets n/a and the first line of its error.
"""
import argparse
import datetime
import importlib.util
import os
import statistics

import torch

import decode
import sweep

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("eager", "graph")


def load_example():
    """examples/decode_loop.py as a module (it imports fa4cpp: the package must be importable)."""
    path = os.path.join(REPO, "examples", "decode_loop.py")
    spec = importlib.util.spec_from_file_location("decode_loop_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_ints(text):
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sha", required=True, help="git sha of the fa4cpp tree")
    ap.add_argument("--out", required=True, help="folder for the .json and .md")
    ap.add_argument("--name", help="file name (default <date>_<sha>_decode_loop)")
    ap.add_argument("--lib", help="libfa4.so (default: $FA4CPP_LIBRARY, else the package's)")
    ap.add_argument("--batches", type=parse_ints, default=[1, 64])
    ap.add_argument("--prompt", type=int, default=512, help="tokens of every prompt")
    ap.add_argument("--steps", type=int, default=64, help="tokens generated per sequence")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="eager, graph (CUDA graph replay; CUDA only)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            ap.error("--modes: %r is not one of %s" % (m, ", ".join(MODES)))
    return args


def prompts_for(batch, length, vocab, seed):
    g = torch.Generator().manual_seed(seed + batch)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def ms_per_step(seconds, steps):
    return 1e3 * seconds / max(1, steps - 1)


def measure_batch(example, model, args, batch, libraries, dtype):
    """One row: every (library, mode) of this batch size in rotated rounds, with the checks."""
    prompts = prompts_for(batch, args.prompt, args.vocab, args.seed)
    row = {"batch": batch, "prompt": args.prompt, "steps": args.steps,
           "page_size": args.page_size, "ms_per_step": {}, "rounds_ms": {}, "errors": {},
           "differing_tokens": {}, "differing_sequences": {}, "first_difference": {},
           "tokens_per_s": {}}
    reference = []  # fa4cpp eager's tokens, to compare every other run with

    def run(lib, mode):
        def loop():
            generated, _, seconds = example.generate(
                model, prompts, args.steps, args.page_size, dtype, args.device,
                cuda_graph=mode == "graph", attention=libraries[lib])
            generated = generated.cpu()
            if not reference:
                reference.append(generated)
            key = "%s %s" % (lib, mode)
            differs = generated != reference[0]  # (sequences, steps)
            row["differing_tokens"][key] = int(differs.sum())
            row["differing_sequences"][key] = int(differs.any(dim=-1).sum())
            steps = differs.any(dim=0).nonzero()
            row["first_difference"][key] = int(steps[0]) if len(steps) else None
            return ms_per_step(seconds, args.steps)
        return loop

    timed = {}
    for lib in libraries:
        for mode in args.modes:
            if mode == "graph" and torch.device(args.device).type != "cuda":
                row["errors"]["%s %s" % (lib, mode)] = "CUDA graphs need a CUDA device"
                continue
            timed["%s %s" % (lib, mode)] = run(lib, mode)

    def refused(key, e):
        row["errors"][key] = sweep.first_line(e)
        return True

    # fa4cpp eager first in round 0: its tokens are the reference the others are compared with.
    times, _ = sweep.rotated_rounds(timed, args.rounds, refused, lambda fn, details: fn())
    for key, values in times.items():
        if key in row["errors"] or not values:
            continue
        row["rounds_ms"][key] = values
        ms = statistics.median(values)
        row["ms_per_step"][key] = ms
        row["tokens_per_s"][key] = 1e3 * batch / ms
    return row


def ratio(row, a, b):
    x, y = row["tokens_per_s"].get(a), row["tokens_per_s"].get(b)
    return None if x is None or y is None else x / y


def difference(row, key):
    """How key's tokens differ from fa4cpp eager's: "<key> 0", or "<key> 37 (2 of 64 sequences,
    from step 9)"."""
    n = row["differing_tokens"][key]
    if n == 0:
        return "%s 0" % key
    return "%s %d (%d of %d sequences, from step %d)" % (
        key, n, row["differing_sequences"][key], row["batch"], row["first_difference"][key])


def markdown(r):
    libs = r["libraries"]
    keys = ["%s %s" % (lib, mode) for lib in libs for mode in r["modes"]]
    lines = ["# Decode loop: tokens/s, %s" % r["gpu_before"].get("name"), "",
             "%s. Model: %s. %s. fa4cpp called through %s (its host time per call is in the "
             "eager rows)." % (sweep.run_facts(r), r["model"], r["timing"], r["fa4cpp_ops"])]
    lines += sweep.partial_note(r)
    if not r["fa3"]["available"]:
        lines += ["", "FlashAttention-3 not run: %s." % r["fa3"]["missing"]]
    head = ["batch"] + ["%s tok/s" % k for k in keys]
    if "FA3" in libs:
        head += ["fa4cpp / FA3 %s" % m for m in r["modes"]]
    head += ["tokens differing"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in r["rows"]:
        cells = [str(row["batch"])]
        for k in keys:
            t = row["tokens_per_s"].get(k)
            cells.append("%.0f" % t if t is not None else "n/a")
        if "FA3" in libs:
            for m in r["modes"]:
                x = ratio(row, "fa4cpp " + m, "FA3 " + m)
                cells.append("%.2f" % x if x is not None else "n/a")
        cells.append(", ".join(difference(row, k) for k in row["differing_tokens"]
                               if k != "fa4cpp eager") or "—")
        lines.append("| " + " | ".join(cells) + " |")
    errors = [(row["batch"], k, e) for row in r["rows"] for k, e in row["errors"].items()]
    if errors:
        lines += [""] + ["- batch %d, %s: %s" % e for e in errors]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    # One build, called through the package as decode.py calls it (load_libraries).
    args.libs, args.lib_env = [(decode.DEFAULT_BUILD, args.lib)], {}
    libraries, builds, how = decode.load_libraries(args)
    example = load_example()
    fa3, fa3_info = decode.find_fa3()
    if fa3 is not None:
        libraries["FA3"] = fa3
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = example.small_llama(seed=args.seed, layers=args.layers, hidden=args.hidden,
                                heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = args.name or "%s_%s_decode_loop" % (date, args.sha)
    described = ("%d layers, hidden %d, %d / %d heads (head dim %d), vocab %d, %s; prompts of %d "
                 "tokens, %d generated, pages of %d keys"
                 % (args.layers, args.hidden, args.heads, args.kv_heads,
                    args.hidden // args.heads, args.vocab, args.dtype, args.prompt, args.steps,
                    args.page_size))
    timing = ("decode steps after the prefill, wall clock from the first step to the last "
              "(synchronised), host included; median of %d rounds, the (library, mode) pairs in "
              "rotated order" % args.rounds)
    run = sweep.ResultFile(args.out, name, markdown, "an engine's decode loop "
                           "(bench/decode_loop.py)", args.sha, builds, args.rounds, extra={
                               "timing": timing, "model": described,
                               "libraries": list(libraries), "modes": args.modes,
                               "fa3": {"available": True, "version": fa3_info} if fa3 else
                               {"available": False, "missing": fa3_info},
                               "device": args.device,
                               "fa4cpp_ops": how})
    for batch in args.batches:
        try:
            row = measure_batch(example, model, args, batch, libraries, dtype)
        except Exception as e:  # out of memory, say: the row says so, the run goes on
            row = {"batch": batch, "error": sweep.first_line(e), "tokens_per_s": {},
                   "differing_tokens": {}, "errors": {"all": sweep.first_line(e)}}
        run.add(row)
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
    run.finish()


if __name__ == "__main__":
    main()
