"""scaled_dot_product_attention: the functional attention API."""
from __future__ import annotations

from typing import Any, Literal, Optional, Sequence, Union, overload

import numpy as np

from . import _checks as C
from . import _core, _runtime
from ._dispatch import StoredKV, route
from ._masks import keys_seen
from ._storage import int8_mode_operands, narrow
from ._typing import Alignment, Float, MaskArray, NDArray, Result


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: Literal[False] = False,
        return_lse: Literal[False] = False,
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> NDArray[Float]: ...


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: Literal[True],
        return_lse: Literal[False] = False,
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> tuple[NDArray[Float], NDArray[Float]]: ...


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: Literal[False] = False,
        return_lse: Literal[True],
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> tuple[NDArray[Float], NDArray[Float]]: ...


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: Literal[True],
        return_lse: Literal[True],
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> tuple[NDArray[Float], NDArray[Float], NDArray[Float]]: ...


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: bool,
        return_lse: Literal[False] = False,
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact"
) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]: ...


@overload
def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: bool,
        return_lse: bool,
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> Result[Float]: ...


def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: bool = False,
        return_lse: bool = False, window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None, precision: str = "exact") -> Result[Float]:
    """Scaled dot-product attention, ``softmax(query @ key^T * scale + mask) @ value``.

    The arguments up to ``enable_gqa`` have the names, order and meaning of
    ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch 2.5+);
    the keyword-only ones are fastattn's additions.  The maths is that of
    Vaswani et al. 2017, "Attention Is All You Need", eq. (1); it is computed
    block by block with an online softmax (FlashAttention, Dao et al. 2022),
    so the L x S matrix is never held in memory unless the weights are asked
    for.

    Parameters
    ----------
    query : ndarray, shape (..., Hq, L, E)
        float32, float64, float16 or bfloat16 (``ml_dtypes.bfloat16``).  The
        16-bit dtypes are computed in float32 (read a tile at a time, never
        copied whole), and the output and weights rounded once to them, to
        nearest-even: the bits of the call on the float32 conversions of the
        inputs, rounded.  Any strides, including negative ones and the
        (B, L, H, E) layout seen through a transposed view.
    key : ndarray, shape (..., Hkv, S, E)
    value : ndarray, shape (..., Hkv, S, Ev)
        Same dtype as query.  The leading axes of query, key and value
        broadcast by NumPy's rules; L != S and E != Ev are allowed.
    attn_mask : ndarray or None, broadcastable to (..., Hq, L, S)
        bool: True = the query may attend to the key (PyTorch's SDPA
        convention; the opposite of nn.MultiheadAttention's masks).
        floating: added to the scaled scores; -inf hides the key whatever
        its score is.  Converted to query's dtype (float32 for the 16-bit
        dtypes); read through strides, never expanded to full size.
    dropout_p : float
        Must be 0: fastattn has no dropout.
    is_causal : bool
        Hide later keys: with ``causal_alignment="upper_left"`` (PyTorch's
        ``is_causal``) query i sees keys 0..i; with ``"lower_right"`` query
        i sees keys 0..i+S-L, the alignment of a key/value cache where the
        L queries are the last L of the S positions (PyTorch's
        ``torch.nn.attention.bias.causal_lower_right``).  No mask is built.
        Unlike PyTorch, ``is_causal`` may be combined with ``attn_mask``: a
        key is visible only when both allow it.
    scale : float or None
        Multiplies query @ key^T.  None means 1/sqrt(E) (1 when E is 0, where
        every score is 0); an explicit value, 0 included, is used as given.
    enable_gqa : bool
        Grouped-query attention (Ainslie et al. 2023): query head h uses
        key/value head h // (Hq // Hkv).  Hq must be a multiple of Hkv.
        Without it, the head axes broadcast like the other leading axes.
    causal_alignment : {"upper_left", "lower_right"} or int
        Where query i sits among the keys: i' = i (upper-left) or i + S - L
        (lower-right), for is_causal, window_size and alibi_slopes alike.
        An int k (fastattn's extension) puts it at i' = i + k: for keys that
        are a slice of a longer sequence starting at position s0, and
        queries starting at position q0, k = q0 - s0, so that each slice's
        call, merged with ``merge_attention``, gives the whole sequence's
        attention (what ``fastattn.distributed`` does).  ``abs(k) < 2**53``.
    need_weights : bool
        Also return the attention weights, shape (..., Hq, L, S).
    return_lse : bool
        Also return each row's log-sum-exp of its logits (the sink
        included), shape (..., Hq, L), query's dtype, float32 for the 16-bit
        dtypes (as FlashAttention's ``softmax_lse``, which it is).  A row
        with no visible key has the sink's logit with sinks (its softmax
        holds the sink alone, as in FlashAttention 4's reference), -inf
        without.  With it, attention
        over disjoint key sets combines exactly: ``merge_attention``.
    window_size : (left, right) or None
        Sliding window (Mistral, Gemma; FlashAttention's ``window_size``):
        query i sees key j only when i' - left <= j <= i' + right; -1 (any negative
        value, as in FlashAttention) is unbounded on that side.  Combines with is_causal (which sets right
        to 0) and masks.  Key blocks outside every window of a block of
        queries are never read: the cost is O(L x window).
    alibi_slopes : ndarray or None, shape (Hq,) or (B, Hq)
        ALiBi (Press et al. 2022; BLOOM, MPT): adds ``-slope * |i' - j|`` to the
        scaled score of head h (FlashAttention's convention; with is_causal
        it equals slope * (j - i')).  Any real dtype, read as float64.
    softcap : float >= 0 or None
        Soft-capping (Gemma 2): scores become softcap * tanh(score /
        softcap) after scaling and before the mask and ALiBi are added.
    sinks : ndarray or None, shape (Hq,) or (B, Hq)
        Attention sinks (gpt-oss; ONNX Runtime's ``head_sink``): one logit
        per head that joins every row's softmax denominator and contributes
        no value, so a row's weights sum to less than 1.  Real or -inf (no
        sink); NaN and +inf are refused.  A row whose keys are all hidden
        still gives zeros (its lse is the sink's logit).
    out : ndarray or None, shape (..., Hq, L, Ev)
        Write the result here, through its strides; for example
        ``split_heads(merged, H)`` writes straight into a (B, L, H*Ev) buffer.
        It must not overlap the inputs.
    num_threads : int or None
        Threads for this call; None uses ``get_num_threads()``.  The result
        is bitwise identical whatever the thread count.
    precision : {"exact", "int8"}
        How the products are computed (the name of JAX's ``precision``
        argument and of PyTorch's ``set_float32_matmul_precision``).
        "exact" (the default): float32 (float64 for float64 inputs)
        throughout.  "int8" (opt-in; float32, float16 and bfloat16
        inputs): SageAttention's 8-bit attention (Zhang et al., ICLR 2025;
        its second version's 8-bit P V): the keys less their mean over the
        positions (smooth_k), then keys, values and each query row rounded
        to int8 with a scale per row, the scores summed as integer
        products, and the weights of each 64 key positions of a query
        row, times their values' scales, rounded to 7 bits and summed
        with the value codes as integers.  The output differs from the
        exact one by that rounding (README, "The int8 mode", gives the
        measured error; about 1e-2 relative RMS on random data); still
        bitwise the same for any thread count, layout and batch.  A
        non-finite key or value row gives NaN where it is seen.  Float64
        inputs stay exact; the mode has no backward pass.

    Returns
    -------
    out : ndarray, shape (..., Hq, L, Ev), query's dtype
        A query row with no visible key gives a zero row (and zero weights),
        never NaN.  A NaN in a visible score gives a NaN row.  A key whose
        weight is exactly 0 never contributes its value row, so a non-finite
        value at a hidden key does not reach the output.
    weights : ndarray, shape (..., Hq, L, S)
        Only with ``need_weights=True``.
    lse : ndarray, shape (..., Hq, L)
        Only with ``return_lse=True``; last when both are asked for:
        ``(out, weights, lse)``.

    Raises
    ------
    TypeError
        An argument that is not an ndarray (or is a numpy.ma.MaskedArray,
        whose mask would be ignored); dtypes other than float32, float64,
        float16 and bfloat16, non-native byte order, or dtypes that
        differ; a mask neither bool nor floating; flags that are not bools;
        an ``out`` of a dtype other than query's.
    ValueError
        Shapes that do not agree or broadcast, Hq not a multiple of Hkv,
        E or Ev above 2**20, broadcast shapes with more elements than a
        64-bit index addresses, dropout_p != 0, a bad ``out`` (wrong
        shape, read-only, misaligned, overlapping an input or itself), an
        unknown causal_alignment, num_threads outside 1 to max(1024, the CPU count),
        a negative softcap, alibi_slopes or sinks of the
        wrong shape, sinks NaN or +inf; a scale or softcap that is not
        finite in the dtype computed in (float32 or float64: 1e300 is finite
        only in float64), a scale or softcap that rounds to 0 there (a scale
        of 0 itself is taken), an alibi slope
        whose bias at distance L + S is not finite there; a precision
        other than "exact" and "int8" (TypeError when not a str).

    Notes
    -----
    The caller's arrays are never modified.
    """
    if C.check_precision(precision) != _core.PRECISION_EXACT and _int8_inputs(query, key, value):
        seen = keys_seen(attn_mask, key.shape, query.shape[-3] if query.ndim >= 3 else 1)
        k_codes, v_codes, k_scale, v_scale, mean = int8_mode_operands(
            key, value, _runtime.resolve_threads(num_threads), seen)
        return route(query, k_codes, v_codes, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment, need_weights, return_lse, window_size, alibi_slopes,
                      softcap, sinks, out, num_threads,
                      StoredKV(_core.STORE_I8, k_scale, v_scale, None, _core.PRECISION_INT8, mean))
    return route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                  causal_alignment, need_weights, return_lse, window_size, alibi_slopes, softcap,
                  sinks, out, num_threads)


def _int8_inputs(query: object, key: object, value: object) -> bool:
    """Whether the int8 mode takes these operands: arrays of one dtype that
    the float32 kernels compute in (other operands go on to the call's own
    checks, which refuse them or keep the exact products, for float64)."""
    arrays = [x for x in (query, key, value)
              if isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray) and x.ndim >= 2]
    if len(arrays) < 3:
        return False
    dtype = arrays[0].dtype
    return (all(x.dtype == dtype for x in arrays)
            and (dtype in (np.float32, np.float16) or dtype.name == "bfloat16"))


def merge_attention(outputs: Sequence[NDArray[Float]], lses: Sequence[NDArray[Float]]
                    ) -> tuple[NDArray[Float], NDArray[Float]]:
    """Attention over the union of disjoint key sets from the attention over
    each set, exactly: the split-key merge of FlashAttention-2's decoding
    (and of fastattn's own), for keys sharded across calls, processes or
    machines.

    Parameters
    ----------
    outputs : list of ndarrays, each of shape (..., L, Ev)
        The outputs of ``scaled_dot_product_attention(..., return_lse=True)``
        over each key set, the same queries and options: float32, float64,
        float16 or bfloat16, all of one dtype.
    lses : list of ndarrays, each of shape (..., L)
        Their log-sum-exps, in the dtype the outputs were computed in (as
        ``return_lse`` gives them): float32 for float32 and 16-bit outputs,
        float64 for float64 ones.  The merge is computed in that dtype and
        the output rounded once to the outputs' dtype.

    Returns
    -------
    out : ndarray, shape (..., L, Ev)
        sum_p exp(lse_p - lse) * out_p: the attention over all the keys.
    lse : ndarray, shape (..., L)
        log sum_p exp(lse_p); for a row that saw no key in any part (its
        output is zeros), the sink's logit where a part had sinks, else
        -inf; +inf where a part's is (a sink of +inf: the
        output is that part's).  A NaN in a part gives NaN.

    With sinks, give them to one part only: each part's lse counts them.

    Raises
    ------
    TypeError
        Not lists of ndarrays, or dtypes other than those above.
    ValueError
        Empty lists, lists of different lengths, or shapes that differ.
    """
    if not isinstance(outputs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError("outputs and lses must be lists (or tuples) of arrays")
    if len(outputs) != len(lses) or not outputs:
        raise ValueError(f"outputs and lses must be non-empty and of one length, got "
                         f"{len(outputs)} and {len(lses)}")
    outs = [C.require_array(o, f"outputs[{i}]") for i, o in enumerate(outputs)]
    ls = [C.require_array(s, f"lses[{i}]") for i, s in enumerate(lses)]
    dtype = C.attention_dtype(**{f"outputs[{i}]": o for i, o in enumerate(outs)})
    compute = C.compute_dtype(dtype)
    lse_dtype = C.common_float_dtype(**{f"lses[{i}]": s for i, s in enumerate(ls)})
    if lse_dtype != compute:
        raise TypeError(f"lses have dtype {lse_dtype} and outputs {dtype}; the log-sum-exps "
                        f"of {dtype} outputs are {compute} (as return_lse gives them)")
    shape = outs[0].shape
    for i, (o, s) in enumerate(zip(outs, ls)):
        if o.ndim < 1 or o.shape != shape or s.shape != shape[:-1]:
            raise ValueError(f"outputs[{i}] has shape {C.shape_str(o.shape)} and lses[{i}] "
                             f"{C.shape_str(s.shape)}; expected {C.shape_str(shape)} and "
                             f"{C.shape_str(shape[:-1])} (the rows of every part alike)")
    lse = np.stack(ls)                                   # (P, ..., L)
    # -inf - -inf: the where below; lse - m below T's lowest (-3e38 - 3e38):
    # -inf, whose exp is the right factor, 0
    with np.errstate(invalid="ignore", over="ignore"):
        m = lse.max(axis=0)                              # NaN when a part's row is NaN
        # 0 for an empty part; 1 for a part at the maximum, +inf included
        # (a sink of +inf: inf - inf would be NaN)
        factor = np.exp(np.where((lse == m) & (m != -np.inf), 0,
                                 lse - np.where(m == -np.inf, 0, m)))
        total = factor.sum(axis=0)

        # part by part in the outputs' own layout (no stacked copy), summed
        # from 0 in order, as NumPy sums over a stack's first axis
        out = np.zeros_like(outs[0], dtype=compute, subok=False)
        for f, o in zip(factor, outs):
            term = np.multiply(f[..., None], o, dtype=compute)
            if not f.all():  # an empty part: 0, even where its output is not finite
                np.copyto(term, 0, where=(f == 0)[..., None])
            out += term
        out /= np.where(total == 0, 1, total)[..., None]
        merged = np.where(total == 0, -np.inf, m + np.log(np.where(total == 0, 1, total)))
    merged = merged.astype(compute, copy=False)
    if compute != dtype:  # rounded once, as the attention's own 16-bit outputs
        return narrow(out.astype(compute), dtype, _runtime.resolve_threads(None)), merged
    return out.astype(dtype, copy=False), merged

