"""fastattn as an attention implementation of Hugging Face transformers.

    >>> import fastattn.integrations.transformers as fa_hf
    >>> fa_hf.register()                                   # once per process
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fastattn")

``register`` adds two functions under one name: the attention function
(``attention_forward``, called by every attention layer) and the mask
function (``_hf_masks.fastattn_mask``, called once per forward pass).  Both
are needed: without the mask function transformers builds no mask at all
and padding is silently ignored.  Tested with transformers 5.24 and
torch 2.13 (CPU).

What runs on fastattn: float32, float64, float16 and bfloat16 CPU tensors
(bfloat16 needs the ml_dtypes package; 16-bit inputs are read as they
are, computed in float32 and rounded once), in inference and in training
(``model.train()``: a call that autograd records runs on
``fastattn.integrations.torch``'s operator, whose backward is
``fastattn.attention_backward``; sinks get their gradient), causal and
bidirectional attention, sliding windows (Mistral, Gemma 2/3, gpt-oss: the
window option, never a dense mask), padding (key masks, never a dense
(B, 1, L, S) mask), dynamic and static caches, grouped-query attention
(key/value heads shared, never repeated), T5's ``position_bias``, and the
attention weights when a model asks for them (``output_attentions=True``).  The
rest runs on transformers' SDPA function with a one-time
``FastattnFallbackWarning`` naming the reason: dropout in training, a
``position_bias`` that needs a gradient (T5 in training), attention weights
in training, non-CPU tensors, other dtypes, bfloat16 without ml_dtypes.
Soft-capping (Gemma 2's ``softcap``) and attention sinks (gpt-oss's
``s_aux``) run on fastattn's own options, which SDPA lacks.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any, Optional

try:
    import torch
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.integrations.transformers needs torch and transformers 5.24 or later "
        "(pip install 'fastattn[transformers]'); importing them failed: "
        f"{e}") from e
if "q_offset" not in inspect.signature(sdpa_mask).parameters:  # pragma: no cover
    raise ImportError(  # 4.x mask functions take cache_position instead
        f"fastattn.integrations.transformers needs transformers 5.24 or later, whose mask "
        f"functions take q_length and q_offset; this is {transformers.__version__} "
        "(pip install 'fastattn[transformers]')")

import numpy as np

import fastattn
from fastattn import _checks as C
from fastattn import _core

from ._hf_masks import CausalMask, fastattn_mask
from ._tensors import ml_dtypes, numpy_of, real_of, tensor_of
from .torch import scaled_dot_product_attention as sdpa_trained


__all__ = ["register", "attention_forward", "fastattn_mask", "FastattnFallbackWarning"]

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class FastattnFallbackWarning(UserWarning):
    """A call that fastattn cannot compute ran on transformers' SDPA function."""


_warned: set[str] = set()


def register(name: str = "fastattn", precision: str = "exact") -> None:
    """Register fastattn's attention and mask functions with transformers under ``name``.

    Afterwards ``from_pretrained(..., attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) runs every attention layer on
    fastattn.  Calling it again with the same name and precision is
    harmless.  ``precision="int8"`` (opt-in) computes inference in the int8
    mode of ``scaled_dot_product_attention`` (SageAttention's 8-bit
    attention; README, "The int8 mode"); layers that train (a gradient
    flows) stay exact, as the mode has no backward.  Register each
    precision under a name of its own to compare them.

    Raises
    ------
    TypeError
        name or precision is not a str.
    ValueError
        name is empty, or is already taken by another attention function
        (``"sdpa"``, ``"eager"``, ``"flash_attention_2"``, ..., or fastattn's
        other precision); precision is neither "exact" nor "int8".
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    forward = _FORWARDS[C.check_precision(precision)]
    taken = AttentionInterface().get(name)
    if not name or name == "eager" or (taken is not None and taken is not forward):
        raise ValueError(f"name must be a new attention implementation name, got {name!r}, "
                         "which is empty or already taken (choose another, e.g. 'fastattn', "
                         "or 'fastattn-int8' for precision='int8')")
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, fastattn_mask)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: Any, dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      position_bias: Optional[torch.Tensor] = None, *,
                      precision: str = "exact",
                      **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' attention-function signature (that of ``sdpa_attention_forward``).

    query (B, Hq, L, E), key (B, Hkv, S, E), value (B, Hkv, S, Ev), any
    strides, one dtype: float32, float64, float16 or bfloat16 (read without
    a copy, computed in float32 for the 16-bit ones); Hq a multiple of Hkv
    (grouped-query attention, the module's ``num_key_value_groups``).
    ``attention_mask`` is what ``fastattn_mask`` returned (or a 4-D
    bool/additive mask given by the caller; a 16-bit additive one is read as
    float32).  ``position_bias`` (B or 1, Hq, L, S) is added to the scaled
    scores.  Returns ``(output, weights)``: output a new contiguous
    (B, L, Hq, Ev) tensor of query's dtype, written by the kernel; weights
    (B, Hq, L, S), query's dtype, when the model passes
    ``output_attentions=True`` (SDPA gives none), else None.

    ``softcap`` (Gemma 2) and ``s_aux`` (gpt-oss's sinks, (Hq,)) become
    fastattn's ``softcap`` and ``sinks``.  ``precision``: that of
    ``scaled_dot_product_attention`` for inference (``register`` binds it);
    a call that trains is exact.

    Raises
    ------
    ValueError
        Hq is not ``module.num_key_value_groups`` times Hkv.
    """
    reason = _fallback_reason(query, key, value, dropout, position_bias)
    if reason is not None:
        return _sdpa(reason, module, query, key, value, attention_mask, dropout, scaling,
                     is_causal, position_bias, **kwargs)

    batch, hq, q_len, _ = query.shape
    hkv, ev = key.shape[1], value.shape[-1]
    groups = getattr(module, "num_key_value_groups", hq // max(hkv, 1))
    if hkv * groups != hq:
        raise ValueError(f"query has {hq} heads and key {hkv}: expected {hkv} x "
                         f"num_key_value_groups ({groups}) query heads")

    causal, alignment, mask, window = False, "upper_left", None, -1
    if attention_mask is None:  # transformers' rule: the module's is_causal, upper-left
        causal = q_len > 1 and (is_causal if is_causal is not None
                                else getattr(module, "is_causal", True))
        length = q_len if causal else key.shape[2]  # an empty static cache: keys past L unseen
    elif isinstance(attention_mask, CausalMask):
        causal, alignment = q_len > 1, "lower_right"
        length, key_mask, window = _causal_mask_parts(attention_mask)
        if key_mask is not None:
            mask = key_mask.numpy()
    elif isinstance(attention_mask, torch.Tensor):
        length, mask = key.shape[2], real_of(attention_mask.as_subclass(torch.Tensor))
    else:
        raise TypeError(f"attention_mask must be None or a torch.Tensor, got "
                        f"{type(attention_mask).__name__}: is the mask function registered "
                        "under the same name (fastattn.integrations.transformers.register)?")
    q_np, k_np, v_np = numpy_of(query), numpy_of(key), numpy_of(value)
    keys = k_np.shape[2]
    # keys before the first query's window are hidden from every query: not passed
    first = max(length - q_len - window, 0) if window >= 0 else 0
    if q_len == 1:
        window = -1  # the keys left are the window
    if first > 0 or length < keys:
        k_np, v_np = k_np[:, :, first:length], v_np[:, :, first:length]
        if mask is not None:  # a key mask over the first length keys
            mask = mask[..., first:]
        if position_bias is not None:
            position_bias = position_bias[..., first:length]
    if position_bias is not None:
        mask = _add_bias(mask, real_of(position_bias))

    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if _trains(query, key, value, *(() if sinks is None else (sinks,))):
        if _weights_requested(kwargs):
            return _sdpa("attention weights with gradients: fastattn's backward has no "
                         "weights (and SDPA returns none)", module, query, key, value, attention_mask, dropout,
                         scaling, is_causal, position_bias, **kwargs)
        # the autograd operator, on the same keys, mask and options
        out = sdpa_trained(
            query, key[:, :, first:length], value[:, :, first:length],
            None if mask is None else torch.from_numpy(mask), is_causal=causal, scale=scaling,
            enable_gqa=hq != hkv, causal_alignment=alignment,
            window_size=None if window < 0 else (window, 0),
            softcap=None if softcap is None else float(softcap), sinks=sinks)
        return out.transpose(1, 2), None
    batch = max(batch, key.shape[0], value.shape[0], 1 if mask is None else mask.shape[0])
    out = np.empty((batch, q_len, hq, ev), q_np.dtype)  # what the model gets, as a view
    out_heads = out.transpose(0, 2, 1, 3)
    if q_len == 1 and hq != hkv and (mask is None or mask.shape[1] == 1) and (
            kwargs.get("s_aux") is None):  # sinks are per query head
        # One token of grouped-query attention: the query heads of a group become the rows
        # of one (Hkv, Hq/Hkv) block (transformers' pack_gqa), so that each key/value head is
        # read once, not once per query head.  Views in the layouts models make.
        q_np = q_np.reshape(q_np.shape[0], hkv, hq // hkv, q_np.shape[-1])
        out_heads = out.reshape(batch, hkv, hq // hkv, ev)
    need_weights = _weights_requested(kwargs)
    result = fastattn.scaled_dot_product_attention(
        q_np, k_np, v_np, mask, is_causal=causal, scale=scaling,
        enable_gqa=q_np.shape[1] != hkv, causal_alignment=alignment, need_weights=need_weights,
        window_size=None if window < 0 else (window, 0),
        softcap=None if softcap is None else float(softcap),
        sinks=None if sinks is None else real_of(sinks), out=out_heads,
        num_threads=torch.get_num_threads(), precision=precision)
    if not need_weights:
        return tensor_of(out), None
    weights = tensor_of(result[1].reshape(batch, hq, q_len, -1))
    # zero for the keys cut off (before every query's window, later than every query)
    return tensor_of(out), torch.nn.functional.pad(weights, (first, keys - length))


# the function registered for each precision (C.check_precision's)
_FORWARDS = {_core.PRECISION_EXACT: attention_forward,
             _core.PRECISION_INT8: functools.partial(attention_forward, precision="int8")}


def _trains(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this call: a gradient may flow to one of them."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _weights_requested(kwargs: dict[str, Any]) -> bool:
    """Whether the model wants this layer's attention weights: an
    ``output_attentions`` keyword that reaches the layer (Llama, BERT), or
    transformers' output recorder collecting attentions for the running
    forward (``capture_outputs``: GPT-2 takes ``output_attentions`` out of the
    kwargs and records what each layer returns)."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
        collecting = _active_collector.get()
    except (ImportError, AttributeError, LookupError, TypeError):
        return False
    return isinstance(collecting, dict) and bool(
        {"attentions", "cross_attentions"} & collecting.keys())


def _causal_mask_parts(mask: CausalMask) -> tuple[int, Optional[torch.Tensor], int]:
    """(length, plain (B, 1, 1, length) bool key mask or None, window) of a CausalMask."""
    try:
        return mask.length, mask.keys, mask.window
    except AttributeError:  # made by an operation on one: its values and shape say the rest
        plain = mask.as_subclass(torch.Tensor)
        if plain.dtype != torch.bool:
            raise TypeError(f"fastattn's causal key mask must stay bool, got {plain.dtype}")
        return plain.shape[-1], plain, getattr(mask, "window", -1)


def _add_bias(mask: Optional[np.ndarray], bias: np.ndarray) -> np.ndarray:
    """An additive mask: position_bias where mask allows (or plus a float mask), -inf elsewhere."""
    if mask is None:
        return bias
    if mask.dtype == np.bool_:
        return np.where(mask, bias, np.array(-np.inf, bias.dtype))
    return bias + mask.astype(bias.dtype, copy=False)


def _fallback_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     dropout: float, position_bias: Optional[torch.Tensor]) -> Optional[str]:
    """Why this call cannot run on fastattn, or None when it can."""
    tensors = (query, key, value) if position_bias is None else (query, key, value, position_bias)
    if not all(t.is_cpu for t in tensors):
        return f"tensors on {query.device.type}: fastattn runs on the CPU"
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        return (f"dtypes query {query.dtype}, key {key.dtype}, value {value.dtype}: fastattn "
                "takes one of float32, float64, float16 and bfloat16")
    if query.dtype == torch.bfloat16 and ml_dtypes is None:
        return ("dtype torch.bfloat16 needs the ml_dtypes package, NumPy's bfloat16 "
                "(pip install ml_dtypes, or 'fastattn[bfloat16]')")
    if position_bias is not None and _trains(position_bias):
        return ("position_bias needs a gradient, and fastattn's backward gives none to an "
                "additive bias")
    if dropout > 0:
        return f"dropout {dropout} (training): fastattn has no dropout"
    return None


def _sdpa(reason: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
          value: torch.Tensor, attention_mask: Any, dropout: float, scaling: Optional[float],
          is_causal: Optional[bool], position_bias: Optional[torch.Tensor],
          **kwargs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """transformers' SDPA function on the same call, with fastattn's mask made dense."""
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fastattn: {reason}; such calls run on PyTorch's SDPA instead "
                      "(warned once)", FastattnFallbackWarning, stacklevel=3)
    if isinstance(attention_mask, CausalMask):
        n = attention_mask.shape[-1]
        key, value = key[:, :, :n], value[:, :, :n]
        if position_bias is not None:
            position_bias = position_bias[..., :n]
        attention_mask = attention_mask.dense(query.shape[2]).to(query.device)
    elif isinstance(attention_mask, torch.Tensor):
        attention_mask = attention_mask.as_subclass(torch.Tensor)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal,
                                  position_bias=position_bias, **kwargs)
