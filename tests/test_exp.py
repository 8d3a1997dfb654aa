"""The kernels' vector exps: the general one within 2 ulp (measured: 1) of
the correctly rounded exp on every path, and the softmax's within its bounds."""
import numpy as np
import pytest

from conftest import PROFILE

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


# Every STRIDE-th bit pattern in the sweep below: 55 million inputs, 35 s
# per case under qemu.  There (the "emulated" profile of conftest.py, for
# .ci/aarch64.sh) every 613th: 7.5 million, the 2.2 million subnormal
# results still all of them, which keeps that job within CI's time.
STRIDE = 613 if PROFILE == "emulated" else 61


def softmax_exp_inputs():
    """float32 x <= ln 256: every float32 whose exp is subnormal, every
    STRIDE-th bit pattern from -0 down to -inf and from 0 up to ln 256,
    special values and NaNs."""
    bits = np.arange(0x80000000, 0xFF800001, STRIDE, dtype=np.uint64).astype(np.uint32)
    top = int(np.float32(np.log(256)).view(np.uint32))
    pos = np.append(np.arange(0, top, STRIDE, dtype=np.uint32), np.uint32(top))
    sub = np.arange(np.float32(-87.0).view(np.uint32), np.float32(-104.0).view(np.uint32) + 1,
                    dtype=np.uint32)
    return np.concatenate([bits.view(np.float32), sub.view(np.float32), pos.view(np.float32),
                           np.array([0.0, -0.0, -np.inf, -1e30, -22.0, -22.180956, -87.33655,
                                     -103.97208], np.float32),
                           np.array([0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0xFFFFFFFF],
                                    np.uint32).view(np.float32)])


@pytest.mark.parametrize("mode", [1, 2], ids=["scores", "masked-scores"])
def test_softmax_exp_error_bound(simd, mode):
    # The attention kernels' exp of x = z - m <= ln 256 (m may trail the
    # maximum by that much, fa_kern_attn.h): its own reduction and polynomial
    # on the SIMD paths (fa_prim_simd.h), the general exp on the portable
    # one.  Within 1 ulp of the correctly rounded exp down to x = -22 (all
    # the weights that move a float32 sum), 4 ulp below (measured
    # exhaustively: 1, and 4 at x = -65.8); NaN stays NaN, -inf gives 0.
    x = softmax_exp_inputs()
    y = kernel_exp(x, mode)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(x))
    ok = ~np.isnan(x)
    x, y = x[ok], y[ok]
    expected = np.exp(x.astype(np.float64)).astype(np.float32)
    d = ulp_distance(y, expected)
    assert d[x >= -22].max() <= 1
    assert d.max() <= 4
    assert y[x == -np.inf].tolist() == [0.0]
    # float64 takes the general exp's path
    x64 = np.concatenate([-np.geomspace(1e-300, 745, 100_001), np.linspace(0, np.log(256), 10_001),
                          [-np.inf]])
    np.testing.assert_array_equal(kernel_exp(x64, mode), kernel_exp(x64))


def test_softmax_exp_gives_the_same_bits_on_every_simd_path():
    # AVX2 and NEON apply 2^n by hand, AVX-512 with VSCALEF: one rounding
    # of the same polynomial either way, so the same weights on every SIMD
    # path (the portable path has no fused multiply-add and rounds its own way)
    paths = [p for p in _runtime.available_simd_paths() if p != "portable"]
    if len(paths) < 2:
        pytest.skip(f"one SIMD path besides the portable one on this machine: {paths}")
    x = softmax_exp_inputs()
    ys = []
    for p in paths:
        y = np.empty_like(x)
        _core.exp(_runtime._PATHS[p], x, y, 1)
        ys.append(y)
    for p, y in zip(paths[1:], ys[1:]):
        np.testing.assert_array_equal(y.view(np.uint32), ys[0].view(np.uint32), err_msg=p)


def test_exp_mode_is_checked():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="mode must be 0, 1 or 2, got 3"):
        _core.exp(_runtime.isa(), x, np.empty_like(x), 3)


@pytest.mark.parametrize("out, match", [
    (np.empty(2, np.float32), "out must have x's shape"),
    (np.empty(16, np.float64), "both be float32 or both float64"),
    (np.empty(32, np.float32)[::2], "C-contiguous"),
    (np.empty(16, np.float32).view(np.int32), "both be float32 or both float64"),
    (np.empty(16, ">f4"), "native byte order"),
])
def test_exp_arrays_are_checked(out, match):
    # out shorter than x used to be written past its end
    x = np.zeros(16, np.float32)
    with pytest.raises(ValueError, match=match):
        _core.exp(_runtime.isa(), x, out, 1)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        _core.exp(_runtime.isa(), x, ro, 0)
