"""rotary: rotary position embedding of packed tokens at their positions."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from . import _checks as C
from . import _core, _runtime
from ._typing import Float, NDArray


def tables(cos: object, sin: object, D: int) -> tuple[NDArray[Any], NDArray[Any]]:
    """cos and sin (max_pos, rotary_dim / 2), checked."""
    out = []
    for name, t in (("cos", cos), ("sin", sin)):
        a = C.require_array(t, name)
        if not C.is_floating(a.dtype):
            raise TypeError(f"{name} has dtype {a.dtype}; expected a floating dtype")
        if a.ndim != 2 or 2 * a.shape[1] > D:
            raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected (max_pos, "
                             f"rotary_dim / 2) with rotary_dim <= the head size {D}")
        out.append(a)
    if out[0].shape != out[1].shape:
        raise ValueError(f"cos {C.shape_str(out[0].shape)} and sin {C.shape_str(out[1].shape)} "
                         "must have one shape")
    return out[0], out[1]


def positions_of(positions: object, n: int, max_pos: int) -> NDArray[np.int64]:
    p = C.require_array(positions, "positions", "np.int64")
    if p.dtype.kind not in "iu":
        raise TypeError(f"positions has dtype {p.dtype}; expected an integer dtype")
    if p.shape != (n,):
        raise ValueError(f"positions has shape {C.shape_str(p.shape)}; expected one per token, "
                         f"({n},)")
    bad = np.flatnonzero((p < 0) | (p >= max_pos))  # in p's own dtype: uint64 too
    if bad.size:
        raise ValueError(f"positions[{bad[0]}] = {p[bad[0]]} is outside the tables' 0 to "
                         f"max_pos - 1 = {max_pos - 1}")
    return C.contiguous(p, np.int64)


def rotary(x: NDArray[Float], positions: NDArray[np.integer[Any]], cos: NDArray[Any],
           sin: NDArray[Any], *, interleaved: bool = False,
           num_threads: Optional[int] = None) -> NDArray[Float]:
    """Rotary position embedding (RoPE; Su et al. 2021, "RoFormer") of packed
    tokens, each at its own position: FlashAttention's ``apply_rotary_emb``
    with its ``rotary_cos`` / ``rotary_sin`` tables.

    Feature pairs (a, b) of each head are rotated by the angle of their
    pair index i at the token's position p::

        y_a = x_a cos[p, i] - x_b sin[p, i]
        y_b = x_b cos[p, i] + x_a sin[p, i]

    with (a, b) = (i, i + rotary_dim / 2) (GPT-NeoX's half split, the
    default, as Llama in Hugging Face transformers) or (2i, 2i + 1) with
    ``interleaved=True`` (GPT-J's).  Features from rotary_dim on are copied
    (a partial rotary embedding, as GPT-NeoX's rotary_pct).  Each output is
    two products and a sum, each rounded: the bits of the formula in NumPy.

    Parameters
    ----------
    x : ndarray, shape (n, H, D), float32 or float64
        Packed tokens (queries or keys of several sequences), any strides.
    positions : ndarray of int, shape (n,)
        Each token's position, 0 to max_pos - 1.
    cos, sin : ndarray, shape (max_pos, rotary_dim / 2)
        The tables, rotary_dim <= D; any real dtype, rounded to x's.
    interleaved : bool
    num_threads : int or None

    Returns
    -------
    ndarray, shape (n, H, D), x's dtype: a new array.

    Raises
    ------
    TypeError
        Non-arrays, an x neither float32 nor float64, integer tables, or
        positions that are not integers.
    ValueError
        Shapes that do not agree, rotary_dim > D, or a position outside
        the tables.
    """
    x = C.require_array(x, "x")
    if x.dtype not in C.FLOAT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; expected float32 or float64"
                        f"{C.unsupported_float_hint(x.dtype, 'x')}")
    if x.ndim != 3:
        raise ValueError(f"x has shape {C.shape_str(x.shape)}; expected (n, H, D)")
    return rotate(x, positions, cos, sin, C.check_bool(interleaved, "interleaved"),
                  _runtime.resolve_threads(num_threads))


def rotate(x: NDArray[Float], positions: object, cos: object, sin: object, interleaved: bool,
           nthreads: int) -> NDArray[Float]:
    """rotary's work on an x (n, H, D) of float32 or float64: the tables and
    positions checked, then the rows rotated on the threads into a new array."""
    if x.dtype not in C.FLOAT_DTYPES:  # the loop reads float32 or float64 only
        raise TypeError(f"rotary takes float32 or float64 rows, got {x.dtype}")
    c, s = tables(cos, sin, x.shape[2])
    p = positions_of(positions, x.shape[0], c.shape[0])
    # only the rows of these positions, in x's dtype: a table of 128k
    # positions in float64 is not converted whole on every call
    rows = [C.contiguous(t[p], x.dtype) for t in (c, s)]
    out = np.empty(x.shape, x.dtype)
    _core.rotary(C.kernel_view(x), np.arange(x.shape[0], dtype=np.int64), rows[0], rows[1],
                 interleaved, out, nthreads)
    return out
