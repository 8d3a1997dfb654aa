"""KVCache: steps of new tokens equal the matching rows of a full causal pass."""
import numpy as np
import pytest
from conftest import assert_close, f64

import fastattn
from fastattn import reference as ref

# float32 cache steps against the float32 full pass: the bound
STEP_ATOL = {np.dtype(np.float32): 1e-6, np.dtype(np.float64): 1e-13}


def qkv(rng, dtype, B, Hq, Hkv, T, D, Dv=None):
    q = rng.standard_normal((B, Hq, T, D)).astype(dtype)
    k = rng.standard_normal((B, Hkv, T, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, T, Dv or D)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("steps", [[1] * 9, [5, 1, 1, 1, 1], [3, 4, 2], [9]])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (6, 1)])
def test_steps_equal_full_causal_pass(simd, dtype, rng, steps, Hq, Hkv):
    B, D, Dv = 2, 16, 12
    T = sum(steps)
    q, k, v = qkv(rng, dtype, B, Hq, Hkv, T, D, Dv)
    full = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r_full = ref.scaled_dot_product_attention(*f64(q, k, v), is_causal=True, enable_gqa=True)
    cache = fastattn.KVCache(B, Hkv, T + 3, D, value_dim=Dv, dtype=dtype)
    t = 0
    for n in steps:
        cache.append(k[:, :, t:t + n], v[:, :, t:t + n])
        out, w = cache.attend(q[:, :, t:t + n], need_weights=True)
        assert out.shape == (B, Hq, n, Dv) and w.shape == (B, Hq, n, t + n)
        np.testing.assert_allclose(out, full[:, :, t:t + n], rtol=0, atol=STEP_ATOL[dtype])
        assert_close(out, r_full[:, :, t:t + n], dtype, D + T)
        t += n
    assert cache.length == T and list(cache.lengths) == [T] * B


def test_long_cache_decode(simd, dtype, rng):
    """One query row over a long cache with few (batch, head) items, the
    decoding case the kernel splits over the keys: still the rows of the
    full causal pass (here its last rows, computed as one block of queries)."""
    B, Hq, Hkv, T, D, new = 1, 8, 2, 2100, 64, 6
    q, k, v = qkv(rng, dtype, B, Hq, Hkv, T, D)
    P = T - new
    rows = fastattn.scaled_dot_product_attention(q[:, :, P:], k, v, is_causal=True,
                                                 causal_alignment="lower_right", enable_gqa=True)
    r_rows = ref.scaled_dot_product_attention(*f64(q[:, :, P:], k, v), is_causal=True,
                                              causal_alignment="lower_right", enable_gqa=True)
    cache = fastattn.KVCache(B, Hkv, T, D, dtype=dtype)
    cache.append(k[:, :, :P], v[:, :, :P])
    for i in range(new):
        cache.append(k[:, :, P + i:P + i + 1], v[:, :, P + i:P + i + 1])
        out = cache.attend(q[:, :, P + i:P + i + 1])
        np.testing.assert_allclose(out, rows[:, :, i:i + 1], rtol=0, atol=STEP_ATOL[dtype])
        assert_close(out, r_rows[:, :, i:i + 1], dtype, D + T)


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch(simd, dtype, rng, padding):
    """Prompts of unequal length, padded: the padding is never attended, and
    every real row equals the full causal pass with the key padding mask."""
    B, H, P, new, D = 3, 2, 7, 4, 8
    lengths = np.array([7, 3, 1])
    pos = np.arange(P)
    real = pos >= P - lengths[:, None] if padding == "left" else pos < lengths[:, None]
    T = P + new
    q, k, v = qkv(rng, dtype, B, H, H, T, D)
    real_all = np.concatenate([real, np.ones((B, new), bool)], axis=1)
    full = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 attn_mask=real_all[:, None, None, :])
    r_full = ref.scaled_dot_product_attention(*f64(q, k, v), is_causal=True,
                                              attn_mask=real_all[:, None, None, :])
    cache = fastattn.KVCache(B, H, T, D, dtype=dtype)
    cache.append(k[:, :, :P], v[:, :, :P], key_padding_mask=~real)
    out = cache.attend(q[:, :, :P])
    rows = real[:, None, :, None]
    np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, full[:, :, :P], 0),
                               rtol=0, atol=STEP_ATOL[dtype])
    for t in range(P, T):
        cache.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        out, w = cache.attend(q[:, :, t:t + 1], need_weights=True)
        np.testing.assert_allclose(out, full[:, :, t:t + 1], rtol=0, atol=STEP_ATOL[dtype])
        assert_close(out, r_full[:, :, t:t + 1], dtype, D + T)
        assert np.all(w[~real_all[:, None, None, :t + 1].repeat(H, 1)] == 0)
    np.testing.assert_array_equal(cache.lengths, lengths + new)
    mask = cache.attn_mask  # a view of the cache's own (B, capacity) array, never expanded
    assert mask.shape == (B, 1, 1, T) and np.shares_memory(mask, cache.attn_mask)


def test_no_reallocation_and_views(rng):
    B, H, D = 2, 3, 8
    cache = fastattn.KVCache(B, H, 10, D)
    k = rng.standard_normal((B, H, 2, D)).astype(np.float32)
    cache.append(k, k)
    first = cache.key
    for _ in range(8):
        cache.append(k[:, :, :1], 2 * k[:, :, :1])
    assert cache.key.__array_interface__["data"][0] == first.__array_interface__["data"][0]
    assert np.shares_memory(cache.key, first)
    assert cache.key.shape == (B, H, 10, D) and cache.value.shape == (B, H, 10, D)
    np.testing.assert_array_equal(cache.key[:, :, 2:], np.repeat(k[:, :, :1], 8, axis=2))
    np.testing.assert_array_equal(cache.value[:, :, 2:], np.repeat(2 * k[:, :, :1], 8, axis=2))
    with pytest.raises(ValueError, match="read-only"):
        cache.key[0, 0, 0, 0] = 1
    assert cache.attn_mask is None  # no padding: no mask


def test_capacity_exceeded_writes_nothing(rng):
    cache = fastattn.KVCache(1, 2, 5, 4)
    k = rng.standard_normal((1, 2, 4, 4)).astype(np.float32)
    cache.append(k, k)
    keys = cache.key.copy()
    with pytest.raises(ValueError, match=r"KVCache capacity exceeded: 2 positions cannot be "
                                         r"appended to the 4 positions held of 5; nothing was "
                                         r"written"):
        cache.append(k[:, :, :2], k[:, :, :2])
    assert cache.length == 4
    np.testing.assert_array_equal(cache.key, keys)
    cache.append(k[:, :, :1], k[:, :, :1])  # the last slot still fits
    assert cache.length == 5


def test_reset(rng):
    cache = fastattn.KVCache(2, 1, 4, 3, dtype=np.float64)
    k = rng.standard_normal((2, 1, 4, 3))
    cache.append(k, k, key_padding_mask=np.array([[True, False, False, False]] * 2))
    cache.reset()
    assert cache.length == 0 and cache.attn_mask is None and cache.key.shape == (2, 1, 0, 3)
    cache.append(k, k)
    q = rng.standard_normal((2, 1, 4, 3))
    np.testing.assert_array_equal(cache.attend(q),
                                  fastattn.scaled_dot_product_attention(q, k, k, is_causal=True))


def test_attend_with_mask_and_padding(dtype, rng):
    B, H, T, D = 2, 2, 6, 8
    q, k, v = qkv(rng, dtype, B, H, H, T, D)
    pad = np.zeros((B, T), bool)
    pad[1, :2] = True
    cache = fastattn.KVCache(B, H, T, D, dtype=dtype)
    cache.append(k, v, key_padding_mask=pad)
    for user in (rng.random((T, T)) > 0.3, rng.standard_normal((B, 1, T, T)).astype(dtype)):
        out = cache.attend(q, attn_mask=user, is_causal=False)
        keep = ~pad[:, None, None, :]
        r_mask = (user & keep) if user.dtype == bool else np.where(keep, user, -np.inf)
        assert_close(out, ref.scaled_dot_product_attention(*f64(q, k, v, r_mask)), dtype, D + T)


def test_mha_steps_equal_full_pass(simd, dtype, rng):
    """MultiHeadAttention with a cache (GQA, left-padded prompts) equals its
    full causal pass with the key padding mask, row for row."""
    B, P, new, E, Hq, Hkv = 3, 6, 5, 32, 4, 2
    m = fastattn.MultiHeadAttention(E, Hq, num_kv_heads=Hkv, dtype=dtype, rng=rng)
    m.in_proj_bias[...] = rng.standard_normal(m.in_proj_bias.shape)
    x = rng.standard_normal((B, P + new, E)).astype(dtype)
    pad = np.zeros((B, P + new), bool)
    pad[1, :2] = pad[2, :5] = True
    full, _ = m(x, key_padding_mask=pad, is_causal=True)
    atol = STEP_ATOL[dtype] * max(1.0, float(np.abs(full).max()))  # relative to the outputs
    cache = m.new_cache(B, P + new)
    first, _ = m(x[:, :P], key_padding_mask=pad[:, :P], is_causal=True, cache=cache)
    real = ~pad[:, :P, None]
    np.testing.assert_allclose(np.where(real, first, 0), np.where(real, full[:, :P], 0),
                               rtol=0, atol=atol)
    for t in range(P, P + new):
        out, w = m(x[:, t:t + 1], is_causal=True, cache=cache, need_weights=True)
        np.testing.assert_allclose(out, full[:, t:t + 1], rtol=0, atol=atol)
        assert w.shape == (B, 1, t + 1) and np.all(w[pad[:, None, :t + 1]] == 0)


def test_mha_cache_errors(rng):
    m = fastattn.MultiHeadAttention(16, 4, num_kv_heads=2, rng=rng)
    x = np.zeros((2, 3, 16), np.float32)
    with pytest.raises(ValueError, match="does not fit this layer: it needs batch_size=2, "
                                         "num_kv_heads=2, head_dim=value_dim=4, dtype=float32"):
        m(x, cache=fastattn.KVCache(2, 4, 8, 4))
    cache = m.new_cache(2, 4)
    with pytest.raises(TypeError, match="with a cache it must be bool"):
        m(x, cache=cache, key_padding_mask=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"attn_mask has shape \(3, 2\); expected \(L, S\) = "
                                         r"\(3, 3\)"):
        m(x, cache=cache, attn_mask=np.zeros((3, 2), bool))
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        m(x, cache=cache, num_threads=0)
    assert cache.length == 0  # nothing appended on an error
    m(x, cache=cache)
    with pytest.raises(ValueError, match="KVCache capacity exceeded: 3 positions cannot be appended to the 3 positions held of 4"):
        m(x, cache=cache)
    assert cache.length == 3


k4 = np.zeros((2, 3, 4, 8), np.float32)
BAD_CACHE = [
    ("append", (k4[:1], k4), {}, ValueError,
     "key has shape (1, 3, 4, 8); expected (batch_size, num_kv_heads, L, head_dim) = (2, 3, L, 8)"),
    ("append", (k4, k4[..., :5]), {}, ValueError, "value has shape (2, 3, 4, 5); expected"),
    ("append", (k4, k4[:, :, :2]), {}, ValueError,
     "key and value must hold the same number of positions, got 4 and 2"),
    ("append", (k4.astype(np.float64), k4), {}, TypeError,
     "key has dtype float64; this KVCache holds float32"),
    ("append", (k4, k4), {"key_padding_mask": np.zeros((2, 4), np.int32)}, TypeError,
     "key_padding_mask has dtype int32; expected bool (True = padding)"),
    ("append", (k4, k4), {"key_padding_mask": np.zeros((2, 3), bool)}, ValueError,
     "key_padding_mask has shape (2, 3); expected (batch_size, L) = (2, 4)"),
    ("append", ([1.0], k4), {}, TypeError, "key must be a numpy.ndarray, got list"),
    ("attend", (k4.astype(np.float64),), {}, TypeError,
     "query has dtype float64; this KVCache holds float32"),
    ("attend", (k4[..., :4],), {}, ValueError, "query has shape (2, 3, 4, 4); expected"),
    ("attend", (np.zeros((2, 4, 1, 8), np.float32),), {}, ValueError,
     "query heads (4) must be a multiple of key/value heads (3)"),
    # (batch, length, heads, features), as Hugging Face and FlashAttention hold them
    ("append", (k4.transpose(0, 2, 1, 3).copy(), k4), {}, ValueError,
     "key has shape (2, 4, 3, 8); expected (batch_size, num_kv_heads, L, head_dim) = "
     "(2, 3, L, 8); if its axes are in another order, pass key.transpose(0, 2, 1, 3)"),
    ("attend", (np.zeros((2, 1, 3, 4), np.float32),), {}, ValueError,
     "query has shape (2, 1, 3, 4); expected (batch_size, Hq, L, head_dim) = (2, Hq, L, 8)"),
    ("truncate", (1,), {}, ValueError, "length = 1; the cache holds 0 positions"),
    ("truncate", (-1,), {}, ValueError, "length must be >= 0, got -1"),
    ("truncate", (1.0,), {}, TypeError, "length must be an int, got float"),
]


@pytest.mark.parametrize("method,args,kwargs,exc,msg", BAD_CACHE,
                         ids=[c[4][:40] for c in BAD_CACHE])
def test_cache_errors(method, args, kwargs, exc, msg):
    cache = fastattn.KVCache(2, 3, 6, 8)
    with pytest.raises(exc) as info:
        getattr(cache, method)(*args, **kwargs)
    assert msg in str(info.value)
    assert cache.length == 0


@pytest.mark.parametrize("args,kwargs,exc,msg", [
    ((0, 1, 1, 1), {}, ValueError, "batch_size must be >= 1, got 0"),
    ((1, 1, 0, 1), {}, ValueError, "capacity must be >= 1, got 0"),
    ((1, 1, 1, 1.5), {}, TypeError, "head_dim must be an int, got float"),
    ((1, 1, 1, 1), {"dtype": np.int32}, TypeError, "dtype must be float32 or float64"),
    ((1, 8, 2**62, 64), {}, ValueError, "KVCache of batch_size=1, num_kv_heads=8, "
     "capacity=4611686018427387904, head_dim=64, value_dim=64, float32, storage=float32 would "
     "need buffers larger than any address space; lower capacity"),
    ((1, 1, 1, 1), {"storage": "float8"}, ValueError, "storage must be one of 'float32', "
     "'float16', 'bfloat16', 'int8', 'float8_e4m3fn', 'float8_e5m2', 'int4' for a float32 "
     "KVCache, got 'float8'"),
    ((1, 1, 1, 1), {"dtype": np.float64, "storage": "int8"}, ValueError,
     "a float64 KVCache holds float64 keys and values only (storage 'float64' or None), got "
     "storage='int8'; for 16-, 8- or 4-bit storage pass dtype=np.float32"),
    ((1, 1, 1, 1), {"storage": np.float16}, ValueError, "storage must be one of"),
    # empty heads: NumPy still refuses the shape
    ((1, 1, 2**62, 0), {"value_dim": 0}, ValueError, "capacity=4611686018427387904, head_dim=0, "
     "value_dim=0, float32, storage=float32 would need buffers larger than any address space"),
    ((1, 2**62, 2, 0), {"value_dim": 0}, ValueError, "num_kv_heads=4611686018427387904"),
    # 36 PiB: within a 64-bit size, beyond any address space a process gets
    ((1, 8, 10**13, 64), {}, MemoryError, "capacity=10000000000000, head_dim=64, value_dim=64, "
     "float32, storage=float32 needs 38156285.9 GiB, which could not be allocated; lower "
     "capacity"),
])
def test_cache_constructor_errors(args, kwargs, exc, msg):
    with pytest.raises(exc) as info:
        fastattn.KVCache(*args, **kwargs)
    assert msg in str(info.value)


@pytest.mark.parametrize("padding", [False, True])
def test_attend_out_overlapping_the_mask_is_an_error(padding):
    """Refused with or without padding (combined with the caller's mask, the
    mask the kernel sees is a new array), and the caller's mask untouched."""
    cache = fastattn.KVCache(1, 1, 8, 4)
    kv = np.ones((1, 1, 4, 4), np.float32)
    cache.append(kv, kv, key_padding_mask=np.array([[padding, False, False, False]]))
    buf = np.zeros((1, 1, 1, 4), np.float32)
    with pytest.raises(ValueError, match="out overlaps attn_mask"):
        cache.attend(np.ones((1, 1, 1, 4), np.float32), attn_mask=buf, out=buf)
    np.testing.assert_array_equal(buf, 0)


def test_attend_more_queries_than_positions_is_an_error(rng):
    cache = fastattn.KVCache(1, 1, 8, 2)
    kv = np.ones((1, 1, 2, 2), np.float32)
    cache.append(kv, kv)
    with pytest.raises(ValueError, match="query has 4 positions but the cache holds 2"):
        cache.attend(rng.standard_normal((1, 1, 4, 2)).astype(np.float32))
    out = cache.attend(rng.standard_normal((1, 1, 4, 2)).astype(np.float32), is_causal=False)
    assert out.shape == (1, 1, 4, 2)   # without causality any number of queries is fine


@pytest.mark.parametrize("storage", ["float32", "float16", "int8"])
def test_half_queries_and_lse(storage):
    """A float32 cache takes float16 queries too (read as float32, the output
    rounded to float16: the bits of the float32 call rounded), and return_lse
    gives each row's log-sum-exp, that of the functional call (issue 28)."""
    rng = np.random.default_rng(7)
    cache = fastattn.KVCache(1, 2, 12, 8, storage=storage)
    k = rng.standard_normal((1, 2, 9, 8)).astype(np.float32)
    cache.append(k, k)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float16)
    out, lse = cache.attend(q, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (1, 4, 2)
    want, want_lse = cache.attend(q.astype(np.float32), return_lse=True)
    np.testing.assert_array_equal(out, want.astype(np.float16))
    np.testing.assert_array_equal(lse, want_lse)


def test_16_bit_dtype_says_how_to_store_16_bits():
    with pytest.raises(TypeError, match="pass dtype=np.float32, storage='float16'"):
        fastattn.KVCache(1, 1, 4, 8, dtype=np.float16)
    with pytest.raises(TypeError, match="storage='float16'"):
        fastattn.PagedKVCache(4, 4, 1, 8, dtype=np.float16)


@pytest.mark.parametrize("storage", ["float32", "int8", "int4"])
def test_truncate_is_as_if_never_appended(storage):
    """Rejected draft tokens: a cache truncated back to a prefix, then fed
    other tokens, attends as one that only ever held the prefix and those
    tokens, bit for bit, padding flags included."""
    rng = np.random.default_rng(11)
    B, H, D = 2, 2, 32
    kv = [rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (5, 3, 2)]
    pad = np.zeros((B, 3), bool)
    pad[1, 0] = True
    spec, plain = (fastattn.KVCache(B, H, 16, D, storage=storage) for _ in range(2))
    spec.append(kv[0], kv[0])
    spec.append(kv[1], kv[1], key_padding_mask=pad)  # the drafts, one of them padding
    assert spec.attn_mask is not None
    spec.truncate(5)
    assert spec.length == 5 and spec.attn_mask is None
    spec.append(kv[2], kv[2])
    plain.append(kv[0], kv[0])
    plain.append(kv[2], kv[2])
    q = rng.standard_normal((B, 4, 2, D)).astype(np.float32)
    np.testing.assert_array_equal(spec.attend(q), plain.attend(q))
    spec.truncate(spec.length)  # keeping everything changes nothing
    np.testing.assert_array_equal(spec.attend(q), plain.attend(q))


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test_state_dict_saved_and_loaded_gives_the_same_bits(tmp_path, storage):
    """A cache saved with np.savez(**state_dict()) and loaded into a new one
    of the same sizes attends bit for bit as the original, padding
    included; it may then grow as the original would."""
    pytest.importorskip("ml_dtypes") if storage == "bfloat16" else None
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 2, 7, 16)).astype(np.float32)
    pad = np.zeros((2, 7), bool)
    pad[0, :2] = True
    cache, copy = (fastattn.KVCache(2, 2, 12, 16, storage=storage) for _ in range(2))
    cache.append(k, k, key_padding_mask=pad)
    np.savez(tmp_path / "cache.npz", **cache.state_dict())
    with np.load(tmp_path / "cache.npz") as saved:
        assert copy.check_state_dict(saved) == 7 and copy.length == 0
        copy.load_state_dict(saved)
    q = rng.standard_normal((2, 4, 3, 16)).astype(np.float32)
    np.testing.assert_array_equal(copy.attend(q), cache.attend(q))
    for c in (cache, copy):
        c.append(k[:, :, :2], k[:, :, :2])
    np.testing.assert_array_equal(copy.attend(q), cache.attend(q))


def test_load_state_dict_refuses_another_cache_and_changes_nothing():
    k = np.ones((1, 2, 3, 8), np.float32)
    small = fastattn.KVCache(1, 2, 2, 8)
    other = fastattn.KVCache(1, 2, 8, 8, storage="int8")
    cache = fastattn.KVCache(1, 2, 8, 8)
    cache.append(k, k)
    full = fastattn.KVCache(1, 2, 8, 8)
    full.append(k, k)
    state = full.state_dict()
    with pytest.raises(ValueError, match="the saved cache holds 3 positions; this cache holds "
                                         "0 to 2"):
        small.load_state_dict(state)
    with pytest.raises(ValueError, match="the saved cache has no key_scale"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"the saved value is uint32 of shape \(1, 2, 3, 4\); this cache "
                                         r"expects uint32 of shape \(1, 2, 3, 8\)"):
        cache.load_state_dict({**state, "value": state["value"][..., :4]})
    with pytest.raises(TypeError, match="state must be a mapping of names to arrays"):
        cache.load_state_dict([state["key"]])
    assert cache.length == 3 and small.length == 0 and other.length == 0
    assert not state["key"].flags.writeable  # views of the buffers, read-only
