"""MultiHeadAttention against the float64 reference (reference.multi_head_attention)."""
import numpy as np
import pytest
from conftest import assert_close, f64

import fastattn
import fastattn.mha
from fastattn import reference as ref

N, L, S, E, H = 3, 13, 17, 32, 4


def reference_of(m, query, key, value, **kwargs):
    """The reference with the module's weights, batch-first inputs, float64."""
    E_, kv = m.embed_dim, m.kv_dim
    if m.in_proj_weight is not None:
        wq, wk, wv = np.split(m.in_proj_weight, [E_, E_ + kv])
    else:
        wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
    weights = f64(wq, wk, wv, m.out_proj_weight, m.in_proj_bias, m.out_proj_bias)
    kwargs = {k: (f64(v)[0] if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    return ref.multi_head_attention(*f64(query, key, value), m.num_heads, *weights[:4],
                                    in_proj_bias=weights[4], out_proj_bias=weights[5], **kwargs)


CASES = {
    "self": {},
    "causal": {"is_causal": True},
    "padding": {"kpm": "bool"},
    "padding-float": {"kpm": "float"},
    "mask-bool": {"am": "bool2"},
    "mask-float": {"am": "float2"},
    "mask-per-head": {"am": "bool3"},
    "padding+causal": {"kpm": "bool", "is_causal": True},
    "padding+mask": {"kpm": "bool", "am": "bool3"},
    "padding-float+mask-bool": {"kpm": "float", "am": "bool2"},
    "causal+mask": {"is_causal": True, "am": "float2"},
    "cross": {"cross": "separate", "kdim": 24, "vdim": 40},
    "cross-packed": {"cross": "separate"},
    "cross-memory": {"cross": "same"},
    "gqa": {"num_kv_heads": 2, "kpm": "bool", "is_causal": True},
    "gqa-mqa-cross": {"num_kv_heads": 1, "cross": "separate", "kdim": 20, "vdim": 12},
    "no-bias": {"bias": False, "kpm": "bool"},
    "seq-first": {"batch_first": False, "kpm": "bool", "am": "float2"},
    "seq-first-cross": {"batch_first": False, "cross": "separate", "kdim": 8, "vdim": 8},
}


def make_case(rng, dtype, spec):
    """(module, batch-first inputs, forward kwargs in the module's layout, reference kwargs)."""
    m = fastattn.MultiHeadAttention(E, H, kdim=spec.get("kdim"), vdim=spec.get("vdim"),
                                    num_kv_heads=spec.get("num_kv_heads"),
                                    bias=spec.get("bias", True),
                                    batch_first=spec.get("batch_first", True), dtype=dtype,
                                    rng=rng)
    if m.in_proj_bias is not None:  # PyTorch starts biases at zero: give them values
        m.in_proj_bias[...] = rng.standard_normal(m.in_proj_bias.shape)
        m.out_proj_bias[...] = rng.standard_normal(E)
    q = rng.standard_normal((N, L, E)).astype(dtype)
    cross = spec.get("cross")
    Sx = S if cross else L
    if cross == "separate":
        k = rng.standard_normal((N, Sx, m.kdim)).astype(dtype)
        v = rng.standard_normal((N, Sx, m.vdim)).astype(dtype)
    elif cross == "same":
        k = v = rng.standard_normal((N, Sx, E)).astype(dtype)
    else:
        k = v = None
    kw = {"is_causal": spec.get("is_causal", False)}
    if spec.get("kpm"):
        lengths = np.array([Sx, Sx - 5, 0])  # the last sequence is all padding
        pad = np.arange(Sx)[None, :] >= lengths[:, None]
        kw["key_padding_mask"] = pad if spec["kpm"] == "bool" else np.where(pad, -np.inf, 0.5)
    am = spec.get("am")
    if am == "bool2":
        kw["attn_mask"] = rng.random((L, Sx)) < 0.3
    elif am == "float2":
        kw["attn_mask"] = rng.standard_normal((L, Sx)).astype(dtype)
    elif am == "bool3":
        kw["attn_mask"] = rng.random((N * H, L, Sx)) < 0.3
    return m, (q, k, v), kw


def run(m, q, k, v, **kw):
    """forward on the module's layout; result back to batch-first."""
    if m.batch_first:
        return m(q, k, v, **kw)
    t = (lambda a: None if a is None else a.swapaxes(0, 1))
    out, w = m(t(q), t(k), t(v), **kw)
    return t(out), w


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(simd, dtype, rng, case):
    m, (q, k, v), kw = make_case(rng, dtype, CASES[case])
    before = [None if a is None else a.copy() for a in (q, k, v)]
    out, w = run(m, q, k, v, need_weights=True, **kw)
    _, w_heads = run(m, q, k, v, need_weights=True, average_attn_weights=False, **kw)
    plain, none = run(m, q, k, v, **kw)
    assert none is None
    k_, v_ = (q, q) if k is None else (k, v)
    r_out, r_w = reference_of(m, q, k_, v_, need_weights=True, **kw)
    _, r_wh = reference_of(m, q, k_, v_, need_weights=True, average_attn_weights=False, **kw)
    n = 2 * E + max(m.kdim, m.vdim) + k_.shape[1]
    assert_close(out, r_out, dtype, n, magnitude=float(np.abs(r_out).max()))
    assert_close(w, r_w, dtype, n)
    assert_close(w_heads, r_wh, dtype, n)
    assert w.shape == (N, L, k_.shape[1]) and w_heads.shape == (N, H, L, k_.shape[1])
    np.testing.assert_array_equal(plain, out)  # need_weights changes nothing else
    for a, b in zip((q, k, v), before):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_all_padding_gives_output_bias(dtype, rng):
    """A sequence of padding only: zero attention, so exactly out_proj.bias (PyTorch: NaN)."""
    m, (q, _, _), kw = make_case(rng, dtype, {"kpm": "bool"})
    out, w = m(q, key_padding_mask=kw["key_padding_mask"], need_weights=True)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[2], np.broadcast_to(m.out_proj_bias, (L, E)))
    assert np.all(w[2] == 0)
    m0 = fastattn.MultiHeadAttention(E, H, bias=False, dtype=dtype, rng=rng)
    out0, _ = m0(q, key_padding_mask=kw["key_padding_mask"])
    assert np.all(out0[2] == 0)


def test_unbatched_equals_batch_of_one(dtype, rng):
    for batch_first in (True, False):
        m = fastattn.MultiHeadAttention(E, H, kdim=10, vdim=6, batch_first=batch_first,
                                        dtype=dtype, rng=rng)
        q = rng.standard_normal((L, E)).astype(dtype)
        k = rng.standard_normal((S, 10)).astype(dtype)
        v = rng.standard_normal((S, 6)).astype(dtype)
        pad = np.arange(S) >= 11
        am = rng.random((H, L, S)) < 0.2
        out, w = m(q, k, v, key_padding_mask=pad, attn_mask=am, need_weights=True,
                   average_attn_weights=False)
        ax = 0 if batch_first else 1
        out1, w1 = m(*(np.expand_dims(a, ax) for a in (q, k, v)), key_padding_mask=pad[None],
                     attn_mask=am, need_weights=True, average_attn_weights=False)
        assert out.shape == (L, E) and w.shape == (H, L, S)
        np.testing.assert_array_equal(out, np.squeeze(out1, ax))
        np.testing.assert_array_equal(w, w1[0])


def root(a):
    while a.base is not None:
        a = a.base
    return a


def test_heads_are_views_and_attention_writes_the_concat(monkeypatch, rng):
    """The heads given to attention are views of one projection buffer, and
    its out is the (N, H, L, D) view of a (N, L, E) buffer."""
    seen = {}
    real = fastattn.mha.scaled_dot_product_attention

    def spy(query, key, value, **kw):
        seen.update(query=query, key=key, value=value, out=kw["out"])
        return real(query, key, value, **kw)

    monkeypatch.setattr(fastattn.mha, "scaled_dot_product_attention", spy)
    m = fastattn.MultiHeadAttention(E, H, rng=rng)
    x = rng.standard_normal((N, L, E)).astype(np.float32)
    m(x)
    q, k, v, out = seen["query"], seen["key"], seen["value"], seen["out"]
    assert q.shape == (N, H, L, E // H)
    qkv = root(q)
    assert root(k) is qkv and root(v) is qkv and qkv.shape == (N * L, 3 * E)  # one product
    isz = out.itemsize
    assert root(out).shape == (N, L, E)
    assert out.strides == (L * E * isz, (E // H) * isz, E * isz, isz)


def test_thread_counts_bitwise(simd, dtype, rng):
    m, (q, k, v), kw = make_case(rng, dtype, CASES["gqa"])
    outs = [m(q, need_weights=True, num_threads=n, **kw) for n in (1, 2, 3)]
    for o, w in outs[1:]:
        np.testing.assert_array_equal(o, outs[0][0])
        np.testing.assert_array_equal(w, outs[0][1])


def test_float64_module_float32_input_is_an_error(rng):
    m = fastattn.MultiHeadAttention(E, H, dtype=np.float64, rng=rng)
    with pytest.raises(TypeError, match="query has dtype float32; this MultiHeadAttention has "
                                        "float64 weights"):
        m(np.zeros((1, 2, E), np.float32))


def test_initial_weights_follow_pytorch(rng):
    m = fastattn.MultiHeadAttention(64, 8, rng=rng)
    bound = np.sqrt(6 / (3 * 64 + 64))
    assert np.abs(m.in_proj_weight).max() <= bound and np.abs(m.in_proj_weight).max() > 0.9 * bound
    assert np.abs(m.out_proj_weight).max() <= 1 / 8
    assert np.all(m.in_proj_bias == 0) and np.all(m.out_proj_bias == 0)
    a = fastattn.MultiHeadAttention(64, 8, rng=7).in_proj_weight
    np.testing.assert_array_equal(a, fastattn.MultiHeadAttention(64, 8, rng=7).in_proj_weight)


# ---- state dicts -------------------------------------------------------------

def test_state_dict_round_trip(rng):
    a = fastattn.MultiHeadAttention(E, H, kdim=7, vdim=9, num_kv_heads=2, rng=rng)
    sd = a.state_dict()
    assert sorted(sd) == ["in_proj_bias", "k_proj_weight", "out_proj.bias", "out_proj.weight",
                          "q_proj_weight", "v_proj_weight"]
    assert sd["k_proj_weight"].shape == (2 * E // H, 7)
    assert sd["in_proj_bias"].shape == (E + 2 * 2 * E // H,)
    b = fastattn.MultiHeadAttention(E, H, kdim=7, vdim=9, num_kv_heads=2, dtype=np.float64,
                                    rng=rng)
    b.load_state_dict(sd)  # float32 -> float64, copied
    for name, arr in b.state_dict().items():
        assert arr.dtype == np.float64
        np.testing.assert_array_equal(arr, sd[name])
        assert not np.shares_memory(arr, sd[name])


def test_load_partial_with_strict_false(rng):
    m = fastattn.MultiHeadAttention(E, H, rng=rng)
    w = rng.standard_normal((E, E))
    m.load_state_dict({"out_proj.weight": w, "something.else": w}, strict=False)
    np.testing.assert_array_equal(m.out_proj_weight, w.astype(np.float32))


BAD_STATE = [
    ({"in_proj_weight": None}, ValueError, "missing ['in_proj_bias', 'out_proj.bias', "
                                           "'out_proj.weight'], unexpected []"),
    ({"extra": 1}, ValueError, "unexpected ['extra']"),
    ({"in_proj_weight": np.zeros((3 * E, E + 1))}, ValueError,
     f"state_dict['in_proj_weight'] has shape ({3 * E}, {E + 1}); expected ({3 * E}, {E})"),
    ({"in_proj_weight": np.zeros((3 * E, E), np.int32)}, TypeError,
     "state_dict['in_proj_weight'] has dtype int32; expected a floating dtype"),
]


@pytest.mark.parametrize("change,exc,msg", BAD_STATE, ids=[c[2][:30] for c in BAD_STATE])
def test_load_state_dict_errors(rng, change, exc, msg):
    m = fastattn.MultiHeadAttention(E, H, rng=rng)
    good = {k: rng.standard_normal(v.shape) for k, v in m.state_dict().items()}
    before = {k: v.copy() for k, v in m.state_dict().items()}
    sd = dict(good)
    for key, val in change.items():
        if val is None:
            sd = {key: good[key]}
        else:
            sd[key] = val
    with pytest.raises(exc) as info:
        m.load_state_dict(sd)
    assert msg in str(info.value)
    for k, v in m.state_dict().items():  # nothing loaded
        np.testing.assert_array_equal(v, before[k])


def test_load_state_dict_not_a_mapping(rng):
    with pytest.raises(TypeError, match="state_dict must be a mapping of names to arrays, "
                                        "got list"):
        fastattn.MultiHeadAttention(E, H, rng=rng).load_state_dict([1, 2])


# ---- errors ------------------------------------------------------------------

x32 = np.zeros((2, 5, E), np.float32)

BAD_CTOR = [
    ((E, 5), {}, ValueError, f"embed_dim ({E}) must be a multiple of num_heads (5)"),
    ((E, 4), {"num_kv_heads": 3}, ValueError,
     "num_heads (4) must be a multiple of num_kv_heads (3)"),
    ((E, 0), {}, ValueError, "num_heads must be >= 1, got 0"),
    ((E, 4.0), {}, TypeError, "num_heads must be an int, got float"),
    ((E, 4), {"dtype": np.int8}, TypeError, "dtype must be float32, float64, float16 or bfloat16"),
    ((E, 4), {"dtype": "nonsense"}, TypeError, "dtype must be float32, float64, float16 or bfloat16, got 'nonsense'"),
    ((E, 4), {"bias": 1}, TypeError, "bias must be a bool, got int"),
    ((E, 4), {"kdim": 0}, ValueError, "kdim must be >= 1, got 0"),
]


@pytest.mark.parametrize("args,kwargs,exc,msg", BAD_CTOR, ids=[c[3][:40] for c in BAD_CTOR])
def test_constructor_errors(args, kwargs, exc, msg):
    with pytest.raises(exc) as info:
        fastattn.MultiHeadAttention(*args, **kwargs)
    assert msg in str(info.value)


BAD_FORWARD = [
    ((x32.tolist(),), {}, TypeError, "query must be a numpy.ndarray, got list"),
    ((x32, x32), {}, ValueError, "pass both key and value (cross-attention) or neither"),
    ((x32[..., :-1],), {}, ValueError,
     f"query has {E - 1} features (last axis of (2, 5, {E - 1})); expected embed_dim = {E}"),
    ((x32[0, 0],), {}, ValueError, f"query must be (N, L, E) or unbatched (L, E), got shape ({E},)"),
    ((x32, x32[0], x32[0]), {}, ValueError, "they must have as many dimensions"),
    ((x32, x32[:1], x32[:1]), {}, ValueError, "query, key and value must have one batch size N"),
    ((x32, x32, x32[:, :3]), {}, ValueError, "key and value one length S"),
    ((x32,), {"key_padding_mask": np.zeros((2, 4), bool)}, ValueError,
     "key_padding_mask has shape (2, 4); expected (N, S) = (2, 5) (True = ignore the key)"),
    ((x32,), {"key_padding_mask": np.zeros((2, 5), np.int8)}, TypeError,
     "key_padding_mask has dtype int8; expected bool (True = ignore"),
    ((x32,), {"attn_mask": np.zeros((5, 4), bool)}, ValueError,
     "attn_mask has shape (5, 4); expected (L, S) = (5, 5) or (N * num_heads, L, S) = (8, 5, 5)"),
    ((x32,), {"attn_mask": np.zeros((5, 5), np.int64)}, TypeError, "attn_mask has dtype int64"),
    ((x32,), {"attn_mask": [[True]]}, TypeError, "attn_mask must be a numpy.ndarray, got list"),
    ((x32,), {"is_causal": 1}, TypeError, "is_causal must be a bool, got int"),
    ((x32,), {"need_weights": "yes"}, TypeError, "need_weights must be a bool, got str"),
    ((x32,), {"num_threads": 0}, ValueError, "num_threads must be >= 1, got 0"),
    ((x32,), {"cache": object()}, TypeError, "cache must be a fastattn.KVCache, got object"),
]


@pytest.mark.parametrize("args,kwargs,exc,msg", BAD_FORWARD, ids=[c[3][:40] for c in BAD_FORWARD])
def test_forward_errors(rng, args, kwargs, exc, msg):
    m = fastattn.MultiHeadAttention(E, 4, rng=rng)
    with pytest.raises(exc) as info:
        m(*args, **kwargs)
    assert msg in str(info.value)


def test_self_attention_with_other_kdim_is_an_error(rng):
    m = fastattn.MultiHeadAttention(E, 4, kdim=8, rng=rng)
    with pytest.raises(ValueError, match="self-attention needs kdim == vdim == embed_dim"):
        m(x32)


def test_from_torch_rejects_other_objects():
    with pytest.raises(TypeError, match="module must be a torch.nn.MultiheadAttention, got dict"):
        fastattn.MultiHeadAttention.from_torch({})


def test_loading_needs_no_torch():
    """load_state_dict and forward with torch made unimportable."""
    import subprocess
    import sys
    import tempfile
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, fastattn\n"
        "m = fastattn.MultiHeadAttention(8, 2, bias=False)\n"
        "sd = {'in_proj_weight': np.tile(np.eye(8), (3, 1)), 'out_proj.weight': np.eye(8)}\n"
        "m.load_state_dict(sd)\n"
        "x = np.ones((1, 3, 8), np.float32)\n"
        "assert np.allclose(m(x)[0], 1)  # identity projections, equal values\n"
        "print('ok')\n")
    with tempfile.TemporaryDirectory() as cwd:  # outside the source tree: the installed package
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120, cwd=cwd)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_cache_step_is_causal_by_default(rng):
    """With a cache, forward defaults to causal (a decoder's step); without
    one it does not, as in PyTorch."""
    m = fastattn.MultiHeadAttention(16, 2, rng=0)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    stepped, _ = m(x, cache=m.new_cache(2, 8))
    np.testing.assert_allclose(stepped, m(x, is_causal=True)[0], rtol=1e-6, atol=1e-6)
    assert not np.allclose(m(x)[0], m(x, is_causal=True)[0])


def test_pytorch_argument_order(rng):
    """query, key, value, key_padding_mask, need_weights, attn_mask,
    average_attn_weights, is_causal may be passed positionally, as in PyTorch."""
    m = fastattn.MultiHeadAttention(16, 2, rng=0)
    x = rng.standard_normal((2, 5, 16)).astype(np.float32)
    pad = np.zeros((2, 5), bool)
    pad[1, 3:] = True
    out, w = m(x, x, x, pad, True, None, False)
    ref_out, ref_w = m(x, key_padding_mask=pad, need_weights=True, average_attn_weights=False)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(w, ref_w)
    assert w.shape == (2, 2, 5, 5)


@pytest.mark.parametrize("shape", [(2, 5, 16), (5, 16)], ids=["batch-of-2", "unbatched"])
def test_returns_a_pair_as_pytorch_does(rng, shape):
    """(output, None) without need_weights, as torch.nn.MultiheadAttention
    returns it: ``y, _ = mha(x)`` must not unpack a batch of 2 (the output
    alone used to be returned, and its two batch rows unpacked silently)."""
    m = fastattn.MultiHeadAttention(16, 2, rng=0)
    x = rng.standard_normal(shape).astype(np.float32)
    result = m(x)
    assert isinstance(result, tuple) and len(result) == 2
    y, w = result
    assert y.shape == shape and w is None
    y2, w2 = m(x, x, x, None, True)  # positional need_weights, PyTorch's order
    np.testing.assert_array_equal(y, y2)
    assert w2.shape == shape[:-2] + (5, 5)


def test_unbatched_key_padding_mask_error_names_its_shape(rng):
    m = fastattn.MultiHeadAttention(16, 2, rng=0)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    with pytest.raises(ValueError, match=r"key_padding_mask has shape \(1, 5\); unbatched inputs "
                                         r"take \(S,\) = \(5,\)"):
        m(x, key_padding_mask=np.zeros((1, 5), bool))


def test_finfo_min_masks_sum_without_a_warning(dtype, rng):
    """Float key_padding_mask and attn_mask holding finfo.min (the "large
    negative" some models pad with): no RuntimeWarning escapes from their
    sum (an error under -W error); a key where both are finfo.min overflows
    to -inf and is hidden, as in PyTorch, while finfo.min alone stays a
    large negative score."""
    import warnings

    lo = np.finfo(dtype).min
    kpm = np.array([[lo, lo, 0.0], [lo, lo, lo]], dtype)                   # (N, S)
    am = np.array([[lo, lo, lo], [0.0, lo, 0.0], [0.0, 0.0, 0.0]], dtype)  # (L, S)
    m = fastattn.MultiHeadAttention(8, 1, dtype=dtype, rng=0)
    x = rng.standard_normal((2, 3, 8)).astype(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = m(x, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    np.testing.assert_array_equal(w[0, 0], [0, 0, 1])  # keys 0, 1: finfo.min twice, -inf
    np.testing.assert_array_equal(w[1, 0], [0, 0, 0])  # every key -inf: a hidden row
    np.testing.assert_allclose(w[1, 1], [0.5, 0, 0.5])  # finfo.min once: equal scores
    np.testing.assert_allclose(w[1, 2], [1 / 3] * 3)
    assert np.all(np.isfinite(out))


def test_minus_inf_hides_against_plus_inf_in_the_other_mask(rng):
    """-inf in one mask hides the key whatever the other adds: +inf + -inf
    is NaN in IEEE arithmetic, which would make the row NaN."""
    import warnings

    m = fastattn.MultiHeadAttention(8, 1, rng=0)
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    kpm = np.array([[0.0, -np.inf, 0.0]], np.float32)
    am = np.array([[0.0, np.inf, 0.0]] * 3, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = m(x, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    ref_out, ref_w = m(x, key_padding_mask=np.array([[False, True, False]]), need_weights=True)
    np.testing.assert_array_equal(w, ref_w)
    np.testing.assert_array_equal(out, ref_out)
