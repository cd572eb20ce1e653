"""bench/sweep.py's other FlashAttention builds (FA3 / FA4 columns when importable), on the CPU
with stand-in modules: which import, the closures they are timed through (forward, backward of one
forward, both), refusals per row, and the table's columns; the fa4cpp builds' checked first runs
(checked_builds); and the result files every benchmark script writes row by row (ResultFile)."""
import importlib.util
import json
import os
import sys
import types

import pytest
import torch

pytest.importorskip("triton")

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.fixture
def sweep(monkeypatch):
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(REPO, "bench", "sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    return module


def attention(q, k, v, causal=False):
    """A stand-in flash_attn_func on (batch, seq, heads, dim) tensors, returning (out, lse) as
    some versions do."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2), None


def test_others_found_only_when_importable(sweep, monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_func=attention))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import raises ImportError
    found, missing = sweep.find_others()
    assert found == {"FA3": attention}
    assert list(missing) == ["FA4"] and missing["FA4"].startswith("flash_attn.cute")


def test_other_closures_run_forward_backward_and_both(sweep):
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    dout = torch.randn(1, 16, 2, 8)
    want = attention(q, k, v, causal=True)[0]
    assert torch.allclose(sweep._first(sweep.other_fn(attention, q, k, v, True)()), want)
    ref = [x.detach().requires_grad_() for x in (q, k, v)]
    want_grads = torch.autograd.grad(attention(*ref, causal=True)[0], ref, dout)
    for with_forward in (False, True):
        run = sweep.other_fn(attention, q, k, v, True, dout, with_forward)
        for _ in range(2):  # the backward alone reuses one forward's graph
            for got, w in zip(run(), want_grads):
                assert torch.allclose(got, w, atol=1e-6)


def test_refusals_and_the_table(sweep, monkeypatch):
    def refuses(*args, **kwargs):
        raise RuntimeError("head dim not supported\nmore detail")
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    row = {}
    runs = sweep.checked_others(row, {"FA3": attention, "FA4": refuses},
                                lambda f: sweep.other_fn(f, q, k, v, False))
    assert list(runs) == ["FA3"]
    assert row["others"]["FA4"] == {"refused": "head dim not supported"}

    monkeypatch.setattr(sweep, "median_ms", lambda fn, windows=None: (fn(), 2.0)[1])
    row.update({"batch": 1, "seqlen": 16, "heads_q": 2, "heads_kv": 2, "head_dim": 8,
                "causal": False, "libs": {"fa4cpp": {}}})
    sweep.time_rounds(row, 1, lambda: None, None, {"fa4cpp": lambda: None}, runs)
    sweep.add_rates(row, 4e9)
    assert row["others"]["FA3"]["tflops"] == pytest.approx(4e9 / 2e-3 / 1e12)
    result = {"benchmark": "forward sweep", "pass": "fwd", "git_sha": "abc", "torch": "t",
              "cudnn": 1, "timing": "median", "flops": "4*b*h*s*s*d", "gpu_before": {},
              "libs": [{"name": "fa4cpp", "version": "0", "path": "lib"}],
              "others": ["FA3", "FA4"], "others_missing": {}, "rows": [row]}
    header, rule, line = sweep.markdown(result).splitlines()[4:7]
    assert "| torch FA2 | FA3 | FA4 | fa4cpp/cuDNN |" in header
    assert rule.count("|---") == header.count("|") - 1
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[8:10] == ["2.0", "—"]  # FA3 timed, FA4 refused in this row
    result.update(others=[], others_missing={"FA3": "flash_attn_interface: No module"})
    assert "Not importable here: FA3 (flash_attn_interface: No module)." in sweep.markdown(result)


def test_checked_builds_records_refusals_and_differences(sweep):
    class Build:
        def __init__(self, name, refuses):
            self.name, self.refuses = name, refuses

    calls = []

    def first_run(bld, entry):
        if bld.refuses:
            raise sweep.fa4_ctypes.Fa4Error("head dim not built")
        entry["note"] = bld.name
        calls.append(bld.name)
        return lambda: bld.name

    row = {"libs": {}}
    builds = [Build("a", False), Build("b", True), Build("c", False)]
    runs = sweep.checked_builds(row, builds, first_run, lambda: 0.25)
    assert list(runs) == ["a", "c"] and runs["c"]() == "c" and calls == ["a", "c"]
    assert row["libs"]["a"] == {"note": "a", "max_abs_diff_vs_cudnn": 0.25}
    assert row["libs"]["b"] == {"refused": "head dim not built"}


def test_partial_result_is_written_and_marked(sweep, tmp_path, capsys):
    row = {"batch": 1, "seqlen": 16, "heads_q": 2, "heads_kv": 2, "head_dim": 8, "causal": True,
           "cudnn_tflops": 1.0, "libs": {"fa4cpp": {"tflops": 2.0, "vs_cudnn": 2.0}}}
    result = {"benchmark": "forward sweep", "pass": "fwd", "git_sha": "abc", "torch": "t",
              "cudnn": 1, "timing": "median", "flops": "4*b*h*s*s*d", "gpu_before": {},
              "libs": [{"name": "fa4cpp", "version": "0", "path": "lib"}], "complete": False,
              "rows": [row]}
    sweep.write_result(result, str(tmp_path), "partial", sweep.markdown, quiet=True)
    assert capsys.readouterr().out == ""
    md = (tmp_path / "partial.md").read_text()
    lines = md.splitlines()
    assert lines[3] == "" and lines[4].startswith("**Partial:** the run stopped after these 1 rows")
    assert lines[6].startswith("| d | seqlen |") and lines[8].startswith("| 8 | 16 |")
    result["complete"] = True
    sweep.write_result(result, str(tmp_path), "partial", sweep.markdown)
    assert "Partial" not in (tmp_path / "partial.md").read_text()
    assert "| 8 | 16 |" in capsys.readouterr().out


def test_result_file_writes_each_row_then_the_whole_run(sweep, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "gpu_facts", lambda: {"name": "GPU"})
    build = types.SimpleNamespace(name="fa4cpp", path="lib.so", version="0", deterministic=False,
                                  env={}, has_rescale_counts=lambda: False)
    run = sweep.ResultFile(str(tmp_path), "run", sweep.markdown, "forward sweep", "abc", [build],
                           3, extra={"pass": "fwd", "flops": "4*b*h*s*s*d"})
    row = {"batch": 1, "seqlen": 16, "heads_q": 2, "heads_kv": 2, "head_dim": 8, "causal": False,
           "cudnn_tflops": 1.0, "libs": {"fa4cpp": {"tflops": 2.0, "vs_cudnn": 2.0}}}
    run.add(row)
    assert json.loads(capsys.readouterr().out) == row  # the row, printed as measured
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["complete"] is False and written["gpu_after"] is None
    assert written["pass"] == "fwd" and written["rounds"] == 3 and written["rows"] == [row]
    assert written["libs"][0]["path"] == "lib.so" and not written["libs"][0]["deterministic"]
    assert "**Partial:** the run stopped after these 1 rows" in (tmp_path / "run.md").read_text()
    run.add(dict(row, seqlen=32))
    run.finish()
    written = json.loads((tmp_path / "run.json").read_text())
    assert written["complete"] is True and written["gpu_after"] == {"name": "GPU"}
    assert [r["seqlen"] for r in written["rows"]] == [16, 32]
    md = (tmp_path / "run.md").read_text()
    assert "Partial" not in md and "| 8 | 32 |" in md and "| 8 | 32 |" in capsys.readouterr().out


def test_small_scripts_mark_a_partial_table(sweep, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "bench"))
    monkeypatch.setitem(sys.modules, "sweep", sweep)
    r = {"libs": [{"name": "fa4cpp", "version": "0", "path": "lib"}], "git_sha": "abc",
         "gpu_before": {}, "torch": "t", "cudnn": 1, "timing": "median", "rows": []}
    for script in ("varlen", "gqa_short"):
        spec = importlib.util.spec_from_file_location(script,
                                                      os.path.join(REPO, "bench", script + ".py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        lines = module.markdown(dict(r, complete=False)).splitlines()
        assert lines[3] == "" and lines[4].startswith("**Partial:** the run stopped after these 0")
        assert lines[5] == "" and lines[6].startswith("| ")
        done = module.markdown(dict(r, complete=True)).splitlines()
        assert "Partial" not in "\n".join(done) and done[3] == "" and done[4].startswith("| ")


def test_rescale_table_names_heads_and_builds_that_never_rescaled(sweep):
    row = {"batch": 1, "seqlen": 16, "heads_q": 8, "heads_kv": 2, "head_dim": 64, "causal": True,
           "libs": {"thr8": {"rescale_counts": {"warp_tiles": 200, "exact_rescales": 50,
                                                "adaptive_rescales": 0}},
                    "thr0": {"rescale_counts": {"warp_tiles": 200, "exact_rescales": 50,
                                                "adaptive_rescales": 200}},
                    "uncounted": {}}}
    lines = sweep.rescale_markdown({"inputs": "spiky", "rows": [row]}, ["thr8", "thr0", "uncounted"])
    assert lines[1] == "## O rescales per warp tile (one forward run, spiky inputs)"
    assert lines[-2] == "| 64 | 16 | 8/2 | yes | thr8 | 200 | 25.00 % | 0.00 % | none |"
    assert lines[-1] == "| 64 | 16 | 8/2 | yes | thr0 | 200 | 25.00 % | 100.00 % | 0.2× |"
    assert sweep.rescale_markdown({"rows": [dict(row, libs={"a": {}})]}, ["a"]) == []


def test_every_column_takes_turns_to_go_first(sweep, monkeypatch):
    # Each column's timings must come from its own callable, and each of cuDNN, the builds, the
    # peers and FA2 must go first in some round: a fixed order hands whoever runs first a cooler
    # chip.
    order = []
    monkeypatch.setattr(sweep, "median_ms", lambda fn, windows=None: fn())

    def timed(name, ms):
        return lambda: (order.append(name), ms)[1]
    row = {"libs": {"a": {}, "b": {}}}
    sweep.time_rounds(row, 5, timed("cudnn", 3.0), timed("fa2", 5.0),
                      {"a": timed("a", 1.0), "b": timed("b", 2.0)}, {"FA3": timed("FA3", 4.0)})
    rounds = [order[i:i + 5] for i in range(0, 25, 5)]
    assert [r[0] for r in rounds] == ["cudnn", "a", "b", "FA3", "fa2"]
    assert all(sorted(r) == sorted(rounds[0]) for r in rounds)
    assert (row["cudnn_ms"], row["fa2_ms"]) == (3.0, 5.0)
    assert [row["libs"][n]["ms"] for n in "ab"] == [1.0, 2.0]
    assert row["libs"]["a"]["ms_rounds"] == [1.0] * 5
    assert row["others"]["FA3"]["ms"] == 4.0


def test_rotated_rounds_drops_only_what_refused_accepts(sweep, monkeypatch):
    # The rotation every script shares: a timing that raises is dropped when refused() says so
    # (not timed again), and goes through otherwise.
    monkeypatch.setattr(sweep, "median_ms", lambda fn, windows=None: fn())
    calls = []

    def fails():
        calls.append("b")
        raise ValueError("no")
    times, _ = sweep.rotated_rounds({"a": lambda: 1.5, "b": fails}, 3, lambda key, e: key == "b")
    assert times == {"a": [1.5] * 3, "b": []} and calls == ["b"]
    with pytest.raises(ValueError):
        sweep.rotated_rounds({"a": lambda: 1.5, "b": fails}, 3, lambda key, e: False)


def test_fa2_refusal_drops_only_its_column(sweep, monkeypatch):
    monkeypatch.setattr(sweep, "median_ms", lambda fn, windows=None: fn())

    def refuses():
        raise RuntimeError("no kernel for this head dim\ndetail")
    row = {"libs": {"a": {}}}
    sweep.time_rounds(row, 3, lambda: 3.0, refuses, {"a": lambda: 1.0})
    assert row["fa2_refused"] == "no kernel for this head dim" and "fa2_ms" not in row
    assert row["libs"]["a"]["ms_rounds"] == [1.0] * 3 and row["cudnn_ms"] == 3.0


def test_variant_columns(sweep):
    # A build's variant columns share its library and carry the variant's tensors; FA4 gets a
    # sinks column whose closures pass (and differentiate) learnable_sink.
    bld = sweep.Build.__new__(sweep.Build)
    bld.name, bld.deterministic, bld.variant = "fa4cpp", False, "none"
    assert bld.with_variant("none") is bld
    sinks, alibi = bld.with_variant("sinks"), bld.with_variant("alibi")
    assert (sinks.name, alibi.name, bld.name) == ("fa4cpp+sinks", "fa4cpp+alibi", "fa4cpp")
    p = alibi.params(True, 4, device="cpu")
    assert p.causal and p.sinks is None
    assert torch.allclose(p.alibi_slopes, torch.tensor([2.0 ** (-2 * (h + 1)) for h in range(4)]))
    p = sinks.params(False, 4, device="cpu")
    assert p.alibi_slopes is None and p.sinks.shape == (4,) and p.sinks.dtype == torch.float32

    seen = []

    def fa4(q, k, v, causal=False, learnable_sink=None):
        seen.append(learnable_sink)
        out, lse = attention(q, k, v, causal=causal)
        return (out * (1.0 if learnable_sink is None else learnable_sink.sum().sigmoid()), lse)
    others = sweep.variant_others({"FA4": fa4, "FA3": attention}, ["none", "sinks"])
    assert sorted(others) == ["FA3", "FA4", "FA4+sinks"]
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    sweep.other_fn(others["FA4+sinks"], q, k, v, False)()
    assert seen[-1].shape == (2,)
    grads = sweep.other_fn(others["FA4+sinks"], q, k, v, False, torch.randn(1, 16, 2, 8))()
    assert len(grads) == 4 and grads[3].shape == (2,)  # d(learnable_sink) too
    sweep.other_fn(others["FA4"], q, k, v, False)()
    assert seen[-1] is None


def test_variant_cost_table(sweep):
    row = {"batch": 1, "seqlen": 16, "heads_q": 2, "heads_kv": 2, "head_dim": 8, "causal": True,
           "libs": {"fa4cpp": {"ms": 2.0}, "fa4cpp+sinks": {"ms": 2.02}},
           "others": {"FA4": {"ms": 4.0}, "FA4+sinks": {"ms": 5.0}}}
    result = {"libs": [{"name": "fa4cpp"}, {"name": "fa4cpp+sinks", "variant": "sinks"}],
              "others": ["FA4", "FA4+sinks"], "rows": [row]}
    lines = sweep.variant_markdown(result)
    assert "| fa4cpp+sinks / fa4cpp | FA4+sinks / FA4 |" in lines[3]
    assert lines[-1] == "| 8 | 16 | 1 | 2/2 | yes | 1.010 | 1.250 |"
    assert sweep.variant_markdown({"libs": [{"name": "fa4cpp"}], "others": ["FA3"],
                                   "rows": [row]}) == []


def test_gqa_rows_at_the_lengths_asked_for(sweep):
    gqa = [s for b, s, hq, hkv, d in sweep.shapes([64, 128], [1024, 4096, 16384]) if hq != hkv]
    assert gqa == [16384]  # the defaults, 2k and 16k, where the sweep has them
    rows = sweep.shapes([128], [4096, 8192], [2048, 4096, 8192])
    assert [(b, s, hq, hkv, d) for b, s, hq, hkv, d in rows if hq != hkv] == \
        [(1, 4096, 64, 8, 128), (1, 8192, 64, 8, 128)]
    assert sweep.shapes([64], [4096], [4096]) == [(4, 4096, 32, 32, 64)]


def test_sustained_timing_windows(sweep, monkeypatch):
    """--sustained: the calls per window from three timed calls, one window of warm-up, then the
    median of the windows' milliseconds per call; the result files say how it timed."""
    calls = []

    def stopwatch(fn, n):  # 2 ms a call, 3 in the warm-up window (not counted)
        calls.append(n)
        return n * (3.0 if len(calls) == 2 else 2.0)
    assert sweep.sustained_ms(lambda: None, 50.0, windows=3, stopwatch=stopwatch) == 2.0
    assert calls == [3, 25, 25, 25, 25]
    calls.clear()
    assert sweep.sustained_ms(lambda: None, 1.0, windows=1, stopwatch=stopwatch) == 2.0
    assert calls == [3, 3, 3], "at least three calls a window"
    assert "do_bench" in sweep.timing_note(1)
    monkeypatch.setattr(sweep, "SUSTAINED_MS", 200.0)
    monkeypatch.setattr(sweep, "sustained_ms", lambda fn, ms: (fn(), ms / 100)[1])
    assert sweep.median_ms(lambda: None) == 2.0
    assert "back-to-back" in sweep.timing_note(5) and "200 ms" in sweep.timing_note(5)
