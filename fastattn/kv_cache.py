"""KVCache: preallocated keys and values of the positions seen so far, for
generating one step at a time."""
from __future__ import annotations

from typing import Any, Literal, Mapping, Optional, cast, overload

import numpy as np

from . import _checks as C
from . import _cache, _masks, _runtime, _storage, _tree
from ._cache import Layout
from ._keys import KeyOptions, KeyTransform
from ._dispatch import StoredKV, route
from ._typing import DTypeLike, Float, MaskArray, NDArray, Result


def _count(n: int, noun: str) -> str:
    """"1 position", "3 positions"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


class KVCache(KeyOptions):
    """The keys and values of an autoregressive decoder, kept between steps.

    Buffers of shape (batch_size, num_kv_heads, capacity, head_dim) (and
    value_dim for the values) are allocated once; each step writes its new
    keys and values in place after the ones already held, and attention
    reads the filled prefix through views, so nothing is reallocated or
    copied per step.  With ``is_causal=True`` the new queries are aligned
    with the last positions (bottom-right causal alignment, PyTorch's
    ``causal_lower_right``), so one step of L new tokens gives exactly the
    rows of a full causal pass over the whole sequence.

    Padded batches: every sequence of the batch writes its step at the same
    slots; the slots of padding tokens (``key_padding_mask`` True in
    ``append``) are recorded and hidden from every later query through a
    (batch, 1, 1, length) key mask, a view of a (batch, capacity) boolean
    array, never expanded.  Left padding (prompts of unequal length padded
    in front, as Hugging Face's ``generate`` does) and right padding both
    work; ``lengths`` gives the real tokens of each sequence.

    Parameters
    ----------
    batch_size, num_kv_heads, capacity, head_dim : int
        capacity is the number of positions the cache can hold (>= 1).
    value_dim : int or None
        Size of a value head; None means head_dim.
    dtype : float32 or float64
        Of the keys and values appended and of the queries: what attention
        computes in.
    storage : {"float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"} or None
        How the keys and values are held (float32 dtype only; None: as
        dtype).  Decoding reads the whole cache at every step, so fewer
        bytes per element decode faster and hold longer sequences in the
        same memory; the kernel converts a row or a tile at a time as it
        reads, never the whole cache.

        - "float16" (IEEE binary16, llama.cpp's default f16 cache) and
          "bfloat16" (ml_dtypes' dtype; needs the ml_dtypes package): each
          element rounded to nearest-even on ``append``.  Relative error
          at most 2**-11 and 2**-8 of each element; float16 holds
          magnitudes up to 65504: a finite value that rounds past it
          (magnitude 65520 or more; 65519 is held as 65504) is a
          ValueError, inf and NaN are kept.
        - "int8": symmetric absmax quantisation of each row of head_dim
          (value_dim) features of one position and head, with a float32
          scale per row: ``scale = max|x| / 127``, ``code =
          round_half_even(x / scale)``, read as ``scale * code``; the error
          of each element is at most scale / 2 = max|x| / 254.  The scheme
          of llama.cpp's q8_0 (which takes blocks of 32 elements with a
          float16 scale) with one scale per row, the per-token granularity
          of ONNX Runtime's quantised KV cache and KIVI's value cache
          (Liu et al. 2024).  Only finite values can be stored, up to
          about 3.4e38 (127 times a scale must stay finite); rows whose
          scale falls among float32's subnormals (max|x| below about
          1.5e-36) keep an error below 127 * 2**-150 (about 9e-44) more.
        - "float8_e5m2" (binary16's top byte; vLLM's fp8_e5m2 cache): each
          element rounded to nearest-even, no scale: relative error at most
          2**-3; magnitudes up to 57344: a finite value that rounds past
          it (magnitude 61440 or more; 60000 is held as 57344) is a
          ValueError; inf and NaN kept.
        - "float8_e4m3fn" (OCP FP8, ml_dtypes' name; vLLM's fp8_e4m3 cache,
          per row rather than per tensor): each row divided by a float32
          scale, the power of two that brings max|x| into (224, 448], and
          rounded to nearest-even: relative error at most 2**-4 (rows
          whose values fall below 2**-6 of the scale, e4m3's subnormals,
          keep an error of at most 2**-10 scale); finite values only.
        - "int4": llama.cpp's q4_0 layout, 4.5 bits per element: each row
          in blocks of 32 elements (the last one zero-padded), a float16
          scale ``d = max|x| / 7`` per block and codes
          ``clip(round_half_even(x / d), -7, 7)``, read as ``d * code``;
          the error of each element is at most about d / 2 = max|block| /
          14.  One scale per 32 elements of a token's row, keys and values
          alike (README's low-precision guide gives the measurements behind
          that choice).  Finite values only, up to 458528 (7 times
          float16's largest): a magnitude of 458640 or more, whose scale
          rounds past float16's range, is a ValueError.

        Every conversion the kernels make is exact, and for float8 and int4
        the scale multiplies exactly: attention over such a cache gives the
        bits of the float32 call on ``cache.key`` and ``cache.value``.
        int8's row scale multiplies each dot product and each weight
        instead, so its results are within rounding of that call, not
        its bits (the low-precision guide).
    smooth_k : bool
        Store each key less the mean of its (sequence, head)'s keys over
        the first append that holds real tokens of that sequence (the
        prompt; non-finite elements left out), kept until ``reset`` or a
        ``truncate`` to no real token: SageAttention's ``smooth_k``
        (Zhang et al., ICLR 2025),
        with the mean fixed once so that later steps stay exact.  Every
        logit is unchanged: attention adds ``scale * q . mean`` back to
        each score.  It spends the int8 and int4 scales on what varies
        rather than on a bias the keys share (default False).
    rotate_k : bool
        Rotate the head dimension of keys and queries by an orthonormal
        Hadamard matrix (Sylvester's, of the largest power of two dividing
        head_dim, repeated along the diagonal) before storing the keys:
        llama.cpp's rotation of quantised caches (its PR #21038),
        mlx-lm's ``--kv-rotate``.  Q K^T is unchanged in exact arithmetic;
        outlier channels are spread over all features.  Values are not
        rotated.  A 16-bit query is then read as float32 and rotated, and
        the output rounded once to its dtype (default False).

        The README's low-precision guide gives the error of each storage
        with and without these; ``key`` returns the keys as appended
        (rounded), whatever is stored.  Both may take keys past the
        storage's range (the rotation multiplies a row's largest by up to
        sqrt(head_dim)): ``append`` says so then; with rotate_k, keys with
        an inf or a NaN are refused (the rotation would spread it over its
        block of features, and its scores come out NaN, not infinite).
    latent : bool
        Multi-head Latent Attention's cache (DeepSeek-V2, Liu et al. 2024;
        FlashMLA's and vLLM's MLA layout, whose ``head_dim_v`` is
        value_dim here): each position holds one row of head_dim features
        (the compressed latent, then the decoupled rotary part), and its
        value is the row's first value_dim features, a view of the same
        storage: held once and read once for both products (with many
        query heads per key/value head, MLA's absorbed form, a matrix
        product).  ``append`` takes the keys alone (value None).  Not with
        smooth_k nor rotate_k, which would change the values; value_dim a
        multiple of 32 in int4 (default False).

    Raises
    ------
    TypeError
        Sizes that are not ints, a dtype other than float32 and float64
        (for a 16-bit one the message says how to store in 16 bits), or
        smooth_k, rotate_k or latent not bools.
    ValueError
        Sizes below 1 (head_dim and value_dim may be 0), a storage not
        among those above (or other than "float64" with float64),
        buffers larger than any address space, or a latent cache with
        value_dim above head_dim, smooth_k or rotate_k.
    ImportError
        storage="bfloat16" without the ml_dtypes package.
    MemoryError
        Buffers that cannot be allocated; the message gives the sizes and
        the bytes.
    """

    def __init__(self, batch_size: int, num_kv_heads: int, capacity: int, head_dim: int, *,
                 value_dim: Optional[int] = None, dtype: DTypeLike = np.float32,
                 storage: Optional[str] = None, smooth_k: bool = False,
                 rotate_k: bool = False, latent: bool = False) -> None:
        batch_size = C.check_index(batch_size, "batch_size", 1)
        core = _cache.Core("KVCache", num_kv_heads, head_dim, value_dim, dtype, storage, latent)
        self._keys = KeyTransform(smooth_k, rotate_k, core.latent)
        capacity = C.check_index(capacity, "capacity", 1)
        sizes = (f"batch_size={batch_size}, num_kv_heads={core.num_kv_heads}, "
                 f"capacity={capacity}, head_dim={core.head_dim}, value_dim={core.value_dim}, "
                 f"{core.dtype.name}, storage={core.storage}")
        # real: True = a real token, may be attended
        rows, (real,) = core.allocate((batch_size, core.num_kv_heads, capacity), sizes,
                                      "capacity", [((batch_size, capacity), bool)])
        self._core = core
        self._dtype, self._storage = core.dtype, core.storage
        self._head_dim, self._value_dim = core.head_dim, core.value_dim
        self._key: NDArray[Any] = rows.key
        self._value: NDArray[Any] = rows.value
        self._real: NDArray[np.bool_] = real
        # int8, float8_e4m3fn: the scale of each (sequence, head, position) row
        self._key_scale: Optional[NDArray[np.float32]] = rows.key_scale
        self._value_scale: Optional[NDArray[np.float32]] = rows.value_scale
        B, Hkv, D, Dv = batch_size, core.num_kv_heads, core.head_dim, core.value_dim
        # smooth_k: the mean each (sequence, head)'s keys are stored less,
        # rotated as they are; fixed by the first append after length 0
        self._key_mean: Optional[NDArray[Any]] = (np.zeros((B, Hkv, D), core.dtype)
                                                  if self._keys.smooth else None)
        self._layouts = (Layout(("batch_size", "num_kv_heads", "L", "head_dim"), (B, Hkv, None, D)),
                         Layout(("batch_size", "num_kv_heads", "L", "value_dim"),
                                (B, Hkv, None, Dv)),
                         Layout(("batch_size", "Hq", "L", "head_dim"), (B, None, None, D)))
        self._length = 0
        self._padded = False

    # ---- sizes -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return int(self._key.shape[0])

    @property
    def num_kv_heads(self) -> int:
        return int(self._key.shape[1])

    @property
    def capacity(self) -> int:
        return int(self._key.shape[2])

    @property
    def head_dim(self) -> int:
        return self._head_dim

    @property
    def value_dim(self) -> int:
        return self._value_dim

    @property
    def dtype(self) -> np.dtype[np.floating[Any]]:
        """The dtype of the keys and values appended and of the queries."""
        return self._dtype

    @property
    def storage(self) -> str:
        """How the keys and values are held: "float32", "float64", "float16",
        "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2" or "int4"."""
        return self._storage

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers (keys, values, row scales, padding flags, key mean)."""
        rows = self._core.owned([self._key, self._value, self._key_scale, self._value_scale])
        mean = 0 if self._key_mean is None else self._key_mean.nbytes
        return int(sum(a.nbytes for a in rows) + self._real.nbytes + mean)

    @property
    def length(self) -> int:
        """Positions filled so far (padding included), the S of attention."""
        return self._length

    @property
    def lengths(self) -> NDArray[np.int64]:
        """Real (non-padding) tokens held per sequence, int64 (batch_size,)."""
        counts: NDArray[np.intp] = np.count_nonzero(self._real[:, :self._length], axis=1)
        return counts.astype(np.int64)

    @property
    def key(self) -> NDArray[np.floating[Any]]:
        """The keys held, (batch_size, num_kv_heads, length, head_dim), in the
        cache's dtype, read-only: a view when stored so, else a new array of
        what attention reads (the stored values converted, int8 times its
        scales; with smooth_k the mean added back, with rotate_k rotated
        back)."""
        keys = self._read(self._key, self._key_scale, self._head_dim)
        if self._key_mean is None and not self._keys.rotate:
            return keys
        if self._key_mean is not None:
            keys = keys + self._key_mean[:, :, None]
        return _storage.read_only(self._keys.rotated(keys))

    @property
    def value(self) -> NDArray[np.floating[Any]]:
        """The values held, (batch_size, num_kv_heads, length, value_dim); as ``key``."""
        return self._read(self._value, self._value_scale, self._value_dim)

    def _read(self, buf: NDArray[Any], scale: Optional[NDArray[np.float32]], n: int
              ) -> NDArray[np.floating[Any]]:
        held = buf[:, :, :self._length]
        if held.dtype == self._dtype:
            return _storage.read_only(held)
        # read-only too: a write to it would change nothing held
        return _storage.read_only(_storage.decode(
            held, None if scale is None else scale[:, :, :self._length], self._storage, n,
            self._dtype))

    @property
    def attn_mask(self) -> Optional[NDArray[np.bool_]]:
        """Read-only bool view (batch_size, 1, 1, length), True = a real token
        that may be attended (the functional API's convention), or None when
        no padding was ever appended."""
        return _storage.read_only(self._real[:, None, None, :self._length]) if self._padded else None

    @property
    def latent(self) -> bool:
        """Whether the values are the keys' first value_dim features (MLA)."""
        return self._core.latent

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, num_kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype.name}, storage={self.storage}, "
                f"{self._keys.options_repr()}{'latent=True, ' if self._core.latent else ''}"
                f"length={self.length})")

    def reset(self) -> None:
        """Forget every position (the buffers are kept for the next sequence)."""
        self.truncate(0)

    def truncate(self, length: int) -> None:
        """Forget the positions from length on, as if never appended: the
        rejected draft tokens of speculative decoding, or a step that
        failed after its append (MultiHeadAttention rolls back so after a
        Ctrl-C during the attention).

        Raises
        ------
        TypeError
            length not an int.
        ValueError
            length below 0 or above the positions held.
        """
        length = C.check_index(length, "length", 0)
        if length > self._length:
            raise ValueError(f"length = {length}; the cache holds {self._length} positions: "
                             "truncate keeps a prefix of them")
        self._hold(length)

    def _hold(self, length: int) -> None:
        """The positions before length are the ones held (a sequence with no
        real token among them gets its key mean from its next ones)."""
        self._real[:, length:] = False
        self._length = length
        self._padded = not bool(self._real[:, :length].all())

    def append(self, key: NDArray[np.floating[Any]], value: Optional[NDArray[np.floating[Any]]],
               key_padding_mask: Optional[NDArray[np.bool_]] = None) -> None:
        """Write L new positions after the ones held, in place.

        Parameters
        ----------
        key : ndarray, (batch_size, num_kv_heads, L, head_dim), the cache's dtype
        value : ndarray, (batch_size, num_kv_heads, L, value_dim), or None
            Any strides (for example head views of a projection); copied
            into the buffers in the cache's storage (rounded or quantised,
            see the class), never kept.  None for a latent cache, whose
            values are the keys' first value_dim features.
        key_padding_mask : bool ndarray (batch_size, L) or None
            nn.MultiheadAttention's convention: True = padding, never
            attended by any later query.

        Raises
        ------
        TypeError
            Non-arrays, a dtype other than the cache's, or a mask that is
            not bool.
        ValueError
            Shapes that do not match the cache, L positions that do not fit
            in the remaining capacity, or values the storage cannot hold: a
            finite value that rounds past float16's or float8_e5m2's
            largest, a non-finite value in int8, float8_e4m3fn or int4, a
            value beyond int8's, e4m3's or int4's range as their scales
            allow (see the class).

        Notes
        -----
        Nothing is written when an error is raised.
        """
        B = self.batch_size
        L = self._core.check_rows(key, value, self._layouts[0], self._layouts[1], "positions")
        if key_padding_mask is not None:
            C.require_array(key_padding_mask, "key_padding_mask")
            if key_padding_mask.dtype != np.bool_:
                raise TypeError(f"key_padding_mask has dtype {key_padding_mask.dtype}; expected "
                                "bool (True = padding)")
            if key_padding_mask.shape != (B, L):
                raise ValueError(f"key_padding_mask has shape "
                                 f"{C.shape_str(key_padding_mask.shape)}; expected "
                                 f"(batch_size, L) = ({B}, {L})")
        n = self._length
        if n + L > self.capacity:
            raise ValueError(f"KVCache capacity exceeded: {_count(L, 'position')} cannot be "
                             f"appended to the {_count(n, 'position')} held of "
                             f"{self.capacity}; nothing was written. Create it with a larger "
                             "capacity or reset() it")
        rotated = self._keys.rotated(key)
        mean = self._key_mean
        if mean is not None:
            # a sequence's first real tokens fix its mean (an append of
            # padding alone, left padding's first chunk, leaves it to the next)
            unset = cast("NDArray[np.bool_]", ~self._real[:, :n].any(axis=1))
            if unset.any():
                real = None if key_padding_mask is None else ~key_padding_mask[:, None, :]
                mean = np.where(unset[:, None, None], KeyTransform.mean(rotated, real, 2), mean)
        held = self._keys.stored(key, rotated, None if mean is None else mean[:, :, None])
        try:
            keys, key_scale = self._encode(held, "key")
        except ValueError as exc:
            raise self._keys.explain(exc, key) from None
        values, value_scale = (None, None) if value is None else self._encode(value, "value")
        if self._key_mean is not None and mean is not None:
            self._key_mean[...] = mean
        writes = [(self._key, keys), (self._key_scale, key_scale)]
        if not self._core.latent:  # (a latent cache's values are its keys)
            writes += [(self._value, values), (self._value_scale, value_scale)]
        for buf, rows in writes:
            if buf is not None and rows is not None:
                buf[:, :, n:n + L] = rows
        if key_padding_mask is None:
            self._real[:, n:n + L] = True
        else:
            np.logical_not(key_padding_mask, out=self._real[:, n:n + L])
            self._padded = self._padded or bool(key_padding_mask.any())
        self._length = n + L

    def _encode(self, x: NDArray[np.floating[Any]], name: str
                ) -> tuple[NDArray[Any], Optional[NDArray[np.float32]]]:
        """x in the storage, and its int8 row scales (None otherwise)."""
        return _storage.encode(x, self._storage, name, _runtime.resolve_threads(None))

    @overload
    def attend(self, query: NDArray[Float], *, attn_mask: Optional[MaskArray] = None,
               is_causal: bool = True, scale: Optional[float] = None,
               need_weights: Literal[False] = False, return_lse: Literal[False] = False,
               window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
               num_threads: Optional[int] = None, precision: str = "exact",
               tree_mask: Optional[NDArray[np.bool_]] = None) -> NDArray[Float]: ...

    @overload
    def attend(self, query: NDArray[Float], *, attn_mask: Optional[MaskArray] = None,
               is_causal: bool = True, scale: Optional[float] = None,
               need_weights: Literal[True], return_lse: Literal[False] = False,
               window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
               num_threads: Optional[int] = None, precision: str = "exact",
               tree_mask: Optional[NDArray[np.bool_]] = None) -> tuple[NDArray[Float], NDArray[Float]]: ...

    @overload
    def attend(self, query: NDArray[Float], *, attn_mask: Optional[MaskArray] = None,
               is_causal: bool = True, scale: Optional[float] = None, need_weights: bool = False,
               return_lse: bool = False, window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
               num_threads: Optional[int] = None, precision: str = "exact",
               tree_mask: Optional[NDArray[np.bool_]] = None) -> Result[Float]: ...

    def attend(self, query: NDArray[Float], *, attn_mask: Optional[MaskArray] = None,
               is_causal: bool = True, scale: Optional[float] = None, need_weights: bool = False,
               return_lse: bool = False, window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, out: Optional[NDArray[Float]] = None,
               num_threads: Optional[int] = None, precision: str = "exact",
               tree_mask: Optional[NDArray[np.bool_]] = None) -> Result[Float]:
        """Attention of query over every position held (padding hidden).

        Parameters
        ----------
        query : ndarray, (batch_size, Hq, L, head_dim)
            The cache's dtype; or, for a float32 cache, float16 or bfloat16
            (read as float32, the output rounded to the query's dtype, as
            ``scaled_dot_product_attention`` does).
            Hq a multiple of num_kv_heads (grouped-query attention,
            Ainslie et al. 2023, when larger).  With is_causal the L queries
            are the last L positions held, usually the ones just appended.
        attn_mask : ndarray or None, broadcastable to (batch_size, Hq, L, length)
            The functional API's convention: bool True = may attend; floating
            added to the scores (-inf hides).  Combined with the padding.
        is_causal : bool
            Bottom-right causal alignment: query i sees positions
            0 .. length - L + i (default True).
        scale, need_weights, return_lse, window_size, alibi_slopes, softcap, sinks, out, num_threads
            As in ``scaled_dot_product_attention``; window_size and
            alibi_slopes count positions with the same bottom-right
            alignment (query i at position length - L + i).
        precision : {"exact", "int8"}
            As in ``paged_attention``: "int8" (opt-in) computes an int8
            cache's scores and weighted values from integer dot products,
            and an int4 cache's scores when L is at most 4 (decoding);
            the default "exact" reads it exactly.  Its
            groups of 32 key positions count the cache's slots, padding
            included: a row of a padded batch and the same tokens unpadded
            differ in the mode's rounding.
        tree_mask : bool ndarray (L, L) or (batch_size, L, L), or None
            Speculative decoding with a tree of draft tokens (SpecInfer,
            Medusa, EAGLE-2): the L queries are the draft tokens, the last
            L positions held, and draft token i may see draft token t where
            ``tree_mask[..., i, t]`` is True (its ancestors and itself);
            every position before them stays visible.  Combined with
            attn_mask and the padding, and the same as the attn_mask of
            all the positions that it stands for (``paged_attention``'s
            ``tree_mask``, one sequence per batch row).  Not with
            window_size nor alibi_slopes, which would count a draft's slot
            rather than its depth.

        Returns
        -------
        out (batch_size, Hq, L, value_dim), and the weights
        (batch_size, Hq, L, length) with need_weights and the log-sum-exp
        (batch_size, Hq, L) with return_lse, in that order.  A query that
        sees no real token gives zeros, and an lse of the sink's logit with
        sinks, -inf without.

        Raises
        ------
        TypeError
            A query whose dtype is not the cache's (nor 16-bit for a
            float32 cache); a precision that is not a str; a tree_mask that
            is not a bool array; and those of
            ``scaled_dot_product_attention``.
        ValueError
            A precision other than "exact" and "int8"; a tree_mask not of
            shape (L, L) or (batch_size, L, L), with window_size or
            alibi_slopes, or overlapping out; with is_causal (or a
            tree_mask), more queries than positions held: the queries
            are the last positions, so that would mean their keys were not
            appended (``scaled_dot_product_attention`` with
            ``causal_alignment="lower_right"`` and FlashAttention give such
            queries zero rows instead; a cache refuses the call rather than
            hide the missing append); and those of
            ``scaled_dot_product_attention``.
        """
        half = self._core.check_query(query, self._layouts[2], 1)
        mode = C.check_precision(precision)
        tree = self._tree(tree_mask, query.shape[2], window_size, alibi_slopes, out)
        if (C.check_bool(is_causal, "is_causal") or tree_mask is not None) and \
                query.shape[2] > self._length:
            raise ValueError(f"query has {_count(query.shape[2], 'position')} but the cache "
                             f"holds {self._length}: with "
                             f"{'is_causal' if tree_mask is None else 'a tree_mask'} the "
                             "queries are the last positions held; append their keys and "
                             "values first")
        mask = _masks.both(_masks.both(tree, "tree_mask", attn_mask, "attn_mask", self.dtype),
                           "attn_mask", self.attn_mask, "the cache's padding", self.dtype)
        if (mask is not attn_mask and isinstance(out, np.ndarray)
                and isinstance(attn_mask, np.ndarray) and C.overlap(out, attn_mask)):
            # the kernel's call sees the mask combined with the padding, not the caller's
            raise ValueError("out overlaps attn_mask; pass a separate output array")
        # rotate_k: the query rotated (a 16-bit one read as float32, its output
        # and weights rounded once to its dtype at the end, as the kernels do)
        rounded_to = query.dtype if self._keys.rotate and half else None
        if self._keys.rotate and out is not None:  # (the call sees the rotated copy)
            C.check_out(out, query.shape[:3] + (self._value_dim,), query.dtype,
                        {"query": query})
        q = self._keys.rotated(query if rounded_to is None else query.astype(np.float32))
        key, value, stored = self._rows(0, self._length)
        # the functional API's call, through its fast path when it takes it
        result = route(q, key, value, mask, 0.0, is_causal, scale, True, "lower_right",
                       need_weights, return_lse, window_size, alibi_slopes, softcap, sinks,
                       out if rounded_to is None else None, num_threads,
                       None if key.dtype == q.dtype and stored.key_mean is None
                       else stored._replace(precision=mode))
        if rounded_to is None:
            return cast("Result[Float]", result)
        parts = list(result) if isinstance(result, tuple) else [result]
        nthreads = _runtime.resolve_threads(num_threads)
        parts[0] = _storage.narrow(parts[0], rounded_to, nthreads, out)
        if need_weights:  # (a bool, route checked it)
            parts[1] = _storage.narrow(parts[1], rounded_to, nthreads)
        return cast("Result[Float]", parts[0] if len(parts) == 1 else tuple(parts))

    def _tree(self, tree_mask: object, L: int, window_size: object, alibi_slopes: object,
              out: object) -> Optional[NDArray[np.bool_]]:
        """attend's tree_mask as a (batch_size or 1, 1, L, length) mask of
        every position held, or None."""
        if tree_mask is None:
            return None
        _tree.no_positions(window_size, alibi_slopes)
        tree = C.require_array(tree_mask, "tree_mask", "bool")
        if tree.dtype != np.bool_:
            raise TypeError(f"tree_mask has dtype {tree.dtype}; expected bool (True = may "
                            "attend)")
        if tree.shape not in ((L, L), (self.batch_size, L, L)):
            raise ValueError(f"tree_mask has shape {C.shape_str(tree.shape)}; expected (L, L) "
                             f"or (batch_size, L, L) = ({self.batch_size}, {L}, {L}) for "
                             f"{L} queries")
        if isinstance(out, np.ndarray) and C.overlap(out, tree):
            raise ValueError("out overlaps tree_mask; pass a separate output array")
        if L > self._length:
            return None  # (attend's error names the positions)
        return _tree.dense(tree.reshape((tree.shape[0] if tree.ndim == 3 else 1, 1, L, L)),
                           self._length)

    def _rows(self, start: int, stop: int) -> tuple[NDArray[Any], NDArray[Any], StoredKV]:
        """Views of the keys and values held at positions start..stop-1, as
        stored, and how the kernels read them (with the int8 scales)."""
        rows = slice(start, stop)
        return (self._key[:, :, rows], self._value[:, :, rows],
                StoredKV(_storage.store(self._storage),
                         None if self._key_scale is None else self._key_scale[:, :, rows],
                         None if self._value_scale is None else self._value_scale[:, :, rows],
                         self._value_dim, key_mean=self._key_mean))

    def state_dict(self) -> dict[str, NDArray[Any]]:
        """The positions held, as stored, bit for bit, to save and load into
        a cache of the same sizes and storage (PyTorch's ``state_dict``
        idea): "key" and "value" (batch_size, num_kv_heads, length, width),
        "real" (batch_size, length), True = a real token, not padding, and
        for int8 and float8_e4m3fn storage "key_scale" and "value_scale"
        (batch_size, num_kv_heads, length), with smooth_k "key_mean"
        (batch_size, num_kv_heads, head_dim), and with rotate_k
        "rotate_k" (a uint8 1).  Each element's bits come as an
        unsigned int of its size (NumPy's files know no bfloat16), in
        read-only views of the buffers: ``np.savez(path,
        **cache.state_dict())`` saves them, and ``load_state_dict`` of what
        ``np.load`` gives takes them back."""
        n = self._length
        state = {"key": self._key[:, :, :n], "value": self._value[:, :, :n],
                 "real": self._real[:, :n]}
        if self._key_scale is not None and self._value_scale is not None:
            state.update(key_scale=self._key_scale[:, :, :n],
                         value_scale=self._value_scale[:, :, :n])
        if self._key_mean is not None:
            state["key_mean"] = self._key_mean
        if self._keys.rotate:
            state["rotate_k"] = np.ones((), np.uint8)
        return {name: _storage.read_only(a.view(f"u{a.itemsize}")) for name, a in state.items()}

    def _state_pairs(self, state: Mapping[str, NDArray[Any]]
                     ) -> list[tuple[str, NDArray[Any], NDArray[Any]]]:
        """(name, buffer, saved array) of each buffer this cache has;
        TypeError for a state that is no mapping, ValueError when it lacks one."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state must be a mapping of names to arrays (what state_dict "
                            f"gives, or np.load's file of it), got {type(state).__name__}")
        for name, mine in (("key_mean", self._keys.smooth), ("rotate_k", self._keys.rotate)):
            option = "smooth_k" if name == "key_mean" else name
            if (name in state) != mine:
                raise ValueError(f"the saved cache was made with {option}={not mine}; this "
                                 f"cache has {option}={mine}, and its keys would be read wrong")
        flag = np.asarray(state["rotate_k"]) if "rotate_k" in state else None
        if flag is not None and (flag.shape != () or flag.dtype != np.uint8 or flag != 1):
            raise ValueError(f"the saved rotate_k is {flag.dtype} of shape "
                             f"{C.shape_str(flag.shape)}; state_dict gives a uint8 1")
        pairs = []
        for name, buf in (("key", self._key), ("value", self._value), ("real", self._real),
                          ("key_scale", self._key_scale), ("value_scale", self._value_scale),
                          ("key_mean", self._key_mean)):
            if buf is not None:
                if name not in state:
                    raise ValueError(f"the saved cache has no {name}; this cache keeps one")
                pairs.append((name, buf, np.asarray(state[name])))
        return pairs

    def check_state_dict(self, state: Mapping[str, NDArray[Any]]) -> int:
        """The positions state holds, when it is what ``state_dict`` gives
        for a cache of this one's sizes and storage (up to its capacity);
        ValueError naming what differs otherwise (TypeError when state is
        not a mapping).  Changes nothing: what ``load_state_dict`` checks
        first, for callers that check several caches before loading any."""
        pairs = self._state_pairs(state)
        n = np.shape(state["key"])[2] if np.ndim(state["key"]) == 4 else -1
        if not 0 <= n <= self.capacity:
            raise ValueError(f"the saved cache holds {n} positions; this cache holds 0 to "
                             f"{self.capacity}")
        for name, buf, saved in pairs:
            # the positions are axis 2 of the keys, values and scales, 1 of
            # real; the key mean has none
            want = (buf.shape if name == "key_mean" else
                    buf.shape[:2] + (n,) + buf.shape[3:] if buf.ndim > 2 else (buf.shape[0], n))
            bits = np.dtype(f"u{buf.dtype.itemsize}")
            if saved.shape != want or saved.dtype != bits:
                raise ValueError(f"the saved {name} is {saved.dtype} of shape "
                                 f"{C.shape_str(saved.shape)}; this cache expects {bits} of "
                                 f"shape {C.shape_str(want)}")
        return n

    def load_state_dict(self, state: Mapping[str, NDArray[Any]]) -> None:
        """Holds the positions of state (``state_dict``'s, of a cache of this
        one's sizes and storage) in place of those held, bit for bit.

        Raises
        ------
        TypeError
            state is not a mapping.
        ValueError
            state lacks an array this cache keeps, or one's shape or dtype
            is not what such a cache gives, or it holds more positions than
            capacity (``check_state_dict``); nothing is changed then.
        """
        n = self.check_state_dict(state)
        for name, buf, saved in self._state_pairs(state):
            held = buf if name == "key_mean" else buf[:, :n] if buf.ndim == 2 else buf[:, :, :n]
            held.view(saved.dtype)[...] = saved
        self._hold(n)
