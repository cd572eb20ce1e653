"""The SM clock and the board's power while the benchmark times something.

nvidia-smi samples both every few milliseconds in the background, with a timestamp, and each
timing keeps the samples taken inside its own window. Under the board's power cap the SM clock is
what differs between two kernels doing the same work, so power × time (energy per call) tells which
kernel the cap favours (bench/NOTES.md, eighteenth session)."""
import datetime
import statistics
import subprocess
import threading

# power.draw is a one-second average on Ampere and newer (nvidia-smi --help-query-gpu), longer
# than a timing; the instant reading follows each kernel.
FIELDS = "timestamp,clocks.sm,power.draw.instant"
INTERVAL_MS = 20  # between samples
TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, in local time like time.time()'s conversions


def parse_sample(line):
    """(seconds since the epoch, SM clock in MHz, board power in W) of one line of
    `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits`, or None (a header, a blank
    line, "[N/A]")."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 3:
        return None
    try:
        when = datetime.datetime.strptime(parts[0], TIMESTAMP).timestamp()
        return when, float(parts[1]), float(parts[2])
    except ValueError:
        return None


def summarize(samples, start, end):
    """Medians of the samples taken in [start, end] (seconds since the epoch):
    {"sm_mhz", "watts", "samples"}, or None if none was."""
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return None
    return {"sm_mhz": statistics.median(s[1] for s in inside),
            "watts": statistics.median(s[2] for s in inside),
            "samples": len(inside)}


def combine(windows, ms):
    """One timed column's power over its rounds: the medians of the rounds' windows (None where a
    round had no sample) and the energy per call, median power × the column's median time."""
    windows = [w for w in windows if w is not None]
    if not windows:
        return None
    watts = statistics.median(w["watts"] for w in windows)
    return {"sm_mhz": statistics.median(w["sm_mhz"] for w in windows), "watts": watts,
            "mj_per_call": watts * ms, "samples": sum(w["samples"] for w in windows)}


class PowerLog:
    """Samples every `interval_ms` from a background nvidia-smi until close()."""

    def __init__(self, interval_ms=INTERVAL_MS, command="nvidia-smi"):
        self._samples = []
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            [command, "--query-gpu=" + FIELDS, "--format=csv,noheader,nounits",
             "-lms", str(interval_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self._proc.stdout:
            sample = parse_sample(line)
            if sample is not None:
                with self._lock:
                    self._samples.append(sample)

    def window(self, start, end):
        """summarize() of the samples so far between start and end."""
        with self._lock:
            samples = list(self._samples)
        return summarize(samples, start, end)

    def close(self):
        self._proc.terminate()
        self._proc.wait()
        self._reader.join(timeout=5)
