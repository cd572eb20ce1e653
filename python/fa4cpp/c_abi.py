"""ctypes binding of fa4cpp's C ABI (include/fa4/fa4.h) over torch tensors: no copies, work enqueued
on torch's current CUDA stream, CPU tensors on the CPU backend.

The struct layouts here must match fa4.h (FA4_ABI_VERSION 5); fa4_*_init fills struct_size and the
defaults. This file imports nothing from the fa4cpp package: bench/sweep.py loads it as a plain
module (`import c_abi`) so that the sweep needs no package install."""
import contextlib
import ctypes
import dataclasses
import struct
from typing import Optional

import torch

ABI_VERSION = 5

# fa4_status
SUCCESS = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_NOT_SUPPORTED = 2
ERROR_WORKSPACE_TOO_SMALL = 3
ERROR_BACKEND_UNAVAILABLE = 4
ERROR_DEVICE = 5
ERROR_INTERNAL = 6

# fa4_backend
BACKEND_AUTO = 0
BACKEND_CPU = 1
BACKEND_SM90 = 2
BACKEND_NAMES = {"cpu": BACKEND_CPU, "sm90": BACKEND_SM90}

# fa4_pass
PASS_FORWARD = 0
PASS_BACKWARD = 1

DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float8_e4m3fn: 3}
# FP8 inputs (fa4_dtype E4M3) give an output in one of these (fa4_problem's out_dtype).
FP8_DTYPES = (torch.float8_e4m3fn,)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16)

# The C++ API's Workspace contract: 256-byte aligned memory of the backend.
WORKSPACE_ALIGNMENT = 256


class Problem(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("batch", ctypes.c_int64), ("seqlen_q", ctypes.c_int64), ("seqlen_k", ctypes.c_int64),
        ("heads_q", ctypes.c_int64), ("heads_kv", ctypes.c_int64),
        ("head_dim_qk", ctypes.c_int64), ("head_dim_v", ctypes.c_int64),
        ("dtype", ctypes.c_int32), ("causal", ctypes.c_int32),
        ("window_left", ctypes.c_int64), ("window_right", ctypes.c_int64),
        ("softcap", ctypes.c_float), ("softmax_scale", ctypes.c_float),
        ("cu_seqlens_q", ctypes.c_void_p), ("cu_seqlens_k", ctypes.c_void_p),
        ("total_q", ctypes.c_int64), ("total_k", ctypes.c_int64),
        ("seqused_k", ctypes.c_void_p),
        ("return_lse", ctypes.c_int32), ("deterministic", ctypes.c_int32),
        # ABI version 2: the KV cache and num_splits.
        ("page_table", ctypes.c_void_p), ("page_table_stride", ctypes.c_int64),
        ("pages_per_seq", ctypes.c_int64), ("num_pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64), ("cache_batch_idx", ctypes.c_void_p),
        ("cache_batch", ctypes.c_int64), ("cache_leftpad", ctypes.c_void_p),
        ("seqlen_new", ctypes.c_int64), ("cu_seqlens_new", ctypes.c_void_p),
        ("total_new", ctypes.c_int64), ("rotary_dim", ctypes.c_int64),
        ("rotary_interleaved", ctypes.c_int32), ("reserved", ctypes.c_int32),
        ("rotary_seqlen", ctypes.c_int64), ("num_splits", ctypes.c_int64),
        # ABI version 3: FP8 — the output's dtype, appended rows quantised on write; ALiBi slopes
        # and attention sinks (Params.alibi_slopes, Params.sinks).
        ("out_dtype", ctypes.c_int32), ("quantize_appends", ctypes.c_int32),
        ("alibi_slopes", ctypes.c_void_p), ("alibi_batch_stride", ctypes.c_int64),
        ("alibi_head_stride", ctypes.c_int64), ("sinks", ctypes.c_void_p),
    ]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("seq_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
                ("dim_stride", ctypes.c_int64)]


class Lse(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("seq_stride", ctypes.c_int64)]


class Descale(ctypes.Structure):
    """fa4_descale: fp32 (batch, heads_kv) descales of e4m3 inputs; a null pointer is 1."""
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64)]


class ForwardTensors(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("out", Tensor), ("lse", Lse),
                # ABI version 2: the KV cache's appended rows and rotary tables.
                ("k_new", Tensor), ("v_new", Tensor), ("rotary_cos", ctypes.c_void_p),
                ("rotary_sin", ctypes.c_void_p), ("rotary_stride", ctypes.c_int64),
                # ABI version 3: descales of e4m3 q, k, v.
                ("q_descale", Descale), ("k_descale", Descale), ("v_descale", Descale)]


class BackwardTensors(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("out", Tensor), ("dout", Tensor), ("lse", Lse),
                ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
                # ABI version 3: the attention sinks' gradient (null: not computed).
                ("dsinks", ctypes.c_void_p)]


class Overrides(ctypes.Structure):
    """fa4_overrides: launch-plan overrides for tools and tests (-1: the library's choice, 0 off,
    1 on; counts 0: the library's)."""
    _fields_ = [("struct_size", ctypes.c_uint32)] + [
        (name, ctypes.c_int32) for name in (
            "persistent", "persistent_ctas", "zigzag_group", "pack_gqa", "splits",
            "longest_first", "chunked_kv", "bwd_group", "bwd_rotate", "bwd_pairs",
            "cpu_threads",
            # ABI version 4.
            "narrow",
            # ABI version 5.
            "unmasked")]


class Fa4Error(RuntimeError):
    """A call the library refused or failed; the message is the library's. `status` is the
    fa4_status code (None when the refusal came from the Python side)."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Params:
    """Everything of a problem that is not a q/k/v/out tensor. softmax_scale 0 = 1/sqrt(head dim);
    window sides -1 = unbounded; softcap 0 = off. cu_seqlens_q non-None selects varlen mode."""
    softmax_scale: float = 0.0
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softcap: float = 0.0
    deterministic: bool = False
    cu_seqlens_q: Optional[torch.Tensor] = None
    cu_seqlens_k: Optional[torch.Tensor] = None
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    seqused_k: Optional[torch.Tensor] = None
    kv: Optional["KvCache"] = None  # k / v are a KV cache (flash_attn_with_kvcache)
    num_splits: int = 0
    fp8: Optional["Fp8"] = None  # float8_e4m3fn inputs: their descales and output dtype
    # ALiBi slopes: fp32 (batch, heads_q) with any strides (0 broadcasts), or (heads_q,) for one
    # slope per head; None = no ALiBi.
    alibi_slopes: Optional[torch.Tensor] = None
    # Attention sinks: fp32 (heads_q,) logits, contiguous; None = no sinks.
    sinks: Optional[torch.Tensor] = None

    @property
    def varlen(self):
        return self.cu_seqlens_q is not None

    def reference_kwargs(self):
        """The keyword arguments fa4cpp.reference's attention functions take for this problem."""
        return dict(softmax_scale=self.softmax_scale, causal=self.causal,
                    window=(self.window_left, self.window_right), softcap=self.softcap,
                    seqused_k=self.seqused_k, alibi_slopes=self.alibi_slopes, sinks=self.sinks)

    def descale_kwargs(self):
        """FP8 inputs' descales as the reference's keyword arguments ({} without FP8)."""
        if self.fp8 is None:
            return {}
        return dict(q_descale=self.fp8.q_descale, k_descale=self.fp8.k_descale,
                    v_descale=self.fp8.v_descale)


@dataclasses.dataclass(frozen=True)
class KvCache:
    """A KV cache's own parameters (fa4_problem's KV-cache fields); the cache lengths travel as
    Params.seqused_k. Tensors as the library reads them: int32, contiguous."""
    page_table: Optional[torch.Tensor] = None       # (cache_batch, pages_per_seq)
    cache_batch_idx: Optional[torch.Tensor] = None  # (batch,)
    cache_leftpad: Optional[torch.Tensor] = None    # (batch,)
    cu_seqlens_new: Optional[torch.Tensor] = None   # (batch + 1,): varlen appends
    seqlen_new: int = 0                             # appended rows (the most, when varlen)
    total_new: int = 0
    rotary_dim: int = 0
    rotary_interleaved: bool = False
    rotary_seqlen: int = 0


@dataclasses.dataclass(frozen=True)
class Fp8:
    """The extras of float8_e4m3fn inputs (fa4_problem's out_dtype and quantize_appends,
    fa4_forward_tensors' descales): the output's dtype (bfloat16 or float16, the rotary tables'
    too); whether a KV cache's appended rows come in that dtype, quantised on write; the fp32
    (batch, heads_kv) descales of q, k and v, any strides (0 broadcasts), None = 1."""
    out_dtype: torch.dtype = torch.bfloat16
    quantize_appends: bool = False
    q_descale: Optional[torch.Tensor] = None
    k_descale: Optional[torch.Tensor] = None
    v_descale: Optional[torch.Tensor] = None


def _ptr(t):
    return t.data_ptr() if t is not None and t.numel() > 0 else None


def _strides(t, rank):
    """t's strides (in elements) padded with leading 0s to `rank`; a last dimension of one element
    has no meaningful stride: 1. Tuples, not lists: this runs several times per call."""
    strides = t.stride()
    if t.shape[-1] == 1:
        strides = strides[:-1] + (1,)
    if len(strides) == rank - 1:
        strides = (0,) + strides
    return strides


def tensor_view(t):
    """A (batch, seq, heads, dim) tensor — (total, heads, dim) in varlen mode — as an fa4_tensor
    (strides in elements). A head dim of one element has no meaningful stride: report 1."""
    return Tensor(_ptr(t), *_strides(t, 4))


def lse_view(t):
    """(batch, heads, seq) fp32, or (heads, total) in varlen mode."""
    return Lse(_ptr(t), *_strides(t, 3))


def descale_view(t):
    """An fp32 (batch, heads_kv) descale tensor, or None (a null pointer: descale 1)."""
    if t is None:
        return Descale(None, 0, 0)
    return Descale(_ptr(t), *t.stride())


# The per-call structs get their fa4_tensor / fa4_lse members packed in place, as the data pointer
# and the int64 strides: building each member as a ctypes Structure and assigning it (a copy)
# costs about three times as much, and a backward has nine of them.
_TENSOR_WORDS = struct.Struct("=Q4q")
_LSE_WORDS = struct.Struct("=Q3q")
assert _TENSOR_WORDS.size == ctypes.sizeof(Tensor) and _LSE_WORDS.size == ctypes.sizeof(Lse)


def _put(s, name, t, words, rank, view):
    strides = _strides(t, rank)
    if len(strides) == rank:
        words.pack_into(s, getattr(type(s), name).offset, _ptr(t) or 0, *strides)
    else:  # a tensor of another rank: assign the ctypes view (zeros, or ctypes' own error)
        setattr(s, name, view(t))


def _put_tensor(s, name, t):
    """s.<name> = tensor_view(t), written in place."""
    _put(s, name, t, _TENSOR_WORDS, 4, tensor_view)


def _put_lse(s, name, t):
    """s.<name> = lse_view(t), written in place."""
    _put(s, name, t, _LSE_WORDS, 3, lse_view)


_BACKEND_OF_TYPE = {"cuda": BACKEND_SM90, "cpu": BACKEND_CPU}


def backend_of(device):
    """The backend the tensors' device selects: cuda -> sm90, cpu -> cpu, anything else None."""
    if not isinstance(device, torch.device):  # a string or an index; t.device needs no parsing
        device = torch.device(device)
    return _BACKEND_OF_TYPE.get(device.type)


_NO_SCOPE = contextlib.nullcontext()  # reusable: CPU calls need no device made current


def _device_scope(device):
    """The CUDA device of the tensors made current for the call: the sm90 backend checks the current
    device (availability, memory ownership) and launches on it."""
    return torch.cuda.device(device) if device.type == "cuda" else _NO_SCOPE


# can_implement only needs to know that varlen mode is on (a non-null cu_seqlens pointer); it never
# reads the arrays, so shape-only queries (fake / meta tensors) point at this host word.
_VARLEN_MARKER = (ctypes.c_int32 * 1)()


class Library:
    """One loaded libfa4.so. Thread-safe: the library keeps its last error per thread and ctypes
    calls it with the GIL released."""

    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        lib = self.lib
        lib.fa4_last_error_message.restype = ctypes.c_char_p
        lib.fa4_version.restype = ctypes.c_char_p
        lib.fa4_status_string.restype = ctypes.c_char_p
        lib.fa4_status_string.argtypes = [ctypes.c_int]
        lib.fa4_abi_version.restype = ctypes.c_int
        lib.fa4_problem_init.argtypes = [ctypes.POINTER(Problem)]
        lib.fa4_forward_tensors_init.argtypes = [ctypes.POINTER(ForwardTensors)]
        lib.fa4_backward_tensors_init.argtypes = [ctypes.POINTER(BackwardTensors)]
        lib.fa4_overrides_init.argtypes = [ctypes.POINTER(Overrides)]
        lib.fa4_overrides_from_env.argtypes = [ctypes.POINTER(Overrides)]
        lib.fa4_can_implement.argtypes = [ctypes.POINTER(Problem), ctypes.c_int, ctypes.c_int]
        lib.fa4_workspace_size_with_overrides.argtypes = [
            ctypes.POINTER(Problem), ctypes.c_int, ctypes.c_int, ctypes.POINTER(Overrides),
            ctypes.POINTER(ctypes.c_size_t)]
        lib.fa4_forward_with_overrides.argtypes = [
            ctypes.POINTER(Problem), ctypes.POINTER(ForwardTensors), ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Overrides)]
        lib.fa4_backward_with_overrides.argtypes = [
            ctypes.POINTER(Problem), ctypes.POINTER(BackwardTensors), ctypes.c_void_p,
            ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(Overrides)]
        for fn in (lib.fa4_overrides_from_env, lib.fa4_can_implement,
                   lib.fa4_workspace_size_with_overrides, lib.fa4_forward_with_overrides,
                   lib.fa4_backward_with_overrides):
            fn.restype = ctypes.c_int
        if lib.fa4_abi_version() != ABI_VERSION:
            raise Fa4Error("libfa4 ABI version %d, this binding speaks %d"
                           % (lib.fa4_abi_version(), ABI_VERSION))
        # The fa4_*_init functions only write constants (struct_size and the defaults): run each
        # once and copy its result per call, which is cheaper than a foreign call.
        self._initialised = {}
        for cls, init in ((Problem, lib.fa4_problem_init),
                          (ForwardTensors, lib.fa4_forward_tensors_init),
                          (BackwardTensors, lib.fa4_backward_tensors_init),
                          (Overrides, lib.fa4_overrides_init)):
            self._initialised[cls] = self._init_checked(cls, init)
        # Passed to every call: None (a null pointer) leaves every choice to the library.
        self.overrides = None

    def _init_checked(self, cls, init):
        """cls as init fills it, once the library's struct is known to be this binding's: init
        writes sizeof(the library's struct), so it writes into room to spare first, and a library
        whose layout differs (a build of another revision with the same ABI version) is refused
        here instead of reading or writing past the binding's structs on every call."""
        room = ctypes.sizeof(cls) + 4096
        scratch = (ctypes.c_uint8 * room)()
        init(ctypes.cast(scratch, ctypes.POINTER(cls)))
        size = ctypes.c_uint32.from_buffer(scratch).value
        if size != ctypes.sizeof(cls):
            raise Fa4Error("libfa4 (%s) has a %d-byte %s, this binding a %d-byte one: the two come "
                           "from different revisions of ABI version %d; use the package and the "
                           "library of one build"
                           % (self.path, size, cls.__name__, ctypes.sizeof(cls), ABI_VERSION))
        return cls.from_buffer_copy(scratch, 0)

    def make_overrides(self, **fields):
        """An Overrides with the library's defaults and `fields` (e.g. splits=3, persistent=0)."""
        o = self._new(Overrides)
        for name, value in fields.items():
            if name == "struct_size" or name not in dict(Overrides._fields_):
                raise ValueError("fa4_overrides has no field %r" % name)
            setattr(o, name, int(value))
        return o

    def overrides_from_env(self):
        """The FA4_SM90_* / FA4_CPU_THREADS environment variables as an Overrides (the library's
        one environment reader); raises Fa4Error naming an invalid variable."""
        o = self._new(Overrides)
        self._check(self.lib.fa4_overrides_from_env(ctypes.byref(o)))
        return o

    def _overrides_arg(self, backend=None):
        """The overrides of a call; on the CPU backend with no thread count set, torch's intra-op
        thread count (torch.set_num_threads), as torch's own CPU ops use."""
        if backend == BACKEND_CPU and (self.overrides is None or self.overrides.cpu_threads == 0):
            o = self._new(Overrides) if self.overrides is None else Overrides.from_buffer_copy(
                self.overrides)
            o.cpu_threads = torch.get_num_threads()
            return ctypes.byref(o)
        return None if self.overrides is None else ctypes.byref(self.overrides)

    def _new(self, cls):
        """A fresh `cls` (Problem, ForwardTensors or BackwardTensors) as fa4_*_init fills it."""
        return cls.from_buffer_copy(self._initialised[cls])

    def version(self):
        return self.lib.fa4_version().decode()

    def _message(self, status):
        message = self.lib.fa4_last_error_message().decode()
        return message or self.lib.fa4_status_string(status).decode()

    def _check(self, status):
        if status != SUCCESS:
            raise Fa4Error(self._message(status), status)

    # -- problems --------------------------------------------------------------------------------

    def problem(self, q, k, v, params, *, pointers=True):
        """The fa4_problem of q/k/v (shapes and dtype) and params. pointers=False describes the
        problem without touching tensor memory (for can_implement on fake or meta tensors)."""
        p = self._new(Problem)
        q_shape, k_shape = q.shape, k.shape
        marker = ctypes.addressof(_VARLEN_MARKER)
        if params.varlen:
            p.batch = int(params.cu_seqlens_q.shape[0]) - 1
            p.seqlen_q, p.seqlen_k = int(params.max_seqlen_q), int(params.max_seqlen_k)
            p.total_q = int(q_shape[0])
            p.cu_seqlens_q = params.cu_seqlens_q.data_ptr() if pointers else marker
            if params.kv is None:
                p.total_k = int(k_shape[0])
                p.cu_seqlens_k = params.cu_seqlens_k.data_ptr() if pointers else marker
        else:
            p.batch, p.seqlen_q = int(q_shape[0]), int(q_shape[1])
            p.seqlen_k = int(k_shape[1])
        p.num_splits = int(params.num_splits)
        if params.kv is not None:
            self._put_kv_cache(p, k_shape, params.kv, pointers)
        p.heads_q, p.heads_kv = int(q_shape[-2]), int(k_shape[-2])
        p.head_dim_qk, p.head_dim_v = int(q_shape[-1]), int(v.shape[-1])
        p.dtype = DTYPES[q.dtype]
        p.causal = int(params.causal)
        p.window_left, p.window_right = params.window_left, params.window_right
        p.softcap = params.softcap
        p.softmax_scale = params.softmax_scale
        if params.seqused_k is not None:
            p.seqused_k = (params.seqused_k.data_ptr() if pointers
                           else ctypes.addressof(_VARLEN_MARKER))
        p.return_lse = 1
        p.deterministic = int(params.deterministic)
        if params.fp8 is not None:
            p.out_dtype = DTYPES[params.fp8.out_dtype]
            p.quantize_appends = int(params.fp8.quantize_appends)
        if params.alibi_slopes is not None or params.sinks is not None:
            self._put_variants(p, params, pointers)
        return p

    @staticmethod
    def _put_variants(p, params, pointers):
        """The score variants' fields of p: ALiBi's slopes and strides (a (heads_q,) tensor has
        batch stride 0), the sinks' pointer."""
        marker = ctypes.addressof(_VARLEN_MARKER)
        slopes = params.alibi_slopes
        if slopes is not None:
            p.alibi_slopes = slopes.data_ptr() if pointers else marker
            p.alibi_batch_stride = int(slopes.stride(0)) if slopes.dim() == 2 else 0
            p.alibi_head_stride = int(slopes.stride(-1))
        if params.sinks is not None:
            p.sinks = params.sinks.data_ptr() if pointers else marker

    @staticmethod
    def _put_kv_cache(p, k_shape, kv, pointers):
        """The KV-cache fields of p; k_shape is the cache's (rows or pages, keys, heads, dim)."""
        def address(t):
            if t is None:
                return None
            return t.data_ptr() if pointers else ctypes.addressof(_VARLEN_MARKER)
        p.cache_batch = int(k_shape[0])
        p.seqlen_k = int(k_shape[1])
        if kv.page_table is not None:
            pt = kv.page_table
            p.page_table = address(pt)
            p.page_table_stride = int(pt.stride(0)) if pt.shape[0] > 1 else int(pt.shape[1])
            p.pages_per_seq = int(pt.shape[1])
            p.num_pages, p.page_size = int(k_shape[0]), int(k_shape[1])
            p.cache_batch = int(pt.shape[0])
            p.seqlen_k = p.pages_per_seq * p.page_size
        p.cache_batch_idx = address(kv.cache_batch_idx)
        p.cache_leftpad = address(kv.cache_leftpad)
        p.seqlen_new, p.total_new = int(kv.seqlen_new), int(kv.total_new)
        p.cu_seqlens_new = address(kv.cu_seqlens_new)
        p.rotary_dim, p.rotary_seqlen = int(kv.rotary_dim), int(kv.rotary_seqlen)
        p.rotary_interleaved = int(kv.rotary_interleaved)

    def can_implement(self, pass_, q, k, v, params, backend):
        """(status, message) of fa4_can_implement for the problem of q/k/v; shapes only."""
        p = self.problem(q, k, v, params, pointers=False)
        with _device_scope(q.device):
            status = self.lib.fa4_can_implement(ctypes.byref(p), backend, pass_)
        return status, ("" if status == SUCCESS else self._message(status))

    def _workspace(self, p, backend, pass_, device):
        nbytes = ctypes.c_size_t(0)
        self._check(self.lib.fa4_workspace_size_with_overrides(
            ctypes.byref(p), backend, pass_, self._overrides_arg(backend), ctypes.byref(nbytes)))
        if nbytes.value == 0:
            return None, None, 0
        # Over-allocate so that an aligned start exists whatever alignment the allocator gives.
        buf = torch.empty(nbytes.value + WORKSPACE_ALIGNMENT, dtype=torch.uint8, device=device)
        start = -buf.data_ptr() % WORKSPACE_ALIGNMENT
        return buf, buf.data_ptr() + start, nbytes.value

    @staticmethod
    def _stream(device):
        if device.type != "cuda":
            return None
        return torch.cuda.current_stream(device).cuda_stream

    def _forward_tensors(self, q, k, v, out, lse, k_new=None, v_new=None, rotary=None, fp8=None):
        """rotary: (cos, sin) of a KV cache's rotary embedding, or None; fp8: params.fp8, whose
        descales go into the struct here so that every forward path (the call and its closure)
        passes them."""
        t = self._new(ForwardTensors)
        for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
            _put_tensor(t, name, x)
        if lse is not None:
            _put_lse(t, "lse", lse)
        if k_new is not None:
            _put_tensor(t, "k_new", k_new)
            _put_tensor(t, "v_new", v_new)
        if rotary is not None:
            cos, sin = rotary
            t.rotary_cos, t.rotary_sin = cos.data_ptr(), sin.data_ptr()
            t.rotary_stride = int(cos.stride(0))
        if fp8 is not None:
            t.q_descale = descale_view(fp8.q_descale)
            t.k_descale = descale_view(fp8.k_descale)
            t.v_descale = descale_view(fp8.v_descale)
        return t

    def _backward_tensors(self, dout, q, k, v, out, lse, dq, dk, dv):
        t = self._new(BackwardTensors)
        for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
            _put_tensor(t, name, x)
        _put_lse(t, "lse", lse)
        for name, x in (("dq", dq), ("dk", dk), ("dv", dv)):
            _put_tensor(t, name, x)
        return t

    def forward(self, q, k, v, out, lse, params, k_new=None, v_new=None, rotary=None):
        """Runs the forward on the backend of q's device, on torch's current stream; raises
        Fa4Error with the library's message. out and lse are written (and, with a KV cache's
        appends, k and v). FP8 inputs take their output dtype and descales from params.fp8."""
        device = q.device  # each .device builds a new torch.device
        backend = backend_of(device)
        if backend is None:
            raise Fa4Error("fa4cpp runs on cpu or cuda tensors, not %s" % device.type)
        p = self.problem(q, k, v, params)
        t = self._forward_tensors(q, k, v, out, lse, k_new, v_new, rotary, params.fp8)
        with _device_scope(device):
            buf, ws, nbytes = self._workspace(p, backend, PASS_FORWARD, device)
            self._check(self.lib.fa4_forward_with_overrides(
                ctypes.byref(p), ctypes.byref(t), ws, nbytes, self._stream(device), backend,
                self._overrides_arg(backend)))
        del buf  # the caching allocator keeps it valid for work already queued on this stream

    def backward(self, dout, q, k, v, out, lse, dq, dk, dv, params, dsinks=None):
        """Runs the backward like forward(); dq, dk and dv are written, and dsinks (fp32
        (heads_q,), contiguous; a problem with sinks only) when given."""
        device = q.device
        backend = backend_of(device)
        if backend is None:
            raise Fa4Error("fa4cpp runs on cpu or cuda tensors, not %s" % device.type)
        p = self.problem(q, k, v, params)
        t = self._backward_tensors(dout, q, k, v, out, lse, dq, dk, dv)
        if dsinks is not None:
            t.dsinks = dsinks.data_ptr()
        with _device_scope(device):
            buf, ws, nbytes = self._workspace(p, backend, PASS_BACKWARD, device)
            self._check(self.lib.fa4_backward_with_overrides(
                ctypes.byref(p), ctypes.byref(t), ws, nbytes, self._stream(device), backend,
                self._overrides_arg(backend)))
        del buf

    # -- bench/sweep.py's entry point ------------------------------------------------------------

    def forward_fn(self, q, k, v, out, lse=None, causal=False, window=(-1, -1), softcap=0.0,
                   params=None):
        """A closure that runs the sm90 forward on the current stream; raises Fa4Error (with the
        library's message) when the problem is refused. Workspace is allocated here, once.
        params (a Params, e.g. a varlen batch's) replaces causal, window and softcap."""
        if params is None:
            params = Params(causal=causal, window_left=window[0], window_right=window[1],
                            softcap=softcap)
        p = self.problem(q, k, v, params)
        p.return_lse = int(lse is not None)
        t = self._forward_tensors(q, k, v, out, lse, fp8=params.fp8)
        buf, ws, nbytes = self._workspace(p, BACKEND_SM90, PASS_FORWARD, q.device)
        overrides = self._overrides_arg()

        def run():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self._check(self.lib.fa4_forward_with_overrides(
                ctypes.byref(p), ctypes.byref(t), ws, nbytes, stream, BACKEND_SM90, overrides))
        # The workspace and the params' tensors (sinks, slopes, ...) live as long as the closure.
        run.workspace, run.params = buf, params
        return run

    def backward_fn(self, dout, q, k, v, out, lse, dq, dk, dv, causal=False, deterministic=False,
                    params=None, dsinks=None):
        """The backward's closure, like forward_fn (out and lse as the forward wrote them); params
        replaces causal and deterministic, and dsinks (a problem with sinks) receives d(sinks)."""
        if params is None:
            params = Params(causal=causal, deterministic=deterministic)
        p = self.problem(q, k, v, params)
        t = self._backward_tensors(dout, q, k, v, out, lse, dq, dk, dv)
        if dsinks is not None:
            t.dsinks = dsinks.data_ptr()
        buf, ws, nbytes = self._workspace(p, BACKEND_SM90, PASS_BACKWARD, q.device)
        overrides = self._overrides_arg()

        def run():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self._check(self.lib.fa4_backward_with_overrides(
                ctypes.byref(p), ctypes.byref(t), ws, nbytes, stream, BACKEND_SM90, overrides))
        run.workspace, run.params, run.dsinks = buf, params, dsinks
        return run
