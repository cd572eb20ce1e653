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
