"""The SM clock and the board's power while the benchmark times something.

A background thread reads both from NVML (nvidia-ml-py's pynvml module) every INTERVAL_MS, with the
time of each reading, and each timing keeps the samples taken inside its own window. Under the
board's power cap the SM clock is what differs between two kernels doing the same work, so the
energy per call tells which kernel the cap favours (the forward without a mask runs power-capped
on the H200).

Power is the instantaneous reading (NVML_FI_DEV_POWER_INSTANT) where the driver has it:
nvmlDeviceGetPowerUsage, the fallback, is a one-second average on Ampere and newer, longer than a
timing. Where the GPU has an energy counter (nvmlDeviceGetTotalEnergyConsumption, mJ since the
driver loaded), a window's energy is the counter's rise between its first and last sample, and a
column's energy per call is that energy over that time (the average power, every watt counted)
times its median time; elsewhere it is the median sampled power times the median time. Each result
says which: "energy_source" is "counter" or "power", "watts_source" "instant" or "average".
"""
import statistics
import threading
import time

INTERVAL_MS = 20  # between samples

# A sample: (seconds since the epoch, SM clock in MHz, board power in W, energy counter in mJ or
# None).


def _nvml(nvml):
    """The pynvml module, or the stand-in given."""
    if nvml is not None:
        return nvml
    try:
        import pynvml
    except ImportError as e:
        raise ImportError("bench/power_log.py needs nvidia-ml-py (module pynvml): "
                          "pip install nvidia-ml-py") from e
    return pynvml


def _handle(nvml, uuid):
    """The GPU named by NVML's UUID ("GPU-..."), else the first GPU. A UUID that NVML does not know
    is an error where there is a choice; on a machine with one GPU, that GPU is the one meant."""
    if not uuid:
        return nvml.nvmlDeviceGetHandleByIndex(0)
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except nvml.NVMLError:
        if nvml.nvmlDeviceGetCount() == 1:
            return nvml.nvmlDeviceGetHandleByIndex(0)
        raise


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def gpu_facts(uuid=None, nvml=None):
    """The GPU's name, driver, clocks, power limit and temperature under the names and in the
    format of nvidia-smi's --query-gpu=... --format=csv, as bench/sweep.py's results record them."""
    nvml = _nvml(nvml)
    nvml.nvmlInit()
    try:
        h = _handle(nvml, uuid)
        return {
            "name": _text(nvml.nvmlDeviceGetName(h)),
            "driver_version": _text(nvml.nvmlSystemGetDriverVersion()),
            "clocks.sm": "%d MHz" % nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM),
            "clocks.max.sm": "%d MHz" % nvml.nvmlDeviceGetMaxClockInfo(h, nvml.NVML_CLOCK_SM),
            "clocks.mem": "%d MHz" % nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM),
            "power.limit": "%.2f W" % (nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000.0),
            "temperature.gpu": "%d" % nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU),
        }
    finally:
        nvml.nvmlShutdown()


# nvmlFieldValue_t's value is a union; valueType says which member holds it.
_FIELD_MEMBERS = {"NVML_VALUE_TYPE_DOUBLE": "dVal", "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
                  "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal",
                  "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
                  "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal",
                  "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
                  "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal"}


class NvmlSampler:
    """One GPU's readings: each call returns a sample. uuid: NVML's UUID of the GPU ("GPU-...";
    default the first GPU); nvml: a stand-in for the pynvml module (tests)."""

    def __init__(self, uuid=None, nvml=None):
        self.nvml = _nvml(nvml)
        self.nvml.nvmlInit()
        try:
            self.handle = _handle(self.nvml, uuid)
            self.watts_source = "instant" if self._instant_mw() is not None else "average"
            self.has_counter = self._counter_mj() is not None
        except Exception:
            self.nvml.nvmlShutdown()
            raise

    def _instant_mw(self):
        """The instantaneous board power in mW, or None where the driver does not report it."""
        n = self.nvml
        field = getattr(n, "NVML_FI_DEV_POWER_INSTANT", None)  # absent from old nvidia-ml-py
        if field is None:
            return None
        try:
            v = n.nvmlDeviceGetFieldValues(self.handle, [field])[0]
        except n.NVMLError:
            return None
        if v.nvmlReturn != n.NVML_SUCCESS:
            return None
        for type_name, member in _FIELD_MEMBERS.items():
            if v.valueType == getattr(n, type_name, None):
                return getattr(v.value, member)
        return None

    def _counter_mj(self):
        try:
            return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except self.nvml.NVMLError:  # NotSupported before Volta, and on some boards
            return None

    def __call__(self):
        n = self.nvml
        when = time.time()
        mhz = n.nvmlDeviceGetClockInfo(self.handle, n.NVML_CLOCK_SM)
        if self.watts_source == "instant":
            mw = self._instant_mw()
            if mw is None:
                raise RuntimeError("NVML returned no instantaneous power")
        else:
            mw = n.nvmlDeviceGetPowerUsage(self.handle)
        mj = n.nvmlDeviceGetTotalEnergyConsumption(self.handle) if self.has_counter else None
        return when, float(mhz), mw / 1000.0, mj

    def close(self):
        self.nvml.nvmlShutdown()


def summarize(samples, start, end):
    """The samples taken in [start, end] (seconds since the epoch), in the order taken: the medians
    {"sm_mhz", "watts", "samples"}, and where the first and last carry the energy counter and lie
    apart, its rise "energy_mj" over their distance "seconds"; None if no sample was taken."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return None
    out = {"sm_mhz": statistics.median(s[1] for s in inside),
           "watts": statistics.median(s[2] for s in inside),
           "samples": len(inside)}
    first, last = inside[0], inside[-1]
    if first[3] is not None and last[3] is not None and last[0] > first[0]:
        out["energy_mj"] = last[3] - first[3]
        out["seconds"] = last[0] - first[0]
    return out


def combine(windows, ms):
    """One timed column's power over its rounds (None where a round had no sample): the medians of
    the rounds' clock and power, and the energy per call of the column's median time `ms`. With the
    counter in every window, that is the counter's average power over the windows ("counter_watts",
    their energy over their time) × ms, "energy_source": "counter"; else the median power × ms,
    "energy_source": "power". W × ms = mJ."""
    windows = [w for w in windows if w is not None]
    if not windows:
        return None
    watts = statistics.median(w["watts"] for w in windows)
    out = {"sm_mhz": statistics.median(w["sm_mhz"] for w in windows), "watts": watts,
           "mj_per_call": watts * ms, "samples": sum(w["samples"] for w in windows),
           "energy_source": "power"}
    if all("energy_mj" in w for w in windows):
        seconds = sum(w["seconds"] for w in windows)
        counter_watts = sum(w["energy_mj"] for w in windows) / seconds / 1e3
        out.update(counter_watts=counter_watts, mj_per_call=counter_watts * ms,
                   energy_source="counter")
    if "watts_source" in windows[0]:
        out["watts_source"] = windows[0]["watts_source"]
    return out


class PowerLog:
    """Samples every `interval_ms` on a background thread until close(). sampler: a callable that
    returns one sample (default NvmlSampler(uuid)); a reading that raises is left out and counted
    in `failures`, its message in `last_error`."""

    def __init__(self, interval_ms=INTERVAL_MS, uuid=None, sampler=None):
        self._sampler = sampler if sampler is not None else NvmlSampler(uuid)
        self._interval = interval_ms / 1000.0
        self._samples = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.failures = 0
        self.last_error = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                sample = self._sampler()
            except Exception as e:  # an NVML error: this reading is missing, the next may not be
                with self._lock:
                    self.failures += 1
                    self.last_error = str(e)
            else:
                with self._lock:
                    self._samples.append(sample)
            # A fixed rate; a reading slower than the interval delays the next, never bunches them.
            due = max(due + self._interval, time.monotonic())
            self._stop.wait(max(0.0, due - time.monotonic()))

    def window(self, start, end):
        """summarize() of the samples so far between start and end, with the sampler's
        "watts_source" where it has one."""
        with self._lock:
            samples = list(self._samples)
        out = summarize(samples, start, end)
        source = getattr(self._sampler, "watts_source", None)
        if out is not None and source is not None:
            out["watts_source"] = source
        return out

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        close = getattr(self._sampler, "close", None)
        if close is not None:
            close()
