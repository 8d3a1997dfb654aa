"""attention_backward: the gradients of scaled_dot_product_attention against
the float64 chain rule of fastattn.reference and against central
differences of the forward, on every variant; the same bits for any thread
count, layout and batch; its errors."""
import numpy as np
import pytest
from conftest import f64, simd_path, tolerance

import fastattn
from fastattn import reference

VARIANTS = {
    "plain": {},
    "causal": {"is_causal": True},
    "causal-lower-right": {"is_causal": True, "causal_alignment": "lower_right"},
    "bool-mask": {"attn_mask": "bool"},
    "additive-mask": {"attn_mask": "float"},
    "window": {"window_size": (17, 3)},
    "alibi": {"alibi_slopes": "slopes"},
    "softcap": {"softcap": 2.5},
    "sinks": {"sinks": "sinks"},
    "gqa": {"enable_gqa": True},
    "everything": {"enable_gqa": True, "is_causal": True, "window_size": (40, -1),
                   "alibi_slopes": "slopes", "softcap": 3.0, "sinks": "sinks",
                   "attn_mask": "bool", "scale": 0.3},
}


def inputs(rng, dtype, B=2, H=4, L=70, S=150, E=40, Ev=24, variant=(), **shape):
    """Random operands and the variant's options, made concrete."""
    kw = dict(VARIANTS[variant]) if isinstance(variant, str) else dict(variant)
    Hkv = H // 2 if kw.get("enable_gqa") else H
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    do = rng.standard_normal((B, H, L, Ev)).astype(dtype)
    if kw.get("attn_mask") == "bool":
        kw["attn_mask"] = rng.random((L, S)) > 0.3
        kw["attn_mask"][5] = False  # a row that sees nothing
    elif kw.get("attn_mask") == "float":
        kw["attn_mask"] = np.where(rng.random((B, 1, L, S)) > 0.2,
                                   rng.standard_normal((B, 1, L, S)), -np.inf).astype(dtype)
    if kw.get("alibi_slopes") == "slopes":
        kw["alibi_slopes"] = np.linspace(0.05, 0.5, H)
    if kw.get("sinks") == "sinks":
        kw["sinks"] = np.linspace(-1.0, 2.0, H)
    return do, q, k, v, kw


def forward_backward(do, q, k, v, **kw):
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    return fastattn.attention_backward(do, q, k, v, out, lse, **kw)


def expected(do, q, k, v, **kw):
    ref_kw = {n: x for n, x in kw.items() if n != "num_threads"}
    if isinstance(ref_kw.get("attn_mask"), np.ndarray) and ref_kw["attn_mask"].dtype.kind == "f":
        ref_kw["attn_mask"] = ref_kw["attn_mask"].astype(np.float64)
    return reference.attention_backward(*f64(do, q, k, v), **ref_kw)


def check_gradients(got, want, dtype, n):
    """Each gradient within the bound of a length-n reduction, relative to
    its largest element: three reductions are chained (dP over Ev, the
    softmax's D and dV over the keys, dQ and dK over S and L), each within
    that bound."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.dtype(dtype) or g.dtype == w.dtype and g.ndim <= 2
        assert g.shape == w.shape
        scale = max(float(np.abs(w).max()), 1e-30)
        np.testing.assert_allclose(g, w, rtol=0, atol=3 * tolerance(dtype, n) * scale)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_match_the_float64_chain_rule(variant, dtype, simd, rng):
    do, q, k, v, kw = inputs(rng, dtype, variant=variant)
    got = forward_backward(do, q, k, v, **kw)
    assert len(got) == (4 if "sinks" in kw else 3)
    check_gradients(got, expected(do, q, k, v, **kw), dtype, 150 + 40 + 24)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gradients_match_central_differences(variant, rng):
    """The float64 gradients against (f(x + h) - f(x - h)) / 2h of the
    forward's sum(out * grad_out), element by element (torch.autograd's
    gradcheck, without torch)."""
    do, q, k, v, kw = inputs(rng, np.float64, B=1, H=2, L=6, S=9, E=4, Ev=3, variant=variant)
    if isinstance(kw.get("attn_mask"), np.ndarray):
        kw["attn_mask"] = kw["attn_mask"][..., :6, :9]
    if "window_size" in kw:
        kw["window_size"] = (3, 1) if variant == "window" else (5, -1)
    params = [q, k, v] + ([kw["sinks"].copy()] if "sinks" in kw else [])
    grads = forward_backward(do, q, k, v, **kw)

    def loss(*xs):
        opts = dict(kw, sinks=xs[3]) if len(xs) > 3 else kw
        return float(np.sum(fastattn.scaled_dot_product_attention(*xs[:3], **opts) * do))

    h = 1e-6
    for x, g in zip(params, grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            keep = x[idx]
            x[idx] = keep + h
            up = loss(*params)
            x[idx] = keep - h
            down = loss(*params)
            x[idx] = keep
            numeric[idx] = (up - down) / (2 * h)
        # the difference's truncation (h^2 f''') and rounding (eps f / h)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-7)


def test_float32_gradients_match_pytorch(rng):
    torch = pytest.importorskip("torch")
    do, q, k, v, kw = inputs(rng, np.float32, variant="gqa")
    mask = rng.random((70, 150)) > 0.3
    got = forward_backward(do, q, k, v, attn_mask=mask, is_causal=False, **kw)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.tensor(mask), enable_gqa=True)
    out.backward(torch.tensor(do))
    want = [x.grad.numpy().astype(np.float64) for x in (tq, tk, tv)]
    # both are float32 computations: twice the bound of one
    check_gradients(got, want, np.float32, 2 * (150 + 40 + 24))


@pytest.mark.parametrize("variant", ["everything", "sinks", "causal"])
def test_same_bits_for_any_thread_count_layout_and_batch(variant, rng):
    do, q, k, v, kw = inputs(rng, np.float32, B=3, L=150, S=300, variant=variant)
    first = forward_backward(do, q, k, v, num_threads=1, **kw)
    for threads in (2, 3, 4):
        again = forward_backward(do, q, k, v, num_threads=threads, **kw)
        for a, b in zip(first, again):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), threads
    # (B, L, H, E) arrays seen through transposed views
    views = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
             for x in (do, q, k, v)]
    for a, b in zip(first, forward_backward(*views, **kw)):
        assert np.array_equal(a, b)
    # the second batch item alone
    one = {n: (x[1:2] if isinstance(x, np.ndarray) and x.ndim == 4 else x) for n, x in kw.items()}
    alone = forward_backward(do[1:2], q[1:2], k[1:2], v[1:2], **one)
    for a, b in zip(first[:3], alone[:3]):
        assert np.array_equal(a[1:2], b)


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_16_bit_inputs_round_the_float32_gradients(dtype_name, rng):
    half = np.dtype(np.float16) if dtype_name == "float16" else \
        np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    do, q, k, v, kw = inputs(rng, np.float32, variant="causal")
    do, q, k, v = (x.astype(half) for x in (do, q, k, v))
    got = forward_backward(do, q, k, v, **kw)
    widened = [x.astype(np.float32) for x in (do, q, k, v)]
    out, lse = fastattn.scaled_dot_product_attention(*widened[1:], return_lse=True, **kw)
    out = out.astype(half).astype(np.float32)  # the forward's output, as the caller holds it
    want = fastattn.attention_backward(widened[0], *widened[1:], out, lse, **kw)
    for g, w in zip(got, want):
        assert g.dtype == half
        assert np.array_equal(g, w.astype(half))


def test_broadcast_inputs_get_summed_gradients(rng):
    do, q, k, v, _ = inputs(rng, np.float64, B=3)
    k1, v1 = k[:1], v[:1]  # one key/value batch item for all three
    got = forward_backward(do, q, k1, v1)
    want = expected(do, q, k1, v1)
    assert got[1].shape == k1.shape and got[2].shape == v1.shape
    check_gradients(got, want, np.float64, 150 + 40 + 24)


def test_hidden_keys_get_no_gradient_and_leak_nothing(rng):
    do, q, k, v, _ = inputs(rng, np.float32, B=1, H=1)
    mask = np.ones((70, 150), bool)
    mask[:, 100:] = False
    k[..., 120, :] = np.inf
    v[..., 130, :] = np.nan
    gq, gk, gv = forward_backward(do, q, k, v, attn_mask=mask)
    assert np.all(np.isfinite(gq)) and np.all(np.isfinite(gk[..., :100, :]))
    assert not gk[..., 100:, :].any() and not gv[..., 100:, :].any()
    assert np.all(np.isfinite(gv))


def test_rows_that_see_nothing_give_zeros_and_nan_stays_nan(rng):
    do, q, k, v, _ = inputs(rng, np.float32, B=1, H=1)
    mask = np.ones((70, 150), bool)
    mask[3] = False
    gq, gk, gv = forward_backward(do, q, k, v, attn_mask=mask)
    assert not gq[..., 3, :].any() and np.all(np.isfinite(gk))
    q[..., 7, 0] = np.nan
    gq, gk, gv = forward_backward(do, q, k, v)
    assert np.isnan(gq[..., 7, :]).all() and np.isnan(gk).any()
    assert not np.isnan(np.delete(gq, 7, axis=-2)).any()


def test_a_logsumexp_of_other_inputs_is_refused(rng):
    do, q, k, v, _ = inputs(rng, np.float32)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="logsumexp does not match"):
        fastattn.attention_backward(do, q, k, v, out, lse + 0.01)
    with pytest.raises(ValueError, match="logsumexp does not match"):  # forgot is_causal
        fastattn.attention_backward(do, q, k, v, out, lse, is_causal=True)
    with pytest.raises(ValueError, match="logsumexp has shape"):
        fastattn.attention_backward(do, q, k, v, out, lse[..., :-1])
    with pytest.raises(TypeError, match="logsumexp has dtype"):
        fastattn.attention_backward(do, q, k, v, out, lse.astype(np.float64))
    with pytest.raises(ValueError, match="grad_out has shape"):
        fastattn.attention_backward(do[:1], q, k, v, out, lse)
    with pytest.raises(TypeError, match="out has dtype"):
        fastattn.attention_backward(do, q, k, v, out.astype(np.float64), lse)
    with pytest.raises(TypeError, match="grad_out"):
        fastattn.attention_backward(list(do), q, k, v, out, lse)
    with pytest.raises(ValueError, match="dropout_p"):
        fastattn.attention_backward(do, q, k, v, out, lse, dropout_p=0.1)


def test_the_forwards_lse_is_taken_for_heads_of_2_to_the_19_features(rng):
    """Four query rows or fewer take the forward's row kernel, whose sums of
    E products differ from the backward's by about 1e-2 at E = 2^19 (the
    weights summed to 0.9975): within the scores' own rounding, which the
    check allows; an lse 0.5 off is still refused."""
    E = 2 ** 19
    q = rng.random((1, 1, 3, E), np.float32)
    k = rng.random((1, 1, 5, E), np.float32)
    v = rng.random((1, 1, 5, 4), np.float32)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    do = np.ones_like(out)
    got = fastattn.attention_backward(do, q, k, v, out, lse)
    want = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)))
    for g, w in zip(got, want):  # the scores' rounding, E^0.5 eps |q| |k| scale, bounds these
        assert np.max(np.abs(g - w)) <= 0.05 * max(np.max(np.abs(w)), 1)
    with pytest.raises(ValueError, match="logsumexp does not match"):
        fastattn.attention_backward(do, q, k, v, out, lse + 0.5)


def test_no_keys_give_zero_gradients(rng):
    do, q, k, v, _ = inputs(rng, np.float64, S=0)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    for got, want in zip(fastattn.attention_backward(do, q, k, v, out, lse),
                         reference.attention_backward(do, q, k, v)):
        assert got.shape == want.shape and not got.any() and not want.any()
    sinks = np.linspace(-1, 1, 4)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, sinks=sinks)
    got = fastattn.attention_backward(do, q, k, v, out, lse, sinks=sinks)
    want = reference.attention_backward(do, q, k, v, sinks=sinks)
    assert np.allclose(got[3], want[3], rtol=1e-12, atol=0)


def test_the_callers_arrays_are_left_alone(rng):
    do, q, k, v, kw = inputs(rng, np.float32, variant="everything")
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    before = [x.copy() for x in (do, q, k, v, out, lse)]
    fastattn.attention_backward(do, q, k, v, out, lse, **kw)
    for x, y in zip((do, q, k, v, out, lse), before):
        assert np.array_equal(x, y, equal_nan=True)


def test_the_portable_path_gives_the_same_gradients_within_rounding(rng):
    do, q, k, v, kw = inputs(rng, np.float32, variant="everything")
    with simd_path("portable"):
        portable = forward_backward(do, q, k, v, **kw)
    check_gradients(portable, expected(do, q, k, v, **kw), np.float32, 150 + 40 + 24)


@pytest.mark.parametrize("variant", ["plain", "everything"])
def test_varlen_gradients_are_each_sequences_own(variant, rng):
    """varlen_attention_backward over packed sequences of different lengths
    (one empty, one of more queries than keys): each sequence's gradients
    bitwise those of attention_backward on its rows alone (enable_gqa), the
    same bits for any thread count."""
    kw = {"plain": {}, "everything": {"is_causal": True, "window_size": (40, 2),
                                      "alibi_slopes": np.linspace(0.1, 0.4, 4),
                                      "softcap": 3.0, "sinks": np.linspace(-1, 1, 4),
                                      "scale": 0.2}}[variant]
    q_lens, k_lens = [70, 0, 5, 130, 9], [150, 3, 300, 130, 4]
    cu_q, cu_k = np.cumsum([0] + q_lens), np.cumsum([0] + k_lens)
    q = rng.standard_normal((cu_q[-1], 4, 40)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 40)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 24)).astype(np.float32)
    do = rng.standard_normal((cu_q[-1], 4, 24)).astype(np.float32)
    out, lse = fastattn.varlen_attention(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    got = fastattn.varlen_attention_backward(do, q, k, v, out, lse, cu_q, cu_k,
                                             num_threads=1, **kw)
    again = fastattn.varlen_attention_backward(do, q, k, v, out, lse, cu_q, cu_k,
                                               num_threads=3, **kw)
    for a, b in zip(got, again):
        assert np.array_equal(a, b)
    sinks_grad = 0
    for b in range(len(q_lens)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        heads = [x[rows].transpose(1, 0, 2) for x in (do, q)]
        kv = [x[keys].transpose(1, 0, 2) for x in (k, v)]
        o, l = fastattn.scaled_dot_product_attention(
            heads[1], *kv, return_lse=True, enable_gqa=True, causal_alignment="lower_right",
            **kw)
        alone = fastattn.attention_backward(heads[0], heads[1], *kv, o, l, enable_gqa=True,
                                            causal_alignment="lower_right", **kw)
        assert np.array_equal(got[0][rows], alone[0].transpose(1, 0, 2))
        assert np.array_equal(got[1][keys], alone[1].transpose(1, 0, 2))
        assert np.array_equal(got[2][keys], alone[2].transpose(1, 0, 2))
        if "sinks" in kw:
            sinks_grad = sinks_grad + alone[3]
    if "sinks" in kw:
        np.testing.assert_allclose(got[3], sinks_grad, rtol=1e-5)
        want = reference.attention_backward(
            *f64(do[:70].transpose(1, 0, 2), q[:70].transpose(1, 0, 2),
                 k[:150].transpose(1, 0, 2), v[:150].transpose(1, 0, 2)),
            enable_gqa=True, causal_alignment="lower_right", **kw)
        check_gradients([got[0][:70].transpose(1, 0, 2)], want[:1], np.float32, 214)


def test_varlen_errors(rng):
    q = rng.standard_normal((10, 2, 8)).astype(np.float32)
    cu = np.array([0, 4, 10])
    out, lse = fastattn.varlen_attention(q, q, q, cu, cu, return_lse=True)
    with pytest.raises(ValueError, match="lse has shape"):
        fastattn.varlen_attention_backward(q, q, q, q, out, lse.T, cu, cu)
    with pytest.raises(ValueError, match="lse does not match"):
        fastattn.varlen_attention_backward(q, q, q, q, out, lse, cu, cu, is_causal=True)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        fastattn.varlen_attention_backward(q, q, q, q, out, lse, cu[:-1], cu)


def test_sinks_of_each_batch_item_over_several_batch_axes(rng):
    """(B, Hq) sinks belong to the first batch axis, whatever axes follow."""
    q = rng.standard_normal((2, 5, 3, 4, 8))
    sinks = rng.standard_normal((2, 3))
    do = rng.standard_normal(q.shape)
    got = forward_backward(do, q, q, q, sinks=sinks)
    want = reference.attention_backward(do, q, q, q, sinks=sinks)
    assert got[3].shape == (2, 3)
    check_gradients(got, want, np.float64, 4 + 8 + 8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_groups_larger_than_a_query_block(dtype, rng):
    """65 query heads over one key/value head (float32's query block is 64
    rows, float64's 32), as Falcon-7B's 71 over 1."""
    q = rng.standard_normal((1, 65, 5, 8)).astype(dtype)
    k = rng.standard_normal((1, 1, 300, 8)).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    got = forward_backward(do, q, k, k, enable_gqa=True)
    check_gradients(got, expected(do, q, k, k, enable_gqa=True), dtype, 300 + 16)


@pytest.mark.parametrize("case", ["mask-min", "alibi-far", "bias-1e8-f64"])
def test_a_large_lse_rounded_by_the_forward_is_taken(case, rng):
    """Rows whose log-sum-exp is too large for its dtype to carry the sum
    exactly (a row hidden by finfo.min, as transformers' eager masks hide
    padding; ALiBi far from the keys; a constant bias of 1e8 in float64):
    the forward's own lse is taken and the gradients are the reference's."""
    dtype = np.float64 if case == "bias-1e8-f64" else np.float32
    q, k, v, do = (rng.standard_normal((1, 2, 8, 16)).astype(dtype) for _ in range(4))
    kw = {}
    if case == "mask-min":
        mask = np.zeros((8, 8), dtype)
        mask[:3] = np.finfo(dtype).min
        kw["attn_mask"] = mask
    elif case == "alibi-far":
        kw.update(alibi_slopes=np.array([0.5, 0.25]), causal_alignment=200000)
    else:
        kw["attn_mask"] = np.full((8, 8), 1e8, dtype)
    got = forward_backward(do, q, k, v, **kw)
    want = expected(do, q, k, v, **kw)
    # such scores keep fewer bits than the dtype's: the forward's own error
    # (ALiBi's 1e5 in float32: 2.7e-3) bounds the gradients' too
    out = fastattn.scaled_dot_product_attention(q, k, v, **kw)
    ref_kw = {n: x.astype(np.float64) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    ref = reference.scaled_dot_product_attention(*f64(q, k, v), **ref_kw)
    lost = float(np.abs(out - ref).max() / np.abs(ref).max())
    for g, w in zip(got, want):
        bound = max(3 * tolerance(dtype, 8 + 16 + 16), 4 * lost) * float(np.abs(w).max())
        np.testing.assert_allclose(g, w, rtol=0, atol=bound)


def test_a_nan_lse_is_refused_where_no_score_can_be_nan(rng):
    do, q, k, v, _ = inputs(rng, np.float32, B=1, H=1)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="logsumexp does not match"):
        fastattn.attention_backward(do, q, k, v, out, np.full_like(lse, np.nan))


@pytest.mark.parametrize("bias", ["mask", "alibi"])
def test_a_forward_nan_lse_from_a_bias_that_overflows_the_scores_is_taken(bias):
    # finite inputs whose scores a finite mask or ALiBi term pushes past
    # float32's largest: the forward's lse is NaN, and so are the gradients
    q = np.full((1, 1, 3, 1), 1e19, np.float32)
    k = np.full((1, 1, 4, 1), 8e18, np.float32)
    v = np.arange(4, dtype=np.float32).reshape(1, 1, 4, 1)
    do = np.ones((1, 1, 3, 1), np.float32)
    if bias == "mask":
        mask = np.zeros((3, 4), np.float32)
        mask[:, 1:3] = 3e38
        kw = dict(attn_mask=mask, scale=1.0)
    else:
        kw = dict(alibi_slopes=np.array([-3e36], np.float32), causal_alignment=-100, scale=1.0)
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
    assert np.isnan(lse).all()
    grads = fastattn.attention_backward(do, q, k, v, out, lse, **kw)
    assert all(np.isnan(g).any() for g in grads)
