"""precision="int8": integer dot products against int8 and int4 caches.

Against the readable twin, reference.int8_query: the query rounded to int8
as the kernels round it, read back in float64, then exact attention over
the keys and values the cache holds (decoded).  Against int4 values what is
left between the two is float32 rounding after exact integer sums, so the
suite's usual bound applies (conftest.tolerance).  Against int8 values the
kernels also round the weights of each group of 32 key positions to 7 bits
of their largest, which moves an output by at most the sum over the groups
of (largest weight x value scale) / 254 x 32 x 128 (|code| <= 128): that
bound is added.  Against the original float64 data, the mode's own error
is bounded per storage by what README's table states."""
import contextlib

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import assert_close, simd_path, tolerance, without_int8_dot

STORAGES = ["int8", "int4"]
# the query's scale groups: one per row against int8, a q4_0 block against int4
GROUP = {"int8": None, "int4": 32}
WEIGHT_GROUP = 32  # key positions whose weights share a scale (int8 values)


def filled(rng, storage, B=2, Hkv=2, S=300, E=64, Ev=None):
    cache = fastattn.KVCache(B, Hkv, S + 8, E, value_dim=Ev, storage=storage)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, Ev or E), dtype=np.float32)
    cache.append(k, v)
    return cache, k, v


def weight_rounding(weights, value_scale):
    """The most that rounding each group's weights to 7 bits moves an output
    element: weights (B, Hq, L, S) of the twin, value_scale (B, Hkv, S)."""
    group = weights.shape[1] // value_scale.shape[1]
    w = weights * np.repeat(value_scale, group, axis=1)[:, :, None, :]
    S = w.shape[-1]
    w = np.pad(w, [(0, 0)] * 3 + [(0, -S % WEIGHT_GROUP)])
    largest = w.reshape(w.shape[:3] + (-1, WEIGHT_GROUP)).max(axis=-1)
    return (largest * WEIGHT_GROUP * 128 / 254).sum(axis=-1)  # (B, Hq, L)


def check(out, cache, query, storage, v, **options):
    """out within the float32 bound of the twin, plus, against int8 values,
    the bound of the weights' rounding (v: the values before they were stored)."""
    q = ref.int8_query(query, GROUP[storage])
    expected, weights = ref.scaled_dot_product_attention(
        q, cache.key.astype(np.float64), cache.value.astype(np.float64), is_causal=True,
        causal_alignment="lower_right", enable_gqa=True, need_weights=True, **options)
    if storage == "int4":
        assert_close(out, expected, np.float32, query.shape[-1] + cache.length)
        return
    value_scale = (np.abs(v).max(axis=-1) / 127).astype(np.float32).astype(np.float64)
    bound = weight_rounding(weights, value_scale)[..., None]
    bound = bound + tolerance(np.float32, query.shape[-1] + cache.length)
    assert np.all(np.abs(out - expected) <= bound), np.max(np.abs(out - expected) - bound)


VARIANTS = {
    "plain": {},
    "window": {"window_size": (40, 0)},
    "softcap": {"softcap": 3.0},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625, 0.5, 0.25, 0.125, 0.0625])},
    "sinks": {"sinks": np.linspace(-1, 2, 8)},
}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("E", [64, 80, 128])
@pytest.mark.parametrize("L", [1, 2])
def test_matches_the_reference_twin(simd, rng, storage, E, L):
    cache, _, v = filled(rng, storage, E=E)
    q = rng.standard_normal((2, 4, L, E), dtype=np.float32)  # 2 query heads per key/value head
    check(cache.attend(q, precision="int8"), cache, q, storage, v)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant(rng, storage, variant):
    cache, _, v = filled(rng, storage, Hkv=4)
    q = rng.standard_normal((2, 8, 1, 64), dtype=np.float32)
    options = VARIANTS[variant]
    check(cache.attend(q, precision="int8", **options), cache, q, storage, v, **options)


@pytest.mark.parametrize("storage", STORAGES)
def test_split_keys_and_long_rows(rng, storage):
    """Decoding splits keys past 2048 into pieces merged by their lse."""
    cache, _, v = filled(rng, storage, B=1, S=5000)
    q = rng.standard_normal((1, 2, 1, 64), dtype=np.float32)
    check(cache.attend(q, precision="int8"), cache, q, storage, v)


@pytest.mark.parametrize("storage", STORAGES)
def test_same_bits_for_any_threads_blocks_and_batch(rng, storage):
    cache, k, v = filled(rng, storage, B=1, S=700)
    q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    dense = cache.attend(q, precision="int8", num_threads=1)
    assert np.array_equal(dense, cache.attend(q, precision="int8", num_threads=2))
    packed_q = q[0].transpose(1, 0, 2).copy()  # (1, Hq, E)
    for block_size in (16, 48):
        paged = fastattn.PagedKVCache(num_blocks=200, block_size=block_size, num_kv_heads=2,
                                      head_dim=64, storage=storage)
        other = paged.add_sequence()  # a sequence before ours, in blocks between its blocks
        mine = paged.add_sequence()
        for start in range(0, 700, 100):
            rows = slice(start, start + 100)
            paged.append([other, mine],
                          np.concatenate([k[0][:, rows].transpose(1, 0, 2)[:50] * 2,
                                          k[0][:, rows].transpose(1, 0, 2)]),
                          np.concatenate([v[0][:, rows].transpose(1, 0, 2)[:50],
                                          v[0][:, rows].transpose(1, 0, 2)]),
                          cu_seqlens=np.array([0, 50, 150]))
        alone = paged.attend([mine], packed_q, precision="int8")
        both = paged.attend([other, mine], np.concatenate([packed_q, packed_q]), precision="int8",
                            num_threads=2)
        assert np.array_equal(alone[0], dense[0, :, 0])
        assert np.array_equal(both[1], dense[0, :, 0])


@pytest.mark.skipif(not {"avx2", "avx512"} <= set(fastattn.available_simd_paths()),
                    reason="needs the AVX2 and AVX-512 paths")
@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("E, Ev", [(64, 64), (128, 128), (48, 80), (256, 96)])
def test_avx512_gives_the_avx2_paths_bits(rng, storage, E, Ev):
    """The AVX-512 path sums the codes with AVX-512 VNNI's vpdpbusd where
    the CPU has it, AVX2's vpmaddubsw + vpmaddwd otherwise; the AVX2 path
    with AVX-VNNI's vpdpbusd where the CPU has it: exact int32 sums every
    way, and the same float steps after them, so the same bits (E, Ev of
    48, 80: the sums' tails in C; 5 query rows: the block kernel's tiles)."""
    cache, _, _ = filled(rng, storage, B=2, S=1100, E=E, Ev=Ev)
    q = rng.standard_normal((2, 8, 2, E), dtype=np.float32)
    rows = rng.standard_normal((2, 8, 5, E), dtype=np.float32)
    with simd_path("avx2"), without_int8_dot():
        expected = cache.attend(q, precision="int8"), cache.attend(rows, precision="int8")
    for path in ("avx2", "avx512"):
        for base in (False, True):
            with simd_path(path), without_int8_dot() if base else contextlib.nullcontext():
                out = cache.attend(q, precision="int8"), cache.attend(rows, precision="int8")
            assert np.array_equal(out[0], expected[0]) and np.array_equal(out[1], expected[1])


def test_paged_attention_over_a_callers_pool(rng):
    """vLLM's layout: int8 codes with per-row scales, a block shared."""
    codes = rng.integers(-128, 128, size=(6, 2, 16, 64), dtype=np.int8)  # -128 too
    scales = rng.uniform(0.01, 0.02, size=(6, 2, 16)).astype(np.float32)
    table = np.array([[3, 1, 4], [5, 1, 0]], np.int32)
    q = rng.standard_normal((2, 4, 64), dtype=np.float32)
    out = fastattn.paged_attention(q, codes, codes, table, np.array([40, 33]), np.array([0, 1, 2]),
                                   k_scale=scales, v_scale=scales, precision="int8")
    for b, n in enumerate((40, 33)):
        rows = (codes[table[b]] * scales[table[b]][..., None]).transpose(1, 0, 2, 3)
        kv = rows.reshape(2, -1, 64)[:, :n].astype(np.float64)
        expected, weights = ref.scaled_dot_product_attention(
            ref.int8_query(q[b][:, None, :]), kv, kv, enable_gqa=True, need_weights=True)
        scale = scales[table[b]].transpose(1, 0, 2).reshape(2, -1)[:, :n].astype(np.float64)
        bound = weight_rounding(weights[None], scale[None])[0] + tolerance(np.float32, 64 + n)
        assert np.all(np.abs(out[b] - expected[:, 0]) <= bound)


@pytest.mark.parametrize("storage", STORAGES)
def test_nan_stays_nan_and_zero_scores(rng, storage):
    cache, _, _ = filled(rng, storage, B=1)
    q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    q[0, 1, 0, 5] = np.nan
    q[0, 2] = 0  # scores all 0: int4 values' mean with the exact mode's bits
    out = cache.attend(q, precision="int8")
    assert np.isnan(out[0, 1]).all() and np.isfinite(out[0, [0, 2, 3]]).all()
    if storage == "int4":  # (int8 values: their weights rounded, test_every_variant's bound)
        assert np.array_equal(out[0, 2], cache.attend(q, precision="exact")[0, 2])


@pytest.mark.parametrize("storage, bound", [("int8", 0.02), ("int4", 0.2)])
def test_error_against_float64(rng, storage, bound):
    """The whole error (the cache's rounding and the query's) against
    float64 attention of the data before it was stored: on random normal
    keys within bound, and with a per-channel bias four times the keys'
    spread, within a third more than the exact mode's own (which the
    cache's rows set: README, "The int8 mode", gives the figures)."""
    for bias in (0.0, 4.0):
        cache = fastattn.KVCache(1, 4, 2048, 128, storage=storage)
        k = rng.standard_normal((1, 4, 2048, 128)).astype(np.float32)
        k += np.float32(bias) * rng.standard_normal(128).astype(np.float32)
        v = rng.standard_normal((1, 4, 2048, 128)).astype(np.float32)
        cache.append(k, v)
        q = rng.standard_normal((1, 4, 1, 128)).astype(np.float32)
        exact = ref.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)))
        errors = {}
        for precision in ("exact", "int8"):
            out = cache.attend(q, precision=precision)
            errors[precision] = np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact ** 2))
        assert errors["int8"] <= 1.3 * errors["exact"] + 5e-3, (bias, errors)
        if bias == 0:
            assert errors["int8"] < bound, errors


def test_float_caches_and_default_stay_exact(rng):
    cache, _, _ = filled(rng, None)
    q = rng.standard_normal((2, 4, 1, 64), dtype=np.float32)
    assert np.array_equal(cache.attend(q, precision="int8"), cache.attend(q))


@pytest.mark.parametrize("bad, error", [("fast", ValueError), ("INT8", ValueError),
                                        (8, TypeError), (None, TypeError)])
def test_bad_precision(rng, bad, error):
    cache, _, _ = filled(rng, "int8")
    q = rng.standard_normal((2, 4, 1, 64), dtype=np.float32)
    with pytest.raises(error, match="precision"):
        cache.attend(q, precision=bad)
    paged = fastattn.PagedKVCache(num_blocks=2, block_size=16, num_kv_heads=2, head_dim=64,
                                  storage="int8")
    s = paged.add_sequence()
    paged.append([s], q[0, :2].transpose(1, 0, 2), q[0, :2].transpose(1, 0, 2))
    with pytest.raises(error, match="precision"):
        paged.attend([s], q[0].transpose(1, 0, 2), precision=bad)
    with pytest.raises(error, match="precision"):
        fastattn.paged_attention(q[0].transpose(1, 0, 2), np.zeros((1, 2, 16, 64), np.int8),
                                 np.zeros((1, 2, 16, 64), np.int8), np.zeros((1, 1), np.int32),
                                 np.array([1]), np.array([0, 1]),
                                 k_scale=np.ones((1, 2, 16), np.float32),
                                 v_scale=np.ones((1, 2, 16), np.float32), precision=bad)


def test_multi_head_attention_decodes_in_the_mode(rng):
    mha = fastattn.MultiHeadAttention(64, 4, num_kv_heads=2, rng=0)
    steps = rng.standard_normal((6, 2, 1, 64), dtype=np.float32)
    outs = {}
    for precision, threads in (("exact", 1), ("int8", 1), ("int8", 2)):
        cache = mha.new_cache(2, 16, storage="int8")
        outs[precision, threads] = np.stack([
            mha(x, cache=cache, precision=precision, num_threads=threads)[0] for x in steps])
    assert np.array_equal(outs["int8", 1], outs["int8", 2])
    assert not np.array_equal(outs["int8", 1], outs["exact", 1])
    np.testing.assert_allclose(outs["int8", 1], outs["exact", 1], atol=0.05 * np.abs(
        outs["exact", 1]).max())
    with pytest.raises(ValueError, match="precision"):
        mha(steps[0], precision="fp8")


@pytest.mark.parametrize("storage", STORAGES)
def test_weights_and_lse_come_from_the_integer_scores(rng, storage):
    """need_weights and return_lse read the mode's scores: against the
    twin's, whose query is the mode's (the values' rounding moves neither)."""
    cache, _, _ = filled(rng, storage, B=1)
    q = rng.standard_normal((1, 4, 1, 64), dtype=np.float32)
    out, w, lse = cache.attend(q, precision="int8", need_weights=True, return_lse=True)
    _, w_ref, lse_ref = ref.scaled_dot_product_attention(
        ref.int8_query(q, GROUP[storage]), cache.key.astype(np.float64),
        cache.value.astype(np.float64), enable_gqa=True, need_weights=True, return_lse=True)
    assert_close(w, w_ref, np.float32, 64 + cache.length)
    assert_close(lse, lse_ref, np.float32, 64 + cache.length, magnitude=np.abs(lse_ref).max())


@pytest.mark.parametrize("storage", STORAGES)
def test_a_ragged_call_rounds_only_its_decoding_sequences(rng, storage):
    """One paged_attention call: a prefill chunk of 9 rows (the block
    kernel: integer products against int8 caches, exact against int4)
    beside a decoding token (integer products); each sequence's bits are
    those of a call of its own in that mode."""
    paged = fastattn.PagedKVCache(num_blocks=40, block_size=16, num_kv_heads=2, head_dim=64,
                                  storage=storage)
    a, b = paged.add_sequence(), paged.add_sequence()
    k = rng.standard_normal((260, 2, 64), dtype=np.float32)
    paged.append([a, b], k, k[::-1].copy(), cu_seqlens=np.array([0, 120, 260]))
    q = rng.standard_normal((10, 4, 64), dtype=np.float32)
    both = paged.attend([a, b], q, np.array([0, 9, 10]), precision="int8")
    chunk = "int8" if storage == "int8" else "exact"
    assert np.array_equal(both[:9], paged.attend([a], q[:9], np.array([0, 9]), precision=chunk))
    assert np.array_equal(both[9:], paged.attend([b], q[9:], precision="int8"))
    assert not np.array_equal(both[9:], paged.attend([b], q[9:]))


def test_longer_calls_against_int4_stay_exact(rng):
    """Calls of more than 4 query rows against int4 caches keep the exact
    bits in every row, a last block of 1-4 rows of the block kernel
    included (its integer products take int8 keys only)."""
    cache, _, _ = filled(rng, "int4", B=1, S=150)
    for L in (5, 65, 68):
        q = rng.standard_normal((1, 4, L, 64), dtype=np.float32)
        assert np.array_equal(cache.attend(q, precision="int8"), cache.attend(q))


def test_longer_calls_against_int8_round_every_row(rng):
    """Calls of more than 4 query rows against int8 caches take integer
    products in every row (the block kernel's, fa_kern_iblock.h, and the
    row kernel's for a last block of 1-4 rows), within the twin's bound of
    the query's rounding and the weights' (7 bits per 64 keys there: twice
    the decoding groups' bound covers them); and rows the block kernel
    computes again (values near float32's largest, whose weights times
    their scales overflow there) come out finite."""
    cache, _, v = filled(rng, "int8", B=1, S=150)
    for L in (5, 65, 68):
        q = rng.standard_normal((1, 4, L, 64), dtype=np.float32)
        out = cache.attend(q, precision="int8")
        assert not np.array_equal(out, cache.attend(q))
        expected, weights = ref.scaled_dot_product_attention(
            ref.int8_query(q), cache.key.astype(np.float64), cache.value.astype(np.float64),
            is_causal=True, causal_alignment="lower_right", enable_gqa=True, need_weights=True)
        value_scale = (np.abs(v).max(axis=-1) / 127).astype(np.float32).astype(np.float64)
        bound = 2 * weight_rounding(weights, value_scale)[..., None] + tolerance(np.float32, 214)
        assert np.all(np.abs(out - expected) <= bound)
    big = fastattn.KVCache(1, 1, 100, 64, storage="int8")
    big.append(rng.standard_normal((1, 1, 100, 64), dtype=np.float32),
               (rng.standard_normal((1, 1, 100, 64)) * 1e38).clip(-3e38, 3e38).astype(np.float32))
    q = rng.standard_normal((1, 1, 8, 64), dtype=np.float32)
    out, exact = big.attend(q, precision="int8"), big.attend(q)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, exact, rtol=0, atol=3e-2 * np.abs(exact).max())


def test_value_scales_that_are_negative_or_subnormal(simd, rng):
    """Groups whose weights a negative scale makes negative, or whose scale
    would be subnormal (a code past 127), are summed exactly."""
    codes = rng.integers(-128, 128, size=(4, 1, 16, 32), dtype=np.int8)
    table, lens, cu = np.array([[2, 0, 3, 1]], np.int32), np.array([64]), np.array([0, 1])
    q = rng.standard_normal((1, 1, 32), dtype=np.float32)
    for v_scale in (-rng.uniform(0.01, 0.02, size=(4, 1, 16)), np.full((4, 1, 16), 3.3e-41)):
        k_scale = np.full((4, 1, 16), 0.01, np.float32)
        args = (q, codes, codes, table, lens, cu)
        exact = fastattn.paged_attention(*args, k_scale=k_scale, v_scale=v_scale.astype(np.float32))
        mode = fastattn.paged_attention(*args, k_scale=k_scale, v_scale=v_scale.astype(np.float32),
                                        precision="int8")
        # the query's rounding alone: 30 % off (a saturated code) or a sign lost would not pass
        np.testing.assert_allclose(mode, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def test_no_features_and_the_largest_head(rng):
    """E = 0 against int4 keys (every score 0), and E past the integer
    sums' bound (FA_IDOT_MAX_E = 65536): the exact call's bits."""
    paged = fastattn.PagedKVCache(num_blocks=4, block_size=16, num_kv_heads=1, head_dim=0,
                                  value_dim=32, storage="int4")
    s = paged.add_sequence()
    paged.append([s], np.zeros((5, 1, 0), np.float32),
                 rng.standard_normal((5, 1, 32), dtype=np.float32), cu_seqlens=np.array([0, 5]))
    q = np.zeros((1, 1, 0), np.float32)
    assert np.array_equal(paged.attend([s], q, precision="int8"), paged.attend([s], q))
    wide = fastattn.KVCache(1, 1, 4, 65537, storage="int8")
    wide.append(*rng.standard_normal((2, 1, 1, 4, 65537), dtype=np.float32))
    q = rng.standard_normal((1, 1, 1, 65537), dtype=np.float32)
    assert np.array_equal(wide.attend(q, precision="int8"), wide.attend(q))
