"""16-bit inputs and 16- and 8-bit key/value caches.

The kernels convert float16 and bfloat16 exactly to float32 as they read
them, so a call on 16-bit arrays must give the bits of the same call on
their float32 conversions, rounded once to the 16-bit dtype: that is checked
bit for bit under hypothesis on every SIMD path, and the float32 call itself
against the float64 reference by the rest of the suite.  Against the
reference directly, the bound is that final rounding (half an ulp: 2**-11
relative for float16, 2**-8 for bfloat16) plus the float32 bound of
conftest.  A cache in int8 holds scale * code with |error| <= max|row| / 254
per element; attention over it is checked against the reference over what
it holds (``cache.key``, ``cache.value``)."""
import warnings

import numpy as np
import pytest
from conftest import assert_close, simd_path, tolerance
from hypothesis import given
from hypothesis import strategies as st
from test_properties import BATCH, FEATURES, KEYS, LENGTHS, PATHS, SEEDS, random_array, random_mask
from test_variants import variants

import fastattn
from fastattn import reference as ref

try:  # bfloat16 is ml_dtypes' (an optional dependency); float16 is tested without it
    import ml_dtypes
    HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
except ImportError:
    HALF = [np.dtype(np.float16)]
sdpa = fastattn.scaled_dot_product_attention
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}  # half an ulp, relative
SMALLEST = {"float16": 2.0**-25, "bfloat16": 2.0**-134}      # half the smallest subnormal


def f32(*arrays):
    return [None if a is None else a.astype(np.float32) for a in arrays]


def assert_rounded_close(actual, expected, dtype, n, magnitude):
    """actual (16-bit) within its rounding of expected (float64) plus the
    float32 bound of a length-n computation."""
    assert actual.dtype == dtype
    err = np.abs(actual.astype(np.float64) - expected)
    bound = (UNIT_ROUNDOFF[dtype.name] * np.abs(expected) + SMALLEST[dtype.name]
             + tolerance(np.float32, n) * max(1.0, magnitude))
    assert np.all((err <= bound) | (np.isnan(actual.astype(np.float64)) & np.isnan(expected)))


@given(st.data())
def test_half_inputs_give_the_bits_of_their_float32_conversion(data):
    draw = data.draw
    dtype = draw(st.sampled_from(HALF))
    rng = np.random.default_rng(draw(SEEDS))
    B, H = draw(BATCH), draw(st.integers(1, 3))
    L, S, E, Ev = draw(LENGTHS), draw(KEYS), draw(FEATURES), draw(FEATURES)
    q = random_array(draw, rng, (B, H, L, E), dtype)
    k = random_array(draw, rng, (B, H, S, E), dtype, minus_inf=draw(st.sampled_from([0, 0.01])))
    v = random_array(draw, rng, (B, H, S, Ev), dtype)
    kwargs = dict(draw(variants(rng, B, H, L, S)),
                  attn_mask=random_mask(draw, rng, (B, H, L, S), np.float32),
                  is_causal=draw(st.booleans()),
                  causal_alignment=draw(st.sampled_from(["upper_left", "lower_right"])))
    with simd_path(draw(PATHS)):
        out, w, lse = sdpa(q, k, v, need_weights=True, return_lse=True, **kwargs)
        o32, w32, lse32 = sdpa(*f32(q, k, v), need_weights=True, return_lse=True, **kwargs)
        outbuf = np.full(out.shape, np.nan, dtype)
        sdpa(q, k, v, out=outbuf, num_threads=draw(st.integers(1, 3)), **kwargs)
    for got, want in ((out, o32), (w, w32), (outbuf, o32)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))
    assert lse.dtype == np.float32  # as FlashAttention's softmax_lse for 16-bit inputs
    np.testing.assert_array_equal(lse, lse32)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_outputs_are_rounded_as_numpy_rounds(simd, dtype):
    """The kernels' float32 -> 16-bit rounding (nearest-even; subnormals,
    overflow, NaN) gives NumPy's and ml_dtypes' bits: random bit patterns
    and every float around the subnormal and overflow edges of float16."""
    rng = np.random.default_rng(5)
    bits = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x32FFFFF0, 0x38800010, 97, dtype=np.uint32),   # 2**-25 .. 2**-14
        np.arange(0x477FE000, 0x47801000, dtype=np.uint32),       # around 65504 .. 65536
        np.array([0, 0x7F7FFFFF, 0x7F800000, 0x7FC00000, 0x7F800001], np.uint32)])
    bits = np.concatenate([bits, bits | 0x80000000])
    x = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = x.astype(dtype)
    got = fastattn._storage.narrow(x, dtype, 2)
    nan = np.isnan(x)
    np.testing.assert_array_equal(got.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
    assert np.isnan(got[nan].astype(np.float32)).all()


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("L", [1, 5])  # the row kernel and the block kernel's tiles
def test_every_16_bit_pattern_is_read_exactly(simd, dtype, L):
    """All 65536 patterns, as values (one key of weight 1: the output is the
    value row) and, the finite ones, as keys (one-hot queries: the score,
    returned as the log-sum-exp of the one key, is the key element); rows
    of 16, so that the vector loads convert them."""
    pattern = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dtype)
    exact = pattern.astype(np.float32)
    v = pattern.reshape(4096, 1, 1, 16)
    q = np.zeros((4096, 1, L, 16), dtype)
    out = sdpa(q, np.zeros((4096, 1, 1, 16), dtype), v, scale=1.0).astype(np.float32)
    for row in np.moveaxis(out, 2, 0):
        same = (row.reshape(-1) == exact) | (np.isnan(row.reshape(-1)) & np.isnan(exact))
        assert same.all()
    finite = pattern[np.isfinite(exact)]
    k = np.zeros((finite.size, 1, 1, 16), dtype)
    k[:, 0, 0, 3] = finite
    q = np.zeros((finite.size, 1, L, 16), dtype)
    q[..., 3] = 1
    _, lse = sdpa(q, k, np.zeros_like(k), scale=1.0, return_lse=True)
    np.testing.assert_array_equal(lse.astype(np.float32)[:, 0, 0], finite.astype(np.float32))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("L,S,E", [(1, 4096, 64), (3, 300, 128), (70, 200, 64), (130, 130, 32)])
def test_half_inputs_against_the_float64_reference(simd, dtype, L, S, E):
    rng = np.random.default_rng(L + S + E)
    q, k, v = (rng.standard_normal((2, 3, n, E)).astype(dtype) for n in (L, S, S))
    mask = rng.random((L, S)) < 0.9
    out = sdpa(q, k, v, attn_mask=mask, is_causal=True, causal_alignment="lower_right")
    expected = ref.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v)), attn_mask=mask, is_causal=True,
        causal_alignment="lower_right")
    assert_rounded_close(out, expected, dtype, E + S, float(np.abs(v.astype(np.float32)).max()))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_half_inputs_keep_the_guards(simd, dtype):
    """A row with every key hidden gives zeros, a NaN score NaN, a
    non-finite value at a hidden key nothing."""
    q = np.ones((1, 1, 3, 8), dtype)
    k = np.ones((1, 1, 5, 8), dtype)
    v = np.ones((1, 1, 5, 8), dtype)
    mask = np.ones((3, 5), bool)
    mask[0] = False
    mask[1, 4] = False
    k[..., 2, 0] = np.nan
    v[..., 4, :] = np.inf
    out = sdpa(q, k, v, attn_mask=mask).astype(np.float32)
    assert np.all(out[0, 0, 0] == 0)
    assert np.all(np.isnan(out[0, 0, 1:]))
    k[..., 2, 0] = 1
    assert np.all(sdpa(q, k, v, attn_mask=mask).astype(np.float32)[0, 0, 1] == 1)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_half_masks_and_per_head_options_in_16_bits(dtype):
    """A float mask, sinks and ALiBi slopes may come in the 16-bit dtype too
    (bfloat16 is not among NumPy's floating dtypes, but is one)."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)).astype(dtype) for _ in range(3))
    mask = np.where(rng.random((5, 5)) < 0.3, -np.inf, 0.5).astype(dtype)
    kw = dict(sinks=np.array([0.5, -1.0], dtype), alibi_slopes=np.array([0.25, 0.5], dtype))
    got = sdpa(q, k, v, attn_mask=mask, **kw)
    want = sdpa(*f32(q, k, v), attn_mask=mask.astype(np.float32),
                **{n: a.astype(np.float32) for n, a in kw.items()})
    np.testing.assert_array_equal(got.view(np.uint16), want.astype(dtype).view(np.uint16))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_merge_attention_of_16_bit_parts(dtype):
    """16-bit outputs and their float32 log-sum-exps merge into the attention
    over all the keys, within two roundings of the 16-bit dtype."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 3, 5, 16)).astype(dtype)
    k, v = (rng.standard_normal((2, 3, 12, 16)).astype(dtype) for _ in range(2))
    parts = [sdpa(q, k[..., a:b, :], v[..., a:b, :], return_lse=True) for a, b in ((0, 5), (5, 12))]
    out, lse = fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == dtype and lse.dtype == np.float32
    exact = ref.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)))
    assert np.abs(out.astype(np.float64) - exact).max() <= 4 * UNIT_ROUNDOFF[dtype.name]
    with pytest.raises(TypeError, match="the log-sum-exps of"):
        fastattn.merge_attention([p[0] for p in parts], [p[1].astype(np.float64) for p in parts])


def test_scale_must_be_finite_in_the_dtype_computed_in():
    q = np.ones((1, 4, 8), np.float32)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        sdpa(q, q, q, scale=1e300)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        sdpa(q.astype(np.float16), q.astype(np.float16), q.astype(np.float16), scale=1e39)
    assert np.isfinite(sdpa(*(a.astype(np.float64) for a in (q, q, q)), scale=1e300)).all()


@pytest.mark.parametrize("option, value, message", [
    ("softcap", 1e300, "softcap must be finite in float32"),
    ("softcap", 1e-50, "softcap must be > 0 in float32"),
    ("alibi_slopes", np.array([1e39]), "alibi_slopes x 8 must be finite in float32"),
    ("alibi_slopes", np.array([-1e38]), "alibi_slopes x 8 must be finite in float32"),
    ("scale", 1e39, "scale must be finite in float32"),
    ("scale", 10 ** 400, "scale must be finite, got 1000"),
])
def test_options_must_be_representable_in_the_dtype_computed_in(option, value, message):
    """float32 kernels round the options to float32, where these would give
    NaN rows (softcap: x / inf * inf or 0 / 0; ALiBi: inf * 0 at the
    diagonal, or +inf biases), so the call refuses them; float64 computes
    them, but for the int beyond float64."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 8)) for _ in range(3))
    cu = np.array([0, 4])
    with pytest.raises(ValueError, match=message):
        sdpa(*(a.astype(np.float32) for a in (q, k, v)), **{option: value})
    with pytest.raises(ValueError, match=message):
        fastattn.varlen_attention(*(a.astype(np.float32).transpose(1, 0, 2) for a in (q, k, v)),
                                  cu, cu, **{option: value})
    if isinstance(value, int):
        return
    got = sdpa(q, k, v, **{option: value})
    exact = ref.scaled_dot_product_attention(q, k, v, **{option: value})
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-13)


@pytest.mark.parametrize("sink", [1e39, -1e39, 1e300, -1e300])
def test_sinks_beyond_float32_act_as_their_limit(sink):
    """A sink logit beyond float32's range rounds to +-inf there: all weight
    to the sink (a zero output) or none, as the float64 reference gives."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 5, 8)) for _ in range(3))
    got = sdpa(*(a.astype(np.float32) for a in (q, k, v)), sinks=np.array([sink, 0.5]))
    exact = ref.scaled_dot_product_attention(q, k, v, sinks=np.array([sink, 0.5]))
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-6)  # float32 (eps 1.2e-7), 5 keys


@pytest.mark.parametrize("S", [2047, 2048, 5000])
@pytest.mark.parametrize("threads", [1, 2])
def test_sink_of_inf_takes_all_the_weight_when_keys_are_split(simd, S, threads):
    """A sink of +inf (1e39 rounds to it in float32) takes all the weight:
    output 0, lse +inf, weights 0, also when a decoding call's keys are
    computed in pieces and merged (S >= 2048), where inf - inf gave NaN."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 1, 8))
    k, v = (rng.standard_normal((1, 2, S, 8)) for _ in range(2))
    sinks = np.array([1e39, 0.5])
    out, w, lse = sdpa(*(a.astype(np.float32) for a in (q, k, v)), sinks=sinks,
                       need_weights=True, return_lse=True, num_threads=threads)
    r_out, r_w, r_lse = ref.scaled_dot_product_attention(q, k, v, sinks=sinks, need_weights=True,
                                                         return_lse=True)
    np.testing.assert_array_equal(out[0, 0], 0)
    np.testing.assert_array_equal(w[0, 0], 0)
    assert lse[0, 0, 0] == np.inf
    # the other head: float32 against float64, S keys (eps 1.2e-7)
    np.testing.assert_allclose(out, r_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(w, r_w, rtol=0, atol=1e-6)
    np.testing.assert_allclose(lse[0, 1], r_lse[0, 1], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_merge_attention_of_a_part_with_lse_inf(dtype):
    """A part whose lse is +inf (it holds a sink of +inf) takes all the
    weight of the merge: its output, lse +inf; NaN only where a part is."""
    o1 = np.zeros((2, 3), dtype)
    o2 = np.arange(6, dtype=dtype).reshape(2, 3)
    l1 = np.array([np.inf, np.nan], dtype)
    l2 = np.array([1.5, 0.0], dtype)
    out, lse = fastattn.merge_attention([o1, o2], [l1, l2])
    np.testing.assert_array_equal(out[0], 0)
    assert lse[0] == np.inf
    assert np.isnan(out[1]).all() and np.isnan(lse[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: d.__name__)
def test_merge_attention_of_lses_far_apart(dtype):
    """lses near the dtype's largest apart (-3e38 and 3e38 in float32): their difference
    overflows to -inf, whose factor 0 is right, silently (no NumPy warning)."""
    big = float(np.finfo(dtype).max) * 0.9
    o1, o2 = np.ones((1, 3), dtype), np.full((1, 3), 2, dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = fastattn.merge_attention([o1, o2], [np.array([-big], dtype),
                                                       np.array([big], dtype)])
    np.testing.assert_array_equal(out, o2)
    np.testing.assert_array_equal(lse, np.array([big], dtype))


def test_half_out_must_have_the_inputs_dtype():
    q = np.zeros((1, 4, 8), np.float16)
    with pytest.raises(TypeError, match="out"):
        sdpa(q, q, q, out=np.zeros((1, 4, 8), np.float32))


@pytest.mark.skipif(not fastattn.available_simd_paths(), reason="no path")
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_half_inputs_against_pytorch(dtype):
    """Not worse than PyTorch's CPU attention in the same dtype: both against
    the float64 reference, RMS error of fastattn at most PyTorch's (plus the
    last rounding, the least either can do)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 4, 256, 64)).astype(dtype) for _ in range(3))
    expected = ref.scaled_dot_product_attention(*(a.astype(np.float64) for a in (q, k, v)),
                                                is_causal=True)
    tdt = torch.float16 if dtype == np.float16 else torch.bfloat16
    t = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a.astype(np.float32)).to(tdt) for a in (q, k, v)), is_causal=True)
    ours = sdpa(q, k, v, is_causal=True).astype(np.float64)
    rms = lambda x: float(np.sqrt(np.mean((x - expected) ** 2)))  # noqa: E731
    floor = rms(expected.astype(dtype).astype(np.float64))
    assert rms(ours) <= max(rms(t.float().numpy().astype(np.float64)), floor) * 1.05


# ---- the cache in 16 and 8 bits ---------------------------------------------------------

STORAGES = ["float16", "int8"] + (["bfloat16"] if len(HALF) == 2 else [])


def filled_cache(storage, rng, B=2, Hkv=2, S=37, D=24, Dv=16, scale=1.0):
    cache = fastattn.KVCache(B, Hkv, S + 8, D, value_dim=Dv, storage=storage)
    k = (rng.standard_normal((B, Hkv, S, D)) * scale).astype(np.float32)
    v = (rng.standard_normal((B, Hkv, S, Dv)) * scale).astype(np.float32)
    k[0, 1, 5] = 0  # an all-zero row: int8 scale 0
    cache.append(k[:, :, :S - 3], v[:, :, :S - 3])
    cache.append(k[:, :, S - 3:], v[:, :, S - 3:])
    return cache, k, v


@pytest.mark.parametrize("storage", STORAGES)
def test_cache_holds_what_its_storage_says(storage):
    rng = np.random.default_rng(1)
    cache, k, v = filled_cache(storage, rng, scale=3.0)
    assert cache.key.dtype == np.float32 and cache.key.shape == k.shape
    if storage == "int8":
        for held, x in ((cache.key, k), (cache.value, v)):
            bound = np.abs(x).max(axis=-1, keepdims=True) / 254
            assert np.all(np.abs(held - x) <= bound * (1 + 1e-6))
        assert np.all(cache.key[0, 1, 5] == 0)  # a row of zeros: scale 0, codes 0
    else:
        for held, x in ((cache.key, k), (cache.value, v)):
            np.testing.assert_array_equal(held, x.astype(cache._key.dtype).astype(np.float32))
    scales = 2 * 4 * 2 * 2 * 45 if storage == "int8" else 0
    item = 1 if storage == "int8" else 2
    assert cache.nbytes == item * 2 * 2 * 45 * (24 + 16) + 2 * 45 + scales


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("L", [1, 3, 37])
def test_cache_attention_reads_its_storage(simd, storage, L):
    """Decoding (L <= 4, keys split when long) and a block of queries over a
    16- or 8-bit cache: the reference over what the cache holds, every
    thread count giving the same bits."""
    rng = np.random.default_rng(L)
    cache, _, _ = filled_cache(storage, rng, S=2500 if L == 1 else 37)
    q = rng.standard_normal((2, 4, L, 24)).astype(np.float32)  # GQA: 4 query heads on 2
    out = cache.attend(q, need_weights=False)
    for threads in (1, 2, 3):
        np.testing.assert_array_equal(cache.attend(q, num_threads=threads), out)
    held_k = np.repeat(cache.key.astype(np.float64), 2, axis=1)
    held_v = np.repeat(cache.value.astype(np.float64), 2, axis=1)
    expected = ref.scaled_dot_product_attention(q.astype(np.float64), held_k, held_v,
                                                is_causal=True, causal_alignment="lower_right")
    S = cache.length
    assert_close(out, expected, np.float32, 24 + S, magnitude=float(np.abs(held_v).max()))
    out_w, w = cache.attend(q, need_weights=True)
    np.testing.assert_array_equal(out_w, out)
    assert w.shape == (2, 4, L, S) and np.allclose(w.sum(-1), 1, atol=1e-5)


@pytest.mark.parametrize("storage", [s for s in STORAGES if s != "int8"])
def test_cache_keeps_nan_and_padding(storage):
    rng = np.random.default_rng(2)
    cache = fastattn.KVCache(1, 1, 8, 4, storage=storage)
    k = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    k[0, 0, 1, 2] = np.nan
    cache.append(k, k, key_padding_mask=np.array([[False, False, True]]))
    q = np.ones((1, 1, 1, 4), np.float32)
    assert np.isnan(cache.attend(q)).all()
    cache.reset()
    cache.append(k[:, :, :1], k[:, :, :1], key_padding_mask=np.array([[True]]))
    assert (cache.attend(q) == 0).all()  # nothing visible: zeros


def test_cache_reads_are_read_only():
    """cache.key and cache.value are read-only whatever the storage (a copy
    for 16 and 8 bits: a write to it would change nothing the cache holds)."""
    for storage in STORAGES + ["float32"]:
        cache = fastattn.KVCache(1, 1, 4, 2, storage=storage)
        cache.append(np.ones((1, 1, 2, 2), np.float32), np.ones((1, 1, 2, 2), np.float32))
        assert not cache.key.flags.writeable and not cache.value.flags.writeable


def test_cache_refuses_what_its_storage_cannot_hold():
    cache = fastattn.KVCache(1, 1, 8, 2, storage="float16")
    big = np.array([[[[1.0, 70000.0]]]], np.float32)
    with pytest.raises(ValueError, match="70000.0, beyond the range of float16 storage"):
        cache.append(big, big * 0)
    assert cache.length == 0
    cache.append(np.full((1, 1, 1, 2), np.inf, np.float32), big * 0)  # inf is kept as inf
    q8 = fastattn.KVCache(1, 1, 8, 2, storage="int8")
    with pytest.raises(ValueError, match="non-finite value, which int8 storage cannot hold"):
        q8.append(big * 0, np.array([[[[1.0, np.nan]]]], np.float32))
    top = np.array([[[[np.finfo(np.float32).max, 1.0]]]], np.float32)
    with pytest.raises(ValueError, match="beyond the range of int8 storage"):
        q8.append(top, big * 0)  # 127 times its scale would read back as inf
    assert q8.length == 0
    q8.append(top * 0.9, big * 0)
    assert np.isfinite(q8.key).all()


def test_bfloat16_needs_ml_dtypes(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_ml_dtypes(name, *args, **kwargs):
        if name == "ml_dtypes":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ml_dtypes)
    with pytest.raises(ImportError, match="pip install ml_dtypes"):
        fastattn.KVCache(1, 1, 8, 2, storage="bfloat16")
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(8, 2).to(torch.bfloat16)
    with pytest.raises(ImportError, match="a bfloat16 module needs the ml_dtypes package"):
        fastattn.MultiHeadAttention.from_torch(module)


# ---- the layer in 16 bits -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_half_layer_is_the_float32_layer_rounded(dtype):
    """A 16-bit MultiHeadAttention computes in float32 with its weights
    converted: the float32 layer's output, rounded once."""
    rng = np.random.default_rng(3)
    half = fastattn.MultiHeadAttention(32, 4, num_kv_heads=2, dtype=dtype, rng=0)
    full = fastattn.MultiHeadAttention(32, 4, num_kv_heads=2, rng=0)
    full.load_state_dict({n: a.astype(np.float32) for n, a in half.state_dict().items()})
    x = rng.standard_normal((2, 9, 32)).astype(dtype)
    y, w = half(x, need_weights=True, is_causal=True)
    y32, w32 = full(x.astype(np.float32), need_weights=True, is_causal=True)
    np.testing.assert_array_equal(y.view(np.uint16), y32.astype(dtype).view(np.uint16))
    np.testing.assert_array_equal(w.view(np.uint16), w32.astype(dtype).view(np.uint16))
    assert not half.in_proj_weight.flags.writeable  # the float32 copies would not see a change
    with pytest.raises(ValueError, match="read-only"):
        half.in_proj_weight[0, 0] = 1
    state = {n: a.astype(np.float32) * 2 for n, a in half.state_dict().items()}
    half.load_state_dict(state)
    full.load_state_dict(state)
    np.testing.assert_array_equal(half(x)[0].view(np.uint16),
                                  full(x.astype(np.float32))[0].astype(dtype).view(np.uint16))


def test_16_bit_layer_refuses_weights_beyond_its_range():
    layer = fastattn.MultiHeadAttention(8, 2, dtype=np.float16, rng=0)
    state = {n: a.astype(np.float32) for n, a in layer.state_dict().items()}
    before = {n: a.copy() for n, a in state.items()}
    state["out_proj.bias"] = state["out_proj.bias"] + 1e6
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.bias'\] holds 1000000.0, beyond"):
        layer.load_state_dict(state)
    for n, a in layer.state_dict().items():  # nothing loaded
        np.testing.assert_array_equal(a.astype(np.float32), before[n])


@pytest.mark.skipif(len(HALF) < 2, reason="ml_dtypes not installed")
def test_bfloat16_torch_module():
    """from_torch reads a bfloat16 nn.MultiheadAttention (NumPy has no
    bfloat16: through float32, exactly) and computes what it computes."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(16, 2, batch_first=True).to(torch.bfloat16).eval()
    layer = fastattn.MultiHeadAttention.from_torch(module)
    assert layer.dtype == HALF[1]
    for name, a in module.state_dict().items():
        np.testing.assert_array_equal(layer.state_dict()[name].astype(np.float32), a.float().numpy())
    x = torch.randn(2, 5, 16).to(torch.bfloat16)
    with torch.no_grad():
        want = module(x, x, x, need_weights=False)[0].float().numpy()
    got = layer(x.float().numpy().astype(HALF[1]))[0].astype(np.float32)
    # both round their projections' inputs and outputs to bfloat16 differently: a few ulps
    np.testing.assert_allclose(got, want, atol=8 * UNIT_ROUNDOFF["bfloat16"] * np.abs(want).max())


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("storage", [None, "float32", "int8"])
def test_half_layer_decodes_with_its_cache(dtype, storage):
    rng = np.random.default_rng(4)
    layer = fastattn.MultiHeadAttention(32, 4, dtype=dtype, rng=1)
    x = rng.standard_normal((2, 6, 32)).astype(dtype)
    full, _ = layer(x, is_causal=True)
    cache = layer.new_cache(2, 8, storage=storage)
    assert cache.dtype == np.float32 and cache.storage == (storage or dtype.name)
    steps = np.concatenate([layer(x[:, t:t + 1], cache=cache)[0] for t in range(6)], axis=1)
    assert steps.dtype == dtype
    # the cache's own rounding (16 bits) or quantisation (int8) of k and v
    tol = 0.02 if storage == "int8" else 2 * UNIT_ROUNDOFF[dtype.name] * 4
    np.testing.assert_allclose(steps.astype(np.float32), full.astype(np.float32), atol=tol)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_a_half_precision_scale(dtype):
    """scale may be a 16-bit scalar, bfloat16 (ml_dtypes') as float16."""
    q = np.random.default_rng(3).standard_normal((2, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(
        fastattn.scaled_dot_product_attention(q, q, q, scale=dtype.type(0.5)),
        fastattn.scaled_dot_product_attention(q, q, q, scale=0.5))
