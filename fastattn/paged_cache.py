"""PagedKVCache: the keys and values of many sequences in blocks of a shared
pool, for serving requests that arrive and finish at different times."""
from __future__ import annotations

import threading
from typing import Any, Optional, Sequence, Union

import numpy as np

from . import _checks as C
from . import _cache, _runtime, _storage, _tree
from ._cache import Layout
from ._dispatch import ragged
from ._keys import KeyOptions, KeyTransform
from ._prefix import PrefixTable, chain
from ._storage import narrow, query_store
from ._typing import DTypeLike, Float, NDArray
from .paged import check_features
from .rotary import rotate

SeqIds = Union[Sequence[int], NDArray[np.integer[Any]]]


class OutOfBlocksError(MemoryError):
    """A PagedKVCache has fewer free blocks than an append needs; nothing
    was written.  Free finished sequences (or preempt one) and try again."""


class PagedKVCache(KeyOptions):
    """Keys and values of many sequences, in blocks of ``block_size``
    positions taken from one pool as the sequences grow: PagedAttention's
    block manager (Kwon et al., SOSP 2023; vLLM's), for continuous batching.

    A sequence holds only the blocks its tokens fill (no padding to the
    longest, no reservation for the worst case); a finished one gives its
    blocks back at once (``free``), and a new one may join at any step
    (``add_sequence``).  ``fork`` shares every block of a sequence with a new
    one (parallel sampling, beam search, a shared prompt): a shared block
    is copied only when one of them writes into it (copy-on-write of the
    last, partly filled block).  Attention (``attend``) is one
    ``paged_attention`` call over any set of live sequences, each with its
    own number of new queries.

    The pool is two arrays, ``key_cache`` (num_blocks, num_kv_heads,
    block_size, head_dim) and ``value_cache`` (..., value_dim): vLLM's and
    FlashAttention's layout, which ``paged_attention`` takes directly with
    ``block_table(seq_ids)`` and the lengths in ``seq_lens``.

    Threads: the bookkeeping (``add_sequence``, ``fork``, ``free``,
    ``append``, the block table of ``attend``) is guarded by a lock, so that
    several threads may serve different sequences of one cache; the
    conversions and the attention run outside it.  An ``attend`` reads the
    blocks its sequences held when it started: free none of them from
    another thread meanwhile (their blocks could be taken and overwritten).
    One sequence's tokens come from one thread at a time: an append that
    finds its sequence grown by another thread since it began raises a
    RuntimeError and writes nothing.

    Parameters
    ----------
    num_blocks, block_size, num_kv_heads, head_dim : int
        The pool holds num_blocks x block_size positions (each >= 1).
    value_dim : int or None
        Size of a value head; None means head_dim.
    dtype : float32 or float64
        Of the keys, values and queries given: what attention computes in.
    storage : {"float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"} or None
        How the rows are held, as ``KVCache``'s (None: as dtype; float64
        only as "float64"): 16-bit and float8_e5m2 rounded to
        nearest-even, int8 and float8_e4m3fn with a float32 scale per row
        (``k_scale``, ``v_scale``), int4 in q4_0 blocks.
    smooth_k, rotate_k : bool
        As ``KVCache``'s, the mean fixed per sequence by its first append
        (a fork keeps its parent's; truncating to 0 forgets it).  The pool
        then holds the keys rotated and less the mean: ``attend`` reads
        them right, a ``paged_attention`` call of one's own would not.
    enable_prefix_caching : bool
        vLLM's automatic prefix caching (its argument of this name): each
        full block whose tokens' ids were given to ``append`` is named by
        them, chained with the blocks before it; ``match_prefix`` gives a
        new sequence the blocks of the longest prompt prefix already held.
        A block no sequence holds keeps its contents, and its name, until
        its memory is needed (least recently freed first), and counts as
        free meanwhile.  Shared blocks are never written (copy-on-write,
        as with ``fork``).  Not with smooth_k, whose keys are stored less
        their own sequence's mean (default False).
    latent : bool
        As ``KVCache``'s: Multi-head Latent Attention's pool, each row's
        first value_dim features its value (``value_cache`` is a view of
        ``key_cache``, as FlashMLA reads one cache with ``head_dim_v``);
        ``append`` takes the keys alone, and ``rotary`` rotates the
        features after value_dim (DeepSeek-V2's decoupled RoPE part) of
        the keys and the queries (default False).

    Raises
    ------
    TypeError
        Sizes that are not ints, a dtype other than float32 and float64, or
        smooth_k, rotate_k, enable_prefix_caching or latent not bools.
    ValueError
        Sizes below 1 (head_dim and value_dim may be 0), num_blocks above
        2**31 (block tables hold int32 ids), a storage it cannot hold, a
        pool larger than any address space, enable_prefix_caching with
        smooth_k, or a latent pool with value_dim above head_dim, smooth_k
        or rotate_k.
    ImportError
        storage="bfloat16" without the ml_dtypes package.
    MemoryError
        A pool that cannot be allocated; the message gives the bytes.
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 value_dim: Optional[int] = None, dtype: DTypeLike = np.float32,
                 storage: Optional[str] = None, smooth_k: bool = False,
                 rotate_k: bool = False, enable_prefix_caching: bool = False,
                 latent: bool = False) -> None:
        num_blocks = C.check_index(num_blocks, "num_blocks", 1)
        if num_blocks > C.INT32_MAX + 1:  # block tables are int32, as vLLM's
            raise ValueError(f"num_blocks = {num_blocks}; at most 2**31 = {C.INT32_MAX + 1} "
                             "blocks (block tables hold int32 ids)")
        block_size = C.check_index(block_size, "block_size", 1)
        core = _cache.Core("PagedKVCache", num_kv_heads, head_dim, value_dim, dtype, storage,
                           latent)
        self._keys = KeyTransform(smooth_k, rotate_k, core.latent)
        prefix = C.check_bool(enable_prefix_caching, "enable_prefix_caching")
        if prefix and self._keys.smooth:
            raise ValueError("enable_prefix_caching cannot go with smooth_k: a shared block "
                             "holds its keys less the mean of the sequence that wrote them")
        sizes = f"{num_blocks} blocks of {block_size} positions"
        rows, (refs,) = core.allocate((num_blocks, core.num_kv_heads, block_size), sizes,
                                      "num_blocks", [((num_blocks,), np.int64)])
        self._core = core
        self._dtype, self._storage = core.dtype, core.storage
        self._head_dim, self._value_dim = core.head_dim, core.value_dim
        self._key: NDArray[Any] = rows.key
        self._value: NDArray[Any] = rows.value
        self._k_scale, self._v_scale = rows.key_scale, rows.value_scale
        self._refs = refs  # sequences holding each block
        Hkv, D, Dv = core.num_kv_heads, core.head_dim, core.value_dim
        self._layouts = (Layout(("n", "num_kv_heads", "head_dim"), (None, Hkv, D)),
                         Layout(("n", "num_kv_heads", "value_dim"), (None, Hkv, Dv)),
                         Layout(("total_q", "Hq", "head_dim"), (None, None, D)))
        # free blocks: those given back (taken again last in, first out), then
        # the never used ones from _fresh up, so that no list of every block is built
        self._free: list[int] = []
        self._fresh = 0
        self._blocks: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        # smooth_k: the (num_kv_heads, head_dim) mean a sequence's keys are
        # stored less, from its first append; shared, never written, by forks
        self._means: dict[int, NDArray[Any]] = {}
        # prefix caching: the named blocks, and each sequence's token ids
        # (None once an append came without them) and its full blocks' names
        self._prefix = PrefixTable() if prefix else None
        self._tokens: dict[int, Optional[list[int]]] = {}
        self._names: dict[int, list[bytes]] = {}
        # the first draft position of a sequence holding unverified drafts
        # (append's draft): no block from there on is named
        self._drafts: dict[int, int] = {}
        self._next_id = 0
        self._lock = threading.Lock()  # around the bookkeeping above, never a kernel

    # ---- sizes -------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return int(self._key.shape[0])

    @property
    def block_size(self) -> int:
        return int(self._key.shape[2])

    @property
    def num_kv_heads(self) -> int:
        return int(self._key.shape[1])

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def value_dim(self) -> int:
        return self._value_dim

    @property
    def dtype(self) -> np.dtype[np.floating[Any]]:
        """The dtype of the keys, values and queries given."""
        return self._dtype

    @property
    def storage(self) -> str:
        return self._storage

    @property
    def num_free_blocks(self) -> int:
        """Blocks that no sequence holds (idle named ones included)."""
        idle = self._prefix.idle if self._prefix is not None else 0
        return len(self._free) + self.num_blocks - self._fresh + idle

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (keys, values and int8 scales)."""
        return int(sum(a.nbytes for a in self._buffers()))

    @property
    def seq_ids(self) -> list[int]:
        """The live sequences, in the order they were added."""
        return list(self._lens)

    @property
    def seq_lens(self) -> dict[int, int]:
        """Positions held per live sequence (a new dict)."""
        return dict(self._lens)

    @property
    def key_cache(self) -> NDArray[Any]:
        """The pool of keys, (num_blocks, num_kv_heads, block_size, head_dim)
        in the storage's dtype (uint8 codes for float8, and for int4 rows of
        ``ceil(head_dim / 32) * 18`` bytes): a read-only view."""
        return _storage.read_only(self._key.view())

    @property
    def value_cache(self) -> NDArray[Any]:
        """The pool of values, (..., value_dim): a read-only view."""
        return _storage.read_only(self._value.view())

    @property
    def k_scale(self) -> Optional[NDArray[np.float32]]:
        """int8 and float8_e4m3fn storage: each key row's scale (num_blocks,
        num_kv_heads, block_size), a read-only view; None otherwise."""
        return None if self._k_scale is None else _storage.read_only(self._k_scale.view())

    @property
    def v_scale(self) -> Optional[NDArray[np.float32]]:
        return None if self._v_scale is None else _storage.read_only(self._v_scale.view())

    @property
    def latent(self) -> bool:
        """Whether the values are the keys' first value_dim features (MLA)."""
        return self._core.latent

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype.name}, storage={self.storage}, "
                f"{self._keys.options_repr()}{'latent=True, ' if self._core.latent else ''}"
                f"sequences={len(self._lens)}, "
                f"free blocks={self.num_free_blocks})")

    # ---- sequences ---------------------------------------------------------
    def add_sequence(self) -> int:
        """A new, empty sequence: its id (never reused).  It takes no block
        until tokens are appended."""
        with self._lock:
            return self._add()

    def _add(self) -> int:
        seq_id = self._next_id
        self._next_id += 1
        self._blocks[seq_id], self._lens[seq_id] = [], 0
        self._tokens[seq_id], self._names[seq_id] = [], []
        return seq_id

    def fork(self, seq_id: int) -> int:
        """A new sequence holding every position of seq_id, sharing its
        blocks (nothing is copied now); the last block, when partly filled,
        is copied by the first of the two that appends to it."""
        with self._lock:
            seq_id = self._one(seq_id)
            child = self._add()
            self._blocks[child] = list(self._blocks[seq_id])
            self._lens[child] = self._lens[seq_id]
            if seq_id in self._means:
                self._means[child] = self._means[seq_id]
            tokens = self._tokens[seq_id]
            self._tokens[child] = None if tokens is None else list(tokens)
            self._names[child] = list(self._names[seq_id])
            if seq_id in self._drafts:
                self._drafts[child] = self._drafts[seq_id]
            self._refs[self._blocks[child]] += 1
            return child

    def free(self, seq_id: int) -> None:
        """Forget seq_id: the blocks no other sequence shares go back to the
        pool at once."""
        with self._lock:
            seq_id = self._one(seq_id)
            self._give_back(self._blocks.pop(seq_id))
            del self._lens[seq_id]
            self._means.pop(seq_id, None)
            self._drafts.pop(seq_id, None)
            del self._tokens[seq_id], self._names[seq_id]

    def _give_back(self, blocks: list[int]) -> None:
        """Drop one holder of each block; those no sequence holds are free."""
        # a named chain's tail idles first, so that it is evicted first
        for block in reversed(blocks) if self._prefix is not None else blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0 and not (self._prefix is not None
                                               and self._prefix.release(block)):
                self._free.append(block)

    def _one(self, seq_id: object) -> int:
        """seq_id, one live sequence."""
        if isinstance(seq_id, (bool, np.bool_)) or not hasattr(seq_id, "__index__"):
            raise TypeError(f"seq_id must be an int, one sequence, got {type(seq_id).__name__}")
        return self._ids([seq_id], "seq_id")[0]

    def _ids(self, seq_ids: object, name: str = "seq_ids", distinct: bool = False) -> list[int]:
        """seq_ids as a list of live ids; a clear error otherwise."""
        def label(i: int) -> str:  # one id (fork's seq_id) or one of a list
            return name if name == "seq_id" else f"{name}[{i}]"
        if isinstance(seq_ids, np.ndarray):
            if seq_ids.ndim != 1 or seq_ids.dtype.kind not in "iu":
                raise TypeError(f"{name} must be a list of ints or a 1-D integer array, got an "
                                f"array of dtype {seq_ids.dtype} and shape "
                                f"{C.shape_str(seq_ids.shape)}")
            ids = [int(s) for s in seq_ids]
        elif isinstance(seq_ids, (list, tuple)):
            ids = [C.check_index(s, label(i), 0) for i, s in enumerate(seq_ids)]
        else:
            raise TypeError(f"{name} must be a list of ints or a 1-D integer array, got "
                            f"{type(seq_ids).__name__}")
        for i, s in enumerate(ids):
            if s not in self._lens:
                raise ValueError(f"{label(i)} = {s} is not a live sequence of this cache "
                                 "(add_sequence() makes one; a freed one is gone)")
        if distinct and len(set(ids)) != len(ids):
            raise ValueError(f"{name} names a sequence twice ({ids}); give each sequence once, "
                             "with all its new tokens")
        return ids

    def seq_lens_of(self, seq_ids: SeqIds) -> NDArray[np.int64]:
        """Positions held by each of seq_ids, int64 (len(seq_ids),):
        ``paged_attention``'s seq_lens for these sequences.  TypeError or
        ValueError for seq_ids that are not live sequences."""
        with self._lock:
            return np.array([self._lens[s] for s in self._ids(seq_ids)], np.int64)

    def block_table(self, seq_ids: SeqIds) -> NDArray[np.int32]:
        """(len(seq_ids), max_blocks) int32: row b lists the blocks of
        seq_ids[b] in order, -1 past them (``paged_attention``'s block_table)."""
        with self._lock:
            return self._table(self._ids(seq_ids))

    def _table(self, ids: list[int]) -> NDArray[np.int32]:
        blocks = [self._blocks[s] for s in ids]
        width = max(map(len, blocks), default=0)
        # padded lists, converted once: half the time of filling rows one by one
        return np.array([b + [-1] * (width - len(b)) for b in blocks],
                        np.int32).reshape(len(blocks), width)

    def blocks_needed(self, seq_ids: SeqIds, num_new_tokens: Sequence[int]) -> int:
        """Free blocks an append of num_new_tokens[b] positions to each
        seq_ids[b] would take (copies of shared blocks included): what a
        scheduler compares with num_free_blocks before admitting work."""
        counts = [C.check_index(c, f"num_new_tokens[{i}]", 0) for i, c in enumerate(num_new_tokens)]
        with self._lock:
            ids = self._ids(seq_ids, distinct=True)
            if len(counts) != len(ids):
                raise ValueError(f"num_new_tokens has {len(counts)} entries; expected one per "
                                 f"sequence ({len(ids)})")
            return sum(take for take, _ in self._plan(ids, counts))

    def _plan(self, seq_ids: list[int], counts: Sequence[int]) -> list[tuple[int, bool]]:
        """For each sequence and its count of new positions: (blocks to take,
        whether to copy its last block first).  A partly filled last block
        that other sequences share is copied by each writer in turn but the
        last one left holding it, which writes into it in place (a parent
        and its fork appending in one call take one copy, not two)."""
        holders: dict[int, int] = {}
        plans = []
        bs = self.block_size
        for s, count in zip(seq_ids, counts):
            n, blocks = self._lens[s], self._blocks[s]
            if count == 0:
                plans.append((0, False))
                continue
            copy = False
            if n % bs != 0:
                last = blocks[-1]
                left = holders.get(last, int(self._refs[last]))
                copy = left > 1
                holders[last] = left - 1 if copy else left
            plans.append((-(-(n + int(count)) // bs) - len(blocks) + int(copy), copy))
        return plans

    # ---- writing -----------------------------------------------------------
    def append(self, seq_ids: SeqIds, key: NDArray[np.floating[Any]],
               value: Optional[NDArray[np.floating[Any]]],
               cu_seqlens: Optional[NDArray[np.integer[Any]]] = None, *,
               rotary: Optional[tuple[NDArray[Any], NDArray[Any]]] = None,
               rotary_interleaved: bool = False, num_threads: Optional[int] = None,
               token_ids: Optional[NDArray[np.integer[Any]]] = None,
               positions: Optional[NDArray[np.integer[Any]]] = None,
               draft: bool = False) -> None:
        """Write new positions of several sequences after the ones they hold.

        Parameters
        ----------
        seq_ids : list of int or 1-D int array, B distinct live sequences
        key : ndarray, (n, num_kv_heads, head_dim), the cache's dtype
        value : ndarray, (n, num_kv_heads, value_dim), or None
            The new tokens of the B sequences, packed (any strides): rounded
            or quantised into the storage, never kept.  None for a latent
            pool, whose values are the keys' first value_dim features.
        cu_seqlens : int array (B + 1,) or None
            seq_ids[b] gets rows cu_seqlens[b] to cu_seqlens[b + 1] - 1; None
            means one token each (a decoding step, n = B).
        rotary : (cos, sin) or None
            Rotary position embedding of the keys at each token's own
            position (``fastattn.rotary``'s tables, (max_pos, rotary_dim / 2)),
            applied on the threads before the rows are written.
        rotary_interleaved : bool
            GPT-J's pairs (2i, 2i + 1) instead of GPT-NeoX's halves.
        positions : int array (n,) or None
            The positions rotary rotates the tokens at (vLLM's
            ``positions``); None: the slots they are written to.  A tree of
            draft tokens puts each at its depth after the tokens before the
            tree (``accept_draft`` then moves the kept ones to those slots).
        num_threads : int or None
        token_ids : int array (n,) or None
            With enable_prefix_caching, the ids of the n tokens (packed as
            key): each block they fill is named by them, for
            ``match_prefix``.  A sequence appended to without them has no
            named block from there on.  Unused otherwise.
        draft : bool
            The tokens are draft tokens awaiting verification (a tree of
            them, speculative decoding): with enable_prefix_caching no
            block from the first of them on is named until
            ``accept_draft`` (or a ``truncate`` before them) settles them,
            so that no other request matches unverified rows.

        Raises
        ------
        OutOfBlocksError
            The pool lacks the blocks (a MemoryError).
        TypeError, ValueError
            Arguments that do not fit: a sequence that is not live or named
            twice, a dtype other than the cache's, shapes, values the
            storage cannot hold, positions past the rotary tables.
        RuntimeError
            Another thread appended to one of the sequences while this append
            ran (one sequence's tokens come from one thread at a time).

        Notes
        -----
        Nothing is written when an error is raised.
        """
        with self._lock:
            ids = self._ids(seq_ids, distinct=True)
            before = [self._lens[s] for s in ids]
            means = [self._means.get(s) for s in ids]
        n = self._core.check_rows(key, value, self._layouts[0], self._layouts[1], "tokens")
        cu = self._cu(cu_seqlens, "cu_seqlens", len(ids), n)
        tokens = None if token_ids is None else _token_ids(token_ids, n)
        counts = [int(c) for c in cu[1:] - cu[:-1]]
        nthreads = _runtime.resolve_threads(num_threads)
        interleaved = C.check_bool(rotary_interleaved, "rotary_interleaved")
        drafts = C.check_bool(draft, "draft")
        with self._lock:  # the pool first: an append that cannot fit does no work
            self._room(ids, counts)
        seq = np.repeat(np.arange(len(ids)), counts)
        slots = np.array(before, np.int64)[seq] + np.arange(n) - cu[:-1][seq]
        _no_positions(positions, rotary)
        if rotary is not None:
            key = self._rotated(key, _positions(positions, n, slots), rotary, interleaved,
                                nthreads)
        rotated, rows_mean = self._keys.rotated(key), None
        if self._keys.smooth:  # a sequence's first append fixes its mean
            means = [KeyTransform.mean(rotated[cu[b]:cu[b + 1]], None, 0) if n0 == 0 else m
                     for b, (n0, m) in enumerate(zip(before, means))]
            rows_mean = self._stacked(means)[seq]
        held = self._keys.stored(key, rotated, rows_mean)
        try:
            keys, key_scale = _storage.encode(held, self._storage, "key", nthreads)
        except ValueError as exc:
            raise self._keys.explain(exc, key) from None
        values, value_scale = ((None, None) if value is None else
                               _storage.encode(value, self._storage, "value", nthreads))
        with self._lock:
            self._ids(ids)  # none freed meanwhile
            grown = [s for s, n0 in zip(ids, before) if self._lens[s] != n0]
            if grown:
                raise RuntimeError(f"sequence {grown[0]} grew from {before[ids.index(grown[0])]} "
                                   f"to {self._lens[grown[0]]} positions while this append ran: "
                                   "append to one sequence from one thread at a time; nothing "
                                   "was written")
            plans = self._room(ids, counts)
            # from here on nothing can fail: blocks taken, shared ones copied, rows written
            for s, (take, copy), c in zip(ids, plans, counts):
                blocks = self._blocks[s]
                if self._prefix is not None and c and self._lens[s] % self.block_size:
                    self._prefix.forget(blocks[-1])  # a partly filled block written in place
                if copy:  # the shared, partly filled last block: this sequence's own copy
                    old, new = blocks[-1], self._take()
                    for buf in self._buffers():
                        buf[new] = buf[old]
                    self._refs[old] -= 1
                    blocks[-1] = new
                    take -= 1
                blocks.extend(self._take() for _ in range(take))
            table = self._table(ids)
            where = table[seq, slots // self.block_size], slots % self.block_size
            writes: list[tuple[Optional[NDArray[Any]], Optional[NDArray[Any]]]] = [
                (self._key, keys), (self._k_scale, key_scale)]
            if not self._core.latent:  # (a latent pool's values are its keys)
                writes += [(self._value, values), (self._v_scale, value_scale)]
            for dst, rows in writes:
                if dst is not None and rows is not None:
                    dst[where[0], :, where[1]] = rows
            for b, (s, c, m) in enumerate(zip(ids, counts, means)):
                if drafts and c > 0:
                    self._drafts.setdefault(s, self._lens[s])
                self._lens[s] += c
                if self._keys.smooth and m is not None and c > 0 and s not in self._means:
                    self._means[s] = m
                if self._prefix is not None and c > 0:
                    self._name_blocks(s, None if tokens is None else tokens[cu[b]:cu[b + 1]])

    def _stacked(self, means: list[Optional[NDArray[Any]]]) -> NDArray[Any]:
        """The sequences' key means as one (B, num_kv_heads, head_dim) array,
        0 for a sequence that has none yet (B >= 1)."""
        zero = np.zeros((self.num_kv_heads, self.head_dim), self._dtype)
        return np.stack([zero if m is None else m for m in means] or [zero])

    def _name_blocks(self, s: int, new: Optional[list[int]]) -> None:
        """Sequence s's new tokens' ids (None: not given, and no more names
        for it), and the names of the blocks they filled."""
        assert self._prefix is not None
        held = self._tokens[s]
        if held is None or new is None:
            self._tokens[s] = None
            return
        held.extend(new)
        names, bs = self._names[s], self.block_size
        while len(names) < min(len(held), self._drafts.get(s, len(held))) // bs:
            k = len(names)
            names.append(chain(names[-1] if names else None, held[k * bs:(k + 1) * bs]))
            self._prefix.register(self._blocks[s][k], names[-1])

    def match_prefix(self, seq_id: int, token_ids: NDArray[np.integer[Any]]) -> int:
        """Give the empty sequence seq_id the named blocks of the longest
        prefix of token_ids that whole blocks hold, shared (vLLM's
        automatic prefix caching; enable_prefix_caching).  The last token
        is left out, so that at least one is computed (its logits are the
        next step's).  Returns the positions it now holds: append the
        tokens from there on (token_ids[n:]) as usual.

        Raises
        ------
        TypeError
            seq_id not an int, token_ids not a 1-D int array.
        ValueError
            A cache without enable_prefix_caching, a sequence that is not
            live or holds positions already.
        """
        if self._prefix is None:
            raise ValueError("match_prefix needs a PagedKVCache made with "
                             "enable_prefix_caching=True")
        tokens = _token_ids(token_ids, None)
        bs = self.block_size
        with self._lock:
            s = self._one(seq_id)
            if self._lens[s] != 0:
                raise ValueError(f"sequence {s} holds {self._lens[s]} positions; match_prefix "
                                 "starts an empty one")
            names: list[bytes] = []
            blocks: list[int] = []
            for k in range((len(tokens) - 1) // bs):
                name = chain(names[-1] if names else None, tokens[k * bs:(k + 1) * bs])
                block = self._prefix.lookup(name)
                if block is None:
                    break
                names.append(name)
                blocks.append(block)
            for block in blocks:
                if self._refs[block] == 0:
                    self._prefix.claim(block)
                self._refs[block] += 1
            n = len(blocks) * bs
            self._blocks[s], self._lens[s] = blocks, n
            self._tokens[s], self._names[s] = tokens[:n], names
            return n

    def _room(self, ids: list[int], counts: list[int]) -> list[tuple[int, bool]]:
        """The plan of an append (_plan), or OutOfBlocksError when the pool
        lacks its blocks."""
        plans = self._plan(ids, counts)
        need = sum(p[0] for p in plans)
        if need > self.num_free_blocks:
            raise OutOfBlocksError(
                f"this append needs {need} free blocks of {self.block_size} positions and the "
                f"pool has {self.num_free_blocks} of {self.num_blocks}; free finished sequences "
                "(free(seq_id)) or create the cache with more blocks")
        return plans

    def truncate(self, seq_ids: SeqIds, lengths: Sequence[int]) -> None:
        """Forget the positions of each seq_ids[b] from lengths[b] on, as if
        never appended, their blocks past it given back to the pool: the
        rejected draft tokens of speculative decoding, or a step that
        failed after its append (MultiHeadAttention rolls back so after a
        Ctrl-C during the attention).  A block still shared with a fork
        stays shared and is copied by the first append into it.  As with
        ``free``, truncate no sequence another thread is attending.

        Raises
        ------
        TypeError
            seq_ids or lengths not ints.
        ValueError
            A sequence that is not live or named twice, as many lengths as
            sequences missing, or a length below 0 or above the positions
            the sequence holds; nothing is changed then.
        """
        counts = [C.check_index(n, f"lengths[{i}]", 0) for i, n in enumerate(lengths)]
        with self._lock:
            ids = self._ids(seq_ids, distinct=True)
            if len(counts) != len(ids):
                raise ValueError(f"lengths has {len(counts)} entries; expected one per "
                                 f"sequence ({len(ids)})")
            for s, n in zip(ids, counts):
                if n > self._lens[s]:
                    raise ValueError(f"lengths[{ids.index(s)}] = {n}; sequence {s} holds "
                                     f"{self._lens[s]} positions: truncate keeps a prefix "
                                     "of them")
            for s, n in zip(ids, counts):
                self._cut(s, n)

    def _cut(self, s: int, n: int) -> None:
        """Sequence s keeps its first n positions (n <= its length), its
        blocks past them given back (the lock held)."""
        blocks = self._blocks[s]
        keep = -(-n // self.block_size)
        self._give_back(blocks[keep:])
        del blocks[keep:]
        self._lens[s] = n
        if n == 0:
            self._means.pop(s, None)
        if self._drafts.get(s, n) >= n:  # no draft left
            self._drafts.pop(s, None)
        tokens = self._tokens[s]  # (empty: its ids may be given again)
        self._tokens[s] = [] if n == 0 else None if tokens is None else tokens[:n]
        del self._names[s][n // self.block_size:]
        if self._prefix is not None and n % self.block_size:
            # written from n on in place once its other holders let go
            self._prefix.forget(blocks[-1])

    def accept_draft(self, seq_ids: SeqIds, num_draft_tokens: Sequence[int],
                     accepted: Sequence[Sequence[int]]) -> None:
        """Keep the verified path of each sequence's tree of draft tokens
        and drop the rest (speculative decoding's step after ``attend``
        with a ``tree_mask``).

        Sequence seq_ids[b] holds its num_draft_tokens[b] draft tokens as
        its last positions; accepted[b] lists, in increasing order, the
        indices among them of the tokens kept (the accepted path, root
        first; empty: none).  Their rows move, as stored, bit for bit, to
        the positions right after the tokens before the tree, and the
        sequence is truncated after them: blocks left empty go back to the
        pool.  With rotary, append the drafts at their depth's positions
        (``append``'s ``positions``), which are the slots they are moved to.
        A block another sequence shares is copied before it is written, as
        by ``append``.  With prefix caching, the blocks of the tree lose
        their names and the full blocks of the kept path are named by its
        tokens' ids (append the drafts with ``draft=True`` so that none is
        named before).

        Raises
        ------
        TypeError
            seq_ids, num_draft_tokens or accepted not ints, or not lists of
            them (accepted: one list of indices per sequence).
        ValueError
            A sequence that is not live or named twice; as many counts or
            lists as sequences missing; more draft tokens than positions
            held; indices that are not increasing or not below the count.
            Nothing is changed then.
        OutOfBlocksError
            Shared blocks to copy and too few free blocks for them, counting
            those the dropped drafts give back (a MemoryError); nothing is
            changed.
        """
        counts = [C.check_index(n, f"num_draft_tokens[{i}]", 0)
                  for i, n in enumerate(_items(num_draft_tokens, "num_draft_tokens", "ints"))]
        paths = [[C.check_index(x, f"accepted[{b}][{i}]", 0)
                  for i, x in enumerate(_items(path, f"accepted[{b}]", "indices"))]
                 for b, path in enumerate(_items(accepted, "accepted", "lists of indices"))]
        with self._lock:
            ids = self._ids(seq_ids, distinct=True)
            if not len(counts) == len(paths) == len(ids):
                raise ValueError(f"num_draft_tokens has {len(counts)} entries and accepted "
                                 f"{len(paths)}; expected one per sequence ({len(ids)})")
            for b, (s, n, path) in enumerate(zip(ids, counts, paths)):
                if n > self._lens[s]:
                    raise ValueError(f"num_draft_tokens[{b}] = {n}; sequence {s} holds "
                                     f"{self._lens[s]} positions")
                if any(y <= x for x, y in zip(path, path[1:])) or (path and path[-1] >= n):
                    raise ValueError(f"accepted[{b}] = {path}: expected increasing indices "
                                     f"below num_draft_tokens[{b}] = {n}")
            plans = [self._accept_plan(s, n, path) for s, n, path in zip(ids, counts, paths)]
            self._check_accept(ids, plans)
            for s, path, (base, needed, moved) in zip(ids, paths, plans):
                if self._prefix is not None:  # the tree's blocks were named by drafts
                    for block in self._blocks[s][base // self.block_size:]:
                        self._prefix.forget(block)
                    del self._names[s][base // self.block_size:]
                self._cut(s, needed)  # the drafts past the last one kept
                if moved:
                    self._move(s, moved)
                tokens = self._tokens[s]
                if self._prefix is not None and tokens is not None:
                    tokens[base:base + len(path)] = [tokens[base + x] for x in path]
                self._cut(s, base + len(path))
                if self._prefix is not None:
                    self._name_blocks(s, [])

    def _accept_plan(self, s: int, n: int, path: list[int]) -> tuple[int, int, list[tuple[int, int]]]:
        """accept_draft's plan for sequence s: its first draft slot, the
        slots it needs until the moves are done, and the moves (src, dst)."""
        base = self._lens[s] - n
        return (base, base + (path[-1] + 1 if path else 0),
                [(base + x, base + i) for i, x in enumerate(path) if x != i])

    def _check_accept(self, ids: list[int], plans: list[tuple[int, int, list[tuple[int, int]]]]
                      ) -> None:
        """OutOfBlocksError unless the free blocks, with those the dropped
        drafts give back first, cover the copies of shared blocks the moves
        write (the lock held)."""
        bs, copies, freed = self.block_size, 0, 0
        holders: dict[int, int] = {}
        for s, (_, needed, moved) in zip(ids, plans):
            for block in self._blocks[s][-(-needed // bs):]:  # given back by the first cut
                left = holders.get(block, int(self._refs[block])) - 1
                holders[block] = left
                freed += left == 0
            for k in sorted({dst // bs for _, dst in moved}):
                block = self._blocks[s][k]
                left = holders.get(block, int(self._refs[block]))
                holders[block] = left - 1 if left > 1 else left
                copies += left > 1
        if copies > self.num_free_blocks + freed:
            raise OutOfBlocksError(f"accepting these paths copies {copies} shared blocks and "
                                   f"the pool has {self.num_free_blocks} free (and {freed} the "
                                   "dropped drafts give back)")

    def _move(self, s: int, moved: list[tuple[int, int]]) -> None:
        """Rows of sequence s from slot src to slot dst for each (src, dst)
        (every dst below its src), its blocks written copied first when
        shared (the lock held)."""
        bs, blocks = self.block_size, self._blocks[s]
        for k in sorted({dst // bs for _, dst in moved}):
            old = blocks[k]
            if self._refs[old] > 1:  # copy-on-write, as append's
                new = self._take()
                for buf in self._buffers():
                    buf[new] = buf[old]
                self._refs[old] -= 1
                blocks[k] = new
            elif self._prefix is not None:
                self._prefix.forget(old)
        src, dst = (np.array(x, np.int64) for x in zip(*moved))
        table = np.array(blocks, np.int64)
        for buf in self._buffers():  # gathered before written (fancy indexing copies)
            buf[table[dst // bs], :, dst % bs] = buf[table[src // bs], :, src % bs]

    def _buffers(self) -> list[NDArray[Any]]:
        """The pool's arrays that hold their own memory: keys, values, their
        scales (a latent pool's values and value scales are views of its
        keys': written through those alone, never twice)."""
        return self._core.owned([self._key, self._value, self._k_scale, self._v_scale])

    def _take(self) -> int:
        """A free block: one given back, else a never used one, else the
        least recently freed named one (its name forgotten)."""
        if self._free:
            block = self._free.pop()
        elif self._fresh < self.num_blocks:
            block, self._fresh = self._fresh, self._fresh + 1
        else:
            evicted = self._prefix.evict() if self._prefix is not None else None
            assert evicted is not None, "_room counted the free blocks"
            block = evicted
        self._refs[block] = 1
        return block

    @staticmethod
    def _cu(cu_seqlens: object, name: str, B: int, total: int) -> NDArray[np.int64]:
        if cu_seqlens is None:
            if total != B:
                raise ValueError(f"without {name}, each sequence gets one token: expected "
                                 f"{B} rows, got {total}")
            return np.arange(B + 1, dtype=np.int64)
        cu = C.cu_seqlens(cu_seqlens, name, total)
        if cu.shape[0] != B + 1:
            raise ValueError(f"{name} holds {cu.shape[0]} values; expected one more than the "
                             f"{B} sequences")
        return cu

    @staticmethod
    def _rotate(x: NDArray[Any], positions: NDArray[np.int64], rotary: object,
                interleaved: bool, nthreads: int) -> NDArray[Any]:
        if not isinstance(rotary, (tuple, list)) or len(rotary) != 2:
            raise TypeError(f"rotary must be a pair (cos, sin) of tables, got "
                            f"{type(rotary).__name__} of "
                            f"{len(rotary) if isinstance(rotary, (tuple, list)) else 'no'} items")
        cos = C.require_array(rotary[0], "rotary's cos")
        if x.shape[0] and cos.ndim == 2:  # the positions are the cache's: say so
            low, high = int(positions.min()), int(positions.max())
            if low < 0:
                raise ValueError("rotary: a query without a position (with is_causal=False a "
                                 "sequence has more queries than positions held)")
            if high >= cos.shape[0]:
                raise ValueError(f"rotary: the tables cover positions 0 to {cos.shape[0] - 1} "
                                 f"and this step reaches position {high}; make them longer")
        return rotate(x, positions, rotary[0], rotary[1], interleaved, nthreads)

    def _rotated(self, x: NDArray[Any], positions: NDArray[np.int64], rotary: object,
                 interleaved: bool, nthreads: int) -> NDArray[Any]:
        """x (n, heads, head_dim) rotated at positions (a new array): all its
        features, or a latent pool's after value_dim (the rotary part)."""
        if not self._core.latent:
            return self._rotate(x, positions, rotary, interleaved, nthreads)
        y = np.array(x, copy=True)
        y[..., self._value_dim:] = self._rotate(x[..., self._value_dim:], positions, rotary,
                                                interleaved, nthreads)
        return y

    # ---- attention ---------------------------------------------------------
    def attend(self, seq_ids: SeqIds, query: NDArray[Float],
               cu_seqlens_q: Optional[NDArray[np.integer[Any]]] = None, *,
               rotary: Optional[tuple[NDArray[Any], NDArray[Any]]] = None,
               rotary_interleaved: bool = False, scale: Optional[float] = None,
               is_causal: bool = True, window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, return_lse: bool = False,
               out: Optional[NDArray[Float]] = None, num_threads: Optional[int] = None,
               precision: str = "exact", tree_mask: Optional[NDArray[np.bool_]] = None,
               tree_mask_indptr: Optional[NDArray[np.integer[Any]]] = None,
               positions: Optional[NDArray[np.integer[Any]]] = None, cascade: bool = False
               ) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]:
        """Attention of each sequence's new queries over every position it
        holds: one ``paged_attention`` call.

        Parameters
        ----------
        seq_ids : list of int or 1-D int array, B live sequences
        query : ndarray, (total_q, Hq, head_dim)
            Packed queries, the cache's dtype (or, for a float32 cache,
            float16 or bfloat16: the output in that dtype); Hq a multiple of
            num_kv_heads.  With is_causal
            (the default) seq_ids[b]'s rows are its last positions, whose
            keys and values were appended first.
        cu_seqlens_q : int array (B + 1,) or None
            As ``append``'s cu_seqlens (None: one query each).
        rotary, rotary_interleaved, positions
            As ``append``'s, at each query's position (by default its
            sequence's length minus its L queries, plus its row).
        scale, is_causal, window_size, alibi_slopes, softcap, sinks, return_lse, out, num_threads, precision, tree_mask, tree_mask_indptr, cascade
            As ``paged_attention``'s (the cache passes its own scales,
            storage and value_dim).  With a tree, pass each draft token's
            own position (its depth after the tokens before the tree) as
            ``positions`` to ``append`` and here when the cache applies
            rotary; ``accept_draft`` keeps the verified path.

        Returns and raises as ``paged_attention``; ValueError for a sequence
        that is not live or named twice, or, with is_causal, that holds fewer positions
        than its queries.
        """
        with self._lock:  # the sequences as they are now: their lengths and blocks
            ids = self._ids(seq_ids, distinct=True)
            lens = np.array([self._lens[s] for s in ids], np.int64)
            table = self._table(ids)
            means = [self._means.get(s) for s in ids]
        half = self._core.check_query(query, self._layouts[2], 1)
        check_features(self.head_dim, self._value_dim)
        mode = C.check_precision(precision)
        caller_query = query  # out must not overlap it, rotated or not
        cu = self._cu(cu_seqlens_q, "cu_seqlens_q", len(ids), query.shape[0])
        counts = cu[1:] - cu[:-1]
        causal = C.check_bool(is_causal, "is_causal")
        if causal and (counts > lens).any():
            b = int(np.flatnonzero(counts > lens)[0])
            raise ValueError(f"sequence {ids[b]} has {counts[b]} quer{'y' if counts[b] == 1 else 'ies'} "
                             f"but holds {lens[b]} position{'' if lens[b] == 1 else 's'}: with is_causal the queries are its last positions; "
                             "append their keys and values first")
        trees = _tree.check(tree_mask, tree_mask_indptr, counts, lens)
        _no_positions(positions, rotary)
        rounded_to = None
        if half and (rotary is not None or self._keys.rotate):
            # rotated in float32, the output rounded to the query's dtype at the end
            rounded_to, query = query.dtype, query.astype(np.float32)
        if rotary is not None:
            seq = np.repeat(np.arange(len(ids)), counts)
            positions = _positions(positions, query.shape[0], (lens - counts)[seq] +
                                   np.arange(query.shape[0]) - cu[:-1][seq])
            query = self._rotated(query, positions, rotary,
                                 C.check_bool(rotary_interleaved, "rotary_interleaved"),
                                 _runtime.resolve_threads(num_threads))
        query = self._keys.rotated(query)
        key_mean = self._stacked(means) if self._keys.smooth else None
        # paged_attention's call without its checks of what the cache keeps
        # good (its pool, table, lengths and scales): they took more than half
        # of a short call's time (threads-and-speed.md, "Small calls")
        inputs = {"query": caller_query, "key_cache": self._key, "value_cache": self._value,
                  "k_scale": self._k_scale, "v_scale": self._v_scale,
                  "cu_seqlens_q": cu_seqlens_q, "tree_mask": tree_mask}
        if table.shape[1] == 0:  # no sequence holds a key: a column the kernels never read
            table = np.zeros((len(ids), 1), np.int32)
        if rounded_to is not None and out is not None:  # filled at the end, in its dtype
            C.check_out(out, (query.shape[0], query.shape[1], self._value_dim), rounded_to,
                        inputs)
        result = ragged(query, self._key, self._value, table, None, lens, cu, counts,
                        (self._k_scale, self._v_scale), query_store(query.dtype),
                        _storage.store(self._storage), self._value_dim, causal, True, 0,
                        scale, window_size, alibi_slopes, softcap, sinks, return_lse,
                        out if rounded_to is None else None, num_threads, inputs, mode,
                        key_mean, trees, cascade)
        if rounded_to is None:
            return result
        nthreads = _runtime.resolve_threads(num_threads)
        if isinstance(result, tuple):
            return narrow(result[0], rounded_to, nthreads, out), result[1]
        return narrow(result, rounded_to, nthreads, out)


def _items(x: object, name: str, what: str) -> list[Any]:
    """x as a list: a list, tuple or 1-D array of `what`."""
    if isinstance(x, np.ndarray) and x.ndim >= 1:
        return list(x)
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{name} must be a list of {what}, got {type(x).__name__}")
    return list(x)


def _no_positions(positions: object, rotary: object) -> None:
    if positions is not None and rotary is None:
        raise ValueError("positions are where rotary rotates the tokens; pass rotary too")


def _positions(positions: object, n: int, slots: NDArray[np.int64]) -> NDArray[np.int64]:
    """The rotary positions of n tokens: positions (checked), else their slots."""
    if positions is None:
        return slots
    a = C.require_array(positions, "positions", "np.int64")
    if a.dtype.kind not in "iu" or a.ndim != 1:
        raise TypeError(f"positions must be a 1-D int array, got {a.dtype} of shape "
                        f"{C.shape_str(a.shape)}")
    if a.shape[0] != n:
        raise ValueError(f"positions holds {a.shape[0]} values; expected one per token ({n})")
    if a.size and (a.min() < 0 or a.max() > np.iinfo(np.int64).max // 2):
        raise ValueError(f"positions holds {a.min() if a.min() < 0 else a.max()}; expected "
                         "positions from 0")
    return C.contiguous(a, np.int64)


def _token_ids(token_ids: object, n: Optional[int]) -> list[int]:
    """token_ids as a list of ints: a 1-D integer array or a list of ints (of
    n entries when n is given), each an int64, before anything is written."""
    a = (np.asarray(token_ids) if isinstance(token_ids, (list, tuple))
         else C.require_array(token_ids, "token_ids"))
    if a.ndim != 1 or not (np.issubdtype(a.dtype, np.integer) or a.size == 0):
        raise TypeError(f"token_ids must be a 1-D array of ints, got {a.dtype} of shape "
                        f"{C.shape_str(a.shape)}")
    if n is not None and a.shape[0] != n:
        raise ValueError(f"token_ids holds {a.shape[0]} ids; expected one per token ({n})")
    ids = [int(t) for t in a]
    if ids and not -2**63 <= min(ids) <= max(ids) < 2**63:
        raise ValueError(f"token_ids holds {max(ids, key=abs)}; ids are int64")
    return ids
