"""Finding and loading libfa4.so, once per process: the path in FA4CPP_LIBRARY when set (a build
tree's library, for development and tests), else the copy `pip install` puts beside these files.

The library's launch-plan overrides (FA4_SM90_*, FA4_CPU_THREADS; docs/developing.md) apply to
the package's calls when set in the environment at load: the C++ library never reads the
environment itself, the package asks it to (fa4_overrides_from_env) and passes them."""
import os
import threading

from . import c_abi

ENV_VAR = "FA4CPP_LIBRARY"
LIBRARY_NAME = "libfa4.so"

_lock = threading.Lock()
_loaded = None


def library_path():
    """Where the library is looked for; raises with instructions when it is not there."""
    path = os.environ.get(ENV_VAR)
    if path:
        if not os.path.isfile(path):
            raise OSError("%s=%s: no such file" % (ENV_VAR, path))
        return path
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_NAME)
    if not os.path.isfile(path):
        raise OSError("fa4cpp cannot find %s: it is not installed beside the package (%s) and %s "
                      "is not set; install the package with `pip install .` or point %s at a "
                      "build's libfa4.so" % (LIBRARY_NAME, path, ENV_VAR, ENV_VAR))
    return path


def library():
    """The process's c_abi.Library."""
    global _loaded
    if _loaded is None:
        with _lock:
            if _loaded is None:
                lib = c_abi.Library(library_path())
                overrides = lib.overrides_from_env()
                # Only a real override is passed: the defaults are the null pointer's.
                if bytes(overrides) != bytes(lib.make_overrides()):
                    lib.overrides = overrides
                _loaded = lib
    return _loaded


# -- the native torch ops -------------------------------------------------------------------------
# libfa4_torch.so (python/csrc) registers torch.ops.fa4cpp.* from C++, built against one torch
# version, which it records beside itself (libfa4_torch.torch_version). It is looked for beside
# libfa4.so and loaded only under that torch version; without it the package's Python
# implementation (ctypes) serves the ops. The native ops hand calls to the Python implementation
# (the ops fa4cpp::*_py) whenever fallback or verify mode is on, or when use_python_path() asks.

NATIVE_NAME = "libfa4_torch.so"
NATIVE_VERSION_NAME = "libfa4_torch.torch_version"

_native = None          # the loaded ctypes handle, once loaded
_native_detail = None   # its path when loaded, else why not
_modes_on = False
_python_path_asked = False


def _load_native():
    global _native, _native_detail
    import torch  # the package needs torch anyway; _library stays importable without it

    folder = os.path.dirname(library_path())
    path = os.path.join(folder, NATIVE_NAME)
    version_path = os.path.join(folder, NATIVE_VERSION_NAME)
    if not os.path.isfile(path):
        _native_detail = "%s is not built (see the build's FA4_TORCH_OPS)" % path
        return
    try:
        with open(version_path) as f:
            built_with = f.read().strip()
    except OSError:
        built_with = None
    if built_with != torch.__version__:
        _native_detail = ("%s was built against torch %s, this process runs torch %s: rebuild "
                          "it (pip install --no-build-isolation .)" % (path, built_with,
                                                                       torch.__version__))
        return
    torch.ops.load_library(path)
    import ctypes
    handle = ctypes.CDLL(path)
    handle.fa4cpp_torch_set_python_path.argtypes = [ctypes.c_int]
    handle.fa4cpp_torch_set_python_path.restype = None
    _native, _native_detail = handle, path
    _push_python_path()


def native():
    """(True, path) when the native ops serve torch.ops.fa4cpp.*, else (False, the reason)."""
    if _native_detail is None:
        library()  # first: it takes the lock itself
        with _lock:
            if _native_detail is None:
                _load_native()
    return _native is not None, _native_detail


def _push_python_path():
    if _native is not None:
        _native.fa4cpp_torch_set_python_path(int(_modes_on or _python_path_asked))


def note_modes(on):
    """fa4cpp.modes: whether fallback or verify mode is on (the native ops then hand every call
    to the Python implementation, where the modes act)."""
    global _modes_on
    _modes_on = bool(on)
    _push_python_path()


def use_python_path(on):
    """Whether the native ops hand every call to the Python implementation; returns the
    previous setting. No effect without the native ops."""
    global _python_path_asked
    previous = _python_path_asked
    _python_path_asked = bool(on)
    _push_python_path()
    return previous
