"""fa4cpp for PyTorch: exact attention from the fa4cpp library (C ABI through ctypes, no tensor
copies, CUDA work on torch's current stream, CPU tensors on the CPU backend).

    from fa4cpp import flash_attn_func, flash_attn_varlen_func   # flash_attn-compatible
    torch.ops.fa4cpp.fwd / bwd / varlen_fwd / varlen_bwd          # custom ops (torch.compile-able)
    fa4cpp.set_mode(fallback=..., verify=...), fa4cpp.mode(...)   # see fa4cpp.modes
    fa4cpp.context_parallel.ring_flash_attn_func                  # a sequence over many ranks

Importing the package registers the custom ops and, where fa4cpp/sdpa.py is present, fa4cpp's
entry in torch's flash-attention registry; it activates nothing."""
import importlib.util as _importlib_util

from . import _library, context_parallel, modes, ops, reference
from .c_abi import Fa4Error
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache,
                        get_scheduler_metadata)
from .modes import FallbackWarning, VerificationError, get_mode, mode, set_mode

__version__ = _library.library().version()

if _importlib_util.find_spec(__name__ + ".sdpa") is not None:
    from . import sdpa  # noqa: F401  (registers, never activates)

__all__ = [
    "Fa4Error", "FallbackWarning", "VerificationError", "__version__", "flash_attn_func",
    "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func", "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache", "get_mode", "get_scheduler_metadata", "mode",
    "context_parallel", "modes", "ops", "reference", "set_mode",
]
