"""varlen_attention: attention over packed sequences of different lengths."""
from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from . import _checks as C
from . import _core, _runtime, _storage, _tree
from ._dispatch import ragged
from ._typing import Float, NDArray


def varlen_attention(
        query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
        cu_seqlens_q: NDArray[np.integer[Any]], cu_seqlens_k: NDArray[np.integer[Any]], *,
        is_causal: bool = False, causal_alignment: Union[str, int] = "lower_right",
        scale: Optional[float] = None, window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, return_lse: bool = False,
        out: Optional[NDArray[Float]] = None, num_threads: Optional[int] = None,
        tree_mask: Optional[NDArray[np.bool_]] = None,
        tree_mask_indptr: Optional[NDArray[np.integer[Any]]] = None,
        precision: str = "exact",
) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]:
    """Attention over B packed sequences, each attending to its own keys
    only: FlashAttention's ``flash_attn_varlen_func`` contract.

    No padding is stored or computed: the work is spread over threads by
    the sequences' actual lengths, in the scheduler of ``paged_attention``
    (a decoding sequence's keys split, the query heads of one key/value
    head together), so that each sequence's output is bitwise that of
    ``scaled_dot_product_attention`` on its own rows, with
    ``enable_gqa=True``.

    Parameters
    ----------
    query : ndarray, shape (total_q, Hq, E)
        The B sequences' query rows one after the other; float32, float64,
        float16 or bfloat16 (16-bit inputs are read as float32 and the
        output rounded to their dtype, as ``scaled_dot_product_attention``
        does).
    key : ndarray, shape (total_k, Hkv, E)
    value : ndarray, shape (total_k, Hkv, Ev)
        Same dtype.  Hq must be a multiple of Hkv (grouped-query attention:
        query head h reads key/value head h // (Hq // Hkv)).  Any strides.
    cu_seqlens_q, cu_seqlens_k : ndarray of int32 or int64, shape (B + 1,)
        Cumulative lengths: sequence b holds query rows cu_seqlens_q[b] to
        cu_seqlens_q[b + 1] - 1 and keys cu_seqlens_k[b] to
        cu_seqlens_k[b + 1] - 1.  Start at 0, never decrease, end at
        total_q and total_k; empty sequences are allowed.
    is_causal, causal_alignment, scale, window_size, alibi_slopes, softcap, sinks
        As for ``scaled_dot_product_attention``, per sequence (its own L and
        S set the alignment); alibi_slopes of shape (Hq,) or (B, Hq), sinks
        (Hq,) only.  causal_alignment defaults to "lower_right", as
        flash_attn_varlen_func aligns its causal mask (query i of a sequence
        sees keys 0..i + S - L; the same as "upper_left" where L = S); an
        int k puts query i of every sequence at key position i + k.
    return_lse : bool
        Also return the log-sum-exp of each row, shape (Hq, total_q), as
        FlashAttention's varlen ``softmax_lse``; for a row with no key (a
        sequence of none, or all outside its window), the sink's logit
        with sinks (as in FlashAttention 4's reference), -inf without.
    out : ndarray or None, shape (total_q, Hq, Ev), query's dtype
        Written through its strides; must not overlap the inputs.
    num_threads : int or None
    tree_mask, tree_mask_indptr : ndarray of bool (sum of L_b**2,) and int (B + 1,), or None
        Speculative decoding's trees of draft tokens, as for
        ``paged_attention`` (FlashInfer's ``custom_mask`` and
        ``mask_indptr`` over each sequence's L_b queries and its last L_b
        keys; an empty range: no tree); not with ``window_size`` nor
        ``alibi_slopes``.
    precision : {"exact", "int8"}
        As for ``scaled_dot_product_attention``: "int8" (opt-in) is its
        8-bit mode, each sequence's keys smoothed by their own mean.

    Returns
    -------
    out : ndarray, shape (total_q, Hq, Ev), query's dtype
        (out, lse) with ``return_lse=True``.

    Raises
    ------
    TypeError
        Arrays that are not ndarrays, dtypes that are not one of float32,
        float64, float16 or bfloat16, cu_seqlens not int32/int64, flags that
        are not bools.
    ValueError
        Shapes that do not agree, Hq not a multiple of Hkv, cu_seqlens not
        starting at 0, decreasing, not ending at the total or of different
        lengths for query and key, and the bad values of
        ``scaled_dot_product_attention``'s options; a tree_mask whose
        sequences' masks are not L_b x L_b, of a sequence with fewer keys
        than queries, or with a window or ALiBi; a precision other than
        "exact" and "int8" (TypeError when not a str).
    """
    dtype, Ev, cu_q, cu_k = packed(query, key, value, cu_seqlens_q, cu_seqlens_k)
    causal = C.check_bool(is_causal, "is_causal")
    lse_wanted = C.check_bool(return_lse, "return_lse")
    offset = C.alignment_offset(causal_alignment, 0, 0)  # per sequence: S - L too
    lower_right = isinstance(causal_alignment, str) and causal_alignment == "lower_right"
    store = kv_store = _storage.query_store(dtype)
    mode = C.check_precision(precision)
    scales: tuple[Optional[NDArray[np.float32]], Optional[NDArray[np.float32]]] = (None, None)
    mean = None
    inputs: dict[str, Optional[NDArray[Any]]] = {
        "query": query, "key": key, "value": value, "cu_seqlens_q": cu_seqlens_q,
        "cu_seqlens_k": cu_seqlens_k, "tree_mask": tree_mask}
    held: tuple[NDArray[Any], NDArray[Any]] = (key, value)  # as the kernels read them
    if mode != _core.PRECISION_EXACT and dtype != np.float64:  # float64 stays exact
        k_codes, v_codes, k_scale, v_scale, mean = _storage.int8_packed_operands(
            key, value, cu_k, _runtime.resolve_threads(num_threads))
        held = (k_codes, v_codes)
        scales, kv_store = (k_scale.T[None], v_scale.T[None]), _core.STORE_I8
    else:
        mode = _core.PRECISION_EXACT
    # the packed rows as the one block of the caches, (1, Hkv, total_k, E)
    key_cache, value_cache = (x.transpose(1, 0, 2)[None] for x in held)
    q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    trees = _tree.check(tree_mask, tree_mask_indptr, q_lens, k_lens)
    return ragged(query, key_cache, value_cache, None, cu_k[:-1], k_lens,
                  cu_q, q_lens, scales, store, kv_store, Ev, causal,
                  lower_right, offset, scale, window_size, alibi_slopes, softcap, sinks,
                  lse_wanted, out, num_threads, inputs, mode, mean, trees=trees)


def packed(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
           cu_seqlens_q: object, cu_seqlens_k: object
           ) -> tuple[np.dtype[Any], int, NDArray[np.int64], NDArray[np.int64]]:
    """The checks of packed sequences (varlen_attention's and its
    backward's): their dtype, Ev and cumulative lengths as int64."""
    for name, a in (("query", query), ("key", key), ("value", value)):
        C.require_array(a, name)
        if a.ndim != 3:
            raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected 3 axes "
                             "(total, heads, features)")
    dtype = C.attention_dtype(query=query, key=key, value=value)
    total_q, Hq, E = query.shape
    total_k, Hkv, Ek = key.shape
    if Ek != E or value.shape[:2] != (total_k, Hkv):
        raise ValueError(f"query {C.shape_str(query.shape)}, key {C.shape_str(key.shape)} and "
                         f"value {C.shape_str(value.shape)} do not agree: expected (total_q, "
                         "Hq, E), (total_k, Hkv, E) and (total_k, Hkv, Ev)")
    Ev = value.shape[2]
    C.check_head_groups(Hq, Hkv)
    cu_q = C.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    cu_k = C.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", total_k)
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold B + 1 values for the same "
                         f"B, got {cu_q.shape[0]} and {cu_k.shape[0]}")
    return dtype, Ev, cu_q, cu_k
