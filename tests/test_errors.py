"""Bad input: a clear TypeError or ValueError, never a crash or a silent result."""
import numpy as np
import pytest

import fastattn

f32 = np.zeros((2, 3, 4, 8), np.float32)
f64 = np.zeros((2, 3, 4, 8), np.float64)
sdpa = fastattn.scaled_dot_product_attention

BAD_SDPA = [  # (args, kwargs, exception, message fragment)
    (([[1.0]], f32, f32), {}, TypeError, "query must be a numpy.ndarray, got list"),
    ((f32, 1.0, f32), {}, TypeError, "key must be a numpy.ndarray, got float"),
    ((f32, f32, f64), {}, TypeError, "dtypes differ (query float32, key float32, value float64)"),
    ((f32.astype(np.int32),) * 3, {}, TypeError, "query has dtype int32"),
    ((f32.astype(np.complex64),) * 3, {}, TypeError, "query has dtype complex64"),
    ((f32.astype(np.float16),) * 3, {}, TypeError, "query has dtype float16"),
    ((f32.astype(object),) * 3, {}, TypeError, "query has dtype object"),
    ((f32.astype(">f4"),) * 3, {}, TypeError, "query has dtype >f4"),
    ((np.zeros(3, np.float32),) * 3, {}, ValueError, "query must have at least 2 dimensions"),
    ((f32, f32[..., :5], f32), {}, ValueError, "key's last axis (5) must equal query's last axis E (8)"),
    ((f32, f32, f32[..., :3, :]), {}, ValueError, "value must have as many rows as key (S = 4), got 3"),
    ((f32, np.zeros((5, 3, 4, 8), np.float32), f32), {}, ValueError, "do not broadcast"),
    ((f32, f32[:, :2], f32[:, :2]), {}, ValueError, "set enable_gqa=True"),
    ((f32, f32[:, :2], f32[:, :2]), {"enable_gqa": True}, ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    ((f32, f32, f32), {"attn_mask": np.zeros((4, 4), np.int64)}, TypeError,
     "attn_mask has dtype int64; expected bool"),
    ((f32, f32, f32), {"attn_mask": [[True]]}, TypeError, "attn_mask must be a numpy.ndarray"),
    ((f32, f32[:, :, :3], f32[:, :, :3]), {"attn_mask": np.ones((3, 4), bool)}, ValueError,
     "attn_mask of shape (3, 4) cannot be broadcast to (..., Hq, L, S) = (2, 3, 4, 3)"),
    ((f32, f32, f32), {"dropout_p": 0.1}, ValueError, "dropout_p must be 0"),
    ((f32, f32, f32), {"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
    ((f32, f32, f32), {"scale": "1"}, TypeError, "scale must be a real number, got str"),
    ((f32, f32, f32), {"scale": float("nan")}, ValueError, "scale must be finite, got nan"),
    ((f32, f32, f32), {"scale": True}, TypeError, "scale must be a real number, got bool"),
    ((f32, f32, f32), {"causal_alignment": "bottom"}, ValueError, "causal_alignment must be"),
    ((f32, f32, f32), {"num_threads": 0}, ValueError, "num_threads must be >= 1 and <= "),
    ((f32, f32, f32), {"num_threads": -3}, ValueError, "got -3"),
    ((f32, f32, f32), {"num_threads": 2.0}, TypeError, "num_threads must be an int, got float"),
    ((f32, f32, f32), {"num_threads": float("nan")}, TypeError, "num_threads must be an int"),
    ((f32, f32, f32), {"out": np.zeros((2, 3, 4, 8), np.float64)}, TypeError,
     "out has dtype float64; expected float32"),
    ((f32, f32, f32), {"out": np.zeros((2, 3, 4, 7), np.float32)}, ValueError,
     "out has shape (2, 3, 4, 7); expected (2, 3, 4, 8)"),
    ((f32, f32, f32), {"out": f32}, ValueError, "out overlaps query"),
]


@pytest.mark.parametrize("args,kwargs,exc,msg", BAD_SDPA, ids=[c[3][:40] for c in BAD_SDPA])
def test_sdpa_errors(args, kwargs, exc, msg):
    before = [a.copy() for a in args if isinstance(a, np.ndarray)]
    with pytest.raises(exc) as info:
        sdpa(*args, **kwargs)
    assert msg in str(info.value)
    for a, b in zip([a for a in args if isinstance(a, np.ndarray)], before):
        np.testing.assert_array_equal(a, b)


def test_read_only_out():
    out = np.zeros_like(f32)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out is read-only"):
        sdpa(f32, f32, f32, out=out)


BAD_OPS = [
    (fastattn.matmul, (f32, [[1.0]]), {}, TypeError, "b must be a numpy.ndarray"),
    (fastattn.matmul, (f32, f64), {}, TypeError, "dtypes differ"),
    (fastattn.matmul, (f32, f32), {}, ValueError, "inner sizes differ"),
    (fastattn.matmul, (np.zeros(3, np.float32), f32), {}, ValueError, "at least 2 dimensions"),
    (fastattn.softmax, (f32,), {"axis": 4}, np.exceptions.AxisError, "axis 4 is out of bounds"),
    (fastattn.softmax, (f32,), {"axis": 1.5}, TypeError, "axis must be an int"),
    (fastattn.softmax, (f32,), {"mask": np.ones((5,), bool)}, ValueError, "cannot be broadcast"),
    (fastattn.softmax, (f32,), {"mask": np.ones((8,), np.int8)}, TypeError, "mask has dtype int8"),
    (fastattn.softmax, (f32.astype(np.int64),), {}, TypeError, "x has dtype int64"),
    (fastattn.split_heads, (f32, 3), {}, ValueError, "not divisible by num_heads (3)"),
    (fastattn.split_heads, (f32, 0), {}, ValueError, "num_heads must be >= 1"),
    (fastattn.split_heads, (f32, 2.0), {}, TypeError, "num_heads must be an int"),
    (fastattn.merge_heads, (np.zeros((3, 4), np.float32),), {}, ValueError, "at least 3 dimensions"),
    (fastattn.merge_heads, (f32.astype(np.int16),), {}, TypeError, "x has dtype int16"),
    (fastattn.set_num_threads, (0,), {}, ValueError, "n must be >= 1"),
    (fastattn.set_simd_path, ("sse9",), {}, ValueError, "unknown SIMD path 'sse9'"),
]


@pytest.mark.parametrize("fn,args,kwargs,exc,msg", BAD_OPS, ids=[c[4][:40] for c in BAD_OPS])
def test_ops_errors(fn, args, kwargs, exc, msg):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert msg in str(info.value)
