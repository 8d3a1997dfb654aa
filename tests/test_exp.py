"""The vector exp inside softmax: within 2 ulp (measured: 1) of the
correctly rounded exp over the range softmax uses, on both SIMD paths."""
import numpy as np
import pytest

from fastattn import _core, _runtime


def ulp_distance(a, b):
    """Distance in units in the last place, for same-sign finite floats."""
    ia = a.view(np.int32 if a.dtype == np.float32 else np.int64).astype(np.int64)
    ib = b.view(np.int32 if b.dtype == np.float32 else np.int64).astype(np.int64)
    return np.abs(ia - ib)


def kernel_exp(x, mode=0):
    y = np.empty_like(x)
    _core.exp(_runtime.isa(), x, y, mode)
    return y


def test_float32_exp_sweep(simd):
    # every 97th float32 from -104 (results below 2^-149 round to 0) up to 0,
    # subnormal results included, plus the positive side up to overflow
    neg_bits = np.arange(0x80000000, int(np.float32(-104).view(np.uint32)) + 1, 97, dtype=np.uint32)
    neg = neg_bits.view(np.float32)
    pos = np.linspace(0, 88.72, 200_001, dtype=np.float32)
    x = np.concatenate([neg, pos])
    expected = np.exp(x.astype(np.float64)).astype(np.float32)  # correctly rounded, but for ties
    assert ulp_distance(kernel_exp(x), expected).max() <= 2


def test_float64_exp_sweep(simd):
    # float64 has no wider type to round from: compare with long double exp
    # where it is wider, else with NumPy's exp (within 1 ulp itself)
    x = np.concatenate([np.linspace(-745, 0, 400_001), np.linspace(0, 709, 100_001)])
    expected = np.exp(x.astype(np.longdouble)).astype(np.float64)
    assert ulp_distance(kernel_exp(x), expected).max() <= 2


def test_exp_special_values(simd):
    for dtype in (np.float32, np.float64):
        x = np.array([np.nan, -np.inf, np.inf, 0.0, -0.0, -1e4, 1e4], dtype)
        y = kernel_exp(x)
        assert np.isnan(y[0])
        np.testing.assert_array_equal(y[1:], [0, np.inf, 1, 1, 0, np.inf])


@pytest.mark.parametrize("mode", [1, 2], ids=["scores", "masked-scores"])
def test_softmax_exp_gives_the_general_exp_bits(simd, mode):
    # The attention kernels' exp of x = z - m <= ln 256 (m may trail the
    # maximum by that much, fa_attn_impl.h) builds 2^n its own way; it must
    # give the bits of the general exp, subnormal results and NaN included
    # (checked exhaustively in C when written; here every float32 whose exp
    # is subnormal, every 61st from -0 down to -inf and from 0 up to ln 256,
    # NaNs, and float64)
    bits = np.arange(0x80000000, 0xFF800001, 61, dtype=np.uint64).astype(np.uint32)
    top = int(np.float32(np.log(256)).view(np.uint32))
    pos = np.append(np.arange(0, top, 61, dtype=np.uint32), np.uint32(top))
    sub = np.arange(np.float32(-87.0).view(np.uint32), np.float32(-104.0).view(np.uint32) + 1,
                    dtype=np.uint32)
    x = np.concatenate([bits.view(np.float32), sub.view(np.float32), pos.view(np.float32),
                        np.array([0.0, -0.0, -np.inf, -1e30, -87.33655, -103.97208], np.float32),
                        np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF],
                                 np.uint32).view(np.float32)])
    general, softmax = kernel_exp(x), kernel_exp(x, mode)
    np.testing.assert_array_equal(np.isnan(softmax), np.isnan(x))
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(softmax[finite].view(np.uint32), general[finite].view(np.uint32))
    x64 = np.concatenate([-np.geomspace(1e-300, 745, 100_001), np.linspace(0, np.log(256), 10_001),
                          [-np.inf]])
    np.testing.assert_array_equal(kernel_exp(x64, mode), kernel_exp(x64))


def test_exp_mode_is_checked():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="mode must be 0, 1 or 2, got 3"):
        _core.exp(_runtime.isa(), x, np.empty_like(x), 3)
