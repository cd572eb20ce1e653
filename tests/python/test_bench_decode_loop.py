"""bench/decode_loop.py on the CPU: a tiny model's loop through fa4cpp's CPU backend beside a
stand-in FlashAttention-3 (fa4cpp's function, counted; one that disagrees; one that raises), the
graph mode refused off CUDA, the rotation of the (library, mode) pairs over the rounds, the token
comparison, and the files and table main() writes."""
import json

import pytest
import torch

import fa4cpp

pytest.importorskip("transformers", reason="needs transformers (FA4_PYTHON_DEPS=1 "
                    "scripts/install_deps.sh installs the pinned version)")
pytest.importorskip("triton")

TINY = ["--device", "cpu", "--dtype", "fp32", "--layers", "1", "--hidden", "64", "--heads", "4",
        "--kv-heads", "2", "--vocab", "97", "--prompt", "9", "--steps", "5", "--page-size", "4",
        "--batches", "1,3", "--rounds", "2"]


@pytest.fixture
def loop(bench_script):
    return bench_script("decode_loop")


def run_main(loop, tmp_path, monkeypatch, fa3, *extra):
    monkeypatch.setattr(loop.decode, "find_fa3", lambda: (fa3, "3.0.test" if fa3 else "not here"))
    loop.main(["--sha", "abc1234", "--out", str(tmp_path), "--name", "loop"] + TINY +
              list(extra))
    with open(tmp_path / "loop.json") as f:
        result = json.load(f)
    return result, (tmp_path / "loop.md").read_text()


def test_fa4cpp_beside_a_stand_in_fa3(loop, tmp_path, monkeypatch):
    calls = []

    def fa3(*args, **kwargs):
        calls.append(args[0].shape)
        return fa4cpp.flash_attn_with_kvcache(*args, **kwargs)
    result, md = run_main(loop, tmp_path, monkeypatch, fa3)
    assert result["complete"] and result["libraries"] == ["fa4cpp", "FA3"]
    assert result["fa3"] == {"available": True, "version": "3.0.test"}
    assert [row["batch"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        # Eager runs twice each (two rounds); graphs are refused on the CPU.
        assert set(row["tokens_per_s"]) == {"fa4cpp eager", "FA3 eager"}
        assert all(len(v) == 2 for v in row["rounds_ms"].values())
        assert row["errors"] == {"fa4cpp graph": "CUDA graphs need a CUDA device",
                                 "FA3 graph": "CUDA graphs need a CUDA device"}
        assert row["differing_tokens"]["FA3 eager"] == 0
        assert row["differing_sequences"]["FA3 eager"] == 0
        assert row["first_difference"]["FA3 eager"] is None
        for key, ms in row["ms_per_step"].items():
            assert ms > 0 and row["tokens_per_s"][key] == pytest.approx(1e3 * row["batch"] / ms)
    # Per loop: a prefill and 4 decode steps in 1 layer; 2 rounds, 2 batch sizes.
    assert len(calls) == 2 * 2 * 5
    assert "| batch | fa4cpp eager tok/s | fa4cpp graph tok/s | FA3 eager tok/s |" in md
    assert "fa4cpp / FA3 eager" in md and "CUDA graphs need a CUDA device" in md


def test_the_pairs_take_turns_first(loop, tmp_path, monkeypatch):
    order = []
    real = loop.load_example

    def example():
        module = real()
        generate = module.generate

        def logged(*args, attention=None, **kwargs):
            order.append("FA3" if attention is fa3 else "fa4cpp")
            return generate(*args, attention=attention, **kwargs)
        module.generate = logged
        return module

    def fa3(*args, **kwargs):
        return fa4cpp.flash_attn_with_kvcache(*args, **kwargs)
    monkeypatch.setattr(loop, "load_example", example)
    run_main(loop, tmp_path, monkeypatch, fa3, "--batches", "2", "--modes", "eager",
             "--rounds", "3")
    assert order == ["fa4cpp", "FA3", "FA3", "fa4cpp", "fa4cpp", "FA3"]


def test_a_wrong_or_failing_peer_shows(loop, tmp_path, monkeypatch):
    def wrong(*args, **kwargs):  # keys rotated the other way: other tokens
        kwargs["rotary_interleaved"] = True
        return fa4cpp.flash_attn_with_kvcache(*args, **kwargs)
    result, md = run_main(loop, tmp_path, monkeypatch, wrong, "--modes", "eager")
    assert sum(row["differing_tokens"]["FA3 eager"] for row in result["rows"]) > 0
    for row in result["rows"]:
        if row["differing_tokens"]["FA3 eager"]:
            assert 1 <= row["differing_sequences"]["FA3 eager"] <= row["batch"]
            assert 0 <= row["first_difference"]["FA3 eager"] < row["steps"]
    assert "sequences, from step" in md

    def failing(*args, **kwargs):
        raise RuntimeError("no kernel for this head dim\nsecond line")
    result, md = run_main(loop, tmp_path, monkeypatch, failing, "--modes", "eager")
    for row in result["rows"]:
        assert row["errors"] == {"FA3 eager": "no kernel for this head dim"}
        assert set(row["tokens_per_s"]) == {"fa4cpp eager"}
    assert "n/a" in md and "no kernel for this head dim" in md


def test_without_fa3(loop, tmp_path, monkeypatch):
    result, md = run_main(loop, tmp_path, monkeypatch, None, "--modes", "eager",
                          "--batches", "2", "--rounds", "1")
    assert result["libraries"] == ["fa4cpp"]
    assert result["fa3"] == {"available": False, "missing": "not here"}
    assert "FlashAttention-3 not run: not here." in md
    assert torch.isfinite(torch.tensor(list(result["rows"][0]["tokens_per_s"].values()))).all()


def test_bad_mode_is_refused(loop):
    with pytest.raises(SystemExit):
        loop.parse_args(["--sha", "x", "--out", "y", "--modes", "eager,fast"])
