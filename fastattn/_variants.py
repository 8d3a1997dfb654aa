"""Checks of the attention variants (sliding window, ALiBi, soft-cap, sinks)
shared by scaled_dot_product_attention, varlen_attention and KVCache.attend:
each returns what the kernels take (csrc/fa_kern_scores.h)."""
from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import _checks as C
from ._typing import NDArray


class Variants(NamedTuple):
    window_left: int           # -1: unbounded
    window_right: int
    softcap: float             # 0: none
    slopes: Optional[NDArray[np.float64]]  # ALiBi slope per item, the batch shape (..., Hq)
    sinks: Optional[NDArray[np.float64]]   # sink logit per item, the batch shape


NONE = Variants(-1, -1, 0.0, None, None)  # no variant: what the kernels take by default


def window(window_size: object, L: int, S: int, offset: int = 0) -> tuple[int, int]:
    """(left, right) as the kernels take them: each >= -1, and -1 for a side
    that hides nothing at these lengths and this alignment offset (so the
    kernels' arithmetic stays far from overflow)."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or
            not all(isinstance(w, numbers.Integral) and not isinstance(w, (bool, np.bool_))
                    for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    left, right = int(window_size[0]), int(window_size[1])
    # any negative side is unbounded, as in FlashAttention
    reach = L + S + abs(offset)  # no |i' - j| is larger
    return (-1 if left < 0 or left >= reach else left), (-1 if right < 0 or right >= reach else right)


def per_head(x: object, name: str, batch: C.Shape, finite: bool) -> NDArray[np.float64]:
    """One float64 value per head: x of shape (Hq,) or (B, Hq), seen with the
    batch shape (..., Hq) of the call (B its first axis)."""
    a = np.asarray(C.require_array(x, name))
    if (a.dtype.kind not in "fiu" or a.dtype == np.bool_) and not C.is_half(a.dtype):
        raise TypeError(f"{name} has dtype {a.dtype}; expected a real dtype")
    Hq = batch[-1] if batch else 1
    if a.shape == (Hq,) or (len(batch) >= 2 and a.shape == (batch[0], Hq)):
        # C-contiguous: a group's heads one element apart, whatever the
        # caller's layout, so that they fold alike (the kernels' heads)
        values = np.ascontiguousarray(a, np.float64)
    else:
        expected = (f"({Hq},) or ({batch[0]}, {Hq}) (Hq, or batch and Hq) for a call of "
                    f"batch shape {C.shape_str(batch)}" if len(batch) >= 2 else
                    f"({Hq},), one per query head")
        raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected {expected}")
    bad = ~np.isfinite(values) if finite else (np.isnan(values) | (values == np.inf))
    if bad.any():
        raise ValueError(f"{name} must be {'finite' if finite else 'real or -inf'}, "
                         f"got {values[bad][0]}")
    if values.ndim == 2:  # (B, Hq): B the first batch axis
        values = values.reshape((batch[0],) + (1,) * (len(batch) - 2) + (Hq,))
    return np.broadcast_to(values, batch)


def check(window_size: Optional[Sequence[int]], alibi_slopes: Optional[NDArray[Any]],
          softcap: Optional[float], sinks: Optional[NDArray[Any]], batch: C.Shape, L: int,
          S: int, compute: np.dtype[Any], offset: int = 0) -> Variants:
    """The variants as the kernels take them, in compute, the dtype they
    compute in (float32 or float64): the softcap finite and not 0 there, and
    each ALiBi bias, up to slope x (L + S + |offset|), finite there (offset:
    the causal alignment's, query i at key position i + offset).  (Sinks beyond
    float32's range round to +-inf, the limits they stand for.)"""
    if window_size is None and alibi_slopes is None and softcap is None and sinks is None:
        return NONE  # the common call: nothing to check or convert
    left, right = (-1, -1) if window_size is None else window(window_size, L, S, offset)
    cap = 0.0
    if softcap is not None:
        cap = C.check_real(softcap, "softcap")
        if cap < 0:
            raise ValueError(f"softcap must be > 0 (None or 0.0: no soft-cap), got {cap}")
        C.check_finite_in(cap, "softcap", compute)
        if cap > 0 and compute.type(cap) == 0:  # x / 0 is NaN at a score of 0
            raise ValueError(f"softcap must be > 0 in {compute.name}, the dtype computed in; "
                             f"got {cap}")
    slopes = None if alibi_slopes is None else per_head(alibi_slopes, "alibi_slopes", batch, True)
    if slopes is not None:  # a bias of +inf gives NaN rows, -inf hides keys the reference sees
        C.check_finite_in(slopes, "alibi_slopes", compute, times=float(L + S + abs(offset)))
    sink = None if sinks is None else per_head(sinks, "sinks", batch, False)
    if slopes is not None and not slopes.any():
        slopes = None  # all zero: no bias
    return Variants(left, right, cap, slopes, sink)

