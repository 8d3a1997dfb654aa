"""Agreement with PyTorch's scaled_dot_product_attention, when torch is installed."""
import numpy as np
import pytest
from conftest import assert_close

import fastattn

torch = pytest.importorskip("torch")
F = torch.nn.functional


def both(q, k, v, torch_kwargs=None, **kwargs):
    ours = fastattn.scaled_dot_product_attention(q, k, v, **kwargs)
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)]
    tk = dict(kwargs, **(torch_kwargs or {}))
    if isinstance(tk.get("attn_mask"), np.ndarray):
        tk["attn_mask"] = torch.from_numpy(tk["attn_mask"])
    theirs = F.scaled_dot_product_attention(*t, **tk).numpy()
    return ours, theirs


@pytest.mark.parametrize("kwargs", [
    {}, {"is_causal": True}, {"scale": 0.3},
    {"attn_mask": "bool"}, {"attn_mask": "float"}, {"enable_gqa": True},
], ids=["plain", "causal", "scale", "bool-mask", "float-mask", "gqa"])
def test_matches_torch(simd, dtype, rng, kwargs):
    B, Hq, L, S, E = 2, 4, 70, 90, 32
    Hkv = 2 if kwargs.get("enable_gqa") else Hq
    q = rng.standard_normal((B, Hq, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    kwargs = dict(kwargs)
    if kwargs.get("attn_mask") == "bool":
        kwargs["attn_mask"] = rng.random((L, S)) > 0.3
    elif kwargs.get("attn_mask") == "float":
        kwargs["attn_mask"] = rng.standard_normal((B, 1, L, S)).astype(dtype)
    ours, theirs = both(q, k, v, **kwargs)
    assert_close(ours, theirs.astype(np.float64), dtype, E + S, magnitude=4)


def test_lower_right_matches_torch_bias(rng):
    from torch.nn.attention.bias import causal_lower_right
    L, S, E = 5, 12, 8
    q = rng.standard_normal((1, 2, L, E)).astype(np.float32)
    k = rng.standard_normal((1, 2, S, E)).astype(np.float32)
    v = rng.standard_normal((1, 2, S, E)).astype(np.float32)
    ours = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 causal_alignment="lower_right")
    t = [torch.from_numpy(a) for a in (q, k, v)]
    theirs = F.scaled_dot_product_attention(*t, attn_mask=causal_lower_right(L, S)).numpy()
    assert_close(ours, theirs.astype(np.float64), np.float32, E + S, magnitude=4)
