"""scaled_dot_product_attention against the float64 NumPy reference."""
import numpy as np
import pytest
from conftest import assert_close, check_attention, f64, simd_path
from test_variants import check_lse

import fastattn
from fastattn import reference as ref


def attn_case(rng, dtype, qshape, kshape, vshape, **kwargs):
    q = rng.standard_normal(qshape).astype(dtype)
    k = rng.standard_normal(kshape).astype(dtype)
    v = rng.standard_normal(vshape).astype(dtype)
    return q, k, v


SHAPES = [  # L, S, E, Ev
    (1, 1, 1, 1), (2, 3, 2, 2), (5, 7, 3, 2), (37, 53, 20, 7), (64, 128, 64, 64),
    (65, 129, 33, 17), (130, 300, 64, 48), (1, 257, 128, 128), (200, 5, 16, 24),
]


@pytest.mark.parametrize("L,S,E,Ev", SHAPES)
def test_shapes(simd, dtype, rng, L, S, E, Ev):
    q, k, v = attn_case(rng, dtype, (2, 3, L, E), (2, 3, S, E), (2, 3, S, Ev))
    check_attention(q, k, v, dtype)


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
@pytest.mark.parametrize("L,S", [(1, 1), (7, 7), (70, 70), (5, 150), (150, 5), (129, 200), (1, 300)])
def test_causal(simd, dtype, rng, alignment, L, S):
    q, k, v = attn_case(rng, dtype, (2, L, 24), (2, S, 24), (2, S, 12))
    out, w = check_attention(q, k, v, dtype, is_causal=True, causal_alignment=alignment)
    visible = ref.causal_mask(L, S, alignment)
    assert np.all(w[:, ~visible] == 0)
    empty_rows = ~visible.any(axis=1)  # lower_right with L > S: the first L - S rows
    assert np.all(out[:, empty_rows] == 0)


MASK_SHAPES = [(40, 70), (70,), (1, 70), (3, 1, 70), (2, 1, 1, 70), (2, 3, 40, 70), (3, 40, 1)]


@pytest.mark.parametrize("mshape", MASK_SHAPES)
def test_bool_mask_broadcast(simd, dtype, rng, mshape):
    q, k, v = attn_case(rng, dtype, (2, 3, 40, 16), (2, 3, 70, 16), (2, 3, 70, 8))
    mask = rng.random(mshape) > 0.4
    check_attention(q, k, v, dtype, attn_mask=mask)


@pytest.mark.parametrize("mask_dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mshape", [(40, 70), (2, 1, 1, 70), (3, 40, 70)])
def test_float_mask(simd, dtype, rng, mshape, mask_dtype):
    q, k, v = attn_case(rng, dtype, (2, 3, 40, 16), (2, 3, 70, 16), (2, 3, 70, 8))
    mask = rng.standard_normal(mshape).astype(mask_dtype)
    mask[rng.random(mshape) < 0.3] = -np.inf
    check_attention(q, k, v, dtype, attn_mask=mask)


@pytest.mark.parametrize("alignment", ["upper_left", "lower_right"])
def test_causal_with_padding_mask(simd, dtype, rng, alignment):
    """A padded batch in a decoder: causal and a key padding mask together."""
    B, L, S = 3, 33, 45
    q, k, v = attn_case(rng, dtype, (B, 2, L, 16), (B, 2, S, 16), (B, 2, S, 16))
    lengths = np.array([45, 30, 1])
    mask = (np.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    check_attention(q, k, v, dtype, attn_mask=mask, is_causal=True, causal_alignment=alignment)


@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1), (6, 3), (4, 4)])
def test_grouped_query(simd, dtype, rng, Hq, Hkv):
    q, k, v = attn_case(rng, dtype, (2, Hq, 19, 16), (2, Hkv, 31, 16), (2, Hkv, 31, 8))
    mask = rng.random((2, Hq, 19, 31)) > 0.2
    check_attention(q, k, v, dtype, enable_gqa=True, attn_mask=mask, is_causal=True)


def test_leading_axes_broadcast(simd, dtype, rng):
    q = rng.standard_normal((4, 1, 3, 10, 8)).astype(dtype)
    k = rng.standard_normal((1, 5, 3, 12, 8)).astype(dtype)
    v = rng.standard_normal((5, 1, 12, 6)).astype(dtype)
    out, _ = check_attention(q, k, v, dtype)
    assert out.shape == (4, 5, 3, 10, 6)


def test_two_dimensional_inputs(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (9, 4), (11, 4), (11, 3))
    out, w = check_attention(q, k, v, dtype, is_causal=True, causal_alignment="lower_right")
    assert out.shape == (9, 3) and w.shape == (9, 11)


def test_strided_views(simd, dtype, rng):
    """(B, L, H, E) seen as (B, H, L, E), reversed rows, every other feature,
    a stride-0 batch: all read in place and all exact."""
    B, L, S, H, E = 2, 21, 34, 3, 16
    q_blhe = rng.standard_normal((B, L, H, 2 * E)).astype(dtype)
    kv = rng.standard_normal((1, S, H, 2 * E)).astype(dtype)
    q = q_blhe.transpose(0, 2, 1, 3)[:, :, ::-1, ::2]
    k = np.broadcast_to(kv.transpose(0, 2, 1, 3)[..., :E], (B, H, S, E))
    v = kv.transpose(0, 2, 1, 3)[:, :, ::-1, E:][..., ::-1]
    assert q.strides[-1] < 0 or q.strides[-2] < 0
    check_attention(q, k, v, dtype, attn_mask=rng.random((L, S)) > 0.3)


@pytest.mark.parametrize("mask", [False, True])
def test_block_kernel_same_bits_in_every_layout(simd, dtype, rng, mask):
    """The block kernel (more than 4 query rows) reads K and V in place: rows
    of features (contiguous), columns (the transpose: feature stride S), and
    every other feature.  The micro-kernel takes a different load for each
    (on NEON: lanes along the features, lanes down a column, a broadcast),
    and each must give the bits of the contiguous copy, and the weights too."""
    L, S, E, Ev = 70, 150, 40, 24  # E >= 32: a score summed in two halves
    q = rng.standard_normal((L, E)).astype(dtype)
    k = rng.standard_normal((S, E)).astype(dtype)
    v = rng.standard_normal((S, Ev)).astype(dtype)
    kw = {"attn_mask": rng.random((L, S)) > 0.2} if mask else {}
    want, w_want = fastattn.scaled_dot_product_attention(q, k, v, need_weights=True, **kw)
    check_attention(q, k, v, dtype, **kw)
    views = {"columns": lambda x: np.ascontiguousarray(x.T).T,
             "strided": lambda x: np.repeat(x, 2, axis=-1)[:, ::2]}
    for kname, kview in views.items():
        for vname, vview in views.items():
            kk, vv = kview(k), vview(v)
            assert np.array_equal(kk, k) and np.array_equal(vv, v)
            got, w = fastattn.scaled_dot_product_attention(q, kk, vv, need_weights=True, **kw)
            assert got.tobytes() == want.tobytes(), (kname, vname)
            assert w.tobytes() == w_want.tobytes(), (kname, vname)


def test_fully_masked_rows_give_zeros(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (2, 9, 8), (2, 140, 8), (2, 140, 5))
    mask = rng.random((2, 9, 140)) > 0.5
    mask[0, 3] = False
    mask[1, :] = False
    fmask = np.where(mask, 0.0, -np.inf).astype(dtype)
    for m in (mask, fmask):
        out, w = check_attention(q, k, v, dtype, attn_mask=m)
        assert np.all(out[0, 3] == 0) and np.all(w[0, 3] == 0)
        assert np.all(out[1] == 0) and np.all(w[1] == 0)
        assert np.all(np.isfinite(out))


# E = 0 also through the row kernel: short queries, split decoding (few heads,
# S >= 2048), and the one-row last block of L = 65 (float32) or 33 (float64)
@pytest.mark.parametrize("L,S,E,Ev", [(0, 5, 4, 3), (5, 0, 4, 3), (5, 6, 0, 3), (5, 6, 4, 0),
                                      (1, 6, 0, 3), (3, 4096, 0, 3), (65, 6, 0, 3), (33, 6, 0, 3)])
def test_zero_size(simd, dtype, rng, L, S, E, Ev):
    q, k, v = attn_case(rng, dtype, (2, L, E), (2, S, E), (2, S, Ev))
    out, w = fastattn.scaled_dot_product_attention(q, k, v, need_weights=True)
    r_out, r_w = ref.scaled_dot_product_attention(*f64(q, k, v), need_weights=True)
    assert out.shape == (2, L, Ev) and w.shape == (2, L, S)
    np.testing.assert_allclose(out, r_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w, r_w, rtol=1e-6, atol=1e-6)
    if S == 0:
        assert np.all(out == 0)


def test_empty_batch(simd, dtype):
    q = np.zeros((0, 3, 4, 8), dtype)
    assert fastattn.scaled_dot_product_attention(q, q, q).shape == (0, 3, 4, 8)


def test_no_heads_with_gqa_give_an_empty_result(dtype):
    """Zero query heads over zero key/value heads is an empty call, as
    without enable_gqa and as in PyTorch; query heads over none is an
    error (test_errors)."""
    q, k = np.zeros((2, 0, 4, 8), dtype), np.zeros((2, 0, 6, 8), dtype)
    out, lse = fastattn.scaled_dot_product_attention(q, k, k[..., :5], enable_gqa=True,
                                                     return_lse=True)
    assert out.shape == (2, 0, 4, 5) and out.dtype == dtype and lse.shape == (2, 0, 4)


def test_large_logits(simd, dtype, rng):
    """Scores up to ~4000, exact in float32 (small integers), far past where a
    naive exp overflows, with each row's maximum in the last key block."""
    L, S, E = 20, 300, 64
    q = rng.integers(-8, 9, (L, E)).astype(dtype)
    k = rng.integers(-8, 9, (S, E)).astype(dtype)
    k[-1] = q.sum(axis=0) / np.abs(q.sum(axis=0)).max() * 8  # a key most rows like best
    k[-1] = np.round(k[-1])
    v = rng.standard_normal((S, 16)).astype(dtype)
    out, w = check_attention(q, k, v, dtype, scale=1.0)
    assert np.all(np.isfinite(out))


def test_nan_propagates_from_visible_entries(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (6, 8), (150, 8), (150, 4))
    q[1, 2] = np.nan          # query row 1: every score NaN
    k[140, 0] = np.nan        # key 140: NaN score in every row that sees it
    mask = np.ones((6, 150), bool)
    mask[3:, 140] = False     # rows 3.. do not see key 140
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.all(np.isnan(out[:3]))
    assert np.all(np.isfinite(out[3:]))
    r_out = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask)
    assert_close(out[3:], r_out[3:], dtype, 158, magnitude=4)


@pytest.mark.parametrize("L", [2, 6])  # the row kernel (<= 4 rows) and the block kernel
def test_nan_row_has_nan_weights_in_skipped_key_blocks(simd, dtype, rng, L):
    """A row with a NaN logit has NaN weights throughout, as the reference
    (and PyTorch's softmax) gives, also in key blocks that causality or the
    mask let the kernel skip.  Found by the property tests: the block
    kernel wrote 0 there while the row kernel wrote NaN."""
    q, k, v = attn_case(rng, dtype, (L, 4), (300, 4), (300, 3))
    k[1, 0] = np.nan
    mask = np.ones((L, 300), bool)
    mask[:, 128:256] = False  # a whole key block hidden
    for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
        out, w = fastattn.scaled_dot_product_attention(q, k, v, need_weights=True, **kwargs)
        r_out, r_w = ref.scaled_dot_product_attention(*f64(q, k, v), need_weights=True, **kwargs)
        np.testing.assert_array_equal(np.isnan(w), np.isnan(r_w))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(r_out))
        assert np.all(np.isnan(w[1:] if kwargs.get("is_causal") else w))


def test_nonfinite_value_at_hidden_key_does_not_leak(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (4, 8), (20, 8), (20, 3))
    v[7] = [np.nan, np.inf, -np.inf]
    mask = np.ones((4, 20), bool)
    mask[:2, 7] = False
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.all(np.isfinite(out[:2]))
    assert np.all(np.isnan(out[2:, 0])) and np.all(np.isinf(out[2:, 1:]))
    r_out = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask)
    assert_close(out[:2], r_out[:2], dtype, 28, magnitude=4)
    # causal: row i never reads rows > i
    out = fastattn.scaled_dot_product_attention(q, k[:4], v[5:9], is_causal=True)
    assert np.all(np.isfinite(out[:2])) and not np.any(np.isfinite(out[2:]))


@pytest.mark.parametrize("L", [70, 3], ids=["block", "rows"])
@pytest.mark.parametrize("mask_kind", ["per-key-bool", "tile-bool", "tile-additive"])
def test_nonfinite_at_padded_keys_gives_the_finite_bits(simd, dtype, rng, L, mask_kind):
    """NaN and inf keys and values at positions a padding mask hides from
    every query (a padded batch's unused slots) give the bits of the call
    with zeros there, and a NaN value at a key that only some queries of a
    block see is NaN in exactly their rows.  The block kernel once sent
    every row of such a block through the row kernel, 6-8x slower, with
    other bits."""
    B, H, S, E = 2, 2, 300, 8
    q, k, v = attn_case(rng, dtype, (B, H, L, E), (B, H, S, E), (B, H, S, 5))
    lengths = [300, 217]  # the second item's keys 217.. are padding: in two key blocks
    visible = np.arange(S)[None, :] < np.array(lengths)[:, None]  # (B, S)
    shape = (B, 1, 1, S) if mask_kind == "per-key-bool" else (B, 1, L, S)
    mask = np.broadcast_to(visible[:, None, None, :], shape).copy()
    if mask_kind == "tile-additive":
        mask = np.where(mask, 0.0, -np.inf).astype(dtype)
    zeros_k, zeros_v = k.copy(), v.copy()
    zeros_k[1, :, 217:], zeros_v[1, :, 217:] = 0, 0
    nans_k, nans_v = k.copy(), v.copy()
    nans_k[1, :, 217:] = np.nan
    nans_v[1, :, 217::2], nans_v[1, :, 218::2] = np.nan, -np.inf
    want = fastattn.scaled_dot_product_attention(q, zeros_k, zeros_v, attn_mask=mask)
    got = fastattn.scaled_dot_product_attention(q, nans_k, nans_v, attn_mask=mask)
    np.testing.assert_array_equal(got, want)
    r_out = ref.scaled_dot_product_attention(*f64(q, zeros_k, zeros_v), attn_mask=mask)
    assert_close(got, r_out, dtype, S, magnitude=4)
    if mask_kind == "per-key-bool":
        return
    # key 5 of the first item hidden from the first rows only: NaN there
    # reaches exactly the rows that see it
    mask[0, :, :L // 2, 5] = False if mask.dtype == bool else -np.inf
    nans_v[0, :, 5] = np.nan
    got = fastattn.scaled_dot_product_attention(q, nans_k, nans_v, attn_mask=mask)
    assert np.all(np.isnan(got[0, :, L // 2:])) and np.all(np.isfinite(got[0, :, :L // 2]))
    np.testing.assert_array_equal(got[1], want[1])
    r_out = ref.scaled_dot_product_attention(*f64(q, zeros_k, v), attn_mask=mask)
    assert_close(got[0, :, :L // 2], r_out[0, :, :L // 2], dtype, S, magnitude=4)


@pytest.mark.parametrize("L, S", [(64, 400), (2, 1900), (1, 4000), (3, 5000)],
                         ids=["block", "rows", "split", "split-3-rows"])
@pytest.mark.parametrize("kind", ["later-maximum", "finfo-min-padding"])
def test_nonfinite_value_at_key_whose_weight_underflows_does_not_leak(simd, dtype, rng, L, S, kind):
    # A key whose weight is 0 only against a maximum met later: online, its
    # weight against the running maximum was nonzero when its value row was
    # added, and the rescale by an underflowed factor then gave inf x 0 =
    # NaN.  Its weight is 0, so its value must not count (README, edge cases).
    v = rng.standard_normal((S, 3)).astype(dtype)
    if kind == "later-maximum":  # scores 0, -50, then 800 far on: e^-850 is 0 in float64
        q, k = np.zeros((L, 4), dtype), np.zeros((S, 4), dtype)
        mask = np.full((L, S), -np.inf, dtype)
        mask[:, 0], mask[:, 1], mask[:, S - 100] = 0, -50, 800
        v[1] = [np.nan, np.inf, -np.inf]
    else:  # transformers' padding mask: the dtype's lowest number on the left padding
        q, k = rng.standard_normal((L, 4)).astype(dtype), rng.standard_normal((S, 4)).astype(dtype)
        mask = np.zeros((L, S), dtype)
        mask[:, :S // 2] = np.finfo(dtype).min
        v[:S // 2] = np.nan
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    r_out, r_lse = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask.astype(np.float64),
                                                    return_lse=True)
    assert np.all(np.isfinite(r_out)) and np.all(np.isfinite(out))
    assert_close(out, r_out, dtype, S, magnitude=4)
    assert_close(lse, r_lse, dtype, S, magnitude=abs(r_lse).max())
    # a genuine NaN or inf still shows: the same value row at a key of nonzero weight
    mask[0, :] = 0
    v[:] = np.nan
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.all(np.isnan(out))


def test_mask_minus_inf_hides_nan_score(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (3, 4), (5, 4), (5, 2))
    k[2] = np.nan
    mask = np.zeros((3, 5), dtype)
    mask[:, 2] = -np.inf
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    r_out = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask.astype(np.float64))
    assert np.all(np.isfinite(out))
    assert_close(out, r_out, dtype, 9, magnitude=4)


@pytest.mark.parametrize("scale", [0.0, -0.5, 3.0])
def test_explicit_scale(simd, dtype, rng, scale):
    q, k, v = attn_case(rng, dtype, (2, 10, 8), (2, 13, 8), (2, 13, 4))
    out, _ = check_attention(q, k, v, dtype, scale=scale)
    if scale == 0.0:
        assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True),
                                          out.shape), dtype, 13, magnitude=4)


def test_out_writes_into_merged_heads(simd, dtype, rng):
    B, H, L, E = 2, 4, 17, 8
    q, k, v = attn_case(rng, dtype, (B, H, L, E), (B, H, L, E), (B, H, L, E))
    merged = np.full((B, L, H * E), np.nan, dtype)
    res = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                out=fastattn.split_heads(merged, H))
    assert np.shares_memory(res, merged)
    expected = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_array_equal(merged, fastattn.merge_heads(expected))


def test_inputs_are_not_modified(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (2, 2, 70, 16), (2, 2, 90, 16), (2, 2, 90, 8))
    v[0, 0, 3] = np.nan
    mask = (rng.random((70, 90)) > 0.5).astype(np.float64)
    copies = [a.copy() for a in (q, k, v, mask)]
    flags = [a.flags.writeable for a in (q, k, v, mask)]
    fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True,
                                          need_weights=True)
    for a, c, f in zip((q, k, v, mask), copies, flags):
        np.testing.assert_array_equal(a, c)
        assert a.flags.writeable == f


def test_read_only_and_unaligned_inputs(simd, rng):
    buf = np.zeros(4 * 3 * 5 * 8 + 1, np.uint8)[1:].view(np.float32)  # misaligned by 1 byte
    buf[...] = rng.standard_normal(buf.size)
    q = buf.reshape(3, 5, 8)
    q.flags.writeable = False
    assert not q.flags.aligned
    out = fastattn.scaled_dot_product_attention(q, q, q)
    r = ref.scaled_dot_product_attention(*f64(q, q, q))
    assert_close(out, r, np.float32, 13, magnitude=4)


def test_dtypes_of_output(simd, dtype, rng):
    q, k, v = attn_case(rng, dtype, (3, 4), (3, 4), (3, 4))
    assert fastattn.scaled_dot_product_attention(q, k, v).dtype == dtype


@pytest.mark.parametrize("L", [1, 3])
@pytest.mark.parametrize("kind", ["none", "bool", "float", "causal"])
def test_decode_split_along_keys(simd, dtype, rng, L, kind):
    """Few (batch, head) items, few query rows, many keys: the keys are split
    in pieces computed apart and merged by their log-sum-exp."""
    S = 5000
    q, k, v = attn_case(rng, dtype, (1, 2, L, 32), (1, 2, S, 32), (1, 2, S, 24))
    kwargs = {}
    if kind == "bool":
        mask = rng.random((1, 1, 1, S)) > 0.3
        mask[..., :2500] = False            # whole pieces hidden
        kwargs["attn_mask"] = mask
    elif kind == "float":
        kwargs["attn_mask"] = np.where(rng.random((L, S)) > 0.5, rng.standard_normal((L, S)),
                                       -np.inf)
    elif kind == "causal":
        kwargs.update(is_causal=True, causal_alignment="lower_right")
    out = fastattn.scaled_dot_product_attention(q, k, v, **kwargs)
    mask = kwargs.pop("attn_mask", None)
    rm = None if mask is None or mask.dtype == bool else mask.astype(dtype).astype(np.float64)
    r = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask if rm is None else rm,
                                         **kwargs)
    assert_close(out, r, dtype, 32 + S, magnitude=4)
    for n in (1, 2, 3):
        again = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, num_threads=n,
                                                      **kwargs)
        np.testing.assert_array_equal(again, out)


def test_decode_split_edge_values(simd, dtype, rng):
    S = 4096
    q, k, v = attn_case(rng, dtype, (1, 1, 2, 16), (1, 1, S, 16), (1, 1, S, 8))
    mask = np.ones((2, S), bool)
    mask[0] = False                          # a row that sees nothing
    mask[1, 3000:] = False                   # hidden keys with non-finite values
    v[0, 0, 3500] = np.nan
    v[0, 0, 3600] = np.inf
    out = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert np.all(out[0, 0, 0] == 0)
    r = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask)
    assert np.all(np.isfinite(out))
    assert_close(out, r, dtype, 16 + S, magnitude=4)
    q[0, 0, 1, 0] = np.nan                   # a NaN query row stays NaN
    assert np.all(np.isnan(fastattn.scaled_dot_product_attention(q, k, v)[0, 0, 1]))


@pytest.mark.parametrize("kind", ["none", "bool", "causal"])
def test_decode_split_weights(simd, dtype, rng, kind):
    """The weights of a split call come from each row's merged maximum and
    sum: they match the reference, and asking for them changes no bit of
    the output (check_attention compares the two outputs bitwise)."""
    S = 4500
    q, k, v = attn_case(rng, dtype, (2, 1, 2, 16), (2, 1, S, 16), (2, 1, S, 8))
    kwargs = {}
    if kind == "bool":
        mask = rng.random((2, 1, 2, S)) > 0.4
        mask[0, 0, 1] = False                # a row that sees nothing
        kwargs["attn_mask"] = mask
    elif kind == "causal":
        kwargs.update(is_causal=True, causal_alignment="lower_right")
    out, w = check_attention(q, k, v, dtype, **kwargs)
    if kind == "bool":
        assert np.all(w[0, 0, 1] == 0) and np.all(out[0, 0, 1] == 0)
    q[1, 0, 0, 3] = np.nan                   # a NaN row: NaN weights everywhere
    out, w = fastattn.scaled_dot_product_attention(q, k, v, need_weights=True, **kwargs)
    assert np.all(np.isnan(w[1, 0, 0])) and np.all(np.isnan(out[1, 0, 0]))


def test_out_interleaved_with_an_input_in_one_buffer(rng):
    """out and key in alternate columns of one buffer share no element: accepted."""
    buf = np.zeros((1, 2, 4, 16), np.float32)
    buf[..., ::2] = rng.standard_normal((1, 2, 4, 8))
    q = rng.standard_normal((1, 2, 4, 8)).astype(np.float32)
    key = buf[..., ::2]
    expected = fastattn.scaled_dot_product_attention(q, key.copy(), q)
    out = fastattn.scaled_dot_product_attention(q, key, q, out=buf[..., 1::2])
    np.testing.assert_array_equal(out, expected)
    with pytest.raises(ValueError, match="out overlaps key"):
        fastattn.scaled_dot_product_attention(q, key, q, out=buf[..., ::2])


def test_float_mask_beyond_float32_range_is_quiet(rng):
    import warnings
    q = rng.standard_normal((3, 4)).astype(np.float32)
    mask = np.array([0.0, -1e300, 0.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = fastattn.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    r = ref.scaled_dot_product_attention(*f64(q, q, q), attn_mask=np.array([0.0, -np.inf, 0.0]))
    assert_close(out, r, np.float32, 7, magnitude=4)


@pytest.mark.parametrize("E", [8, 32, 64, 65, 128])
@pytest.mark.parametrize("L", [1, 4, 64])
@pytest.mark.parametrize("strided", [False, True])
def test_scale_brings_an_overflowing_product_back(simd, E, L, strided):
    # q.k = 5.8e38 is beyond float32, scale * q.k = 58 is not: the block
    # kernel (L = 64) scales each half of a score of E >= 64 before adding
    # them, the row kernel (L <= 4: decoding; and the block kernel's rows
    # that came out non-finite) each partial sum and each product of the
    # tail (E = 8 is all tail on AVX-512), so the score stays finite (as the
    # float64 reference and PyTorch give), whatever L and the keys' strides
    S = 2
    q = np.full((1, 1, L, E), 3e18 * np.sqrt(64 / E), np.float32)
    k = np.full((1, 1, S, E), 3e18 * np.sqrt(64 / E), np.float32)
    k[0, 0, 1] *= 0.5
    v = np.array([1.0, 2.0], np.float32).reshape(1, 1, S, 1)
    expected = ref.scaled_dot_product_attention(*f64(q, k, v)[:3], scale=1e-37)
    if strided:  # features 2 apart
        k = np.repeat(k, 2, axis=-1)[..., ::2]
    out = fastattn.scaled_dot_product_attention(q, k, v, scale=1e-37)
    assert np.isfinite(out).all()
    assert_close(out, expected, np.float32, S)


@pytest.mark.parametrize("E", [8, 32, 63, 64, 128])
@pytest.mark.parametrize("L", [1, 64])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_scale_brings_back_products_near_the_float_limit(simd, E, L, softcap):
    # every product q_e * k_e is about 1e38, so any sum of two overflows;
    # the scores (scale * q.k = 2.7, 3, 3.3) are ordinary: the same answer
    # on every path and for any E, whatever sums a path's vectors form, and
    # the weights and lse of the rows the block kernel recomputes too (with
    # a softcap, which would have made the overflow's inf finite)
    c = np.array([0.9, 1.0, 1.1])
    q = np.full((1, 1, L, E), 1e19, np.float32)
    k = (c[:, None] * np.full((3, E), 1e19)).astype(np.float32)[None, None]
    v = np.array([1.0, 2.0, 3.0], np.float32).reshape(1, 1, 3, 1)
    scale = float(np.float32(3.0 / E / 1e38))
    out, w, lse = fastattn.scaled_dot_product_attention(q, k, v, scale=scale, softcap=softcap,
                                                        need_weights=True, return_lse=True)
    r_out, r_w, r_lse = ref.scaled_dot_product_attention(*f64(q, k, v)[:3], scale=scale,
                                                         softcap=softcap, need_weights=True,
                                                         return_lse=True)
    assert_close(out, r_out, np.float32, E)
    assert_close(w, r_w, np.float32, E)
    check_lse(lse, r_lse, np.float32, E)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("E", [4, 8, 16, 64, 128])
@pytest.mark.parametrize("L", [1, 2, 64])
def test_a_scale_near_the_float_limit_overflows_a_score_to_minus_inf(simd, dtype, E, L):
    # scale near dtype's largest: key 1's score, scale * -E, is beyond the
    # range and -inf, as in float arithmetic (PyTorch, the reference in
    # dtype), so key 0 (scale * -0.5) takes all the weight and key 2
    # (scale * -0.6) none.  Key 1's products alternate in sign, each beyond
    # the range once scaled (inf - inf): the row kernel, which recomputes a
    # non-finite score product by product, gave NaN rows
    big = float(np.finfo(dtype).max) * 0.9
    q = np.full((1, 1, L, E), 1.0 / E, dtype)
    k = np.empty((1, 1, 3, E), dtype)
    k[..., 0, :], k[..., 2, :] = -0.5, -0.6
    k[..., 1, :] = np.tile([2.0 * E, -4.0 * E], E // 2)
    v = np.arange(9, dtype=dtype).reshape(1, 1, 3, 3)
    out, w, lse = fastattn.scaled_dot_product_attention(q, k, v, scale=big, need_weights=True,
                                                        return_lse=True)
    np.testing.assert_array_equal(out, np.broadcast_to(v[..., :1, :], out.shape))
    np.testing.assert_array_equal(w, np.broadcast_to(np.eye(3, dtype=dtype)[0], w.shape))
    np.testing.assert_allclose(lse, dtype(big) * dtype(-0.5), rtol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("L", [1, 64])
@pytest.mark.parametrize("S", [2, 300, 2100])
@pytest.mark.parametrize("threads", [1, 2])
def test_values_near_the_float_limit(simd, L, S, threads):
    # the output is a weighted mean of the values, within their range, but
    # their unnormalised sum (S values near 3e38) is not: every path gives
    # the reference's answer (S = 2100 decodes in pieces merged)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, L, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, 8)).astype(np.float32)
    v = (3e38 * rng.uniform(0.5, 1.0, (1, 2, S, 3)) * rng.choice([-1, 1], 3)).astype(np.float32)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, num_threads=threads)
    r_out, r_lse = ref.scaled_dot_product_attention(*f64(q, k, v)[:3], return_lse=True)
    assert np.isfinite(out).all()
    assert_close(out, r_out, np.float32, S, magnitude=3e38)
    check_lse(lse, r_lse, np.float32, S)


@pytest.mark.parametrize("L", [5, 65])
def test_power_of_two_scale_above_one_with_huge_queries(simd, L):
    # q = 2^70 with scale = 2^58: q * scale is beyond float32, the score
    # (14 * 2^58 against a tiny key) is not; the kernels must not take the
    # scale into the queries then (they do for powers of two up to 1)
    q = np.full((L, 16), 2.0 ** 70, np.float32)
    q[:, 1] = -(2.0 ** 70)
    k = np.full((1, 16), 2.0 ** -70, np.float32)
    v = np.arange(16, dtype=np.float32)[None]
    out, w = fastattn.scaled_dot_product_attention(q, k, v, scale=2.0 ** 58, need_weights=True)
    np.testing.assert_array_equal(out, np.broadcast_to(v, (L, 16)))
    np.testing.assert_array_equal(w, np.ones((L, 1), np.float32))


@pytest.mark.parametrize("S", [3000, 2 ** 20])
def test_decoding_keeps_small_weights_after_a_large_one(simd, S):
    """Every value 1, so the output is 1 whatever the weights: one key of
    weight 1 (the 1024th), then keys of weight 2^-25, below half an ulp of
    1 in float32.  Added one by one to the running sum of the weighted
    values, each was lost (S = 2^20: 0.99814; S = 3000: 0.999986); each
    key block's part is summed apart and then added, so they count.  (The
    same running sum stopped at 2^24 terms: 2^29 keys of equal weight gave
    0.5, too slow a case for the suite.)"""
    q = np.ones((1, 1, 1, 1), np.float32)
    k = np.full((1, 1, S, 1), -25 * np.log(2), np.float32)
    k[0, 0, 1023] = 0
    v = np.ones((1, 1, S, 1), np.float32)
    out = fastattn.scaled_dot_product_attention(q, k, v)
    assert abs(float(out[0, 0, 0, 0]) - 1) <= 4 * np.finfo(np.float32).eps


@pytest.mark.parametrize("step", [0.5, 5.0, 6.0, 40.0])
def test_running_maximum_rises_block_by_block(simd, dtype, rng, step):
    """Scores that rise by `step` from one key block of 128 to the next, and
    within a block: the kernel's running maximum trails the true one by up
    to ln 256 (it is raised only past that), so steps of 0.5 and 5 never
    raise it after the first block and 6 and 40 raise it in every block;
    the output, the weights and the log-sum-exp are those of the float64
    reference either way."""
    L, S, E = 70, 600, 32
    q, k, v = attn_case(rng, dtype, (L, E), (S, E), (S, 16))
    mask = (step * (np.arange(S) // 128 + 0.9 * (np.arange(S) % 128) / 128)).astype(dtype)
    mask = np.broadcast_to(mask, (L, S))
    check_attention(q, k, v, dtype, attn_mask=mask)
    _, lse = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, return_lse=True)
    rq, rk, rm = f64(q, k, mask)
    z = rq @ rk.T / np.sqrt(E) + rm
    r_lse = z.max(axis=-1) + np.log(np.exp(z - z.max(axis=-1, keepdims=True)).sum(axis=-1))
    assert_close(lse, r_lse, dtype, E + S, magnitude=float(np.abs(r_lse).max()))


@pytest.mark.parametrize("L", [1, 2])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (8, 1), (6, 2), (3, 1)])
@pytest.mark.parametrize("S", [300, 2100])
@pytest.mark.parametrize("nan_value", [False, True])
def test_grouped_query_decoding_is_each_head_alone(simd, dtype, L, Hq, Hkv, S, nan_value):
    """Decoding with grouped-query attention computes the query heads of a
    key/value head together (their keys read once): up to 4 rows in all
    (the row kernel), each head keeps the bits of the same call with the
    keys repeated per head (one head per call), with its own slope and
    sink, its lse, split keys or not; also where a NaN value row sends
    heads through the row kernel's second pass (which took head 0's slope
    and sink for every head: the helper's reproducer of 2026-12-04), seen
    by some heads only.  More rows of heads (8 heads of a token, 4 of two)
    are folded into the block kernel's columns: the values of the one-head
    calls, to the suite's bound."""
    rng = np.random.default_rng(Hq * S + L)
    q = rng.standard_normal((2, Hq, L, 32)).astype(dtype)
    k = rng.standard_normal((2, Hkv, S, 32)).astype(dtype)
    v = rng.standard_normal((2, Hkv, S, 24)).astype(dtype)
    slopes = rng.random(Hq) * 0.01
    if nan_value:  # steep slopes on even heads: the first key's weight underflows there
        v[:, :, 0] = np.nan
        slopes[::2] = 1.0
    options = dict(is_causal=True, causal_alignment="lower_right", return_lse=True,
                   alibi_slopes=slopes, sinks=rng.standard_normal(Hq))
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True, **options)
    group = Hq // Hkv
    ko, vo = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    want, want_lse = fastattn.scaled_dot_product_attention(q, ko, vo, **options)
    if group * L <= 4:
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)
    else:
        assert_close(out, want.astype(np.float64), dtype, 32 + S)
        assert_close(lse, want_lse.astype(np.float64), dtype, 32 + S, magnitude=10.0)


@pytest.mark.skipif("avx512" not in fastattn.available_simd_paths(), reason="no AVX-512 here")
@pytest.mark.parametrize("E,Ev", [(12, 12), (44, 64), (64, 76), (132, 204)])
@pytest.mark.parametrize("L,S", [(1, 300), (4, 2500), (2, 40)])
def test_decoding_with_part_vectors_runs_the_avx2_kernels_on_avx512(dtype, E, Ev, L, S):
    """Decoding (at most 4 query rows) whose E or Ev is not a whole number
    of 512-bit vectors runs the AVX2 kernels on an AVX-512 CPU (fa_api.c's
    attn_isa, where 256-bit vectors were up to 2.2x faster): the AVX2
    path's bits, with the weights and the log-sum-exp, split keys or not."""
    rng = np.random.default_rng(E * Ev + L)
    q = rng.standard_normal((2, 3, L, E)).astype(dtype)
    k = rng.standard_normal((2, 3, S, E)).astype(dtype)
    v = rng.standard_normal((2, 3, S, Ev)).astype(dtype)
    results = {}
    for path in ("avx512", "avx2"):
        with simd_path(path):
            results[path] = [fastattn.scaled_dot_product_attention(
                q, k, v, is_causal=True, causal_alignment="lower_right", num_threads=2, **kw)
                for kw in ({"return_lse": True}, {"need_weights": True})]
    for got, want in zip(results["avx512"], results["avx2"]):
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x, y)
