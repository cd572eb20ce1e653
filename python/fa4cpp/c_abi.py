"""A thin ctypes binding of fa4cpp's C ABI (include/fa4/fa4.h) over torch tensors (used by
bench/sweep.py; the PyTorch package will grow around it): no copies, work enqueued on torch's
current CUDA stream. The struct layouts here must
match fa4.h (FA4_ABI_VERSION 1); fa4_*_init fills struct_size and the defaults."""
import ctypes

import torch

ABI_VERSION = 1
BACKEND_SM90 = 2
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


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
    ]


class Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("seq_stride", ctypes.c_int64), ("head_stride", ctypes.c_int64),
                ("dim_stride", ctypes.c_int64)]


class Lse(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("batch_stride", ctypes.c_int64),
                ("head_stride", ctypes.c_int64), ("seq_stride", ctypes.c_int64)]


class ForwardTensors(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_uint32), ("q", Tensor), ("k", Tensor), ("v", Tensor),
                ("out", Tensor), ("lse", Lse)]


def _view(t):
    """A (batch, seq, heads, dim) tensor as an fa4_tensor (strides in elements)."""
    return Tensor(t.data_ptr(), *t.stride())


class Fa4Error(RuntimeError):
    pass


class Library:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.fa4_last_error_message.restype = ctypes.c_char_p
        self.lib.fa4_version.restype = ctypes.c_char_p
        self.lib.fa4_forward.argtypes = [ctypes.POINTER(Problem), ctypes.POINTER(ForwardTensors),
                                         ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                         ctypes.c_int]
        self.lib.fa4_workspace_size.argtypes = [ctypes.POINTER(Problem), ctypes.c_int,
                                                ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
        if self.lib.fa4_abi_version() != ABI_VERSION:
            raise Fa4Error("libfa4 ABI version %d, this binding speaks %d"
                           % (self.lib.fa4_abi_version(), ABI_VERSION))

    def version(self):
        return self.lib.fa4_version().decode()

    def _check(self, status):
        if status != 0:
            raise Fa4Error(self.lib.fa4_last_error_message().decode())

    def forward_fn(self, q, k, v, out, lse=None, causal=False, window=(-1, -1), softcap=0.0):
        """A closure that runs the forward on the current stream; raises Fa4Error (with the
        library's message) when the problem is refused. Workspace is allocated here, once."""
        p = Problem()
        self.lib.fa4_problem_init(ctypes.byref(p))
        p.batch, p.seqlen_q, p.heads_q, p.head_dim_qk = q.shape
        p.seqlen_k, p.heads_kv = k.shape[1], k.shape[2]
        p.head_dim_v = v.shape[3]
        p.dtype = DTYPES[q.dtype]
        p.causal = int(causal)
        p.window_left, p.window_right = window
        p.softcap = softcap
        p.return_lse = int(lse is not None)
        t = ForwardTensors()
        self.lib.fa4_forward_tensors_init(ctypes.byref(t))
        t.q, t.k, t.v, t.out = _view(q), _view(k), _view(v), _view(out)
        if lse is not None:
            t.lse = Lse(lse.data_ptr(), *lse.stride())
        nbytes = ctypes.c_size_t(0)
        self._check(self.lib.fa4_workspace_size(ctypes.byref(p), BACKEND_SM90, 0,
                                                ctypes.byref(nbytes)))
        ws = torch.empty(max(nbytes.value, 1), dtype=torch.uint8, device=q.device)

        def run():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self._check(self.lib.fa4_forward(ctypes.byref(p), ctypes.byref(t), ws.data_ptr(),
                                             nbytes.value, stream, BACKEND_SM90))
        return run
