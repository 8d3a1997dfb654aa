"""paged_attention: one attention call for a ragged batch of sequences whose
keys and values lie in blocks of a shared pool (a paged cache)."""
from __future__ import annotations

from typing import Any, Optional, Union

import numpy as np

from . import _checks as C
from . import _core, _storage, _tree
from ._dispatch import ragged
from ._storage import query_store
from ._typing import Float, NDArray


def _ints(x: object, name: str, ndim: int, layout: str) -> NDArray[np.integer[Any]]:
    a = C.require_array(x, name, "np.int32")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {a.dtype}; expected int32 (or another integer dtype)")
    if a.ndim != ndim:
        raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected {layout}")
    return a


def _byte_caches(key_cache: NDArray[Any], value_cache: NDArray[Any], kv_cache_dtype: object
                 ) -> tuple[NDArray[Any], NDArray[Any], str]:
    """The caches as the kernels read them and the storage they hold:
    "auto" (their dtype's), or one of _storage.CODES held in uint8 (float8
    also in ml_dtypes' dtypes of that name, read as their bytes)."""
    if kv_cache_dtype == "auto":
        return key_cache, value_cache, C.dtype_name(key_cache.dtype)
    if kv_cache_dtype not in _storage.CODES:  # (also what is not a str)
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of "
                         f"{', '.join(map(repr, _storage.CODES))}, got {kv_cache_dtype!r}")
    views = []
    for name, a in (("key_cache", key_cache), ("value_cache", value_cache)):
        if a.dtype != np.uint8 and C.dtype_name(a.dtype) != kv_cache_dtype:
            raise TypeError(f"{name} has dtype {a.dtype}; kv_cache_dtype={kv_cache_dtype!r} "
                            f"reads uint8 codes{'' if kv_cache_dtype == 'int4' else ' or ' + kv_cache_dtype}")
        views.append(a.view(np.uint8))
    return views[0], views[1], str(kv_cache_dtype)


def _cache_dtypes(query: NDArray[Any], key_cache: NDArray[Any], value_cache: NDArray[Any],
                  k_scale: object, v_scale: object, storage: str) -> tuple[int, int]:
    """The kernels' stores of query and of the caches (storage: what the
    caches hold); TypeError for dtypes that do not go together, and for row
    scales that are missing or given to another cache."""
    qd, kd = query.dtype, key_cache.dtype
    if value_cache.dtype != kd:
        raise TypeError(f"key_cache has dtype {kd} and value_cache {value_cache.dtype}; "
                        "expected one dtype")
    if qd == np.float64:
        if kd != np.float64 or storage != "float64":
            raise TypeError(f"key_cache has dtype {kd}; a float64 query reads float64 caches")
        q_store = kv_store = _core.STORE_NATIVE
    else:
        if C.dtype_name(qd) not in _storage.QUERY_DTYPES or not qd.isnative:
            raise TypeError(f"query has dtype {qd}; expected float32, float64, float16 or "
                            "bfloat16 (native byte order)")
        if storage not in _storage.CODES and (C.dtype_name(kd) not in _storage.BY_DTYPE
                                              or not kd.isnative):
            raise TypeError(f"key_cache has dtype {kd}; expected float32, float16, bfloat16 "
                            f"or int8 (with k_scale and v_scale) for a {qd} query, or codes "
                            f"named by kv_cache_dtype")
        q_store, kv_store = query_store(qd), _storage.store(storage)
    scaled = storage in _storage.SCALED
    if scaled and (k_scale is None or v_scale is None):
        raise TypeError(f"{storage} caches need k_scale and v_scale, the float32 scale of every "
                        "row (num_blocks, num_kv_heads, block_size)")
    if not scaled and (k_scale is not None or v_scale is not None):
        raise TypeError(f"k_scale and v_scale are the scales of int8 and float8_e4m3fn caches; "
                        f"key_cache holds {storage}")
    return q_store, kv_store


def _scales(k_scale: object, v_scale: object, shape: C.Shape
            ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        a = C.require_array(s, name)
        if a.dtype != np.float32:
            raise TypeError(f"{name} has dtype {a.dtype}; expected float32")
        if a.shape != shape:
            raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected (num_blocks, "
                             f"num_kv_heads, block_size) = {C.shape_str(shape)}")
        out.append(C.kernel_view(a))
    return out[0], out[1]


def check_features(E: int, Ev: int) -> None:
    """ValueError for heads wider than the kernels take (fastattn.h)."""
    if E > _core.ATTN_MAX_FEATURES or Ev > _core.ATTN_MAX_FEATURES:
        raise ValueError(f"E = {E} and Ev = {Ev}: at most {_core.ATTN_MAX_FEATURES} features "
                         "are supported")


def _block_table(block_table: object, seq_lens: object, B: int, num_blocks: int,
                 block_size: int) -> tuple[NDArray[np.int32], NDArray[np.int64]]:
    """The table as the kernels read it (C-contiguous int32) and seq_lens as
    int64, after checking every entry a sequence's keys occupy."""
    table = _ints(block_table, "block_table", 2, "(B, max_blocks)")
    lens = _ints(seq_lens, "seq_lens", 1, "(B,)")
    if table.shape[0] != B or lens.shape[0] != B:
        raise ValueError(f"block_table {C.shape_str(table.shape)} and seq_lens "
                         f"{C.shape_str(lens.shape)} must have one row per sequence: "
                         f"cu_seqlens_q holds B + 1 = {B + 1} values")
    max_blocks = table.shape[1]
    bad = np.flatnonzero((lens < 0) | (lens > max_blocks * block_size))  # in lens's dtype
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"seq_lens[{b}] = {lens[b]}: sequence {b} can hold 0 to "
                         f"max_blocks x block_size = {max_blocks} x {block_size} = "
                         f"{max_blocks * block_size} keys")
    lens64 = lens.astype(np.int64)
    used = np.arange(max_blocks)[None, :] < (-(-lens64 // block_size))[:, None]
    wrong = used & ((table < 0) | (table >= num_blocks))
    if wrong.any():
        b, i = (int(x) for x in np.argwhere(wrong)[0])
        held = (f"0 to num_blocks - 1 = {num_blocks - 1}" if num_blocks else
                "they hold no block: num_blocks = 0")
        raise ValueError(f"block_table[{b}, {i}] = {table[b, i]} is not a block of the caches "
                         f"({held}): sequence {b} holds "
                         f"{lens64[b]} keys in its first {-(-lens64[b] // block_size)} blocks")
    # the kernels read int32 ids (as vLLM's): a larger id would wrap to another block
    if num_blocks > C.INT32_MAX and (used & (table > C.INT32_MAX)).any():
        b, i = (int(x) for x in np.argwhere(used & (table > C.INT32_MAX))[0])
        raise ValueError(f"block_table[{b}, {i}] = {table[b, i]}: block ids above 2**31 - 1 = "
                         f"{C.INT32_MAX} are not supported (the kernels read int32 block "
                         "tables); keep the pool's blocks in use below that")
    # the entries past a sequence's blocks are never read: any value, even one
    # an int32 cannot hold
    if table.dtype != np.int32:
        table = np.where(used, table, 0)
    if table.shape[1] == 0:  # no sequence holds a key: a column the kernels never read
        table = np.zeros((B, 1), np.int32)
    return C.contiguous(table, np.int32), C.contiguous(lens64)


def paged_attention(
        query: NDArray[Float], key_cache: NDArray[Any], value_cache: NDArray[Any],
        block_table: NDArray[np.integer[Any]], seq_lens: NDArray[np.integer[Any]],
        cu_seqlens_q: NDArray[np.integer[Any]], *, scale: Optional[float] = None,
        is_causal: bool = True, window_size: Optional[tuple[int, int]] = None,
        alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
        sinks: Optional[NDArray[Any]] = None, return_lse: bool = False,
        k_scale: Optional[NDArray[np.float32]] = None,
        v_scale: Optional[NDArray[np.float32]] = None, kv_cache_dtype: str = "auto",
        value_dim: Optional[int] = None,
        out: Optional[NDArray[Float]] = None, num_threads: Optional[int] = None,
        precision: str = "exact", key_mean: Optional[NDArray[Any]] = None,
        tree_mask: Optional[NDArray[np.bool_]] = None,
        tree_mask_indptr: Optional[NDArray[np.integer[Any]]] = None, cascade: bool = False,
) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]:
    """Attention of a ragged batch of sequences over a paged key/value cache,
    in one call: a serving step that mixes prefill chunks, single decoding
    tokens and several speculative tokens.

    The contract of vLLM's unified CPU attention and of FlashAttention's
    ``flash_attn_with_kvcache`` with a ``block_table``, PagedAttention's
    layout (Kwon et al., "Efficient Memory Management for Large Language
    Model Serving with PagedAttention", SOSP 2023): each sequence's keys and
    values lie in blocks of ``block_size`` positions anywhere in a shared
    pool, listed in order by its row of ``block_table``.

    Each sequence's output is bitwise equal to
    ``scaled_dot_product_attention(q, k, v, causal_alignment="lower_right",
    enable_gqa=True, ...)`` on that sequence's queries and its keys and
    values alone (as ``KVCache.attend`` reads them, for caches in 16, 8 or
    4 bits), whatever the block size, the order of the blocks in memory and
    the other sequences of the call.

    Parameters
    ----------
    query : ndarray, shape (total_q, Hq, E)
        The new tokens' queries of every sequence, packed: sequence b owns
        rows ``cu_seqlens_q[b]`` to ``cu_seqlens_q[b + 1] - 1``, which are
        its LAST positions (the keys and values of these tokens are already
        in the cache).  float32, float64, float16 or bfloat16; any strides.
    key_cache : ndarray, shape (num_blocks, Hkv, block_size, E)
    value_cache : ndarray, shape (num_blocks, Hkv, block_size, Ev)
        The pool of blocks (vLLM's and FlashAttention's layout, any
        strides, but each int4 row's bytes contiguous: a q4_0 row is
        blocks of bytes).  For a float64 query float64; else float32, float16,
        bfloat16 or int8 (with ``k_scale`` and ``v_scale``), or the codes
        that ``kv_cache_dtype`` names, converted exactly to float32 as they
        are read, a tile at a time.  Hq must be
        a multiple of Hkv (grouped-query attention: query head h reads
        key/value head h // (Hq // Hkv)).
    block_table : ndarray of int32, shape (B, max_blocks)
        Row b lists sequence b's blocks in order: its key j is in block
        ``block_table[b, j // block_size]`` at row ``j % block_size``.
        Entries past a sequence's ``ceil(seq_lens[b] / block_size)`` blocks
        are ignored, whatever they hold; a block may appear in several rows
        (a shared prefix).  Other integer dtypes are converted.
    seq_lens : ndarray of int, shape (B,)
        Keys held per sequence, its new tokens included.
    cu_seqlens_q : ndarray of int32 or int64, shape (B + 1,)
        Cumulative query counts: start at 0, never decrease, end at
        total_q.  A sequence may have no query (it is then skipped).
    scale, window_size, alibi_slopes, softcap, sinks
        As for ``scaled_dot_product_attention``, per sequence, with query
        row i of sequence b at position ``seq_lens[b] - L_b + i``
        (lower-right alignment); alibi_slopes of shape (Hq,) or (B, Hq),
        sinks (Hq,).
    is_causal : bool
        Query i of sequence b sees keys 0 to ``seq_lens[b] - L_b + i``
        (default True: every query sees its own key and the earlier ones).
    return_lse : bool
        Also return each row's log-sum-exp, shape (Hq, total_q), as
        ``varlen_attention`` (FlashAttention's varlen ``softmax_lse``); for
        a row with no key (``seq_lens[b]`` 0, or none in its window), the
        sink's logit with sinks (as in FlashAttention 4's reference), -inf
        without.
    k_scale, v_scale : ndarray of float32, shape (num_blocks, Hkv, block_size), or None
        For int8 and float8_e4m3fn caches only: row j stands for its scale
        times its codes (``KVCache``'s storages of those names).  Per row,
        unlike vLLM's per-tensor ``k_scale`` of its fp8 cache.
    kv_cache_dtype : {"auto", "float8_e4m3fn", "float8_e5m2", "int4"}
        What the caches hold (vLLM's argument of this name, with
        ``KVCache``'s storage names for its "fp8_e4m3" and "fp8_e5m2"):
        "auto" their dtype's values; else uint8 codes (for float8 also
        ml_dtypes' arrays of that dtype): float8 one per element; int4
        llama.cpp's q4_0 blocks, ``ceil(E / 32) * 18`` contiguous bytes per
        row (as ``PagedKVCache(storage="int4")`` writes them).
    value_dim : int or None
        int4 caches only: Ev, the elements of a value row (default: 32 per
        18-byte block of value_cache's rows).  Pass it when Ev is not a
        multiple of 32: the default also computes the padding's columns
        (zeros), and the others' last bits may then differ from a call of
        Ev columns, as any call's do between two widths.
    out : ndarray or None, shape (total_q, Hq, Ev), query's dtype
        Written through its strides; must not overlap an input.
    num_threads : int or None
    precision : {"exact", "int8"}
        How the scores are computed (the name of JAX's ``precision``
        argument of its products and of PyTorch's
        ``set_float32_matmul_precision``).  "exact" (the default): every
        stored element read exactly.  "int8" (opt-in): against int8
        caches, and int4 caches in sequences of at most four query rows
        (decoding), the queries are rounded to int8, one scale per row
        against int8 keys and per block of 32 against int4 ones, and the
        scores summed as integer products, llama.cpp's q8_0 dot products
        and SageAttention's int8 Q Kᵀ (Zhang et al., ICLR 2025); against
        int8 values, the weights of each 32 key positions (64 in
        sequences of more than four query rows) are rounded to 7 bits
        too.  The output then differs from the exact one by that rounding
        (README, "The int8 mode", gives the measured error); the same bits
        for any thread count, layout, block placement and batch, as in
        the exact mode.  Other caches, and int4 caches in sequences of
        more query rows, stay exact.
    key_mean : ndarray, shape (B, Hkv, E), or None
        The per-channel mean each sequence's keys were stored less
        (SageAttention's ``smooth_k``, Zhang et al., ICLR 2025, with the
        mean fixed per sequence as ``PagedKVCache(smooth_k=True)`` does):
        the kernels add ``scale * q . key_mean[b, h]`` to every score of
        sequence b and key head h, so the results are those of the keys
        before (softcap, sinks and the lse see the true logits).  Float32
        (float64 for a float64 query), finite; None: none.
    tree_mask : ndarray of bool, shape (sum of L_b**2,), or None
        Speculative decoding with a tree of draft tokens (SpecInfer, Medusa,
        EAGLE-2): sequence b's L_b query rows are its draft tokens, its
        last L_b positions, and ``tree_mask`` holds its L_b x L_b mask,
        row-major, from ``tree_mask_indptr[b]``: True where draft token i
        may see draft token t (its ancestors and itself).  Every position
        before the tree stays visible, and ``is_causal``, the window and
        softcap and sinks still apply (with the tokens in topological
        order, every ancestor before its descendants, as those methods lay
        them out, ``is_causal`` hides nothing the tree shows); not
        ``window_size`` nor ``alibi_slopes``, which would count a draft's
        slot rather than its depth.  FlashInfer's
        ``custom_mask`` layout with its ``mask_indptr``, over the new
        tokens only, as vLLM's tree attention.  Each sequence's output is
        bitwise that of ``scaled_dot_product_attention`` with the same
        mask over all its keys.
    tree_mask_indptr : int array (B + 1,) or None
        Where each sequence's mask starts in ``tree_mask`` (int32 or int64,
        from 0, never decreasing, ending at its length); a sequence whose
        range is empty has no tree (a prefill chunk or a plain decoding
        token in the same call).  None: every sequence's mask, packed in
        order.
    cascade : bool
        Opt-in cascade attention (vLLM's ``use_cascade_attention`` with its
        common prefix; FlashInfer's shared-prefix attention): the leading
        whole blocks that every sequence with queries holds, and that all
        of their queries see, are attended once for all the call's queries
        as one matrix product, then each sequence's own keys, the two merged
        by their log-sum-exps (``merge_attention``; ``sinks`` join the first
        part).  Faster where many queries share a long prefix (forks, a
        common system prompt) with several query heads per key/value head;
        a sequence's result then differs from its exact bits in the last
        bits and depends on the prefix the call's sequences share.  Not
        with ``window_size``, ``alibi_slopes``, ``key_mean`` or
        ``precision="int8"``; without a common prefix, the exact call.  Without it (the default) the blocks
        sequences share are read once for all of them too, each sequence
        keeping the bits of a call of its own.

    Returns
    -------
    out : ndarray, shape (total_q, Hq, Ev), query's dtype
        (out, lse) with ``return_lse=True``; lse in float32 for 16-bit
        queries.  A query row that sees no key (seq_lens[b] = 0 without
        is_causal, or a window that hides every key) gives zeros, and an
        lse of -inf, or of the sink's logit with sinks.

    Raises
    ------
    TypeError
        Non-ndarrays; a query dtype other than those above, caches of a
        dtype the query cannot read or of two dtypes; non-integer block
        tables, seq_lens or cu_seqlens_q; int8 and float8_e4m3fn caches
        without their scales or scales for other caches; caches that are not
        uint8 (or that float8 dtype) with kv_cache_dtype; flags that are not
        bools; a precision that is not a str; a key_mean that is not an
        array of float32 (float64 for a float64 query); a tree_mask that is
        not bool.
    ValueError
        A precision other than "exact" and "int8"; shapes that do not
        agree (key_mean's included); a key_mean that is not finite; a
        tree_mask whose sequences' masks are not L_b x L_b or hold more
        tokens than their keys, with window_size or alibi_slopes, or
        tree_mask_indptr without tree_mask; cascade with a window_size
        that hides keys, alibi_slopes, key_mean or precision="int8";
        Hq not a multiple of Hkv; cu_seqlens_q
        not starting at 0, decreasing or not ending at total_q; a seq_lens
        entry below 0 or beyond max_blocks x block_size; a block-table entry
        that a sequence reads and that is not a block of the caches (the
        message names the sequence); with is_causal, a sequence with more
        queries than keys (its queries are its last positions, whose keys
        must be in the cache); a bad ``out``; and the bad option values of
        ``scaled_dot_product_attention``.

    Notes
    -----
    The caller's arrays are never modified.
    """
    for name, a, layout in (("query", query, "(total_q, Hq, E)"),
                            ("key_cache", key_cache, "(num_blocks, Hkv, block_size, E)"),
                            ("value_cache", value_cache, "(num_blocks, Hkv, block_size, Ev)")):
        C.require_array(a, name)
        if a.ndim != len(layout.split(",")):
            raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected {layout}")
    key_cache, value_cache, storage = _byte_caches(key_cache, value_cache, kv_cache_dtype)
    mode = C.check_precision(precision)
    q_store, kv_store = _cache_dtypes(query, key_cache, value_cache, k_scale, v_scale, storage)
    total_q, Hq, E = query.shape
    num_blocks, Hkv, block_size, Ek = key_cache.shape
    Ev = value_cache.shape[3]
    if storage == "int4":  # rows of q4_0 blocks: E's bytes, and Ev's
        Ev = Ev // _storage.Q4_BLOCK_BYTES * _storage.Q4_BLOCK if value_dim is None else value_dim
        Ev = C.check_index(Ev, "value_dim", 0)
        # (an empty cache's strides may be 0: NumPy's for arrays of no element)
        if _storage.width(storage, Ev) != value_cache.shape[3] or (
                value_cache.size > 1 and value_cache.strides[3] != 1):
            raise ValueError(f"value_cache has rows of {value_cache.shape[3]} bytes, strides "
                             f"{value_cache.strides}; int4 rows of value_dim = {Ev} elements "
                             f"are {_storage.width(storage, Ev)} contiguous bytes")
        if key_cache.size > 1 and key_cache.strides[3] != 1:
            raise ValueError(f"key_cache has strides {key_cache.strides}; int4 rows are "
                             "contiguous bytes")
    elif value_dim is not None:
        raise ValueError("value_dim is for int4 caches only (their rows count bytes)")
    if (Ek != _storage.width(storage, E) or value_cache.shape[:3] != key_cache.shape[:3]):
        last = "E" if storage != "int4" else f"ceil(E / 32) * 18 = {_storage.width(storage, E)}"
        raise ValueError(f"query {C.shape_str(query.shape)}, key_cache "
                         f"{C.shape_str(key_cache.shape)} and value_cache "
                         f"{C.shape_str(value_cache.shape)} do not agree: expected (total_q, "
                         f"Hq, E), (num_blocks, Hkv, block_size, {last}) and (num_blocks, Hkv, "
                         "block_size, Ev)")
    if block_size == 0:
        raise ValueError("key_cache has block_size 0; expected blocks of at least one position")
    C.check_head_groups(Hq, Hkv)
    check_features(E, Ev)
    scales: tuple[Optional[NDArray[np.float32]], Optional[NDArray[np.float32]]] = (None, None)
    if storage in _storage.SCALED:
        scales = _scales(k_scale, v_scale, key_cache.shape[:3])
    cu_q = C.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", total_q)
    B = cu_q.shape[0] - 1
    table, lens = _block_table(block_table, seq_lens, B, num_blocks, block_size)
    causal = C.check_bool(is_causal, "is_causal")
    lse_wanted = C.check_bool(return_lse, "return_lse")
    q_lens = cu_q[1:] - cu_q[:-1]  # (np.diff's checks cost more)
    if causal and (q_lens > lens).any():
        b = int(np.flatnonzero(q_lens > lens)[0])
        raise ValueError(f"sequence {b} has {q_lens[b]} queries but seq_lens[{b}] = {lens[b]} "
                         "keys: with is_causal the queries are a sequence's last positions, "
                         "whose keys and values must be in the cache first")
    inputs = {"query": query, "key_cache": key_cache, "value_cache": value_cache,
              "block_table": block_table, "seq_lens": seq_lens, "cu_seqlens_q": cu_seqlens_q,
              "k_scale": k_scale, "v_scale": v_scale, "key_mean": key_mean,
              "tree_mask": tree_mask}
    mean = None if key_mean is None else _key_mean(key_mean, (B, Hkv, E), query.dtype)
    trees = _tree.check(tree_mask, tree_mask_indptr, q_lens, lens)
    return ragged(query, key_cache, value_cache, table, None, lens, cu_q, q_lens, scales,
                  q_store, kv_store, Ev, causal, True, 0, scale, window_size, alibi_slopes,
                  softcap, sinks, lse_wanted, out, num_threads, inputs, mode, mean, trees,
                  cascade)


def _key_mean(key_mean: object, shape: tuple[int, int, int], dtype: np.dtype[Any]
              ) -> NDArray[Any]:
    """paged_attention's key_mean, checked: C-contiguous in the kernels' dtype."""
    a = C.require_array(key_mean, "key_mean")
    want = C.compute_dtype(dtype)
    if a.dtype != want:
        raise TypeError(f"key_mean has dtype {a.dtype}; expected {want} (the kernels' dtype "
                        f"for a {dtype} query)")
    if a.shape != shape:
        raise ValueError(f"key_mean has shape {C.shape_str(a.shape)}; expected (B, Hkv, E) = "
                         f"{C.shape_str(shape)}")
    if not np.isfinite(a).all():
        raise ValueError("key_mean holds an inf or a NaN; expected finite means")
    return C.contiguous(a)
