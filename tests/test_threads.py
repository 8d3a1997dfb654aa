"""Results are bitwise identical whatever the thread count."""
import concurrent.futures

import numpy as np
import pytest

import fastattn


@pytest.fixture
def big(rng, dtype):
    B, H, L, S, E = 2, 3, 150, 260, 32
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, H, S, E)).astype(dtype)
    v = rng.standard_normal((B, H, S, E)).astype(dtype)
    mask = rng.random((B, 1, L, S)) > 0.2
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True])
def test_attention_thread_counts(simd, big, causal):
    q, k, v, mask = big
    results = [fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                     need_weights=True, num_threads=n)
               for n in (1, 2, 4)]
    for out, w in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(w, results[0][1])


def test_ops_thread_counts(simd, rng, dtype):
    a = rng.standard_normal((3, 200, 300)).astype(dtype)
    b = rng.standard_normal((300, 270)).astype(dtype)
    mm = [fastattn.matmul(a, b, num_threads=n) for n in (1, 2, 4)]
    sm = [fastattn.softmax(a, axis=1, num_threads=n) for n in (1, 2, 4)]
    mh = [fastattn.merge_heads(a.reshape(3, 4, 50, 300), num_threads=n) for n in (1, 2, 4)]
    for results in (mm, sm, mh):
        for r in results[1:]:
            np.testing.assert_array_equal(r, results[0])


def test_global_thread_setting(big):
    q, k, v, _ = big
    before = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(1)
        assert fastattn.get_num_threads() == 1
        one = fastattn.scaled_dot_product_attention(q, k, v)
        fastattn.set_num_threads(3)
        assert fastattn.get_num_threads() == (3 if fastattn.openmp_enabled() else 1)
        np.testing.assert_array_equal(fastattn.scaled_dot_product_attention(q, k, v), one)
    finally:
        fastattn.set_num_threads(None)
    assert fastattn.get_num_threads() == before


def test_concurrent_python_threads(big):
    """Calls from several Python threads at once (the GIL is released in C)."""
    q, k, v, mask = big
    expected = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fastattn.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                               num_threads=1 + i % 2) for i in range(12)]
        for f in futures:
            np.testing.assert_array_equal(f.result(), expected)
