"""Exact attention over keys and values sharded across processes and
machines, on Ray: sequence (context) parallelism.

Each shard holds a part of a sequence's keys and values and computes the
attention of the queries over its part with its log-sum-exp; the parts are
merged exactly (``merge_attention``), as in Ring Attention (Liu et al.
2023), Tree Attention (Shyam et al. 2024) and vLLM's decode context
parallelism.  Where a shard's keys sit in the sequence is given to the
kernels as an int ``causal_alignment``, so causal masks, sliding windows
and ALiBi count global positions.

- ``ShardedKVCache``: a decoder's cache, one Ray actor per shard.
- ``sharded_attention``: a one-shot long prefill, the queries sharded too.

Needs Ray (``pip install 'fastattn[ray]'``); ``import fastattn`` never
imports this module.  The merge is exact in real arithmetic; in floating
point a merged result differs from one process's call by the rounding of
the merge, a few units in the last place (README, "Across machines").
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from typing import Any, Callable, NamedTuple, NoReturn, Optional, Sequence, TypeVar, Union, cast

import numpy as np

try:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - the tests skip without Ray
    raise ImportError("fastattn.distributed needs Ray: pip install 'fastattn[ray]' "
                      "(or pip install ray)") from exc

from . import _checks as C
from . import _cache, _core, _runtime, _storage, _variants
from ._cache import Layout
from ._dispatch import StoredKV, checked_attention, require_qkv
from ._keys import KeyOptions, KeyTransform
from ._storage import narrow
from ._typing import Alignment, Float, NDArray
from .attention import merge_attention
from .kv_cache import KVCache

__all__ = ["ShardLostError", "ShardTimeoutError", "ShardedKVCache", "sharded_attention"]

_PLACEMENTS = {"spread": "SPREAD", "pack": "PACK", "strict_spread": "STRICT_SPREAD",
               "strict_pack": "STRICT_PACK"}


class ShardLostError(RuntimeError):
    """A shard's process died: its keys and values are gone, so no result is
    computed from the shards left (it would be silently wrong).

    Attributes
    ----------
    shards : list of int
        The lost shards.
    positions : int
        How many of the cache's positions they held.
    """

    def __init__(self, message: str, shards: Sequence[int], positions: int) -> None:
        super().__init__(message)
        self.shards = list(shards)
        self.positions = positions


class ShardTimeoutError(ShardLostError, TimeoutError):
    """A shard did not answer within the cache's timeout (its process hung,
    stopped, or its node is unreachable).  The shard is ended and taken as
    lost, as a dead one: a late answer, or a late append, would no longer
    agree with the other shards.  A ShardLostError, so that the handling
    of a lost shard (restore from a snapshot) covers it, and a
    TimeoutError, as a call given a timeout raises.  Same attributes."""


# ---- the plan: which keys each call reads, and how ----------------------

class _Options(NamedTuple):
    """The options of one attention, checked, as every part takes them."""
    is_causal: bool
    scale: Optional[float]
    window: Optional[tuple[int, int]]
    alibi_slopes: Optional[NDArray[np.float64]]
    softcap: Optional[float]
    num_threads: Optional[int]
    enable_gqa: bool
    precision: int = _core.PRECISION_EXACT  # C.check_precision's


def _parts(runs: Sequence[tuple[int, int, int]], q0: int, L: int, opts: _Options
           ) -> list[tuple[int, int, Optional[int]]]:
    """The calls that cover a shard's keys for L queries at positions q0..q0+L-1.

    runs: (local start, global start, count) of each run of keys held,
    consecutive in the shard's storage.  A run no query sees is skipped.  A
    run every query sees whole, with no ALiBi (so no score depends on where
    the keys are), joins its neighbours of that kind in one call without
    causal mask or window: the common case of decoding, where all but the
    last run are in every query's past.  Every other run is a call of its
    own, told its place by causal_alignment = q0 - its global start.
    Returns (local start, local stop, global start or None for the whole
    kind)."""
    left, right = opts.window if opts.window is not None else (-1, -1)
    q_last = q0 + L - 1
    calls: list[tuple[int, int, Optional[int]]] = []
    for a, g, n in runs:
        g_last = g + n - 1
        if (n == 0 or L == 0 or (opts.is_causal and g > q_last)
                or (left >= 0 and g_last < q0 - left) or (right >= 0 and g > q_last + right)):
            continue
        whole = (opts.alibi_slopes is None and (not opts.is_causal or g_last <= q0)
                 and (left < 0 or g >= q_last - left) and (right < 0 or g_last <= q0 + right))
        if whole and calls and calls[-1][2] is None and calls[-1][1] == a:
            calls[-1] = (calls[-1][0], a + n, None)
        else:
            calls.append((a, a + n, None if whole else g))
    return calls


def _attend_runs(query: NDArray[Any], rows: Any, runs: Sequence[tuple[int, int, int]], q0: int,
                 opts: _Options, sinks: Optional[NDArray[Any]]
                 ) -> tuple[NDArray[Any], NDArray[Any]]:
    """Attention of query (Hq, L, E) over the keys of runs, merged: (out,
    lse).  rows(a, b) gives the keys, values and StoredKV of local rows
    a..b-1.  The sinks join the first call; with no call, one over no keys
    gives zeros (and the sinks' lse)."""
    calls = _parts(runs, q0, query.shape[-2], opts) or [(0, 0, None)]
    outs, lses = [], []
    for n, (a, b, g) in enumerate(calls):
        key, value, stored = rows(a, b)
        placed = g is not None
        out, lse = cast("tuple[NDArray[Any], NDArray[Any]]", checked_attention(
            query, key, value, None, 0.0, opts.is_causal and placed, opts.scale, opts.enable_gqa,
            0 if g is None else q0 - g, False, True, opts.window if placed else None,
            opts.alibi_slopes if placed else None, opts.softcap, None if n else sinks, None,
            opts.num_threads, None if stored is None else stored._replace(precision=opts.precision)))
        outs.append(out)
        lses.append(lse)
    return merge_attention(outs, lses) if len(outs) > 1 else (outs[0], lses[0])


# ---- one shard ----------------------------------------------------------

class _Shard:
    """A shard's process: a KVCache of one sequence and where its runs of
    positions sit in the whole sequence."""

    def __init__(self, index: int, num_kv_heads: int, capacity: int, head_dim: int,
                 value_dim: int, dtype: str, storage: str, num_threads: int,
                 smooth_k: bool = False, rotate_k: bool = False) -> None:
        self._index = index
        self._cache = KVCache(1, num_kv_heads, capacity, head_dim, value_dim=value_dim,
                              dtype=dtype, storage=storage, smooth_k=smooth_k, rotate_k=rotate_k)
        self._runs: list[tuple[int, int, int]] = []  # (local start, global start, count)
        self._threads = num_threads
        self._staged: Optional[tuple[dict[str, NDArray[Any]], list[tuple[int, int, int]]]] = None

    def ping(self) -> int:
        return self._cache.length

    def append(self, pieces: list[tuple[int, NDArray[Any], NDArray[Any]]]) -> int:
        """Appends each (global start, key (Hkv, n, E), value) in order; all
        or nothing."""
        length, runs = self._cache.length, list(self._runs)
        try:
            for g, key, value in pieces:
                a, n = self._cache.length, key.shape[1]
                self._cache.append(key[None], value[None])
                if self._runs and sum(self._runs[-1][::2]) == a and (
                        self._runs[-1][1] + self._runs[-1][2] == g):
                    self._runs[-1] = (self._runs[-1][0], self._runs[-1][1], self._runs[-1][2] + n)
                else:
                    self._runs.append((a, g, n))
        except BaseException:
            self.truncate(length, runs)
            raise
        return self._cache.length

    def truncate(self, length: int, runs: list[tuple[int, int, int]]) -> None:
        self._cache.truncate(length)
        self._runs = runs

    def attend(self, query: NDArray[Any], q0: int, opts: _Options,
               sinks: Optional[NDArray[Any]]) -> tuple[Any, ...]:
        start = time.perf_counter()
        opts = opts._replace(num_threads=self._threads)

        def rows(a: int, b: int) -> tuple[NDArray[Any], NDArray[Any], StoredKV]:
            key, value, stored = self._cache._rows(a, b)
            return key[0], value[0], StoredKV(
                stored.store, None if stored.key_scale is None else stored.key_scale[0],
                None if stored.value_scale is None else stored.value_scale[0], stored.value_dim,
                key_mean=None if stored.key_mean is None else stored.key_mean[0])

        # the shard's own mean (of its first chunk) and the rotation, as its KVCache's attend
        query = self._cache._keys.rotated(query)
        out, lse = _attend_runs(query, rows, self._runs, q0, opts, sinks)
        return out, lse, time.perf_counter() - start, 0.0

    def merge(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> tuple[Any, ...]:
        """Two partial results (out, lse, compute seconds, merge seconds) as
        one: the times are the slower branch's, plus this merge."""
        start = time.perf_counter()
        out, lse = merge_attention([a[0], b[0]], [a[1], b[1]])
        return out, lse, max(a[2], b[2]), max(a[3], b[3]) + time.perf_counter() - start

    def save(self, folder: str, snapshot_id: str) -> str:
        """Writes its file of a snapshot into folder, with the snapshot's id
        and its own index, synced to disk; returns the file's sha256."""
        state = self._cache.state_dict()
        state["runs"] = np.array(self._runs, np.int64).reshape(-1, 3)
        name = os.path.join(folder, _shard_file(self._index))
        try:
            with open(name, "wb") as f:
                np.savez(f, snapshot_id=np.array(snapshot_id), shard=np.array(self._index),
                         **cast("dict[str, Any]", state))
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:  # a failed write names no file: say which, keep errno
            raise OSError(exc.errno, exc.strerror, name) from None
        return _sha256(name)

    def stage(self, folder: str, snapshot_id: str, sha256: str, length: int,
              runs: list[tuple[int, int, int]]) -> None:
        """Reads its file of a snapshot and checks it (the snapshot's id,
        this shard's index, the sha256 cache.json records, length positions
        in these runs), holding it aside for commit: the cache is not
        changed.  ValueError naming the file and what is wrong."""
        self._staged = None
        name = os.path.join(folder, _shard_file(self._index))
        digest = _sha256(name)
        try:
            with np.load(name) as saved:
                state = {key: saved[key] for key in saved.files}
            found = str(state.pop("snapshot_id", "none"))
            index = int(state.pop("shard", -1))
            held = [tuple(int(x) for x in r) for r in state.pop("runs")]
        except Exception as exc:  # noqa: BLE001 - any unreadable file says the same
            raise ValueError(f"{name} cannot be read ({type(exc).__name__}: {exc}); it is "
                             "truncated or damaged") from None
        if found != snapshot_id:
            raise ValueError(f"{name} is of snapshot {found}; cache.json is of snapshot "
                             f"{snapshot_id}: the file is from another snapshot")
        if index != self._index:
            raise ValueError(f"{name} holds shard {index}'s positions, not shard "
                             f"{self._index}'s: files swapped or renamed")
        if digest != sha256:
            raise ValueError(f"{name} is damaged: its sha256 is {digest}, cache.json records "
                             f"{sha256}")
        try:
            n = self._cache.check_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if held != [tuple(r) for r in runs] or n != length:
            raise ValueError(f"{name} holds other positions than the snapshot's cache.json "
                             f"gives this shard ({length})")
        self._staged = (state, list(runs))

    def commit(self) -> int:
        """Takes what stage checked; returns the positions now held."""
        if self._staged is None:
            raise RuntimeError(f"shard {self._index}: commit with no file staged")
        state, runs = self._staged
        self._staged = None
        self._cache.load_state_dict(state)
        self._runs = runs
        return self._cache.length

    def discard(self) -> None:
        """Forgets what stage read: the restore does not go on."""
        self._staged = None


def _shard_file(k: int) -> str:
    return f"shard-{k}.npz"


def _sha256(name: str) -> str:
    digest = hashlib.sha256()
    with open(name, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _sync_folder(path: str) -> None:
    """Makes the entries of a folder (files made or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# the folders of a snapshot being written and of the one it replaces
_NEW, _OLD = ".snapshot-new", ".snapshot-old"
_MAX_TIMEOUT = 2.0**31  # seconds: Ray's waits take milliseconds in a C long
_Method = TypeVar("_Method", bound=Callable[..., Any])


def _one_at_a_time(method: _Method) -> _Method:
    """A ShardedKVCache method that holds the cache's lock: a snapshot taken
    while an append runs would record lengths its files do not hold."""
    @functools.wraps(method)
    def locked(self: ShardedKVCache, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)
    return cast(_Method, locked)


def _timeout(value: object, name: str = "timeout") -> float:
    """A timeout in seconds: > 0, at most _MAX_TIMEOUT."""
    seconds = C.check_real(value, name)
    if not 0 < seconds <= _MAX_TIMEOUT:
        raise ValueError(f"{name} must be > 0 and at most 2**31 seconds, got {value}")
    return seconds


def _check_replaceable(folder: str) -> None:
    """FileExistsError unless folder holds a snapshot's files only: a
    snapshot replaces or removes such a folder whole."""
    others = sorted(f for f in os.listdir(folder)
                    if f != "cache.json" and not re.fullmatch(r"shard-\d+\.npz", f))
    if others:
        raise FileExistsError(f"{folder} holds files other than a snapshot's "
                              f"({', '.join(others[:3])}{', ...' if others[3:] else ''}); a "
                              "snapshot replaces or removes the whole folder: give a path whose "
                              "folder is new, empty or a snapshot")


def _finish_swap(path: str) -> None:
    """Finishes what a snapshot to path that stopped part-way left: path +
    _NEW (not yet in place) is removed; path + _OLD (the older snapshot,
    moved aside) is put back when path is missing, else removed."""
    new, old = path + _NEW, path + _OLD
    for folder in (new, old):
        if os.path.lexists(folder):
            _check_replaceable(folder)
    if os.path.lexists(new):
        shutil.rmtree(new)
    if os.path.lexists(old):
        if os.path.lexists(path):
            shutil.rmtree(old)
        else:
            os.rename(old, path)


# restarted, a shard would come back empty and give wrong answers: never
_SHARD: Any = ray.remote(max_restarts=0)(_Shard)


def _last_line(exc: BaseException) -> str:
    """The last line of an error Ray relays: the original exception's."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _cause_text(exc: BaseException) -> str:
    """The message of the error a Ray task raised."""
    cause = getattr(exc, "cause", None)
    return str(cause) if isinstance(cause, Exception) else _last_line(exc)


def _free_cpus() -> float:
    return float(ray.available_resources().get("CPU", 0))  # type: ignore[no-untyped-call]


# ---- the cache ----------------------------------------------------------

def _release(actors: list[Any], group: Any) -> None:
    """Ends the shards' processes and frees their placement group."""
    if not ray.is_initialized():
        return  # the cluster is gone, and its processes with it
    for actor in actors:
        try:
            ray.kill(actor)
        except Exception:  # noqa: BLE001 - already dead
            pass
    remove_placement_group(group)


class ShardedKVCache(KeyOptions):
    """One sequence's keys and values, sharded over Ray actors, and exact
    attention over all of them.

    Positions are dealt to the shards in chunks of ``chunk_size``
    consecutive positions, round-robin: position p is held by shard
    (p // chunk_size) % num_shards, so every shard grows evenly and does an
    even part of every decoding step.  Each shard is a Ray actor (a process
    of its own, somewhere in the cluster) holding a ``KVCache`` of
    ``capacity_per_shard`` positions in the given dtype and storage.
    ``attend`` sends the query once to the object store, every shard that
    holds a visible key computes its part with its log-sum-exp, and the
    parts are merged in a tree of pairwise ``merge_attention`` calls run by
    the shards themselves (Tree Attention's reduction, Shyam et al. 2024),
    so only the merged (Hq, L, Ev) result travels to the caller.

    Call ``ray.init`` first to join a cluster (Ray starts a local one
    otherwise), and ``close()`` (or use ``with``) to end the shards.

    Parameters
    ----------
    num_shards, num_kv_heads, head_dim : int
    capacity_per_shard : int
        Positions each shard can hold: the cache holds at most about
        num_shards x capacity_per_shard (exactly that when it is a multiple
        of chunk_size).
    value_dim : int or None
        Size of a value head; None means head_dim.
    dtype, storage
        As in ``KVCache``: float32 or float64; storage "float32",
        "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2" or
        "int4" for float32.
    smooth_k, rotate_k : bool
        As in ``KVCache``, each shard taking the mean of the first chunk
        it holds (every logit is unchanged whatever the mean).
    chunk_size : int
        Positions dealt to a shard at a time (default 256).  Attention with
        ALiBi costs one kernel call per chunk held (a chunk's bias depends
        on where it sits); larger chunks, fewer calls.
    placement : {"spread", "pack", "strict_spread", "strict_pack"}
        Ray's placement-group strategy for the shards (default "spread":
        across the cluster's nodes as far as they go).
    num_cpus_per_shard : float
        CPUs reserved for each shard (default 1).  The shards are placed
        only when the cluster has num_shards x this free.
    num_threads : int or None
        The kernels' threads in each shard; None: num_cpus_per_shard,
        rounded down, at least 1.
    timeout : float
        Seconds to wait for the cluster to place and start the shards, and
        for the shards' answers to each call (default 60, > 0 and at most
        2**31; a snapshot or restore must write or read a shard's file
        within it).  A shard
        that does not answer in time is ended and taken as lost:
        ``ShardTimeoutError``.

    Raises
    ------
    TypeError, ValueError
        Sizes, dtype, storage, smooth_k or rotate_k as ``KVCache`` refuses
        them (buffers no address space holds included); an unknown placement;
        num_cpus_per_shard not > 0, timeout not in (0, 2**31]; more CPUs
        than the cluster has in all (an autoscaling cluster: add the nodes
        first).
    TimeoutError
        The cluster cannot place the shards within timeout (too few CPUs
        free, or nodes for a strict strategy); nothing is left reserved.
    RuntimeError
        A shard's process could not start (its buffers could not be
        allocated on its node, say): the message has its error; nothing is
        left running.

    Notes
    -----
    Threads: ``append``, ``attend``, ``snapshot``, ``restore`` and
    ``close`` hold the cache's lock, so that calls from several threads run
    one at a time (a snapshot never records lengths its files do not hold).
    A path given to ``snapshot`` or ``restore`` that is a symbolic link
    stands for its target, which the snapshot replaces.
    """

    def __init__(self, num_shards: int, num_kv_heads: int, head_dim: int, *,
                 capacity_per_shard: int, value_dim: Optional[int] = None,
                 dtype: Any = np.float32, storage: Optional[str] = None, smooth_k: bool = False,
                 rotate_k: bool = False, chunk_size: int = 256, placement: str = "spread",
                 num_cpus_per_shard: float = 1.0, num_threads: Optional[int] = None,
                 timeout: float = 60.0) -> None:
        self._lock = threading.RLock()  # one call at a time (_one_at_a_time)
        self._num_shards = C.check_index(num_shards, "num_shards", 1)
        self._core = _cache.Core("ShardedKVCache", num_kv_heads, head_dim, value_dim, dtype,
                                 storage)
        self._num_kv_heads, self._dtype = self._core.num_kv_heads, self._core.dtype
        self._head_dim, self._value_dim = self._core.head_dim, self._core.value_dim
        self._storage = self._core.storage
        self._keys = KeyTransform(smooth_k, rotate_k)
        Hkv, D, Dv = self._num_kv_heads, self._head_dim, self._value_dim
        self._layouts = (Layout(("num_kv_heads", "n", "head_dim"), (Hkv, None, D)),
                         Layout(("num_kv_heads", "n", "value_dim"), (Hkv, None, Dv)),
                         Layout(("Hq", "L", "head_dim"), (None, None, D)))
        self._capacity = C.check_index(capacity_per_shard, "capacity_per_shard", 1)
        self._chunk = C.check_index(chunk_size, "chunk_size", 1)
        if placement not in _PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(map(repr, _PLACEMENTS))}, "
                             f"got {placement!r}")
        cpus = C.check_real(num_cpus_per_shard, "num_cpus_per_shard")
        if not cpus > 0:
            raise ValueError(f"num_cpus_per_shard must be > 0, got {num_cpus_per_shard}")
        self._timeout = _timeout(timeout)
        self._threads = (max(1, int(cpus)) if num_threads is None
                         else _runtime.resolve_threads(num_threads))
        if not self._core.fits((1, self._num_kv_heads, self._capacity)):
            raise ValueError(f"capacity_per_shard={self._capacity} would need buffers larger "
                             "than any address space; lower it or add shards")
        if not ray.is_initialized():
            ray.init()  # what Ray's first remote call would do: a local cluster
        total = float(ray.cluster_resources().get("CPU", 0))  # type: ignore[no-untyped-call]
        if self._num_shards * cpus > total:
            raise ValueError(f"{self._num_shards} shards of {cpus:g} CPU each need "
                             f"{self._num_shards * cpus:g} CPUs; the Ray cluster has {total:g} "
                             "in all. Lower num_cpus_per_shard or num_shards, or add nodes")
        self._lengths = [0] * self._num_shards
        self._lost: list[int] = []
        self._lost_why = ""
        self._lost_kind: type[ShardLostError] = ShardLostError
        self.last_timing: dict[str, float] = {}
        """Seconds of the last attend: "total" (the caller's), "compute" (the
        slowest shard's kernels), "merge" (the merges on the tree's longest
        path) and "transfer" (the rest: Ray's scheduling and copies)."""

        self._group = placement_group([{"CPU": cpus}] * self._num_shards,
                                      strategy=_PLACEMENTS[placement])
        try:
            ray.get(self._group.ready(), timeout=self._timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._group)
            raise TimeoutError(
                f"the Ray cluster could not place {self._num_shards} shards of "
                f"{cpus:g} CPU each ({placement}) within {self._timeout:g} s; it has "
                f"{_free_cpus():g} CPUs free. Lower "
                "num_cpus_per_shard or num_shards, or add nodes") from None
        self._actors = [self._start(k) for k in range(self._num_shards)]
        self._finalizer = weakref.finalize(self, _release, self._actors, self._group)
        for k, actor in enumerate(self._actors):  # a shard that cannot start: say why, now
            try:
                ray.get(actor.ping.remote(), timeout=self._timeout)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as exc:
                self.close()
                raise RuntimeError(f"shard {k} could not start: {_last_line(exc)}") from None

    def _start(self, k: int) -> Any:
        """Shard k's actor, in bundle k of the placement group."""
        strategy = PlacementGroupSchedulingStrategy(placement_group=self._group,
                                                    placement_group_bundle_index=k)
        cpus = self._group.bundle_specs[k]["CPU"]
        return _SHARD.options(num_cpus=cpus, scheduling_strategy=strategy).remote(
            k, self._num_kv_heads, self._capacity, self._head_dim, self._value_dim,
            self._dtype.name, self._storage, self._threads, self._keys.smooth, self._keys.rotate)

    # ---- sizes ----------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return self._num_shards

    @property
    def length(self) -> int:
        """Positions held, in all shards."""
        return sum(self._lengths)

    @property
    def shard_lengths(self) -> list[int]:
        """Positions held by each shard."""
        return list(self._lengths)

    @property
    def chunk_size(self) -> int:
        return self._chunk

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def storage(self) -> str:
        return self._storage

    def __repr__(self) -> str:
        return (f"ShardedKVCache(num_shards={self._num_shards}, num_kv_heads="
                f"{self._num_kv_heads}, head_dim={self._head_dim}, value_dim={self._value_dim}, "
                f"capacity_per_shard={self._capacity}, chunk_size={self._chunk}, "
                f"dtype={self._dtype.name}, storage={self._storage}, "
                f"{self._keys.options_repr()}length={self.length})")

    def shard_of(self, position: int) -> int:
        """The shard that holds (or will hold) a position (an int >= 0)."""
        return (C.check_index(position, "position", 0) // self._chunk) % self._num_shards

    def _runs(self, k: int, length: int) -> list[tuple[int, int, int]]:
        """(local start, global start, count) of shard k's chunks among the
        first length positions: what the shard itself records."""
        runs, step = [], self._chunk * self._num_shards
        for m, g in enumerate(range(k * self._chunk, length, step)):
            runs.append((m * self._chunk, g, min(self._chunk, length - g)))
        return runs

    # ---- writing --------------------------------------------------------
    @_one_at_a_time
    def append(self, key: NDArray[np.floating[Any]], value: NDArray[np.floating[Any]]) -> None:
        """Write n new positions after the ones held, each to its shard.

        Parameters
        ----------
        key : ndarray, (num_kv_heads, n, head_dim), the cache's dtype
        value : ndarray, (num_kv_heads, n, value_dim)

        Raises
        ------
        TypeError, ValueError
            As ``KVCache.append`` (dtype, shapes, values the storage cannot
            hold), or when a shard's capacity would be exceeded.  Nothing
            is written then, in any shard.
        ShardLostError
            A shard is lost (see ``attend``).  The shards left are brought
            back to before the call.
        ShardTimeoutError
            A shard did not answer within timeout.  It is ended (whether it
            wrote its part no longer matters: its positions are lost); the
            other shards are brought back to before the call, and
            ``length`` and ``shard_lengths`` are as before it.
        """
        self._check_alive()
        n = self._core.check_rows(key, value, self._layouts[0], self._layouts[1], "positions")
        start = self.length
        pieces: list[list[tuple[int, Any, Any]]] = [[] for _ in self._actors]
        g = start
        while g < start + n:  # chunk by chunk
            stop = min(start + n, (g // self._chunk + 1) * self._chunk)
            pieces[self.shard_of(g)].append((g, key[:, g - start:stop - start],
                                             value[:, g - start:stop - start]))
            g = stop
        grown = [sum(p[1].shape[1] for p in ps) for ps in pieces]
        full = [k for k in range(self._num_shards) if self._lengths[k] + grown[k] > self._capacity]
        if full:
            raise ValueError(f"ShardedKVCache capacity exceeded: shard {full[0]} holds "
                             f"{self._lengths[full[0]]} of {self._capacity} positions and "
                             f"{grown[full[0]]} more would go to it; nothing was written. "
                             "Create it with a larger capacity_per_shard or more shards")
        lengths, errors, hung = self._call({k: self._actors[k].append.remote(pieces[k])
                                            for k in range(self._num_shards) if pieces[k]})
        if errors or hung:
            # undo the shards that took their part: a hung shard is ended, so
            # whether it wrote its part (or writes it late) no longer matters
            _, undo_errors, undo_hung = self._call(
                {k: self._actors[k].truncate.remote(self._lengths[k], self._runs(k, start))
                 for k in lengths})
            self._fail(errors | undo_errors, hung + undo_hung, "append")
        for k, n in lengths.items():
            self._lengths[k] = n

    # ---- attention ------------------------------------------------------
    @_one_at_a_time
    def attend(self, query: NDArray[Float], *, is_causal: bool = True,
               scale: Optional[float] = None, window_size: Optional[tuple[int, int]] = None,
               alibi_slopes: Optional[NDArray[Any]] = None, softcap: Optional[float] = None,
               sinks: Optional[NDArray[Any]] = None, return_lse: bool = False,
               precision: str = "exact"
               ) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]:
        """Attention of query over every position held, in all shards: the
        result of ``KVCache.attend`` on one cache holding them all, within
        the rounding of the merge.

        Parameters
        ----------
        query : ndarray, (Hq, L, head_dim)
            The cache's dtype, or float16 / bfloat16 for a float32 cache
            (computed in float32, rounded once at the end).  Hq a multiple
            of num_kv_heads (grouped-query attention).  With is_causal the L
            queries are the last L positions held (lower-right alignment).
        is_causal, scale, window_size, alibi_slopes, softcap, sinks, return_lse, precision
            As in ``KVCache.attend``, with the positions of the whole
            sequence (precision="int8": each shard's part in the int8
            mode, its groups of key positions counted in that part); alibi_slopes and sinks of shape (Hq,).  Shards whose
            keys lie wholly outside every query's window (or causal bound)
            are not asked; the sinks join one shard's softmax only.  No
            attn_mask: a mask would be cut along the shards' chunks; the
            padding-free cache and these options cover what decoding needs.

        Returns
        -------
        out (Hq, L, value_dim) in query's dtype, and with return_lse the
        log-sum-exp (Hq, L) (float32 for 16-bit queries); for a query that
        sees no position, the sink's logit with sinks, -inf without.

        Raises
        ------
        TypeError, ValueError
            As ``KVCache.attend``.
        ShardLostError
            A shard's actor died (now or earlier): the error names the
            shard and the positions lost; every call raises it until
            ``restore`` brings the shard back from a snapshot.
        ShardTimeoutError
            A shard did not answer within timeout (its part or a merge it
            runs): the error names it; it is ended and lost, as above.
        """
        self._check_alive()
        start = time.perf_counter()
        half = self._core.check_query(query, self._layouts[2], 0)
        Hq, L = query.shape[:2]
        length = self.length
        causal = C.check_bool(is_causal, "is_causal")
        lse_wanted = C.check_bool(return_lse, "return_lse")
        mode = C.check_precision(precision)
        if causal and L > length:
            raise ValueError(f"query has {L} positions but the cache holds {length}: with "
                             "is_causal the queries are the last positions held; append "
                             "their keys and values first")
        compute = np.dtype(np.float32) if half else self._dtype
        scale = C.check_scale(scale, self._head_dim, compute)
        q0 = length - L
        variants = _variants.check(window_size, alibi_slopes, softcap, sinks, (Hq,), L, length,
                                   compute, q0)
        opts = _Options(causal, scale, None if window_size is None else (
            variants.window_left, variants.window_right), variants.slopes, softcap, None, True,
            mode)
        sink = None if sinks is None else np.asarray(sinks, np.float64)
        asked = [k for k in range(self._num_shards)
                 if _parts(self._runs(k, length), q0, L, opts)] or [0]
        q = ray.put(np.ascontiguousarray(query, compute))  # once, read by every shard
        # (shard, ref, the refs it takes) of every task: the parts, then the merges
        tasks: list[tuple[int, Any, list[Any]]] = [
            (k, self._actors[k].attend.remote(q, q0, opts, sink if n == 0 else None), [])
            for n, k in enumerate(asked)]
        level = [(k, ref) for k, ref, _ in tasks]
        while len(level) > 1:  # the tree: each pair merged by the first one's shard
            merged = []
            for a, b in zip(level[::2], level[1::2]):
                tasks.append((a[0], self._actors[a[0]].merge.remote(a[1], b[1]), [a[1], b[1]]))
                merged.append((a[0], tasks[-1][1]))
            level = merged + level[len(merged) * 2:]
        hung = self._stalled(tasks)
        if hung:
            self._hung(hung, "attend")
        try:
            out, lse, compute_s, merge_s = ray.get(level[0][1])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as exc:
            self._shard_died(exc)
        if half:
            out = narrow(out, query.dtype, self._threads)
        total = time.perf_counter() - start
        self.last_timing = {"total": total, "compute": compute_s, "merge": merge_s,
                            "transfer": max(0.0, total - compute_s - merge_s)}
        return (out, lse) if lse_wanted else out

    # ---- failures, snapshots --------------------------------------------
    def _check_alive(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this ShardedKVCache is closed")
        if not ray.is_initialized():
            raise RuntimeError("Ray was shut down, and this cache's shards with it; create a "
                               "new ShardedKVCache (and restore a snapshot into it)")
        if self._lost:
            raise self._lost_error()

    def _lost_error(self) -> ShardLostError:
        held = sum(self._lengths[k] for k in self._lost)
        lost = []
        for k in self._lost:
            runs = self._runs(k, self.length)  # the first few ranges of positions
            lost += [f"shard {k}: " + ", ".join(f"{g}-{g + n - 1}" for _, g, n in runs[:4])
                      + (", ..." if len(runs) > 4 else "")] if runs else []
        where = "; ".join(lost)
        return self._lost_kind(
            f"shard{'s' if len(self._lost) > 1 else ''} {', '.join(map(str, self._lost))} of "
            f"{self._num_shards} lost{self._lost_why}: {held} of the {self.length} positions "
            f"held are gone ({where or 'none held'}). No result is computed from the shards left; "
            "restore(path) brings the cache back from a snapshot, or close() it",
            self._lost, held)

    def _dead_shards(self) -> list[int]:
        """The shards whose actor is dead or does not answer within timeout."""
        _, errors, hung = self._call({k: a.ping.remote() for k, a in enumerate(self._actors)})
        return sorted(set(errors) | set(hung))

    def _shard_died(self, exc: BaseException, known: Sequence[int] = ()) -> NoReturn:
        """Raises ShardLostError when a shard's actor is dead (known: shards
        whose own call said so), else exc."""
        dead = sorted(set(self._dead_shards()) | set(known))
        if not dead:
            raise exc
        self._lost, self._lost_kind = sorted(set(self._lost) | set(dead)), ShardLostError
        self._lost_why = f" (its Ray actor died: {_last_line(exc)})"
        raise self._lost_error() from exc

    def _stalled(self, tasks: Sequence[tuple[int, Any, Sequence[Any]]]) -> list[int]:
        """Waits for tasks (shard, ref, the refs it takes) within timeout;
        returns the shards that did not answer: those with a task not done
        whose inputs are (a merge waiting for another shard's part is not
        the one stalled)."""
        refs = [ref for _, ref, _ in tasks]
        if not refs:
            return []
        # fetch_local=False: the parts stay where they are, only the merged one travels
        done = set(ray.wait(refs, num_returns=len(refs), timeout=self._timeout,
                            fetch_local=False)[0])
        return sorted({k for k, ref, needs in tasks
                       if ref not in done and all(r in done for r in needs)})

    def _call(self, refs: dict[int, Any]
              ) -> tuple[dict[int, Any], dict[int, BaseException], list[int]]:
        """Each shard's call (shard: ref) waited for within timeout: the
        results, the errors, and the shards that did not answer."""
        hung = self._stalled([(k, ref, ()) for k, ref in refs.items()])
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        for k, ref in refs.items():
            if k not in hung:
                try:
                    results[k] = ray.get(ref)
                except ray.exceptions.RayError as exc:
                    errors[k] = exc
        return results, errors, hung

    def _hung(self, shards: list[int], doing: str) -> NoReturn:
        """Ends the shards that did not answer (a late answer or write would
        not agree with the others) and raises ShardTimeoutError."""
        for k in shards:
            ray.kill(self._actors[k])
        self._lost, self._lost_kind = sorted(set(self._lost) | set(shards)), ShardTimeoutError
        self._lost_why = (f" (no answer to {doing} within {self._timeout:g} s: ended as hung "
                          "or unreachable)")
        raise self._lost_error()

    def _fail(self, errors: dict[int, BaseException], hung: list[int], doing: str) -> NoReturn:
        """Raises the error of a call some shards failed: ShardTimeoutError,
        ShardLostError, or the first shard's own error."""
        if hung:
            self._hung(hung, doing)
        # a shard whose own call found its actor dead is lost, whatever the
        # pings after it say (pings alone let the raw error escape, rarely)
        died = {k: e for k, e in errors.items() if isinstance(e, ray.exceptions.RayActorError)}
        if died:
            self._shard_died(next(iter(died.values())), list(died))
        first = next(iter(errors.values()))
        cause = getattr(first, "cause", None)
        raise (cause if isinstance(cause, Exception) else first) from None

    @_one_at_a_time
    def snapshot(self, path: Union[str, os.PathLike[str]]) -> None:
        """Saves every shard to path, a folder: cache.json and one NumPy file
        per shard, shard-K.npz (the keys and values as stored, bit for bit,
        written by the shard's own process, so on a cluster path must be on
        a file system every node shares).  Each snapshot has an id (a
        uuid) written into every file, and cache.json records the sha256 of
        each shard's file: ``restore`` checks both.

        Never half written: the snapshot is written into the sibling folder
        path + ".snapshot-new" and synced to disk; then path (an older
        snapshot) is renamed to path + ".snapshot-old", path +
        ".snapshot-new" to path, and path + ".snapshot-old" is removed.  So
        whatever stops a snapshot (an error, a lost or hung shard, a full
        disk, a crash of the program or of a shard), path holds the older
        snapshot or the new one, whole; only if it stops between the two
        renames is path missing, and then ``restore(path)`` reads path +
        ".snapshot-old", the older one.  The next snapshot to path first
        finishes what a stopped one left: it removes path +
        ".snapshot-new", and puts path + ".snapshot-old" back as path when
        path is missing (else removes it).  One snapshot to a path at a
        time.

        Raises
        ------
        ShardLostError, ShardTimeoutError
            A shard is lost, or did not answer within timeout (a snapshot
            of the shards left would not be the cache).
        OSError
            A file or folder could not be written (a full disk, no
            permission: the error names it).
        FileExistsError
            path, or one of those two siblings, holds files other than a
            snapshot's: a snapshot replaces or removes them whole, so they
            must be new, empty or snapshots.

        In every case path is left as it was.
        """
        self._check_alive()
        path = os.path.realpath(os.fspath(path))  # a link's target, kept a link
        new, old = path + _NEW, path + _OLD
        _finish_swap(path)
        if os.path.lexists(path):
            _check_replaceable(path)
        snapshot_id = uuid.uuid4().hex
        os.makedirs(new)
        try:
            digests, errors, hung = self._call({k: a.save.remote(new, snapshot_id)
                                                for k, a in enumerate(self._actors)})
            if errors or hung:
                self._fail(errors, hung, "snapshot")
            with open(os.path.join(new, "cache.json"), "w") as f:
                json.dump(self._config() | {"shard_lengths": self._lengths,
                                            "snapshot_id": snapshot_id,
                                            "sha256": {_shard_file(k): digests[k]
                                                       for k in sorted(digests)}}, f)
                f.flush()
                os.fsync(f.fileno())
            _sync_folder(new)
            if os.path.lexists(path):
                os.rename(path, old)
            try:
                os.rename(new, path)
            except BaseException:
                if os.path.lexists(old):
                    os.rename(old, path)
                raise
        except BaseException:
            shutil.rmtree(new, ignore_errors=True)
            raise
        _sync_folder(os.path.dirname(path))
        # the new snapshot is in place: a failure here leaves only a stray
        # folder, which the next snapshot removes
        shutil.rmtree(old, ignore_errors=True)

    def _config(self) -> dict[str, Any]:
        return {"num_shards": self._num_shards, "num_kv_heads": self._num_kv_heads,
                "head_dim": self._head_dim, "value_dim": self._value_dim,
                "capacity_per_shard": self._capacity, "chunk_size": self._chunk,
                "dtype": self._dtype.name, "storage": self._storage,
                "smooth_k": self._keys.smooth, "rotate_k": self._keys.rotate}

    @_one_at_a_time
    def restore(self, path: Union[str, os.PathLike[str]]) -> None:
        """Brings every shard back to a snapshot's positions, starting a new
        actor for each shard whose process died or does not answer: after
        a crash, or into a new cache created with the same arguments.
        Positions appended after the snapshot are gone from every shard.

        All or nothing, in two phases.  First the snapshot is checked: its
        cache.json against this cache and the round-robin rule, then each
        shard reads its file beside its cache and checks it (the
        snapshot's id and the shard's index written in it, its sha256
        against cache.json's, its positions and arrays).  Only when every
        shard's file passed do they all take it (a copy in memory).  If any
        check fails, no shard has changed: the cache answers as before, bit
        for bit, and the error names the file and what is wrong.  A shard
        needs the memory of a second copy of its positions while it checks.
        If path is missing but path + ".snapshot-old" is there (a snapshot
        stopped between the renames of its swap, see ``snapshot``), that
        older snapshot is read.

        Shards restarted here (their process had died or hung) hold nothing
        until the restore succeeds: if it fails they stay lost, and every
        call raises ShardLostError until a restore succeeds.  The same if a
        shard dies or hangs while the shards take their files.

        Raises
        ------
        FileNotFoundError
            No snapshot at path, or a shard's file missing.
        ValueError
            A snapshot of a cache of other sizes, chunk size, dtype or
            storage, or one whose files do not agree with it (truncated or
            damaged, of another snapshot, of another shard).
        ShardLostError, ShardTimeoutError
            A shard died, or did not answer within timeout, during the
            restore.
        """
        if not self._finalizer.alive:
            raise RuntimeError("this ShardedKVCache is closed")
        if not ray.is_initialized():
            raise RuntimeError("Ray was shut down, and this cache's shards with it; create a "
                               "new ShardedKVCache and restore the snapshot into it")
        folder, meta = self._read_snapshot(os.path.realpath(os.fspath(path)))
        lengths = meta["shard_lengths"]
        restart = sorted(set(self._lost) | set(self._dead_shards()))
        if restart:
            for k in restart:
                ray.kill(self._actors[k])  # a process that does not answer is not kept
                self._actors[k] = self._start(k)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _release, self._actors, self._group)
            # empty until the restore succeeds: lost till then
            why = self._lost_why if self._lost else " (its Ray actor died or did not answer)"
            self._lost, self._lost_why = restart, why
            _, errors, hung = self._call({k: self._actors[k].ping.remote() for k in restart})
            if errors or hung:
                self._fail(errors, hung, "restore (starting)")
        total = sum(lengths)
        _, errors, hung = self._call({
            k: a.stage.remote(folder, meta["snapshot_id"], meta["sha256"][_shard_file(k)],
                              lengths[k], self._runs(k, total))
            for k, a in enumerate(self._actors)})
        if errors or hung:
            for k, a in enumerate(self._actors):
                if k not in hung:
                    a.discard.remote()  # in order, before any later call of the shard
            task = {k: e for k, e in errors.items()
                    if not isinstance(e, ray.exceptions.RayActorError)}
            if hung or len(task) < len(errors):
                self._fail(errors, hung, "restore")
            raise ValueError("; ".join(_cause_text(task[k]) for k in sorted(task))
                             + f". The snapshot at {folder} was not restored: the cache is as "
                             "it was")
        _, errors, hung = self._call({k: a.commit.remote() for k, a in enumerate(self._actors)})
        self._lengths = list(lengths)
        if errors or hung:
            self._fail(errors, hung, "restore")
        self._lost, self._lost_why, self._lost_kind = [], "", ShardLostError

    def _read_snapshot(self, path: str) -> tuple[str, dict[str, Any]]:
        """The folder of the snapshot at path (path, or path + _OLD while a
        swap is unfinished) and its cache.json, checked against this cache
        and the round-robin rule, its files present."""
        unfinished = not os.path.lexists(path) and os.path.isdir(path + _OLD)
        folder = path + _OLD if unfinished else path
        name = os.path.join(folder, "cache.json")
        with open(name) as f:
            try:
                saved = json.load(f)
            except ValueError:
                saved = None
        fields = {"shard_lengths", "snapshot_id", "sha256"}
        if not isinstance(saved, dict) or not fields <= set(saved):
            raise ValueError(f"{name} is not a ShardedKVCache snapshot's cache.json (it needs "
                             f"{', '.join(sorted(fields))} and the cache's arguments)")
        meta = {k: saved.pop(k) for k in fields}
        for option in ("smooth_k", "rotate_k"):  # (snapshots made before the options)
            saved.setdefault(option, False)
        if saved != self._config():
            differ = {k: (saved.get(k), v) for k, v in self._config().items()
                      if saved.get(k) != v}
            raise ValueError(f"the snapshot at {folder} is of another cache: "
                             + ", ".join(f"{k} {s} there, {v} here"
                                         for k, (s, v) in differ.items()))
        lengths = meta["shard_lengths"]
        total = sum(lengths) if isinstance(lengths, list) and all(
            type(n) is int and n >= 0 for n in lengths) else -1
        rule = [sum(n for _, _, n in self._runs(k, total)) for k in range(self._num_shards)]
        if lengths != rule or max(rule, default=0) > self._capacity:
            raise ValueError(f"the snapshot at {folder} says its shards hold {lengths} positions, "
                             f"which {total} positions dealt in chunks of {self._chunk} to "
                             f"{self._num_shards} shards of {self._capacity} do not give")
        files = [_shard_file(k) for k in range(self._num_shards)]
        digests = meta["sha256"]
        if (not isinstance(meta["snapshot_id"], str) or not isinstance(digests, dict)
                or sorted(digests) != sorted(files)
                or not all(isinstance(d, str) for d in digests.values())):
            raise ValueError(f"{name} has no snapshot id or no sha256 for each of "
                             f"{', '.join(files)}")
        for shard in files:
            if not os.path.isfile(os.path.join(folder, shard)):
                raise FileNotFoundError(f"the snapshot at {folder} has no {shard}")
        return folder, meta

    @_one_at_a_time
    def close(self) -> None:
        """Ends the shards' processes and frees their CPUs; idempotent."""
        self._finalizer()

    def __enter__(self) -> ShardedKVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- a one-shot prefill --------------------------------------------------

def _query_shard(query: NDArray[Any], q0: int, shards: list[tuple[int, int, Any, Any]],
                 store: Optional[int], opts: _Options, sinks: Optional[NDArray[Any]]
                 ) -> tuple[Any, Any]:
    """One query shard (queries at positions q0...) against the key shards
    (global start, count, key ref, value ref) in ring order, merged: (out,
    lse).  A key shard that no query sees is skipped, not even fetched."""
    outs, lses = [], []
    stored = None if store is None else StoredKV(store)
    for n, (g, count, key_ref, value_ref) in enumerate(shards):
        runs = [(0, g, count)]
        if n and not _parts(runs, q0, query.shape[-2], opts):
            continue
        key, value = ray.get([key_ref, value_ref])
        out, lse = _attend_runs(query, lambda a, b: (key[..., a:b, :], value[..., a:b, :], stored),
                                runs, q0, opts, None if n else sinks)
        outs.append(out)
        lses.append(lse)
    return merge_attention(outs, lses) if len(outs) > 1 else (outs[0], lses[0])


_QUERY_SHARD: Any = ray.remote(_query_shard)


def _cuts(n: int, parts: int) -> list[tuple[int, int]]:
    """0..n-1 in parts contiguous ranges of nearly equal length."""
    edges = [n * p // parts for p in range(parts + 1)]
    return list(zip(edges, edges[1:]))


def sharded_attention(query: NDArray[Float], key: NDArray[Float], value: NDArray[Float],
                      num_shards: int, *, is_causal: bool = False,
                      causal_alignment: Alignment = "upper_left", scale: Optional[float] = None,
                      enable_gqa: bool = False, window_size: Optional[tuple[int, int]] = None,
                      alibi_slopes: Optional[NDArray[Any]] = None,
                      softcap: Optional[float] = None, sinks: Optional[NDArray[Any]] = None,
                      return_lse: bool = False, num_cpus_per_shard: float = 1.0,
                      num_threads: Optional[int] = None, timeout: Optional[float] = None
                      ) -> Union[NDArray[Float], tuple[NDArray[Float], NDArray[Float]]]:
    """``scaled_dot_product_attention`` computed by Ray tasks over sharded
    queries and keys: a long prefill spread over processes and machines
    (Ring Attention's schedule, Liu et al. 2023).

    The L queries and the S keys and values are each cut in num_shards
    contiguous shards of nearly equal length, put once in Ray's object
    store.  Task i takes query shard i and visits the key shards in ring
    order (its own, then i - 1, i - 2, ... wrapping round), skipping, and
    never fetching, those no query of its shard sees (under is_causal,
    about half of them), and merges its parts with ``merge_attention``.
    The outputs of the query shards are concatenated.

    Parameters
    ----------
    query, key, value, is_causal, causal_alignment, scale, enable_gqa, window_size,
    alibi_slopes, softcap, sinks, return_lse
        As in ``scaled_dot_product_attention``: shapes (..., Hq, L, E),
        (..., Hkv, S, E), (..., Hkv, S, Ev); no attn_mask (a mask would
        be cut like the scores; use window_size and is_causal).
    num_shards : int
        Shards of the queries and of the keys (>= 1).
    num_cpus_per_shard : float
        CPUs each task reserves from the cluster (default 1).
    num_threads : int or None
        The kernels' threads in each task; None: num_cpus_per_shard,
        rounded down, at least 1.
    timeout : float or None
        Seconds to wait for all the tasks (None: as long as they take).  A
        task waits for CPUs that others hold, a ``ShardedKVCache`` of the
        same program included: with a timeout, such a wait ends.

    Returns
    -------
    out (..., Hq, L, Ev) in query's dtype, and with return_lse the
    log-sum-exp (..., Hq, L): within the rounding of the merge of
    ``scaled_dot_product_attention``'s (see the module's note).

    Raises
    ------
    TypeError, ValueError
        As ``scaled_dot_product_attention``; num_shards not an int >= 1,
        num_cpus_per_shard or timeout not > 0, num_cpus_per_shard more than
        any node of the cluster has.
    TimeoutError
        The tasks were not done within timeout; they are cancelled.
    """
    shards = C.check_index(num_shards, "num_shards", 1)
    cpus = C.check_real(num_cpus_per_shard, "num_cpus_per_shard")
    if not cpus > 0:
        raise ValueError(f"num_cpus_per_shard must be > 0, got {num_cpus_per_shard}")
    threads = max(1, int(cpus)) if num_threads is None else _runtime.resolve_threads(num_threads)
    wait = None if timeout is None else _timeout(timeout)
    lse_wanted = C.check_bool(return_lse, "return_lse")
    require_qkv(query, key, value)  # the caller's shapes in any error about them
    # every other check of the call, on no rows, before anything is sent
    empty = checked_attention(query[..., :0, :], key[..., :0, :], value[..., :0, :], None, 0.0,
                       is_causal, scale, enable_gqa, causal_alignment, False, True, window_size,
                       alibi_slopes, softcap, sinks, None, threads)
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    dtype = query.dtype
    compute = C.compute_dtype(dtype)
    offset = C.alignment_offset(causal_alignment, L, S)
    batch = empty[0].shape[:-2]
    variants = _variants.check(window_size, alibi_slopes, softcap, sinks, batch, L, S, compute,
                               offset)
    opts = _Options(bool(is_causal), C.check_scale(scale, E, compute), None if window_size is None
                    else (variants.window_left, variants.window_right), alibi_slopes, softcap,
                    threads, bool(enable_gqa))
    if L == 0:
        return empty if lse_wanted else empty[0]  # type: ignore[return-value]
    if not ray.is_initialized():
        ray.init()  # what Ray's first remote call would do: a local cluster
    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    largest = max((float(n["Resources"].get("CPU", 0)) for n in nodes if n["Alive"]), default=0.0)
    if cpus > largest:
        raise ValueError(f"num_cpus_per_shard={cpus:g}: no node of the Ray cluster has that "
                         f"many CPUs (the largest has {largest:g}), so no task could start")
    store = _storage.store(dtype.name) if compute != dtype else None
    refs = [(c, d - c, ray.put(np.ascontiguousarray(key[..., c:d, :])),
             ray.put(np.ascontiguousarray(value[..., c:d, :]))) for c, d in _cuts(S, shards)]
    tasks = []
    for i, (a, b) in enumerate(_cuts(L, shards)):
        if a == b:
            continue
        ring = [refs[(i - n) % shards] for n in range(shards)]
        tasks.append(_QUERY_SHARD.options(num_cpus=cpus).remote(
            np.ascontiguousarray(query[..., a:b, :], compute), a + offset, ring, store, opts,
            sinks))
    done, _ = ray.wait(tasks, num_returns=len(tasks), timeout=wait)
    if len(done) < len(tasks):
        for task in tasks:
            ray.cancel(task, force=True)
        raise TimeoutError(f"sharded_attention: {len(tasks) - len(done)} of {len(tasks)} tasks "
                           f"not done within {wait:g} s, now cancelled; the Ray cluster has "
                           f"{_free_cpus():g} CPUs free (a ShardedKVCache holds its shards')")
    try:
        parts = ray.get(tasks)
    except ray.exceptions.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        raise (cause if isinstance(cause, (TypeError, ValueError, MemoryError)) else exc) from None
    out = np.concatenate([p[0] for p in parts], axis=-2)
    lse = np.concatenate([p[1] for p in parts], axis=-1)
    if compute != dtype:
        out = narrow(out, dtype, threads)
    return (out, lse) if lse_wanted else out
