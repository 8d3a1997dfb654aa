"""The core the caches share (KVCache, PagedKVCache, ShardedKVCache): their
sizes, dtype and storage, the buffers of stored rows with their scales and
the one error when they cannot be had, and the checks of the rows appended
and of the queries, whose messages name each cache's layout."""
from __future__ import annotations

import itertools
import math
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from . import _checks as C
from . import _storage
from ._typing import DTypeLike, NDArray


class Rows(NamedTuple):
    """The stored rows of a cache: keys and values (lead + (width,)) and,
    for int8 and float8_e4m3fn, a float32 scale per row (lead)."""
    key: NDArray[Any]
    value: NDArray[Any]
    key_scale: Optional[NDArray[np.float32]]
    value_scale: Optional[NDArray[np.float32]]


class Layout(NamedTuple):
    """The axes of an array a cache takes: their names, and the sizes they
    must have (None: any, the positions or tokens)."""
    names: tuple[str, ...]
    sizes: tuple[Optional[int], ...]

    def __str__(self) -> str:
        """"(batch_size, num_kv_heads, L, head_dim) = (2, 8, L, 64)"."""
        given = (str(n) if s is None else str(s) for n, s in zip(self.names, self.sizes))
        return f"({', '.join(self.names)}) = ({', '.join(given)})"

    def fits(self, shape: tuple[int, ...]) -> bool:
        if len(shape) != len(self.sizes):
            return False
        for want, n in zip(self.sizes, shape):  # a loop: decoding calls this every step
            if want is not None and want != n:
                return False
        return True

    def require(self, a: NDArray[Any], name: str) -> None:
        """ValueError unless a has this layout, saying how to reorder its
        leading axes when that would give it (the caller's layout is then
        another library's, say (batch, length, heads, features))."""
        if self.fits(a.shape):
            return
        hint = ""
        lead = range(a.ndim - 1) if a.ndim == len(self.sizes) <= 5 else None
        for axes in itertools.permutations(lead) if lead else ():
            axes += (a.ndim - 1,)
            if self.fits(tuple(a.shape[i] for i in axes)):
                hint = (f"; if its axes are in another order, pass "
                        f"{name}.transpose{tuple(axes)}")
                break
        raise ValueError(f"{name} has shape {C.shape_str(a.shape)}; expected {self}{hint}")


class Core:
    """A cache's sizes, dtype and storage, checked; its owner's name (the
    class) for messages."""

    def __init__(self, owner: str, num_kv_heads: int, head_dim: int, value_dim: Optional[int],
                 dtype: DTypeLike, storage: Optional[str], latent: bool = False) -> None:
        self.owner = owner
        self.num_kv_heads = C.check_index(num_kv_heads, "num_kv_heads", 1)
        self.head_dim = C.check_index(head_dim, "head_dim", 0)
        self.value_dim = (self.head_dim if value_dim is None
                          else C.check_index(value_dim, "value_dim", 0))
        self.dtype = _storage.cache_dtype(dtype, owner)
        self.storage = _storage.check(storage, self.dtype, owner)
        self.stored = _storage.storage_dtype(self.storage)
        # MLA's latent rows: the values are the keys' first value_dim features
        self.latent = C.check_bool(latent, "latent")
        if self.latent and self.value_dim > self.head_dim:
            raise ValueError(f"a latent {owner}'s values are its keys' first value_dim "
                             f"features: value_dim = {self.value_dim} must not exceed "
                             f"head_dim = {self.head_dim}")
        if self.latent and self.storage == "int4" and self.value_dim % _storage.Q4_BLOCK:
            raise ValueError(f"a latent int4 {owner} reads its values as whole blocks of "
                             f"{_storage.Q4_BLOCK} of its keys: value_dim = {self.value_dim} "
                             f"must be a multiple of {_storage.Q4_BLOCK}")

    def fits(self, lead: tuple[int, ...]) -> bool:
        """Whether NumPy can make the rows of these leading axes (and 4-byte scales)."""
        widths = (_storage.width(self.storage, n) for n in (self.head_dim, self.value_dim))
        return all(C.addressable(lead + (w,), max(self.stored.itemsize, 4)) for w in widths)

    def allocate(self, lead: tuple[int, ...], sizes: str, lower: str,
                 extra: Sequence[tuple[tuple[int, ...], DTypeLike]] = ()
                 ) -> tuple[Rows, list[NDArray[Any]]]:
        """Zeroed rows of leading axes lead (calloc: no page touched until
        written, and unused slots hold finite numbers), and zeroed arrays of
        the extra (shape, dtype)s; ValueError beyond any address space,
        MemoryError when they cannot be had, both naming sizes and what to
        lower."""
        if not self.fits(lead) or not all(C.addressable(s, np.dtype(d).itemsize)
                                          for s, d in extra):
            raise ValueError(f"{self.owner} of {sizes} would need buffers larger than any "
                             f"address space; lower {lower}")
        widths = [_storage.width(self.storage, n) for n in (self.head_dim, self.value_dim)]
        scaled = self.storage in _storage.SCALED
        try:
            key = np.zeros(lead + (widths[0],), self.stored)
            key_scale = np.zeros(lead, np.float32) if scaled else None
            if self.latent:  # views of the keys: the rows stored once
                rows = Rows(key, key[..., :widths[1]], key_scale, key_scale)
            else:
                rows = Rows(key, np.zeros(lead + (widths[1],), self.stored), key_scale,
                            np.zeros(lead, np.float32) if scaled else None)
            arrays = [np.zeros(s, d) for s, d in extra]
        except MemoryError:
            nbytes = (math.prod(lead) * (sum(widths) * self.stored.itemsize + (8 if scaled else 0))
                      + sum(math.prod(s) * np.dtype(d).itemsize for s, d in extra))
            raise MemoryError(f"{self.owner} of {sizes} needs {nbytes / 2**30:.1f} GiB, which "
                              f"could not be allocated; lower {lower}") from None
        return rows, arrays

    def check_rows(self, key: object, value: object, layout: Layout, value_layout: Layout,
                   unit: str) -> int:
        """key and value as appended: arrays of the cache's dtype in these
        layouts, with as many units (positions, tokens) along their free
        axis; that count.  A latent cache takes key alone (value None)."""
        if self.latent != (value is None):
            raise ValueError(f"a latent {self.owner} holds its values in its keys: pass "
                             "value=None" if self.latent else
                             f"value is None; this {self.owner} is not latent (latent=True "
                             "makes the values the keys' first value_dim features)")
        counts = []
        pairs = (("key", key, layout),) + (() if self.latent else (("value", value, value_layout),))
        for name, a, want in pairs:
            arr = C.require_array(a, name)
            if arr.dtype != self.dtype:
                raise self._dtype_error(name, arr.dtype)
            want.require(arr, name)
            counts.append(int(arr.shape[want.sizes.index(None)]))
        n, nv = counts[0], counts[-1]
        if nv != n:
            raise ValueError(f"key and value must hold the same number of {unit}, got {n} "
                             f"and {nv}")
        return n

    def check_query(self, query: object, layout: Layout, heads_axis: int) -> bool:
        """query as attended: an array of the cache's dtype, or 16-bit for a
        float32 cache (True then), in this layout, whose heads (axis
        heads_axis) share the cache's key/value heads in equal groups."""
        q = C.require_array(query, "query")
        half = C.is_half(q.dtype) and q.dtype.isnative and self.dtype == np.float32
        if q.dtype != self.dtype and not half:
            raise self._dtype_error("query", q.dtype)
        layout.require(q, "query")
        C.check_head_groups(q.shape[heads_axis], self.num_kv_heads)
        return half

    def owned(self, rows: Sequence[Optional[NDArray[Any]]]) -> list[NDArray[Any]]:
        """The buffers of rows (key, value, key scale, value scale) that hold
        their own memory: a latent cache's values are views of its keys."""
        return [a for i, a in enumerate(rows) if a is not None and not (self.latent and i % 2)]

    def _dtype_error(self, name: str, dtype: np.dtype[Any]) -> TypeError:
        """An array of another dtype than the cache's, with the fix for a 16-bit one."""
        return TypeError(f"{name} has dtype {dtype}; this {self.owner} holds {self.dtype}"
                         f"{_storage.half_hint(dtype, self.dtype, name, self.owner)}")
