"""The pip packaging (pyproject.toml, cmake/fa4_python.cmake): a CPU-only wheel built from this tree
holds the package's sources, libfa4.so and the native torch ops (built against this environment's
torch) and nothing else, the build adds nothing to the source
tree, and the installed package finds its own library (no FA4CPP_LIBRARY) and computes.

Builds the library and the native ops once more (about 40 s on two cores), offline: scikit-build-core comes from the
environment (--no-build-isolation), as `FA4_PYTHON_DEPS=1 scripts/install_deps.sh` installs it."""
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PINNED = re.search(r'"scikit-build-core==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)

skbuild = pytest.importorskip("scikit_build_core", reason="needs scikit-build-core==%s in the "
                              "environment (FA4_PYTHON_DEPS=1 scripts/install_deps.sh installs "
                              "it)" % PINNED)
if skbuild.__version__ != PINNED:
    pytest.skip("needs the pinned scikit-build-core==%s (found %s): the build runs offline with "
                "the environment's copy" % (PINNED, skbuild.__version__), allow_module_level=True)

SKIPPED_DIRS = {".git", "__pycache__", ".venv", ".pytest_cache"}


def _tree_paths():
    """Every file and folder of the source tree (git's data, caches and .venv left out)."""
    paths = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        paths.update(os.path.join(folder, name) for name in dirs + files)
    return paths


def _project_version():
    text = (ROOT / "CMakeLists.txt").read_text()
    return re.search(r"project\(fa4cpp VERSION ([0-9.]+)", text).group(1)


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if k not in ("FA4CPP_LIBRARY", "PYTHONPATH", "FA4_SM90_KERNELS")}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    before = _tree_paths()
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w",
         str(out), str(ROOT)],
        env=_env(FA4_WITH_CUDA="OFF"), capture_output=True, text=True)
    assert build.returncode == 0, build.stdout[-4000:] + build.stderr[-4000:]
    # A build in the tree leaves new files or folders (build directories, egg-info, ...).
    new = sorted(_tree_paths() - before)
    assert new == [], "the build wrote into the source tree: %s" % new[:20]
    wheels = list(out.glob("fa4cpp-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents(wheel):
    assert wheel.name == "fa4cpp-%s-py3-none-linux_x86_64.whl" % _project_version()
    names = zipfile.ZipFile(wheel).namelist()
    payload = sorted(n for n in names if ".dist-info/" not in n)
    sources = sorted("fa4cpp/" + p.name for p in (ROOT / "python" / "fa4cpp").glob("*.py"))
    # Built with this environment's torch: the native ops and the torch version they need.
    assert payload == sorted(sources + ["fa4cpp/libfa4.so", "fa4cpp/libfa4_torch.so",
                                        "fa4cpp/libfa4_torch.torch_version"])
    version = zipfile.ZipFile(wheel).read("fa4cpp/libfa4_torch.torch_version").decode()
    assert version.strip() == torch.__version__


def test_installed_package_uses_its_library(wheel, tmp_path):
    site = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(site), str(wheel)],
        env=_env(), capture_output=True, text=True)
    assert install.returncode == 0, install.stdout[-4000:] + install.stderr[-4000:]
    probe = textwrap.dedent("""
        import torch, fa4cpp
        from fa4cpp import _library, reference
        print(fa4cpp.__file__)
        print(_library.library_path())
        print(fa4cpp.__version__)
        print(fa4cpp.ops.native_ops()[1])
        q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
        out = fa4cpp.flash_attn_func(q, k, v, causal=True)
        ref, _ = reference.attention(q, k, v, causal=True)
        print((out - ref).abs().max().item())
    """)
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path,
                         env=_env(PYTHONPATH=str(site)), capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-4000:]
    package, library, version, native, error = run.stdout.split("\n")[:5]
    assert Path(package).parent == site / "fa4cpp"
    assert Path(library) == site / "fa4cpp" / "libfa4.so"
    assert version == _project_version()
    assert Path(native) == site / "fa4cpp" / "libfa4_torch.so"
    assert float(error) < 1e-5
