"""The native ops (libfa4_torch.so: torch.ops.fa4cpp.* registered from C++): they load beside the
library under the torch they were built for, give the Python implementation's results bit for bit,
never enter Python on a call they run, hand every other call (bad input, a refusal, a mode) to the
Python implementation for its error or fallback, bump the KV cache's version counters, and work
in a process that never imports the package."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fa4cpp
from fa4cpp import Fa4Error, _library, ops
from test_kvcache import _case

NATIVE, DETAIL = ops.native_ops()
BUILT = os.path.isfile(os.path.join(os.path.dirname(_library.library_path()),
                                    _library.NATIVE_NAME))
needs_native = pytest.mark.skipif(not NATIVE, reason="native ops not loaded: %s" % DETAIL)


def test_native_ops_load_where_built():
    # A build with the native ops (any build with the Python test environment) must load them.
    assert NATIVE == BUILT, DETAIL


def _qkv(dtype=torch.bfloat16, b=2, sq=37, sk=45, hq=4, hkv=2, d=64, grad=False):
    return [torch.randn(b, s, h, d, dtype=dtype).requires_grad_(grad)
            for s, h in ((sq, hq), (sk, hkv), (sk, hkv))]


def _varlen(dtype=torch.float32):
    lens_q, lens_k = [5, 0, 17, 9], [7, 3, 17, 30]
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 32, dtype=dtype)
    k, v = (torch.randn(sum(lens_k), 2, 32, dtype=dtype) for _ in range(2))
    used = torch.tensor([7, 2, 17, 25], dtype=torch.int32)
    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), used


def _both_paths(call):
    """call() on the native path and on the Python implementation."""
    native = call()
    with ops.python_path():
        python = call()
    return native, python


def _assert_identical(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
        assert torch.equal(x, y)


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (9, 3), 5.0)])
def test_fixed_length_paths_agree(dtype, causal, window, softcap):
    q, k, v = _qkv(dtype)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # strided: (b, h, s, d) memory
    args = (0.1, causal, window[0], window[1], softcap, True)
    native, python = _both_paths(lambda: torch.ops.fa4cpp.fwd(q, k, v, *args))
    _assert_identical(native, python)
    out, lse = native
    dout = torch.randn_like(out)
    _assert_identical(*_both_paths(lambda: torch.ops.fa4cpp.bwd(dout, q, k, v, out, lse, *args)))


@needs_native
def test_varlen_paths_agree():
    q, k, v, cu_q, cu_k, max_q, max_k, used = _varlen()
    args = (q, k, v, cu_q, cu_k, max_q, max_k, used, 0.0, True, -1, -1, 0.0, False)
    native, python = _both_paths(lambda: torch.ops.fa4cpp.varlen_fwd(*args))
    _assert_identical(native, python)
    out, lse = native
    dout = torch.randn_like(out)
    grads = _both_paths(lambda: torch.ops.fa4cpp.varlen_bwd(
        dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, used, 0.0, True, -1, -1, 0.0, True))
    _assert_identical(*grads)


@needs_native
@pytest.mark.parametrize("case", [dict(page_size=7, append=2, batch_idx=True, leftpad=True,
                                       rotary="gptj_full"),
                                  dict(page_size=16, append=5, varlen_new=True, varlen_q=True,
                                       sq=5, rotary="neox_half")])
def test_kvcache_paths_agree(case):
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(21, **case)
    caches = {}

    def call():
        k, v = k_cache.clone(), v_cache.clone()
        caches[len(caches)] = (k, v)
        return fa4cpp.flash_attn_with_kvcache(q, k, v, cache_seqlens=cache_seqlens, causal=True,
                                              return_softmax_lse=True, **args)
    _assert_identical(*_both_paths(call))
    _assert_identical(caches[0], caches[1])


@needs_native
def test_native_calls_do_not_enter_python(monkeypatch):
    def python_called(*args, **kwargs):
        raise AssertionError("the Python implementation ran")
    for name in ("_forward", "_backward", "_forward_kvcache"):
        monkeypatch.setattr(ops, name, python_called)
    q, k, v = _qkv(torch.float32, grad=True)
    out = fa4cpp.flash_attn_func(q, k, v, causal=True)
    assert type(out.grad_fn).__name__ == "CppFunction"
    out.backward(torch.randn_like(out))
    assert all(t.grad is not None for t in (q, k, v))
    vq, vk, vv, cu_q, cu_k, max_q, max_k, used = _varlen()
    vq.requires_grad_()
    fa4cpp.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, max_q, max_k, seqused_k=used).sum() \
        .backward()
    assert vq.grad is not None
    kq, k_cache, v_cache, cache_seqlens, args, _, _ = _case(22, page_size=16, append=1, sq=1)
    fa4cpp.flash_attn_with_kvcache(kq, k_cache, v_cache, cache_seqlens=cache_seqlens, **args)


@needs_native
def test_modes_send_native_calls_to_python(monkeypatch):
    seen = []
    real = ops._forward
    monkeypatch.setattr(ops, "_forward", lambda *a, **kw: seen.append(1) or real(*a, **kw))
    q, k, v = _qkv(torch.float32)
    fa4cpp.flash_attn_func(q, k, v)
    assert seen == []
    with fa4cpp.mode(verify=1.0):
        fa4cpp.flash_attn_func(q, k, v)
    assert seen == [1]
    with fa4cpp.mode(fallback=True):
        fa4cpp.flash_attn_func(q, k, v)
    assert seen == [1, 1]
    fa4cpp.flash_attn_func(q, k, v)
    assert seen == [1, 1]


BAD_CALLS = {
    "window": lambda q, k, v: torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -2, -1, 0.0),
    "softcap": lambda q, k, v: torch.ops.fa4cpp.fwd(q, k, v, 0.0, False, -1, -1, -1.0),
    "scale": lambda q, k, v: torch.ops.fa4cpp.fwd(q, k, v, 1e-60, False, -1, -1, 0.0),
    "dtypes": lambda q, k, v: torch.ops.fa4cpp.fwd(q, k.half(), v, 0.0, False, -1, -1, 0.0),
    "heads": lambda q, k, v: torch.ops.fa4cpp.fwd(q[:, :, :3], k, v, 0.0, False, -1, -1, 0.0),
    "rank": lambda q, k, v: torch.ops.fa4cpp.fwd(q[0], k[0], v[0], 0.0, False, -1, -1, 0.0),
    "batch": lambda q, k, v: torch.ops.fa4cpp.fwd(q[:1], k, v, 0.0, False, -1, -1, 0.0),
    "float64": lambda q, k, v: torch.ops.fa4cpp.fwd(q.double(), k.double(), v.double(), 0.0,
                                                    False, -1, -1, 0.0),
    "lse": lambda q, k, v: torch.ops.fa4cpp.bwd(q, q, k, v, q, torch.zeros(1), 0.0, False, -1,
                                                -1, 0.0, False),
}


@needs_native
@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_calls_raise_the_python_implementations_error(name):
    q, k, v = _qkv(torch.float32)
    errors = []
    for python in (False, True):
        with ops.python_path() if python else _nothing():
            with pytest.raises((ValueError, Fa4Error)) as info:
                BAD_CALLS[name](q, k, v)
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_native
def test_refused_kvcache_call_writes_nothing():
    """The library refuses (a page past the last): the native op writes nothing and the Python
    implementation raises the library's error."""
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(23, page_size=16, append=3)
    args["page_table"][0, 0] = k_cache.shape[0]
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(Fa4Error, match="page_table"):
        fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **args)
    _assert_identical((k_cache, v_cache), before)


@needs_native
def test_kvcache_op_bumps_the_cache_versions():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(24, append=1, sq=1)
    versions = k_cache._version, v_cache._version
    fa4cpp.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, **args)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]


def _run(code, **env):
    environ = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(fa4cpp.__file__)),
                   **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                          capture_output=True, text=True, timeout=300)


@needs_native
def test_other_torch_version_runs_the_python_implementation(tmp_path):
    folder = os.path.dirname(_library.library_path())
    for name in ("libfa4.so", _library.NATIVE_NAME):
        os.symlink(os.path.join(folder, name), tmp_path / name)
    (tmp_path / _library.NATIVE_VERSION_NAME).write_text("1.0.0\n")
    result = _run("""
        import torch, fa4cpp
        print(fa4cpp.ops.native_ops())
        q = torch.randn(1, 5, 2, 16)
        print(fa4cpp.flash_attn_func(q, q, q).shape)
    """, FA4CPP_LIBRARY=str(tmp_path / "libfa4.so"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(False" in result.stdout and "built against torch 1.0.0" in result.stdout
    assert "torch.Size([1, 5, 2, 16])" in result.stdout


@needs_native
def test_native_ops_without_the_package():
    """A process that loads the ops without importing fa4cpp: calls run; one the native path does
    not run says why, and that the package reports and falls back."""
    result = _run("""
        import torch
        torch.ops.load_library(%r)
        q = torch.randn(1, 5, 2, 16)
        out, lse = torch.ops.fa4cpp.fwd(q, q, q, 0.0, True, -1, -1, 0.0)
        print(out.shape, lse.shape)
        try:
            torch.ops.fa4cpp.fwd(q, q, q, 0.0, True, -2, -1, 0.0)
        except RuntimeError as e:
            print("raised:", e)
    """ % DETAIL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "torch.Size([1, 5, 2, 16]) torch.Size([1, 2, 5])" in result.stdout
    assert "raised: fa4cpp: window sides must be >= 0" in result.stdout
    assert "import fa4cpp" in result.stdout


def _vllm_call(q, k_cache, v_cache, cache_seqlens, args, out):
    return fa4cpp.flash_attn_varlen_func(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=None,
        max_seqlen_q=4, max_seqlen_k=80, seqused_k=cache_seqlens, causal=True,
        block_table=args["page_table"], out=out, return_softmax_lse=True)


@pytest.mark.parametrize("layout", ["rows of a larger buffer", "last dimension strided"])
def test_vllm_out_is_written_in_place(monkeypatch, layout):
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(
        25, page_size=16, varlen_q=True, sq=4, capacity=80)
    want, want_lse = _vllm_call(q, k_cache, v_cache, cache_seqlens, args, None)
    if layout == "rows of a larger buffer":  # vLLM's output[:num_actual_tokens]
        buffer = torch.full((q.shape[0] + 5,) + tuple(want.shape[1:]), float("nan"))
        out = buffer[:q.shape[0]]
    else:
        buffer = torch.full(tuple(want.shape[:-1]) + (2 * want.shape[-1],), float("nan"))
        out = buffer[..., ::2]
    if NATIVE and layout == "rows of a larger buffer" and not _library._python_path_asked:
        monkeypatch.setattr(ops, "_forward_kvcache",
                            lambda *a, **kw: pytest.fail("the Python implementation ran"))
    result, lse = _vllm_call(q, k_cache, v_cache, cache_seqlens, args, out)
    assert result is out
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    if layout == "rows of a larger buffer":
        assert torch.isnan(buffer[q.shape[0]:]).all()  # nothing written past out


def test_out_of_the_wrong_shape_raises():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(
        26, page_size=16, varlen_q=True, sq=4, capacity=80)
    out = torch.empty(q.shape[0] + 1, q.shape[1], v_cache.shape[-1])
    with pytest.raises(ValueError, match="out must be"):
        _vllm_call(q, k_cache, v_cache, cache_seqlens, args, out)


def test_kvcache_ops_pass_opcheck():
    q, k_cache, v_cache, cache_seqlens, args, _, _ = _case(27, page_size=16, append=2, sq=2,
                                                           rotary="neox_full")
    common = (q, k_cache, v_cache, args["k"], args["v"], args["rotary_cos"], args["rotary_sin"],
              cache_seqlens, None, None, args["page_table"], None, None, 0, 0.0, True, -1, -1,
              0.0, False, 0)
    torch.library.opcheck(torch.ops.fa4cpp.fwd_kvcache.default, common)
    out = torch.empty(q.shape[:-1] + v_cache.shape[-1:])
    torch.library.opcheck(torch.ops.fa4cpp.fwd_kvcache_out.default, common + (out,))


@needs_native
def test_native_schemas_match_the_package():
    """Import checks every native op against the package's (a stale libfa4_torch.so would pass
    the Python implementation the wrong arguments); the check tells two different ops apart."""
    for op in ops._OPS:
        native = getattr(torch.ops.fa4cpp, op).default._schema
        assert ops.schema_mismatch(native, getattr(torch.ops.fa4cpp, op + "_py").default._schema) \
            is None, op
    why = ops.schema_mismatch(torch.ops.fa4cpp.fwd.default._schema,
                              torch.ops.fa4cpp.bwd_py.default._schema)
    assert why is not None and "dout" in why
