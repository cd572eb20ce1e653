"""c_abi's per-call structs. Their fa4_tensor / fa4_lse members are packed in place (a cheaper path
than assigning ctypes views); the bytes must be those of the plain ctypes construction: the
fa4_*_init defaults, then tensor_view() / lse_view() assigned member by member."""
import ctypes
import types

import pytest
import torch

from fa4cpp import _library, c_abi


def _tensors():
    x = torch.randn(2, 5, 4, 8)
    return [
        x,                                               # contiguous
        x.transpose(1, 2).contiguous().transpose(1, 2),  # heads outermost
        x[..., :3],                                      # strided rows
        torch.randn(3, 7, 2, 1),                         # head dim 1: its stride reads 1
        torch.randn(2, 0, 4, 8),                         # empty: null data pointer
        torch.randn(9, 4, 8),                            # varlen (total, heads, dim)
        torch.randn(5, 1, 1),
    ]


def _lses():
    return [torch.randn(2, 4, 5), torch.randn(4, 9), torch.randn(1, 1, 1),
            torch.randn(2, 3, 0), torch.randn(3, 1)]


def _plain(cls, init, **members):
    s = cls()
    init(ctypes.byref(s))
    for name, t in members.items():
        if t is not None:
            setattr(s, name, (c_abi.lse_view if name == "lse" else c_abi.tensor_view)(t))
    return bytes(s)


@pytest.mark.parametrize("lse_index", range(len(_lses()) + 1))
def test_packed_structs_equal_ctypes_views(lse_index):
    lib = _library.library()
    lse = (_lses() + [None])[lse_index]
    for t in _tensors():
        got = lib._forward_tensors(t, t, t, t, lse)
        want = _plain(c_abi.ForwardTensors, lib.lib.fa4_forward_tensors_init,
                      q=t, k=t, v=t, out=t, lse=lse)
        assert bytes(got) == want
        if lse is None:
            continue
        got = lib._backward_tensors(t, t, t, t, t, lse, t, t, t)
        want = _plain(c_abi.BackwardTensors, lib.lib.fa4_backward_tensors_init,
                      q=t, k=t, v=t, out=t, dout=t, lse=lse, dq=t, dk=t, dv=t)
        assert bytes(got) == want


def test_other_ranks_behave_as_ctypes_views():
    lib = _library.library()
    x = torch.randn(3, 4)  # too few strides: the view's missing fields stay 0
    assert bytes(lib._forward_tensors(x, x, x, x, None)) == _plain(
        c_abi.ForwardTensors, lib.lib.fa4_forward_tensors_init, q=x, k=x, v=x, out=x)
    with pytest.raises(TypeError):  # too many: ctypes' own error
        lib._forward_tensors(*[torch.randn(1, 2, 3, 4, 5)] * 4, None)


def test_overrides_struct_matches_the_library():
    lib = _library.library()
    o = lib.make_overrides()
    assert o.struct_size == ctypes.sizeof(c_abi.Overrides)
    assert (o.persistent, o.pack_gqa, o.splits, o.cpu_threads) == (-1, -1, 0, 0)
    assert lib.make_overrides(splits=3, bwd_pairs=0).splits == 3
    with pytest.raises(ValueError):
        lib.make_overrides(no_such_field=1)


def test_overrides_from_env(monkeypatch):
    lib = _library.library()
    monkeypatch.setenv("FA4_SM90_TILE_ORDER", "input")
    monkeypatch.setenv("FA4_CPU_THREADS", "2")
    o = lib.overrides_from_env()
    assert (o.longest_first, o.cpu_threads, o.persistent) == (0, 2, -1)
    monkeypatch.setenv("FA4_SM90_BWD_PAIRS", "sometimes")
    with pytest.raises(c_abi.Fa4Error, match="FA4_SM90_BWD_PAIRS"):
        lib.overrides_from_env()


def test_calls_pass_the_overrides():
    """A forward on one CPU thread gives the default's result; an invalid override is refused
    with the library's message, before anything is written."""
    lib = c_abi.Library(_library.library_path())  # its own overrides, the package's untouched
    q, k, v = (torch.randn(2, 37, 4, 16) for _ in range(3))
    out, lse = torch.empty_like(q), torch.empty(2, 4, 37)
    lib.forward(q, k, v, out, lse, c_abi.Params(causal=True))
    lib.overrides = lib.make_overrides(cpu_threads=1)
    out1, lse1 = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
    lib.forward(q, k, v, out1, lse1, c_abi.Params(causal=True))
    assert torch.equal(out1, out) and torch.equal(lse1, lse)
    lib.overrides = lib.make_overrides(splits=-1)
    out2 = torch.full_like(q, float("nan"))
    with pytest.raises(c_abi.Fa4Error, match="splits"):
        lib.forward(q, k, v, out2, lse1, c_abi.Params(causal=True))
    assert torch.isnan(out2).all()


def test_struct_layouts_match_the_library():
    """fa4_*_init writes sizeof(the C struct) into struct_size: the ctypes layouts must be as large,
    or the library would write past them."""
    lib = _library.library()
    for cls, init in ((c_abi.Problem, lib.lib.fa4_problem_init),
                      (c_abi.ForwardTensors, lib.lib.fa4_forward_tensors_init),
                      (c_abi.BackwardTensors, lib.lib.fa4_backward_tensors_init),
                      (c_abi.Overrides, lib.lib.fa4_overrides_init)):
        s = cls()
        init(ctypes.byref(s))
        assert s.struct_size == ctypes.sizeof(cls), cls.__name__


def test_forward_closure_passes_the_descales(monkeypatch):
    """forward_fn (bench/fp8.py times e4m3 through it) hands the library the same descales as
    forward(): their pointers and strides, a transposed one's strides as it lies, None as null."""
    lib = c_abi.Library(_library.library_path())
    seen = []

    def fake_forward(problem, tensors, *args):
        seen.append(c_abi.ForwardTensors.from_buffer_copy(tensors._obj))
        return c_abi.SUCCESS
    monkeypatch.setattr(lib, "_workspace", lambda *args: (None, None, 0))
    monkeypatch.setattr(lib.lib, "fa4_forward_with_overrides", fake_forward)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: types.SimpleNamespace(cuda_stream=0))
    q, k, v = (torch.randn(3, 5, 4, 16).to(torch.float8_e4m3fn) for _ in range(3))
    out, lse = torch.empty(3, 5, 4, 16, dtype=torch.bfloat16), torch.empty(3, 4, 5)
    qd, kd = torch.rand(3, 4) + 0.5, (torch.rand(4, 3) + 0.5).t()
    fp8 = c_abi.Fp8(q_descale=qd, k_descale=kd, v_descale=None)
    lib.forward_fn(q, k, v, out, lse, params=c_abi.Params(causal=True, fp8=fp8))()
    lib.forward(q, k, v, out, lse, c_abi.Params(causal=True, fp8=fp8))
    assert len(seen) == 2
    for t in seen:
        assert (t.q_descale.data, t.q_descale.batch_stride, t.q_descale.head_stride) == \
            (qd.data_ptr(), 4, 1)
        assert (t.k_descale.data, t.k_descale.batch_stride, t.k_descale.head_stride) == \
            (kd.data_ptr(), 1, 3)
        assert t.v_descale.data is None
