"""scaled_dot_product_attention(precision="int8"): SageAttention's 8-bit
attention in the block kernel, and the int8 caches' longer calls with it.

Against the readable twin, reference.int8_mode_operands: the smoothed keys,
values and query rounded as the mode rounds them, read back in float64,
then exact attention.  What is left between the two is float32 rounding
after exact integer sums (conftest.tolerance over E + S terms) and the
weights' rounding: each query row's weights of a group of 64 key positions,
times their value scales, rounded to 7 bits of their largest, which moves
an output element by at most the sum over the groups of largest / 254 x 64
x 127 (|code| <= 127) over the row's sum of weights.  Against the original
float64 data the mode's own error is bounded as README's table states."""
import contextlib

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

from conftest import simd_path, tolerance, without_int8_dot

GROUP = 64  # key positions whose weights share a scale in the block kernel


def operands(rng, B=2, Hq=4, Hkv=4, L=130, S=257, E=64, Ev=None, bias=0.0):
    q = rng.standard_normal((B, Hq, L, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    k += np.float32(bias) * rng.standard_normal(E, dtype=np.float32)  # outlier channels
    v = rng.standard_normal((B, Hkv, S, Ev or E), dtype=np.float32)
    return q, k, v


def check_twin(out, q, k, v, **options):
    """out within float32's bound of the twin plus the weights' rounding."""
    q2, k2, v2 = ref.int8_mode_operands(q, k, v)
    E, S = q.shape[-1], k.shape[-2]
    expected, w = ref.scaled_dot_product_attention(q2, k2, v2, scale=options.pop("scale", None)
                                                   or 1 / np.sqrt(E), need_weights=True, **options)
    group = q.shape[-3] // k.shape[-3]
    vs = np.repeat(np.abs(v2).max(axis=-1), group, axis=-2)[..., None, :]  # (.., Hq, 1, S)
    wv = np.pad(np.where(w == 0, 0, w * vs), [(0, 0)] * (w.ndim - 1) + [(0, -S % GROUP)])
    largest = wv.reshape(wv.shape[:-1] + (-1, GROUP)).max(axis=-1)
    bound = (largest * GROUP * 127 / 254).sum(axis=-1)[..., None]  # weights already over l
    bound = bound + tolerance(np.float32, E + S) * max(1.0, np.abs(expected).max())
    assert np.all(np.abs(out - expected) <= bound), np.max(np.abs(out - expected) - bound)


def rel_rms(out, expected):
    return np.sqrt(np.mean((out - expected) ** 2) / np.mean(expected ** 2))


@pytest.mark.parametrize("shape", [dict(), dict(L=64, S=64), dict(L=65, S=300, E=48, Ev=80),
                                   dict(L=70, S=90, E=5, Ev=7), dict(L=200, S=200, E=128),
                                   dict(Hq=8, Hkv=2, L=100, S=129)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_the_reference_twin(simd, rng, shape, is_causal):
    q, k, v = operands(rng, **shape)
    gqa = q.shape[1] != k.shape[1]
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=gqa,
                                                precision="int8")
    check_twin(out, q, k, v, is_causal=is_causal, enable_gqa=gqa)


VARIANTS = {
    "bool mask": lambda rng, L, S: {"attn_mask": rng.random((L, S)) < 0.7},
    "additive mask": lambda rng, L, S: {"attn_mask": np.where(rng.random((L, S)) < 0.7, 0, -np.inf)
                                        .astype(np.float32) + rng.standard_normal((L, S)).astype(np.float32)},
    "window": lambda rng, L, S: {"window_size": (40, 3)},
    "softcap": lambda rng, L, S: {"softcap": 3.0},
    "alibi": lambda rng, L, S: {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "sinks": lambda rng, L, S: {"sinks": np.linspace(-1, 2, 4)},
    "lower_right": lambda rng, L, S: {"is_causal": True, "causal_alignment": "lower_right"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant(rng, variant):
    q, k, v = operands(rng, L=150, S=333)
    options = VARIANTS[variant](rng, 150, 333)
    out = fastattn.scaled_dot_product_attention(q, k, v, precision="int8", **options)
    check_twin(out, q, k, v, **options)
    exact = ref.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                             v.astype(np.float64), **options)
    assert rel_rms(out, exact) < 2e-2


@pytest.mark.parametrize("bias, bound", [(0.0, 2e-2), (4.0, 2e-2)])
def test_error_against_float64(rng, bias, bound):
    """README's table: random normal data, and keys with a per-channel bias
    four times their spread (smoothing takes it out before the rounding)."""
    q, k, v = operands(rng, B=1, Hq=8, Hkv=8, L=256, S=1024, bias=bias)
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, precision="int8")
    exact = ref.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                             v.astype(np.float64), is_causal=True)
    cosine = np.sum(out * exact) / np.sqrt(np.sum(out * out) * np.sum(exact * exact))
    assert rel_rms(out, exact) < bound and cosine > 0.9995


def test_same_bits_for_any_threads_layout_batch_and_path(rng):
    q, k, v = operands(rng, L=200, S=300)
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, precision="int8",
                                                num_threads=1)
    for n in (2, 3):
        assert np.array_equal(out, fastattn.scaled_dot_product_attention(
            q, k, v, is_causal=True, precision="int8", num_threads=n))
    # a batch item alone, and the operands in another layout
    alone = fastattn.scaled_dot_product_attention(q[1:], k[1:], v[1:], is_causal=True,
                                                  precision="int8")
    assert np.array_equal(out[1:], alone)
    qt, kt, vt = (np.swapaxes(np.swapaxes(x, 1, 2).copy(), 1, 2) for x in (q, k, v))
    assert np.array_equal(out, fastattn.scaled_dot_product_attention(
        qt, kt, vt, is_causal=True, precision="int8"))
    # the AVX2 path's maddubs and the vpdpbusd of AVX-512 VNNI and of
    # AVX-VNNI sum alike: every x86 path, with the CPU's instruction or without
    if "avx512" in fastattn.available_simd_paths():
        with simd_path("avx512"):
            wide = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, precision="int8")
        for path in ("avx2", "avx512"):
            for base in (False, True):
                with simd_path(path), without_int8_dot() if base else contextlib.nullcontext():
                    assert np.array_equal(wide, fastattn.scaled_dot_product_attention(
                        q, k, v, is_causal=True, precision="int8")), (path, base)


def test_weights_and_lse_come_from_the_integer_scores(rng):
    q, k, v = operands(rng, B=1, L=100, S=150)
    out, w, lse = fastattn.scaled_dot_product_attention(q, k, v, precision="int8",
                                                        need_weights=True, return_lse=True)
    q2, k2, v2 = ref.int8_mode_operands(q, k, v)
    _, w_ref, lse_ref = ref.scaled_dot_product_attention(q2, k2, v2, scale=1 / 8, need_weights=True,
                                                         return_lse=True)
    np.testing.assert_allclose(w, w_ref, atol=tolerance(np.float32, 64 + 150))
    np.testing.assert_allclose(lse, lse_ref, atol=tolerance(np.float32, 64 + 150) * np.abs(lse_ref).max())


def test_nan_masked_rows_and_the_callers_arrays(rng):
    q, k, v = operands(rng, B=1, Hq=1, Hkv=1, L=80, S=100)
    copies = [x.copy() for x in (q, k, v)]
    q[0, 0, 3, 5] = np.nan  # a NaN query row: a NaN output row
    k[0, 0, 7, 1] = np.nan  # a NaN key seen by rows past 7 only (causal)
    v[0, 0, 50, 2] = np.inf  # a value row no row below 50 sees
    mask = np.ones((80, 100), bool)
    mask[10] = False  # a row that sees nothing: zeros
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask & np.tri(80, 100, dtype=bool),
                                                precision="int8")
    assert np.array_equal(q, q0, equal_nan=True) and np.array_equal(k, k0, equal_nan=True)
    assert np.array_equal(v, v0)
    seen = np.arange(7, 80) != 10
    assert np.isnan(out[0, 0, 3]).all() and np.isnan(out[0, 0, 7:][seen]).all()
    assert np.all(out[0, 0, 10] == 0) and np.isfinite(out[0, 0, :7][np.arange(7) != 3]).all()
    q, k, v = copies
    check_twin(fastattn.scaled_dot_product_attention(q, k, v, precision="int8"), q, k, v)


def test_float64_and_the_default_stay_exact(rng):
    q, k, v = operands(rng, L=70, S=80)
    exact = fastattn.scaled_dot_product_attention(q, k, v)
    assert np.array_equal(exact, fastattn.scaled_dot_product_attention(q, k, v, precision="exact"))
    assert not np.array_equal(exact, fastattn.scaled_dot_product_attention(q, k, v, precision="int8"))
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    assert np.array_equal(fastattn.scaled_dot_product_attention(q, k, v),
                          fastattn.scaled_dot_product_attention(q, k, v, precision="int8"))


def test_half_inputs(rng):
    q, k, v = operands(rng, B=1, L=90, S=120)
    out = fastattn.scaled_dot_product_attention(q.astype(np.float16), k.astype(np.float16),
                                                v.astype(np.float16), precision="int8")
    assert out.dtype == np.float16
    q, k, v = (x.astype(np.float16).astype(np.float32) for x in (q, k, v))
    check_twin(out.astype(np.float32), q, k, v)


@pytest.mark.parametrize("bad, error", [(8, TypeError), ("int4", ValueError), ("INT8", ValueError)])
def test_bad_precision(rng, bad, error):
    q, k, v = operands(rng, B=1, L=5, S=5)
    with pytest.raises(error, match="precision"):
        fastattn.scaled_dot_product_attention(q, k, v, precision=bad)
    cu = np.array([0, 5])
    with pytest.raises(error, match="precision"):
        fastattn.varlen_attention(q[0, :, :, :].transpose(1, 0, 2).copy(),
                                  k[0].transpose(1, 0, 2).copy(), v[0].transpose(1, 0, 2).copy(),
                                  cu, cu, precision=bad)


def test_varlen_smooths_each_sequence_alone(rng):
    """varlen_attention(precision="int8"): each packed sequence's output is
    that of scaled_dot_product_attention over its own keys (its own mean,
    the same integer products), the sequences' lengths around the weight
    groups and the block kernel's 64 rows."""
    lens_q, lens_k = [70, 1, 130, 0, 5], [90, 40, 130, 3, 200]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 4, 64), dtype=np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 64), dtype=np.float32) + 3 * rng.standard_normal(64, dtype=np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 48), dtype=np.float32)
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, precision="int8")
    for b in range(len(lens_q)):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(1, 0, 2)[None]
                      for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        alone = fastattn.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True,
                                                      causal_alignment="lower_right",
                                                      precision="int8")
        np.testing.assert_array_equal(out[cu_q[b]:cu_q[b + 1]], alone[0].transpose(1, 0, 2))


def test_rounding_matches_the_twin_on_extreme_rows(rng):
    """fa_int8_rows against reference.int8_mode_operands, decoded, bit for
    bit: ordinary rows, zeros, rows too small for 127 / max (codes +-127),
    values near float32's largest (no mean then), NaN and inf rows (NaN)."""
    k = rng.standard_normal((2, 3, 40, 24), dtype=np.float32)
    v = rng.standard_normal((2, 3, 40, 16), dtype=np.float32)
    k[0, 0, 3] = 0
    k[0, 1, :] *= np.float32(1e-38)  # a whole head of tiny keys (mean tiny too)
    v[0, 0, 5] = np.float32(2e-38) * np.sign(v[0, 0, 5])
    v[1, 2, 7] = 0
    k[1, 0, :20, 4] = np.float32(-3e38)
    k[1, 0, 20, 4] = np.float32(3e38)  # the mean, -1.4e38, would push it past the range
    k[1, 1, 2, 0] = np.nan
    v[1, 1, 3, 1] = np.inf
    q = rng.standard_normal((2, 3, 5, 24), dtype=np.float32)
    kc, vc, ks, vs, mean = fastattn._storage.int8_mode_operands(k, v, 2)
    _, k2, v2 = ref.int8_mode_operands(q, k, v)
    np.testing.assert_array_equal(kc * ks[..., None].astype(np.float64), k2[..., :24])
    np.testing.assert_array_equal(np.broadcast_to(mean[..., None, :], k.shape), k2[..., 24:])
    np.testing.assert_array_equal(vc * vs[..., None].astype(np.float64), v2)
    assert np.isnan(ks[1, 1, 2]) and np.isnan(vs[1, 1, 3]) and np.all(mean[1, 0] == 0)
    assert set(np.abs(vc[0, 0, 5]).tolist()) <= {0, 127} and np.all(kc[0, 0, 3] == (-np.round(
        mean[0, 0] * 127 / np.abs(mean[0, 0]).max())).astype(np.int8))


@pytest.mark.parametrize("nthreads", [1, 3])
def test_key_sums_are_numpys_bit_for_bit(rng, simd, nthreads):
    """The key mean's float64 sums (_core.col_sums, on the kernels' threads,
    in each path's vectors) equal numpy's x.sum(axis=-2, dtype=float64) bit
    for bit, whatever the shape and magnitude, so that the mean is the
    twin's."""
    for i in range(80):
        shape = tuple(rng.integers(1, 4, size=rng.integers(0, 3)).tolist()) + (
            int(rng.integers(0, 700)), 1 if i % 4 == 0 else int(rng.integers(0, 200)))
        # magnitudes mixed within a column, so that the order of the sums shows
        scale = (10.0 ** rng.integers(-30, 30, size=shape)).astype(np.float32)
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        got = fastattn._storage._col_sums(x, nthreads)
        want = x.sum(axis=-2, dtype=np.float64)
        assert got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint64), want.view(np.uint64))


@pytest.mark.parametrize("nthreads", [1, 3])
def test_one_call_and_the_general_path_give_the_same_operands(rng, simd, nthreads):
    """int8_mode_operands' common case, one C call (_core.int8_operands),
    and its general path (taken for a mask's rows: here every row seen)
    give the same bits: the same sums, mean, codes and scales, over shapes
    (broadcast heads too) and magnitudes from 1e-30 to 1e30 a row."""
    for i in range(40):
        B, H, S = (int(n) for n in rng.integers(1, 4, size=3)) if i % 5 else (1, 1, 0)
        S = int(rng.integers(0, 300)) if i % 5 else 0
        E, Ev = int(rng.integers(2, 140)), int(rng.integers(1, 140))
        scale = (10.0 ** rng.integers(-30, 30, size=(B, H, S, 1))).astype(np.float32)
        k = (rng.standard_normal((B, H, S, E)) * scale).astype(np.float32)
        v = (rng.standard_normal((B, H, S, Ev)) * scale).astype(np.float32)
        if i % 3 == 0:  # heads broadcast: rounded once
            k = np.broadcast_to(k[:, :1], k.shape)
        fast = fastattn._storage.int8_mode_operands(k, v, nthreads)
        general = fastattn._storage.int8_mode_operands(
            k, v, nthreads, seen=np.ones(k.shape[:-1], np.bool_))
        for got, want in zip(fast, general):
            assert got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_rounding_refuses_arrays_of_other_dimensions():
    """The rounding's and the key sums' C loops take (R, S, n) arrays only:
    any other shape is a ValueError, never a read past the array."""
    x = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="3 dimensions"):
        fastattn._core.col_sums(0, x, np.zeros(128), 1)
    with pytest.raises(ValueError, match="3 dimensions"):
        fastattn._core.int8_rows(0, x, None, np.zeros(32, np.int8), np.zeros(32, np.float32), 1)
    with pytest.raises(ValueError, match="3 dimensions"):
        fastattn._core.col_sums(0, np.ones((), np.float32), np.zeros(1), 1)
    with pytest.raises(ValueError, match="3 dimensions"):
        fastattn._core.int8_operands(0, x, x.reshape(1, 4, 8), 1)
    with pytest.raises(ValueError, match="float32, native, aligned and C-contiguous"):
        fastattn._core.int8_operands(0, x.reshape(1, 4, 8)[:, :, ::2], x.reshape(1, 4, 8), 1)


def test_the_c_loops_refuse_other_byte_orders_and_thread_counts():
    """Big-endian floats (whose dtype char is "f" too) and thread counts
    OpenMP cannot create are ValueErrors, never garbage or an abort."""
    x, out = np.ones((2, 3, 4), ">f4"), np.zeros((2, 4), ">f8")
    with pytest.raises(ValueError, match="native"):
        fastattn._core.col_sums(0, x, out, 1)
    with pytest.raises(ValueError, match="native"):
        fastattn._core.int8_rows(0, x, None, np.zeros((2, 3, 4), np.int8),
                                 np.zeros((2, 3), np.float32), 1)
    with pytest.raises(ValueError, match="native"):
        fastattn._core.int8_operands(0, x, x, 1)
    x, out = np.ones((5, 2, 2), np.float32), np.zeros((5, 2))
    for n in (0, -5, fastattn._core.MAX_THREADS + 1):
        with pytest.raises(ValueError, match="nthreads"):
            fastattn._core.col_sums(0, x, out, n)
        with pytest.raises(ValueError, match="nthreads"):
            fastattn._core.int8_operands(0, x, x, n)


@pytest.mark.parametrize("S", [0, 50])
def test_keys_broadcast_along_their_features(rng, S):
    """A key broadcast along its features (stride 0), or with no positions
    at all, gives what its contiguous copy gives: the key mean is read
    whole (it was a single float, read as E of them)."""
    q = rng.standard_normal((1, 2, 3, 64), dtype=np.float32)
    k = np.broadcast_to((rng.standard_normal((1, 2, S, 1)) + 3).astype(np.float32), (1, 2, S, 64))
    v = rng.standard_normal((1, 2, S, 8), dtype=np.float32)
    got = fastattn.scaled_dot_product_attention(q, k, v, precision="int8")
    want = fastattn.scaled_dot_product_attention(q, np.ascontiguousarray(k), v, precision="int8")
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(got).all()


@pytest.mark.parametrize("L", [1, 3, 4, 5, 70])
@pytest.mark.parametrize("additive", [False, True])
def test_a_hidden_value_row_of_nan_does_not_leak(rng, L, additive):
    """A masked key whose value row is NaN or inf (its row scale NaN): a
    weight of 0 stays 0 times that scale, in the row kernel (L <= 4) and in
    the block kernel."""
    q, k, v = operands(rng, B=1, Hq=2, Hkv=2, L=L, S=90)
    v[0, 0, 7, 3], v[0, 1, 50] = np.nan, np.inf
    mask = np.ones((L, 90), bool)
    mask[:, [7, 50]] = False
    m = np.where(mask, 0, -np.inf).astype(np.float32) if additive else mask
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=m, precision="int8")
    assert np.isfinite(out).all()
    check_twin(out, q, k, v, attn_mask=m)


def test_the_mean_is_over_the_keys_some_query_sees(rng):
    """Padding keys that no query sees (a key padding mask) hold anything:
    huge finite values there would spoil the smoothing of the visible keys
    if the mean took them in; it does not."""
    q, k, v = operands(rng, B=2, Hq=4, Hkv=2, L=40, S=128)
    mask = np.ones((2, 1, 1, 128), bool)
    mask[0, ..., 100:] = False
    mask[1, ..., 60:] = False
    k[0, :, 100:] = 1e10
    k[1, :, 60:] = -3e4
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True,
                                                precision="int8")
    exact = ref.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                             v.astype(np.float64), attn_mask=mask, enable_gqa=True)
    assert rel_rms(out, exact) < 2e-2
    seen = np.broadcast_to(mask[:, 0, 0, None, :], (2, 2, 128))
    q2, k2, v2 = ref.int8_mode_operands(q, k, v, key_seen=seen)
    twin = ref.scaled_dot_product_attention(q2, k2, v2, scale=1 / 8, attn_mask=mask,
                                            enable_gqa=True)
    assert rel_rms(out, twin) < 1.5e-2  # the weights' rounding alone


def test_rows_too_small_for_127_over_their_largest(rng):
    """Value and key rows whose largest is below 127 / float32's largest
    (about 3.7e-37) are scaled by 2^64 before they are rounded: their codes
    keep their signs and sizes."""
    q, k, v = operands(rng, B=1, Hq=1, Hkv=1, L=70, S=80)
    v *= np.float32(1e-38)
    k *= np.float32(1e-37)
    q *= np.float32(1e36)  # scores of ordinary size
    out = fastattn.scaled_dot_product_attention(q, k, v, precision="int8")
    exact = ref.scaled_dot_product_attention(q.astype(np.float64), k.astype(np.float64),
                                             v.astype(np.float64))
    assert rel_rms(out, exact) < 2e-2


def test_subclasses_broadcasts_and_one_dimension(rng, tmp_path):
    """An ndarray subclass (np.memmap) takes the mode; a key broadcast over
    the batch (stride 0) is rounded once, with the bits of its copy; 1-D
    inputs get the exact call's error; the twin takes L = 0."""
    q, k, v = operands(rng, B=1, L=70, S=90)
    mm = np.memmap(tmp_path / "q.bin", dtype=np.float32, mode="w+", shape=q.shape)
    mm[:] = q
    assert np.array_equal(fastattn.scaled_dot_product_attention(mm, k, v, precision="int8"),
                          fastattn.scaled_dot_product_attention(q, k, v, precision="int8"))
    qb = np.concatenate([q, q[:, ::-1]])
    kb, vb = np.broadcast_to(k, (2,) + k.shape[1:]), np.broadcast_to(v, (2,) + v.shape[1:])
    assert np.array_equal(fastattn.scaled_dot_product_attention(qb, kb, vb, precision="int8"),
                          fastattn.scaled_dot_product_attention(qb, kb.copy(), vb.copy(),
                                                                precision="int8"))
    with pytest.raises(ValueError, match="query"):
        fastattn.scaled_dot_product_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0], precision="int8")
    q2, _, _ = ref.int8_mode_operands(q[:, :, :0], k, v)
    assert q2.shape == (1, 4, 0, 128)


@pytest.mark.parametrize("block_size", [16, 48, 128])
def test_a_prefill_over_paged_int8_blocks_keeps_its_bits(rng, block_size):
    """A prefill chunk of 70 rows in the int8 mode over an int8 paged cache
    (the block kernel reading its keys and values through the block table,
    key rows copied where a key block crosses cache blocks): the bits of
    the same rows in a dense int8 KVCache, whatever the block size and the
    blocks' order, and for 1 or 2 threads."""
    S, L = 300, 70
    k = rng.standard_normal((1, 2, S, 64), dtype=np.float32)
    v = rng.standard_normal((1, 2, S, 48), dtype=np.float32)
    q = rng.standard_normal((1, 4, L, 64), dtype=np.float32)
    dense = fastattn.KVCache(1, 2, S, 64, value_dim=48, storage="int8")
    dense.append(k, v)
    expected = dense.attend(q, precision="int8")
    paged = fastattn.PagedKVCache(num_blocks=64, block_size=block_size, num_kv_heads=2,
                                  head_dim=64, value_dim=48, storage="int8")
    other, mine = paged.add_sequence(), paged.add_sequence()
    for start in range(0, S, 100):  # interleaved with another sequence's blocks
        rows = slice(start, start + 100)
        kr, vr = (x[0][:, rows].transpose(1, 0, 2) for x in (k, v))
        paged.append([other, mine], np.concatenate([kr[:30] * 2, kr]),
                     np.concatenate([vr[:30], vr]), cu_seqlens=np.array([0, 30, 130]))
    packed = q[0].transpose(1, 0, 2).copy()
    for n in (1, 2):
        out = paged.attend([mine], packed, np.array([0, L]), precision="int8", num_threads=n)
        np.testing.assert_array_equal(out, expected[0].transpose(1, 0, 2))


@pytest.mark.parametrize("L", [3, 30])  # the row kernel, and the block kernel's repair by it
def test_a_query_near_float32s_largest_gives_no_nan(simd, L):
    """A query row of 1e37 in the int8 mode: its scores' integer sums times
    the query's scale overflow float32 where the true scores do not; they
    are computed again from the float query and the dequantised keys, so
    the row attends to the one key it sees (NaN before)."""
    rng = np.random.default_rng(L)
    q = rng.standard_normal((1, 2, L, 64), dtype=np.float32)
    q[:, :, 1] *= np.float32(1e37)
    k = rng.standard_normal((1, 2, 9, 64), dtype=np.float32)
    v = rng.standard_normal((1, 2, 9, 64), dtype=np.float32)
    out = fastattn.scaled_dot_product_attention(q, k, v, precision="int8")
    q2, k2, v2 = ref.int8_mode_operands(q, k, v)
    expected = ref.scaled_dot_product_attention(q2, k2, v2, scale=1 / 8)
    assert np.isfinite(out).all()
    # the huge row's softmax is one key's: that value row, as the mode rounds it
    np.testing.assert_allclose(out[:, :, 1], expected[:, :, 1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("L", [1, 6])  # the row kernel, and the block kernel
@pytest.mark.parametrize("form", ["huge query", "huge keys"])
def test_a_key_mean_term_past_float32s_range_gives_no_nan(simd, L, form):
    """The key mean's term of a score, scale q . m, was rounded to float32
    before the scale: q of 1e37 against keys of mean 1 (E = 100, the term
    1e38, q . m 1e39), or keys near 1e38 against normal queries, gave inf
    there and NaN rows where every true score is finite."""
    rng = np.random.default_rng(L)
    if form == "huge query":
        q = np.full((1, 1, L, 100), 1e37, np.float32)
        k = (1 + 0.1 * rng.standard_normal((1, 1, 8, 100))).astype(np.float32)
    else:
        q = rng.standard_normal((1, 1, L, 256)).astype(np.float32)
        k = (1e38 * (1 + 0.1 * rng.standard_normal((1, 1, 40, 256)))).astype(np.float32)
    v = rng.standard_normal((1, 1, k.shape[2], 4)).astype(np.float32)
    out = fastattn.scaled_dot_product_attention(q, k, v, precision="int8")
    q2, k2, v2 = ref.int8_mode_operands(q, k, v)
    expected = ref.scaled_dot_product_attention(q2, k2, v2, scale=1 / np.sqrt(q.shape[-1]))
    assert np.isfinite(out).all()
    # scores 1e36 and more apart: each row's softmax is its largest score's
    # key, whose value row the twin gives to float32's rounding
    np.testing.assert_allclose(out, expected, atol=1e-6)
