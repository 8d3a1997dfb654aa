"""scaled_dot_product_attention: the functional attention API."""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal, NamedTuple, Optional, Sequence, Union, overload

import numpy as np

from . import _checks as C
from . import _core, _runtime, _tuning, _variants
from ._storage import narrow, query_store
from ._typing import Float, MaskArray, NDArray

# where query i sits among the keys: a name, or the offset k of i' = i + k
Alignment = Union[Literal["upper_left", "lower_right"], int]
# the output; with the weights and/or the log-sum-exp when asked for
Result = Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]],
               tuple[NDArray[Float], NDArray[Float], NDArray[Float]]]

_MAX_FEATURES = _core.ATTN_MAX_FEATURES  # the kernels' bound on E and Ev (csrc/fastattn.h)
# the short route's dtypes: their element bound, and the largest scale they hold
_COMMON_DTYPES = {dt: (C.max_elements(dt), largest) for dt, largest in C.LARGEST.items()}
_BOOL = np.dtype(np.bool_)


def _padding_mask_hint(mask_shape: C.Shape, target: C.Shape) -> str:
    """For a (B, S) or (B, 1, S) mask that fails to broadcast to target
    (B, ..., L, S): the index that makes it a key padding mask, which is
    likely what was meant ('' for other shapes)."""
    n = len(mask_shape)
    if (not 2 <= n < len(target) or (mask_shape[0], mask_shape[-1]) != (target[0], target[-1])
            or any(d != 1 for d in mask_shape[1:-1])):
        return ""
    # the missing axes go after B, where a head axis of 1 broadcasts
    new_axes = len(target) - n
    if n == 2:
        index = "[:, " + "None, " * new_axes + ":]"
    else:
        index = "[:, " + ", ".join(["None"] * new_axes) + "]"
    shape = C.shape_str((target[0],) + (1,) * (len(target) - 2) + (target[-1],))
    seen = "(B, " + "1, " * (n - 2) + "S)"
    return (f"; for a {seen} key padding mask (True = may attend) pass attn_mask{index}, "
            f"of shape {shape}")


def _common_call(query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
                 attn_mask: Optional[MaskArray], dropout_p: object, is_causal: object,
                 scale: object, enable_gqa: object, causal_alignment: object,
                 out: Optional[NDArray[Float]], num_threads: Optional[int],
                 stored: Optional[StoredKV] = None) -> Optional[NDArray[Float]]:
    """scaled_dot_product_attention for the common call, or None for a call
    to leave to the general path.  A tiny call is mostly its checks: these
    take a fraction of the general path's time (plain type, identity and
    tuple tests, no message built).  The caller has seen plain ndarrays (out
    one or None) and the variants, need_weights and return_lse at their
    defaults (the kernel's defaults are those of _variants.NONE, and the
    native storage of float32 and float64).  Grouped-query calls and an out
    array are taken too: a model's decoding step makes both, once per layer
    and token.  So are a float32 KVCache's keys and values in another
    storage (stored, as _attention takes it), whose shapes the cache has
    checked: a decoding step over an int8 cache took 17 us, 7.5 over a
    float32 one (one head, 16 positions, Zen 4).

    It takes only calls that the general path accepts, and passes the kernel
    what the general path passes, so the result is bitwise the same.  It
    raises only where the general path raises the same error:
    resolve_threads is called once every check the general path makes
    before it has passed here.  Anything else is None, and the general path
    gives the error."""
    dtype = query.dtype
    bounds = _COMMON_DTYPES.get(dtype)
    if stored is None:
        if bounds is None or key.dtype != dtype or value.dtype != dtype:
            return None
    elif bounds is None or dtype != np.float32:  # 16-bit: rounded at the end (_attention)
        return None
    limit, largest = bounds
    qs, ks, vs = query.shape, key.shape, value.shape
    if len(qs) < 2 or len(ks) != len(qs) or len(vs) != len(qs):
        return None
    batch = qs[:-2]  # the same leading axes: no broadcast
    L, E, S = qs[-2], qs[-1], ks[-2]
    Ev = vs[-1] if stored is None or stored.value_dim is None else stored.value_dim
    packed = stored is not None and stored.store == _core.STORE_Q4  # rows of bytes
    group = 1
    if enable_gqa is True:  # the same axes before the heads; Hkv divides Hq
        if len(qs) < 3 or qs[:-3] != ks[:-3] or ks[:-2] != vs[:-2]:
            return None
        hq, hkv = qs[-3], ks[-3]
        if hkv == 0 or hq % hkv:
            return None
        group = hq // hkv
    elif enable_gqa is not False or batch != ks[:-2] or batch != vs[:-2]:
        return None
    if (ks[-1] != E and not packed) or vs[-2] != S or E > _MAX_FEATURES or Ev > _MAX_FEATURES:
        return None
    if (type(dropout_p) is not float and type(dropout_p) is not int) or dropout_p != 0:
        return None
    if (is_causal is not False and is_causal is not True) or type(causal_alignment) is not str:
        return None
    if causal_alignment == "upper_left":
        offset = 0
    elif causal_alignment == "lower_right":
        offset = S - L
    else:
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(E) if E > 0 else 1.0
    elif type(scale) is not float or not -largest <= scale <= largest:
        return None
    if math.prod(batch) * (L or 1) * (S or 1) * ((E if E > Ev else Ev) or 1) > limit:
        return None
    if attn_mask is None:
        kind, mask = _core.MASK_NONE, None
    else:
        if type(attn_mask) is not np.ndarray:
            return None
        if attn_mask.dtype == _BOOL:
            kind = _core.MASK_BOOL
        elif attn_mask.dtype == dtype:
            kind = _core.MASK_ADD
        else:
            return None
        try:
            mask = C.broadcast_view(C.kernel_view(attn_mask), batch + (L, S))
        except ValueError:
            return None
    if out is None:
        out = np.empty(batch + (L, Ev), dtype)
    else:  # the general path's checks; its error is left to it
        try:
            C.check_out(out, batch + (L, Ev), dtype,
                        {"query": query, "key": key, "value": value, "attn_mask": attn_mask})
        except (TypeError, ValueError):
            return None
    nthreads = _runtime.resolve_threads(num_threads)
    if out.size:
        isa, q, k, v = _runtime.isa(), C.kernel_view(query), C.kernel_view(key), C.kernel_view(value)
        # a cache's storage: _attention's call, the scales as the cache holds them
        kv_store, k_scale, v_scale = ((_core.STORE_NATIVE, None, None) if stored is None else
                                      (stored.store, stored.key_scale, stored.value_scale))
        # nbytes: at least the bytes read (broadcast axes counted once)
        tkey, nbytes = (isa, nthreads, kv_store, False), key.nbytes + value.nbytes
        # a tiny call straight to the kernel, its arguments positional: the
        # closure and a keyword cost it 0.7 us of 4.5
        if L > _tuning.DECODE_ROWS or nbytes < _tuning.MIN_BYTES:
            if stored is None:
                _core.attention(isa, q, k, v, mask, kind, out, None, group, is_causal, offset,
                                scale, nthreads, _tuning.current(tkey))
            else:
                _core.attention(isa, q, k, v, mask, kind, out, None, group, is_causal, offset,
                                scale, nthreads, _tuning.current(tkey), kv_store=kv_store,
                                k_scale=k_scale, v_scale=v_scale)
        else:
            _tuning.run(tkey, _tuning.distinct_bytes(key, value), True,
                        lambda prefetch: _core.attention(
                            isa, q, k, v, mask, kind, out, None, group, is_causal, offset, scale,
                            nthreads, prefetch, kv_store=kv_store, k_scale=k_scale,
                            v_scale=v_scale))
    return out


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
        num_threads: Optional[int] = None) -> NDArray[Float]: ...


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
        num_threads: Optional[int] = None) -> tuple[NDArray[Float], NDArray[Float]]: ...


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
        num_threads: Optional[int] = None) -> tuple[NDArray[Float], NDArray[Float]]: ...


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
        num_threads: Optional[int] = None) -> tuple[NDArray[Float], NDArray[Float], NDArray[Float]]: ...


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
        num_threads: Optional[int] = None
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
        num_threads: Optional[int] = None) -> Result[Float]: ...


def scaled_dot_product_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left", need_weights: bool = False,
        return_lse: bool = False, window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
        num_threads: Optional[int] = None) -> Result[Float]:
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
        Must be 0: fastattn computes inference-time attention.
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
        only in float64), a softcap that rounds to 0 there, an alibi slope
        whose bias at distance L + S is not finite there.

    Notes
    -----
    The caller's arrays are never modified.
    """
    return _route(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                  causal_alignment, need_weights, return_lse, window_size, alibi_slopes, softcap,
                  sinks, out, num_threads)


def _route(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
           attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
           scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
           need_weights: bool, return_lse: bool, window_size: Optional[tuple[int, int]],
           alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
           sinks: Optional[NDArray[Any]], out: Optional[NDArray[Any]],
           num_threads: Optional[int], stored: Optional[StoredKV] = None) -> Result[Any]:
    """The common call's short route (_common_call) when it takes the call,
    else the general path (_attention); the arguments are _attention's."""
    if (type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray
            and (out is None or type(out) is np.ndarray) and need_weights is False
            and return_lse is False and window_size is None and alibi_slopes is None
            and softcap is None and sinks is None):
        result = _common_call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, causal_alignment, out, num_threads, stored)
        if result is not None:
            return result
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment, need_weights, return_lse, window_size, alibi_slopes,
                      softcap, sinks, out, num_threads, stored)


class StoredKV(NamedTuple):
    """How a KVCache stores its keys and values when not in query's dtype:
    the kernels' storage kind (_core.STORE_*), for int8 and float8_e4m3fn
    the float32 scale of every row, shaped like key and value without their
    last axis, and the elements of a value row (Ev; not value's last axis
    for int4, whose rows are blocks of bytes)."""
    store: int
    key_scale: Optional[NDArray[np.float32]] = None
    value_scale: Optional[NDArray[np.float32]] = None
    value_dim: Optional[int] = None


def _attention(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
               attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
               scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
               need_weights: bool, return_lse: bool, window_size: Optional[tuple[int, int]],
               alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
               sinks: Optional[NDArray[Any]], out: Optional[NDArray[Any]],
               num_threads: Optional[int], stored: Optional[StoredKV] = None) -> Result[Any]:
    """scaled_dot_product_attention's work; with stored, key and value are a
    KVCache's buffers in that storage (query's dtype is then the only one
    checked)."""
    packed = stored is not None and stored.store == _core.STORE_Q4  # rows of bytes
    if not packed:  # (a cache checked its own)
        require_qkv(query, key, value)
    dtype = (C.attention_dtype(query=query, key=key, value=value) if stored is None
             else C.attention_dtype(query=query))
    compute = C.compute_dtype(dtype)  # float32 for the 16-bit dtypes
    L, E = query.shape[-2:]
    S = key.shape[-2]
    Ev = value.shape[-1] if stored is None or stored.value_dim is None else stored.value_dim
    if E > _MAX_FEATURES or Ev > _MAX_FEATURES:
        raise ValueError(f"query/key have E = {E} and value Ev = {Ev} features per head; "
                         f"at most {_MAX_FEATURES} are supported")
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.number)):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 (fastattn computes inference-time attention), "
                         f"got {dropout_p}")
    causal = C.check_bool(is_causal, "is_causal")
    gqa = C.check_bool(enable_gqa, "enable_gqa")
    weights_wanted = C.check_bool(need_weights, "need_weights")
    lse_wanted = C.check_bool(return_lse, "return_lse")
    offset = C.alignment_offset(causal_alignment, L, S)
    scale = C.check_scale(scale, E, compute)
    nthreads = _runtime.resolve_threads(num_threads)

    if gqa:
        for name, a in (("query", query), ("key", key), ("value", value)):
            C.require_ndim(a, name, 3, "(..., heads, length, features) with enable_gqa=True")
        Hq, Hkv = query.shape[-3], key.shape[-3]
        if value.shape[-3] != Hkv:
            raise ValueError(f"key and value must have the same number of heads, "
                             f"got {Hkv} and {value.shape[-3]}")
        if (Hkv == 0 and Hq != 0) or (Hkv != 0 and Hq % Hkv):  # no heads at all: empty
            raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv}) "
                             "for grouped-query attention")
        outer = C.broadcast_shapes([("query", query.shape[:-3]), ("key", key.shape[:-3]),
                                    ("value", value.shape[:-3])], "the batch axes")
        batch, kv_batch, group = outer + (Hq,), outer + (Hkv,), Hq // Hkv if Hkv else 1
    else:
        heads = {a.shape[-3] for a in (query, key) if a.ndim >= 3} - {1}
        hint = (" (set enable_gqa=True for grouped-query attention)"
                if len(heads) > 1 and 0 not in heads else "")  # no heads: GQA cannot help
        if (query.ndim == key.ndim == 4 and query.shape[-3] != key.shape[-3]
                and query.shape[-2] == key.shape[-2] and query.shape[0] == key.shape[0]):
            hint = hint[:-1] + ("; or, if these are (B, L, H, E) arrays, FlashAttention's "
                                "layout, pass query.transpose(0, 2, 1, 3) and key and value "
                                "likewise: the heads come before the positions here)")
        batch = C.broadcast_shapes([("query", query.shape[:-2]), ("key", key.shape[:-2]),
                                    ("value", value.shape[:-2])], "the leading axes" + hint)
        kv_batch, group = batch, 1

    # Broadcast views (stride 0) can describe more elements than an index
    # reaches.  One product bounds every array of the call (the scores too,
    # which bound its work); only past it is each one checked, to name it.
    bound = math.prod(batch) * (L or 1) * (S or 1) * ((E if E > Ev else Ev) or 1)
    if bound > C.max_elements(dtype):
        C.require_addressable([("query broadcast to", batch + (L, E)),
                               ("key broadcast to", kv_batch + (S, E)),
                               ("value broadcast to", kv_batch + (S, Ev)),
                               ("the output", batch + (L, Ev)),
                               ("the attention scores (..., Hq, L, S)", batch + (L, S))],
                              dtype.itemsize)
    kind, mask = C.mask_kind_and_array(attn_mask, compute, "attn_mask")
    if mask is not None:
        target = batch + (L, S)
        try:
            mask = C.broadcast_view(mask, target)
        except ValueError:
            raise ValueError(f"attn_mask of shape {C.shape_str(mask.shape)} cannot be "
                             f"broadcast to (..., Hq, L, S) = {C.shape_str(target)}"
                             f"{_padding_mask_hint(mask.shape, target)}") from None

    variants = _variants.check(window_size, alibi_slopes, softcap, sinks, batch, L, S, compute,
                               offset)

    out_shape = batch + (L, Ev)
    inputs = {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
              "alibi_slopes": alibi_slopes, "sinks": sinks}
    if out is not None:
        C.check_out(out, out_shape, dtype, inputs)
    # the kernels write float32 for 16-bit inputs, rounded to them at the end
    result = out if out is not None and compute == dtype else np.empty(out_shape, compute)
    try:
        weights = np.empty(batch + (L, S), compute) if weights_wanted else None
    except MemoryError:
        raise MemoryError(f"need_weights=True asks for the (..., Hq, L, S) = "
                          f"{C.shape_str(batch + (L, S))} weights, "
                          f"{math.prod(batch + (L, S)) * compute.itemsize / 2**30:.1f} GiB, which "
                          "could not be allocated; the output alone needs O(L) memory per head "
                          "(need_weights=False)") from None
    lse = np.empty(batch + (L,), compute) if lse_wanted else None

    q = C.broadcast_view(C.kernel_view(query), batch + (L, E))
    k = C.broadcast_view(C.kernel_view(key), kv_batch + (S, key.shape[-1] if packed else E))
    v = C.broadcast_view(C.kernel_view(value), kv_batch + (S, value.shape[-1]))
    store = (query_store(dtype) if compute != dtype
             else _core.STORE_NATIVE)
    kv_store, k_scale, v_scale = store, None, None
    if stored is not None:
        kv_store = stored.store
        if stored.key_scale is not None and stored.value_scale is not None:
            k_scale = C.broadcast_view(stored.key_scale, kv_batch + (S,))
            v_scale = C.broadcast_view(stored.value_scale, kv_batch + (S,))
    if result.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        isa = _runtime.isa()
        _tuning.run((isa, nthreads, kv_store, False), _tuning.distinct_bytes(k, v),
                    L <= _tuning.DECODE_ROWS,
                    lambda prefetch: _core.attention(
                        isa, q, k, v, mask, kind, result, weights, group, causal, offset, scale,
                        nthreads, window_left=variants.window_left,
                        window_right=variants.window_right, softcap=variants.softcap,
                        slopes=variants.slopes, sinks=variants.sinks, lse=lse, q_store=store,
                        kv_store=kv_store, k_scale=k_scale, v_scale=v_scale,
                        prefetch=prefetch))
    half = compute != dtype  # 16-bit inputs: the float32 results rounded once to their dtype
    out = narrow(result, dtype, nthreads, out) if half else result
    if half and weights is not None:
        weights = narrow(weights, dtype, nthreads)
    results = (out,) + tuple(x for x in (weights, lse) if x is not None)  # lse: float32
    return results[0] if len(results) == 1 else results  # type: ignore[return-value]


def require_qkv(query: object, key: object, value: object) -> None:
    """query (..., L, E), key (..., S, E) and value (..., S, Ev): arrays of
    these lengths, or the error naming the one that is not."""
    names = ("query", "key", "value")
    q, k, v = (C.require_array(a, name) for a, name in zip((query, key, value), names))
    for a, name in zip((q, k, v), names):
        C.require_ndim(a, name, 2, "(..., length, features)")
    E, (S, Ek), Sv = q.shape[-1], k.shape[-2:], v.shape[-2]
    if Ek != E:
        raise ValueError(f"key's last axis ({Ek}) must equal query's last axis E ({E}); "
                         f"query {C.shape_str(q.shape)}, key {C.shape_str(k.shape)}")
    if Sv != S:
        raise ValueError(f"value must have as many rows as key (S = {S}), got {Sv}; "
                         f"key {C.shape_str(k.shape)}, value {C.shape_str(v.shape)}")


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
        values = np.stack([o.astype(compute, copy=False) for o in outs])
        parts = np.where(factor[..., None] == 0, 0, factor[..., None] * values)
        out = parts.sum(axis=0) / np.where(total == 0, 1, total)[..., None]
        merged = np.where(total == 0, -np.inf, m + np.log(np.where(total == 0, 1, total)))
    merged = merged.astype(compute, copy=False)
    if compute != dtype:  # rounded once, as the attention's own 16-bit outputs
        return narrow(out.astype(compute), dtype, _runtime.resolve_threads(None)), merged
    return out.astype(dtype, copy=False), merged

