"""The building blocks of attention as public functions: the blocked matrix
product, the guarded softmax and the head layout."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from . import _checks as C
from . import _core, _runtime
from ._typing import Float, MaskArray, NDArray, Scalar


def matmul(a: NDArray[Float], b: NDArray[Float], *, out: Optional[NDArray[Float]] = None,
           num_threads: Optional[int] = None) -> NDArray[Float]:
    """Batched matrix product ``a @ b`` with fastattn's blocked kernel.

    Parameters
    ----------
    a : ndarray, shape (..., M, K), float32 or float64
    b : ndarray, shape (..., K, N), same dtype
        Leading axes broadcast by NumPy's rules.  Any strides: transposed
        views, negative strides and stride-0 broadcasts are read in place.
    out : ndarray or None, shape (..., M, N)
        Written through its strides; must not overlap a or b.
    num_threads : int or None

    Returns
    -------
    ndarray, shape (..., M, N), the inputs' dtype.  K = 0 gives zeros.

    Raises
    ------
    TypeError
        Non-arrays, or dtypes other than one of float32 and float64.
    ValueError
        Fewer than 2 dimensions, mismatched inner sizes, batch axes that do
        not broadcast, broadcast shapes with more elements than a 64-bit
        index addresses, or a bad out.

    Notes
    -----
    Unlike numpy.matmul, 1-D operands are not promoted.

    Packing and loop order follow Goto & van de Geijn, "Anatomy of
    high-performance matrix multiplication" (ACM TOMS 2008).
    """
    C.require_array(a, "a")
    C.require_array(b, "b")
    C.require_ndim(a, "a", 2, "(..., M, K)")
    C.require_ndim(b, "b", 2, "(..., K, N)")
    dtype = C.common_float_dtype(a=a, b=b)
    (M, K), (Kb, N) = a.shape[-2:], b.shape[-2:]
    if K != Kb:
        raise ValueError(f"inner sizes differ: a {C.shape_str(a.shape)} is (..., M, K) with "
                         f"K = {K}, b {C.shape_str(b.shape)} is (..., K, N) with K = {Kb}")
    batch = C.broadcast_shapes([("a", a.shape[:-2]), ("b", b.shape[:-2])], "the batch axes")
    if math.prod(batch) * (M or 1) * (K or 1) * (N or 1) > C.max_elements(dtype):
        C.require_addressable([("a broadcast to", batch + (M, K)),
                               ("b broadcast to", batch + (K, N)),
                               ("the output", batch + (M, N))], dtype.itemsize)
    nthreads = _runtime.resolve_threads(num_threads)
    if out is None:
        out = np.empty(batch + (M, N), dtype)
    else:
        C.check_out(out, batch + (M, N), dtype, {"a": a, "b": b})
    av = C.broadcast_view(C.kernel_view(a), batch + (M, K))
    bv = C.broadcast_view(C.kernel_view(b), batch + (K, N))
    _core.matmul(_runtime.isa(), av, bv, out, nthreads)
    return out


def softmax(x: NDArray[Float], axis: int = -1, *, mask: Optional[MaskArray] = None,
            out: Optional[NDArray[Float]] = None,
            num_threads: Optional[int] = None) -> NDArray[Float]:
    """Softmax along one axis with the maximum subtracted first.

    Parameters
    ----------
    x : ndarray, float32 or float64
    axis : int
    mask : ndarray or None, broadcastable to x.shape
        bool: True = keep the entry (PyTorch SDPA's convention); floating:
        added to x, -inf hides the entry.
    out : ndarray or None, x's shape and dtype
        May be x itself (in place); must not partly overlap x or mask.
    num_threads : int or None

    Returns
    -------
    ndarray, x's shape and dtype.  Entries of x equal to -inf and masked-out
    entries get weight 0; a row with no visible entry gives zeros (not the
    NaN of 0/0); a NaN in a visible entry gives a NaN row; +inf gives NaN
    (inf - inf), as in the IEEE arithmetic of the textbook formula.

    Raises
    ------
    TypeError
        A non-array, a dtype other than float32/float64, or a mask neither
        bool nor floating.
    ValueError
        A bad axis (numpy.exceptions.AxisError, a ValueError), mask shape
        or out.
    """
    C.require_array(x, "x")
    dtype = C.common_float_dtype(x=x)
    if isinstance(axis, (bool, np.bool_)) or not hasattr(axis, "__index__"):
        raise TypeError(f"axis must be an int, got {type(axis).__name__}")
    axis = int(axis)
    if not -x.ndim <= axis < x.ndim:
        raise np.exceptions.AxisError(axis, x.ndim)
    axis %= x.ndim
    kind, m = C.mask_kind_and_array(mask, dtype, "mask")
    if m is not None:
        try:
            m = np.broadcast_to(m, x.shape)
        except ValueError:
            raise ValueError(f"mask of shape {C.shape_str(m.shape)} cannot be broadcast "
                             f"to x's shape {C.shape_str(x.shape)}") from None
    nthreads = _runtime.resolve_threads(num_threads)
    if out is None:
        out = np.empty(x.shape, dtype)
    elif out is x:
        C.check_out(out, x.shape, dtype, {"mask": mask})
    else:
        C.check_out(out, x.shape, dtype, {"x": x, "mask": mask})
    xv = np.moveaxis(C.kernel_view(x), axis, -1)
    mv = None if m is None else np.moveaxis(m, axis, -1)
    _core.softmax_rows(_runtime.isa(), xv, mv, kind, np.moveaxis(out, axis, -1), nthreads)
    return out


def split_heads(x: NDArray[Scalar], num_heads: int) -> NDArray[Scalar]:
    """View (..., L, H*D) as (..., H, L, D): head h is features h*D..(h+1)*D-1.

    No copy: the result shares x's memory, so writing into it (for example
    as the ``out`` of scaled_dot_product_attention) fills the merged
    (..., L, H*D) layout directly.  Any dtype.

    Raises
    ------
    TypeError
        A non-array, or a num_heads that is not an int.
    ValueError
        Fewer than 2 dimensions, a feature size not divisible by num_heads,
        or a num_heads so large that the view would have more elements than
        a 64-bit index addresses (x with 0 features).
    """
    C.require_array(x, "x")
    C.require_ndim(x, "x", 2, "(..., L, H*D)")
    num_heads = C.check_index(num_heads, "num_heads", 1)
    if x.shape[-1] % num_heads:
        raise ValueError(f"the last axis of x ({x.shape[-1]}) is not divisible by "
                         f"num_heads ({num_heads})")
    shape = x.shape[:-1] + (num_heads, x.shape[-1] // num_heads)
    C.require_addressable([("the heads of x", shape)], x.itemsize)  # any num_heads divides 0
    heads = x.reshape(shape)
    return np.swapaxes(heads, -3, -2)


def merge_heads(x: NDArray[Float], *, num_threads: Optional[int] = None) -> NDArray[Float]:
    """(..., H, L, D) -> (..., L, H*D), heads side by side (the concat of
    multi-head attention, Vaswani et al. 2017, sec. 3.2.2).

    Returns a new C-contiguous array of x's dtype (float32 or float64),
    copied by a parallel typed-memoryview loop.  To avoid the copy, let
    attention write into ``split_heads(buffer, H)`` instead.

    Raises
    ------
    TypeError
        A non-array, or a dtype other than float32/float64.
    ValueError
        Fewer than 3 dimensions.
    """
    C.require_array(x, "x")
    C.require_ndim(x, "x", 3, "(..., H, L, D)")
    dtype = C.common_float_dtype(x=x)
    nthreads = _runtime.resolve_threads(num_threads)
    *lead, H, L, D = x.shape
    out = np.empty(tuple(lead) + (L, H * D), dtype)
    if out.size:
        x4 = C.kernel_view(x).reshape((-1, H, L, D))
        _core.merge_heads(x4, out.reshape((-1, L, H * D)), nthreads)
    return out
