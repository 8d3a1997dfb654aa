"""Element offsets past 2**31, where a 32-bit index would wrap around: the
kernels compute every offset (batch, row and column strides, reversed ones
too) in 64 bits.  The operands are strided views into lazily mapped
anonymous memory of 8 GiB; only the pages they touch become resident."""
import mmap

import numpy as np
import pytest
from conftest import assert_close, check_attention, f64
from numpy.lib.stride_tricks import as_strided

import fastattn
from fastattn import reference as ref

G = 2**30
SPACE = 8 * G + 2**20  # bytes of each mapping


@pytest.fixture(scope="module")
def spaces():
    """Two separate mappings (outputs must not share memory with inputs)."""
    try:
        maps = [mmap.mmap(-1, SPACE, flags=mmap.MAP_PRIVATE) for _ in range(2)]
    except (OSError, OverflowError, ValueError) as e:
        pytest.skip(f"cannot map 2 x 8 GiB of address space: {e}")
    return [np.frombuffer(m, np.uint8) for m in maps]


def place(space, dtype, start, shape, strides, rng=None):
    """A view of dtype into space at element start with element strides,
    filled with normal values (or random booleans)."""
    item = np.dtype(dtype).itemsize
    view = as_strided(space[start * item:].view(dtype), shape, [s * item for s in strides])
    if rng is not None:
        view[...] = rng.random(shape) > 0.3 if dtype == np.bool_ else rng.standard_normal(shape)
    return view


def test_attention(spaces, simd, rng):
    src, dst = spaces
    f = np.float32
    B, L, S, E, Ev = 2, 5, 3, 8, 4
    q = place(src, f, 0, (B, L, E), (2 * G, E, 1), rng)                      # batch 1 at 2^31
    k = place(src, f, 1000, (B, S, E), (E, G + 1000, 1), rng)                # row 2 at 2^31 + 3000
    v = place(src, f, 2 * G + 10000, (B, S, Ev), (Ev, -G, 1), rng)           # reversed rows
    mask = place(src, f, 20000, (B, L, S), (S, G // 2, 1), rng)              # row 4 at 2^31 + 20000
    out = place(dst, f, 2 * G + 100, (B, L, Ev), (-2 * G, Ev, 1))            # batch 1 at -2^31
    assert max(abs(s) for a in (q, k, v, mask, out) for s in a.strides) >= 4 * G
    expected, _ = check_attention(q, k, v, f, attn_mask=mask, is_causal=True)
    assert fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True,
                                                 out=out) is out
    np.testing.assert_array_equal(out, expected)


def test_matmul(spaces, simd, rng):
    src, dst = spaces
    f = np.float32
    a = place(src, f, 0, (2, 7, 9), (2 * G, 9, 1), rng)             # batch 1 at 2^31
    b = place(src, f, 100, (9, 11), (1, 2 * G // 10 + 1), rng)      # column 10 at 2^31 + 110
    out = place(dst, f, 2 * G + 50, (2, 7, 11), (-2 * G, 11, 1))    # batch 1 at -2^31
    assert fastattn.matmul(a, b, out=out) is out
    assert_close(out, f64(a)[0] @ f64(b)[0], f, 9, magnitude=3)


def test_softmax(spaces, simd, rng):
    src, dst = spaces
    f = np.float32
    x = place(src, f, 0, (3, 6), (G, 1), rng)                       # row 2 at 2^31
    mask = place(src, np.bool_, 3 * G + 100, (3, 6), (G + 1, 1), rng)  # row 2 at 5 * 2^30 bytes
    y = fastattn.softmax(x, mask=mask)
    assert_close(y, ref.softmax(f64(x)[0], mask=mask), f, 6)
    out = place(dst, f, 2 * G + 7, (3, 6), (-G, 1))
    assert fastattn.softmax(x, mask=mask, out=out) is out
    np.testing.assert_array_equal(out, y)


def test_empty_operands_with_absurd_strides(simd, dtype, rng):
    """Empty arrays may carry any strides; the kernels never read them, and
    must not even compute offsets with them (pointer arithmetic past any
    object is undefined behaviour, which the sanitizer build reports)."""
    base = np.zeros(1, dtype)
    huge = [2**62, 2**61, 2**61, 8]
    q0 = as_strided(base, (3, 5, 128, 0), huge)          # E = 0
    k0 = as_strided(base, (3, 5, 7, 0), huge)
    v = rng.standard_normal((3, 5, 7, 2)).astype(dtype)
    out = fastattn.scaled_dot_product_attention(q0, k0, v)
    assert_close(out, np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True),
                                      out.shape), dtype, 7)  # no feature: equal weights
    q = rng.standard_normal((3, 5, 128, 4)).astype(dtype)
    k = rng.standard_normal((3, 5, 7, 4)).astype(dtype)
    v0 = as_strided(base, (3, 5, 7, 0), huge)             # Ev = 0, weights wanted
    o0 = as_strided(np.zeros(1, dtype), (3, 5, 128, 0), huge)
    _, w = fastattn.scaled_dot_product_attention(q, k, v0, need_weights=True, out=o0)
    assert_close(w, ref.scaled_dot_product_attention(*f64(q, k, v0), need_weights=True)[1],
                 dtype, 7)


@pytest.mark.parametrize("num_blocks,block", [(2**31 + 8, 2**31 + 1), (2**32 + 8, 2**32 + 1)])
def test_block_ids_past_int32_are_refused(num_blocks, block):
    """The kernels read int32 block tables: an id past 2**31 - 1 of a pool
    that large would wrap, to another block (2**32 + 1 to 1) or before the
    pool.  The pool is one block seen num_blocks times (stride 0)."""
    one = np.arange(4, dtype=np.float32)
    pool = as_strided(one, (num_blocks, 1, 1, 4), (0, 0, 0, 4))
    q = np.ones((1, 1, 4), np.float32)
    fine = fastattn.paged_attention(q, pool, pool, np.array([[0, 2**31 - 1]]), np.array([2]),
                                    np.array([0, 1]))
    np.testing.assert_array_equal(fine, one[None, None])  # two equal rows: their mean
    with pytest.raises(ValueError, match=rf"block_table\[0, 1\] = {block}: block ids above "
                                         r"2\*\*31 - 1"):
        fastattn.paged_attention(q, pool, pool, np.array([[0, block]]), np.array([2]),
                                 np.array([0, 1]))


def test_a_paged_cache_holds_int32_block_ids():
    with pytest.raises(ValueError, match=r"num_blocks = 2147483649; at most 2\*\*31"):
        fastattn.PagedKVCache(2**31 + 1, 1, 1, 0)
