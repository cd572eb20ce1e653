"""bench/power_log.py and sweep.py --power, on the CPU: nvidia-smi's lines parsed, each timing's
window of samples, the medians and energy per call of a column over its rounds, the background
sampler (a stand-in nvidia-smi), and the sweep's power table."""
import datetime
import importlib.util
import os
import stat
import sys
import textwrap
import time

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
import power_log  # noqa: E402


def stamp(t):
    return datetime.datetime.fromtimestamp(t).strftime(power_log.TIMESTAMP)[:-3]  # milliseconds


def test_parse_sample():
    t = time.time()
    when, mhz, watts = power_log.parse_sample("%s, 1635, 689.42\n" % stamp(t))
    assert when == pytest.approx(t, abs=2e-3)
    assert (mhz, watts) == (1635.0, 689.42)
    for line in ("timestamp, clocks.sm [MHz], power.draw.instant [W]", "", "%s, [N/A], 70.1" % stamp(t),
                 "%s, 1980" % stamp(t)):
        assert power_log.parse_sample(line) is None


def test_summarize_takes_the_window_only():
    samples = [(10.0, 1980, 100), (11.0, 1700, 690), (11.5, 1600, 700), (12.0, 1650, 695),
               (13.0, 1980, 120)]
    assert power_log.summarize(samples, 11.0, 12.0) == {"sm_mhz": 1650, "watts": 695,
                                                        "samples": 3}
    assert power_log.summarize(samples, 14.0, 15.0) is None


def test_combine_rounds_into_energy_per_call():
    windows = [{"sm_mhz": 1600, "watts": 700, "samples": 5}, None,
               {"sm_mhz": 1700, "watts": 680, "samples": 6}]
    got = power_log.combine(windows, 0.5)
    assert got == {"sm_mhz": 1650, "watts": 690, "mj_per_call": 345.0, "samples": 11}
    assert power_log.combine([None, None], 0.5) is None


def test_power_log_reads_a_background_sampler(tmp_path):
    # Stands in for nvidia-smi: whatever its arguments, a header, then a sample every 10 ms.
    fake = tmp_path / "nvidia-smi"
    fake.write_text(textwrap.dedent("""\
        #!%s
        import datetime, sys, time
        print("timestamp, clocks.sm [MHz], power.draw.instant [W]", flush=True)
        mhz = 1500
        while True:
            now = datetime.datetime.now().strftime("%%Y/%%m/%%d %%H:%%M:%%S.%%f")[:-3]
            print("%%s, %%d, 650.5" %% (now, mhz), flush=True)
            mhz += 1
            time.sleep(0.01)
        """ % sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = power_log.PowerLog(interval_ms=10, command=str(fake))
    try:
        start = time.time()
        deadline = start + 10
        got = None
        while time.time() < deadline:
            time.sleep(0.2)
            got = log.window(start, time.time())
            if got is not None and got["samples"] >= 5:
                break
        assert got is not None and got["samples"] >= 5
        assert got["watts"] == 650.5 and got["sm_mhz"] >= 1500
        assert log.window(start - 100, start - 50) is None
    finally:
        log.close()


def test_sweep_records_and_tabulates_power(monkeypatch):
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(REPO, "bench", "sweep.py"))
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)

    class FakeLog:  # cuDNN's timings sample 700 W at 1700 MHz, the build's 680 W at 1600 MHz
        def __init__(self):
            self.next = None

        def window(self, start, end):
            assert start <= end
            return self.next

    log = FakeLog()
    monkeypatch.setattr(sweep, "POWER", log)

    def timed(watts, mhz, ms):
        def run():
            log.next = {"sm_mhz": mhz, "watts": watts, "samples": 4}
        return run, ms
    cudnn, cudnn_ms = timed(700.0, 1700.0, 0.9)
    build, build_ms = timed(680.0, 1600.0, 0.95)
    times = {cudnn: cudnn_ms, build: build_ms}
    monkeypatch.setattr(sweep.triton.testing, "do_bench",
                        lambda fn, **kw: (fn(), times[fn])[1])
    row = {"batch": 4, "seqlen": 4096, "heads_q": 8, "heads_kv": 8, "head_dim": 256,
           "causal": False, "libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 3, cudnn, None, {"fa4cpp": build})
    assert row["cudnn_power"] == {"sm_mhz": 1700.0, "watts": 700.0,
                                  "mj_per_call": pytest.approx(630.0), "samples": 12}
    assert row["libs"]["fa4cpp"]["power"]["mj_per_call"] == pytest.approx(646.0)
    result = {"benchmark": "forward sweep", "pass": "fwd", "git_sha": "abc", "torch": "t",
              "cudnn": 1, "timing": "median", "flops": "4*b*h*s*s*d", "gpu_before": {},
              "libs": [{"name": "fa4cpp", "version": "0", "path": "lib"}],
              "others": [], "others_missing": {}, "rows": [row]}
    lines = sweep.markdown(result).splitlines()
    at = lines.index(next(l for l in lines if l.startswith("## SM clock")))
    header, rule, line = lines[at + 2:at + 5]
    assert "fa4cpp MHz / W / mJ | cuDNN MHz / W / mJ | fa4cpp/cuDNN energy" in header
    assert rule.count("|---") == header.count("|") - 1
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[5:] == ["1600 / 680 / 646", "1700 / 700 / 630", "1.025"]

    monkeypatch.setattr(sweep, "POWER", None)  # without --power: no window, no table
    row = {"libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 1, cudnn, None, {"fa4cpp": build})
    assert "cudnn_power" not in row and "power" not in row["libs"]["fa4cpp"]
    assert sweep.power_markdown({"rows": [row]}, ["fa4cpp"]) == []
