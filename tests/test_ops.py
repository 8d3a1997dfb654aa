"""matmul, softmax, split_heads and merge_heads against NumPy."""
import numpy as np
import pytest
from conftest import assert_close, f64

import fastattn
from fastattn import reference as ref

MATMUL_SHAPES = [  # M, K, N: around the micro-tile (6 x NR) and cache blocks (96, 256)
    (1, 1, 1), (6, 16, 16), (7, 17, 15), (95, 255, 257), (97, 300, 33), (200, 64, 520), (3, 0, 4),
]


@pytest.mark.parametrize("M,K,N", MATMUL_SHAPES)
def test_matmul(simd, dtype, rng, M, K, N):
    a = rng.standard_normal((2, M, K)).astype(dtype)
    b = rng.standard_normal((2, K, N)).astype(dtype)
    assert_close(fastattn.matmul(a, b), f64(a)[0] @ f64(b)[0], dtype, K, magnitude=np.sqrt(K))


def test_matmul_strides_and_broadcast(simd, dtype, rng):
    a = rng.standard_normal((3, 1, 40, 50)).astype(dtype)
    b = rng.standard_normal((4, 70, 50)).astype(dtype)
    views = [
        (a, np.swapaxes(b, -1, -2)),                          # transposed
        (a[..., ::-1, :], np.swapaxes(b, -1, -2)[..., ::-1]),  # negative strides
        (a[..., ::2], np.swapaxes(b, -1, -2)[..., ::2, :]),   # non-unit inner stride
        (np.broadcast_to(a[:1], (3, 4, 40, 50)), np.swapaxes(b, -1, -2)),
    ]
    for x, y in views:
        out = fastattn.matmul(x, y)
        assert out.shape == np.broadcast_shapes(x.shape[:-2], y.shape[:-2]) + (x.shape[-2], y.shape[-1])
        assert_close(out, f64(x)[0] @ f64(y)[0], dtype, x.shape[-1], magnitude=8)


def test_matmul_out_strided(simd, dtype, rng):
    a = rng.standard_normal((30, 20)).astype(dtype)
    b = rng.standard_normal((20, 25)).astype(dtype)
    buf = np.zeros((25, 30), dtype)
    res = fastattn.matmul(a, b, out=buf.T)
    assert res.base is buf or np.shares_memory(res, buf)
    assert_close(buf.T, f64(a)[0] @ f64(b)[0], dtype, 20, magnitude=5)


def test_matmul_ieee(simd, dtype):
    a = np.array([[np.nan, 1.0], [1.0, 1.0]], dtype)
    b = np.array([[1.0, 2.0], [np.inf, 1.0]], dtype)
    np.testing.assert_array_equal(fastattn.matmul(a, b), a @ b)


@pytest.mark.parametrize("shape,axis", [((5, 300), -1), ((5, 300), 0), ((3, 4, 17), 1),
                                        ((1,), 0), ((2, 1000), 1), ((4, 0), 0)])
def test_softmax(simd, dtype, rng, shape, axis):
    x = (rng.standard_normal(shape) * 20).astype(dtype)
    n = shape[axis]
    assert_close(fastattn.softmax(x, axis=axis), ref.softmax(f64(x)[0], axis=axis), dtype, n)


def test_softmax_guards(simd, dtype):
    inf, nan = np.inf, np.nan
    x = np.array([[-inf, -inf, -inf],      # nothing visible: zeros, not NaN
                  [0.0, -inf, 1.0],        # -inf entries get 0
                  [nan, 0.0, 1.0],         # NaN visible: NaN row
                  [1e30, 1e30, -1e30],     # huge logits: no overflow
                  [inf, 0.0, 0.0]], dtype) # inf - inf: NaN, as the textbook formula
    y = fastattn.softmax(x)
    np.testing.assert_array_equal(y[0], [0, 0, 0])
    assert y[1, 1] == 0 and abs(y[1].sum() - 1) < 1e-6
    assert np.all(np.isnan(y[2])) and np.all(np.isnan(y[4]))
    np.testing.assert_allclose(y[3], [0.5, 0.5, 0], rtol=1e-6)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(ref.softmax(x.astype(np.float64))))


def test_softmax_masks(simd, dtype, rng):
    x = rng.standard_normal((4, 6, 130)).astype(dtype)
    bmask = rng.random((6, 130)) > 0.5
    bmask[2] = False
    fmask = np.where(rng.random((130,)) > 0.3, rng.standard_normal(130), -np.inf)
    y = fastattn.softmax(x, mask=bmask)
    assert_close(y, ref.softmax(f64(x)[0], mask=bmask), dtype, 130)
    assert np.all(y[:, 2] == 0)
    y = fastattn.softmax(x, mask=fmask)
    assert_close(y, ref.softmax(f64(x)[0], mask=fmask.astype(dtype).astype(np.float64)), dtype, 130)


def test_softmax_in_place_and_out(simd, dtype, rng):
    x = rng.standard_normal((7, 33)).astype(dtype)
    expected = fastattn.softmax(x)
    out = np.empty((33, 7), dtype).T
    assert fastattn.softmax(x, out=out) is out
    np.testing.assert_array_equal(out, expected)
    assert fastattn.softmax(x, out=x) is x
    np.testing.assert_array_equal(x, expected)


def test_split_and_merge_heads(dtype, rng):
    x = rng.standard_normal((2, 5, 12)).astype(dtype)
    heads = fastattn.split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4) and np.shares_memory(heads, x)
    np.testing.assert_array_equal(heads, ref.split_heads(x, 3))
    np.testing.assert_array_equal(heads[:, 1, :, :], x[:, :, 4:8])
    merged = fastattn.merge_heads(heads)
    assert merged.flags.c_contiguous
    np.testing.assert_array_equal(merged, x)
    y = rng.standard_normal((3, 2, 4, 7, 5)).astype(dtype)[:, :, ::-1]
    np.testing.assert_array_equal(fastattn.merge_heads(y), ref.merge_heads(y))
    assert fastattn.merge_heads(np.zeros((0, 2, 3, 4), dtype)).shape == (0, 3, 8)
