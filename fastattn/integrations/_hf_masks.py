"""The mask function fastattn registers with transformers' AttentionMaskInterface.

transformers builds the mask of a forward pass once, through the function
registered under the model's ``attn_implementation``, and hands the result
unchanged to every attention layer (``attention_forward`` in
``transformers.py`` of this package).  SDPA's function materialises a
(B, 1, L, S) boolean mask as soon as one sequence is padded (1 GiB for one
32k-token sequence); this one returns what fastattn applies without it:

==========================  ==================================================
returned                    meaning for the attention layer
==========================  ==================================================
``None``                    no padding: the module's ``is_causal``, upper-left
                            (transformers' rule for SDPA)
``CausalMask``              (B or 1, 1, 1, length) bool key mask (a tensor
                            subclass): causal, lower-right, over the first
                            ``length`` keys; with ``window`` >= 0 also a
                            sliding window (Mistral, Gemma 2/3, gpt-oss)
(B, 1, 1, S) bool tensor    bidirectional with padding (encoders): a key mask
any other tensor            transformers' own dense mask (chunked attention,
                            bidirectional windows, packed sequences, custom
                            overlays), applied as is
==========================  ==================================================
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers.masking_utils import (and_masks, bidirectional_mask_function,
                                        causal_mask_function, prepare_padding_mask, sdpa_mask,
                                        sliding_window_overlay)


class CausalMask(torch.Tensor):
    """A (B or 1, 1, 1, length) bool key mask (True = may attend) that also
    means: causal, lower-right aligned over the first ``length`` keys, and
    with ``window`` >= 0 a sliding window.  Query i of L, at key position
    i' = i + length - L, sees key j when i' - window <= j <= i' and the mask
    allows j (fastattn's ``window_size=(window, 0)``; window -1: no window).

    Keys at and past ``length`` are later than every query (the unwritten
    slots of a static cache): the layer drops them before attending.  It is
    a tensor, not a plain object, because transformers passes masks that are
    4-D tensors through untouched (generate() with a static cache builds
    them ahead and hands them to the model again); its type is what tells
    it from a dense mask.
    """

    length: int
    keys: Optional[torch.Tensor]  # a plain-tensor view of the mask, None when no key is hidden
    window: int

    @staticmethod
    def make(key_mask: Optional[torch.Tensor], length: int, window: int = -1) -> "CausalMask":
        """key_mask (B, length) bool, or None: every key allowed; window >= -1."""
        if key_mask is None:
            plain = torch.ones((1, 1, 1, length), dtype=torch.bool)
        else:  # contiguous: generate()'s .contiguous() then returns this very object
            plain = key_mask[:, None, None, :].contiguous()
        mask = plain.as_subclass(CausalMask)
        # Plain attributes, read by the attention layers without torch's subclass dispatch
        # (microseconds per .shape); a copy made by an operation has only the window.
        mask.length, mask.keys = length, None if key_mask is None else plain
        mask.window = window
        return mask

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        # A copy made by an operation (a clone, a no-op slice) reads its length and key mask
        # from its shape and values; only the window would be lost, and with it the keys the
        # window hides: it is carried over from the mask operated on.
        result = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(result, CausalMask) and "window" not in result.__dict__:
            source = next((a for a in args if isinstance(a, CausalMask)), None)
            result.window = getattr(source, "window", -1)
        return result

    def dense(self, q_length: int) -> torch.Tensor:
        """The same pattern as transformers' (B or 1, 1, L, length) bool mask, for SDPA."""
        length = self.shape[-1]
        keys = self.as_subclass(torch.Tensor)
        i = torch.arange(q_length, device=keys.device)[:, None] + (length - q_length)  # i'
        j = torch.arange(length, device=keys.device)[None, :]
        allowed = j <= i
        window = getattr(self, "window", -1)
        if window >= 0:
            allowed &= j >= i - window
        return allowed & keys


# transformers makes a new closure per call of sliding_window_causal_mask_function; these
# code objects are what every one of them shares
_AND_CODE = and_masks(causal_mask_function).__code__
_OVERLAY_CODE = sliding_window_overlay(1).__code__


def _closure(function: Callable[..., Any]) -> dict[str, Any]:
    cells = getattr(function, "__closure__", None) or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells)))


def causal_window(mask_function: Callable[..., Any]) -> Optional[int]:
    """sliding_window when mask_function is transformers'
    ``sliding_window_causal_mask_function(sliding_window)`` (key k visible
    from query q when q - sliding_window < k <= q), else None.  Read from its
    code and closure: evaluating it would build the dense mask."""
    if getattr(mask_function, "__code__", None) is not _AND_CODE:
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not (isinstance(parts, tuple) and len(parts) == 2 and parts[1] is causal_mask_function
            and getattr(parts[0], "__code__", None) is _OVERLAY_CODE):
        return None
    window = _closure(parts[0]).get("sliding_window")
    return window if isinstance(window, int) and window >= 1 else None


def fastattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0,
                  kv_offset: int = 0, mask_function: Callable[..., Any] = causal_mask_function,
                  attention_mask: Optional[torch.Tensor] = None, local_size: Optional[int] = None,
                  allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False,
                  use_vmap: bool = False, **kwargs: Any) -> Any:
    """transformers' mask-interface signature (that of ``masking_utils.sdpa_mask``):
    positions ``q_offset .. q_offset+q_length-1`` attend to ``kv_offset ..
    kv_offset+kv_length-1`` under ``mask_function`` and the (B, >= kv_length)
    bool padding mask ``attention_mask``.  Returns one of the forms in the
    module docstring."""
    def dense() -> Any:
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                         q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                         attention_mask=attention_mask, local_size=local_size,
                         allow_is_causal_skip=allow_is_causal_skip,
                         allow_is_bidirectional_skip=allow_is_bidirectional_skip,
                         use_vmap=use_vmap, **kwargs)

    q_offset = int(q_offset)  # a 0-d tensor for static caches
    if use_vmap:
        return dense()
    # Sliding-window layers: transformers' local_size is the window; chunked attention
    # (local_size the chunk) has another mask function and stays dense.
    window = causal_window(mask_function)
    causal = mask_function is causal_mask_function and local_size is None
    if (causal or (window is not None and window == local_size)) and (
            allow_is_causal_skip or q_length == 1) and (
            # the keys run from at or before the first query to at or past the last
            kv_offset <= q_offset and q_offset + q_length <= kv_offset + kv_length):
        # allow_is_causal_skip is False for one-token steps on a static cache only so
        # that a compiled graph sees a tensor; fastattn is not compiled.
        left = -1
        if window is not None and q_offset + q_length - 1 - kv_offset >= window:
            left = window - 1  # some key is window or more positions before a query: hidden
        return _causal(q_length, kv_length, q_offset, kv_offset, attention_mask, left)
    if local_size is not None:
        return dense()
    if mask_function is bidirectional_mask_function and allow_is_bidirectional_skip:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]
        return None if bool(padding.all()) else padding[:, None, None, :]
    return dense()


def _causal(q_length: int, kv_length: int, q_offset: int, kv_offset: int,
            attention_mask: Optional[torch.Tensor], window: int) -> Optional[CausalMask]:
    length = q_offset + q_length - kv_offset  # keys later than the last query are dropped
    key_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if key_mask is not None:
        key_mask = key_mask[:, kv_offset:kv_offset + length]
        if bool(key_mask.all()):
            key_mask = None
    if key_mask is None and window < 0 and q_offset == 0 and (q_length > 1 or kv_length == 1):
        return None
    return CausalMask.make(key_mask, length, window)
