"""bench/decode.py without a GPU: its rows (the defaults, --max-gb, the narrowing options, --smoke),
the bytes and FLOPs it divides by (the bottom-right causal pair count against brute force), the
timing plan and the rotation of the libraries over rounds, its float32 reference and rotary, one row
of each kind measured end to end on the CPU backend with stand-ins (a refusing "FA3", cuDNN refusing
CPU tensors), and the markdown of a fabricated result. Several fa4cpp builds in one run (--lib
NAME=PATH, two files of the library under test): their C ABI call against the package's, their own
columns, ratios and place in the rotated rounds, main() on the CPU; and a single build's output
against what decode.py wrote before it took several (tests/python/data/decode_single_build.json).
e4m3 caches (--kv-dtypes): their rows, bytes and draws, the quantisation against the package's
rounding, rows measured on the CPU backend (a wrong descale flagged), their markdown, and main()
with one build and with two. FlashAttention-4 (flash_attn.cute, stood in for by a
flash_attn_varlen_func over the package's op): its column, ratios and checks on decode and prefill
rows, paged and contiguous, in the rotated rounds; skipped on e4m3 rows and for append; its columns
omitted when it does not import; n/a when it raises; flagged when it is wrong."""
import functools
import json
import math
import shutil
import os
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture
def decode(monkeypatch, bench_script):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return bench_script("decode")


def rows_of(decode, *argv):
    return decode.plan(decode.parse_args(["--dry-run"] + list(argv)))


# -- rows ---------------------------------------------------------------------------------------

def test_default_rows_and_max_gb(decode):
    rows, skipped = rows_of(decode)
    decode_rows = [r for r in rows if r["kind"] == "decode"]
    assert len(decode_rows) + len(skipped) == 3 * 5 * 5 * 4
    for r in decode_rows:
        assert decode.kv_bytes([r["cache_len"]] * r["batch"], r["heads_kv"], 128) <= 40e9
    for s in skipped:
        assert s["kv_gb"] > 40 and s["reason"].endswith("> --max-gb 40")
    key = lambda r: (r["heads_q"], r["heads_kv"], r["batch"], r["cache_len"], r["page_size"])
    kept = {key(r) for r in decode_rows}
    assert (32, 8, 64, 131072, 0) in kept  # 34.4 GB
    assert (32, 8, 256, 65536, 0) in {key(s) for s in skipped}  # 68.7 GB
    assert (8, 1, 256, 131072, 256) in kept  # 17.2 GB
    # Table order: GQA, batch, cache length, layout.
    assert [key(r) for r in decode_rows[:5]] == [
        (32, 8, 1, 1024, 0), (32, 8, 1, 1024, 16), (32, 8, 1, 1024, 64), (32, 8, 1, 1024, 256),
        (32, 8, 1, 4096, 0)]
    prefill = [r for r in rows if r["kind"] == "prefill"]
    assert [(r["batch"], r["seqlen_q"], r["cache_len"], r["page_size"], r["heads_q"],
             r["heads_kv"], r["causal"]) for r in prefill] == [
        (4, 512, 8192, p, 32, 8, True) for p in (0, 64, 256)]
    rows, skipped = rows_of(decode, "--max-gb", "1", "--parts", "decode")
    assert all(decode.kv_bytes([r["cache_len"]] * r["batch"], r["heads_kv"], 128) <= 1e9
               for r in rows) and len(rows) + len(skipped) == 300
    assert all(r["kind"] == "decode" for r in rows)


def test_narrowing_options(decode):
    rows, skipped = rows_of(decode, "--gqa", "32/8,8/1", "--batches", "1,64", "--cache-lens",
                            "4k,131072", "--pages", "0,256", "--hdim", "64", "--ragged",
                            "--parts", "append,prefill", "--chunk", "256", "--prefill-cache",
                            "16k", "--prefill-batch", "2", "--prefill-pages", "0,16")
    dec = [(r["heads_q"], r["heads_kv"], r["batch"], r["cache_len"], r["page_size"])
           for r in rows if r["kind"] == "decode"]
    assert dec == [(hq, hkv, b, n, p) for hq, hkv in ((32, 8), (8, 1)) for b in (1, 64)
                   for n in (4096, 131072) for p in (0, 256)]
    assert not skipped  # 32/8 b64 128k at d64 is 17 GB
    assert all(r["head_dim"] == 64 and r["ragged"] for r in rows if r["kind"] == "decode")
    assert [(r["batch"], r["seqlen_q"], r["cache_len"], r["page_size"]) for r in rows
            if r["kind"] == "prefill"] == [(2, 256, 16384, 0), (2, 256, 16384, 16)]
    rows, _ = rows_of(decode, "--parts", "prefill")
    assert [r["kind"] for r in rows] == ["prefill"] * 3
    rows, _ = rows_of(decode, "--smoke")
    assert [(r["kind"], r["batch"], r["cache_len"], r["page_size"]) for r in rows] == [
        ("decode", 2, 1024, 0), ("decode", 2, 1024, 64), ("prefill", 1, 1024, 0)]
    for bad in (["--gqa", "32/5"], ["--parts", "decode,bwd"], ["--chunk", "9000"],
                ["--pages", "-16"]):
        with pytest.raises(SystemExit):
            decode.parse_args(["--dry-run"] + bad)
    with pytest.raises(SystemExit):
        decode.parse_args([])  # --sha and --out are needed to run
    assert decode.parse_len("128k") == 131072 and decode.parse_len("1000") == 1000
    assert decode.length_label(131072) == "128k" and decode.length_label(1000) == "1000"


def test_dry_run_prints_rows_and_estimate(decode, capsys):
    decode.main(["--dry-run", "--gqa", "32/8", "--batches", "256", "--cache-lens", "64k",
                 "--pages", "0", "--parts", "decode"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("skipped 32/8 b256 64k contiguous: K + V 68.7 GB")
    assert out[-1].startswith("0 rows, 1 skipped")
    args = decode.parse_args(["--dry-run", "--smoke"])
    rows, _ = decode.plan(args)
    one = decode.estimate_seconds(rows, args)
    args.rounds = 4
    assert 0 < one < decode.estimate_seconds(rows, args)


# -- bytes, FLOPs, copies and the timing plan ------------------------------------------------

def test_bytes_and_flops(decode):
    assert decode.kv_bytes([4096] * 64, 8, 128) == 64 * 4096 * 8 * 128 * 2 * 2
    assert decode.kv_bytes([10, 20], 1, 64) == 30 * 64 * 4
    for sq in range(0, 11):
        for sk in range(0, 11):
            brute = sum(1 for i in range(sq) for j in range(sk) if j <= i + sk - sq)
            assert decode.visible_pairs(sq, sk, True) == brute, (sq, sk)
            assert decode.visible_pairs(sq, sk, False) == sq * sk
    pairs = 512 * (8192 - 512) + 512 * 513 // 2
    assert decode.visible_pairs(512, 8192, True) == pairs
    assert decode.attention_flops(4, 32, 512, 8192, 128, True) == 4.0 * 4 * 32 * 128 * pairs
    assert decode.attention_flops(1, 8, 1, 4096, 128, False) == 4.0 * 8 * 4096 * 128
    # Decode's one row sees every key with or without the causal mask.
    assert decode.visible_pairs(1, 4096, True) == 4096


def test_capacity_copies_and_window_plan(decode):
    assert decode.capacity(4096, 0) == 4096 + 256  # room for the appended token
    assert decode.capacity(4096, 64) == 4096 + 64 and decode.capacity(1000, 16) == 1008
    assert decode.kv_copies(4 << 20, 50 << 20) == math.ceil(3 * 50 / 4)
    assert decode.kv_copies(1 << 30, 50 << 20) == 1 and decode.kv_copies(1, 50 << 20) == 64
    assert decode.window_plan(0.002, 20, 200, 5, 100) == (100, 5)  # 2 µs: 100 calls per window
    assert decode.window_plan(1e-5, 20, 200, 5, 100) == (128, 5)  # capped
    assert decode.window_plan(0.05, 20, 200, 5, 100) == (4, 5)
    assert decode.window_plan(1.0, 20, 200, 5, 100) == (1, 20)  # >= --reps calls
    assert decode.window_plan(10.0, 20, 200, 5, 100) == (1, 10)  # within --max-timing-ms
    assert decode.window_plan(50.0, 20, 200, 5, 100) == (1, 5)  # never below --min-windows


def test_rounds_rotate_and_a_failing_timing_stops(decode):
    order = []

    def timer(fn):
        return fn(), {"host_us": 1.0, "calls_per_window": 1, "windows": 5}

    def timed(name, ms):
        return lambda: (order.append(name), ms)[1]

    def broken():
        order.append("bad")
        raise RuntimeError("illegal page size\ndetail")

    times, details, failed = decode.time_rounds(
        {"a": timed("a", 1.0), "b": timed("b", 2.0), "bad": broken, "c": timed("c", 3.0)},
        4, timer)
    # Rounds start at a, b, bad (failed in round 0: left out), c.
    assert order == ["a", "b", "bad", "c", "b", "c", "a", "c", "a", "b", "c", "a", "b"]
    assert times == {"a": [1.0] * 4, "b": [2.0] * 4, "bad": [], "c": [3.0] * 4}
    assert failed == {"bad": "illegal page size"} and len(details["a"]) == 4


# -- the reference and rotary --------------------------------------------------------------------

def test_reference_matches_sdpa_bottom_right(decode):
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = torch.randn(5, 8, 16), torch.randn(9, 2, 16), torch.randn(9, 2, 16)
    for causal in (False, True):
        got = decode.reference_attention(q, k, v, causal)
        kk, vv = (x.repeat_interleave(4, dim=1).transpose(0, 1) for x in (k, v))
        mask = causal_lower_right(5, 9) if causal else None
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-5)
    # More queries than keys: the first rows see nothing and read zero.
    got = decode.reference_attention(torch.randn(4, 2, 8), torch.randn(2, 1, 8),
                                     torch.randn(2, 1, 8), True)
    assert torch.equal(got[:2], torch.zeros(2, 2, 8)) and got[2:].abs().sum() > 0


def test_rotary_is_the_packages_neox(decode):
    from fa4cpp import reference
    cos, sin = decode.rotary_tables(40, 16, torch.float32, "cpu")
    assert cos.shape == (40, 8) and torch.allclose(cos[3, 0], torch.tensor(math.cos(3.0)))
    x = torch.randn(1, 3, 16)
    want = reference.rotate(x, cos, sin, torch.tensor([17]), False)
    assert torch.allclose(decode.rotate_neox(x, cos, sin, 17), want, atol=1e-6)


def test_first_sequence_through_the_page_table(decode):
    cache = torch.arange(6 * 4 * 1 * 2, dtype=torch.float32).view(6, 4, 1, 2)
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    got = decode.first_sequence(cache, table, 6)
    assert torch.equal(got, torch.cat([cache[5], cache[2, :2]]))
    assert torch.equal(decode.first_sequence(cache, None, 3), cache[0, :3])


# -- rows measured on the CPU backend --------------------------------------------------------------

def test_rows_measured_on_the_cpu(decode):
    import fa4cpp

    def fa3_standin(q, k_cache, v_cache, page_table=None, **kw):
        if page_table is not None and k_cache.shape[1] == 16:
            raise ValueError("page size 16 not supported\nsecond line")
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, page_table=page_table, **kw)

    args = decode.parse_args(["--dry-run", "--rounds", "2", "--hdim", "32"])
    libs = {"fa4cpp": fa4cpp.flash_attn_with_kvcache, "FA3": fa3_standin}
    ms = {"fa4cpp": 0.010, "FA3": 0.020}
    calls = []

    def timer(fn):
        calls.append(fn)
        fn()
        return 0.001 * len(calls), {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    bench = decode.Bench(args, libs, timer, l2_bytes=1 << 16, device="cpu")
    base = {"heads_q": 4, "heads_kv": 2, "head_dim": 32, "batch": 2, "cache_len": 40,
            "ragged": False}
    contiguous = bench.measure(dict(base, kind="decode", seqlen_q=1, page_size=0), 0)
    libs_row = contiguous["libs"]
    assert libs_row["cuDNN"]["refused"]  # SDPA's cuDNN backend takes no CPU tensors: n/a
    for name in ("fa4cpp", "FA3"):
        e = libs_row[name]
        assert e["max_abs_diff_vs_ref"] < 2e-2 and e["append_max_abs_diff_vs_ref"] < 2e-2
        assert len(e["ms_rounds"]) == 2 and len(e["append_ms_rounds"]) == 2
        assert e["gbps"] == pytest.approx(contiguous["kv_bytes"] / (e["ms"] * 1e-3) / 1e9)
        assert e["append_over_plain_us"] == pytest.approx((e["append_ms"] - e["ms"]) * 1e3)
    assert libs_row["FA3"]["max_abs_diff_vs_fa4cpp"] == 0.0
    assert contiguous["kv_bytes"] == 2 * 40 * 2 * 32 * 4 and contiguous["flagged"] == []
    assert contiguous["fa4cpp_vs_fa3"] == pytest.approx(
        libs_row["fa4cpp"]["gbps"] / libs_row["FA3"]["gbps"])
    assert "fa4cpp_vs_cudnn" not in contiguous
    assert contiguous["kv_copies"] > 1  # a small cache is copied past the (stand-in) L2
    json.dumps(contiguous)

    calls.clear()
    paged = bench.measure(dict(base, kind="decode", seqlen_q=1, page_size=16, ragged=True), 1)
    assert paged["libs"]["FA3"] == {"refused": "page size 16 not supported",
                                    "append_refused": "page size 16 not supported"}
    assert paged["libs"]["cuDNN"] == {"skipped": decode.CUDNN_PAGED}
    assert paged["libs"]["fa4cpp"]["append_max_abs_diff_vs_ref"] < 2e-2
    assert 20 <= paged["seqlens"]["min"] <= paged["seqlens"]["max"] <= 40
    assert paged["kv_bytes"] == paged["seqlens"]["sum"] * 2 * 32 * 4
    assert len(calls) == 2 * 2  # fa4cpp plain and append, two rounds

    rows = [bench.measure(dict(base, kind="prefill", seqlen_q=8, page_size=p, causal=True), 2 + i)
            for i, p in enumerate((0, 16))]
    decode.prefill_ratios(rows)
    for row in rows:
        assert row["libs"]["cuDNN"] == {"skipped": decode.CUDNN_PREFILL}
        assert row["flops"] == decode.attention_flops(2, 4, 8, 40, 32, True)
        assert row["libs"]["fa4cpp"]["max_abs_diff_vs_ref"] < 2e-2
    assert rows[1]["libs"]["fa4cpp"]["vs_contiguous"] == pytest.approx(
        rows[1]["libs"]["fa4cpp"]["tflops"] / rows[0]["libs"]["fa4cpp"]["tflops"])
    assert "tflops" in rows[0]["libs"]["FA3"] and "refused" in rows[1]["libs"]["FA3"]


def test_flags_differences_over_tol_and_nan(decode):
    row = {"kind": "decode", "kv_bytes": 1e9, "libs": {
        "fa4cpp": {"ms": 1.0, "max_abs_diff_vs_ref": 0.001},
        "FA3": {"ms": 2.0, "max_abs_diff_vs_ref": 0.03, "max_abs_diff_vs_fa4cpp": float("nan")},
        "cuDNN": {"refused": "no kernel"}}}
    decode.add_rates(row, 2e-2)
    assert row["libs"]["fa4cpp"]["gbps"] == pytest.approx(1000.0)
    assert row["fa4cpp_vs_fa3"] == pytest.approx(2.0) and "fa4cpp_vs_cudnn" not in row
    assert row["flagged"] == ["FA3 max_abs_diff_vs_ref 0.03", "FA3 max_abs_diff_vs_fa4cpp nan"]


# -- markdown -------------------------------------------------------------------------------------

def fabricated(fa3=True):
    def lib(gbps, us, diff=0.001, append_over=None, **more):
        e = {"gbps": gbps, "us": us, "ms": us / 1e3, "max_abs_diff_vs_ref": diff}
        if append_over is not None:
            e["append_over_plain_us"] = append_over
        e.update(more)
        return e
    rows = [
        {"kind": "decode", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "batch": 64,
         "cache_len": 4096, "page_size": 0, "fa4cpp_vs_cudnn": 1.02, "fa4cpp_vs_fa3": 1.1,
         "flagged": [], "libs": {"fa4cpp": lib(4100, 262.0, append_over=3.5),
                                 "FA3": lib(3700, 290.0, append_over=-1.25),
                                 "cuDNN": lib(4000, 268.0)}},
        {"kind": "decode", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "batch": 64,
         "cache_len": 4096, "page_size": 16, "flagged": ["fa4cpp max_abs_diff_vs_ref 0.05"],
         "libs": {"fa4cpp": lib(3000, 358.0, diff=0.05, append_refused="no append path"),
                  "FA3": {"refused": "page size 16", "append_refused": "page size 16"},
                  "cuDNN": {"skipped": "contiguous caches only"}}},
        {"kind": "decode", "heads_q": 8, "heads_kv": 1, "head_dim": 128, "batch": 1,
         "cache_len": 131072, "page_size": 256, "error": "CUDA out of memory", "libs": {}},
        {"kind": "prefill", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "batch": 4,
         "seqlen_q": 512, "cache_len": 8192, "page_size": 0, "flagged": [],
         "fa4cpp_vs_fa3": 1.05, "libs": {"fa4cpp": {"tflops": 520.0, "us": 1000.0, "ms": 1.0,
                                                    "max_abs_diff_vs_ref": 0.002},
                                         "FA3": {"tflops": 495.0, "us": 1050.0, "ms": 1.05,
                                                 "max_abs_diff_vs_ref": 0.002},
                                         "cuDNN": {"skipped": "top-left"}}},
        {"kind": "prefill", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "batch": 4,
         "seqlen_q": 512, "cache_len": 8192, "page_size": 64, "flagged": [],
         "libs": {"fa4cpp": {"tflops": 500.0, "us": 1040.0, "ms": 1.04, "vs_contiguous": 0.96,
                             "max_abs_diff_vs_ref": 0.002},
                  "FA3": {"refused": "paged prefill"}}},
    ]
    if not fa3:
        for r in rows:
            r.get("libs", {}).pop("FA3", None)
            r.pop("fa4cpp_vs_fa3", None)
    return {"benchmark": "decode", "git_sha": "abc1234", "torch": "2.11.0", "cudnn": 91900,
            "rounds": 5, "timing": "windows of >= 200 µs", "head_dim": 128, "tol": 0.02,
            "max_gb": 40, "complete": True, "gpu_before": {"name": "NVIDIA H200",
                                                           "driver_version": "580"},
            "libs": [{"name": "fa4cpp", "version": "0.1.0", "path": "build/libfa4.so"}],
            "fa3": {"available": True, "version": "3.0.0b1"} if fa3 else
            {"available": False, "missing": "flash_attn_interface: No module named x"},
            "fa4cpp_ops": "native torch ops",
            "skipped_rows": [{"heads_q": 32, "heads_kv": 8, "batch": 256, "cache_len": 131072,
                              "page_size": 0}],
            "rows": rows}


def table(md, title):
    lines = md.splitlines()
    start = lines.index(title) + 2
    while not lines[start].startswith("|"):
        start += 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return [[c.strip() for c in line.split("|")[1:-1]] for line in lines[start:end]]


def test_markdown_with_fa3(decode):
    md = decode.markdown(fabricated())
    assert md.startswith("# Decode and chunked prefill over a KV cache (bench/decode.py)\n")
    head = md.splitlines()[2]
    for text in ("NVIDIA H200", "driver 580", "torch 2.11.0", "cuDNN 91900", "git abc1234",
                 "FA3 = flash_attn_interface.flash_attn_with_kvcache, version 3.0.0b1",
                 "5 rounds", "windows of >= 200 µs", "native torch ops"):
        assert text in head, text
    assert "Skipped (K + V over --max-gb 40): 32/8 b256 128k contiguous." in md
    rows = table(md, "## Decode, GQA 32/8, d128")
    assert rows[0] == ["b", "cache", "layout", "fa4cpp GB/s (µs)", "FA3 GB/s (µs)",
                       "cuDNN GB/s (µs)", "fa4cpp/cuDNN", "fa4cpp/FA3",
                       "append+rotary µs over plain: fa4cpp", "append+rotary µs over plain: FA3",
                       "max abs diff vs ref (fa4cpp / FA3 / cuDNN)", "check"]
    assert rows[1] == ["---"] * 12 or set(rows[1]) == {"---"}
    assert rows[2] == ["64", "4k", "contiguous", "4100 (262.0)", "3700 (290.0)", "4000 (268.0)",
                       "1.02", "1.10", "+3.5", "-1.2", "0.001 / 0.001 / 0.001", "ok"]
    assert rows[3][:10] == ["64", "4k", "paged 16", "3000 (358.0)", "n/a", "—", "—", "—",
                            "n/a", "n/a"]
    assert rows[3][11].startswith("**over tol**: fa4cpp max_abs_diff_vs_ref 0.05")
    assert "- n/a: FA3 (plain, 1 row): page size 16" in md
    assert "- n/a: fa4cpp (append, 1 row): no append path" in md
    small = table(md, "## Decode, GQA 8/1, d128")
    assert small[2][:3] == ["1", "128k", "paged 256"] and small[2][-1] == "error"
    assert "- n/a: row (error, 1 row): CUDA out of memory" in md
    title = ("## Chunked prefill: 512 queries against 8k keys, causal (bottom-right), GQA 32/8, "
             "b 4, d128")
    pre = table(md, title)
    assert pre[0] == ["layout", "fa4cpp TFLOP/s (µs)", "FA3 TFLOP/s (µs)", "fa4cpp/FA3",
                      "fa4cpp paged/contiguous", "FA3 paged/contiguous",
                      "max abs diff vs ref (fa4cpp / FA3)", "check"]
    assert pre[2] == ["contiguous", "520.0 (1000.0)", "495.0 (1050.0)", "1.05", "—", "—",
                      "0.002 / 0.002", "ok"]
    assert pre[3][:6] == ["paged 64", "500.0 (1040.0)", "n/a", "—", "0.96", "—"]
    assert "%d visible (query, key) pairs" % (512 * 7680 + 512 * 513 // 2) in md
    assert "cuDNN: not run: SDPA's is_causal is aligned top-left" in md
    assert "Partial" not in md and "host-bound" not in md
    assert "**Partial:**" in decode.markdown(dict(fabricated(), complete=False))
    r = fabricated()
    r["rows"][0]["libs"]["FA3"]["host_bound"] = True
    md = decode.markdown(r)
    assert "| 3700 (290.0)† |" in md and "† host-bound: in some round" in md


def test_markdown_without_fa3_omits_its_columns(decode):
    md = decode.markdown(fabricated(fa3=False))
    assert ("FA3 not importable here (flash_attn_interface: No module named x): its columns are "
            "omitted") in md
    rows = table(md, "## Decode, GQA 32/8, d128")
    assert rows[0] == ["b", "cache", "layout", "fa4cpp GB/s (µs)", "cuDNN GB/s (µs)",
                       "fa4cpp/cuDNN", "append+rotary µs over plain: fa4cpp",
                       "max abs diff vs ref (fa4cpp / cuDNN)", "check"]
    assert all(len(r) == len(rows[0]) for r in rows[2:])
    assert "FA3" not in "\n".join(md.splitlines()[3:])


def test_plot_needs_rows_at_32_8(decode, tmp_path):
    assert decode.plot({"rows": [{"kind": "prefill"}]}, str(tmp_path / "x.png")) is None
    pytest.importorskip("matplotlib")
    path = decode.plot(fabricated(), str(tmp_path / "x.png"))
    assert path and os.path.getsize(path) > 0


def test_timer_keeps_windows_queued_ahead_of_the_gpu(decode, monkeypatch):
    # Fake events: a window's time is its calls × 0.01 ms, or 1 ms per call when the GPU had
    # started it before the host finished queuing (query() True: those must not count).
    state = {"calls": 0, "script": [], "holds": []}

    class Event:
        def __init__(self, enable_timing=True):
            self.starved = False

        def record(self):
            self.calls = state["calls"]

        def query(self):
            self.starved = state["script"].pop(0) if state["script"] else False
            return self.starved

        def elapsed_time(self, end):
            return (end.calls - self.calls) * (1.0 if self.starved else 0.01)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: state["holds"].append(cycles))

    def fn():
        state["calls"] += 1

    timer = decode.Timer(20, 200, 5, 100, cycles_per_us=1000.0)
    state["script"] = [True, False]  # the first window started early: the hold doubles
    ms, detail = timer(fn)
    assert ms == pytest.approx(0.01) and timer.factor == 2 * decode.Timer.HOLD_FACTOR
    assert detail["calls_per_window"] == 20 and detail["windows"] == 5
    assert not detail["host_bound"]
    assert state["calls"] == 2 + 3 + 6 * 20  # warm-up, estimate, one repeated window
    state["script"] = [True] * 100  # never ahead: host-bound, every window kept
    ms, detail = timer(fn)
    assert ms == pytest.approx(1.0) and detail["host_bound"] and detail["windows"] == 15
    assert timer.factor == 64.0


# -- several fa4cpp builds in one run (--lib NAME=PATH, repeated) -------------------------------

@pytest.fixture(scope="module")
def two_libraries(tmp_path_factory):
    """Two files of the library under test (the loader keys on the file: a copy loads apart)."""
    from fa4cpp import _library
    first = _library.library_path()
    copy = tmp_path_factory.mktemp("builds") / "libfa4_copy.so"
    shutil.copyfile(first, copy)
    return first, str(copy)


def logged(log, name, func):
    """func, noting (name, plain / append) in log at every call."""
    def call(*args, **kwargs):
        log.append((name, "append" if kwargs.get("k") is not None else "plain"))
        return func(*args, **kwargs)
    return call


def test_c_abi_call_matches_the_package(decode, two_libraries):
    """c_abi_kvcache (how each build of a several-build run is called) computes what the package's
    flash_attn_with_kvcache computes, appends and rotary included, contiguous and paged."""
    import fa4cpp
    bld = decode.sweep.Build("gather", two_libraries[1])
    mine = decode.c_abi_kvcache(bld.fa4)
    b, hq, hkv, d, n = 2, 4, 2, 32, 40
    cos, sin = decode.rotary_tables(64, d, torch.bfloat16, "cpu")
    for page in (0, 16):
        cap = decode.capacity(n, page)
        shape = (b * cap // page, page, hkv, d) if page else (b, cap, hkv, d)
        table = (torch.randperm(b * cap // page).view(b, -1).to(torch.int32) if page else None)
        kc, vc = torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16)
        q = torch.randn(b, 1, hq, d, dtype=torch.bfloat16)
        lens = torch.tensor([n, n - 7], dtype=torch.int32)
        k_new = torch.randn(b, 1, hkv, d, dtype=torch.bfloat16)
        v_new = torch.randn(b, 1, hkv, d, dtype=torch.bfloat16)
        for extra in ({}, dict(k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                               rotary_interleaved=False)):
            caches = [(kc.clone(), vc.clone()) for _ in range(2)]
            got = mine(q, *caches[0], cache_seqlens=lens, page_table=table, causal=False, **extra)
            want = fa4cpp.flash_attn_with_kvcache(q, *caches[1], cache_seqlens=lens,
                                                  page_table=table, causal=False, **extra)
            assert torch.equal(got, want)
            assert torch.equal(caches[0][0], caches[1][0])  # the same rows appended
            assert torch.equal(caches[0][1], caches[1][1])
            if extra:
                assert not torch.equal(caches[0][0], kc)
    # The build's refusal raises its Fa4Error (never the package's fallback).
    wide = torch.randn(1, 8, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(decode.sweep.fa4_ctypes.Fa4Error, match="head_dim"):
        mine(wide[:, :1], wide, wide.clone(), cache_seqlens=torch.tensor([4], dtype=torch.int32))


def test_two_builds_rotate_and_get_their_own_columns(decode, two_libraries):
    import fa4cpp
    log = []
    mains = [decode.sweep.Build(name, path) for name, path in zip(("main", "gather"),
                                                                  two_libraries)]
    libs = {b.name: logged(log, b.name, decode.c_abi_kvcache(b.fa4)) for b in mains}
    libs["FA3"] = logged(log, "FA3", fa4cpp.flash_attn_with_kvcache)
    base_ms = {("main", "plain"): 0.010, ("main", "append"): 0.014,
               ("gather", "plain"): 0.008, ("gather", "append"): 0.013,
               ("FA3", "plain"): 0.020, ("FA3", "append"): 0.021}
    timed = []

    def timer(fn):
        fn()
        timed.append(log[-1])
        return base_ms[log[-1]] * (1 + 0.01 * (len(timed) % 3)), {
            "host_us": 3.0, "calls_per_window": 2, "windows": 5}

    args = decode.parse_args(["--dry-run", "--rounds", "3", "--hdim", "32"])
    bench = decode.Bench(args, libs, timer, l2_bytes=1 << 16, device="cpu",
                         builds=["main", "gather"])
    row = bench.measure({"kind": "decode", "heads_q": 4, "heads_kv": 2, "head_dim": 32,
                         "batch": 2, "seqlen_q": 1, "cache_len": 40, "page_size": 0,
                         "ragged": False}, 0)
    # Every (library, call) pair takes its turn to go first: round r starts r places on.
    keys = [("main", "plain"), ("main", "append"), ("gather", "plain"), ("gather", "append"),
            ("FA3", "plain"), ("FA3", "append")]
    assert timed == [k for r in range(3) for k in keys[r:] + keys[:r]]
    e = row["libs"]
    assert e["cuDNN"]["refused"]  # no cuDNN on CPU tensors
    for name in ("main", "gather", "FA3"):
        want = sorted(base_ms[(name, "plain")] * (1 + 0.01 * (i % 3))
                      for i, k in enumerate(timed, 1) if k == (name, "plain"))
        assert sorted(e[name]["ms_rounds"]) == pytest.approx(want) and len(want) == 3
        assert e[name]["ms"] == pytest.approx(want[1])
        assert len(e[name]["append_ms_rounds"]) == 3
        assert e[name]["gbps"] == pytest.approx(row["kv_bytes"] / (e[name]["ms"] * 1e-3) / 1e9)
        assert e[name]["max_abs_diff_vs_ref"] < 2e-2
    # Ratios: each build to FA3 (cuDNN refused: none), the second build to the first.
    assert row["gather_vs_main"] == pytest.approx(e["main"]["ms"] / e["gather"]["ms"])
    assert row["gather_vs_main"] == pytest.approx(1.25, rel=0.03)
    for name in ("main", "gather"):
        assert row[name + "_vs_fa3"] == pytest.approx(e["FA3"]["ms"] / e[name]["ms"])
        assert name + "_vs_cudnn" not in row
    assert not any(k.startswith("fa4cpp") for k in row)
    # Outputs are compared with the first build's: the copy computes the same bits.
    assert e["gather"]["max_abs_diff_vs_main"] == 0.0
    assert e["gather"]["append_max_abs_diff_vs_main"] == 0.0
    assert "max_abs_diff_vs_main" in e["FA3"] and "max_abs_diff_vs_main" not in e["main"]
    assert row["flagged"] == []
    json.dumps(row)


def test_build_ratios_and_flags(decode):
    row = {"kind": "prefill", "batch": 1, "heads_q": 8, "seqlen_q": 4, "cache_len": 16,
           "head_dim": 64, "libs": {
               "a": {"ms": 2.0, "max_abs_diff_vs_ref": 0.001},
               "b": {"ms": 1.0, "max_abs_diff_vs_ref": 0.001, "max_abs_diff_vs_a": 0.5},
               "c": {"refused": "no"},
               "FA3": {"ms": 4.0, "max_abs_diff_vs_a": 0.001},
               "cuDNN": {"ms": 1.0}}}
    decode.add_rates(row, 2e-2, ["a", "b", "c"])
    assert row["b_vs_a"] == pytest.approx(2.0) and "c_vs_a" not in row
    assert row["a_vs_fa3"] == pytest.approx(2.0) and row["b_vs_fa3"] == pytest.approx(4.0)
    assert row["a_vs_cudnn"] == pytest.approx(0.5) and row["b_vs_cudnn"] == pytest.approx(1.0)
    assert row["flagged"] == ["b max_abs_diff_vs_a 0.5"]


def two_builds(r):
    """fabricated() as a run of two builds, main and gather (gather 10 % faster where it ran)."""
    r["libs"] = [{"name": "main", "version": "0.1.0", "path": "a/libfa4.so"},
                 {"name": "gather", "version": "0.1.0", "path": "b/libfa4.so"}]
    r["fa4cpp_ops"] = "ctypes"
    for row in r["rows"]:
        libs = row["libs"]
        if "fa4cpp" not in libs:
            continue
        main = libs["main"] = libs.pop("fa4cpp")
        gather = libs["gather"] = dict(main)
        for unit in ("gbps", "tflops"):
            if unit in main:
                gather[unit] = main[unit] * 1.1
        for key in ("fa4cpp_vs_cudnn", "fa4cpp_vs_fa3"):
            if key in row:
                row["main" + key[6:]] = row.pop(key)
                row["gather" + key[6:]] = row["main" + key[6:]] * 1.1
        if "ms" in main:
            row["gather_vs_main"] = 1.1
        libs.update((k, libs.pop(k)) for k in ("FA3", "cuDNN") if k in libs)  # --lib order
    return r


def test_markdown_of_two_builds(decode):
    r = two_builds(fabricated())
    r["rows"][1]["libs"]["gather"] = {"refused": "gather: no page size 16"}
    del r["rows"][1]["gather_vs_main"]
    md = decode.markdown(r)
    head = md.splitlines()[2]
    assert "main = fa4cpp 0.1.0 (a/libfa4.so); gather = fa4cpp 0.1.0 (b/libfa4.so)" in head
    assert "main, gather each through its own C ABI (ctypes)" in head
    assert "gather/main against the first build" in md and "against main's over the whole" in md
    rows = table(md, "## Decode, GQA 32/8, d128")
    assert rows[0] == ["b", "cache", "layout", "main GB/s (µs)", "gather GB/s (µs)",
                       "FA3 GB/s (µs)", "cuDNN GB/s (µs)", "gather/main", "main/cuDNN",
                       "gather/cuDNN", "main/FA3", "gather/FA3",
                       "append+rotary µs over plain: main", "append+rotary µs over plain: gather",
                       "append+rotary µs over plain: FA3",
                       "max abs diff vs ref (main / gather / FA3 / cuDNN)", "check"]
    assert rows[2] == ["64", "4k", "contiguous", "4100 (262.0)", "4510 (262.0)", "3700 (290.0)",
                       "4000 (268.0)", "1.10", "1.02", "1.12", "1.10", "1.21", "+3.5", "+3.5",
                       "-1.2", "0.001 / 0.001 / 0.001 / 0.001", "ok"]
    assert rows[3][:12] == ["64", "4k", "paged 16", "3000 (358.0)", "n/a", "n/a", "—", "—", "—",
                            "—", "—", "—"]
    assert all(len(x) == len(rows[0]) for x in rows[2:])
    assert "- n/a: gather (plain, 1 row): gather: no page size 16" in md
    pre = table(md, "## Chunked prefill: 512 queries against 8k keys, causal (bottom-right), "
                    "GQA 32/8, b 4, d128")
    assert pre[0] == ["layout", "main TFLOP/s (µs)", "gather TFLOP/s (µs)", "FA3 TFLOP/s (µs)",
                      "gather/main", "main/FA3", "gather/FA3", "main paged/contiguous",
                      "gather paged/contiguous", "FA3 paged/contiguous",
                      "max abs diff vs ref (main / gather / FA3)", "check"]
    assert pre[2][:7] == ["contiguous", "520.0 (1000.0)", "572.0 (1000.0)", "495.0 (1050.0)",
                          "1.10", "1.05", "1.16"]
    assert "fa4cpp/" not in md and "fa4cpp GB/s" not in md
    md = decode.markdown(two_builds(fabricated(fa3=False)))
    rows = table(md, "## Decode, GQA 32/8, d128")
    assert rows[0][5:9] == ["cuDNN GB/s (µs)", "gather/main", "main/cuDNN", "gather/cuDNN"]
    assert "FA3" not in "\n".join(md.splitlines()[3:])


def test_plot_of_two_builds(decode, tmp_path):
    pytest.importorskip("matplotlib")
    path = decode.plot(two_builds(fabricated()), str(tmp_path / "ab.png"))
    assert path and os.path.getsize(path) > 0


def test_lib_options(decode, two_libraries, tmp_path, capsys):
    a, b = two_libraries
    args = decode.parse_args(["--dry-run", "--lib", a])
    assert args.libs == [("fa4cpp", a)] and args.lib_env == {}
    args = decode.parse_args(["--dry-run", "--lib", "main=" + a, "--lib", "gather=" + b,
                              "--lib-env", "gather:FA4_CPU_THREADS=1"])
    assert args.libs == [("main", a), ("gather", b)]
    assert args.lib_env == {"gather": {"FA4_CPU_THREADS": "1"}}
    assert decode.parse_args(["--dry-run"]).libs == [("fa4cpp", None)]
    link = tmp_path / "link.so"
    os.symlink(a, link)
    for bad in (["--lib", a, "--lib", b],  # two bare paths: both named fa4cpp
                ["--lib", "main=" + a, "--lib", "other=" + str(link)],  # one file twice
                ["--lib", "FA3=" + a], ["--lib", "cuDNN=" + a],  # a peer's column
                ["--lib", "main=" + str(tmp_path / "missing.so")],
                ["--lib", "main=" + a, "--lib-env", "gather:FA4_CPU_THREADS=1"]):
        with pytest.raises(SystemExit):
            decode.parse_args(["--dry-run"] + bad)
    row = {"kind": "decode", "page_size": 0, "ragged": False}
    assert decode.timed_calls(row, ["decode", "append"], True, ["a", "b"]) == [
        ("a", "plain"), ("b", "plain"), ("FA3", "plain"), ("cuDNN", "plain"),
        ("a", "append"), ("b", "append"), ("FA3", "append")]
    argv = ["--dry-run", "--smoke"]
    one = decode.estimate_seconds(*reversed((decode.parse_args(argv),
                                             decode.plan(decode.parse_args(argv))[0])))
    args = decode.parse_args(argv + ["--lib", "main=" + a, "--lib", "gather=" + b])
    two = decode.estimate_seconds(decode.plan(args)[0], args, builds=["main", "gather"])
    assert two > one
    decode.main(argv + ["--lib", "main=" + a, "--lib", "gather=" + b])
    assert capsys.readouterr().out.splitlines()[-1].endswith("(2 rounds, builds main, gather)")


# -- main() on the CPU: one build as before, two builds side by side -----------------------------

GOLDEN = os.path.join(REPO, "tests", "python", "data", "decode_single_build.json")
CPU_ARGV = ["--sha", "abc1234", "--name", "run", "--no-plot", "--hdim", "32", "--gqa", "4/2",
            "--batches", "2", "--cache-lens", "40", "--pages", "0,16", "--prefill-gqa", "4/2",
            "--prefill-batch", "2", "--chunk", "8", "--prefill-cache", "40",
            "--prefill-pages", "0,16", "--rounds", "3"]


FA4_MISSING = "flash_attn.cute: No module named 'flash_attn'"


def run_main_on_cpu(decode, monkeypatch, out, argv, fa4=None):
    """decode.main(CPU_ARGV + argv) with the GPU's pieces stood in for: rows on the CPU backend, a
    timer that calls once and returns a made-up time, an "FA3" that refuses pages of 16 keys, and
    FA4's flash_attn_varlen_func fa4 (None: FA4 does not import, FA4_MISSING). Returns the result
    (JSON) and the markdown."""
    import fa4cpp
    from fa4cpp import _library

    def fa3_standin(q, k_cache, v_cache, page_table=None, **kw):
        if page_table is not None and k_cache.shape[1] == 16:
            raise ValueError("page size 16 not supported")
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, page_table=page_table, **kw)

    class Timer:
        def __init__(self, *args):
            self.n = 0

        def __call__(self, fn):
            self.n += 1
            fn()
            return 0.01 + 0.001 * (self.n % 7), {"host_us": 3.0, "calls_per_window": 2,
                                                 "windows": 5, "host_bound": False}

    monkeypatch.setenv("FA4CPP_LIBRARY", _library.library_path())  # main may set it
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(L2_cache_size=1 << 16))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(decode.sweep, "gpu_facts", lambda: {"name": "CPU stand-in"})
    monkeypatch.setattr(decode, "find_fa3", lambda: (fa3_standin, "3.0.0b1"))
    monkeypatch.setattr(decode, "find_fa4", lambda: (fa4, "4.0.0b36") if fa4 else
                        (None, FA4_MISSING))
    monkeypatch.setattr(decode, "Timer", Timer)
    monkeypatch.setattr(decode, "Bench", functools.partial(decode.Bench, device="cpu"))
    decode.main(CPU_ARGV + ["--out", str(out)] + list(argv))
    with open(os.path.join(out, "run.json")) as f:
        result = json.load(f)
    with open(os.path.join(out, "run.md")) as f:
        return result, f.read()


def result_keys(result):
    """The keys of a result, in order, at every level the tables and tools read."""
    return {"top": list(result), "libs": [list(x) for x in result["libs"]],
            "options": list(result["options"]),
            "rows": [[list(row), {name: list(e) for name, e in row["libs"].items()}]
                     for row in result["rows"]]}


# What --kv-dtypes adds to a bf16-only run, which the golden file predates: two options and each
# decode row's kv_dtype (test_single_build_output_unchanged checks them apart).
KV_DTYPE_OPTIONS = ("kv_dtypes", "fp8_tol")
KV_DTYPE_ROW_KEYS = ("kv_dtype",)


def without_kv_dtype_keys(keys):
    """result_keys' keys less those KV_DTYPE_OPTIONS and KV_DTYPE_ROW_KEYS name."""
    return dict(keys, options=[k for k in keys["options"] if k not in KV_DTYPE_OPTIONS],
                rows=[[[k for k in row if k not in KV_DTYPE_ROW_KEYS], libs]
                      for row, libs in keys["rows"]])


# What FA4's columns add to a run where FA4 does not import, which the golden file predates: the
# result's fa4 entry (available: False, and why) and two options.
FA4_TOP_KEYS = ("fa4",)
FA4_OPTIONS = ("fa4_version", "fa4_num_splits")


def without_fa4_keys(keys):
    """result_keys' keys less those FA4_TOP_KEYS and FA4_OPTIONS name."""
    return dict(keys, top=[k for k in keys["top"] if k not in FA4_TOP_KEYS],
                options=[k for k in keys["options"] if k not in FA4_OPTIONS])


def single_build_outputs(decode, monkeypatch, out, argv):
    """What tests/python/data/decode_single_build.json holds: the markdown of the fabricated
    results and the keys of a single-build run on the CPU (made by bench/decode.py before it
    took several builds)."""
    r = fabricated()
    r["rows"][0]["libs"]["FA3"]["host_bound"] = True
    result, _ = run_main_on_cpu(decode, monkeypatch, out, argv)
    return {"markdown_fa3": decode.markdown(fabricated()),
            "markdown_no_fa3": decode.markdown(fabricated(fa3=False)),
            "markdown_partial_host_bound": decode.markdown(dict(r, complete=False)),
            "keys": without_fa4_keys(without_kv_dtype_keys(result_keys(result)))}


@pytest.mark.parametrize("lib", [False, True])
def test_single_build_output_unchanged(decode, monkeypatch, tmp_path, lib):
    """One build (--lib PATH, or none) writes what decode.py wrote before it took several: the
    same markdown for the same result, the same JSON keys at every level, column fa4cpp."""
    from fa4cpp import _library
    argv = ["--lib", _library.library_path()] if lib else []
    with open(GOLDEN) as f:
        golden = json.load(f)
    got = single_build_outputs(decode, monkeypatch, tmp_path, argv)
    for key in ("markdown_fa3", "markdown_no_fa3", "markdown_partial_host_bound"):
        assert got[key] == golden[key], key
    assert got["keys"] == golden["keys"]
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path / "again", argv)
    assert [x["name"] for x in result["libs"]] == ["fa4cpp"]
    # The keys --kv-dtypes adds: its options, and every decode row's (bf16) cache dtype.
    assert set(KV_DTYPE_OPTIONS) <= set(result["options"])
    assert result["options"]["kv_dtypes"] == ["bf16"] and "fp8" not in result
    # FA4's: not importable here (run_main_on_cpu's default), its splits option.
    assert result["fa4"] == {"available": False, "missing": FA4_MISSING}
    assert result["options"]["fa4_num_splits"] == 1 and result["options"]["fa4_version"] is None
    assert [r.get("kv_dtype") for r in result["rows"]] == ["bf16", "bf16", None, None]
    assert result["fa4cpp_ops"] in ("native torch ops",
                                    "the package's Python implementation of the ops")
    assert "; fa4cpp through fa4cpp.flash_attn_with_kvcache (%s);" % result["fa4cpp_ops"] in md
    contiguous = result["rows"][0]
    assert contiguous["fa4cpp_vs_fa3"] == pytest.approx(
        contiguous["libs"]["fa4cpp"]["gbps"] / contiguous["libs"]["FA3"]["gbps"])
    assert "max_abs_diff_vs_fa4cpp" in contiguous["libs"]["FA3"]


def test_two_builds_through_main(decode, monkeypatch, tmp_path, two_libraries):
    a, b = two_libraries
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path, [
        "--lib", "main=" + a, "--lib", "gather=" + b, "--lib-env", "gather:FA4_CPU_THREADS=1"])
    assert [(x["name"], x["env"]) for x in result["libs"]] == [
        ("main", {}), ("gather", {"FA4_CPU_THREADS": "1"})]
    assert result["fa4cpp_ops"].startswith("ctypes")
    assert "lib_env" not in result["options"] and "libs" not in result["options"]
    kinds = [(x["kind"], x["page_size"]) for x in result["rows"]]
    assert kinds == [("decode", 0), ("decode", 16), ("prefill", 0), ("prefill", 16)]
    unit = {"decode": "gbps", "prefill": "tflops"}
    for row in result["rows"]:
        e = row["libs"]
        assert [n for n in e if n != "cuDNN"] == ["main", "gather", "FA3"]
        for name in ("main", "gather"):
            assert len(e[name]["ms_rounds"]) == 3 and e[name]["max_abs_diff_vs_ref"] < 2e-2
        assert e["gather"]["max_abs_diff_vs_main"] == 0.0
        assert row["gather_vs_main"] == pytest.approx(
            e["gather"][unit[row["kind"]]] / e["main"][unit[row["kind"]]])
        if "ms" in e["FA3"]:
            assert row["gather_vs_fa3"] == pytest.approx(e["FA3"]["ms"] / e["gather"]["ms"])
        assert not any(k.startswith("fa4cpp") for k in list(row) + list(e["FA3"]))
    assert len(result["rows"][0]["libs"]["gather"]["append_ms_rounds"]) == 3
    for name in ("main", "gather"):  # each build's paged / contiguous prefill
        assert result["rows"][3]["libs"][name]["vs_contiguous"] == pytest.approx(
            result["rows"][3]["libs"][name]["tflops"] / result["rows"][2]["libs"][name]["tflops"])
    rows = table(md, "## Decode, GQA 4/2, d32")
    assert rows[0][3:8] == ["main GB/s (µs)", "gather GB/s (µs)", "FA3 GB/s (µs)",
                            "cuDNN GB/s (µs)", "gather/main"]
    assert rows[2][7] == "%.2f" % result["rows"][0]["gather_vs_main"]
    assert "main, gather each through its own C ABI (ctypes;" in md


# -- e4m3 caches (--kv-dtypes) ---------------------------------------------------------------------

def test_kv_dtype_rows_bytes_and_options(decode, capsys):
    rows, skipped = rows_of(decode, "--gqa", "32/8", "--batches", "1,256", "--cache-lens",
                            "4k,64k", "--pages", "0,64", "--parts", "decode", "--kv-dtypes",
                            "bf16,e4m3")
    key = lambda r: (r["batch"], r["cache_len"], r["page_size"], r["kv_dtype"])
    # A shape's bf16 and e4m3 rows side by side; e4m3 reads half the bytes, so it fits in
    # --max-gb where bf16 does not.
    assert [key(r) for r in rows[:4]] == [(1, 4096, 0, "bf16"), (1, 4096, 0, "e4m3"),
                                          (1, 4096, 64, "bf16"), (1, 4096, 64, "e4m3")]
    assert {key(s) for s in skipped} == {(256, 65536, p, "bf16") for p in (0, 64)}
    assert {(256, 65536, p, "e4m3") for p in (0, 64)} <= {key(r) for r in rows}
    for r in rows:
        size = 1 if r["kv_dtype"] == "e4m3" else 2
        assert decode.row_kv_bytes(r) == r["batch"] * r["cache_len"] * 8 * 128 * 2 * size
        assert decode.row_alloc_bytes(r) == (r["batch"] * decode.capacity(r["cache_len"],
                                                                          r["page_size"])
                                             * 8 * 128 * 2 * size)
    # --smoke: one tiny e4m3 decode row (contiguous) when e4m3 is asked for.
    rows, _ = rows_of(decode, "--smoke", "--kv-dtypes", "bf16,e4m3")
    assert [(r["kind"], r["page_size"], decode.kv_dtype(r)) for r in rows] == [
        ("decode", 0, "bf16"), ("decode", 0, "e4m3"), ("decode", 64, "bf16"),
        ("prefill", 0, "bf16")]
    assert all(r["kv_dtype"] == "bf16" for r in rows_of(decode)[0] if r["kind"] == "decode")
    assert all(r["kv_dtype"] == "e4m3" for r in rows_of(decode, "--kv-dtypes", "e4m3",
                                                        "--parts", "decode")[0])
    for bad in (["--kv-dtypes", "fp8"], ["--kv-dtypes", "bf16,bf16"], ["--kv-dtypes", ","],
                ["--kv-dtypes", "e4m3", "--parts", "append,prefill"]):
        with pytest.raises(SystemExit):
            decode.parse_args(["--dry-run"] + bad)
    # e4m3 rows time the plain call, and not on cuDNN.
    row = {"kind": "decode", "page_size": 0, "ragged": False, "kv_dtype": "e4m3"}
    assert decode.timed_calls(row, ["decode", "append"]) == [("fa4cpp", "plain"),
                                                             ("FA3", "plain")]
    decode.main(["--dry-run", "--gqa", "32/8", "--batches", "256", "--cache-lens", "64k",
                 "--pages", "0", "--parts", "decode", "--kv-dtypes", "bf16,e4m3"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["decode", "32/8", "b256", "64k", "contiguous", "e4m3", "K+V",
                              "34.360", "GB"]
    assert out[1].startswith("skipped 32/8 b256 64k contiguous: K + V 68.7 GB")
    assert out[-1].startswith("1 rows, 1 skipped")


def test_a_shapes_dtypes_share_their_draws(decode):
    rows, _ = rows_of(decode, "--gqa", "32/8", "--batches", "1", "--cache-lens", "1k", "--pages",
                      "0,64", "--kv-dtypes", "bf16,e4m3")
    assert decode.seed_indices(rows) == [0, 0, 2, 2, 4, 5, 6]  # then the three prefill rows
    rows, _ = rows_of(decode)  # bf16 alone: each row its own position, as before
    assert decode.seed_indices(rows) == list(range(len(rows)))


def test_e4m3_quantisation(decode):
    from fa4cpp import reference
    ds = decode.fp8_descales(3, 2, torch.Generator().manual_seed(3))
    assert ds.dtype == torch.float32 and ds.shape == (3, 2) and ds.unique().numel() == 6
    assert ((ds >= 2 ** -0.5 / 32) & (ds <= 2 ** 0.5 / 32)).all()
    x = torch.randn(3, 50, 8, 64, dtype=torch.bfloat16)
    x8 = decode.quantize(x, ds, group=4)  # q: 8 heads over 2 kv heads
    per = ds.repeat_interleave(4, dim=1)[:, None, :, None]
    assert x8.dtype == torch.float8_e4m3fn
    assert torch.equal(x8.view(torch.uint8),
                       reference.round_e4m3(x.float() / per).view(torch.uint8))
    # Back within e4m3's half ulp: 2^-4 of the value (normal), 2^-10 · descale (subnormal).
    err = (reference.dequantize(x8, ds, group=4) - x.float()).abs()
    assert (err <= torch.maximum(x.float().abs() * 2 ** -4, 2 ** -10 * per)).all()
    assert decode.quantize(torch.full((1, 1, 2, 16), -1e4), torch.ones(1, 2)).float().min() == -448
    # A paged cache's pages take their sequence's descales, drawn a piece at a time.
    table = torch.tensor([[5, 2, 0], [1, 3, 4]], dtype=torch.int32)
    owner = decode.page_owners(table, 6)
    assert owner.tolist() == [0, 1, 0, 1, 1, 0]
    torch.manual_seed(7)
    cache = decode.quantized_cache((6, 4, 2, 8), ds[:2], owner, "cpu",
                                   chunk_bytes=2 * 4 * 4 * 2 * 8)  # two pages at a time
    torch.manual_seed(7)
    want = torch.cat([decode.quantize(torch.randn(2, 4, 2, 8, dtype=torch.bfloat16), ds[:2],
                                      owner[i:i + 2]) for i in (0, 2, 4)])
    assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))
    got = decode.first_sequence(cache, table, 10)
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8),
                       torch.cat([cache[5], cache[2], cache[0, :2]]).view(torch.uint8))


def e4m3_bench(decode, libs, timer):
    args = decode.parse_args(["--dry-run", "--rounds", "2", "--hdim", "32", "--kv-dtypes",
                              "bf16,e4m3"])
    return decode.Bench(args, libs, timer, l2_bytes=1 << 16, device="cpu")


def test_e4m3_rows_measured_on_the_cpu(decode):
    import fa4cpp
    seen = []

    def fa3_standin(q, k_cache, v_cache, **kw):
        seen.append((q.dtype, k_cache.dtype, sorted(k for k in kw if k.endswith("_descale"))))
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)

    calls = []

    def timer(fn):
        calls.append(fn)
        fn()
        return 0.001 * len(calls), {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    bench = e4m3_bench(decode, {"fa4cpp": fa4cpp.flash_attn_with_kvcache, "FA3": fa3_standin},
                       timer)
    base = {"kind": "decode", "heads_q": 8, "heads_kv": 2, "head_dim": 32, "batch": 3,
            "seqlen_q": 1, "cache_len": 60}
    rows = [dict(base, page_size=p, ragged=p > 0, kv_dtype=dt) for p in (0, 16)
            for dt in ("bf16", "e4m3")]
    for index, row in zip(decode.seed_indices(rows), rows):
        bench.measure(row, index)
    decode.kv_dtype_ratios(rows)
    assert (torch.float8_e4m3fn, torch.float8_e4m3fn,
            ["k_descale", "q_descale", "v_descale"]) in seen
    for bf, e8 in (rows[0:2], rows[2:4]):
        assert e8["seqlens"] == bf["seqlens"] and 2 * e8["kv_bytes"] == bf["kv_bytes"]
        assert e8["libs"]["cuDNN"] == {"skipped": decode.CUDNN_FP8}
        assert e8["append_skipped"] == decode.FP8_APPEND and "append_skipped" not in bf
        for name in ("fa4cpp", "FA3"):
            e = e8["libs"][name]
            # The CPU backend keeps P in fp32: the bf16 output's rounding is all that differs.
            assert e["max_abs_diff_vs_ref"] < 1e-2
            assert len(e["ms_rounds"]) == 2 and "append_ms" not in e
            assert e["gbps"] == pytest.approx(e8["kv_bytes"] / (e["ms"] * 1e-3) / 1e9)
            assert e["time_vs_bf16"] == pytest.approx(e["ms"] / bf["libs"][name]["ms"])
            assert "time_vs_bf16" not in bf["libs"][name]
        assert e8["libs"]["FA3"]["max_abs_diff_vs_fa4cpp"] == 0.0 and e8["flagged"] == []
    assert 30 <= rows[2]["seqlens"]["min"] <= rows[2]["seqlens"]["max"] <= 60
    json.dumps(rows)

    # A library that applies the wrong descale is flagged at --fp8-tol.
    def doubled_v(q, k_cache, v_cache, v_descale=None, **kw):
        return fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, v_descale=2 * v_descale, **kw)

    bench = e4m3_bench(decode, {"fa4cpp": fa4cpp.flash_attn_with_kvcache, "FA3": doubled_v},
                       timer)
    row = bench.measure(dict(base, page_size=0, ragged=False, kv_dtype="e4m3"), 0)
    assert row["libs"]["FA3"]["max_abs_diff_vs_ref"] > decode.FP8_TOL
    assert [f.split()[:2] for f in row["flagged"]] == [["FA3", "max_abs_diff_vs_ref"],
                                                       ["FA3", "max_abs_diff_vs_fa4cpp"]]


def with_e4m3(r):
    """fabricated() with an e4m3 row beside its first row (which becomes bf16's, explicitly)."""
    bf = r["rows"][0]
    bf["kv_dtype"] = "bf16"
    e8 = {"kind": "decode", "heads_q": 32, "heads_kv": 8, "head_dim": 128, "batch": 64,
          "cache_len": 4096, "page_size": 0, "kv_dtype": "e4m3", "fa4cpp_vs_fa3": 1.2,
          "flagged": [], "append_skipped": "bf16 rows only",
          "libs": {"fa4cpp": {"gbps": 7900, "us": 136.0, "ms": 0.136, "time_vs_bf16": 0.519,
                              "max_abs_diff_vs_ref": 0.004},
                   "FA3": {"gbps": 6580, "us": 163.0, "ms": 0.163, "time_vs_bf16": 0.562,
                           "max_abs_diff_vs_ref": 0.005},
                   "cuDNN": {"skipped": "not run: no FP8"}}}
    r["rows"].insert(1, e8)
    r["fp8"] = {"tol": 0.06, "scale": 32.0, "spread": 0.5}
    return r


def test_markdown_of_e4m3_rows(decode):
    md = decode.markdown(with_e4m3(fabricated()))
    assert "bf16 (decode also e4m3), d128" in md.splitlines()[2]
    note = next(x for x in md.splitlines() if x.startswith("e4m3 rows"))
    assert "1 B per element" in note and "over 0.06 flags the row" in note
    assert "cuDNN: — (%s)" % decode.CUDNN_FP8 in note and "(fa4cpp / FA3)" in note
    rows = table(md, "## Decode, GQA 32/8, d128")
    assert rows[0] == ["b", "cache", "layout", "kv", "fa4cpp GB/s (µs)", "FA3 GB/s (µs)",
                       "cuDNN GB/s (µs)", "fa4cpp/cuDNN", "fa4cpp/FA3",
                       "append+rotary µs over plain: fa4cpp", "append+rotary µs over plain: FA3",
                       "e4m3/bf16 time: fa4cpp", "e4m3/bf16 time: FA3",
                       "max abs diff vs ref (fa4cpp / FA3 / cuDNN)", "check"]
    assert rows[2] == ["64", "4k", "contiguous", "bf16", "4100 (262.0)", "3700 (290.0)",
                       "4000 (268.0)", "1.02", "1.10", "+3.5", "-1.2", "—", "—",
                       "0.001 / 0.001 / 0.001", "ok"]
    assert rows[3] == ["64", "4k", "contiguous", "e4m3", "7900 (136.0)", "6580 (163.0)", "—",
                       "—", "1.20", "—", "—", "0.52", "0.56", "0.004 / 0.005 / —", "ok"]
    assert all(len(x) == len(rows[0]) for x in rows[2:])
    # Without e4m3 rows, a decode row's explicit bf16 changes nothing.
    r = fabricated()
    for row in r["rows"]:
        if row["kind"] == "decode":
            row["kv_dtype"] = "bf16"
    assert decode.markdown(r) == decode.markdown(fabricated())


def test_e4m3_rows_through_main(decode, monkeypatch, tmp_path, two_libraries):
    """--kv-dtypes bf16,e4m3 end to end on the CPU backend: one build through the package, two
    through their C ABI (c_abi_kvcache passes the descales)."""
    a, b = two_libraries
    for argv, builds in (([], ["fa4cpp"]), (["--lib", "main=" + a, "--lib", "gather=" + b],
                                            ["main", "gather"])):
        result, md = run_main_on_cpu(decode, monkeypatch, tmp_path / builds[0],
                                     argv + ["--kv-dtypes", "bf16,e4m3"])
        assert [(x["kind"], x["page_size"], x.get("kv_dtype")) for x in result["rows"]] == [
            ("decode", 0, "bf16"), ("decode", 0, "e4m3"), ("decode", 16, "bf16"),
            ("decode", 16, "e4m3"), ("prefill", 0, None), ("prefill", 16, None)]
        assert result["fp8"]["tol"] == decode.FP8_TOL
        assert result["options"]["kv_dtypes"] == ["bf16", "e4m3"]
        for i in (1, 3):
            bf, e8 = result["rows"][i - 1], result["rows"][i]
            assert e8["flagged"] == [] and 2 * e8["kv_bytes"] == bf["kv_bytes"]
            for name in builds:
                e = e8["libs"][name]
                assert e["max_abs_diff_vs_ref"] < 1e-2 and "append_ms" not in e
                assert e["time_vs_bf16"] == pytest.approx(e["ms"] / bf["libs"][name]["ms"])
            if len(builds) == 2:
                assert e8["libs"]["gather"]["max_abs_diff_vs_main"] == 0.0
        assert "time_vs_bf16" in result["rows"][1]["libs"]["FA3"]
        assert "refused" in result["rows"][3]["libs"]["FA3"]  # the stand-in's pages of 16
        rows = table(md, "## Decode, GQA 4/2, d32")
        assert rows[0][3] == "kv" and [x[3] for x in rows[2:]] == ["bf16", "e4m3"] * 2
        assert "e4m3/bf16 time: %s" % builds[0] in rows[0]


# -- FlashAttention-4 (flash_attn.cute) ---------------------------------------------------------

def fa4_standin(seen=None, refuse_page=None, shift=0.0):
    """A stand-in for flash_attn.cute.flash_attn_varlen_func over the package's op: it checks what
    bench/decode.py passes (FA4's keywords, int32 seqused_k and page table, num_splits=1 as FA4's
    sm90 forward needs, no descales or appended keys), notes each call's (dtype, page size) in seen,
    raises a two-line error on pages of refuse_page keys (as FA4 on sm90 refuses a split), adds
    shift to its output (a wrong FA4) and returns (out, lse) as FA4 does (lse None unless asked
    for)."""
    import fa4cpp

    def flash_attn_varlen_func(q, k, v, seqused_k=None, page_table=None, causal=False,
                               num_splits=1, **rest):
        assert not rest and num_splits == 1, (rest, num_splits)
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16  # never an e4m3 row
        assert seqused_k.dtype == torch.int32 and seqused_k.shape == (q.shape[0],)
        if page_table is not None:
            assert page_table.dtype == torch.int32 and page_table.shape[0] == q.shape[0]
            assert page_table.stride(-1) == 1
        if seen is not None:
            seen.append((q.dtype, k.shape[1] if page_table is not None else 0))
        if refuse_page and page_table is not None and k.shape[1] == refuse_page:
            raise AssertionError("SplitKV not supported on SM 9.0\nsecond line")
        out = fa4cpp.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqused_k,
                                             page_table=page_table, causal=causal)
        return out + shift, None
    return flash_attn_varlen_func


def fa4_bench(decode, timer, fa4, argv=()):
    """A Bench on the CPU backend of fa4cpp, an FA3 (the package's op) and FA4 (fa4: a
    flash_attn_varlen_func, through decode.fa4_kvcache), each call logged."""
    import fa4cpp
    log = []
    libs = {"fa4cpp": logged(log, "fa4cpp", fa4cpp.flash_attn_with_kvcache),
            "FA3": logged(log, "FA3", fa4cpp.flash_attn_with_kvcache),
            "FA4": logged(log, "FA4", decode.fa4_kvcache(fa4))}
    args = decode.parse_args(["--dry-run", "--rounds", "2", "--hdim", "32"] + list(argv))
    return decode.Bench(args, libs, timer, l2_bytes=1 << 16, device="cpu"), log


FA4_BASE = {"heads_q": 4, "heads_kv": 2, "head_dim": 32, "batch": 2, "cache_len": 40}


def test_fa4_column_on_decode_and_prefill_rows(decode):
    """(a) FA4 gets its column on decode rows, contiguous and paged, and on prefill rows: timed in
    the rotated rounds with the others (its plain call only), checked against the reference and
    fa4cpp's output, a ratio of fa4cpp to it; its append recorded as not run."""
    seen, timed = [], []

    def timer(fn):
        fn()
        timed.append(log[-1])
        ms = {"fa4cpp": 0.010, "FA3": 0.020, "FA4": 0.016}[log[-1][0]]
        return ms, {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    bench, log = fa4_bench(decode, timer, fa4_standin(seen))
    for page, ragged, index in ((0, False, 0), (16, True, 1)):
        timed.clear()
        row = bench.measure(dict(FA4_BASE, kind="decode", seqlen_q=1, page_size=page,
                                 ragged=ragged), index)
        e = row["libs"]
        # Rotated rounds over every (library, call) pair, FA4's plain call among them.
        keys = [("fa4cpp", "plain"), ("fa4cpp", "append"), ("FA3", "plain"), ("FA3", "append"),
                ("FA4", "plain")]
        assert timed == [k for r in range(2) for k in keys[r:] + keys[:r]]
        fa4 = e["FA4"]
        assert fa4["append_skipped"] == decode.FA4_APPEND
        assert "append_ms" not in fa4 and "append_max_abs_diff_vs_ref" not in fa4
        assert len(fa4["ms_rounds"]) == 2 and fa4["ms"] == pytest.approx(0.016)
        assert fa4["gbps"] == pytest.approx(row["kv_bytes"] / (fa4["ms"] * 1e-3) / 1e9)
        assert fa4["max_abs_diff_vs_ref"] < 2e-2 and fa4["max_abs_diff_vs_fa4cpp"] == 0.0
        assert row["fa4cpp_vs_fa4"] == pytest.approx(e["fa4cpp"]["gbps"] / fa4["gbps"])
        assert row["fa4cpp_vs_fa4"] == pytest.approx(1.6)
        assert row["fa4cpp_vs_fa3"] == pytest.approx(2.0) and row["flagged"] == []
        json.dumps(row)
    assert {p for _, p in seen} == {0, 16}
    rows = [bench.measure(dict(FA4_BASE, kind="prefill", seqlen_q=8, page_size=p, causal=True),
                          2 + i) for i, p in enumerate((0, 16))]
    decode.prefill_ratios(rows)
    for row in rows:  # causal, bottom-right: the reference agrees
        fa4 = row["libs"]["FA4"]
        assert fa4["max_abs_diff_vs_ref"] < 2e-2 and "tflops" in fa4
        assert row["fa4cpp_vs_fa4"] == pytest.approx(row["libs"]["fa4cpp"]["tflops"]
                                                     / fa4["tflops"])
        assert "append_skipped" not in fa4
    assert rows[1]["libs"]["FA4"]["vs_contiguous"] == pytest.approx(1.0)
    row = {"kind": "decode", "page_size": 0, "ragged": False}
    assert decode.timed_calls(row, ["decode", "append"], fa4=True) == [
        ("fa4cpp", "plain"), ("FA3", "plain"), ("FA4", "plain"), ("cuDNN", "plain"),
        ("fa4cpp", "append"), ("FA3", "append")]
    args = decode.parse_args(["--dry-run", "--smoke"])
    rows, _ = decode.plan(args)
    assert decode.estimate_seconds(rows, args, fa4=True) > decode.estimate_seconds(rows, args)


def test_fa4_through_main(decode, monkeypatch, tmp_path):
    """(a) FA4's columns, ratios and header line in the result files of a run."""
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path, [], fa4=fa4_standin())
    assert result["fa4"] == {"available": True, "version": "4.0.0b36",
                             "function": "flash_attn.cute.flash_attn_varlen_func",
                             "num_splits": 1, "fp8": decode.FA4_FP8,
                             "append": decode.FA4_APPEND}
    head = md.splitlines()[2]
    assert ("; FA4 = flash_attn.cute.flash_attn_varlen_func (num_splits=1), version 4.0.0b36; "
            "cuDNN = SDPA") in head
    assert decode.FA4_APPEND in md and decode.FA4_FP8 in md and "has no split-KV" in md
    for row in result["rows"]:
        e = row["libs"]["FA4"]
        assert e["max_abs_diff_vs_ref"] < 2e-2 and len(e["ms_rounds"]) == 3
        assert "fa4cpp_vs_fa4" in row
    rows = table(md, "## Decode, GQA 4/2, d32")
    assert rows[0] == ["b", "cache", "layout", "fa4cpp GB/s (µs)", "FA3 GB/s (µs)",
                       "FA4 GB/s (µs)", "cuDNN GB/s (µs)", "fa4cpp/cuDNN", "fa4cpp/FA3",
                       "fa4cpp/FA4", "append+rotary µs over plain: fa4cpp",
                       "append+rotary µs over plain: FA3",
                       "max abs diff vs ref (fa4cpp / FA3 / FA4 / cuDNN)", "check"]
    assert [x[9] for x in rows[2:]] == ["%.2f" % x["fa4cpp_vs_fa4"] for x in result["rows"][:2]]
    assert all(len(x) == len(rows[0]) for x in rows[2:])
    pre = table(md, "## Chunked prefill: 8 queries against 40 keys, causal (bottom-right), "
                    "GQA 4/2, b 2, d32")
    assert pre[0] == ["layout", "fa4cpp TFLOP/s (µs)", "FA3 TFLOP/s (µs)", "FA4 TFLOP/s (µs)",
                      "fa4cpp/FA3", "fa4cpp/FA4", "fa4cpp paged/contiguous",
                      "FA3 paged/contiguous", "FA4 paged/contiguous",
                      "max abs diff vs ref (fa4cpp / FA3 / FA4)", "check"]
    assert pre[3][5] == "%.2f" % result["rows"][3]["fa4cpp_vs_fa4"]
    # --fa4-num-splits and --fa4-version reach the call and the header.
    calls = []

    def splits_seen(q, k, v, num_splits=1, **kw):
        calls.append(num_splits)
        return fa4_standin()(q, k, v, num_splits=1, **kw)
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path / "one", [
        "--fa4-num-splits", "0", "--fa4-version", "abc123", "--parts", "decode"],
        fa4=splits_seen)
    assert set(calls) == {0} and result["fa4"]["num_splits"] == 0
    assert "FA4 = flash_attn.cute.flash_attn_varlen_func (num_splits=0), version abc123" in md
    assert "FA4's own split heuristic" in md


def test_fa4_skips_e4m3_rows(decode, monkeypatch, tmp_path):
    """(b) e4m3 rows do not call FA4 (no FP8 on sm90): its cell says why, in the row and the
    markdown; the shape's bf16 row times it."""
    import fa4cpp
    seen, calls = [], []

    def timer(fn):
        calls.append(fn)
        fn()
        return 0.001 * len(calls), {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    bench = e4m3_bench(decode, {"fa4cpp": fa4cpp.flash_attn_with_kvcache,
                                "FA4": decode.fa4_kvcache(fa4_standin(seen))}, timer)
    base = {"kind": "decode", "heads_q": 8, "heads_kv": 2, "head_dim": 32, "batch": 3,
            "seqlen_q": 1, "cache_len": 60, "ragged": False}
    rows = [dict(base, page_size=p, kv_dtype=dt) for p in (0, 16) for dt in ("bf16", "e4m3")]
    for index, row in zip(decode.seed_indices(rows), rows):
        bench.measure(row, index)
    decode.kv_dtype_ratios(rows)
    assert set(seen) == {(torch.bfloat16, 0), (torch.bfloat16, 16)}  # the bf16 rows' calls
    for bf, e8 in (rows[0:2], rows[2:4]):
        assert e8["libs"]["FA4"] == {"skipped": decode.FA4_FP8}
        assert "fa4cpp_vs_fa4" not in e8 and e8["flagged"] == []
        assert bf["libs"]["FA4"]["max_abs_diff_vs_ref"] < 2e-2 and "fa4cpp_vs_fa4" in bf
        assert "time_vs_bf16" in e8["libs"]["fa4cpp"]
    row = {"kind": "decode", "page_size": 0, "ragged": False, "kv_dtype": "e4m3"}
    assert decode.timed_calls(row, ["decode"], fa4=True) == [("fa4cpp", "plain"),
                                                             ("FA3", "plain")]
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path, [
        "--kv-dtypes", "bf16,e4m3", "--parts", "decode"], fa4=fa4_standin())
    note = next(x for x in md.splitlines() if x.startswith("e4m3 rows"))
    assert "FA4: — (%s)" % decode.FA4_FP8 in note and "(fa4cpp / FA3)" in note
    rows = table(md, "## Decode, GQA 4/2, d32")
    assert "e4m3/bf16 time: FA4" not in rows[0] and "e4m3/bf16 time: FA3" in rows[0]
    fa4_col = rows[0].index("FA4 GB/s (µs)")
    assert [x[3] for x in rows[2:]] == ["bf16", "e4m3"] * 2
    assert [x[fa4_col] == "—" for x in rows[2:]] == [False, True] * 2
    assert [x[rows[0].index("fa4cpp/FA4")] == "—" for x in rows[2:]] == [False, True] * 2


def test_fa4_absent_omits_its_columns(decode, monkeypatch, tmp_path):
    """(c) flash_attn.cute that does not import: no FA4 columns, the reason in the header (as
    FA3's); find_fa4 reads the import's error, and the version where the module has one."""
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    func, why = decode.find_fa4()
    assert func is None and why.startswith("flash_attn.cute: ") and "halted" in why
    module = types.ModuleType("flash_attn.cute")
    module.flash_attn_func = lambda *a, **kw: None  # what sweep.find_others imports it for
    module.flash_attn_varlen_func = fa4_standin()
    module.__version__ = "4.0.0b36"
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    assert decode.find_fa4() == (module.flash_attn_varlen_func, "4.0.0b36")

    def no_dist(name):
        raise decode.importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(decode.importlib.metadata, "version", no_dist)
    module.__version__ = "0.0.0"  # flash_attn.cute's placeholder without a "fa4" distribution
    assert decode.find_fa4() == (module.flash_attn_varlen_func, "unknown")
    del module.flash_attn_varlen_func
    assert decode.find_fa4() == (None, "flash_attn.cute has no flash_attn_varlen_func")

    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path, [])
    assert result["fa4"] == {"available": False, "missing": FA4_MISSING}
    assert ("FA4 not importable here (%s): its columns are omitted; cuDNN = SDPA" % FA4_MISSING
            in md.splitlines()[2])
    assert "FA4" not in "\n".join(md.splitlines()[3:])
    assert not any("FA4" in row["libs"] or "fa4cpp_vs_fa4" in row for row in result["rows"])
    rows = table(md, "## Decode, GQA 4/2, d32")
    assert rows[0][3:6] == ["fa4cpp GB/s (µs)", "FA3 GB/s (µs)", "cuDNN GB/s (µs)"]


def test_fa4_that_raises_reads_na(decode, monkeypatch, tmp_path):
    """(d) FA4 refusing a row (pages of 16 keys here): n/a with its error's first line, in the row,
    the cell and the notes; the other rows go on."""
    def timer(fn):
        fn()
        return 0.01, {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    bench, _ = fa4_bench(decode, timer, fa4_standin(refuse_page=16), ["--parts", "decode"])
    row = bench.measure(dict(FA4_BASE, kind="decode", seqlen_q=1, page_size=16, ragged=False), 0)
    assert row["libs"]["FA4"] == {"refused": "SplitKV not supported on SM 9.0"}
    assert "fa4cpp_vs_fa4" not in row and row["flagged"] == []
    assert "ms" in row["libs"]["fa4cpp"] and "ms" in row["libs"]["FA3"]
    result, md = run_main_on_cpu(decode, monkeypatch, tmp_path, [],
                                 fa4=fa4_standin(refuse_page=16))
    assert [("refused" in x["libs"]["FA4"]) for x in result["rows"]] == [False, True, False, True]
    rows = table(md, "## Decode, GQA 4/2, d32")
    col = rows[0].index("FA4 GB/s (µs)")
    assert rows[2][col] != "n/a" and rows[3][col] == "n/a"
    assert "- n/a: FA4 (plain, 1 row): SplitKV not supported on SM 9.0" in md


def test_fa4_with_wrong_values_is_flagged(decode):
    """(e) An FA4 whose output is off by 0.1 is flagged against the reference and fa4cpp's output
    at --tol 2e-2, and not at --tol 0.5."""
    def timer(fn):
        fn()
        return 0.01, {"host_us": 3.0, "calls_per_window": 2, "windows": 5}

    for tol, flagged in (("2e-2", True), ("0.5", False)):
        bench, _ = fa4_bench(decode, timer, fa4_standin(shift=0.1), ["--tol", tol])
        for page in (0, 16):
            row = bench.measure(dict(FA4_BASE, kind="decode", seqlen_q=1, page_size=page,
                                     ragged=False), page)
            assert row["libs"]["FA4"]["max_abs_diff_vs_ref"] == pytest.approx(0.1, abs=1e-2)
            assert row["libs"]["FA4"]["max_abs_diff_vs_fa4cpp"] == pytest.approx(0.1, abs=1e-2)
            if flagged:
                assert [f.split()[:2] for f in row["flagged"]] == [
                    ["FA4", "max_abs_diff_vs_ref"], ["FA4", "max_abs_diff_vs_fa4cpp"]]
                assert decode.check_cell(row).startswith("**over tol**: FA4 max_abs_diff_vs_ref")
            else:
                assert row["flagged"] == [] and decode.check_cell(row) == "ok"
