"""The NumPy reference: the oracle of the tests.

Plain NumPy that follows the five steps of the seeds literally (project,
score and scale, mask, softmax along the key axis, weighted sum), in
whatever dtype it is given (the tests give float64).  It materialises every
intermediate and is meant to be read, not to be fast.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Union, cast

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.floating[Any]]
Mask = Union[NDArray[np.bool_], NDArray[np.floating[Any]]]
# the output, and the weights and/or the log-sum-exp when asked for
Result = Union[Array, tuple[Array, Array], tuple[Array, Array, Array]]


def softmax(x: Array, axis: int = -1, mask: Optional[Mask] = None) -> Array:
    """Softmax along axis; mask: bool (True = keep) or floating (added).

    Hidden entries (-inf, or masked out) get weight 0; a row with nothing
    visible is all zeros; NaN propagates."""
    if mask is not None and mask.dtype == np.bool_:
        x = np.where(mask, x, -np.inf)
    elif mask is not None:
        x = np.where(mask == -np.inf, -np.inf, x + mask)
    m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)  # row maximum (NaN if any)
    with np.errstate(invalid="ignore"):                # inf - inf is NaN, as it should be
        e = np.exp(x - np.where(m == -np.inf, 0, m))   # hidden entries: exp(-inf) = 0
    s = np.sum(e, axis=axis, keepdims=True)
    return e / np.where(m == -np.inf, 1, s)            # all hidden: 0 / 1, not 0 / 0


def causal_mask(L: int, S: int, alignment: str = "upper_left") -> NDArray[np.bool_]:
    """Bool (L, S), True = visible: key j <= query i (+ S - L for lower_right)."""
    offset = S - L if alignment == "lower_right" else 0
    return np.arange(S)[None, :] <= np.arange(L)[:, None] + offset


def weighted_sum(weights: Array, value: Array) -> Array:
    """weights @ value, except that a weight of exactly 0 never reads its
    value row (so inf or NaN at a hidden key does not leak)."""
    if np.all(np.isfinite(value)):
        return weights @ value
    w = weights[..., :, :, None]
    with np.errstate(invalid="ignore"):  # 0 * inf, discarded by the where
        total: Array = np.where(w != 0, w * value[..., None, :, :], 0).sum(axis=-2)
    return total


def per_head(x: Array, batch_shape: tuple[int, ...]) -> Array:
    """(Hq,) or (B, Hq) values, broadcast against (..., Hq, L, S) scores."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim == 2:  # (B, Hq): B is the first batch axis
        x = x.reshape((x.shape[0],) + (1,) * (len(batch_shape) - 2) + (x.shape[1],))
    return x[..., None, None]


def logits(query: Array, key: Array, attn_mask: Optional[Mask] = None, *,
           is_causal: bool = False, scale: Optional[float] = None,
           causal_alignment: Union[str, int] = "upper_left",
           window_size: Optional[tuple[int, int]] = None,
           alibi_slopes: Optional[Array] = None,
           softcap: Optional[float] = None) -> tuple[Array, Array, float]:
    """Steps 2 and 3 with the variants in the kernels' order
    (csrc/fa_kern_scores.h), key already repeated for GQA: the scaled
    scores Q K^T * scale, the logits (-inf where hidden), and the scale."""
    E = query.shape[-1]
    L, S = query.shape[-2], key.shape[-2]
    # where each query sits among the keys: i' = i, i + S - L (lower right)
    # or i + k for an int k
    offset = (causal_alignment if isinstance(causal_alignment, int)
              else S - L if causal_alignment == "lower_right" else 0)
    i = np.arange(L)[:, None] + offset
    j = np.arange(S)[None, :]

    scale = scale if scale is not None else (1 / math.sqrt(E) if E else 1.0)
    scaled = (query @ np.swapaxes(key, -1, -2)) * scale                       # step 2: Q K^T
    scores = scaled
    if softcap is not None:                                # soft-cap (Gemma 2)
        scores = softcap * np.tanh(scores / softcap)

    visible = np.ones(scores.shape, dtype=bool)                                # step 3: mask
    # not in place: a mask may have batch axes that only value has
    if attn_mask is not None and attn_mask.dtype == np.bool_:
        visible = visible & attn_mask
    elif attn_mask is not None:
        visible = visible & (attn_mask != -np.inf)
        scores = scores + attn_mask
    if alibi_slopes is not None:                           # ALiBi (Press et al. 2022)
        scores = scores - per_head(alibi_slopes, scores.shape[:-2]) * np.abs(i - j)
    if is_causal:
        visible = visible & (j <= i)
    if window_size is not None:                            # sliding window
        left, right = window_size
        if left >= 0:
            visible = visible & (j >= i - left)
        if right >= 0:
            visible = visible & (j <= i + right)
    return scaled, np.where(visible, scores, -np.inf), scale


def with_sinks(scores: Array, sinks: Optional[Array]) -> Array:
    """The logits with the sink's as one more key, with no value (gpt-oss)."""
    if sinks is None:
        return scores
    sink = np.broadcast_to(per_head(sinks, scores.shape[:-2]), scores.shape[:-1] + (1,))
    return np.concatenate([scores, sink], axis=-1)


def scaled_dot_product_attention(query: Array, key: Array, value: Array,
                                 attn_mask: Optional[Mask] = None, *, is_causal: bool = False,
                                 scale: Optional[float] = None, enable_gqa: bool = False,
                                 causal_alignment: Union[str, int] = "upper_left",
                                 need_weights: bool = False, return_lse: bool = False,
                                 window_size: Optional[tuple[int, int]] = None,
                                 alibi_slopes: Optional[Array] = None,
                                 softcap: Optional[float] = None,
                                 sinks: Optional[Array] = None) -> Result:
    """softmax(query @ key^T * scale + mask) @ value, step by step, with the
    variants in the kernels' order (csrc/fa_kern_scores.h).

    fastattn.scaled_dot_product_attention's arguments, keyword-only after
    attn_mask: there is no dropout_p here, so PyTorch's positional order
    would shift them.  Returns out, then the weights and the log-sum-exp
    when asked for."""
    if enable_gqa:
        group = query.shape[-3] // key.shape[-3]
        key = np.repeat(key, group, axis=-3)
        value = np.repeat(value, group, axis=-3)
    scores = with_sinks(logits(query, key, attn_mask, is_causal=is_causal, scale=scale,
                               causal_alignment=causal_alignment, window_size=window_size,
                               alibi_slopes=alibi_slopes, softcap=softcap)[1], sinks)
    weights = softmax(scores, axis=-1)                                         # step 4
    m = np.max(scores, axis=-1, initial=-np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):  # log(0) = -inf: nothing visible
        lse = m + np.log(np.sum(np.exp(scores - np.where(m == -np.inf, 0, m)[..., None]),
                                axis=-1))
    if sinks is not None:
        weights = weights[..., :-1]
    out = weighted_sum(weights, value)                                         # step 5
    extra = ((weights,) if need_weights else ()) + ((lse,) if return_lse else ())
    return (out,) + extra if extra else out  # type: ignore[return-value]


def sum_to(x: Array, shape: tuple[int, ...]) -> Array:
    """The gradient x of an input of this shape that was broadcast to x's."""
    while x.ndim > len(shape):
        x = x.sum(axis=0)
    axes = tuple(d for d, n in enumerate(shape) if n == 1 and x.shape[d] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def attention_backward(grad_out: Array, query: Array, key: Array, value: Array,
                       attn_mask: Optional[Mask] = None, *, is_causal: bool = False,
                       scale: Optional[float] = None, enable_gqa: bool = False,
                       causal_alignment: Union[str, int] = "upper_left",
                       window_size: Optional[tuple[int, int]] = None,
                       alibi_slopes: Optional[Array] = None, softcap: Optional[float] = None,
                       sinks: Optional[Array] = None) -> tuple[Array, ...]:
    """The gradients of scaled_dot_product_attention's output (grad_out
    given) with respect to query, key and value (and sinks), by the chain
    rule through each step, every intermediate held: the softmax's
    dS = P (dP - rowsum(P dP)), the soft-cap's tanh' = 1 - tanh^2, and for
    GQA the sum over each group's query heads."""
    group = query.shape[-3] // key.shape[-3] if enable_gqa else 1
    k = np.repeat(key, group, axis=-3) if group > 1 else key
    v = np.repeat(value, group, axis=-3) if group > 1 else value
    scaled, scores, scale = logits(query, k, attn_mask, is_causal=is_causal, scale=scale,
                                   causal_alignment=causal_alignment, window_size=window_size,
                                   alibi_slopes=alibi_slopes, softcap=softcap)
    weights = softmax(with_sinks(scores, sinks), axis=-1)    # the sink's in the last column
    p = weights[..., :scores.shape[-1]]
    grad_v = np.swapaxes(p, -1, -2) @ grad_out                       # out = P V
    grad_p = np.concatenate([grad_out @ np.swapaxes(v, -1, -2),       # the sink has no value
                             np.zeros(weights.shape[:-1] + (weights.shape[-1] - p.shape[-1],))],
                            axis=-1)
    with np.errstate(invalid="ignore"):  # 0 * inf at hidden keys, discarded by the where
        grad_s = np.where(weights != 0, weights * (
            grad_p - np.sum(np.where(weights != 0, weights * grad_p, 0), axis=-1, keepdims=True)),
            0)                                                          # through the softmax
    S = scores.shape[-1]
    grad_sink, grad_s = grad_s[..., S:], grad_s[..., :S]               # the sink's column, if any
    if softcap is not None:
        grad_s = grad_s * (1 - np.tanh(scaled / softcap) ** 2)
    with np.errstate(invalid="ignore"):
        grad_q = scale * weighted_sum(grad_s, k)                       # S = scale Q K^T
        grad_k = scale * weighted_sum(np.swapaxes(grad_s, -1, -2), query)
    if group > 1:  # each key/value head's gradient: the sum over its query heads
        shape = grad_k.shape[:-3] + (key.shape[-3], group) + grad_k.shape[-2:]
        grad_k = grad_k.reshape(shape).sum(axis=-3)
        grad_v = grad_v.reshape(shape[:-1] + (value.shape[-1],)).sum(axis=-3)
    grads = (sum_to(grad_q, query.shape), sum_to(grad_k, key.shape),
             sum_to(grad_v, value.shape))
    if sinks is None:
        return grads
    g = grad_sink.sum(axis=(-2, -1))                                 # over the rows
    s = np.asarray(sinks)
    if s.ndim == 2:  # (B, Hq): B is the first batch axis
        g = g.reshape(g.shape[0], -1, g.shape[-1]).sum(axis=1)
    else:
        g = g.reshape(-1, g.shape[-1]).sum(axis=0)
    return grads + (g,)


def rotary(x: Array, positions: NDArray[np.integer[Any]], cos: Array, sin: Array,
           interleaved: bool = False) -> Array:
    """Rotary position embedding of x (n, H, D) at positions (n,): the
    first rotary_dim = 2 * cos.shape[1] features rotated in pairs (i, i +
    rotary_dim / 2), or (2i, 2i + 1) when interleaved; the rest copied."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]   # (n, 1, half)
    a = np.arange(half) * 2 if interleaved else np.arange(half)      # the pairs' indices
    b = a + (1 if interleaved else half)
    y = x.copy()
    y[..., a] = x[..., a] * c - x[..., b] * s
    y[..., b] = x[..., b] * c + x[..., a] * s
    return y


def paged_attention(query: Array, key_cache: Array, value_cache: Array,
                    block_table: NDArray[np.integer[Any]], seq_lens: NDArray[np.integer[Any]],
                    cu_seqlens_q: NDArray[np.integer[Any]], *, is_causal: bool = True,
                    key_mean: Optional[Array] = None,
                    tree_mask: Optional[NDArray[np.bool_]] = None,
                    tree_mask_indptr: Optional[NDArray[np.integer[Any]]] = None,
                    **options: Any) -> Array:
    """fastattn.paged_attention (float caches): each sequence's keys and
    values gathered from its blocks in order (with key_mean (B, Hkv, E),
    sequence b's keys are the stored ones plus key_mean[b]), then attention
    of its queries, its last positions, with lower-right alignment, under
    its tree mask where it has one (an (L, L) block of tree_mask from
    tree_mask_indptr[b], over its last L keys; the keys before all
    visible).  options as for scaled_dot_product_attention; alibi_slopes
    (B, Hq) are per sequence."""
    block_size = key_cache.shape[2]
    outs = []
    for b in range(len(seq_lens)):
        j = np.arange(seq_lens[b])
        blocks = block_table[b, j // block_size]
        k = key_cache[blocks, :, j % block_size].transpose(1, 0, 2)  # (Hkv, S, E)
        if key_mean is not None:
            k = k + np.asarray(key_mean)[b][:, None, :]
        v = value_cache[blocks, :, j % block_size].transpose(1, 0, 2)
        q = query[cu_seqlens_q[b]:cu_seqlens_q[b + 1]].transpose(1, 0, 2)
        seq = dict(options)
        L, S = q.shape[1], len(j)
        if tree_mask is not None:
            at = (np.concatenate(([0], np.cumsum(np.diff(cu_seqlens_q) ** 2)))
                  if tree_mask_indptr is None else tree_mask_indptr)
            if at[b + 1] > at[b]:
                seq["attn_mask"] = np.ones((L, S), np.bool_)
                seq["attn_mask"][:, S - L:] = tree_mask[at[b]:at[b + 1]].reshape(L, L)
        if seq.get("alibi_slopes") is not None and np.ndim(seq["alibi_slopes"]) == 2:
            seq["alibi_slopes"] = seq["alibi_slopes"][b]
        out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True,
                                           causal_alignment="lower_right", **seq)
        outs.append(cast(Array, out).transpose(1, 0, 2))
    return np.concatenate(outs) if outs else np.zeros((0, query.shape[1], value_cache.shape[3]))


def int8_query(query: Array, group: Optional[int] = None) -> Array:
    """The query as precision="int8" reads it: each row's groups of `group`
    features (None: the whole row; 32 against int4 caches) rounded in
    float32 to int8 codes times their scale max|x| / 127, ties to even, then
    read back in float64.  Its scores against the decoded keys are those of
    the int8 mode in exact arithmetic; a group with a NaN or an inf reads
    back as NaN (codes 0 times a scale of NaN or inf)."""
    x = np.asarray(query, np.float32)
    E = x.shape[-1]
    g = E if group is None else group
    pad = -E % g if E else 0
    groups = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]).reshape(
        x.shape[:-1] + ((E + pad) // g if g else 0, g))
    with np.errstate(invalid="ignore"):
        d = np.max(np.abs(groups), axis=-1, keepdims=True, initial=0) / np.float32(127)
        d = np.where(np.isnan(groups).any(axis=-1, keepdims=True), np.float32(np.nan), d)
        coded = (d > 0) & np.isfinite(d)
        codes = np.where(coded, np.clip(np.rint(groups / np.where(coded, d, 1)), -127, 127), 0)
        back = (codes.astype(np.float64) * d.astype(np.float64))
    back = np.where(np.isfinite(d), back, np.nan)
    return back.reshape(x.shape[:-1] + (E + pad,))[..., :E]


def int8_mode_operands(query: Array, key: Array, value: Array,
                       key_seen: Optional[Array] = None) -> tuple[Array, Array, Array]:
    """What scaled_dot_product_attention(precision="int8") reads of its
    operands, in float64, as query, key and value of an exact call with
    ``scale=1/sqrt(E)`` given: the keys less their mean over the positions
    (summed in float64; over the rows without a NaN or an inf; no mean
    where that would push a key past float32's range), each key and value
    row rounded to int8 codes ``rint(x * (127 / max|row|))`` (both scaled
    by 2^64 first for rows too small for that quotient) times
    max|row| / 127 (NaN for a row with a non-finite value), the
    query rounded as int8_query; the mean's term q . mean joins every score
    as an extra feature.  key_seen (bool, key's shape without its last
    axis; None: all): the keys some query sees through the call's mask,
    the only ones the mean is taken over.  The weights' rounding (7 bits
    per 64 keys) is left out: tests bound it.  Scores equal the mode's in
    exact arithmetic."""
    k = np.ascontiguousarray(key, np.float32)
    finite = np.isfinite(k).all(axis=-1, keepdims=True)
    counted = finite if key_seen is None else finite & np.asarray(key_seen, bool)[..., None]
    count = np.maximum(counted.sum(axis=-2), 1)
    mean = (np.where(counted, k, 0).sum(axis=-2, dtype=np.float64) / count).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        smoothed = k - mean[..., None, :]
        spoilt = (finite & ~np.isfinite(smoothed).all(axis=-1, keepdims=True)).any(axis=(-2, -1))
        mean[spoilt] = 0
        smoothed = k - mean[..., None, :]

    def rows(x: Array) -> Array:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            m = np.abs(x).max(axis=-1, keepdims=True, initial=0).astype(np.float32)
            # rows too small for 127 / m: both scaled by 2^64 first (exactly)
            f = np.where(m < np.float32(127) / np.finfo(np.float32).max, np.float32(2.0 ** 64),
                         np.float32(1))
            codes = np.clip(np.nan_to_num(np.rint(x * f * (np.float32(127) / (m * f))), nan=0.0),
                            -127, 127)
            d = m / np.float32(127)
            return np.where(np.isfinite(d), codes * d.astype(np.float64), np.nan)

    means = np.broadcast_to(mean[..., None, :], k.shape).astype(np.float64)
    q = np.asarray(query, np.float32)
    return (np.concatenate([int8_query(q), q.astype(np.float64)], axis=-1),
            np.concatenate([rows(smoothed), means], axis=-1),
            rows(np.asarray(value, np.float32)))


def hadamard(n: int) -> Array:
    """rotate_k's rotation in float64, entry by entry: features i and j in
    one block of p (the largest power of two dividing n) get
    (-1)^popcount(i & j) / sqrt(p), others 0 (Walsh's form of Sylvester's
    matrix)."""
    p = n & -n if n > 0 else 1
    i, j = np.indices((n, n))
    same = i // p == j // p
    sign = np.vectorize(lambda x: (-1.0) ** bin(x).count("1"))(i % p & j % p) if n else i
    return np.where(same, sign / np.sqrt(p), 0.0)


def stored_keys(key: Array, rotate: bool, mean: Optional[Array] = None) -> Array:
    """The keys a cache with rotate_k and smooth_k quantises: key (..., E)
    times the rotation, less mean (the rotated keys' mean over the first
    append), in float64.  Attention over them with the query rotated alike
    and scale * q . mean added to every score is attention over key."""
    k = np.asarray(key, np.float64)
    k = k @ hadamard(k.shape[-1]) if rotate else k
    return k if mean is None else k - mean


def self_attention(x: Array, w_q: Array, w_k: Array, w_v: Array, **kwargs: Any) -> Result:
    """Step 1 too: Q = X W_Q, K = X W_K, V = X W_V, then attention."""
    return scaled_dot_product_attention(x @ w_q, x @ w_k, x @ w_v, **kwargs)


def split_heads(x: Array, num_heads: int) -> Array:
    """(..., L, H*D) -> (..., H, L, D)"""
    D = x.shape[-1] // num_heads  # explicit: reshape cannot infer -1 for an empty x
    return np.swapaxes(x.reshape(x.shape[:-1] + (num_heads, D)), -3, -2)


def merge_heads(x: Array) -> Array:
    """(..., H, L, D) -> (..., L, H*D)"""
    x = np.swapaxes(x, -3, -2)
    return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))


def multi_head_attention(query: Array, key: Array, value: Array, num_heads: int,
                         q_proj_weight: Array, k_proj_weight: Array, v_proj_weight: Array,
                         out_proj_weight: Array, in_proj_bias: Optional[Array] = None,
                         out_proj_bias: Optional[Array] = None,
                         key_padding_mask: Optional[Mask] = None,
                         attn_mask: Optional[Mask] = None, is_causal: bool = False,
                         need_weights: bool = False, average_attn_weights: bool = True) -> Result:
    """nn.MultiheadAttention's forward on batch-first (N, L, E) inputs, step
    by step: project, split heads, attention, merge heads, output projection.

    The key/value heads are k_proj_weight.shape[0] // head_dim (fewer than
    num_heads: grouped-query attention).  Masks in nn.MultiheadAttention's
    convention: bool True = ignore, floating added; key_padding_mask (N, S),
    attn_mask (L, S) or (N * num_heads, L, S).  A row with nothing visible
    gives zeros before the output projection."""
    E = q_proj_weight.shape[0]
    head_dim = E // num_heads
    kv_heads = k_proj_weight.shape[0] // head_dim
    bq, bk, bv = (0, 0, 0) if in_proj_bias is None else np.split(
        in_proj_bias, [E, E + kv_heads * head_dim])
    q = split_heads(query @ q_proj_weight.T + bq, num_heads)          # (N, H, L, D)
    k = split_heads(key @ k_proj_weight.T + bk, kv_heads)
    v = split_heads(value @ v_proj_weight.T + bv, kv_heads)
    N, L, S = query.shape[0], query.shape[1], key.shape[1]

    additive = np.zeros((N, num_heads, L, S))                         # True = ignore -> -inf
    for m in (key_padding_mask if key_padding_mask is None else key_padding_mask[:, None, None, :],
              attn_mask if attn_mask is None or attn_mask.ndim == 2
              else attn_mask.reshape(N, num_heads, L, S)):
        if m is not None:
            additive = additive + (np.where(m, -np.inf, 0.0) if m.dtype == np.bool_ else m)
    out, weights = cast(tuple[Array, Array], scaled_dot_product_attention(
        q, k, v, attn_mask=additive, is_causal=is_causal, enable_gqa=kv_heads != num_heads,
        need_weights=True))
    out = merge_heads(out) @ out_proj_weight.T                        # concat, W_O
    if out_proj_bias is not None:
        out = out + out_proj_bias
    if average_attn_weights:
        weights = weights.mean(axis=1)
    return (out, weights) if need_weights else out
