"""Query heads folded into the block kernel's columns: when at least 8 rows
of the query heads of one key/value head fit a query block (decoding with
8 or more heads per key/value head, a few speculative tokens of 4, MLA's
128 heads over one latent head; on the portable path only rows of more
than 4 queries), the keys and values are read once for
all of them as one matrix product per key block.  Checked against the
float64 reference with every variant, and bitwise: the same for any thread
count, batch composition, layout and placement, and equal to the heads
folded into query rows by the caller (MLA's absorbed form)."""
import numpy as np
import pytest
from conftest import assert_close, f64
from test_paged import Pool, packed, per_sequence

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention


def gqa(rng, B, Hkv, G, L, S, E, Ev, dtype=np.float32):
    q = rng.standard_normal((B, Hkv * G, L, E)).astype(dtype)
    k = rng.standard_normal((B, Hkv, S, E)).astype(dtype)
    v = rng.standard_normal((B, Hkv, S, Ev)).astype(dtype)
    return q, k, v


def reference(q, k, v, **options):
    G = q.shape[1] // k.shape[1]
    options = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
               for n, x in options.items()}
    rq, rk, rv = f64(q, np.repeat(k, G, axis=1), np.repeat(v, G, axis=1))
    return ref.scaled_dot_product_attention(rq, rk, rv, return_lse=True, **options)


@pytest.mark.parametrize("G,L", [(8, 1), (16, 1), (4, 2), (4, 8), (128, 1), (3, 5)])
@pytest.mark.parametrize("options", [
    {}, {"softcap": 4.0}, {"window_size": (9, 0)}, {"alibi_slopes": "per head"},
    {"sinks": "per head"}], ids=["plain", "softcap", "window", "alibi", "sinks"])
def test_folded_heads_against_the_reference(simd, dtype, G, L, options):
    rng = np.random.default_rng(G * 10 + L)
    q, k, v = gqa(rng, 2, 2 if G < 128 else 1, G, L, 300, 24, 20, dtype)
    Hq = q.shape[1]
    options = {n: (rng.uniform(0.05, 0.5, Hq) if x == "per head" else x)
               for n, x in options.items()}
    options.update(is_causal=True, causal_alignment="lower_right")
    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, **options)
    want, want_lse = reference(q, k, v, **options)
    assert_close(out, want, dtype, 24 + 300)
    assert_close(lse, want_lse, dtype, 24 + 300, magnitude=float(np.abs(want_lse).max()))


@pytest.mark.parametrize("G,L,S", [(8, 1, 300), (16, 1, 3000), (128, 1, 200), (4, 8, 500)])
def test_threads_batch_and_layout_change_no_bit(G, L, S):
    rng = np.random.default_rng(G + L)
    q, k, v = gqa(rng, 3, 2, G, L, S, 32, 32)
    options = dict(enable_gqa=True, is_causal=True, causal_alignment="lower_right")
    base = sdpa(q, k, v, num_threads=1, **options)
    for threads in (2, 3):
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=threads, **options), base)
    np.testing.assert_array_equal(sdpa(q[1:2], k[1:2], v[1:2], **options), base[1:2])
    # other strides: heads and rows swapped in memory
    qs = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    ks = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    vs = np.asfortranarray(v)
    np.testing.assert_array_equal(sdpa(qs, ks, vs, **options), base)


@pytest.mark.parametrize("G", [8, 16, 128])
def test_folded_heads_are_the_heads_as_query_rows(simd, G):
    """One decoding token of G heads over a key/value head gives the bits of
    those heads passed as G query rows of one head (no causal bound: every
    row sees every key), the absorbed form's usual trick.  (The portable
    path folds no decoding rows: its row kernel computes them faster.)"""
    if simd == "portable":
        pytest.skip("the portable path keeps decoding rows in the row kernel")
    rng = np.random.default_rng(G)
    q, k, v = gqa(rng, 2, 1, G, 1, 700, 72, 64)
    out = sdpa(q, k, v, enable_gqa=True)
    rows = sdpa(q.reshape(2, 1, G, 72), k, v)
    np.testing.assert_array_equal(out.reshape(2, 1, G, 64), rows)


def test_a_latent_cache_read_as_keys_and_values():
    """MLA's absorbed decoding: 128 query heads over one latent row of 576
    whose first 512 features are the values (a view of the same rows)."""
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((1, 1, 900, 576)).astype(np.float32)
    q = rng.standard_normal((1, 128, 1, 576)).astype(np.float32)
    out = sdpa(q, latent, latent[..., :512], enable_gqa=True, scale=0.05)
    want, _ = reference(q, latent, latent[..., :512], scale=0.05)
    assert_close(out, want, np.float32, 576 + 900)


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_paged_sequences_fold_as_alone(simd, block_size):
    """paged_attention folds each sequence's heads by its own shape: every
    sequence the bits of scaled_dot_product_attention on it alone, beside
    sequences of other lengths, split or not."""
    rng = np.random.default_rng(block_size)
    Hq, Hkv, E = 16, 2, 32
    q_lens, k_lens = [1, 8, 2, 1, 70], [2100, 40, 300, 5, 90]
    queries = [rng.standard_normal((Hq, L, E)).astype(np.float32) for L in q_lens]
    keys = [rng.standard_normal((Hkv, S, E)).astype(np.float32) for S in k_lens]
    values = [rng.standard_normal((Hkv, S, E)).astype(np.float32) for S in k_lens]
    pool = Pool(rng, keys, values, block_size)
    query, cu = packed(queries)
    out = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                   pool.seq_lens, cu)
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        want = sdpa(q, k, v, is_causal=True, causal_alignment="lower_right", enable_gqa=True)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)


def test_the_int8_mode_keeps_the_row_kernel():
    """precision="int8" reads int8 caches with integer dot products in the
    row kernel: 8 heads of a token are not folded there (their results are
    those of the mode, not the exact ones)."""
    rng = np.random.default_rng(1)
    cache = fastattn.KVCache(1, 1, 64, 32, storage="int8")
    k = rng.standard_normal((1, 1, 64, 32)).astype(np.float32)
    cache.append(k, k)
    q = rng.standard_normal((1, 8, 1, 32)).astype(np.float32)
    mode = cache.attend(q, precision="int8")
    alone = [cache.attend(q[:, h:h + 1], precision="int8") for h in range(8)]
    np.testing.assert_array_equal(mode, np.concatenate(alone, axis=1))
    assert not np.array_equal(mode, cache.attend(q))


@pytest.mark.parametrize("layout", ["fortran", "broadcast", "transposed"])
def test_slopes_and_sinks_layout_changes_no_bit(layout):
    """Per-head slopes and sinks of any memory layout fold as C-contiguous
    ones do (a fresh tester's finding: another layout kept the heads apart,
    with other bits)."""
    rng = np.random.default_rng(0)
    q, k, v = gqa(rng, 2, 1, 16, 1, 200, 32, 32)
    s = rng.uniform(0.01, 0.2, (2, 16))
    x = {"fortran": np.asfortranarray(s), "broadcast": np.broadcast_to(s[:1], (2, 16)),
         "transposed": np.ascontiguousarray(s.T).T}[layout]
    for name in ("alibi_slopes", "sinks"):
        got = sdpa(q, k, v, enable_gqa=True, **{name: x})
        np.testing.assert_array_equal(got, sdpa(q, k, v, enable_gqa=True,
                                                **{name: np.ascontiguousarray(x)}))


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("per_head", [False, True])
def test_masks_fold_when_every_head_shares_them(simd, kind, per_head):
    """A mask broadcast over the heads (a padding or tree mask) is every
    head's, so the heads fold with it; a mask per head keeps them apart.
    Both give the reference's values, and a NaN value behind the mask
    stays hidden."""
    rng = np.random.default_rng(7)
    q, k, v = gqa(rng, 2, 2, 8, 6, 90, 16, 12)
    v[:, :, 5] = np.nan
    shape = (2, 16 if per_head else 1, 6, 90)
    visible = rng.random(shape) > 0.3
    visible[..., 5] = False
    mask = visible if kind == "bool" else np.where(visible, rng.standard_normal(shape),
                                                   -np.inf).astype(np.float32)
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    rm = mask if kind == "bool" else mask.astype(np.float64)
    G = 8
    want, _ = ref.scaled_dot_product_attention(*f64(q, np.repeat(k, G, 1),
                                                    np.repeat(v, G, 1)),
                                               attn_mask=rm, return_lse=True)
    assert_close(out, want, np.float32, 16 + 90, magnitude=4)
