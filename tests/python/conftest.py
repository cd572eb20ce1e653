"""pytest setup for the fa4cpp Python package.

- Imports fa4cpp from this source tree (python/), with the library FA4CPP_LIBRARY names; when it
  is unset, a build tree's libfa4.so (build/cpu, then build/default) is used if one exists.
- Tests marked `sm90` need a CUDA device of compute capability 9.0 and skip, saying so, elsewhere.
- Every test starts with fallback and verify off, no fallback warning yet given, and a fixed seed.
- The fixture `path` runs a test on both the native ops and the Python implementation.
- The fixture `python_path` sends the native ops' calls to the Python implementation, for tests
  that replace a piece of it (ops.support, the c_abi calls) outside a mode. FA4CPP_TEST_PYTHON_PATH=1
  sends every test's calls there (scripts/test.sh runs the ops' tests so too).
- The fixture `bench_script` loads a bench/ script as a fresh module, bench/sweep.py (which the
  others import) fresh in sys.modules and bench/ on the path, for the benchmarks' CPU tests.
"""
import contextlib
import importlib.util
import os
import sys

import pytest
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(REPO, "python"))

if not os.environ.get("FA4CPP_LIBRARY"):
    for build in ("cpu", "default"):
        candidate = os.path.join(REPO, "build", build, "libfa4.so")
        if os.path.isfile(candidate):
            os.environ["FA4CPP_LIBRARY"] = candidate
            break

from fa4cpp import modes, ops  # noqa: E402  (imports fa4cpp from this tree)

SM90_REASON = "needs a CUDA device with compute capability 9.0"


def has_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def pytest_configure(config):
    config.addinivalue_line("markers", "sm90: needs a CUDA device with compute capability 9.0 "
                                       "(an H100 / H200); skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if has_sm90():
        return
    skip = pytest.mark.skip(reason=SM90_REASON)
    for item in items:
        if "sm90" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    previous = modes.set_mode(fallback=False, verify=0.0)
    monkeypatch.setattr(modes, "_warned", set())
    torch.manual_seed(0)
    with ops.python_path() if os.environ.get("FA4CPP_TEST_PYTHON_PATH") == "1" else _NO_PATH:
        yield
    modes.set_mode(fallback=previous.fallback, verify=previous.verify)


_NO_PATH = contextlib.nullcontext()


@pytest.fixture(params=["native", "python"])
def path(request):
    """Runs a test twice: through the native ops, then through the package's Python
    implementation (the same path twice where the native ops are not built)."""
    if request.param == "python":
        with ops.python_path():
            yield request.param
    else:
        yield request.param


@pytest.fixture
def python_path():
    with ops.python_path():
        yield


class Check:
    """Comparisons of library results with fa4cpp.reference (fp32), with verify mode's documented
    tolerances (fa4cpp/modes.py): out within c·max|V|; gradients within c·m + one subnormal
    spacing, m the reference's magnitudes (the gradient summed over absolute values); LSE
    (fp32 in both) within 1e-5·(1 + |LSE|). Equal infinities match; NaN never does."""

    @staticmethod
    def _assert(what, got, want, bound):
        got, want = got.detach().float(), want.detach().float()
        assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
        same_inf = torch.isinf(got) & torch.isinf(want) & (got.sign() == want.sign())
        err = torch.where(same_inf, torch.zeros_like(got), (got - want).abs())
        err = torch.nan_to_num(err, nan=float("inf"))
        excess = err - bound
        if excess.numel() and float(excess.max()) > 0:
            i = int(excess.argmax())
            raise AssertionError("%s: error %.3g > bound %.3g at flat index %d (got %.6g, want "
                                 "%.6g)" % (what, float(err.flatten()[i]),
                                            float(torch.as_tensor(bound).expand_as(err)
                                                  .flatten()[i]),
                                            i, float(got.flatten()[i]), float(want.flatten()[i])))

    def out(self, got, want, v, what="out"):
        scale = float(v.detach().abs().max()) if v.numel() else 1.0
        self._assert(what, got, want, modes.OUT_TOLERANCE[v.dtype] * scale)

    def lse(self, got, want, what="lse"):
        bound = 1e-5 * (1 + torch.nan_to_num(want.detach().abs(), posinf=0.0))
        self._assert(what, got, want, bound)

    def grads(self, got, want, magnitudes, dtype, names=("dq", "dk", "dv")):
        floor = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
        for name, g, w, m in zip(names, got, want, magnitudes):
            assert g.dtype == dtype, (name, g.dtype)
            self._assert(name, g, w, modes.GRAD_TOLERANCE[dtype] * m + floor)


@pytest.fixture
def check():
    return Check()


@pytest.fixture
def bench_script(monkeypatch):
    """load(name): bench/<name>.py as a fresh module; the scripts it imports from bench/ resolve,
    sweep to a fresh copy of its own (so a test's patches of one script's sweep stay there)."""
    bench = os.path.join(REPO, "bench")

    def fresh(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(bench, name + ".py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    monkeypatch.syspath_prepend(bench)
    monkeypatch.setitem(sys.modules, "sweep", fresh("sweep"))
    return fresh
