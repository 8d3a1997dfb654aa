"""No leaks: the resident memory of 10,000 calls settles.

Every call allocates scratch memory per thread, an output, views and (on
bad input) an exception; a leak of any of them per call grows the resident
set by 10,000 times its size.  The bound is generous (allocator and
interpreter noise), far below what a per-call leak of the scratch or of an
output would add."""
import gc

import numpy as np
import pytest

import fastattn

psutil = pytest.importorskip("psutil")

CALLS = 10_000
BOUND_MB = 20


def rss_mb():
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_resident_memory_settles():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    k = rng.standard_normal((2, 2, 9, 8)).astype(np.float32)
    mask = rng.random((7, 9)) > 0.3
    x = rng.standard_normal((3, 5, 6))
    a, b = rng.standard_normal((7, 5)), rng.standard_normal((5, 9))
    bad_mask = np.zeros((3, 3), np.int8)

    def calls(i):  # five calls
        fastattn.scaled_dot_product_attention(q, k, k, attn_mask=mask, is_causal=i % 2 == 0,
                                              need_weights=i % 3 == 0, num_threads=1 + i % 2)
        fastattn.softmax(x, axis=i % 3, mask=None if i % 2 else x > 0)
        fastattn.matmul(a, b)
        fastattn.merge_heads(fastattn.split_heads(x, 3))
        try:
            fastattn.scaled_dot_product_attention(q, k, k, attn_mask=bad_mask)
        except TypeError:
            pass

    for i in range(1000):  # warm up: thread pools, allocator arenas, caches
        calls(i)
    before = rss_mb()
    for i in range(CALLS // 5):
        calls(i)
    growth = rss_mb() - before
    print(f"resident memory after {CALLS} calls: {growth:+.1f} MB")
    assert growth < BOUND_MB
