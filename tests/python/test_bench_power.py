"""bench/power_log.py and sweep.py --power, on the CPU: each timing's window of samples, the medians
and energy per call of a column over its rounds (from the energy counter, or power × time), NVML's
readings through a stand-in pynvml module, the background sampler, the GPU facts the results
record, and the sweep's power table."""
import importlib.util
import os
import sys
import threading
import time
import types

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "bench"))
import power_log  # noqa: E402


class FakeNvml:
    """Stands in for the pynvml module: one GPU, its UUID GPU-0, whose SM clock rises by 1 MHz and
    energy counter by 7 mJ at every reading. instant / counter: whether the driver reports the
    instantaneous power and has the energy counter."""

    NVML_SUCCESS = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_TEMPERATURE_GPU = 0
    NVML_FI_DEV_POWER_INSTANT = 186
    NVML_VALUE_TYPE_DOUBLE = 0
    NVML_VALUE_TYPE_UNSIGNED_INT = 1

    class NVMLError(Exception):
        pass

    def __init__(self, instant=True, counter=True, gpus=2):
        self.instant, self.counter, self.gpus = instant, counter, gpus
        self.initialized = 0
        self.mhz = 1500
        self.energy_mj = 5_000_000
        self.lock = threading.Lock()

    def _check(self, handle):
        assert self.initialized > 0, "NVML used before nvmlInit or after nvmlShutdown"
        assert handle == "gpu0"

    def nvmlInit(self):
        self.initialized += 1

    def nvmlShutdown(self):
        self.initialized -= 1

    def nvmlDeviceGetCount(self):
        assert self.initialized > 0
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, index):
        assert self.initialized > 0 and index == 0
        return "gpu0"

    def nvmlDeviceGetHandleByUUID(self, uuid):
        assert self.initialized > 0
        if uuid != "GPU-0":
            raise self.NVMLError("Not Found")
        return "gpu0"

    def nvmlDeviceGetName(self, handle):
        self._check(handle)
        return "NVIDIA H200"

    def nvmlSystemGetDriverVersion(self):
        return "580.159.04"

    def nvmlDeviceGetClockInfo(self, handle, clock):
        self._check(handle)
        if clock == self.NVML_CLOCK_MEM:
            return 3201
        with self.lock:
            self.mhz += 1
            return self.mhz

    def nvmlDeviceGetMaxClockInfo(self, handle, clock):
        self._check(handle)
        return 1980 if clock == self.NVML_CLOCK_SM else 3201

    def nvmlDeviceGetPowerManagementLimit(self, handle):
        self._check(handle)
        return 700000  # mW

    def nvmlDeviceGetTemperature(self, handle, sensor):
        self._check(handle)
        assert sensor == self.NVML_TEMPERATURE_GPU
        return 38

    def nvmlDeviceGetFieldValues(self, handle, fields):
        self._check(handle)
        assert fields == [self.NVML_FI_DEV_POWER_INSTANT]
        value = types.SimpleNamespace(uiVal=650500, dVal=float("nan"))  # mW
        return [types.SimpleNamespace(
            fieldId=fields[0], valueType=self.NVML_VALUE_TYPE_UNSIGNED_INT, value=value,
            nvmlReturn=self.NVML_SUCCESS if self.instant else self.NVML_ERROR_NOT_SUPPORTED)]

    def nvmlDeviceGetPowerUsage(self, handle):
        self._check(handle)
        return 700250  # mW, the one-second average

    def nvmlDeviceGetTotalEnergyConsumption(self, handle):
        self._check(handle)
        if not self.counter:
            raise self.NVMLError("Not Supported")
        with self.lock:
            self.energy_mj += 7
            return self.energy_mj


def test_pynvml_has_what_the_stand_in_offers():
    # The stand-in's names are those power_log uses: the pinned nvidia-ml-py must have them all.
    pynvml = pytest.importorskip("pynvml")
    names = [n for n in dir(FakeNvml) if n.startswith(("nvml", "NVML"))]
    assert len(names) > 20
    assert [n for n in names if not hasattr(pynvml, n)] == []


def test_summarize_takes_the_window_only():
    samples = [(10.0, 1980, 100, 1000), (11.0, 1700, 690, 2000), (11.5, 1600, 700, 2350),
               (12.0, 1650, 695, 2700), (13.0, 1980, 120, 2800)]
    assert power_log.summarize(samples, 11.0, 12.0) == {
        "sm_mhz": 1650, "watts": 695, "samples": 3, "energy_mj": 700, "seconds": 1.0}
    assert power_log.summarize(samples, 14.0, 15.0) is None
    # Without the counter, or with one sample only, no energy: power × time takes over.
    no_counter = [s[:3] + (None,) for s in samples]
    assert power_log.summarize(no_counter, 11.0, 12.0) == {"sm_mhz": 1650, "watts": 695,
                                                           "samples": 3}
    assert "energy_mj" not in power_log.summarize(samples, 11.2, 11.7)


def test_combine_rounds_into_energy_per_call_from_power():
    windows = [{"sm_mhz": 1600, "watts": 700, "samples": 5}, None,
               {"sm_mhz": 1700, "watts": 680, "samples": 6}]
    got = power_log.combine(windows, 0.5)
    assert got == {"sm_mhz": 1650, "watts": 690, "mj_per_call": 345.0, "samples": 11,
                   "energy_source": "power"}
    assert power_log.combine([None, None], 0.5) is None


def test_combine_rounds_into_energy_per_call_from_the_counter():
    # 1400 J in 2 s over both windows: 700 W on average, whatever the sampled medians say.
    windows = [{"sm_mhz": 1600, "watts": 650, "samples": 5, "energy_mj": 600_000, "seconds": 0.8,
                "watts_source": "instant"}, None,
               {"sm_mhz": 1700, "watts": 690, "samples": 6, "energy_mj": 800_000, "seconds": 1.2,
                "watts_source": "instant"}]
    got = power_log.combine(windows, 0.5)
    assert got == {"sm_mhz": 1650, "watts": 670, "samples": 11, "energy_source": "counter",
                   "counter_watts": pytest.approx(700.0), "mj_per_call": pytest.approx(350.0),
                   "watts_source": "instant"}
    # One window without the counter: the column falls back to power × time.
    windows[2] = {"sm_mhz": 1700, "watts": 690, "samples": 6}
    got = power_log.combine(windows, 0.5)
    assert got["energy_source"] == "power" and got["mj_per_call"] == pytest.approx(335.0)
    assert "counter_watts" not in got


def test_nvml_sampler_reads_instant_power_and_the_counter():
    nvml = FakeNvml()
    sampler = power_log.NvmlSampler(uuid="GPU-0", nvml=nvml)
    assert (sampler.watts_source, sampler.has_counter) == ("instant", True)
    before = time.time()
    when, mhz, watts, mj = sampler()
    assert before <= when <= time.time()
    assert (mhz, watts, mj) == (1501.0, 650.5, nvml.energy_mj)
    assert sampler()[3] == mj + 7
    sampler.close()
    assert nvml.initialized == 0


def test_nvml_sampler_falls_back_to_average_power_without_a_counter():
    nvml = FakeNvml(instant=False, counter=False)
    sampler = power_log.NvmlSampler(nvml=nvml)  # no UUID: the first GPU
    assert (sampler.watts_source, sampler.has_counter) == ("average", False)
    _, mhz, watts, mj = sampler()
    assert (mhz, watts, mj) == (1501.0, 700.25, None)
    sampler.close()
    assert nvml.initialized == 0


def test_nvml_sampler_refuses_an_unknown_gpu_and_shuts_nvml_down():
    nvml = FakeNvml()
    with pytest.raises(FakeNvml.NVMLError):
        power_log.NvmlSampler(uuid="GPU-7", nvml=nvml)
    assert nvml.initialized == 0
    # With a single GPU there is no choice: an unknown UUID names that one.
    nvml = FakeNvml(gpus=1)
    sampler = power_log.NvmlSampler(uuid="GPU-7", nvml=nvml)
    assert sampler()[1] == 1501.0
    sampler.close()
    assert nvml.initialized == 0


def wait_for_window(log, start, count):
    deadline = start + 10
    got = None
    while time.time() < deadline:
        time.sleep(0.05)
        got = log.window(start, time.time())
        if got is not None and got["samples"] >= count:
            break
    return got


def test_power_log_samples_nvml_in_the_background():
    nvml = FakeNvml()
    start = time.time()
    log = power_log.PowerLog(interval_ms=5, sampler=power_log.NvmlSampler(nvml=nvml))
    try:
        got = wait_for_window(log, start, 5)
        assert got is not None and got["samples"] >= 5
        assert got["watts"] == 650.5 and got["sm_mhz"] > 1500
        assert got["watts_source"] == "instant"
        # Every reading adds 7 mJ: the first and last sample of the window are samples - 1 apart.
        assert got["energy_mj"] == 7 * (got["samples"] - 1) and got["seconds"] > 0
        assert log.window(start - 100, start - 50) is None
        assert log.failures == 0
    finally:
        log.close()
    assert nvml.initialized == 0
    count = len(log._samples)
    time.sleep(0.05)
    assert len(log._samples) == count  # closed: no more readings


def test_power_log_leaves_out_failed_readings():
    calls = []
    closed = []

    class Flaky:
        def __call__(self):
            calls.append(None)
            if len(calls) % 2 == 0:
                raise RuntimeError("GPU is lost")
            return time.time(), 1600.0, 690.0, None

        def close(self):
            closed.append(True)

    start = time.time()
    log = power_log.PowerLog(interval_ms=2, sampler=Flaky())
    try:
        got = wait_for_window(log, start, 4)
        assert got is not None and got["samples"] >= 4 and "energy_mj" not in got
        assert "watts_source" not in got  # the sampler does not say
        assert log.failures >= 1 and log.last_error == "GPU is lost"
    finally:
        log.close()
    assert closed == [True]


def test_gpu_facts_keep_nvidia_smi_names_and_formats():
    nvml = FakeNvml()
    assert power_log.gpu_facts("GPU-0", nvml=nvml) == {
        "name": "NVIDIA H200", "driver_version": "580.159.04", "clocks.sm": "1501 MHz",
        "clocks.max.sm": "1980 MHz", "clocks.mem": "3201 MHz", "power.limit": "700.00 W",
        "temperature.gpu": "38"}
    assert nvml.initialized == 0
    with pytest.raises(FakeNvml.NVMLError):
        power_log.gpu_facts("GPU-7", nvml=nvml)
    assert nvml.initialized == 0


@pytest.fixture
def sweep():
    pytest.importorskip("triton")
    spec = importlib.util.spec_from_file_location("sweep", os.path.join(REPO, "bench", "sweep.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_gpu_facts_come_from_nvml(sweep, monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setattr(sweep, "nvml_uuid", lambda: "GPU-0")
    monkeypatch.setattr(power_log, "_nvml", lambda _: nvml)
    facts = sweep.gpu_facts()
    assert list(facts) == ["name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem",
                           "power.limit", "temperature.gpu"]
    monkeypatch.setattr(sweep, "nvml_uuid", lambda: "GPU-7")  # not this machine's: no facts
    assert list(sweep.gpu_facts()) == ["error"]


def test_sweep_records_and_tabulates_power(sweep, monkeypatch):
    class FakeLog:  # cuDNN's timings sample 700 W at 1700 MHz, the build's 680 W at 1600 MHz
        def __init__(self):
            self.next = None

        def window(self, start, end):
            assert start <= end
            return self.next

    log = FakeLog()
    monkeypatch.setattr(sweep, "POWER", log)

    def timed(watts, mhz, ms, counter_mj=None):
        def run():
            log.next = {"sm_mhz": mhz, "watts": watts, "samples": 4}
            if counter_mj is not None:  # over a 0.5 s window
                log.next.update(energy_mj=counter_mj, seconds=0.5)
        return run, ms
    cudnn, cudnn_ms = timed(700.0, 1700.0, 0.9)
    build, build_ms = timed(680.0, 1600.0, 0.95)
    times = {cudnn: cudnn_ms, build: build_ms}
    monkeypatch.setattr(sweep.triton.testing, "do_bench",
                        lambda fn, **kw: (fn(), times[fn])[1])
    row = {"batch": 4, "seqlen": 4096, "heads_q": 8, "heads_kv": 8, "head_dim": 256,
           "causal": False, "libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 3, cudnn, None, {"fa4cpp": build})
    assert row["cudnn_power"] == {"sm_mhz": 1700.0, "watts": 700.0, "energy_source": "power",
                                  "mj_per_call": pytest.approx(630.0), "samples": 12}
    assert row["libs"]["fa4cpp"]["power"]["mj_per_call"] == pytest.approx(646.0)
    result = {"benchmark": "forward sweep", "pass": "fwd", "git_sha": "abc", "torch": "t",
              "cudnn": 1, "timing": "median", "flops": "4*b*h*s*s*d", "gpu_before": {},
              "libs": [{"name": "fa4cpp", "version": "0", "path": "lib"}],
              "others": [], "others_missing": {}, "rows": [row]}
    lines = sweep.markdown(result).splitlines()
    at = lines.index(next(l for l in lines if l.startswith("## SM clock")))
    assert lines[at].endswith("mJ = median power × median time)")
    header, rule, line = lines[at + 2:at + 5]
    assert "fa4cpp MHz / W / mJ | cuDNN MHz / W / mJ | fa4cpp/cuDNN energy" in header
    assert rule.count("|---") == header.count("|") - 1
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[5:] == ["1600 / 680 / 646", "1700 / 700 / 630", "1.025"]

    # With the energy counter: 360 J in 0.5 s is 720 W on average, 0.9 ms of it 648 mJ.
    cudnn, cudnn_ms = timed(700.0, 1700.0, 0.9, counter_mj=360_000)
    times = {cudnn: cudnn_ms, build: build_ms}
    monkeypatch.setattr(sweep.triton.testing, "do_bench",
                        lambda fn, **kw: (fn(), times[fn])[1])
    row = {"batch": 4, "seqlen": 4096, "heads_q": 8, "heads_kv": 8, "head_dim": 256,
           "causal": False, "libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 2, cudnn, None, {"fa4cpp": build})
    assert row["cudnn_power"]["energy_source"] == "counter"
    assert row["cudnn_power"]["mj_per_call"] == pytest.approx(648.0)
    result["rows"] = [row]
    lines = sweep.markdown(result).splitlines()
    at = lines.index(next(l for l in lines if l.startswith("## SM clock")))
    assert lines[at].endswith("mJ = the energy counter's average power or median power × "
                              "median time)")
    cells = [c.strip() for c in lines[at + 4].split("|")[1:-1]]
    assert cells[5:] == ["1600 / 680 / 646", "1700 / 700 / 648", "0.997"]

    # A peer (FA3) timed beside them gets its clock, power and energy too, after cuDNN's column;
    # the energy ratios stay the builds' against cuDNN.
    peer, peer_ms = timed(690.0, 1650.0, 0.8)
    times = {cudnn: cudnn_ms, build: build_ms, peer: peer_ms}
    monkeypatch.setattr(sweep.triton.testing, "do_bench",
                        lambda fn, **kw: (fn(), times[fn])[1])
    row = {"batch": 4, "seqlen": 4096, "heads_q": 8, "heads_kv": 8, "head_dim": 256,
           "causal": False, "libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 2, cudnn, None, {"fa4cpp": build}, {"FA3": peer})
    assert row["others"]["FA3"]["power"]["mj_per_call"] == pytest.approx(552.0)
    assert row["others"]["FA3"]["power"]["sm_mhz"] == 1650.0
    lines = sweep.power_markdown({"others": ["FA3"], "rows": [row]}, ["fa4cpp"])
    assert lines[3] == ("| d | seqlen | b | hq/hkv | causal | fa4cpp MHz / W / mJ | cuDNN MHz / "
                        "W / mJ | FA3 MHz / W / mJ | fa4cpp/cuDNN energy |")
    assert lines[4].count("|---") == lines[3].count("|") - 1
    cells = [c.strip() for c in lines[5].split("|")[1:-1]]
    assert cells[5:] == ["1600 / 680 / 646", "1700 / 700 / 648", "1650 / 690 / 552", "0.997"]

    monkeypatch.setattr(sweep, "POWER", None)  # without --power: no window, no table
    row = {"libs": {"fa4cpp": {}}}
    sweep.time_rounds(row, 1, cudnn, None, {"fa4cpp": build})
    assert "cudnn_power" not in row and "power" not in row["libs"]["fa4cpp"]
    assert sweep.power_markdown({"rows": [row]}, ["fa4cpp"]) == []
