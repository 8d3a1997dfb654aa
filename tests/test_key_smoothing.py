"""smooth_k and rotate_k: a cache's keys stored less their mean and rotated.

Both leave every logit unchanged in exact arithmetic, so the results are
checked against the float64 reference over the keys as appended: within
the float32 bound of a float32 cache (which adds only the rotation's and
the subtraction's rounding: a sum of head_dim terms, inside the suite's
bound for E + S), and within the storage's own error for int8 and int4,
which the options lower on keys with a per-channel bias or outlier
channels (the figures of README's low-precision guide).  The twin is
reference.stored_keys with reference.hadamard, built entry by entry."""
import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import assert_close, tolerance

BOTH = [(True, False), (False, True), (True, True)]


def keys_with_bias(rng, shape, bias=4.0):
    """Normal keys plus a per-channel bias `bias` times their spread."""
    k = rng.standard_normal(shape)
    return (k + bias * rng.standard_normal(shape[-1])).astype(np.float32)


def expected(q, k, v, **options):
    return ref.scaled_dot_product_attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), is_causal=True,
        causal_alignment="lower_right", enable_gqa=True, **options)


def rel_rms(out, exact):
    return float(np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact ** 2)))


@pytest.mark.parametrize("n", [0, 1, 2, 64, 80, 96, 128])
def test_rotation_is_the_twins_and_its_own_inverse(n):
    from fastattn._keys import hadamard, rotate
    h = ref.hadamard(n)
    np.testing.assert_array_equal(hadamard(n, "float64"), h)
    np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-15)
    np.testing.assert_array_equal(h, h.T)
    x = np.random.default_rng(n).standard_normal((3, 200, n)).astype(np.float32)
    np.testing.assert_allclose(rotate(x), x.astype(np.float64) @ h, rtol=0, atol=1e-5)
    # a row's bits do not depend on the rows beside it
    np.testing.assert_array_equal(rotate(x[1:2, 2:3]), rotate(x)[1:2, 2:3])
    np.testing.assert_array_equal(rotate(x[:, ::-1])[:, ::-1], rotate(x))


@pytest.mark.parametrize("L", [1, 3, 70])  # the row kernel, GQA heads together, the block kernel
@pytest.mark.parametrize("options", [
    {}, {"softcap": 5.0}, {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    {"alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4])}, {"window_size": (20, 0)},
], ids=["plain", "softcap", "sinks", "alibi", "window"])
@pytest.mark.parametrize("smooth,rotate", BOTH)
def test_logits_unchanged_in_every_variant(L, options, smooth, rotate):
    """softcap and sinks see the logits themselves, and lse returns them:
    the mean's term must be back in every score, not only cancel in the
    softmax."""
    rng = np.random.default_rng(L)
    B, H, Hq, S, E = 2, 2, 4, 300, 64
    k, v = keys_with_bias(rng, (B, H, S, E)), rng.standard_normal((B, H, S, E), dtype=np.float32)
    q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    cache = fastattn.KVCache(B, H, S, E, smooth_k=smooth, rotate_k=rotate)
    cache.append(k, v)
    out, weights, lse = cache.attend(q, need_weights=True, return_lse=True, **options)
    want, want_w, want_lse = expected(q, k, v, need_weights=True, return_lse=True, **options)
    # the keys' bias (about 4 x 3 per feature) makes scores of magnitude ~ 50
    assert_close(out, want, np.float32, E + S, magnitude=50)
    assert_close(weights, want_w, np.float32, E + S, magnitude=50)
    assert_close(lse, want_lse, np.float32, E + S, magnitude=50)


@pytest.mark.parametrize("storage", ["int8", "int4"])
@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_bias_error_within_the_issue_bounds(storage, precision):
    """Keys with a per-channel bias four times their spread: smoothing
    brings int8 to <= 2e-2 and int4 to <= 0.2 rel RMS (measured 1.4e-2 and
    0.13; without it 3.0e-2 and 0.45)."""
    rng = np.random.default_rng(0)
    shape = (1, 8, 4096, 128)
    k, v = keys_with_bias(rng, shape), rng.standard_normal(shape, dtype=np.float32)
    q = rng.standard_normal((1, 8, 1, 128), dtype=np.float32)
    exact = expected(q, k, v)
    errors = []
    for smooth in (False, True):
        cache = fastattn.KVCache(1, 8, 4096, 128, storage=storage, smooth_k=smooth)
        cache.append(k, v)
        errors.append(rel_rms(cache.attend(q, precision=precision).astype(np.float64), exact))
    assert errors[1] <= (2e-2 if storage == "int8" else 0.2) < errors[0]


def test_rotation_lowers_int4_error_on_outlier_channels():
    """Four channels twenty times the others' spread: rotation spreads them
    over every block of 32 (measured 0.60 -> 0.42 rel RMS, 0.38 with
    smoothing too)."""
    rng = np.random.default_rng(0)
    shape = (1, 8, 2048, 128)
    k, v = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    k[..., rng.choice(128, 4, replace=False)] *= 20
    q = rng.standard_normal((1, 8, 1, 128), dtype=np.float32)
    exact = expected(q, k, v)
    errors = []
    for rotate in (False, True):
        cache = fastattn.KVCache(1, 8, 2048, 128, storage="int4", rotate_k=rotate)
        cache.append(k, v)
        errors.append(rel_rms(cache.attend(q).astype(np.float64), exact))
    assert errors[1] < 0.8 * errors[0]


@pytest.mark.parametrize("smooth,rotate", BOTH)
def test_stored_codes_and_key_read_back(smooth, rotate):
    """The cache quantises the twin's stored keys (the mean of the first
    append's real tokens, padding left out), and `key` gives the keys as
    appended, within int8's rounding."""
    rng = np.random.default_rng(3)
    B, H, E = 2, 2, 80
    k1, k2 = keys_with_bias(rng, (B, H, 5, E)), keys_with_bias(rng, (B, H, 3, E))
    k1[1, :, 0] = 1e4  # padding: out of the mean
    pad = np.zeros((B, 5), bool)
    pad[1, 0] = True
    v1, v2 = np.zeros((B, H, 5, E), np.float32), np.zeros((B, H, 3, E), np.float32)
    cache = fastattn.KVCache(B, H, 16, E, storage="int8", smooth_k=smooth, rotate_k=rotate)
    cache.append(k1, v1, key_padding_mask=pad)
    cache.append(k2, v2)
    rotated = ref.stored_keys(np.concatenate([k1, k2], axis=2), rotate)
    mean = None
    if smooth:
        real = ~pad[:, None, :, None]
        mean = (rotated[:, :, :5] * real).sum(axis=2) / real.sum(axis=2)
        saved = cache.state_dict()["key_mean"].view(np.float32)
        np.testing.assert_allclose(saved, mean, rtol=1e-6, atol=1e-4)
        mean = saved.astype(np.float64)[:, :, None]
    stored = ref.stored_keys(np.concatenate([k1, k2], axis=2), rotate, mean)
    codes = cache.state_dict()["key"].view(np.int8).astype(np.float64)
    scales = cache.state_dict()["key_scale"].view(np.float32).astype(np.float64)[..., None]
    err = np.abs(codes * scales - stored)
    # half a step of each row's scale, plus float32's rounding of the transform
    assert np.all(err <= 0.5 * scales + 1e-5 * np.abs(stored).max(axis=-1, keepdims=True))
    held = cache.key.astype(np.float64)
    original = np.concatenate([k1, k2], axis=2).astype(np.float64)
    real = np.concatenate([~pad, np.ones((B, 3), bool)], axis=1)[:, None, :, None]
    step = np.sqrt(E) * scales  # the rows' rounding, rotated back: at most sqrt(E) x
    assert np.all(np.where(real, np.abs(held - original) <= step, True))


@pytest.mark.parametrize("L", [1, 6])  # the row kernel, the block kernel
@pytest.mark.parametrize("storage,precision", [
    ("float32", "exact"), ("int8", "exact"), ("int8", "int8"), ("int4", "exact"), ("int4", "int8")])
def test_a_mean_term_past_float32s_range_gives_no_nan(L, storage, precision):
    """Queries of 1e37 against keys of mean 1 (E = 100): the mean's term,
    about 1e38, was rounded to float32 as q . m = 1e39 before the scale
    (inf), so the rows came out NaN in both modes; every logit is finite,
    and 1e36 and more apart, so each row is its largest logit's value row,
    as in the cache without smoothing (int4 aside)."""
    rng = np.random.default_rng(L)
    k = (1 + 0.1 * rng.standard_normal((1, 2, 50, 100))).astype(np.float32)
    v = rng.standard_normal((1, 2, 50, 100)).astype(np.float32)
    q = np.full((1, 2, L, 100), 1e37, np.float32)
    outs = []
    for smooth in (False, True):
        cache = fastattn.KVCache(1, 2, 50, 100, storage=storage, smooth_k=smooth)
        cache.append(k, v)
        outs.append(cache.attend(q, precision=precision, is_causal=False))
    assert np.isfinite(outs[1]).all()
    if storage != "int4":  # int4's steps (an eighth of the largest, 0.14) exceed the spread (0.1)
        np.testing.assert_allclose(outs[1], outs[0], atol=1e-6)


def test_mean_fixed_until_reset():
    rng = np.random.default_rng(4)
    cache = fastattn.KVCache(1, 1, 16, 32, storage="int8", smooth_k=True)
    k = keys_with_bias(rng, (1, 1, 4, 32))
    cache.append(k, k)
    first = cache.state_dict()["key_mean"].copy()
    cache.append(k + 100, k)  # later steps keep the prompt's mean
    np.testing.assert_array_equal(cache.state_dict()["key_mean"], first)
    cache.truncate(2)
    np.testing.assert_array_equal(cache.state_dict()["key_mean"], first)
    cache.reset()
    cache.append(k + 100, k)
    np.testing.assert_allclose(cache.state_dict()["key_mean"].view(np.float32),
                               k.astype(np.float64).mean(axis=2) + 100, rtol=1e-6)


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_bits_do_not_depend_on_threads_or_batch(precision):
    rng = np.random.default_rng(5)
    B, H, S, E = 3, 2, 2100, 64  # past 2048 keys: the keys split over threads
    k, v = keys_with_bias(rng, (B, H, S, E)), rng.standard_normal((B, H, S, E), dtype=np.float32)
    q = rng.standard_normal((B, 4, 1, E), dtype=np.float32)
    whole = fastattn.KVCache(B, H, S, E, storage="int8", smooth_k=True, rotate_k=True)
    whole.append(k, v)
    outs = [whole.attend(q, precision=precision, num_threads=t) for t in (1, 2)]
    np.testing.assert_array_equal(outs[0], outs[1])
    alone = fastattn.KVCache(1, H, S, E, storage="int8", smooth_k=True, rotate_k=True)
    alone.append(k[1:2], v[1:2])
    np.testing.assert_array_equal(alone.attend(q[1:2], precision=precision), outs[0][1:2])


@pytest.mark.parametrize("storage", ["float32", "int4"])
def test_paged_cache_fork_truncate_and_placement(storage):
    """Per-sequence means: a fork keeps its parent's; each sequence's result
    is bitwise that of the same tokens in a cache of its own, whatever
    the blocks' placement."""
    rng = np.random.default_rng(6)
    H, Hq, E = 2, 4, 64
    lens = [5, 40, 1]
    ks = [keys_with_bias(rng, (n, H, E)) for n in lens]
    vs = [rng.standard_normal((n, H, E), dtype=np.float32) for n in lens]
    cache = fastattn.PagedKVCache(64, 16, H, E, storage=storage, smooth_k=True, rotate_k=True)
    ids = [cache.add_sequence() for _ in lens]
    cu = np.concatenate([[0], np.cumsum(lens)])
    cache.append(ids, np.concatenate(ks), np.concatenate(vs), cu)
    child = cache.fork(ids[1])
    new_k = keys_with_bias(rng, (4, H, E))
    new_v = rng.standard_normal((4, H, E), dtype=np.float32)
    cache.append(ids + [child], new_k, new_v)
    q = rng.standard_normal((4, Hq, E), dtype=np.float32)
    out, lse = cache.attend(ids + [child], q, return_lse=True, softcap=4.0)
    for b, (kk, vv) in enumerate(zip(ks + [ks[1]], vs + [vs[1]])):
        K = np.concatenate([kk, new_k[b:b + 1]]).transpose(1, 0, 2)[None]
        V = np.concatenate([vv, new_v[b:b + 1]]).transpose(1, 0, 2)[None]
        if storage == "float32":
            want = expected(q[b][None, :, None], K, V, softcap=4.0)
            assert_close(out[b], want[0, :, 0], np.float32, E + K.shape[2], magnitude=50)
        own = fastattn.PagedKVCache(8, 16, H, E, storage=storage, smooth_k=True, rotate_k=True)
        s = own.add_sequence()
        own.append([s], kk, vv, np.array([0, len(kk)]))
        own.append([s], new_k[b:b + 1], new_v[b:b + 1])
        np.testing.assert_array_equal(own.attend([s], q[b:b + 1], softcap=4.0), out[b:b + 1])
    cache.truncate([ids[0]], [0])  # forgets the mean: the next append sets it again
    cache.append([ids[0]], new_k[:1] + 50, new_v[:1])
    fresh = fastattn.PagedKVCache(8, 16, H, E, storage=storage, smooth_k=True, rotate_k=True)
    s = fresh.add_sequence()
    fresh.append([s], new_k[:1] + 50, new_v[:1])
    np.testing.assert_array_equal(cache.attend([ids[0]], q[:1]), fresh.attend([s], q[:1]))


def test_state_dict_round_trip_and_mismatch():
    rng = np.random.default_rng(7)
    k = keys_with_bias(rng, (1, 2, 6, 32))
    cache = fastattn.KVCache(1, 2, 8, 32, storage="int8", smooth_k=True, rotate_k=True)
    cache.append(k, k)
    state = {name: a.copy() for name, a in cache.state_dict().items()}
    other = fastattn.KVCache(1, 2, 8, 32, storage="int8", smooth_k=True, rotate_k=True)
    other.load_state_dict(state)
    q = rng.standard_normal((1, 2, 1, 32), dtype=np.float32)
    np.testing.assert_array_equal(other.attend(q), cache.attend(q))
    np.testing.assert_array_equal(other.key, cache.key)
    for smooth, rotate in ((False, True), (True, False), (False, False)):
        plain = fastattn.KVCache(1, 2, 8, 32, storage="int8", smooth_k=smooth, rotate_k=rotate)
        with pytest.raises(ValueError, match="smooth_k|rotate_k|key_mean"):
            plain.load_state_dict(state)


def test_inputs_unchanged_and_16_bit_queries():
    rng = np.random.default_rng(8)
    k = keys_with_bias(rng, (1, 2, 50, 64))
    v = rng.standard_normal((1, 2, 50, 64), dtype=np.float32)
    q = rng.standard_normal((1, 2, 1, 64), dtype=np.float32)
    saved = [x.copy() for x in (k, v, q)]
    cache = fastattn.KVCache(1, 2, 64, 64, smooth_k=True, rotate_k=True)
    cache.append(k, v)
    cache.attend(q)
    for x, before in zip((k, v, q), saved):
        np.testing.assert_array_equal(x, before)
    half = q.astype(np.float16)
    out = cache.attend(half)
    assert out.dtype == np.float16
    # the rotated query rounded to float16 once more: twice float16's rounding
    want = expected(half.astype(np.float32), k, v)
    np.testing.assert_allclose(out, want, rtol=0, atol=50 * 2 * 2.0 ** -11)
    with pytest.raises(ValueError, match="out overlaps query"):
        cache.attend(q, out=q)


@pytest.mark.parametrize("name", ["smooth_k", "rotate_k"])
def test_options_must_be_bools(name):
    for make in (lambda **kw: fastattn.KVCache(1, 1, 4, 8, **kw),
                 lambda **kw: fastattn.PagedKVCache(4, 4, 1, 8, **kw)):
        with pytest.raises(TypeError, match=name):
            make(**{name: "yes"})


def test_multi_head_attention_cache():
    rng = np.random.default_rng(9)
    mha = fastattn.MultiHeadAttention(64, 4, rng=rng)
    x = rng.standard_normal((1, 12, 64), dtype=np.float32)
    outs = []
    for smooth in (False, True):
        cache = mha.new_cache(1, 16, storage="float32", smooth_k=smooth, rotate_k=smooth)
        assert cache.smooth_k is smooth and cache.rotate_k is smooth
        outs.append(mha.forward(x, cache=cache, is_causal=True)[0])
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=tolerance(np.float32, 76))


def test_non_finite_keys_do_not_spread():
    """A NaN or inf key (float storages hold them), even in a padding slot,
    is left out of the mean: only the rows that attend it see it."""
    rng = np.random.default_rng(10)
    k = keys_with_bias(rng, (2, 1, 4, 8))
    v = rng.standard_normal((2, 1, 4, 8), dtype=np.float32)
    k[0, 0, 0, 1] = np.nan   # padding of sequence 0
    k[1, 0, 3, 2] = np.inf   # the last key of sequence 1
    pad = np.zeros((2, 4), bool)
    pad[0, 0] = True
    outs = []
    for smooth in (False, True):
        cache = fastattn.KVCache(2, 1, 8, 8, smooth_k=smooth)  # (rotate_k refuses them)
        cache.append(k, v, key_padding_mask=pad)
        outs.append(cache.attend(np.ones((2, 1, 4, 8), np.float32)))
    np.testing.assert_array_equal(np.isnan(outs[1]), np.isnan(outs[0]))
    assert np.isfinite(outs[1][0]).all() and np.isfinite(outs[1][1, :, :3]).all()
    np.testing.assert_allclose(outs[1][np.isfinite(outs[0])], outs[0][np.isfinite(outs[0])],
                               rtol=1e-5, atol=1e-5)


def test_padding_first_chunk_leaves_the_mean_to_the_next():
    """Left padding's first chunk holds no real token of sequence 1: its
    mean comes from the next append, as if it had been the first."""
    rng = np.random.default_rng(12)
    k1, k2 = keys_with_bias(rng, (2, 1, 4, 16)), keys_with_bias(rng, (2, 1, 6, 16))
    pad = np.zeros((2, 4), bool)
    pad[1] = True
    cache = fastattn.KVCache(2, 1, 16, 16, storage="int8", smooth_k=True)
    cache.append(k1, k1, key_padding_mask=pad)
    first = cache.state_dict()["key_mean"].view(np.float32).copy()
    np.testing.assert_array_equal(first[1], 0)
    cache.append(k2, k2)
    mean = cache.state_dict()["key_mean"].view(np.float32)
    np.testing.assert_array_equal(mean[0], first[0])
    np.testing.assert_allclose(mean[1], k2[1].astype(np.float64).mean(axis=1), rtol=1e-6)


def test_keys_past_the_storage_range_are_refused_clearly():
    k = np.full((1, 1, 2, 16), 20000.0, np.float32)  # rotated: 80000, past float16
    cache = fastattn.KVCache(1, 1, 4, 16, storage="float16", rotate_k=True)
    with pytest.raises(ValueError, match="rotate_k store them: rotated,"):
        cache.append(k, k)
    assert cache.length == 0
    huge = np.full((1, 1, 1, 64), 1e38, np.float32)
    with pytest.raises(ValueError, match="not finite once rotate_k"):
        fastattn.KVCache(1, 1, 4, 64, rotate_k=True).append(huge, huge)


def test_paged_16_bit_queries_fill_out_in_their_dtype():
    rng = np.random.default_rng(13)
    cache = fastattn.PagedKVCache(8, 4, 1, 16, rotate_k=True, smooth_k=True)
    s = cache.add_sequence()
    k = keys_with_bias(rng, (6, 1, 16))
    cache.append([s], k, k, np.array([0, 6]))
    q = rng.standard_normal((1, 2, 16)).astype(np.float16)
    out = np.empty((1, 2, 16), np.float16)
    assert cache.attend([s], q, out=out) is out
    want = expected(q.astype(np.float32)[None].transpose(0, 2, 1, 3),
                    k.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None])
    np.testing.assert_allclose(out, want[0].transpose(1, 0, 2), rtol=0, atol=50 * 2.0 ** -10)
    with pytest.raises(TypeError, match="expected float16"):
        cache.attend([s], q, out=np.empty((1, 2, 16), np.float32))
    assert "smooth_k=True, rotate_k=True" in repr(cache)


def test_rotation_refuses_non_finite_keys_and_checks_its_flag():
    k = np.ones((1, 1, 2, 4), np.float32)
    k[0, 0, 0, 1] = np.inf
    cache = fastattn.KVCache(1, 1, 4, 4, rotate_k=True)
    with pytest.raises(ValueError, match="inf or a NaN, which rotate_k"):
        cache.append(k, k)
    assert cache.length == 0
    with pytest.raises(ValueError, match="non-finite|finite") as err:  # the storage's own word
        fastattn.KVCache(1, 1, 4, 4, storage="int8", smooth_k=True).append(k, k)
    assert "store them" not in str(err.value)
    cache.append(np.ones((1, 1, 2, 4), np.float32), np.ones((1, 1, 2, 4), np.float32))
    state = dict(cache.state_dict())
    for bad in (np.uint8(0), np.ones(2, np.uint8), np.float32(1), "yes"):
        with pytest.raises(ValueError, match="rotate_k"):
            fastattn.KVCache(1, 1, 4, 4, rotate_k=True).load_state_dict(dict(state, rotate_k=bad))


def test_16_bit_weights_with_numpy_bool():
    rng = np.random.default_rng(14)
    cache = fastattn.KVCache(1, 1, 8, 16, rotate_k=True)
    k = keys_with_bias(rng, (1, 1, 5, 16))
    cache.append(k, k)
    q = rng.standard_normal((1, 1, 1, 16)).astype(np.float16)
    for flag in (True, np.True_):
        out, weights = cache.attend(q, need_weights=flag)
        assert out.dtype == weights.dtype == np.float16


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_paged_attention_takes_a_callers_key_mean(dtype):
    """A caller's pool of keys stored less a mean per sequence: with
    key_mean, paged_attention gives the results of the keys before
    (softcap, sinks and lse included), as the twin does."""
    rng = np.random.default_rng(15)
    Hkv, Hq, E, bs = 2, 4, 32, 8
    lens, q_lens = np.array([20, 9]), np.array([3, 1])
    table = np.array([[0, 1, 2], [3, 4, 0]], np.int32)
    keys = (rng.standard_normal((5, Hkv, bs, E)) + 5 * rng.standard_normal(E)).astype(dtype)
    values = rng.standard_normal((5, Hkv, bs, E)).astype(dtype)
    mean = rng.standard_normal((2, Hkv, E)).astype(dtype) * 5
    stored = keys.copy()
    for b, blocks in enumerate(([0, 1, 2], [3, 4])):
        stored[blocks] -= mean[b][None, :, None, :]
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    q = rng.standard_normal((int(cu[-1]), Hq, E)).astype(dtype)
    opts = dict(softcap=20.0, sinks=rng.standard_normal(Hq))
    out, lse = fastattn.paged_attention(q, stored, values, table, lens, cu, key_mean=mean,
                                        return_lse=True, **opts)
    want, want_lse = fastattn.paged_attention(q, keys, values, table, lens, cu, return_lse=True,
                                              **opts)
    tol = tolerance(dtype, E + 20) * 30
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    np.testing.assert_allclose(lse, want_lse, rtol=tol, atol=tol)
    twin = ref.paged_attention(q.astype(np.float64), stored.astype(np.float64),
                               values.astype(np.float64), table, lens, cu,
                               key_mean=mean.astype(np.float64), **opts)
    np.testing.assert_allclose(out, twin, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"key_mean has shape \(2, 2, 31\)"):
        fastattn.paged_attention(q, stored, values, table, lens, cu, key_mean=mean[..., :31])
    with pytest.raises(TypeError, match="key_mean has dtype float16"):
        fastattn.paged_attention(q, stored, values, table, lens, cu,
                                 key_mean=mean.astype(np.float16))
    bad = mean.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="key_mean holds an inf or a NaN"):
        fastattn.paged_attention(q, stored, values, table, lens, cu, key_mean=bad)
