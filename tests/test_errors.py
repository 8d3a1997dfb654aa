"""Hostile input: one table of bad calls, each with the exception it must
raise and a fragment of its message.  Never a crash, a hang, a silent
result or a change to the caller's arrays (checked for every row)."""
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import fastattn
from fastattn import _core

try:
    import torch
except ImportError:  # the rows that pass torch tensors are left out
    torch = None

f32 = np.zeros((2, 3, 4, 8), np.float32)
f64 = np.zeros((2, 3, 4, 8), np.float64)
sdpa = fastattn.scaled_dot_product_attention
bcast = np.broadcast_to


def z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def misaligned(shape, dtype=np.float32):
    """A C-contiguous array one byte off its dtype's alignment."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.zeros(n + 1, np.uint8)[1:].view(dtype).reshape(shape)


def self_overlapping(shape, dtype=np.float32):
    """A writeable view whose rows all share the same memory (stride 0)."""
    return as_strided(np.zeros(shape[-1], dtype), shape, (0,) * (len(shape) - 1) + (np.dtype(dtype).itemsize,))


def cache_overflow(capacity, steps):
    """Append steps of (1, 2, L, 8) to a KVCache of that capacity."""
    cache = fastattn.KVCache(1, 2, capacity, 8)
    for L in steps:
        cache.append(z(1, 2, L, 8), z(1, 2, L, 8))


def cache_overflow_keeps_state():
    """A refused append leaves the cache as it was."""
    cache = fastattn.KVCache(1, 1, 4, 2)
    kv = np.arange(6, dtype=np.float32).reshape(1, 1, 3, 2)
    cache.append(kv, kv)
    try:
        cache.append(kv[:, :, :2], kv[:, :, :2])
    finally:
        assert cache.length == 3
        np.testing.assert_array_equal(cache.key, kv)


HUGE = 2**40  # a broadcast batch axis: stride 0, no memory behind it
mha = fastattn.MultiHeadAttention(8, 2, rng=0)
cache = fastattn.KVCache(2, 2, 8, 4)
kv16 = z(2, 2, 3, 4, dtype=np.float16)
shared, flat = z(2, 3, 4, 8), z(96)  # outputs whose memory an option's array shares
out_with_cu = z(2, 2, 8)
cu_in_out = out_with_cu.reshape(-1)[:6].view(np.int64)  # cu_seqlens in the output's memory
cu_in_out[:] = [0, 1, 2]


def row(category, fn, args, kwargs, exc, msg):
    return pytest.param(fn, args, kwargs, exc, msg, id=f"{category}: {msg[:50]}")


HOSTILE = [
    # -- not an ndarray ------------------------------------------------------------------
    row("type", sdpa, ([[1.0]], f32, f32), {}, TypeError, "query must be a numpy.ndarray, got list"),
    row("type", sdpa, (f32, 1.0, f32), {}, TypeError, "key must be a numpy.ndarray, got float"),
    row("type", sdpa, (f32, f32, None), {}, TypeError, "value must be a numpy.ndarray, got NoneType"),
    row("type", sdpa, (np.float32(1), f32, f32), {}, TypeError, "query must be a numpy.ndarray, got float32"),
    row("type", sdpa, (np.ma.masked_array(f32, mask=True), f32, f32), {}, TypeError,
        "query is a numpy.ma.MaskedArray"),
    row("type", fastattn.matmul, (f32, [[1.0]]), {}, TypeError, "b must be a numpy.ndarray"),
    row("type", fastattn.matmul, ((1, 2), f32), {}, TypeError, "a must be a numpy.ndarray, got tuple"),
    row("type", fastattn.softmax, ([1.0, 2.0],), {}, TypeError, "x must be a numpy.ndarray, got list"),
    row("type", fastattn.softmax, (3.0,), {}, TypeError, "x must be a numpy.ndarray, got float"),
    row("type", fastattn.split_heads, ([[1.0]], 1), {}, TypeError, "x must be a numpy.ndarray, got list"),
    row("type", fastattn.merge_heads, ([[[1.0]]],), {}, TypeError, "x must be a numpy.ndarray, got list"),
    # -- dtypes ---------------------------------------------------------------------------
    row("dtype", sdpa, (f32, f32, f64), {}, TypeError,
        "dtypes differ (query float32, key float32, value float64)"),
    row("dtype", sdpa, (f32.astype(np.int32),) * 3, {}, TypeError, "query has dtype int32"),
    row("dtype", sdpa, (f32, f32.astype(np.uint8), f32), {}, TypeError, "key has dtype uint8"),
    row("dtype", sdpa, (f32.astype(bool),) * 3, {}, TypeError, "query has dtype bool"),
    row("dtype", sdpa, (f32.astype(np.complex64),) * 3, {}, TypeError, "query has dtype complex64"),
    row("dtype", sdpa, (f32, f32.astype(np.float16), f32), {}, TypeError,
        "dtypes differ (query float32, key float16, value float32); pass arrays of one dtype, "
        "float32, float64, float16 or bfloat16"),
    row("dtype", sdpa, (f32.astype(">f2"),) * 3, {}, TypeError,
        "query has dtype >f2; expected float32, float64, float16 or bfloat16 (native byte order)"),
    row("dtype", sdpa, (f32.astype(np.longdouble),) * 3, {}, TypeError, "query has dtype float128"),
    row("dtype", sdpa, (f32.astype(object),) * 3, {}, TypeError, "query has dtype object"),
    row("dtype", sdpa, (f32.astype(">f4"),) * 3, {}, TypeError, "query has dtype >f4"),
    row("dtype", sdpa, (f32.astype("U1"),) * 3, {}, TypeError, "query has dtype <U1"),
    row("dtype", sdpa, (z(4, 4, dtype=[("a", "f4")]),) * 3, {}, TypeError, "query has dtype [('a', '<f4')]"),
    row("dtype", fastattn.matmul, (f32, f64), {}, TypeError, "dtypes differ"),
    row("dtype", fastattn.softmax, (f32.astype(np.int64),), {}, TypeError, "x has dtype int64"),
    row("dtype", fastattn.softmax, (f32.astype(np.complex128),), {}, TypeError, "x has dtype complex128"),
    row("dtype", fastattn.merge_heads, (f32.astype(np.int16),), {}, TypeError, "x has dtype int16"),
    row("dtype", fastattn.merge_heads, (f32.astype(np.float16),), {}, TypeError,
        "x has dtype float16; expected float32 or float64 (native byte order); float16 is taken "
        "by scaled_dot_product_attention, paged_attention, MultiHeadAttention and the caches' "
        "attend, not here: pass x.astype(np.float32)"),
    row("dtype", fastattn.matmul, (z(3, 4), z(4, 5, dtype=np.float16)), {}, TypeError,
        "float16 is taken by scaled_dot_product_attention, paged_attention, "
        "MultiHeadAttention and the caches' attend, not here: pass b.astype(np.float32)"),
    row("dtype", mha, (z(2, 3, 8, dtype=np.float16),), {}, TypeError,
        "query has dtype float16; this MultiHeadAttention has float32 weights; for float16 "
        "inputs make the layer float16 (dtype= of MultiHeadAttention) or pass "
        "query.astype(np.float32)"),
    row("dtype", mha, (z(2, 3, 8), z(2, 5, 8), z(2, 5, 8, dtype=np.float16)), {}, TypeError,
        "value has dtype float16; this MultiHeadAttention has float32 weights; for float16"),
    row("dtype", cache.append, (kv16, kv16), {}, TypeError,
        "key has dtype float16; this KVCache holds float32; pass key.astype(np.float32): a "
        "KVCache computes in float32 (one created with storage='float16' holds its keys and "
        "values in float16)"),
    # -- dimensions and shapes ------------------------------------------------------------
    row("shape", sdpa, (z(3),) * 3, {}, ValueError, "query must have at least 2 dimensions"),
    row("shape", sdpa, (np.zeros((), np.float32),) * 3, {}, ValueError, "query must have at least 2 dimensions"),
    row("shape", sdpa, (f32, f32[..., :5], f32), {}, ValueError,
        "key's last axis (5) must equal query's last axis E (8)"),
    row("shape", sdpa, (f32, f32, f32[..., :3, :]), {}, ValueError,
        "value must have as many rows as key (S = 4), got 3"),
    row("shape", sdpa, (f32, z(5, 3, 4, 8), f32), {}, ValueError, "do not broadcast"),
    row("shape", sdpa, (z(2, 3, 4, 8), z(3, 3, 4, 8), z(3, 3, 4, 8)), {}, ValueError,
        "the leading axes do not broadcast: query (2, 3), key (3, 3), value (3, 3)"),
    row("shape", sdpa, (f32, f32[:, :2], f32[:, :2]), {}, ValueError, "set enable_gqa=True"),
    row("shape", sdpa, (z(*(1,) * 40 + (4, 8)), z(*(2,) + (1,) * 39 + (4, 8)), z(4, 8)), {}, ValueError,
        "cannot be broadcast: this function only supports up to 32 dimensions"),
    row("shape", fastattn.matmul, (f32, f32), {}, ValueError, "inner sizes differ"),
    row("shape", fastattn.matmul, (z(3), f32), {}, ValueError, "at least 2 dimensions"),
    row("shape", fastattn.matmul, (z(2, 4, 5), z(3, 5, 4)), {}, ValueError, "the batch axes do not broadcast"),
    row("shape", fastattn.softmax, (f32,), {"axis": 4}, np.exceptions.AxisError, "axis 4 is out of bounds"),
    row("shape", fastattn.softmax, (f32,), {"axis": -5}, np.exceptions.AxisError, "axis -5 is out of bounds"),
    row("shape", fastattn.softmax, (np.zeros((), np.float32),), {}, np.exceptions.AxisError,
        "for array of dimension 0"),
    row("shape", fastattn.split_heads, (f32, 3), {}, ValueError, "not divisible by num_heads (3)"),
    row("shape", fastattn.split_heads, (z(8), 2), {}, ValueError, "x must have at least 2 dimensions"),
    row("shape", fastattn.merge_heads, (z(3, 4),), {}, ValueError, "at least 3 dimensions"),
    # -- grouped-query attention ----------------------------------------------------------
    row("gqa", sdpa, (f32, f32[:, :2], f32[:, :2]), {"enable_gqa": True}, ValueError,
        "query heads (3) must be a multiple of key/value heads (2)"),
    row("gqa", sdpa, (f32, f32[:, :0], f32[:, :0]), {"enable_gqa": True}, ValueError,
        "query heads (3) must be a multiple of key/value heads (0)"),
    row("gqa", sdpa, (f32, f32[:, :1], f32), {"enable_gqa": True}, ValueError,
        "key and value must have the same number of heads, got 1 and 3"),
    row("gqa", sdpa, (z(4, 8),) * 3, {"enable_gqa": True}, ValueError,
        "query must have at least 3 dimensions"),
    row("gqa", sdpa, (z(6, 4, 8), z(2, 4, 8), z(2, 4, 8)), {"enable_gqa": 1}, TypeError,
        "enable_gqa must be a bool, got int"),
    # -- masks ----------------------------------------------------------------------------
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": z(4, 4, dtype=np.int64)}, TypeError,
        "attn_mask has dtype int64; expected bool"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": z(4, 4, dtype=np.uint8)}, TypeError,
        "attn_mask has dtype uint8; expected bool"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": z(4, 4, dtype=np.complex64)}, TypeError,
        "attn_mask has dtype complex64"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": z(4, 4, dtype=object)}, TypeError,
        "attn_mask has dtype object"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": [[True]]}, TypeError,
        "attn_mask must be a numpy.ndarray"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": np.ma.masked_array(z(4, 4) > 0)}, TypeError,
        "attn_mask is a numpy.ma.MaskedArray"),
    row("mask", sdpa, (f32, f32[:, :, :3], f32[:, :, :3]), {"attn_mask": np.ones((3, 4), bool)},
        ValueError, "attn_mask of shape (3, 4) cannot be broadcast to (..., Hq, L, S) = (2, 3, 4, 3)"),
    row("mask", sdpa, (f32, f32[:, :, :3], f32[:, :, :3]), {"attn_mask": np.ones((2, 3), bool)},
        ValueError, "attn_mask of shape (2, 3) cannot be broadcast to (..., Hq, L, S) = "
        "(2, 3, 4, 3); for a (B, S) key padding mask (True = may attend) pass "
        "attn_mask[:, None, None, :], of shape (2, 1, 1, 3)"),
    row("mask", sdpa, (z(2, 4, 8), z(2, 3, 8), z(2, 3, 8)), {"attn_mask": np.ones((2, 3), bool)},
        ValueError, "pass attn_mask[:, None, :], of shape (2, 1, 3)"),
    # (B, 1, S), as some libraries keep a padding mask: the same fix, one axis fewer
    row("mask", sdpa, (f32, f32[:, :, :3], f32[:, :, :3]), {"attn_mask": np.ones((2, 1, 3), bool)},
        ValueError, "attn_mask of shape (2, 1, 3) cannot be broadcast to (..., Hq, L, S) = "
        "(2, 3, 4, 3); for a (B, 1, S) key padding mask (True = may attend) pass "
        "attn_mask[:, None], of shape (2, 1, 1, 3)"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": np.ones((2, 3, 4, 5), bool)}, ValueError,
        "attn_mask of shape (2, 3, 4, 5) cannot be broadcast"),
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": np.ones((5, 2, 3, 4, 4), bool)}, ValueError,
        "attn_mask of shape (5, 2, 3, 4, 4) cannot be broadcast"),
    row("mask", fastattn.softmax, (f32,), {"mask": np.ones((5,), bool)}, ValueError, "cannot be broadcast"),
    row("mask", fastattn.softmax, (f32,), {"mask": z(8, dtype=np.int8)}, TypeError, "mask has dtype int8"),
    row("mask", fastattn.softmax, (f32,), {"mask": [True] * 8}, TypeError, "mask must be a numpy.ndarray"),
    # -- scalars and flags ----------------------------------------------------------------
    row("flag", sdpa, (f32, f32, f32), {"dropout_p": 0.1}, ValueError, "dropout_p must be 0"),
    row("flag", sdpa, (f32, f32, f32), {"dropout_p": float("nan")}, ValueError, "dropout_p must be 0"),
    row("flag", sdpa, (f32, f32, f32), {"dropout_p": "0"}, TypeError, "dropout_p must be a number, got str"),
    row("flag", sdpa, (f32, f32, f32), {"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
    row("flag", sdpa, (f32, f32, f32), {"is_causal": None}, TypeError, "is_causal must be a bool, got NoneType"),
    row("flag", sdpa, (f32, f32, f32), {"need_weights": "yes"}, TypeError, "need_weights must be a bool"),
    row("flag", sdpa, (f32, f32, f32), {"scale": "1"}, TypeError, "scale must be a real number, got str"),
    row("flag", sdpa, (f32, f32, f32), {"scale": float("nan")}, ValueError, "scale must be finite, got nan"),
    row("flag", sdpa, (f32, f32, f32), {"scale": -float("inf")}, ValueError, "scale must be finite, got -inf"),
    row("flag", sdpa, (f32, f32, f32), {"scale": True}, TypeError, "scale must be a real number, got bool"),
    row("flag", sdpa, (f32, f32, f32), {"scale": 1e-46}, ValueError,
        "scale must round to a nonzero float32, the dtype computed in, or be 0; got 1e-46"),
    row("flag", sdpa, (f32, f32, f32), {"scale": 1j}, TypeError, "scale must be a real number, got complex"),
    row("flag", sdpa, (f32, f32, f32), {"causal_alignment": "bottom"}, ValueError, "causal_alignment must be"),
    row("flag", sdpa, (f32, f32, f32), {"causal_alignment": None}, ValueError, "causal_alignment must be"),
    row("flag", sdpa, (f32, f32, f32), {"causal_alignment": True}, ValueError, "causal_alignment must be"),
    row("flag", sdpa, (f32, f32, f32), {"causal_alignment": 2**53}, ValueError, "below 2**53"),
    row("flag", fastattn.softmax, (f32,), {"axis": 1.5}, TypeError, "axis must be an int"),
    row("flag", fastattn.softmax, (f32,), {"axis": True}, TypeError, "axis must be an int, got bool"),
    row("flag", fastattn.split_heads, (f32, 0), {}, ValueError, "num_heads must be >= 1"),
    row("flag", fastattn.split_heads, (f32, -2), {}, ValueError, "num_heads must be >= 1, got -2"),
    row("flag", fastattn.split_heads, (f32, 2.0), {}, TypeError, "num_heads must be an int"),
    row("flag", fastattn.split_heads, (f32, True), {}, TypeError, "num_heads must be an int, got bool"),
    row("flag", fastattn.set_simd_path, ("sse9",), {}, ValueError, "unknown SIMD path 'sse9'"),
    row("flag", fastattn.set_simd_path, (3,), {}, TypeError, "name must be a str, got int"),
    # -- thread counts (OpenMP aborts the process when it cannot create a thread) ---------
    row("threads", sdpa, (f32, f32, f32), {"num_threads": 0}, ValueError, "num_threads must be >= 1, got 0"),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": -3}, ValueError, "got -3"),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": 2**40}, ValueError,
        "num_threads must be <= "),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": 2**63}, ValueError, "got 9223372036854775808"),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": 2.0}, TypeError, "num_threads must be an int, got float"),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": float("nan")}, TypeError, "num_threads must be an int"),
    row("threads", sdpa, (f32, f32, f32), {"num_threads": True}, TypeError, "num_threads must be an int, got bool"),
    row("threads", fastattn.matmul, (f32, f32.swapaxes(-1, -2)), {"num_threads": 100_000}, ValueError,
        "num_threads must be <= "),
    row("threads", fastattn.softmax, (f32,), {"num_threads": -1}, ValueError, "got -1"),
    row("threads", fastattn.merge_heads, (f32,), {"num_threads": "2"}, TypeError, "num_threads must be an int"),
    row("threads", fastattn.set_num_threads, (0,), {}, ValueError, "n must be >= 1"),
    row("threads", fastattn.set_num_threads, (2**40,), {}, ValueError, "got 1099511627776"),
    row("threads", fastattn.set_num_threads, (float("nan"),), {}, TypeError, "n must be an int, got float"),
    # -- output arrays --------------------------------------------------------------------
    row("out", sdpa, (f32, f32, f32), {"out": f64.copy()}, TypeError, "out has dtype float64; expected float32"),
    row("out", sdpa, (f32, f32, f32), {"out": z(2, 3, 4, 7)}, ValueError,
        "out has shape (2, 3, 4, 7); expected (2, 3, 4, 8)"),
    row("out", sdpa, (f32, f32, f32), {"out": f32}, ValueError, "out overlaps query"),
    row("out", sdpa, (f32.copy(), f32.copy(), f32), {"out": f32}, ValueError, "out overlaps value"),
    row("out", sdpa, (f32, f32, f32), {"out": [[0.0]]}, TypeError, "out must be a numpy.ndarray"),
    row("out", sdpa, (f32, f32, f32), {"out": read_only(f32)}, ValueError, "out is read-only"),
    row("out", sdpa, (f32, f32, f32), {"out": misaligned((2, 3, 4, 8))}, ValueError, "out must be aligned"),
    row("out", sdpa, (f32, f32, f32), {"out": self_overlapping((2, 3, 4, 8))}, ValueError,
        "out has elements that share memory"),
    row("out", fastattn.matmul, (z(3, 4), z(4, 5)), {"out": self_overlapping((3, 5))}, ValueError,
        "out has elements that share memory"),
    row("out", fastattn.matmul, (z(3, 4), z(4, 5)), {"out": z(3, 5).T}, ValueError,
        "out has shape (5, 3); expected (3, 5)"),
    row("out", fastattn.softmax, (f32,), {"out": self_overlapping((2, 3, 4, 8))}, ValueError,
        "out has elements that share memory"),
    row("out", fastattn.softmax, (f32,), {"out": f32[..., ::-1]}, ValueError, "out overlaps x"),
    row("out", fastattn.softmax, (f32.copy(),), {"mask": f32, "out": f32}, ValueError, "out overlaps mask"),
    row("out", sdpa, (f32, f32, f32), {"out": shared, "alibi_slopes": shared.reshape(-1)[:3]},
        ValueError, "out overlaps alibi_slopes"),
    row("out", sdpa, (f32, f32, f32), {"out": shared, "sinks": shared.reshape(-1)[-3:]},
        ValueError, "out overlaps sinks"),
    row("out", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8), np.array([0, 5]),
                                           np.array([0, 6])),
        {"out": flat[:80].reshape(5, 2, 8), "sinks": flat[78:80]}, ValueError, "out overlaps sinks"),
    row("out", fastattn.varlen_attention, (z(2, 2, 8), z(6, 2, 8), z(6, 2, 8), cu_in_out,
                                           np.array([0, 3, 6])),
        {"out": out_with_cu}, ValueError, "out overlaps cu_seqlens_q"),
    row("out", fastattn.paged_attention, (z(1, 2, 8), z(1, 1, 4, 8), z(1, 1, 4, 8), np.array([[0]]),
                                          np.array([1]), np.array([0, 1])),
        {"out": flat[:16].reshape(1, 2, 8), "alibi_slopes": flat[:2]}, ValueError,
        "out overlaps alibi_slopes"),
    # -- sizes past what an index addresses (broadcast views: no memory behind them) ------
    row("size", sdpa, (bcast(z(1, 1, 8), (HUGE, 4096, 8)), z(4096, 8), z(4096, 4)), {}, ValueError,
        "the attention scores (..., Hq, L, S) (1099511627776, 4096, 4096) would have"),
    row("size", sdpa, (bcast(z(1, 1, 8), (HUGE, 1, 8)), bcast(z(1, 8), (2**30, 8)), bcast(z(1, 1), (2**30, 1))),
        {"attn_mask": np.ones((1, 1), bool)}, ValueError, "key broadcast to (1099511627776, 1073741824, 8)"),
    row("size", sdpa, (bcast(z(1, 2**10), (2**12, 2**10)), bcast(z(1, 1, 2**10), (HUGE, 1, 2**10)), z(1, 1)), {}, ValueError,
        "query broadcast to (1099511627776, 4096, 1024) would have"),
    row("size", sdpa, (bcast(z(1, 1, 1, 4, 8), (2**30, 1, 1, 4, 8)), bcast(z(1, 1, 4, 8), (1, 2**30, 16, 4, 8)),
                       bcast(z(1, 1, 4, 8), (1, 2**30, 16, 4, 8))), {}, ValueError,
        "the leading axes broadcast to more elements than a 64-bit index addresses: "
        "query (1073741824, 1, 1), key (1, 1073741824, 16)"),
    row("size", sdpa, (bcast(z(1, 1), (1, 2**60)),) * 2 + (z(1, 1),), {}, ValueError,
        "E = 1152921504606846976"),
    row("size", sdpa, (z(1, 8), z(1, 8), bcast(z(1, 1), (1, 2**21))), {}, ValueError,
        "value Ev = 2097152 features per head; at most 1048576"),
    row("size", fastattn.matmul, (bcast(z(1, 1, 1), (HUGE, 1, 1)), z(1, 2**22)), {}, ValueError,
        "b broadcast to (1099511627776, 1, 4194304) would have 4611686018427387904 elements"),
    row("size", fastattn.matmul, (bcast(z(1, 1), (2**31, 1)), bcast(z(1, 1), (1, 2**31))), {}, ValueError,
        "the output (2147483648, 2147483648) would have"),
    row("size", fastattn.split_heads, (z(3, 0), 2**70), {}, ValueError, "the heads of x (3, 1180591620717411303424, 0)"),
    # -- the KV cache ---------------------------------------------------------------------
    row("cache", cache_overflow, (4, [4, 1]), {}, ValueError, "KVCache capacity exceeded"),
    row("cache", cache_overflow, (3, [5]), {}, ValueError, "KVCache capacity exceeded"),
    row("cache", cache_overflow_keeps_state, (), {}, ValueError, "KVCache capacity exceeded"),
    # -- attention variants ---------------------------------------------------------------
    row("variant", sdpa, (f32, f32, f32), {"window_size": 3}, TypeError,
        "window_size must be a pair of ints (left, right), got 3"),
    row("variant", sdpa, (f32, f32, f32), {"window_size": (1.5, 0)}, TypeError,
        "window_size must be a pair of ints"),
    row("variant", sdpa, (f32, f32, f32), {"softcap": -1.0}, ValueError,
        "softcap must be > 0 (None or 0.0: no soft-cap), got -1.0"),
    row("variant", sdpa, (f32, f32, f32), {"softcap": float("nan")}, ValueError,
        "softcap must be finite, got nan"),
    row("variant", sdpa, (f32, f32, f32), {"softcap": "50"}, TypeError,
        "softcap must be a real number, got str"),
    row("variant", sdpa, (f32, f32, f32), {"alibi_slopes": np.ones(4)}, ValueError,
        "alibi_slopes has shape (4,); expected (3,) or (2, 3)"),
    row("variant", sdpa, (f32, f32, f32), {"alibi_slopes": np.array([1, np.nan, 1])}, ValueError,
        "alibi_slopes must be finite, got nan"),
    row("variant", sdpa, (f32, f32, f32), {"alibi_slopes": np.ones(3, bool)}, TypeError,
        "alibi_slopes has dtype bool; expected a real dtype"),
    row("variant", sdpa, (f32, f32, f32), {"sinks": np.array([0, np.inf, 0])}, ValueError,
        "sinks must be real or -inf, got inf"),
    row("variant", sdpa, (f32, f32, f32), {"sinks": np.zeros((3, 1))}, ValueError,
        "sinks has shape (3, 1); expected (3,) or (2, 3)"),
    row("variant", sdpa, (f32, f32, f32), {"return_lse": 1}, TypeError,
        "return_lse must be a bool, got int"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 5]), np.array([1, 6])), {}, ValueError,
        "cu_seqlens_k must start at 0, never decrease and end at the total length 6"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 3, 2, 5]), np.array([0, 2, 4, 6])),
        {}, ValueError, "cu_seqlens_q must start at 0, never decrease"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 4]), np.array([0, 6])), {}, ValueError,
        "end at the total length 5"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0., 5.]), np.array([0, 6])), {}, TypeError,
        "cu_seqlens_q has dtype float64; expected int32 or int64"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 5]), np.array([0, 3, 6])), {},
        ValueError, "cu_seqlens_q and cu_seqlens_k must hold B + 1 values for the same B"),
    row("varlen", fastattn.varlen_attention, (z(5, 3, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 5]), np.array([0, 6])), {}, ValueError,
        "query heads (3) must be a multiple of key/value heads (2)"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 4), z(6, 2, 8),
                                              np.array([0, 5]), np.array([0, 6])), {}, ValueError,
        "do not agree"),
    row("varlen", fastattn.varlen_attention, (z(5, 2, 8), z(6, 2, 8), z(6, 2, 8),
                                              np.array([0, 5]), np.array([0, 6])),
        {"sinks": np.zeros((1, 2))}, ValueError, "sinks has shape (1, 2); expected (2,), one per query head"),
    row("merge", fastattn.merge_attention, ([z(2, 4, 8)], [z(2, 5)]), {}, ValueError,
        "outputs[0] has shape (2, 4, 8) and lses[0] (2, 5); expected (2, 4, 8) and (2, 4)"),
    row("merge", fastattn.merge_attention, ([], []), {}, ValueError,
        "outputs and lses must be non-empty and of one length"),
    row("merge", fastattn.merge_attention, (z(2, 4, 8), z(2, 4)), {}, TypeError,
        "outputs and lses must be lists (or tuples) of arrays"),
    row("merge", fastattn.merge_attention, ([z(2, 4, 8)], [z(2, 4, dtype=np.float64)]), {},
        TypeError, "lses have dtype float64 and outputs float32; the log-sum-exps of float32 outputs "
        "are float32 (as return_lse gives them)"),
    # errors that say the fix (issue 28, item 5)
    row("fix", sdpa, ([[1.0]], f32, f32), {}, TypeError,
        "query must be a numpy.ndarray, got list; pass np.asarray(query, dtype=np.float32)"),
    row("fix", sdpa, (f32.astype(">f4"), f32, f32), {}, TypeError,
        ">f4 is float32 in the other byte order: pass query.astype('=f4')"),
    row("fix", fastattn.matmul, (z(2, 2, dtype=">f8"), z(2, 2, dtype=">f8")), {}, TypeError,
        "pass a.astype('=f8')"),
    row("fix", sdpa, (z(2, 5, 4, 8), z(2, 7, 4, 8), z(2, 7, 4, 8)), {}, ValueError,
        "if these are (B, L, H, E) arrays, FlashAttention's layout, pass "
        "query.transpose(0, 2, 1, 3)"),
    row("fix", sdpa, (f32, f32, f32), {"num_threads": -1}, ValueError,
        "num_threads must be >= 1, got -1; None (the default) means get_num_threads()"),
    # a mask value that overflows the dtype computed in (item 6); -1e39 still hides
    row("mask", sdpa, (f32, f32, f32), {"attn_mask": np.full((4, 4), 1e39)}, ValueError,
        "attn_mask holds 1e+39, beyond float32's range (the dtype computed in)"),
]

if torch is not None:  # a torch tensor where an ndarray is expected: the message says .numpy()
    t32 = torch.zeros(2, 3, 4, 8)
    HOSTILE += [
        row("torch", sdpa, (t32, f32, f32), {}, TypeError,
            "query must be a numpy.ndarray, got torch.Tensor; pass query.numpy() "
            "(query.detach().cpu().numpy() for a tensor that requires grad or is not on the CPU)"),
        row("torch", sdpa, (f32, f32, t32), {}, TypeError,
            "value must be a numpy.ndarray, got torch.Tensor; pass value.numpy()"),
        row("torch", sdpa, (f32, f32, f32), {"attn_mask": torch.ones(4, 4, dtype=torch.bool)},
            TypeError, "attn_mask must be a numpy.ndarray, got torch.Tensor; pass attn_mask.numpy()"),
        row("torch", fastattn.matmul, (z(3, 4), torch.zeros(4, 5)), {}, TypeError,
            "b must be a numpy.ndarray, got torch.Tensor; pass b.numpy()"),
        row("torch", fastattn.softmax, (torch.nn.Parameter(torch.zeros(3)),), {}, TypeError,
            "x must be a numpy.ndarray, got torch.nn.parameter.Parameter; pass x.numpy() "
            "(x.detach().cpu().numpy()"),
        row("torch", fastattn.softmax, (f32,), {"mask": torch.ones(8, dtype=torch.bool)}, TypeError,
            "mask must be a numpy.ndarray, got torch.Tensor; pass mask.numpy()"),
        row("torch", fastattn.split_heads, (torch.zeros(4, 8), 2), {}, TypeError,
            "x must be a numpy.ndarray, got torch.Tensor; pass x.numpy()"),
        row("torch", fastattn.merge_heads, (t32,), {}, TypeError,
            "x must be a numpy.ndarray, got torch.Tensor; pass x.numpy()"),
        row("torch", mha, (torch.zeros(2, 3, 8),), {}, TypeError,
            "query must be a numpy.ndarray, got torch.Tensor; pass query.numpy()"),
        row("torch", mha, (z(2, 3, 8), torch.zeros(2, 5, 8), z(2, 5, 8)), {}, TypeError,
            "key must be a numpy.ndarray, got torch.Tensor; pass key.numpy()"),
        row("torch", mha, (z(2, 3, 8),), {"key_padding_mask": torch.zeros(2, 3, dtype=torch.bool)},
            TypeError, "key_padding_mask must be a numpy.ndarray, got torch.Tensor; "
            "pass key_padding_mask.numpy()"),
        row("torch", mha, (z(2, 3, 8),), {"attn_mask": torch.zeros(3, 3, dtype=torch.bool)},
            TypeError, "attn_mask must be a numpy.ndarray, got torch.Tensor; pass attn_mask.numpy()"),
        row("torch", cache.attend, (torch.zeros(2, 2, 1, 4),), {}, TypeError,
            "query must be a numpy.ndarray, got torch.Tensor; pass query.numpy()"),
    ]


def owner(a):
    """The array that owns a's memory (views of views, broadcasts)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


@pytest.mark.parametrize("fn,args,kwargs,exc,msg", HOSTILE)
def test_hostile_input(fn, args, kwargs, exc, msg):
    arrays = [owner(a) for a in list(args) + list(kwargs.values()) if isinstance(a, np.ndarray)]
    before = [(a.copy(), a.flags.writeable) for a in arrays]
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    assert msg in str(info.value)
    for a, (copy, writeable) in zip(arrays, before):
        np.testing.assert_array_equal(a, copy)
        assert a.flags.writeable == writeable


def test_padding_mask_hint_only_for_padding_masks():
    """(B, 2, S) is no padding mask: no hint that would make it one."""
    with pytest.raises(ValueError, match=r"\(2, 3, 4, 3\)$"):
        sdpa(f32, f32[:, :, :3], f32[:, :, :3], attn_mask=np.ones((2, 2, 3), bool))


def test_hostile_table_covers_every_function():
    fns = {p.values[0] for p in HOSTILE}
    assert {sdpa, fastattn.matmul, fastattn.softmax, fastattn.split_heads, fastattn.merge_heads,
            fastattn.set_num_threads, fastattn.set_simd_path} <= fns


def test_torch_tensor_is_told_by_name_without_importing_torch():
    """The .numpy() hint needs no torch: a class named Tensor from a module
    named torch.* is enough, and an unrelated Tensor class gets no hint."""
    import types

    fake_torch = types.new_class("Tensor")
    fake_torch.__module__ = "torch"
    other = types.new_class("Tensor")
    other.__module__ = "tensorflow"
    sub = types.new_class("Parameter", (fake_torch,))
    sub.__module__ = "torch.nn.parameter"
    with pytest.raises(TypeError, match=r"got torch.Tensor; pass query.numpy\(\)"):
        sdpa(fake_torch(), f32, f32)
    with pytest.raises(TypeError, match=r"got torch.nn.parameter.Parameter; pass query.numpy"):
        sdpa(sub(), f32, f32)
    with pytest.raises(TypeError) as info:
        sdpa(other(), f32, f32)
    assert str(info.value) == "query must be a numpy.ndarray, got Tensor"


def test_zero_size_output_with_huge_batch_returns_at_once():
    """Ev = 0 leaves nothing to compute, however large the (broadcast) batch:
    this used to run 2^40 empty tasks, a hang."""
    q = bcast(z(1, 1, 1, 8), (2**20, 2**20, 1, 8))
    out = sdpa(q, z(1, 1, 300, 8), z(1, 1, 300, 0))
    assert out.shape == (2**20, 2**20, 1, 0)


def test_kernel_refuses_head_size_past_its_bound():
    """The C layer itself refuses E past FA_ATTN_MAX_FEATURES, whatever Python
    passes: its scratch size would wrap around (a heap overflow, a crash)."""
    q = bcast(z(1, 1), (1, 2**60))
    v = z(1, 1)
    with pytest.raises(RuntimeError, match="rejected its arguments"):
        _core.attention(_core.ISA_PORTABLE, q, q, v, None, _core.MASK_NONE, z(1, 1), None, 1,
                        False, 0, 1.0, 1)


@pytest.mark.parametrize("shape", [(3, 5, 8), (2, 3, 40, 16)])
def test_misaligned_inputs_are_copied_aligned(simd, shape):
    """Contiguous but misaligned arrays reach the kernels as aligned copies
    (np.ascontiguousarray returns them unchanged: a misaligned load in C,
    undefined behaviour that UBSan reported)."""
    from fastattn import _checks

    rng = np.random.default_rng(0)
    x = misaligned(shape)
    x[...] = rng.standard_normal(shape)
    assert not x.flags.aligned and x.flags.c_contiguous
    assert _checks.kernel_view(x).flags.aligned
    a = np.ascontiguousarray(x)
    np.testing.assert_array_equal(sdpa(x, x, x), sdpa(a, a, a))
    np.testing.assert_array_equal(fastattn.softmax(x), fastattn.softmax(a))
    np.testing.assert_array_equal(fastattn.matmul(x, a.swapaxes(-1, -2)),
                                  fastattn.matmul(a, a.swapaxes(-1, -2)))
    np.testing.assert_array_equal(fastattn.merge_heads(x), fastattn.merge_heads(a))


def test_a_mask_below_the_range_still_hides():
    """-1e39 in a float64 mask of a float32 call becomes -inf: the key is
    hidden, as meant, and the row is the one without that key."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 8)).astype(np.float32)
    mask = np.zeros((3, 3))
    mask[:, 2] = -1e39
    np.testing.assert_array_equal(sdpa(q, q, q, attn_mask=mask),
                                  sdpa(q, q[:, :2], q[:, :2]))


def test_weights_beyond_memory_say_what_costs(monkeypatch):
    """need_weights=True whose (L, S) weights cannot be allocated: a
    MemoryError that names the weights and the way out."""
    real_empty = np.empty

    def empty(shape, *args, **kwargs):
        if tuple(shape)[-2:] == (4, 4) and len(tuple(shape)) == 4:
            raise MemoryError
        return real_empty(shape, *args, **kwargs)

    monkeypatch.setattr(np, "empty", empty)
    with pytest.raises(MemoryError, match="the output alone needs O\\(L\\) memory"):
        sdpa(f32, f32, f32, need_weights=True)


def test_writing_a_16_bit_layers_weight_points_to_load_state_dict():
    mha = fastattn.MultiHeadAttention(16, 2, dtype=np.float16)
    with pytest.raises(ValueError, match=r"read-only .* load_state_dict"):
        mha.out_proj_weight[0, 0] = 1
    before = mha(np.ones((1, 3, 16), np.float16))[0]
    mha.load_state_dict({"out_proj.weight": 2 * mha.out_proj_weight}, strict=False)
    assert not np.array_equal(mha(np.ones((1, 3, 16), np.float16))[0], before)
