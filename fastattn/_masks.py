"""Masks between the two conventions, and two masks made into one.

The functional API (PyTorch's scaled_dot_product_attention): bool True = may
attend.  nn.MultiheadAttention's masks: bool True = ignore.  Floating masks
mean the same in both: added to the scaled scores, -inf hides.
"""
from __future__ import annotations

from typing import Any, Optional, overload

import numpy as np
from numpy.typing import NDArray

from . import _checks as C


def _require_mask(mask: NDArray[Any], name: str, bool_meaning: str) -> None:
    C.require_array(mask, name)
    if mask.dtype != np.bool_ and not C.is_floating(mask.dtype):
        raise TypeError(f"{name} has dtype {mask.dtype}; expected bool ({bool_meaning}) or a "
                        "floating dtype (added to the scores, -inf hides)")


@overload
def from_mha(mask: NDArray[Any], name: str, dtype: np.dtype[Any]) -> NDArray[Any]: ...


@overload
def from_mha(mask: None, name: str, dtype: np.dtype[Any]) -> None: ...


def from_mha(mask: Optional[NDArray[Any]], name: str,
             dtype: np.dtype[Any]) -> Optional[NDArray[Any]]:
    """An nn.MultiheadAttention mask (bool True = ignore; floating added) as
    a functional-API mask: the negation of a bool mask, a float mask in dtype."""
    if mask is None:
        return None
    _require_mask(mask, name, "True = ignore, nn.MultiheadAttention's convention")
    if mask.dtype == np.bool_:
        return ~mask
    return C.float_mask(mask, dtype, name)


def _additive(mask: NDArray[Any], dtype: np.dtype[Any], name: str) -> NDArray[Any]:
    if mask.dtype == np.bool_:
        additive: NDArray[Any] = np.where(mask, dtype.type(0), dtype.type(-np.inf))
        return additive
    return C.float_mask(mask, dtype, name)


def _sum(a: NDArray[Any], b: NDArray[Any]) -> NDArray[Any]:
    """a + b, two additive masks, as one that hides what either hides.  Two
    large negatives (finfo.min + finfo.min, as some models pad) overflow to
    -inf: hidden, as PyTorch's nn.MultiheadAttention gets from the same
    sum, and without NumPy's overflow warning.  -inf in either hides the
    key even against +inf in the other (whose IEEE sum is NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        total: NDArray[Any] = a + b
    np.copyto(total, -np.inf, where=(a == -np.inf) | (b == -np.inf))
    return total


def both(a: Optional[NDArray[Any]], a_name: str, b: Optional[NDArray[Any]], b_name: str,
         dtype: np.dtype[Any]) -> Optional[NDArray[Any]]:
    """One functional-API mask that hides what a or b hides (either may be
    None): two bool masks give their AND; otherwise the sum of the additive
    forms (bool False -> -inf) in dtype, -inf where either is -inf or the
    sum overflows.  The result has the broadcast shape of the two."""
    if a is None or b is None:
        return b if a is None else a
    _require_mask(a, a_name, "True = may attend")
    _require_mask(b, b_name, "True = may attend")
    try:
        if a.dtype == np.bool_ and b.dtype == np.bool_:
            anded: NDArray[np.bool_] = np.logical_and(a, b)
            return anded
        return _sum(_additive(a, dtype, a_name), _additive(b, dtype, b_name))
    except ValueError:
        raise ValueError(f"{a_name} of shape {C.shape_str(a.shape)} and {b_name} of shape "
                         f"{C.shape_str(b.shape)} do not broadcast") from None


def keys_seen(mask: object, key_shape: tuple[int, ...], query_heads: int
              ) -> Optional[NDArray[np.bool_]]:
    """Which keys of a call some query may see through its attn_mask (bool
    True = may attend; floating: not -inf), as a bool array of key's shape
    without its last axis (broadcast where the mask is), for the int8
    mode's key mean; None when there is no mask, or one whose shape or
    dtype the call's checks will refuse."""
    if type(mask) is not np.ndarray or len(key_shape) < 2:
        return None
    if mask.dtype != np.bool_ and not C.is_floating(mask.dtype):
        return None
    if mask.ndim < 2 or mask.shape[-1] not in (1, key_shape[-2]):
        return None
    seen: NDArray[np.bool_] = np.any(mask if mask.dtype == np.bool_ else mask > -np.inf, axis=-2)
    hkv = key_shape[-3] if len(key_shape) >= 3 else 1
    lead = len(key_shape) - 1  # key's axes but the last: (..., Hkv, S)
    if seen.ndim > lead:
        return None
    seen = seen.reshape((1,) * (lead - seen.ndim) + seen.shape)
    if lead >= 2 and seen.shape[-2] == query_heads != hkv and query_heads % max(hkv, 1) == 0:
        seen = np.any(seen.reshape(seen.shape[:-2] + (hkv, query_heads // hkv, seen.shape[-1])),
                      axis=-2)
    for axis in range(lead):  # axes the key broadcasts over: a key seen in any
        if key_shape[axis] == 1 and seen.shape[axis] > 1:
            seen = np.any(seen, axis=axis, keepdims=True)
    try:
        return np.broadcast_to(seen, key_shape[:-1])
    except ValueError:
        return None
