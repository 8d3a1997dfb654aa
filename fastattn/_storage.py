"""How keys, values and queries are held: the one table of storages (the
user's word, ``storage``) with their NumPy dtypes and the kernels' enum
(``store``), and the rounding or quantisation of the rows written."""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np

from . import _checks as C
from . import _core, _runtime
from ._typing import DTypeLike, NDArray, Scalar


class Storage(NamedTuple):
    """One way of holding elements: the NumPy dtype of the arrays that hold
    them, how the kernels read them (converted exactly to float32), whether
    each row has a float32 scale, whether they are uint8 codes that only the
    storage's name tells apart, and the largest finite value a rounded
    storage holds (None where rows are scaled into range or exact)."""
    dtype: str
    store: int
    scaled: bool = False
    codes: bool = False
    largest: Optional[float] = None


TABLE = {
    "float32": Storage("float32", _core.STORE_NATIVE),
    "float64": Storage("float64", _core.STORE_NATIVE),
    "float16": Storage("float16", _core.STORE_F16, largest=65504.0),
    "bfloat16": Storage("bfloat16", _core.STORE_BF16, largest=3.3895313892515355e38),
    "int8": Storage("int8", _core.STORE_I8, scaled=True),
    "float8_e4m3fn": Storage("uint8", _core.STORE_F8E4M3, scaled=True, codes=True),
    "float8_e5m2": Storage("uint8", _core.STORE_F8E5M2, codes=True, largest=57344.0),
    "int4": Storage("uint8", _core.STORE_Q4, codes=True),
}
FLOAT32_STORAGES = tuple(s for s in TABLE if s != "float64")  # what a float32 cache holds
SCALED = tuple(s for s, t in TABLE.items() if t.scaled)
CODES = tuple(s for s, t in TABLE.items() if t.codes)
# the storages a float32 computation reads from arrays of their own dtype
# (paged_attention's "auto" caches)
BY_DTYPE = tuple(s for s in FLOAT32_STORAGES if TABLE[s].dtype == s)
LARGEST = {s: t.largest for s, t in TABLE.items() if t.largest is not None}
# the dtypes of queries the kernels read for a float32 computation
QUERY_DTYPES = ("float32", "float16", "bfloat16")

# int4: llama.cpp's q4_0 blocks (csrc/fa_common.h): a float16 scale d and 16
# bytes of codes per 32 elements of a row, nibble c standing for d * (c - 8)
Q4_BLOCK, Q4_BLOCK_BYTES = 32, 18


def width(storage: str, n: int) -> int:
    """The length of the last axis that holds a row of n elements."""
    if storage == "int4":
        return -(-n // Q4_BLOCK) * Q4_BLOCK_BYTES
    return n


def _fp8_values(storage: str) -> NDArray[np.float64]:
    """The values of the non-negative codes 0, 1, ... of a float8 format, in
    increasing order: OCP FP8's float8_e4m3fn (4 exponent bits of bias 7, 3
    fraction bits; 0x7f is NaN, no inf) up to 448, or float8_e5m2 (binary16's
    top byte) up to 57344 and then inf (code 0x7c)."""
    ebits, bias, top = (4, 7, 0x7e) if storage == "float8_e4m3fn" else (5, 15, 0x7b)
    mbits = 7 - ebits
    c = np.arange(top + 1)
    e, m = c >> mbits, c & ((1 << mbits) - 1)
    values = np.where(e == 0, m * 2.0 ** (1 - bias - mbits),
                      (m + 2 ** mbits) * 2.0 ** (e - bias - mbits))
    return values if storage == "float8_e4m3fn" else np.append(values, np.inf)


def _fp8_encode(x: NDArray[Any], storage: str) -> NDArray[np.uint8]:
    """Codes of x (finite, or for e5m2 also inf and NaN) rounded to nearest,
    ties to even (IEEE's rounding; beyond the largest finite, e5m2 rounds to
    inf).  In float32 bits: a normal value's fraction rounded to the
    format's bits (a carry steps the exponent), a subnormal one to the
    format's step by rint; the result, a binary16 value, read off its
    binary16 bits (e5m2 is their top byte)."""
    ebits = 4 if storage == "float8_e4m3fn" else 5
    mbits, emin = 7 - ebits, (-6 if ebits == 4 else -14)  # fraction bits, smallest normal
    y = np.ascontiguousarray(x, np.float32)
    bits = y.view(np.uint32)
    drop = 23 - mbits  # the float32 fraction bits to round off
    up = bits + np.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & np.uint32(1))
    normal = (up & np.uint32(0xFFFFFFFF ^ ((1 << drop) - 1))).view(np.float32)
    step = np.float32(2.0 ** (emin - mbits))
    with np.errstate(invalid="ignore", over="ignore"):
        rounded = np.where(np.abs(y) < np.float32(2.0 ** emin), np.rint(y / step) * step, normal)
        rounded = np.where(np.isnan(y), y, rounded)
        h = rounded.astype(np.float16).view(np.uint16)  # exact (beyond e5m2's range: inf)
    if ebits == 5:
        return (h >> 8).astype(np.uint8)
    mag = np.abs(rounded)
    normal_code = ((h >> 10 & 31).astype(np.int32) - 8) << 3 | (h >> 7 & 7)
    code = np.where(mag >= np.float32(2.0**-6), normal_code,
                    np.rint(mag * np.float32(512)).astype(np.int32))
    signed: NDArray[np.uint8] = (code.astype(np.uint8)
                                 | ((h >> 15).astype(np.uint8) << 7).astype(np.uint8))
    return signed


def _fp8_decode(codes: NDArray[np.uint8], storage: str) -> NDArray[np.float32]:
    table = np.full(128, np.nan)
    values = _fp8_values(storage)
    table[:len(values)] = values
    out = table[codes & 0x7f].astype(np.float32)
    signed: NDArray[np.float32] = np.where(codes & 0x80, -out, out)
    return signed


def decode(held: NDArray[Any], scale: Optional[NDArray[np.float32]], storage: str, n: int,
           dtype: np.dtype[Any]) -> NDArray[Any]:
    """What the kernels read from rows held in storage (n elements each), in
    dtype (a new array).  Computed as the kernels do, in float32."""
    if storage.startswith("float8_"):
        out = _fp8_decode(held, storage)
    elif storage == "int4":  # (the blocks counted from the width: held may have no row)
        groups = held.shape[-1] // Q4_BLOCK_BYTES
        blocks = held.reshape(held.shape[:-1] + (groups, Q4_BLOCK_BYTES))
        d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # (..., G, 1)
        codes = np.concatenate([blocks[..., 2:] & 15, blocks[..., 2:] >> 4], axis=-1)
        out = (d * (codes.astype(np.float32) - 8)).reshape(
            held.shape[:-1] + (groups * Q4_BLOCK,))[..., :n]
    else:
        out = held.astype(dtype)
    if scale is not None:
        out = out * scale[..., None]
    return out.astype(dtype, copy=False)


def cache_dtype(dtype: DTypeLike, what: str) -> np.dtype[Any]:
    """The dtype a cache computes in, float32 or float64; a 16-bit one is a
    TypeError that says how to hold the keys and values in 16 bits."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is not None and C.is_half(dt):
        raise TypeError(f"dtype must be float32 or float64, what a {what} computes in; got "
                        f"{dt.name}: for keys and values held in {dt.name}, pass "
                        f"dtype=np.float32, storage='{dt.name}' (its queries may then be "
                        f"{dt.name} too)")
    return C.check_float_dtype(dtype, "dtype")


def check(storage: object, dtype: np.dtype[Any], what: str) -> str:
    """storage (None: dtype's own) when a cache computing in dtype can hold
    it, else a ValueError naming the storages it can."""
    storage = dtype.name if storage is None else storage
    if dtype == np.float64 and storage != "float64":
        raise ValueError(f"a float64 {what} holds float64 keys and values only (storage "
                         f"'float64' or None), got storage={storage!r}; for 16-, 8- or "
                         "4-bit storage pass dtype=np.float32")
    if dtype != np.float64 and storage not in FLOAT32_STORAGES:  # (also what is not a str)
        raise ValueError(f"storage must be one of {', '.join(map(repr, FLOAT32_STORAGES))} "
                         f"for a {dtype.name} {what}, got {storage!r}")
    return str(storage)


def storage_dtype(storage: str) -> np.dtype[Any]:
    if storage == "bfloat16":
        return C.bfloat16("storage='bfloat16'")
    return np.dtype(TABLE[storage].dtype)


def store(storage: str) -> int:
    """The kernels' enum of a storage (_core.STORE_*)."""
    return TABLE[storage].store


def query_store(dtype: np.dtype[Any]) -> int:
    """How the kernels read queries of dtype (float32, float64, float16 or
    bfloat16)."""
    return TABLE[C.dtype_name(dtype)].store


def narrow(x: NDArray[np.float32], dtype: np.dtype[Any], nthreads: int,
           out: Optional[NDArray[Any]] = None) -> NDArray[Any]:
    """x (float32) rounded to nearest-even dtype (float16 or bfloat16), into
    out when given: what NumPy's and ml_dtypes' astype give (NaN's payload
    bits aside), on the threads."""
    x = C.contiguous(x)
    y = out if out is not None and out.flags.c_contiguous and out.flags.aligned else \
        np.empty(x.shape, dtype)
    _core.narrow(_runtime.isa(), store(C.dtype_name(dtype)), x, y, nthreads)
    if out is not None and y is not out:
        np.copyto(out, y)
        return out
    return y


def read_only(a: NDArray[Scalar]) -> NDArray[Scalar]:
    a.flags.writeable = False
    return a


def encode(x: NDArray[np.floating[Any]], storage: str, name: str, nthreads: int
           ) -> tuple[NDArray[Any], Optional[NDArray[np.float32]]]:
    """x in the storage, and its row scales (SCALED storages; None
    otherwise); a ValueError, before anything is written, for what the
    storage cannot hold.

    16-bit and float8_e5m2: rounded to nearest-even, as astype rounds.
    int8: symmetric absmax quantisation of each row of the last axis,
    ``scale = max|x| / 127`` (float32), ``code = round_half_even(x /
    scale)``.  float8_e4m3fn: ``x / scale`` rounded to nearest-even, the
    scale the power of two that brings max|x| into (224, 448].  int4:
    ``int4_encode``."""
    stored = storage_dtype(storage)
    if stored == x.dtype:
        return x, None
    if storage in ("float16", "bfloat16", "float8_e5m2"):
        if storage == "float8_e5m2":
            y = _fp8_encode(x, storage)
            held = _fp8_decode(y, storage)
        else:  # rounded as astype rounds, on the kernels' threads
            y = held = narrow(x, stored, nthreads)
        overflow = np.isfinite(x) & np.isinf(held)
        if overflow.any():
            raise ValueError(f"{name} holds {x[overflow].flat[0]}, beyond the range of "
                             f"{storage} storage (largest finite {LARGEST[storage]:g}); use "
                             "storage='float32'")
        return y, None
    if not np.isfinite(x).all():
        raise ValueError(f"{name} holds a non-finite value, which {storage} storage cannot hold; "
                         "use storage='float32' (or 'float16')")
    if storage == "int4":
        return int4_encode(x, name), None
    if storage == "float8_e4m3fn":
        codes, scale = _e4m3_encode(x)
        with np.errstate(over="ignore"):
            held = _fp8_decode(codes, storage).max(axis=-1, initial=0) * scale
        if np.isinf(held).any():  # a row near float32's largest rounded up past it
            raise ValueError(f"{name} holds {_largest(x)}, beyond the range of float8_e4m3fn "
                             "storage (its rows, rounded, must stay finite float32s); use "
                             "storage='float32'")
        return codes, scale
    scale = (np.abs(x).max(axis=-1, initial=0) / 127).astype(np.float32)
    with np.errstate(over="ignore"):
        read_back = scale * np.float32(127)  # what a largest code is read as
    if np.isinf(read_back).any():
        raise ValueError(f"{name} holds {_largest(x)}, beyond the range of int8 storage "
                         f"(127 times its scale must stay a finite float32); use "
                         "storage='float32'")
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 for an all-zero row
        codes = np.rint(x / scale[..., None])
    codes = np.clip(np.nan_to_num(codes, nan=0.0), -127, 127).astype(np.int8)
    return codes, scale


def int8_mode_operands(key: NDArray[Any], value: NDArray[Any], nthreads: int,
                       seen: Optional[NDArray[np.bool_]] = None
                       ) -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.float32],
                                  NDArray[np.float32], NDArray[np.float32]]:
    """What the int8 mode reads of a call's float keys and values (dense
    calls, ``precision="int8"``): the keys less their per-channel mean over
    the positions of each (batch, head) (SageAttention's smooth_k, Zhang et
    al., ICLR 2025; the kernels add ``scale * q . mean`` back to every
    score, so that the softmax, softcap, sinks and lse see the true logits),
    then keys and values rounded to int8 per row, ``scale = max|row| /
    127`` and ``code = round_half_even(x * (127 / max|row|))``
    (fa_int8_rows, on the kernels' threads).  Returns key codes, value
    codes, their row scales and the mean (float32, key's shape without its
    positions); axes that key or value broadcast (stride 0) are rounded
    once and broadcast back.  The mean is over the rows some query sees
    (seen: key's shape without its last axis, keys_seen's; None: all) and
    holds no NaN or inf; none where it would push a key past float32's
    range.  A row holding a non-finite value gets scale NaN (codes 0): its
    scores or values come out NaN where the row is seen, as the exact ones
    would be NaN or inf (reference.int8_mode_operands is the readable
    twin)."""
    kd, vd = _distinct(key), _distinct(value)
    k, v = C.contiguous(kd, np.float32), C.contiguous(vd, np.float32)  # aligned too
    kshape, vshape = np.shape(key), np.shape(value)
    # the common case in one C call (_core.int8_operands); the general path
    # below for what it leaves: a mask's rows, keys of one feature (numpy's
    # sum is pairwise there), a sum or a row the mean made not finite
    if seen is None and k.ndim >= 2 and v.ndim >= 2 and k.shape[-1] > 1:
        got = _core.int8_operands(_runtime.isa(), k.reshape(_heads(k), *k.shape[-2:]),
                                  v.reshape(_heads(v), *v.shape[-2:]), nthreads)
        if got is not None:
            k8, k_scale, v8, v_scale, k_mean = got
            return (_widen(k8.reshape(k.shape), kshape), _widen(v8.reshape(v.shape), vshape),
                    _widen(k_scale.reshape(k.shape[:-1]), kshape[:-1]),
                    _widen(v_scale.reshape(v.shape[:-1]), vshape[:-1]),
                    _widen(k_mean.reshape(k.shape[:-2] + k.shape[-1:]), kshape[:-2] + kshape[-1:]))
    if seen is not None:  # a key seen along an axis the key broadcasts over
        axes = tuple(a for a in range(k.ndim - 1) if k.shape[a] == 1 and seen.shape[a] > 1)
        seen = np.any(seen, axis=axes, keepdims=True) if axes else seen
    # summed in float64, so that the order of the sums (varlen_attention's
    # differs) leaves the same float32 mean; in C on the kernels' threads,
    # in numpy's order (numpy's own took much of a short call's time)
    sums = _col_sums(k, nthreads) if seen is None else None
    if sums is not None and np.isfinite(sums).all():
        mean = (sums / max(k.shape[-2], 1)).astype(np.float32)
    else:  # over the rows seen without a NaN or an inf
        counted = np.isfinite(k).all(axis=-1, keepdims=True)
        if seen is not None:
            counted &= seen[..., None]
        count = np.maximum(counted.sum(axis=-2, dtype=np.int64), 1)
        mean = (np.where(counted, k, 0).sum(axis=-2, dtype=np.float64) / count).astype(np.float32)
    kc, ks = _int8_rows(k, mean, nthreads)
    if kc is None:  # a mean pushed keys past float32's range: their heads not smoothed
        k3 = k.reshape(-1, *k.shape[-2:])
        with np.errstate(invalid="ignore", over="ignore"):  # finite rows made not finite
            spoilt = (np.isfinite(k3).all(axis=-1) & ~np.isfinite(
                k3 - mean.reshape(-1, 1, k.shape[-1])).all(axis=-1)).any(axis=-1)
        mean.reshape(-1, k.shape[-1])[spoilt] = 0
        kc, ks = _int8_rows(k, mean, nthreads)
    vc, vs = _int8_rows(v, None, nthreads)
    assert kc is not None and vc is not None and ks is not None and vs is not None
    return (_widen(kc, kshape), _widen(vc, vshape), _widen(ks, kshape[:-1]),
            _widen(vs, vshape[:-1]), _widen(mean, kshape[:-2] + kshape[-1:]))


def _heads(x: NDArray[Any]) -> int:
    """The rows of (positions, features) x holds: its axes before them."""
    return math.prod(x.shape[:-2])


def _widen(x: NDArray[Any], shape: tuple[int, ...]) -> NDArray[Any]:
    """x broadcast to shape (axes _distinct took once), x itself when it
    has that shape (np.broadcast_to took a tenth of a short call's
    preparation)."""
    return x if x.shape == shape else np.broadcast_to(x, shape)


def _col_sums(x: NDArray[np.float32], nthreads: int) -> NDArray[np.float64]:
    """x.sum(axis=-2, dtype=np.float64) of a contiguous x, the same sums
    (each in order along the positions) from _core.col_sums; numpy's own
    for one feature, which it sums pairwise (its axis then contiguous)."""
    S, n = x.shape[-2], x.shape[-1]
    if n == 1:
        sums: NDArray[np.float64] = x.sum(axis=-2, dtype=np.float64)
        return sums
    R = x.size // (S * n) if S * n > 0 else 0
    out = np.zeros(x.shape[:-2] + (n,), np.float64)
    if R > 0:
        _core.col_sums(_runtime.isa(), x.reshape(R, S, n), out.reshape(R, n), nthreads)
    return out


def _distinct(x: NDArray[Any]) -> NDArray[Any]:
    """x without the repeats of its broadcast axes (stride 0) but its last,
    the features, which the kernels read whole (the key mean too): index 0
    there."""
    if 0 not in x.strides:
        return x
    last = x.ndim - 1
    return x[tuple(slice(0, 1) if st == 0 and n > 1 and a < last else slice(None)
                   for a, (st, n) in enumerate(zip(x.strides, x.shape)))]


def int8_packed_operands(key: NDArray[Any], value: NDArray[Any], cu_seqlens_k: NDArray[np.int64],
                         nthreads: int
                         ) -> tuple[NDArray[np.int8], NDArray[np.int8], NDArray[np.float32],
                                    NDArray[np.float32], NDArray[np.float32]]:
    """int8_mode_operands for packed sequences (varlen_attention): key
    (total_k, Hkv, E) and value (total_k, Hkv, Ev), sequence b's rows
    cu_seqlens_k[b]..cu_seqlens_k[b + 1] - 1, each sequence's keys less
    their own mean; the mean is (B, Hkv, E)."""
    k = C.contiguous(key, np.float32)
    lens = np.diff(cu_seqlens_k)
    seq = np.repeat(np.arange(lens.size), lens)  # each row's sequence
    finite: NDArray[np.bool_] = np.all(np.isfinite(k), axis=-1, keepdims=True)
    sums = np.zeros((lens.size,) + k.shape[1:], np.float64)
    count = np.zeros((lens.size,) + k.shape[1:2] + (1,), np.int64)
    some = lens > 0
    if some.any():  # reduceat over the sequences with rows (an empty range gives a row)
        starts = cu_seqlens_k[:-1][some]
        sums[some] = np.add.reduceat(np.where(finite, k, 0), starts, axis=0, dtype=np.float64)
        count[some] = np.add.reduceat(finite, starts, axis=0, dtype=np.int64)
    mean = (sums / np.maximum(count, 1)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        smoothed = k - mean[seq]
        spoilt = np.zeros(mean.shape[:2], bool)  # a mean pushing finite keys past float32's range
        np.logical_or.at(spoilt, seq,
                         finite[..., 0] & ~np.all(np.isfinite(smoothed), axis=-1))
    if spoilt.any():
        mean[spoilt] = 0
        smoothed = k - mean[seq]
    kc, ks = _int8_rows(smoothed[None], None, nthreads)
    vc, vs = _int8_rows(C.contiguous(value, np.float32)[None], None, nthreads)
    assert kc is not None and vc is not None and ks is not None and vs is not None
    return kc[0], vc[0], ks[0], vs[0], mean


def _int8_rows(x: NDArray[np.float32], mean: Optional[NDArray[np.float32]], nthreads: int
               ) -> tuple[Optional[NDArray[np.int8]], Optional[NDArray[np.float32]]]:
    """x (contiguous) less mean (x's shape without its positions, or None)
    rounded to int8 per row by fa_int8_rows; (None, None) when the mean
    pushed a finite row past float32's range."""
    if x.size == 0:  # a row of no features: scale 0
        return np.zeros(x.shape, np.int8), np.zeros(x.shape[:-1], np.float32)
    codes = np.empty(x.shape, np.int8)  # every element written by fa_int8_rows
    scales = np.empty(x.shape[:-1], np.float32)
    S, n = x.shape[-2], x.shape[-1]
    R = x.size // (S * n)
    m = None if mean is None else C.contiguous(mean.reshape(R, n))
    spoilt = _core.int8_rows(_runtime.isa(), x.reshape(R, S, n), m, codes.reshape(R, S, n),
                               scales.reshape(R, S), nthreads)
    return (None, None) if spoilt else (codes, scales)


def _largest(x: NDArray[Any]) -> float:
    """The element of x of largest magnitude, with its sign."""
    return float(x.flat[int(np.argmax(np.abs(x)))])


def _e4m3_encode(x: NDArray[np.floating[Any]]) -> tuple[NDArray[np.uint8], NDArray[np.float32]]:
    """float8_e4m3fn codes of x / scale and the scale of each row: the power
    of two 2^k, k >= -149, with max|x| / 2^k in (224, 448] (1 for a row of
    zeros).  A power of two, so that scale * code is exact and the kernels'
    scaled dot products equal those of the dequantised rows (barring
    subnormal floats); a float format loses nothing to the scale's coarser
    steps, whose only work is to keep the row clear of 448 and of e4m3's
    subnormals."""
    amax = np.abs(x).astype(np.float64).max(axis=-1, initial=0)
    with np.errstate(divide="ignore"):
        mant, exp = np.frexp(amax / 448)  # amax / 448 = mant * 2^exp, mant in [0.5, 1)
    k = np.where(mant == 0.5, exp - 1, exp)  # ceil(log2(amax / 448))
    k = np.where(amax > 0, np.maximum(k, -149), 0)
    scale = np.ldexp(np.float64(1), k).astype(np.float32)
    # x / 2^k: exact in float32 (but for results among float32's
    # subnormals, which round to code 0 whatever their last bit)
    return _fp8_encode(x.astype(np.float32) / scale[..., None], "float8_e4m3fn"), scale


def int4_encode(x: NDArray[np.floating[Any]], name: str = "x") -> NDArray[np.uint8]:
    """The rows of x (last axis) as llama.cpp's q4_0 blocks: per block of 32
    elements (the last one zero-padded) a float16 scale ``d = max|x| / 7``
    rounded to nearest-even, then ``code = clip(round_half_even(x / d), -7,
    7) + 8`` two per byte, element b in the low nibble of byte b and element
    b + 16 in the high one; a block whose d is 0 holds codes 8 (zeros).  The
    scale in float16, not float32: ``d * (code - 8)`` is then exact in
    float32 (11 + 4 significant bits), so the kernels read exactly the
    dequantised values, and it costs 2 bytes per 32 elements, as in q4_0."""
    n = x.shape[-1]
    blocks = -(-n // Q4_BLOCK)
    padded = np.zeros(x.shape[:-1] + (blocks * Q4_BLOCK,), np.float64)
    padded[..., :n] = x
    g = padded.reshape(x.shape[:-1] + (blocks, Q4_BLOCK))
    with np.errstate(over="ignore"):
        d = (np.abs(g).max(axis=-1) / 7).astype(np.float16)
    if np.isinf(d).any():
        raise ValueError(f"{name} holds {_largest(x)}, beyond the range of int4 storage "
                         "(7 times its float16 scale, at most 458528); use storage='float32'")
    d64 = d.astype(np.float64)[..., None]
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.rint(np.where(d64 > 0, g / d64, 0.0))
    nib = (np.clip(codes, -7, 7) + 8).astype(np.uint8)
    out = np.empty(x.shape[:-1] + (blocks, Q4_BLOCK_BYTES), np.uint8)
    out[..., :2] = d[..., None].view(np.uint8)  # little-endian float16
    out[..., 2:] = nib[..., :16] | (nib[..., 16:] << 4)
    return out.reshape(x.shape[:-1] + (blocks * Q4_BLOCK_BYTES,))


def half_hint(dtype: np.dtype[Any], cache_dtype: np.dtype[Any], name: str, what: str) -> str:
    """The fix for 16-bit arrays given to a cache, to end a dtype error."""
    if not C.is_half(dtype):
        return ""
    return (f"; pass {name}.astype(np.{cache_dtype.name}): a {what} computes in float32 "
            f"(one created with storage='{dtype.name}' holds its keys and values in "
            f"{dtype.name})")
