"""The backward pass of scaled dot-product attention and of varlen
attention: the gradients of their inputs from the gradient of their
output, for training."""
from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from . import _checks as C
from . import _dispatch
from .varlen import packed
from ._typing import Alignment, Float, MaskArray, NDArray


def attention_backward(
        grad_out: NDArray[Float], query: NDArray[Float], key: NDArray[Float],
        value: NDArray[Float], out: NDArray[Float], logsumexp: NDArray[Any],
        attn_mask: Optional[MaskArray] = None, dropout_p: float = 0.0, is_causal: bool = False,
        scale: Optional[float] = None, enable_gqa: bool = False, *,
        causal_alignment: Alignment = "upper_left",
        window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None,
        num_threads: Optional[int] = None) -> tuple[NDArray[Any], ...]:
    """Gradients of ``scaled_dot_product_attention`` with respect to its
    query, key and value (and sinks), from the gradient of its output.

    The first six arguments have the names and order of PyTorch's
    ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward``
    (grad_out, query, key, value, out, logsumexp); the forward's options
    follow with the names, meaning and checks of
    ``scaled_dot_product_attention``, and must be the forward call's.  The
    maths is FlashAttention-2's backward (Dao 2023, Algorithm 2): the scores
    are computed again from query, key and logsumexp, the L x S matrix is
    never held, and ``D = rowsum(grad_out * out)`` comes first.

    Parameters
    ----------
    grad_out : ndarray, shape (..., Hq, L, Ev)
        The gradient of the loss with respect to the forward's output; the
        forward's broadcast batch shape, query's dtype.
    query, key, value : ndarray
        The forward's inputs, with their shapes and dtypes (float32,
        float64, float16 or bfloat16; the 16-bit ones are computed in
        float32 copies and their gradients rounded once to them).
    out : ndarray, shape (..., Hq, L, Ev)
        The forward's output.
    logsumexp : ndarray, shape (..., Hq, L)
        The forward's ``return_lse=True`` log-sum-exp (float32 for the
        16-bit dtypes).  Each row's weights, computed again, must sum to 1
        with it (within 1e-3 in float32, 1e-9 in float64, more for heads
        of some 2^19 features, whose scores' rounding is larger): a
        log-sum-exp of other inputs or options is refused.
    attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
    window_size, alibi_slopes, softcap, sinks :
        As in ``scaled_dot_product_attention`` (bool mask: True = may
        attend, PyTorch's convention; floating: added).  The mask and the
        ALiBi slopes are constants: no gradient is returned for them.
    num_threads : int or None
        Threads for this call; None uses ``get_num_threads()``.  The
        gradients are bitwise identical whatever the thread count: every
        one is written once, its sums in an order fixed by positions (with
        GQA, dK and dV summed over the group's heads in head order), no
        atomics.

    Returns
    -------
    grad_query, grad_key, grad_value : ndarrays
        Of query's, key's and value's shapes and dtypes; an input broadcast
        by the forward gets the sum over the axes it was broadcast along.
    grad_sinks : ndarray, only with sinks
        Of sinks' shape, its dtype (float64 for integer sinks):
        ``-sum_i exp(sink - lse_i) D_i`` over the rows of each head.

    A key whose weight is 0 gets zero gradients and adds nothing to the
    query's, a non-finite key or value there included; a NaN in a visible
    score gives NaN gradients.

    Raises
    ------
    TypeError, ValueError
        What ``scaled_dot_product_attention`` raises for these inputs and
        options; grad_out, out or logsumexp of another shape or dtype; a
        logsumexp that does not match the inputs (above).
    """
    return _dispatch.backward(grad_out, query, key, value, out, logsumexp, attn_mask, dropout_p,
                              is_causal, scale, enable_gqa, causal_alignment, window_size,
                              alibi_slopes, softcap, sinks, num_threads)


def varlen_attention_backward(
        grad_out: NDArray[Float], query: NDArray[Float], key: NDArray[Float],
        value: NDArray[Float], out: NDArray[Float], lse: NDArray[Any],
        cu_seqlens_q: NDArray[np.integer[Any]], cu_seqlens_k: NDArray[np.integer[Any]], *,
        is_causal: bool = False, causal_alignment: Union[str, int] = "lower_right",
        scale: Optional[float] = None, window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None,
        num_threads: Optional[int] = None) -> tuple[NDArray[Any], ...]:
    """Gradients of ``varlen_attention`` with respect to its query, key and
    value (and sinks): ``attention_backward`` for packed sequences, as
    FlashAttention's ``_flash_attn_varlen_backward`` (whose dout, q, k, v,
    out, softmax_lse and cu_seqlens these are, under PyTorch's names).

    Parameters
    ----------
    grad_out, out : ndarray, shape (total_q, Hq, Ev)
        The gradient of the loss with respect to the forward's output, and
        that output; query's dtype.
    query, key, value, cu_seqlens_q, cu_seqlens_k :
        The forward's, as ``varlen_attention`` takes them.
    lse : ndarray, shape (Hq, total_q)
        The forward's ``return_lse=True`` log-sum-exp (float32 for 16-bit
        inputs); checked as ``attention_backward`` checks its logsumexp.
    is_causal, causal_alignment, scale, window_size, alibi_slopes, softcap, sinks :
        The forward's options, as ``varlen_attention`` takes them (no tree
        masks: they serve decoding).
    num_threads : int or None

    Returns
    -------
    grad_query, grad_key, grad_value : ndarrays of query's, key's and
    value's shapes and dtypes; grad_sinks (Hq,) only with sinks.  Each
    sequence's gradients are bitwise those of ``attention_backward`` on its
    own rows with ``enable_gqa=True``, whatever the other sequences and the
    thread count.

    Raises
    ------
    TypeError, ValueError
        What ``varlen_attention`` raises for these inputs and options;
        grad_out, out or lse of another shape or dtype, an lse that does not
        match the inputs.
    """
    dtype, Ev, cu_q, cu_k = packed(query, key, value, cu_seqlens_q, cu_seqlens_k)
    return _dispatch.varlen_backward(
        grad_out, query, key, value, out, lse, dtype, Ev, cu_q, cu_k,
        C.check_bool(is_causal, "is_causal"), causal_alignment, scale, window_size,
        alibi_slopes, softcap, sinks, num_threads)
