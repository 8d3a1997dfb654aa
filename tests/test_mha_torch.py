"""MultiHeadAttention against torch.nn.MultiheadAttention with the same weights,
when torch is installed: float32 within 1e-5, float64 within 1e-12 (absolute,
on inputs and weights of magnitude ~1), except on rows where every key is
masked (PyTorch gives NaN there, fastattn the output bias)."""
import numpy as np
import pytest

import fastattn

torch = pytest.importorskip("torch")

N, L, S, E, H = 3, 11, 19, 48, 6
ATOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}
TORCH_DTYPE = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}

CASES = {
    "self": {},
    "padding": {"kpm": True},
    "causal": {"causal": True},  # PyTorch needs the mask with is_causal: give both
    "padding+causal": {"kpm": True, "causal": True},
    "mask-float": {"am": "float"},
    "mask-per-head": {"am": "bool3", "kpm": True},
    "cross": {"cross": True, "kdim": 20, "vdim": 36, "kpm": True},
    "cross-packed": {"cross": True},
    "no-bias": {"bias": False, "am": "bool2"},
    "seq-first": {"batch_first": False, "kpm": True},
    "seq-first-cross": {"batch_first": False, "cross": True, "kdim": 12, "vdim": 12},
}


def torch_module(spec, dtype, seed):
    torch.manual_seed(seed)
    t = torch.nn.MultiheadAttention(E, H, bias=spec.get("bias", True), kdim=spec.get("kdim"),
                                    vdim=spec.get("vdim"),
                                    batch_first=spec.get("batch_first", True),
                                    dtype=TORCH_DTYPE[dtype]).eval()
    with torch.no_grad():  # PyTorch starts biases at zero: give them values
        for name, p in t.named_parameters():
            if "bias" in name:
                p.normal_()
    return t


def inputs(spec, dtype, rng):
    q = rng.standard_normal((N, L, E)).astype(dtype)
    Sx = S if spec.get("cross") else L
    if spec.get("cross"):
        k = rng.standard_normal((N, Sx, spec.get("kdim") or E)).astype(dtype)
        v = rng.standard_normal((N, Sx, spec.get("vdim") or E)).astype(dtype)
    else:
        k = v = q
    kw = {}
    if spec.get("kpm"):
        kw["key_padding_mask"] = np.arange(Sx)[None, :] >= np.array([Sx, 4, 0])[:, None]
    if spec.get("causal"):
        kw["attn_mask"] = np.triu(np.ones((L, Sx), bool), 1)
        kw["is_causal"] = True
    am = spec.get("am")
    if am == "float":
        kw["attn_mask"] = rng.standard_normal((L, Sx)).astype(dtype)
    elif am == "bool2":
        kw["attn_mask"] = rng.random((L, Sx)) < 0.3
    elif am == "bool3":
        kw["attn_mask"] = rng.random((N * H, L, Sx)) < 0.3
    if not spec.get("batch_first", True):
        q, k, v = (a.swapaxes(0, 1) for a in (q, k, v))
    return q, k, v, kw


def theirs(t, q, k, v, kw, average):
    tt = {key: torch.from_numpy(np.ascontiguousarray(val)) for key, val in kw.items()
          if isinstance(val, np.ndarray)}
    with torch.no_grad():
        out, w = t(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)),
                   need_weights=True, average_attn_weights=average,
                   is_causal=kw.get("is_causal", False), **tt)
    return out.numpy(), w.numpy()


def row_masks(kw, n_keys, batch_first):
    """Rows (N, L), or (L, N) when not batch_first: with a visible key in
    every head; with none in any head."""
    hidden = np.zeros((N, 1, L, n_keys), bool)
    if "key_padding_mask" in kw:
        hidden = hidden | kw["key_padding_mask"][:, None, None, :]
    if "attn_mask" in kw and kw["attn_mask"].dtype == np.bool_:
        am = kw["attn_mask"]
        hidden = hidden | (am.reshape(N, H, L, -1) if am.ndim == 3 else am)
    empty = hidden.all(axis=-1)
    rows, dead = ~empty.any(axis=1), empty.all(axis=1)
    return (rows, dead) if batch_first else (rows.T, dead.T)


@pytest.mark.parametrize("case", CASES)
def test_matches_torch(dtype, rng, case):
    spec = CASES[case]
    t = torch_module(spec, dtype, seed=len(case))
    m = fastattn.MultiHeadAttention.from_torch(t)
    assert m.dtype == dtype and m.batch_first == spec.get("batch_first", True)
    q, k, v, kw = inputs(spec, dtype, rng)
    cross = spec.get("cross")
    args = (q, k, v) if cross else (q,)
    rows, dead = row_masks(kw, S if cross else L, m.batch_first)
    for average in (True, False):
        out, w = m(*args, need_weights=True, average_attn_weights=average, **kw)
        t_out, t_w = theirs(t, q, k, v, kw, average)
        np.testing.assert_allclose(out[rows], t_out[rows], rtol=0, atol=ATOL[dtype])
        w_rows = rows if m.batch_first else rows.T
        sel = w[w_rows] if average else w.transpose(0, 2, 1, 3)[w_rows]
        t_sel = t_w[w_rows] if average else t_w.transpose(0, 2, 1, 3)[w_rows]
        np.testing.assert_allclose(sel, t_sel, rtol=0, atol=ATOL[dtype])
    if dead.any():  # PyTorch: NaN; fastattn: the output bias
        assert np.isnan(t_out[dead]).all()
        bias = 0 if m.out_proj_bias is None else m.out_proj_bias
        np.testing.assert_array_equal(out[dead], np.broadcast_to(bias, out[dead].shape))


def test_gqa_equals_torch_with_repeated_heads(dtype, rng):
    """Grouped-query attention equals PyTorch's multi-head attention whose
    key/value projections repeat each key/value head for its query group."""
    Hkv, D = 2, E // H
    m = fastattn.MultiHeadAttention(E, H, num_kv_heads=Hkv, dtype=dtype, rng=rng)
    m.in_proj_bias[...] = rng.standard_normal(m.in_proj_bias.shape)
    m.out_proj_bias[...] = rng.standard_normal(E)
    wq, wk, wv = np.split(m.in_proj_weight, [E, E + Hkv * D])
    bq, bk, bv = np.split(m.in_proj_bias, [E, E + Hkv * D])
    rep = (lambda a: np.repeat(a.reshape(Hkv, D, *a.shape[1:]), H // Hkv, axis=0)
           .reshape(E, *a.shape[1:]))
    t = torch.nn.MultiheadAttention(E, H, batch_first=True, dtype=TORCH_DTYPE[dtype]).eval()
    t.load_state_dict({"in_proj_weight": torch.from_numpy(np.concatenate([wq, rep(wk), rep(wv)])),
                       "in_proj_bias": torch.from_numpy(np.concatenate([bq, rep(bk), rep(bv)])),
                       "out_proj.weight": torch.from_numpy(m.out_proj_weight),
                       "out_proj.bias": torch.from_numpy(m.out_proj_bias)})
    x = rng.standard_normal((N, L, E)).astype(dtype)
    causal = np.triu(np.ones((L, L), bool), 1)
    pad = np.arange(L)[None, :] >= np.array([L, 6, 1])[:, None]
    out, _ = m(x, key_padding_mask=pad, attn_mask=causal)
    t_out, _ = theirs(t, x, x, x, {"key_padding_mask": pad, "attn_mask": causal}, True)
    np.testing.assert_allclose(out, t_out, rtol=0, atol=ATOL[dtype])


def test_state_dict_loads_into_torch(rng):
    m = fastattn.MultiHeadAttention(E, H, kdim=10, vdim=14, rng=rng)
    t = torch.nn.MultiheadAttention(E, H, kdim=10, vdim=14, batch_first=True).eval()
    t.load_state_dict({k: torch.from_numpy(v) for k, v in m.state_dict().items()})
    q = rng.standard_normal((N, L, E)).astype(np.float32)
    k = rng.standard_normal((N, S, 10)).astype(np.float32)
    v = rng.standard_normal((N, S, 14)).astype(np.float32)
    t_out, _ = theirs(t, q, k, v, {}, True)
    np.testing.assert_allclose(m(q, k, v)[0], t_out, rtol=0, atol=1e-5)


def test_from_torch_rejects_bias_kv():
    t = torch.nn.MultiheadAttention(E, H, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn are not supported"):
        fastattn.MultiHeadAttention.from_torch(t)


def test_unbatched_matches_torch(dtype, rng):
    t = torch_module({"kdim": 10, "vdim": 14}, dtype, seed=3)
    m = fastattn.MultiHeadAttention.from_torch(t)
    q = rng.standard_normal((L, E)).astype(dtype)
    k = rng.standard_normal((S, 10)).astype(dtype)
    v = rng.standard_normal((S, 14)).astype(dtype)
    kw = {"key_padding_mask": np.arange(S) >= 15, "attn_mask": rng.random((H, L, S)) < 0.2}
    out, w = m(q, k, v, need_weights=True, average_attn_weights=False, **kw)
    t_out, t_w = theirs(t, q, k, v, kw, False)
    assert out.shape == (L, E) and w.shape == (H, L, S)
    np.testing.assert_allclose(out, t_out, rtol=0, atol=ATOL[dtype])
    np.testing.assert_allclose(w, t_w, rtol=0, atol=ATOL[dtype])


def test_finfo_min_masks_match_torch(dtype, rng):
    """Float masks of finfo.min in both key_padding_mask and attn_mask: the
    sum overflows to -inf in PyTorch too, so such keys are hidden there as
    here (rows with every key hidden: NaN there, the output bias here)."""
    import warnings

    lo = np.finfo(dtype).min
    t = torch_module({}, dtype, seed=5)
    m = fastattn.MultiHeadAttention.from_torch(t)
    x = rng.standard_normal((N, L, E)).astype(dtype)
    kpm = np.where(rng.random((N, L)) < 0.4, lo, 0).astype(dtype)
    kpm[0] = lo  # sequence 0: query 0 sees only -inf (a dead row); others -inf or finfo.min
    am = np.where(rng.random((L, L)) < 0.4, lo, 0).astype(dtype)
    am[0] = lo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, w = m(x, key_padding_mask=kpm, attn_mask=am, need_weights=True)
    t_out, t_w = theirs(t, x, x, x, {"key_padding_mask": kpm, "attn_mask": am}, True)
    dead = np.isnan(t_out).any(axis=-1)
    assert dead[0, 0] and not dead.all()  # both kinds of rows are seen
    np.testing.assert_allclose(out[~dead], t_out[~dead], rtol=0, atol=ATOL[dtype])
    np.testing.assert_allclose(w[~dead], t_w[~dead], rtol=0, atol=ATOL[dtype])
    np.testing.assert_array_equal(out[dead], np.broadcast_to(m.out_proj_bias, out[dead].shape))
