"""Latent caches (Multi-head Latent Attention, DeepSeek-V2): KVCache and
PagedKVCache with latent=True hold one row per position whose first
value_dim features are its value, stored once.  Checked: every storage
gives the bits of the same call over the rows as stored, read as float32
keys and values; rotary turns the features after value_dim; forks, copies
and accept_draft keep keys and values one; the memory is the keys'."""
import numpy as np
import pytest
from conftest import assert_close, f64

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
STORAGES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"]
E, EV = 96, 64  # a latent of 64 and a rotary part of 32 (DeepSeek's 512 + 64, smaller)


def rope(n, dim):
    angles = np.arange(n)[:, None] * 10000.0 ** (-np.arange(dim // 2) / (dim // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@pytest.mark.parametrize("storage", STORAGES)
def test_kvcache_reads_its_rows_once_for_both(storage):
    """128 query heads over one latent head (the absorbed form): the bits of
    scaled_dot_product_attention over the stored rows as float32 keys, and
    their first value_dim features as values."""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    cache = fastattn.KVCache(2, 1, 80, E, value_dim=EV, storage=storage, latent=True)
    latent = rng.standard_normal((2, 1, 70, E)).astype(np.float32)
    cache.append(latent[:, :, :60], None)
    cache.append(latent[:, :, 60:], None)
    q = rng.standard_normal((2, 128, 1, E)).astype(np.float32)
    out = cache.attend(q, scale=0.1)
    rows = cache.key  # the rows as stored, read back as float32
    np.testing.assert_array_equal(out, sdpa(q, rows, rows[..., :EV], enable_gqa=True,
                                            scale=0.1))
    np.testing.assert_array_equal(cache.value, rows[..., :EV])
    want, _ = ref.scaled_dot_product_attention(*f64(q, np.repeat(rows, 128, 1),
                                                    np.repeat(rows[..., :EV], 128, 1)),
                                               scale=0.1, return_lse=True)
    assert_close(out, want, np.float32, E + 70)


def test_memory_is_the_keys_alone():
    plain = fastattn.KVCache(1, 1, 100, E, value_dim=EV, storage="int8")
    latent = fastattn.KVCache(1, 1, 100, E, value_dim=EV, storage="int8", latent=True)
    assert latent.nbytes == plain.nbytes - 100 * (EV + 4)
    paged = fastattn.PagedKVCache(10, 16, 1, E, value_dim=EV, latent=True)
    assert paged.nbytes == 10 * 16 * E * 4
    assert paged.latent and "latent=True" in repr(paged) and "latent=True" in repr(latent)


@pytest.mark.parametrize("storage", ["float32", "int8", "int4"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_latent_pool_with_rotary_on_its_tail(storage, block_size):
    """A paged latent pool rotates the features after value_dim (the
    decoupled RoPE part) of keys and queries: the bits of a pool given those
    rows rotated by the caller, and paged_attention over its own pool (the
    values a view of the keys) reads the same."""
    rng = np.random.default_rng(block_size)
    cos, sin = rope(64, E - EV)
    lat = rng.standard_normal((40, 1, E)).astype(np.float32)
    q = rng.standard_normal((2, 16, E)).astype(np.float32)
    pools = [fastattn.PagedKVCache(48, block_size, 1, E, value_dim=EV, storage=storage,
                                   latent=True) for _ in range(2)]
    a, b = (p.add_sequence() for p in pools)
    pools[0].append([a], lat, None, np.array([0, 40]), rotary=(cos, sin))
    turned = lat.copy()
    turned[..., EV:] = fastattn.rotary(lat[..., EV:], np.arange(40), cos, sin)
    pools[1].append([b], turned, None, np.array([0, 40]))
    got = pools[0].attend([a], q, np.array([0, 2]), rotary=(cos, sin))
    qt = q.copy()
    qt[..., EV:] = fastattn.rotary(q[..., EV:], np.array([38, 39]), cos, sin)
    np.testing.assert_array_equal(got, pools[1].attend([b], qt, np.array([0, 2])))
    p = pools[1]
    kw = {} if storage == "float32" else {"kv_cache_dtype": "int4", "value_dim": EV} \
        if storage == "int4" else {"k_scale": p.k_scale, "v_scale": p.v_scale}
    direct = fastattn.paged_attention(qt, p.key_cache, p.value_cache, p.block_table([b]),
                                      p.seq_lens_of([b]), np.array([0, 2]), **kw)
    np.testing.assert_array_equal(direct, got)


def test_forks_copies_and_accepted_paths_keep_keys_and_values_one():
    """Copy-on-write and accept_draft's moves write a latent pool's rows
    once: the values stay the keys' first features (written twice, the
    second gather would read rows the first had moved)."""
    rng = np.random.default_rng(0)
    pool = fastattn.PagedKVCache(12, 4, 1, E, value_dim=EV, latent=True)
    s = pool.add_sequence()
    lat = rng.standard_normal((11, 1, E)).astype(np.float32)
    pool.append([s], lat[:6], None, np.array([0, 6]))
    child = pool.fork(s)
    pool.append([s], lat[6:], None, np.array([0, 5]))
    pool.accept_draft([s], [5], [[1, 2, 4]])
    j = np.arange(9)
    rows = pool.key_cache[pool.block_table([s])[0][j // 4], :, j % 4]
    np.testing.assert_array_equal(rows[:, 0], lat[[0, 1, 2, 3, 4, 5, 7, 8, 10], 0])
    vals = pool.value_cache[pool.block_table([s])[0][j // 4], :, j % 4]
    np.testing.assert_array_equal(vals, rows[..., :EV])
    k = np.arange(6)
    kept = pool.key_cache[pool.block_table([child])[0][k // 4], :, k % 4]
    np.testing.assert_array_equal(kept[:, 0], lat[:6, 0])


@pytest.mark.parametrize("kwargs, error, words", [
    ({"value_dim": E + 1}, ValueError, "must not exceed head_dim"),
    ({"storage": "int4", "value_dim": 48}, ValueError, "multiple of 32"),
    ({"smooth_k": True}, ValueError, "latent cannot go with smooth_k or rotate_k"),
    ({"rotate_k": True}, ValueError, "latent cannot go with smooth_k or rotate_k"),
    ({"latent": 1}, TypeError, "latent"),
])
def test_bad_latent_caches(kwargs, error, words):
    args = {"value_dim": EV, "latent": True, **kwargs}
    for make in (lambda: fastattn.KVCache(1, 1, 8, E, **args),
                 lambda: fastattn.PagedKVCache(4, 4, 1, E, **args)):
        with pytest.raises(error) as info:
            make()
        assert words in str(info.value)


def test_values_go_with_latent_alone():
    latent = fastattn.KVCache(1, 1, 8, E, value_dim=EV, latent=True)
    plain = fastattn.KVCache(1, 1, 8, E, value_dim=EV)
    k = np.zeros((1, 1, 2, E), np.float32)
    with pytest.raises(ValueError, match="pass value=None"):
        latent.append(k, k[..., :EV])
    with pytest.raises(ValueError, match="is not latent"):
        plain.append(k, None)
    assert latent.length == plain.length == 0
