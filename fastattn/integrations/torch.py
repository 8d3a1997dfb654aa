"""fastattn's attention as a PyTorch operator that trains.

    >>> from fastattn.integrations.torch import scaled_dot_product_attention
    >>> out = scaled_dot_product_attention(q, k, v, is_causal=True, softcap=50.0)
    >>> out.sum().backward()                  # q.grad, k.grad, v.grad

A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU
tensors, with fastattn's options (window, ALiBi, softcap, sinks, causal
alignment) and its backward pass (``fastattn.attention_backward``): the
same bits for any thread count.  Both directions are ``torch.library``
custom operators (``torch.ops.fastattn.sdpa`` and ``sdpa_backward``) with
fake implementations, so ``torch.compile`` traces them without graph
breaks.  Tensors reach the kernels without copies (NumPy views of their
memory, any strides); bfloat16 needs the ml_dtypes package.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("fastattn.integrations.torch needs torch (pip install torch); "
                      f"importing it failed: {e}") from e

import fastattn

from ._tensors import HALF, numpy_of, real_of, tensor_of

__all__ = ["scaled_dot_product_attention"]

Tensor = torch.Tensor


def _alignment(causal_alignment: str) -> Union[str, int]:
    """The option as fastattn takes it: the operators' schema carries it as a string."""
    return causal_alignment if causal_alignment in ("upper_left", "lower_right") \
        else int(causal_alignment)


def _options(attn_mask: Optional[Tensor], is_causal: bool, scale: Optional[float],
             enable_gqa: bool, causal_alignment: str, window_left: int, window_right: int,
             alibi_slopes: Optional[Tensor], softcap: Optional[float], sinks: Optional[Tensor],
             num_threads: int) -> dict[str, Any]:
    """fastattn's keyword arguments from the operators' ones."""
    return dict(attn_mask=None if attn_mask is None else real_of(attn_mask),
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                causal_alignment=_alignment(causal_alignment),
                window_size=(window_left, window_right),
                alibi_slopes=None if alibi_slopes is None else real_of(alibi_slopes),
                softcap=softcap, sinks=None if sinks is None else real_of(sinks),
                num_threads=num_threads or torch.get_num_threads())


@torch.library.custom_op("fastattn::sdpa", mutates_args=(), device_types="cpu")
def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
          is_causal: bool, scale: Optional[float], enable_gqa: bool, causal_alignment: str,
          window_left: int, window_right: int, alibi_slopes: Optional[Tensor],
          softcap: Optional[float], sinks: Optional[Tensor],
          num_threads: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of fastattn.scaled_dot_product_attention; a window of (-1, -1) is none;
    num_threads 0: torch.get_num_threads() when it runs (a call inside torch.compile's
    graph would break it)."""
    out, lse = fastattn.scaled_dot_product_attention(
        numpy_of(query), numpy_of(key), numpy_of(value), return_lse=True,
        **_options(attn_mask, is_causal, scale, enable_gqa, causal_alignment, window_left,
                   window_right, alibi_slopes, softcap, sinks, num_threads))
    return tensor_of(out), tensor_of(lse)


@_sdpa.register_fake
def _sdpa_fake(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor],
               is_causal: bool, scale: Optional[float], enable_gqa: bool,
               causal_alignment: str, window_left: int, window_right: int,
               alibi_slopes: Optional[Tensor], softcap: Optional[float],
               sinks: Optional[Tensor], num_threads: int) -> tuple[Tensor, Tensor]:
    lead = -3 if enable_gqa else -2  # the heads broadcast only without GQA
    batch = tuple(torch.broadcast_shapes(query.shape[:lead], key.shape[:lead],
                                         value.shape[:lead]))
    if enable_gqa:
        batch += (query.shape[-3],)
    lse_dtype = torch.float32 if query.dtype in HALF else query.dtype
    return (query.new_empty(batch + (query.shape[-2], value.shape[-1])),
            query.new_empty(batch + (query.shape[-2],), dtype=lse_dtype))


@torch.library.custom_op("fastattn::sdpa_backward", mutates_args=(), device_types="cpu")
def _sdpa_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                   lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                   scale: Optional[float], enable_gqa: bool, causal_alignment: str,
                   window_left: int, window_right: int, alibi_slopes: Optional[Tensor],
                   softcap: Optional[float], sinks: Optional[Tensor],
                   num_threads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(grad_query, grad_key, grad_value, grad_sinks) of fastattn.attention_backward;
    grad_sinks empty without sinks."""
    grads = fastattn.attention_backward(
        numpy_of(grad_out), numpy_of(query), numpy_of(key), numpy_of(value), numpy_of(out),
        numpy_of(lse), **_options(attn_mask, is_causal, scale, enable_gqa, causal_alignment,
                                  window_left, window_right, alibi_slopes, softcap, sinks,
                                  num_threads))
    dsinks = tensor_of(grads[3]).to(sinks.dtype) if sinks is not None else query.new_empty(0)
    return tensor_of(grads[0]), tensor_of(grads[1]), tensor_of(grads[2]), dsinks


@_sdpa_backward.register_fake
def _sdpa_backward_fake(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                        out: Tensor, lse: Tensor, attn_mask: Optional[Tensor], is_causal: bool,
                        scale: Optional[float], enable_gqa: bool, causal_alignment: str,
                        window_left: int, window_right: int, alibi_slopes: Optional[Tensor],
                        softcap: Optional[float], sinks: Optional[Tensor],
                        num_threads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            torch.empty_like(sinks) if sinks is not None else query.new_empty(0))


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    query, key, value, attn_mask, *options = inputs
    ctx.options = options  # is_causal ... num_threads, with alibi_slopes and sinks
    ctx.save_for_backward(query, key, value, attn_mask, *output)
    ctx.mark_non_differentiable(output[1])


def _backward(ctx: Any, grad_out: Tensor, grad_lse: Optional[Tensor]) -> tuple[Any, ...]:
    query, key, value, attn_mask, out, lse = ctx.saved_tensors
    grads = torch.ops.fastattn.sdpa_backward(grad_out, query, key, value, out, lse, attn_mask,
                                             *ctx.options)
    sinks = ctx.options[-2]
    # no gradient for the mask, the options and the ALiBi slopes (constants)
    return (grads[0], grads[1], grads[2], None) + (None,) * 8 + \
        (grads[3] if sinks is not None else None, None)


_sdpa.register_autograd(_backward, setup_context=_setup_context)


def scaled_dot_product_attention(
        query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
        enable_gqa: bool = False, *, causal_alignment: Union[str, int] = "upper_left",
        window_size: Optional[Sequence[int]] = None, alibi_slopes: Optional[Tensor] = None,
        softcap: Optional[float] = None, sinks: Optional[Tensor] = None,
        num_threads: Optional[int] = None) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` on fastattn's
    kernels, differentiable with respect to query, key, value and sinks.

    The arguments up to ``enable_gqa`` are PyTorch's (names, order,
    meaning; a bool ``attn_mask`` is True where a query may attend); the
    keyword-only ones are ``fastattn.scaled_dot_product_attention``'s, which
    documents the shapes, dtypes (float32, float64, float16, bfloat16) and
    errors; all CPU tensors.  ``dropout_p`` must be 0.  ``num_threads``
    None: ``torch.get_num_threads()``.  The backward is
    ``fastattn.attention_backward`` (FlashAttention-2's, Dao 2023): bitwise
    the same for any thread count.  The mask and the ALiBi slopes get no
    gradient: one that requires a gradient is refused rather than left
    untrained.  Once differentiable: no double backward.

    Returns
    -------
    Tensor, shape (..., Hq, L, Ev), query's dtype: a new tensor.

    Raises
    ------
    TypeError, ValueError
        dropout_p != 0, num_threads < 1, a window_size that is not a pair
        of ints, a causal_alignment that is not "upper_left",
        "lower_right" or an int, an attn_mask or alibi_slopes that requires
        a gradient, and what fastattn raises for these inputs.
    """
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 (fastattn has no dropout), got {dropout_p}")
    if num_threads is not None and int(num_threads) < 1:
        raise ValueError(f"num_threads must be at least 1 (or None), got {num_threads}")
    if window_size is None:
        window_size = (-1, -1)  # unbounded on both sides: no window
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or
            not all(isinstance(w, int) and not isinstance(w, bool) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if not (causal_alignment in ("upper_left", "lower_right") or
            (isinstance(causal_alignment, int) and not isinstance(causal_alignment, bool))):
        raise ValueError(f'causal_alignment must be "upper_left", "lower_right" or an int, '
                         f"got {causal_alignment!r}")
    for name, t in (("attn_mask", attn_mask), ("alibi_slopes", alibi_slopes)):
        if isinstance(t, torch.Tensor) and t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires a gradient, which fastattn does not compute "
                             "(only query, key, value and sinks get one); detach it, or use "
                             "torch.nn.functional.scaled_dot_product_attention")
    out, _ = torch.ops.fastattn.sdpa(
        query, key, value, attn_mask, bool(is_causal), scale, bool(enable_gqa),
        str(causal_alignment), int(window_size[0]), int(window_size[1]), alibi_slopes,
        softcap, sinks, 0 if num_threads is None else int(num_threads))
    return out
