"""The internal call layer under the public modules: from their arguments
to the kernels, one route per kind of call.  The public modules call these
names and never each other's private ones.

- Dense calls (scaled_dot_product_attention, KVCache.attend): ``route``
  dispatches between ``common_call``, the fast path of a common call (cheap
  checks, straight to the kernel), and ``checked_attention``, the checked
  general path of every option.
- Ragged calls (paged_attention, varlen_attention, PagedKVCache.attend):
  ``ragged``, the options' checks and the kernel, after the caller checked
  its sequences.
"""
from __future__ import annotations

import contextlib
import math
from contextvars import ContextVar
from typing import Any, Callable, Iterator, List, Mapping, NamedTuple, Optional, Union

import numpy as np

from . import _checks as C
from . import _cascade, _core, _runtime, _tuning, _variants
from ._storage import narrow, query_store
from ._tree import Trees, no_positions
from ._typing import Alignment, Float, MaskArray, NDArray, Result

_MAX_FEATURES = _core.ATTN_MAX_FEATURES  # the kernels' bound on E and Ev (csrc/fastattn.h)
# the fast path's dtypes: their element bound, and the largest scale they hold
_COMMON_DTYPES = {dt: (C.max_elements(dt), largest) for dt, largest in C.LARGEST.items()}
_BOOL = np.dtype(np.bool_)
# where ragged calls made under reads() add the bytes their kernels stream
_READS: ContextVar[Optional[List[int]]] = ContextVar("fastattn_reads", default=None)


@contextlib.contextmanager
def reads() -> Iterator[List[int]]:
    """The bytes of keys and values each ragged call in the block streams
    (a shared block once for all the sequences that hold it), as counted by
    the scheduler's plan: `fastattn bench --serving`'s "MB read"."""
    counts: List[int] = []
    token = _READS.set(counts)
    try:
        yield counts
    finally:
        _READS.reset(token)


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


def common_call(query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
                 attn_mask: Optional[MaskArray], dropout_p: object, is_causal: object,
                 scale: object, enable_gqa: object, causal_alignment: object,
                 out: Optional[NDArray[Float]], num_threads: Optional[int],
                 stored: Optional[StoredKV] = None) -> Optional[NDArray[Float]]:
    """scaled_dot_product_attention for the common call, or None for a call
    to leave to the checked general path.  A tiny call is mostly its checks: these
    take a fraction of the checked general path's time (plain type, identity and
    tuple tests, no message built).  The caller has seen plain ndarrays (out
    one or None) and the variants, need_weights and return_lse at their
    defaults (the kernel's defaults are those of _variants.NONE, and the
    native storage of float32 and float64).  Grouped-query calls and an out
    array are taken too: a model's decoding step makes both, once per layer
    and token.  So are a float32 KVCache's keys and values in another
    storage (stored, as checked_attention takes it), whose shapes the cache has
    checked: the checked general path took more than twice their time
    (threads-and-speed.md, "Small calls").

    It takes only calls that the checked general path accepts, and passes the kernel
    what the checked general path passes, so the result is bitwise the same.  It
    raises only where the checked general path raises the same error:
    resolve_threads is called once every check the checked general path makes
    before it has passed here.  Anything else is None, and the checked general path
    gives the error."""
    dtype = query.dtype
    bounds = _COMMON_DTYPES.get(dtype)
    if stored is None:
        if bounds is None or key.dtype != dtype or value.dtype != dtype:
            return None
    elif bounds is None or dtype != np.float32:  # 16-bit: rounded at the end (checked_attention)
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
    elif type(scale) is not float or not (-largest <= scale <= largest and
                                          (scale == 0 or abs(scale) >= 1e-38)):
        return None  # (a subnormal scale: check_scale's, which may refuse it)
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
    else:  # the checked general path's checks; its error is left to it
        try:
            C.check_out(out, batch + (L, Ev), dtype,
                        {"query": query, "key": key, "value": value, "attn_mask": attn_mask})
        except (TypeError, ValueError):
            return None
    nthreads = _runtime.resolve_threads(num_threads)
    if out.size:
        isa, q, k, v = _runtime.isa(), C.kernel_view(query), C.kernel_view(key), C.kernel_view(value)
        # a cache's storage: checked_attention's call, the scales as the cache holds them
        kv_store, k_scale, v_scale, precision, key_mean = (
            (_core.STORE_NATIVE, None, None, _core.PRECISION_EXACT, None) if stored is None else
            (stored.store, stored.key_scale, stored.value_scale, stored.precision,
             stored.key_mean))
        # nbytes: at least the bytes read (broadcast axes counted once)
        tkey, nbytes = (isa, nthreads, kv_store, False, precision), key.nbytes + value.nbytes
        # a tiny call straight to the kernel, its arguments positional: a
        # closure and a keyword cost it about a sixth of its time
        if L > _tuning.DECODE_ROWS or nbytes < _tuning.MIN_BYTES:
            if stored is None:
                _core.attention(isa, q, k, v, mask, kind, out, None, group, is_causal, offset,
                                scale, nthreads, _tuning.current(tkey))
            else:
                _core.attention(isa, q, k, v, mask, kind, out, None, group, is_causal, offset,
                                scale, nthreads, _tuning.current(tkey), kv_store=kv_store,
                                k_scale=k_scale, v_scale=v_scale, precision=precision,
                                key_mean=key_mean, int8_dot=_runtime.int8_dot())
        else:
            _tuning.run(tkey, _tuning.distinct_bytes(key, value), True,
                        lambda prefetch: _core.attention(
                            isa, q, k, v, mask, kind, out, None, group, is_causal, offset, scale,
                            nthreads, prefetch, kv_store=kv_store, k_scale=k_scale,
                            v_scale=v_scale, precision=precision, key_mean=key_mean,
                            int8_dot=_runtime.int8_dot()))
    return out


def route(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
           attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
           scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
           need_weights: bool, return_lse: bool, window_size: Optional[tuple[int, int]],
           alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
           sinks: Optional[NDArray[Any]], out: Optional[NDArray[Any]],
           num_threads: Optional[int], stored: Optional[StoredKV] = None) -> Result[Any]:
    """The common call's fast path (common_call) when it takes the call,
    else the checked general path (checked_attention), whose arguments
    these are."""
    if (type(query) is np.ndarray and type(key) is np.ndarray and type(value) is np.ndarray
            and (out is None or type(out) is np.ndarray) and need_weights is False
            and return_lse is False and window_size is None and alibi_slopes is None
            and softcap is None and sinks is None):
        result = common_call(query, key, value, attn_mask, dropout_p, is_causal, scale,
                              enable_gqa, causal_alignment, out, num_threads, stored)
        if result is not None:
            return result
    return checked_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment, need_weights, return_lse, window_size, alibi_slopes,
                      softcap, sinks, out, num_threads, stored)


class StoredKV(NamedTuple):
    """How a KVCache stores its keys and values when not in query's dtype:
    the kernels' storage kind (_core.STORE_*), for int8 and float8_e4m3fn
    the float32 scale of every row, shaped like key and value without their
    last axis, the elements of a value row (Ev; not value's last axis
    for int4, whose rows are blocks of bytes), the kernels' precision
    (C.check_precision's), and the mean the keys were stored less
    (smooth_k: key's shape without its positions, in the compute dtype)."""
    store: int
    key_scale: Optional[NDArray[np.float32]] = None
    value_scale: Optional[NDArray[np.float32]] = None
    value_dim: Optional[int] = None
    precision: int = _core.PRECISION_EXACT
    key_mean: Optional[NDArray[Any]] = None


class Call(NamedTuple):
    """A dense call's arguments, checked: its dtype and the one computed in,
    lengths, batch shapes of the queries and of the keys and values, query
    heads per key/value head, options as the kernels take them, and the mask
    as a view of (..., Hq, L, S) with its kind (_core.MASK_*)."""
    dtype: np.dtype[Any]
    compute: np.dtype[Any]
    L: int
    S: int
    E: int
    Ev: int
    batch: C.Shape
    kv_batch: C.Shape
    group: int
    causal: bool
    offset: int
    scale: float
    nthreads: int
    kind: int
    mask: Optional[NDArray[Any]]
    variants: _variants.Variants


def check_call(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
               attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
               scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
               window_size: Optional[tuple[int, int]], alibi_slopes: Optional[NDArray[Any]],
               softcap: Optional[float], sinks: Optional[NDArray[Any]],
               num_threads: Optional[int], stored: Optional[StoredKV] = None) -> Call:
    """The checks of a dense call (scaled_dot_product_attention's, and of
    its backward): with stored, key and value are a KVCache's buffers in
    that storage (query's dtype is then the only one checked)."""
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
        raise ValueError(f"dropout_p must be 0 (fastattn has no dropout), "
                         f"got {dropout_p}")
    causal = C.check_bool(is_causal, "is_causal")
    gqa = C.check_bool(enable_gqa, "enable_gqa")
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
        C.check_head_groups(Hq, Hkv)
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
    return Call(dtype, compute, L, S, E, Ev, batch, kv_batch, group, causal, offset, scale,
                nthreads, kind, mask, variants)


def checked_attention(query: NDArray[Any], key: NDArray[Any], value: NDArray[Any],
               attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
               scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
               need_weights: bool, return_lse: bool, window_size: Optional[tuple[int, int]],
               alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
               sinks: Optional[NDArray[Any]], out: Optional[NDArray[Any]],
               num_threads: Optional[int], stored: Optional[StoredKV] = None) -> Result[Any]:
    """scaled_dot_product_attention's work; with stored, key and value are a
    KVCache's buffers in that storage (query's dtype is then the only one
    checked)."""
    call = check_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment, window_size, alibi_slopes, softcap, sinks, num_threads,
                      stored)
    dtype, compute, L, S, E, Ev, batch, kv_batch, group = call[:9]
    causal, offset, scale, nthreads, kind, mask, variants = call[9:]
    packed = stored is not None and stored.store == _core.STORE_Q4  # rows of bytes
    weights_wanted = C.check_bool(need_weights, "need_weights")
    lse_wanted = C.check_bool(return_lse, "return_lse")

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
    kv_store, k_scale, v_scale, key_mean = store, None, None, None
    if stored is not None:
        if stored.key_mean is not None:
            key_mean = C.broadcast_view(stored.key_mean, kv_batch + (E,))
        kv_store = stored.store
        if stored.key_scale is not None and stored.value_scale is not None:
            k_scale = C.broadcast_view(stored.key_scale, kv_batch + (S,))
            v_scale = C.broadcast_view(stored.value_scale, kv_batch + (S,))
    if result.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        isa = _runtime.isa()
        precision = _core.PRECISION_EXACT if stored is None else stored.precision
        _tuning.run((isa, nthreads, kv_store, False, precision), _tuning.distinct_bytes(k, v),
                    L <= _tuning.DECODE_ROWS,
                    lambda prefetch: _core.attention(
                        isa, q, k, v, mask, kind, result, weights, group, causal, offset, scale,
                        nthreads, window_left=variants.window_left,
                        window_right=variants.window_right, softcap=variants.softcap,
                        slopes=variants.slopes, sinks=variants.sinks, lse=lse, q_store=store,
                        kv_store=kv_store, k_scale=k_scale, v_scale=v_scale,
                        prefetch=prefetch, precision=precision, key_mean=key_mean,
                        int8_dot=_runtime.int8_dot()))
    half = compute != dtype  # 16-bit inputs: the float32 results rounded once to their dtype
    out = narrow(result, dtype, nthreads, out) if half else result
    if half and weights is not None:
        weights = narrow(weights, dtype, nthreads)
    results = (out,) + tuple(x for x in (weights, lse) if x is not None)  # lse: float32
    return results[0] if len(results) == 1 else results  # type: ignore[return-value]


# How far each row's recomputed weights, the sink's included, may sum from 1
# before the log-sum-exp is taken for another call's, beyond what its own
# rounding explains (_weight_sums): the forward's sums and the recomputed
# exps differ by roundings of about S eps at worst
_LSE_SLACK = {np.dtype(np.float32): 1e-3, np.dtype(np.float64): 1e-9}
# ulps of a log-sum-exp (and of the largest logit beside it) that its
# rounding and the logits' recomputation may move it by
_LSE_ULPS = 8


def _sum_to(x: NDArray[Any], shape: C.Shape) -> NDArray[Any]:
    """x summed over the axes that shape broadcasts to x's (leading ones
    and axes of 1): a broadcast input's gradient, in an order fixed by the
    shapes alone."""
    lead = x.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + d for d, n in enumerate(shape)
                                      if n == 1 and x.shape[lead + d] != 1)
    return x.sum(axis=axes).reshape(shape) if axes else x


class GradPlan(NamedTuple):
    """The work of a backward call over sequences of L[b] queries and S[b]
    keys, as _core's backward takes it: the tasks (sequence, key/value head,
    chunk of keys, offsets in parts and sums), costlier first, the merges
    (sequence, query head, first row of a query block, its chunk 0's offset
    and the chunks' stride in parts, the same in sums, the chunks), and the
    scratch the tasks write: sequence b's parts as (chunks, Hq, query
    blocks, E, query block), its sums as (chunks, Hq, L[b])."""
    tasks: NDArray[np.int64]
    merges: NDArray[np.int64]
    parts: NDArray[Any]
    sums: NDArray[Any]


def _grad_plan(L: NDArray[np.int64], S: NDArray[np.int64], Hq: int, group: int, E: int,
               compute: np.dtype[Any]) -> GradPlan:
    qb = _core.attn_query_block(compute.itemsize)
    nqb = -(-L // qb)
    sizes, inverse = np.unique(S, return_inverse=True)
    kv_heads = Hq // group if group else 0
    keys = np.array([_core.grad_chunk_keys(int(n), kv_heads) for n in sizes], np.int64)[inverse]
    chunks = np.maximum(-(-S // keys), 1)
    part_s, sum_s = Hq * nqb * E * qb, Hq * L  # a chunk's
    parts_at = np.cumsum(chunks * part_s) - chunks * part_s
    sums_at = np.cumsum(chunks * sum_s) - chunks * sum_s

    def each(per_seq: NDArray[np.int64]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(sequence, its index 0..per_seq[b]-1) of every item of every sequence"""
        seq = np.repeat(np.arange(L.shape[0]), per_seq)
        return seq, np.arange(int(per_seq.sum())) - np.repeat(np.cumsum(per_seq) - per_seq,
                                                              per_seq)
    seq, local = each(chunks * kv_heads)
    head, chunk = local // chunks[seq], local % chunks[seq]
    first = chunk * Hq + head * group  # the task's first query head in its chunk
    tasks = np.stack([seq, head, chunk, parts_at[seq] + first * nqb[seq] * E * qb,
                      sums_at[seq] + first * L[seq]], axis=1)
    tasks = tasks[np.argsort(-(L * S)[seq], kind="stable")]
    seq, local = each(Hq * nqb)
    head, block = local // nqb[seq], local % nqb[seq]
    merges = np.stack([seq, head, block * qb,
                       parts_at[seq] + (head * nqb[seq] + block) * E * qb, part_s[seq],
                       sums_at[seq] + head * L[seq] + block * qb, sum_s[seq], chunks[seq]],
                      axis=1)
    return GradPlan(np.ascontiguousarray(tasks, np.int64), np.ascontiguousarray(merges, np.int64),
                    np.empty(int((chunks * part_s).sum()), compute),
                    np.empty(int((chunks * sum_s).sum()), compute))


def _weight_sums(psum: NDArray[Any], lse: NDArray[Any], sinks: Optional[NDArray[Any]],
                 compute: np.dtype[Any], finite_inputs: Callable[[], bool],
                 score_rounding: Callable[[], float], name: str = "logsumexp"
                 ) -> tuple[NDArray[Any], Optional[NDArray[Any]]]:
    """Each row's sink weight exp(sink - lse) (0 without sinks), and None or
    the factors by which the rows' weights are to be computed again, once
    every row's weights, the sink's with them, are checked to sum to 1.
    A sum off by more than the slack and by more than the rounding of a
    large lse explains is refused (an lse of other inputs or options), as
    is a NaN lse where the inputs are finite (finite_inputs(): no score
    could be NaN; asked only of an lse with a NaN, as it reads every
    input).  Rows off by more than the slack are given score_rounding()
    more (asked only then: it reads q and k): what the forward's and the
    backward's sums of E products may differ by, which outgrows the
    slack for heads of about 2^19 features.  Any sum off by more than a
    row's own roundings (a large lse: an additive mask of the dtype's
    lowest hiding a row, a large bias) gets the factor 1 / sum, as the
    forward normalised the row."""
    with np.errstate(all="ignore"):
        sink = (np.exp(sinks[..., None] - lse.astype(np.float64)) if sinks is not None
                else np.zeros(lse.shape))
        total = psum + sink
        off = np.abs(total - 1) > _LSE_SLACK[compute]
        allowed = _LSE_ULPS * np.spacing(np.abs(lse)).astype(np.float64) + _LSE_SLACK[compute]
        log_total = np.abs(np.log(total))
        explained = log_total <= allowed
        if (off & ~explained).any():
            explained = log_total <= allowed + score_rounding()
        # rows with nothing visible (lse -inf, no sink) sum to 0; NaN rows are NaN's
        bad = np.where(lse == -np.inf, psum != 0, off & ~explained) & ~np.isnan(total)
        nan = np.isnan(lse)
        if nan.any() and finite_inputs():
            bad |= nan
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name} does not match these inputs: at row {at} it is "
                         f"{float(lse[at]):.6g} and the weights exp(logit - {name}) over the "
                         f"keys (the sink included) sum to {float(total[at]):.6g}, not 1; pass "
                         f"the lse that the forward call with return_lse=True returned for the "
                         f"same inputs and options")
    # rows further from 1 than a row's own roundings take (a large lse's
    # rounding, below the slack or explained) are normalised again
    redo = ((np.abs(total - 1) > 64 * float(np.finfo(compute).eps)) & (lse != -np.inf) &
            np.isfinite(total) & (total > 0))
    if not redo.any():
        return sink, None
    rnorm = np.where(redo, 1 / np.where(redo, total, 1), 1).astype(compute)
    return sink * rnorm, rnorm


def _finite_scores(q: NDArray[Any], k: NDArray[Any], v: NDArray[Any],
                   mask: Optional[NDArray[Any]], scale: float, compute: np.dtype[Any],
                   slopes: Optional[NDArray[Any]], distance: int) -> bool:
    """Whether no score can be NaN: finite inputs whose scores, with the
    mask's largest finite term and ALiBi's (slopes times at most `distance`
    positions), stay below the dtype's largest, a mask with neither NaN nor
    +inf (a NaN lse then belongs to another call).  The arrays as given,
    not broadcast."""
    with np.errstate(all="ignore"):
        bound = (float(np.abs(q).max(initial=0)) * float(np.abs(k).max(initial=0)) *
                 q.shape[-1] * abs(scale))
        if slopes is not None:
            bound += float(np.abs(slopes).max(initial=0)) * distance
        masked = mask is None or mask.dtype == np.bool_ or not bool(
            np.isnan(mask).any() or (mask == np.inf).any())
        if mask is not None and mask.dtype != np.bool_:
            bound += float(np.abs(mask[np.isfinite(mask)]).max(initial=0))
        return (bool(np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(v).all())
                and masked and bound < float(np.finfo(compute).max) / 4)


def _score_rounding(q: NDArray[Any], k: NDArray[Any], scale: float,
                    compute: np.dtype[Any]) -> float:
    """How far two sums of a score's E products, in different orders, may
    typically differ (a random walk of roundings, 4 standard deviations),
    for the largest |q||k| scale of any query and key row: 2 x 4 sqrt(E)
    eps x max |q_i| max |k_j| |scale|, twice for the forward's scores and
    the backward's.  The arrays as given, not broadcast."""
    E = q.shape[-1]
    if E == 0 or q.size == 0 or k.size == 0:
        return 0.0
    with np.errstate(all="ignore"):
        norms = [float(np.sqrt(np.square(x, dtype=np.float64).sum(axis=-1).max()))
                 for x in (q, k)]
    return 8 * math.sqrt(E) * float(np.finfo(compute).eps) * norms[0] * norms[1] * abs(scale)


def _sink_grad(sink: NDArray[Any], delta: NDArray[Any], sinks: Any) -> NDArray[Any]:
    """d/d sink = -sum over a head's rows of the sink's weight times D (the
    sink has no value), summed to sinks' shape ((Hq,), or (B, Hq) with B the
    first batch axis), in its dtype (float64 for integer sinks)."""
    g = -(sink * delta).sum(axis=-1)                       # the batch shape (..., Hq)
    s = np.asarray(sinks)
    if s.ndim == 2 and g.ndim >= 2:
        g = g.reshape(g.shape[0], -1, g.shape[-1]).sum(axis=1)
    else:
        g = g.reshape(-1, g.shape[-1]).sum(axis=0)
    want = s.dtype if np.issubdtype(s.dtype, np.floating) else np.dtype(np.float64)
    grad: NDArray[Any] = g.reshape(s.shape).astype(want)
    return grad


def _grad_arrays(names: tuple[str, ...], arrays: tuple[Any, ...], shapes: tuple[C.Shape, ...],
                 dtypes: tuple[np.dtype[Any], ...]) -> list[NDArray[Any]]:
    """grad_out, out and logsumexp as arrays of the forward's shapes and dtypes."""
    checked = []
    for name, a, shape, want in zip(names, arrays, shapes, dtypes):
        a = C.require_array(a, name)
        if a.shape != shape:
            raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected "
                             f"{C.shape_str(shape)}, the forward's "
                             f"{'lse' if name in ('logsumexp', 'lse') else 'output'} of these "
                             "inputs")
        if a.dtype != want:
            raise TypeError(f"{name} has dtype {a.dtype}; expected {want}" +
                            (" (the forward's return_lse dtype)" if name in ("logsumexp", "lse")
                             else " (query's)"))
        checked.append(a)
    return checked


def _computed(x: NDArray[Any], compute: np.dtype[Any]) -> NDArray[Any]:
    """x as the kernels read it: 16-bit inputs as float32 copies."""
    return C.kernel_view(x if x.dtype == compute else x.astype(compute))


def _delta(dout: NDArray[Any], out: NDArray[Any]) -> NDArray[Any]:
    """D = rowsum(dO o O) (the kernels compute their own: this one serves
    the sinks' gradient), C-ordered so that its sums do not depend on the
    layout."""
    with np.errstate(all="ignore"):
        delta: NDArray[Any] = np.multiply(dout, out, order="C").sum(axis=-1)
    return delta


def backward(grad_out: NDArray[Any], query: NDArray[Any], key: NDArray[Any],
             value: NDArray[Any], out: NDArray[Any], logsumexp: NDArray[Any],
             attn_mask: Optional[MaskArray], dropout_p: float, is_causal: bool,
             scale: Optional[float], enable_gqa: bool, causal_alignment: Alignment,
             window_size: Optional[tuple[int, int]], alibi_slopes: Optional[NDArray[Any]],
             softcap: Optional[float], sinks: Optional[NDArray[Any]],
             num_threads: Optional[int]) -> tuple[NDArray[Any], ...]:
    """attention_backward's work: the checks of the forward's call, of
    grad_out, out and logsumexp against it, the kernels, the weights' sums
    checked (_weight_sums), and the gradients of broadcast inputs summed to
    their shapes."""
    call = check_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                      causal_alignment, window_size, alibi_slopes, softcap, sinks, num_threads)
    dtype, compute, L, S, E, Ev = call[:6]
    batch, variants = call.batch, call.variants
    grad_out, out, logsumexp = _grad_arrays(
        ("grad_out", "out", "logsumexp"), (grad_out, out, logsumexp),
        (batch + (L, Ev), batch + (L, Ev), batch + (L,)), (dtype, dtype, compute))
    given = [_computed(x, compute) for x in (query, key, value)]
    q = C.broadcast_view(given[0], batch + (L, E))
    k = C.broadcast_view(given[1], call.kv_batch + (S, E))
    v = C.broadcast_view(given[2], call.kv_batch + (S, Ev))
    dout, out_c, lse = _computed(grad_out, compute), _computed(out, compute), \
        C.kernel_view(logsumexp)
    dq = np.empty(batch + (L, E), compute)
    dk = np.empty(call.kv_batch + (S, E), compute)
    dv = np.empty(call.kv_batch + (S, Ev), compute)
    psum = np.empty(batch + (L,), compute)
    Hq = batch[-1] if batch else 1
    nseq = math.prod(batch[:-1]) if batch else 1
    plan = _grad_plan(np.full(nseq, L, np.int64), np.full(nseq, S, np.int64), Hq, call.group,
                      E, compute)
    slopes = None if variants.slopes is None else np.ascontiguousarray(variants.slopes)

    def kernels(rnorm: Optional[NDArray[Any]]) -> None:
        _core.attention_backward(
            _runtime.isa(), q, k, v, call.mask, call.kind, out_c, lse, dout, dq, dk, dv, psum,
            plan.parts, plan.sums, plan.tasks, plan.merges, call.group, call.causal,
            call.offset, call.scale, call.nthreads, window_left=variants.window_left,
            window_right=variants.window_right, softcap=variants.softcap, slopes=slopes,
            rnorm=rnorm)
    kernels(None)
    sink, rnorm = _weight_sums(psum, lse, variants.sinks, compute,
                               lambda: _finite_scores(given[0], given[1], given[2], attn_mask,
                                                      call.scale, compute, variants.slopes,
                                                      L + S + abs(call.offset)),
                               lambda: _score_rounding(given[0], given[1], call.scale, compute))
    if rnorm is not None:  # rows of an lse rounded off: again, each row normalised
        kernels(rnorm)
    grads = [_sum_to(g, np.shape(x)) for g, x in ((dq, query), (dk, key), (dv, value))]
    if compute != dtype:
        grads = [narrow(np.ascontiguousarray(g), dtype, call.nthreads) for g in grads]
    if sinks is not None:
        grads.append(_sink_grad(sink, _delta(dout, out_c), sinks))
    return tuple(grads)


def varlen_backward(grad_out: NDArray[Any], query: NDArray[Any], key: NDArray[Any],
                    value: NDArray[Any], out: NDArray[Any], lse: NDArray[Any],
                    dtype: np.dtype[Any], Ev: int, cu_q: NDArray[np.int64],
                    cu_k: NDArray[np.int64], causal: bool, causal_alignment: Union[str, int],
                    scale: Optional[float], window_size: Optional[tuple[int, int]],
                    alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
                    sinks: Optional[NDArray[Any]],
                    num_threads: Optional[int]) -> tuple[NDArray[Any], ...]:
    """varlen_attention_backward's work once the packed sequences are
    checked (varlen.packed): as backward, each sequence's chunks its own."""
    compute = C.compute_dtype(dtype)
    total_q, Hq, E = query.shape
    total_k, Hkv = key.shape[:2]
    grad_out, out, lse = _grad_arrays(
        ("grad_out", "out", "lse"), (grad_out, out, lse),
        ((total_q, Hq, Ev), (total_q, Hq, Ev), (Hq, total_q)), (dtype, dtype, compute))
    scale = C.check_scale(scale, E, compute)
    nthreads = _runtime.resolve_threads(num_threads)
    offset = C.alignment_offset(causal_alignment, 0, 0)  # per sequence: S - L too
    lower_right = isinstance(causal_alignment, str) and causal_alignment == "lower_right"
    L, S = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    B = L.shape[0]
    lengths = int(max(L.max(initial=0), 1)), int(max(S.max(initial=0), 1))
    variants = _variants.check(window_size, alibi_slopes, softcap, None, (B, Hq), *lengths,
                               compute, offset)
    sink_logits = None if sinks is None else _variants.per_head(sinks, "sinks", (Hq,),
                                                                finite=False)
    dout, out_c, lse = _computed(grad_out, compute), _computed(out, compute), C.kernel_view(lse)
    dq, dk = np.empty((total_q, Hq, E), compute), np.empty((total_k, Hkv, E), compute)
    dv, psum = np.empty((total_k, Hkv, Ev), compute), np.empty((Hq, total_q), compute)
    plan = _grad_plan(L, S, Hq, Hq // Hkv, E, compute)
    q, k, v = (_computed(x, compute) for x in (query, key, value))

    def kernels(rnorm: Optional[NDArray[Any]]) -> None:
        _core.varlen_backward(
            _runtime.isa(), q, k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], out_c,
            lse, dout, dq, dk, dv, psum, plan.parts, plan.sums, plan.tasks, plan.merges, cu_q,
            cu_k, np.ascontiguousarray(S), Hq // Hkv, causal, lower_right, offset, scale,
            nthreads, variants.window_left, variants.window_right, variants.softcap,
            None if variants.slopes is None else C.contiguous(variants.slopes), rnorm)
    kernels(None)
    sink, rnorm = _weight_sums(psum, lse, sink_logits, compute,
                               lambda: _finite_scores(q, k, v, None, scale, compute,
                                                      variants.slopes,
                                                      2 * sum(lengths) + abs(offset)),
                               lambda: _score_rounding(q, k, scale, compute), "lse")
    if rnorm is not None:  # rows of an lse rounded off: again, each row normalised
        kernels(rnorm)
    grads = [dq, dk, dv]
    if compute != dtype:
        grads = [narrow(g, dtype, nthreads) for g in grads]
    if sinks is not None:
        grads.append(_sink_grad(sink, _delta(dout, out_c).T, sinks))
    return tuple(grads)


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


def ragged(query: NDArray[Any], key_cache: NDArray[Any], value_cache: NDArray[Any],
           table: Optional[NDArray[np.int32]], kv_start: Optional[NDArray[np.int64]],
           lens: NDArray[np.int64], cu_q: NDArray[np.int64], q_lens: NDArray[np.int64],
           scales: tuple[Optional[NDArray[np.float32]], Optional[NDArray[np.float32]]],
           q_store: int, kv_store: int, Ev: int, causal: bool, lower_right: bool, offset: int,
           scale: Optional[float], window_size: Optional[tuple[int, int]],
           alibi_slopes: Optional[NDArray[Any]], softcap: Optional[float],
           sinks: Optional[NDArray[Any]], return_lse: bool, out: Optional[NDArray[Any]],
           num_threads: Optional[int], inputs: Mapping[str, Optional[NDArray[Any]]],
           precision: int = _core.PRECISION_EXACT, key_mean: Optional[NDArray[Any]] = None,
           trees: Optional[Trees] = None, cascade: bool = False
           ) -> Union[NDArray[Any], tuple[NDArray[Any], NDArray[Any]]]:
    """A ragged batch's call once its caches, keys' places, lengths and
    offsets are known good (_core.ragged's arguments: a block table, or
    with table None each sequence's first key row kv_start in the one block
    of the caches; q_lens the queries of each sequence; causal checked):
    the options' checks and the kernel.  paged_attention, varlen_attention
    and PagedKVCache.attend (with its own arrays, which it keeps good) come
    here.  inputs: what out must not overlap; precision: C.check_precision's;
    key_mean: (B, Hkv, E) C-contiguous in the compute dtype, the mean each
    sequence's keys were stored less (PagedKVCache's smooth_k), or None;
    trees: _tree.check's, or None; cascade: paged_attention's (_cascade)."""
    total_q, Hq, E = query.shape
    Hkv = key_cache.shape[1]
    B = lens.shape[0]
    dtype = query.dtype
    compute = C.compute_dtype(dtype)
    lse_wanted = C.check_bool(return_lse, "return_lse")
    scale = C.check_scale(scale, E, compute)
    if trees is not None:
        no_positions(window_size, alibi_slopes)
    nthreads = _runtime.resolve_threads(num_threads)
    lengths = int(max(q_lens.max(initial=0), 1)), int(max(lens.max(initial=0), 1))
    # (with lower_right, |i' - j| < L + S already: the int alignment's offset only)
    variants = _variants.check(window_size, alibi_slopes, softcap, None, (B, Hq), *lengths,
                               compute, offset)
    slopes = None if variants.slopes is None else C.contiguous(variants.slopes)
    sink = None if sinks is None else C.contiguous(
        _variants.per_head(sinks, "sinks", (Hq,), finite=False))

    out_shape = (total_q, Hq, Ev)
    if out is not None:
        C.check_out(out, out_shape, dtype,
                    {**inputs, "alibi_slopes": alibi_slopes, "sinks": sinks})
    if C.check_bool(cascade, "cascade"):
        windowed = variants.window_left >= 0 or variants.window_right >= 0
        if windowed or alibi_slopes is not None or key_mean is not None:
            raise ValueError("cascade=True cannot go with a window_size that hides keys, "
                             "alibi_slopes or a smoothed cache's key means: the prefix the "
                             "sequences share is attended once for queries whose positions and "
                             "means differ")
        if precision != _core.PRECISION_EXACT:
            raise ValueError('cascade=True cannot go with precision="int8": the shared '
                             "prefix is one matrix product of all the queries, whose int8 "
                             'rows are per decoding sequence; use precision="exact"')
        prefix = 0 if table is None else _cascade.common_prefix(table, lens, q_lens,
                                                                key_cache.shape[2])
        if prefix and table is not None:
            from .attention import merge_attention  # (attention imports this module)

            def part(q: NDArray[Any], t: NDArray[np.int32], n: NDArray[np.int64],
                     cu: NDArray[np.int64], ql: NDArray[np.int64], hide: Optional[bool],
                     s: Optional[NDArray[Any]], tr: Optional[Trees]) -> Any:
                return ragged(q, key_cache, value_cache, t, None, n, cu, ql, scales, q_store,
                              kv_store, Ev, causal if hide is None else hide, lower_right,
                              offset, scale, None, None, softcap, s, True, None, num_threads,
                              inputs, precision, None, tr)
            return _cascade.attend(part, query, table, lens, cu_q, q_lens, prefix,
                                   key_cache.shape[2], lse_wanted, out, sinks, trees,
                                   merge_attention)
    # the kernels write float32 for 16-bit queries, rounded to them at the end
    result = out if out is not None and compute == dtype else np.empty(out_shape, compute)
    lse = np.empty((Hq, total_q), compute) if lse_wanted else None
    if result.size or (lse is not None and lse.size):  # every row is in a sequence: all written
        isa = _runtime.isa()
        # the bytes of keys and values the call reads
        read = int(lens.sum()) * Hkv * (key_cache.shape[-1] + value_cache.shape[-1]) * \
            key_cache.itemsize
        q, kc, vc = C.kernel_view(query), C.kernel_view(key_cache), C.kernel_view(value_cache)
        counts = _READS.get()
        streamed = None if counts is None else np.zeros(1, np.int64)
        _tuning.run((isa, nthreads, kv_store, table is not None, precision), read,
                    lengths[0] <= _tuning.DECODE_ROWS,
                    lambda prefetch: _core.ragged(
                        isa, q, kc, vc, scales[0], scales[1], table, kv_start, lens, cu_q,
                        result, lse, Hq // Hkv, causal, lower_right, offset, scale, nthreads,
                        variants.window_left,
                        variants.window_right, variants.softcap, slopes, sink, q_store,
                        kv_store, prefetch=prefetch, precision=precision, key_mean=key_mean,
                        tree_mask=None if trees is None else trees.mask,
                        tree_at=None if trees is None else trees.at, read=streamed,
                        int8_dot=_runtime.int8_dot()))
        if counts is not None and streamed is not None:
            counts.append(int(streamed[0]))
    out = narrow(result, dtype, nthreads, out) if compute != dtype else result
    return out if lse is None else (out, lse)
