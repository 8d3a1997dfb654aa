"""How a key/value cache holds its elements (KVCache and PagedKVCache): the
storages, their NumPy dtypes and kernel kinds, and the rounding or
quantisation of the rows written."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _checks as C
from . import _core
from ._typing import DTypeLike, NDArray, Scalar
from .attention import narrow

# storage -> (its NumPy dtype's name, the kernels' kind)
STORAGES = {"float32": ("float32", _core.STORE_NATIVE), "float64": ("float64", _core.STORE_NATIVE),
            "float16": ("float16", _core.STORE_F16), "bfloat16": ("bfloat16", _core.STORE_BF16),
            "int8": ("int8", _core.STORE_I8)}

LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}  # their largest finite values


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
                         f"'float64' or None), got storage={storage!r}; for 16-bit or int8 "
                         "storage pass dtype=np.float32")
    allowed = ("float32", "float16", "bfloat16", "int8")
    if dtype != np.float64 and storage not in allowed:  # (also what is not a str)
        raise ValueError(f"storage must be one of {', '.join(map(repr, allowed))} for a "
                         f"{dtype.name} {what}, got {storage!r}")
    return str(storage)


def storage_dtype(storage: str) -> np.dtype[Any]:
    if storage == "bfloat16":
        return C.bfloat16("storage='bfloat16'")
    return np.dtype(STORAGES[storage][0])


def kind(storage: str) -> int:
    """The kernels' kind of a storage (_core.STORE_*)."""
    return STORAGES[storage][1]


def read_only(a: NDArray[Scalar]) -> NDArray[Scalar]:
    a.flags.writeable = False
    return a


def encode(x: NDArray[np.floating[Any]], storage: str, name: str, nthreads: int
           ) -> tuple[NDArray[Any], Optional[NDArray[np.float32]]]:
    """x in the storage, and its int8 row scales (None otherwise); a
    ValueError, before anything is written, for what the storage cannot hold.

    16-bit: rounded to nearest-even, as astype rounds.  int8: symmetric
    absmax quantisation of each row of the last axis, ``scale = max|x| /
    127`` (float32), ``code = round_half_even(x / scale)``."""
    stored = storage_dtype(storage)
    if stored == x.dtype:
        return x, None
    if storage != "int8":  # rounded as astype rounds, on the kernels' threads
        y = narrow(x, stored, nthreads)
        overflow = np.isfinite(x) & np.isinf(y)
        if overflow.any():
            raise ValueError(f"{name} holds {x[overflow].flat[0]}, beyond the range of "
                             f"{storage} storage (largest finite {LARGEST[storage]:g}); use "
                             "storage='float32'")
        return y, None
    if not np.isfinite(x).all():
        raise ValueError(f"{name} holds a non-finite value, which int8 storage cannot hold; "
                         "use storage='float32' (or 'float16')")
    scale = (np.abs(x).max(axis=-1, initial=0) / 127).astype(np.float32)
    with np.errstate(over="ignore"):
        read_back = scale * np.float32(127)  # what a largest code is read as
    if np.isinf(read_back).any():
        raise ValueError(f"{name} holds {np.abs(x).max()}, beyond the range of int8 storage "
                         f"(127 times its scale must stay a finite float32); use "
                         "storage='float32'")
    with np.errstate(invalid="ignore", divide="ignore"):  # 0 / 0 for an all-zero row
        codes = np.rint(x / scale[..., None])
    codes = np.clip(np.nan_to_num(codes, nan=0.0), -127, 127).astype(np.int8)
    return codes, scale


def half_hint(dtype: np.dtype[Any], cache_dtype: np.dtype[Any], name: str, what: str) -> str:
    """The fix for 16-bit arrays given to a cache, to end a dtype error."""
    if not C.is_half(dtype):
        return ""
    return (f"; pass {name}.astype(np.{cache_dtype.name}): a {what} computes in float32 "
            f"and holds its keys and values in {dtype.name} with storage='{dtype.name}'")
