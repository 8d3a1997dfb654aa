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
                            ``length`` keys
(B, 1, 1, S) bool tensor    bidirectional with padding (encoders): a key mask
``SlidingWindowMask``       a sliding window that hides keys: run on SDPA
any other tensor            transformers' own dense mask (chunked attention,
                            packed sequences, custom overlays), applied as is
==========================  ==================================================
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from transformers.masking_utils import (bidirectional_mask_function, causal_mask_function,
                                        prepare_padding_mask, sdpa_mask)


class CausalMask(torch.Tensor):
    """A (B or 1, 1, 1, length) bool key mask (True = may attend) that also
    means: causal, lower-right aligned over the first ``length`` keys.  Query
    i of L sees key j when j <= i + length - L and the mask allows j.

    Keys at and past ``length`` are later than every query (the unwritten
    slots of a static cache): the layer drops them before attending.  It is
    a tensor, not a plain object, because transformers passes masks that are
    4-D tensors through untouched (generate() with a static cache builds
    them ahead and hands them to the model again); its type is what tells
    it from a dense mask.
    """

    length: int
    keys: Optional[torch.Tensor]  # a plain-tensor view of the mask, None when no key is hidden

    @staticmethod
    def make(key_mask: Optional[torch.Tensor], length: int) -> "CausalMask":
        """key_mask (B, length) bool, or None: every key allowed."""
        if key_mask is None:
            plain = torch.ones((1, 1, 1, length), dtype=torch.bool)
        else:  # contiguous: generate()'s .contiguous() then returns this very object
            plain = key_mask[:, None, None, :].contiguous()
        mask = plain.as_subclass(CausalMask)
        # Plain attributes, read by the attention layers without torch's subclass dispatch
        # (about 5 us per .shape); a copy made by an operation has neither.
        mask.length, mask.keys = length, None if key_mask is None else plain
        return mask

    def dense(self, q_length: int) -> torch.Tensor:
        """The same pattern as transformers' (B or 1, 1, L, length) bool mask, for SDPA."""
        length = self.shape[-1]
        keys = self.as_subclass(torch.Tensor)
        i = torch.arange(q_length, device=keys.device)[:, None]
        j = torch.arange(length, device=keys.device)[None, :]
        return (j <= i + (length - q_length)) & keys


class SlidingWindowMask(torch.Tensor):
    """transformers' dense mask of a sliding window that hides keys in this
    pass: fastattn has no window option yet, so the layer runs on SDPA."""


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
    window = getattr(kwargs.get("config"), "sliding_window", None)
    if local_size is not None and local_size == window:
        # The place to wire fastattn's window option: return a CausalMask with the window
        # (and a bidirectional key mask with it) instead of the dense mask.
        first = min(q_offset, kv_offset)
        last = max(q_offset + q_length, kv_offset + kv_length) - 1
        if last - first >= window:  # two positions this far apart: the window may hide keys
            mask = dense()
            return None if mask is None else mask.as_subclass(SlidingWindowMask)
        return dense()  # nothing hidden by the window: transformers' mask is exact here
    if use_vmap or local_size is not None:
        return dense()
    if mask_function is causal_mask_function and kv_offset == 0 and (
            allow_is_causal_skip or q_length == 1):
        # allow_is_causal_skip is False for one-token steps on a static cache only so
        # that a compiled graph sees a tensor; fastattn is not compiled.
        return _causal(q_length, kv_length, q_offset, attention_mask)
    if mask_function is bidirectional_mask_function and allow_is_bidirectional_skip:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset:kv_offset + kv_length]
        return None if bool(padding.all()) else padding[:, None, None, :]
    return dense()


def _causal(q_length: int, kv_length: int, q_offset: int,
            attention_mask: Optional[torch.Tensor]) -> Optional[CausalMask]:
    length = min(q_offset + q_length, kv_length)  # keys later than the last query are dropped
    key_mask = prepare_padding_mask(attention_mask, kv_length, 0)
    if key_mask is not None:
        key_mask = key_mask[:, :length]
        if bool(key_mask.all()):
            key_mask = None
    if key_mask is None and q_offset == 0 and (q_length > 1 or kv_length == 1):
        return None
    return CausalMask.make(key_mask, length)
