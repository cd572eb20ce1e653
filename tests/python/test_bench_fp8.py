"""bench/fp8.py on the CPU with stand-ins for the GPU's pieces (fa4cpp's forward closure, FA3's
flash_attn_func, cuDNN's SDPA, the timer): its inputs (amax-scaled e4m3, per (batch, kv head)
descales, bf16 copies of the same values), the columns present with and without FA3, the checked
first runs (a descale that never arrives and an output never written are bad), a column refusing
one row's head dim and one failing while timed, the rotation over the rounds, the ratios, and the
files and tables of a whole run through main()."""
import json
import sys
import types

import pytest
import torch

pytest.importorskip("triton")


# Each column's time (ms) as the stand-in timer reports it: distinct, so ratios tell them apart.
MS = {"fa4cpp e4m3": 1.0, "FA3 e4m3": 1.25, "fa4cpp bf16": 2.0, "FA3 bf16": 2.5,
      "cuDNN bf16": 2.2}


class Stand:
    """The GPU's pieces on the CPU. calls: the column of every call, in order; the timer reports
    MS of the column its callable ran."""

    def __init__(self, fp8):
        self.fp8, self.calls = fp8, []
        self.Build = fp8.sweep.Build  # the class, before a test puts a factory in its place

    def attention(self, q, k, v, causal):
        """fp32 attention of (b, s, h, d) tensors, as (b, s, h, d)."""
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.transpose(1, 2).float() for x in (q, k, v)), is_causal=causal,
            enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)

    def values(self, x, descale):
        return x.float() if descale is None else self.fp8.dequantize(x, descale, torch.float32)

    def sdpa_fn(self, backend, q, k, v, causal):
        """cuDNN: SDPA's (b, h, s, d) output, in the inputs' dtype."""
        def run():
            self.calls.append("cuDNN bf16")
            return self.attention(q, k, v, causal).to(q.dtype).transpose(1, 2)
        return run

    def fa3(self, q, k, v, causal=False, q_descale=None, k_descale=None, v_descale=None):
        """FlashAttention-3's flash_attn_func: e4m3 with descales, bf16 without; (out, lse)."""
        fp8 = q.dtype == torch.float8_e4m3fn
        self.calls.append("FA3 " + ("e4m3" if fp8 else "bf16"))
        out = self.attention(self.values(q, q_descale), self.values(k, k_descale),
                             self.values(v, v_descale), causal)
        return out.to(torch.bfloat16), None

    def median_ms(self, fn, windows=None):
        fn()
        return MS.get(self.calls[-1], 3.0)

    def build(self, name="fa4cpp", dims=(8, 16), ignore_descales=False, writes=True):
        """A sweep.Build whose library's forward closure computes on the CPU; it refuses head dims
        not in dims, drops the descales (as if they never reached the library) or writes
        nothing."""
        sweep = self.fp8.sweep
        stand = self

        class Library:
            def forward_fn(self, q, k, v, out, lse, params):
                if q.shape[3] not in dims:
                    raise sweep.fa4_ctypes.Fa4Error("head dim %d not built" % q.shape[3])
                fp8 = params.fp8 if q.dtype == torch.float8_e4m3fn else None
                if fp8 is not None and ignore_descales:
                    fp8 = sweep.fa4_ctypes.Fp8()
                if fp8 is not None:
                    assert fp8.out_dtype == torch.bfloat16
                qkv = [stand.values(x, getattr(fp8, n + "_descale", None))
                       for x, n in zip((q, k, v), "qkv")]

                def run():
                    stand.calls.append(name + " " + ("e4m3" if fp8 is not None else "bf16"))
                    if writes:
                        out.copy_(stand.attention(*qkv, params.causal))
                return run

        bld = self.Build.__new__(self.Build)
        bld.name, bld.path, bld.version, bld.deterministic = name, "lib.so", "0", False
        bld.env, bld.variant, bld.fa4, bld._counts = {}, "none", Library(), None
        return bld


@pytest.fixture
def fp8(monkeypatch, bench_script):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    module = bench_script("fp8")
    monkeypatch.setattr(module, "DEVICE", "cpu")
    return module


@pytest.fixture
def stand(fp8, monkeypatch):
    s = Stand(fp8)
    monkeypatch.setattr(fp8.sweep, "sdpa_fn", s.sdpa_fn)
    monkeypatch.setattr(fp8.sweep, "median_ms", s.median_ms)
    return s


def test_inputs_span_e4m3_and_dequantize_to_the_same_values(fp8):
    torch.manual_seed(1)
    b, s, hq, hkv, d = 3, 40, 6, 2, 16
    x = fp8.make_inputs(b, s, hq, hkv, d)
    for name, heads in (("q", hq), ("k", hkv), ("v", hkv)):
        x8, descale, bf16 = x[name + "8"], x[name + "d"], x[name]
        assert x8.dtype == torch.float8_e4m3fn and x8.shape == (b, s, heads, d)
        assert descale.dtype == torch.float32 and descale.shape == (b, hkv)
        assert (descale > 0).all() and descale.unique().numel() == b * hkv  # drawn, not shared
        groups = x8.float().view(b, s, hkv, heads // hkv, d)
        assert not torch.isnan(groups).any()
        # Each (batch, kv head) group reaches the e4m3 range's end, q's heads with their kv head's.
        assert torch.equal(groups.abs().amax(dim=(1, 3, 4)), torch.full((b, hkv), 448.0))
        want = groups * descale[:, None, :, None, None]
        assert bf16.dtype == torch.bfloat16
        assert torch.allclose(bf16.float().view_as(want), want, rtol=2.0 ** -8, atol=0)
        # The widths 2^u, u in [-1/2, 1/2], per group: the values' spread, not the descales'.
        std = want.std(dim=(1, 3, 4))
        assert (std > 0.6).all() and (std < 1.6).all()


def test_quantize_round_trip(fp8):
    torch.manual_seed(2)
    widths = torch.tensor([0.01, 3.0]).repeat_interleave(2)  # per kv head, over its 2 heads
    x = torch.randn(2, 33, 4, 8) * widths[None, None, :, None]
    x8, descale = fp8.quantize(x, 2)
    assert torch.allclose(descale, x.abs().view(2, 33, 2, 2, 8).amax(dim=(1, 3, 4)) / 448)
    back = fp8.dequantize(x8, descale, torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals below 2^-6 · descale.
    tol = 2.0 ** -4 * x.abs() + 2.0 ** -10 * descale.repeat_interleave(2, dim=1)[:, None, :, None]
    assert ((back - x).abs() <= tol).all()
    assert not torch.equal(back, x)  # it did quantize


def test_columns_with_and_without_fa3(fp8):
    assert fp8.column_names(["fa4cpp"], True) == [
        "fa4cpp e4m3", "FA3 e4m3", "fa4cpp bf16", "FA3 bf16", "cuDNN bf16"]
    assert fp8.column_names(["a", "b"], False) == [
        "a e4m3", "b e4m3", "a bf16", "b bf16", "cuDNN bf16"]
    assert fp8.ratio_names(["fa4cpp"], True) == [
        ("fa4cpp e4m3 / FA3 e4m3", "fa4cpp e4m3", "FA3 e4m3"),
        ("fa4cpp e4m3 / fa4cpp bf16", "fa4cpp e4m3", "fa4cpp bf16")]
    assert fp8.ratio_names(["fa4cpp"], False) == [
        ("fa4cpp e4m3 / fa4cpp bf16", "fa4cpp e4m3", "fa4cpp bf16")]


def _row(fp8, stand, builds, d=16, causal=True, rounds=1, fa3=True):
    x = fp8.make_inputs(2, 24, 4, 4, d)
    cudnn = fp8.sweep.sdpa_fn(None, x["q"], x["k"], x["v"], causal)
    row = fp8.measure_row(fp8.columns(builds, stand.fa3 if fa3 else None, x, causal), cudnn,
                          rounds)
    fp8.add_rates(row, 4e9, fp8.ratio_names([b.name for b in builds], fa3))
    return row


def test_a_row_checks_times_and_rates_every_column(fp8, stand):
    torch.manual_seed(3)
    row = _row(fp8, stand, [stand.build()])
    cols = row["columns"]
    assert list(cols) == fp8.column_names(["fa4cpp"], True)
    for name, entry in cols.items():
        assert entry["nan_count"] == 0 and not entry["bad"], name
        assert entry["ms"] == MS[name] and entry["tflops"] == pytest.approx(4e9 / MS[name] / 1e9)
    for name in ("fa4cpp e4m3", "FA3 e4m3"):
        # The same attention as cuDNN's up to bf16's rounding (inputs, output): small, not zero.
        assert 0 < cols[name]["max_abs_diff_vs_cudnn"] < 0.05, name
    for name in ("fa4cpp bf16", "FA3 bf16"):
        assert cols[name]["max_abs_diff_vs_cudnn"] < 0.05, name
    assert "max_abs_diff_vs_cudnn" not in cols["cuDNN bf16"]
    assert row["ratios"] == pytest.approx({"fa4cpp e4m3 / FA3 e4m3": 1.25,
                                           "fa4cpp e4m3 / fa4cpp bf16": 2.0})


def test_missing_descales_and_unwritten_outputs_are_bad(fp8, stand):
    torch.manual_seed(4)
    row = _row(fp8, stand, [stand.build("nodescale", ignore_descales=True),
                            stand.build("nowrite", writes=False)], fa3=False)
    cols = row["columns"]
    assert cols["nodescale e4m3"]["bad"] and cols["nodescale e4m3"]["nan_count"] == 0
    assert cols["nodescale e4m3"]["max_abs_diff_vs_cudnn"] > 10  # v undescaled: up to 448
    assert not cols["nodescale bf16"]["bad"]
    assert cols["nowrite e4m3"]["bad"] and cols["nowrite e4m3"]["nan_count"] == 2 * 24 * 4 * 16
    assert cols["nowrite bf16"]["max_abs_diff_vs_cudnn"] == 0  # no element left to compare
    # Bad columns are still timed: the table shows their rate, marked.
    assert cols["nowrite e4m3"]["ms"] == 3.0 and "tflops" in cols["nodescale e4m3"]


def test_a_refused_head_dim_sits_out_its_row_only(fp8, stand):
    torch.manual_seed(5)
    bld = stand.build(dims=(8,))
    refused = _row(fp8, stand, [bld], d=16)
    for name in ("fa4cpp e4m3", "fa4cpp bf16"):
        assert refused["columns"][name] == {"refused": "head dim 16 not built"}
    assert refused["columns"]["FA3 e4m3"]["ms"] == 1.25
    assert refused["ratios"] == {}
    assert "fa4cpp e4m3" not in [c for c in stand.calls]  # never timed
    ran = _row(fp8, stand, [bld], d=8)
    assert ran["columns"]["fa4cpp e4m3"]["ms"] == 1.0 and len(ran["ratios"]) == 2


def test_every_column_goes_first_once_over_as_many_rounds(fp8, stand):
    torch.manual_seed(6)
    names = fp8.column_names(["fa4cpp"], True)
    row = _row(fp8, stand, [stand.build()], rounds=len(names))
    timed = stand.calls[len(names):]  # after each column's first run
    rounds = [timed[i:i + len(names)] for i in range(0, len(timed), len(names))]
    assert len(rounds) == len(names)
    assert [r[0] for r in rounds] == names
    assert all(sorted(r) == sorted(names) for r in rounds)
    assert row["columns"]["FA3 bf16"]["ms_rounds"] == [2.5] * len(names)


def test_a_column_failing_while_timed_is_refused_the_others_go_on(fp8, stand, monkeypatch):
    torch.manual_seed(7)

    def median_ms(fn, windows=None):
        fn()
        if stand.calls[-1] == "FA3 bf16" and stand.calls.count("FA3 bf16") == 3:
            raise RuntimeError("out of memory\ndetail")
        return MS[stand.calls[-1]]
    monkeypatch.setattr(fp8.sweep, "median_ms", median_ms)
    row = _row(fp8, stand, [stand.build()], rounds=4)
    fa3 = row["columns"]["FA3 bf16"]
    assert fa3["refused"] == "while timing: out of memory" and "ms" not in fa3
    assert stand.calls.count("FA3 bf16") == 3  # not timed after it failed
    assert row["columns"]["fa4cpp bf16"]["ms_rounds"] == [2.0] * 4


def _main(fp8, stand, monkeypatch, tmp_path, argv, fa3=True, **build):
    """main() with stand-ins, sweep's shapes shrunk (16384 tokens -> 64, hidden 2048 -> 32) and
    its FLOPs scaled by 1e9 (rates that read in a table); returns the JSON and the markdown."""
    sweep = fp8.sweep
    flops = sweep.flops
    monkeypatch.setattr(sweep, "flops", lambda *a: flops(*a) * 1e9)
    monkeypatch.setattr(sweep, "TOKENS", 64)
    monkeypatch.setattr(sweep, "HIDDEN", 32)
    monkeypatch.setattr(sweep, "gpu_facts", lambda: {"name": "GPU"})
    monkeypatch.setattr(sweep, "Build", lambda name, path, env=None: stand.build(name, **build))
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=stand.fa3) if fa3 else None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    lib = tmp_path / "libfa4.so"
    lib.write_bytes(b"stand-in")
    out = tmp_path / "out"
    fp8.main(["--lib", str(lib), "--sha", "abc", "--out", str(out)] + argv)
    return json.loads((out / "fp8_fwd.json").read_text()), (out / "fp8_fwd.md").read_text()


def test_a_whole_run_writes_its_rows_and_tables(fp8, stand, monkeypatch, tmp_path, capsys):
    torch.manual_seed(8)
    r, md = _main(fp8, stand, monkeypatch, tmp_path,
                  ["--hdims", "8,16", "--seqlens", "16,32", "--rounds", "5"], dims=(8,))
    assert r["complete"] and r["git_sha"] == "abc" and r["rounds"] == 5
    assert r["others"] == ["FA3"] and r["others_missing"] == {}
    shapes = [(x["head_dim"], x["seqlen"], x["batch"], x["heads_q"], x["causal"])
              for x in r["rows"]]
    assert shapes == [(8, 16, 4, 4, False), (8, 16, 4, 4, True), (8, 32, 2, 4, False),
                      (8, 32, 2, 4, True), (16, 16, 4, 2, False), (16, 16, 4, 2, True),
                      (16, 32, 2, 2, False), (16, 32, 2, 2, True)]
    for x in r["rows"]:
        assert "error" not in x
        assert ("refused" in x["columns"]["fa4cpp e4m3"]) == (x["head_dim"] == 16)
        assert x["columns"]["FA3 e4m3"]["ms_rounds"] == [1.25] * 5
    lines = md.splitlines()
    assert "cuDNN has no FP8 attention through torch's SDPA" in lines[2]
    assert "Not importable" not in md
    assert lines[4] == ("| d | seqlen | b | hq/hkv | causal | fa4cpp e4m3 | FA3 e4m3 | fa4cpp bf16 "
                        "| FA3 bf16 | cuDNN bf16 | fa4cpp e4m3 / FA3 e4m3 "
                        "| fa4cpp e4m3 / fa4cpp bf16 |")
    assert lines[5].count("|---") == 12
    # 4·b·h·s²·d / 2 (causal; _main scales it by 1e9) over each column's time, and the ratios.
    rates = tuple(4.0 * 4 * 4 * 16 * 16 * 8 / 2 * 1e9 / (MS[n] * 1e-3) / 1e12 for n in r["columns"])
    assert rates[0] == 65536
    assert lines[7] == ("| 8 | 16 | 4 | 4/4 | yes | %.1f | %.1f | %.1f | %.1f | %.1f | 1.25 | "
                        "2.00 |" % rates)
    assert lines[10].startswith("| 16 | 16 | 4 | 2/2 | no | refused | ")
    assert lines[10].endswith(" | — | — |")
    checks = lines[lines.index("| d | seqlen | b | hq/hkv | causal | " +
                               " | ".join(r["columns"]) + " |", 6) + 2:]
    assert len(checks) == 8 and "refused: head dim 16 not built" in checks[4]
    assert capsys.readouterr().out.endswith("\n" + md + "\n")  # the markdown last, printed


def test_without_fa3_its_columns_are_absent_and_the_reason_recorded(fp8, stand, monkeypatch,
                                                                    tmp_path):
    torch.manual_seed(9)
    r, md = _main(fp8, stand, monkeypatch, tmp_path,
                  ["--hdims", "8", "--seqlens", "16", "--causal", "no"], fa3=False,
                  ignore_descales=True)
    assert r["columns"] == ["fa4cpp e4m3", "fa4cpp bf16", "cuDNN bf16"]
    assert r["others"] == [] and r["others_missing"]["FA3"].startswith("flash_attn_interface")
    assert [x["causal"] for x in r["rows"]] == [False]
    assert set(r["rows"][0]["columns"]) == set(r["columns"])
    assert "Not importable here: FA3 (flash_attn_interface" in md
    assert "FA3" not in md.split("\n")[4]
    lines = md.splitlines()
    # The e4m3 column lost its descales: bad, in both tables; its rate and ratio still shown.
    assert lines[6] == "| 8 | 16 | 4 | 4/4 | no | %.1f **bad** | %.1f | %.1f | 2.00 |" % tuple(
        4.0 * 4 * 4 * 16 * 16 * 8 * 1e9 / (MS[n] * 1e-3) / 1e12 for n in r["columns"])
    check = lines[-1].split(" | ")
    assert check[5].startswith("**") and float(check[5].strip("*")) > 0.5
    assert check[6:] == ["0", "reference |"]


def test_plot_draws_every_column_of_an_fp8_result(tmp_path, bench_script):
    """bench/plot.py takes fp8.py's rows (their `columns`): one line per column that has a rate,
    none for a refused one."""
    pytest.importorskip("matplotlib")
    plot = bench_script("plot")
    rows = []
    for d in (64, 128):
        for s in (1024, 4096):
            for causal in (False, True):
                rows.append({"seqlen": s, "head_dim": d, "heads_q": 2048 // d,
                             "heads_kv": 2048 // d, "causal": causal, "columns": {
                                 "fa4cpp e4m3": {"tflops": 300.0 + d + s / 1024},
                                 "FA3 e4m3": {"tflops": 700.0 + d},
                                 "fa4cpp bf16": ({"refused": "no kernel"} if d == 64 else
                                                 {"tflops": 600.0})}})
    data = plot.series(rows)
    assert sorted(data[(64, False)]) == ["FA3 e4m3", "fa4cpp e4m3"]
    assert sorted(data[(128, True)]) == ["FA3 e4m3", "fa4cpp bf16", "fa4cpp e4m3"]
    assert sorted(data[(128, False)]["fa4cpp e4m3"]) == [(1024, 429.0), (4096, 432.0)]
    out = tmp_path / "fp8.png"
    plot.plot({"benchmark": "FP8 (e4m3) forward beside bf16", "git_sha": "abc", "rows": rows},
              str(out))
    assert out.stat().st_size > 0
