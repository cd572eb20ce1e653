"""bench/decode.py without a GPU: its rows (the defaults, --max-gb, the narrowing options, --smoke),
the bytes and FLOPs it divides by (the bottom-right causal pair count against brute force), the
timing plan and the rotation of the libraries over rounds, its float32 reference and rotary, one row
of each kind measured end to end on the CPU backend with stand-ins (a refusing "FA3", cuDNN refusing
CPU tensors), and the markdown of a fabricated result."""
import importlib.util
import json
import math
import os
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "bench", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def decode(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    monkeypatch.setitem(sys.modules, "sweep", _load("sweep"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return _load("decode")


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
