"""Choices of memory access that depend on the CPU, made by timing the calls
they concern rather than by a table of CPUs.

The row kernel, which decodes (a few query rows against a long key/value
cache), can ask the cache for data ahead of its reads, beyond what the
hardware prefetcher fetches (fa_attn_args.prefetch, csrc/fastattn.h):

- KEYS: the key rows 2 KB ahead, into L1, or with FAR 8 KB ahead;
- VALUES: a block's value rows into L2 while its keys are read, so that the
  weighted sum over them that follows finds them there.

Each pays on some CPUs and costs on others (docs/guide/threads-and-speed.md,
"What the decoding kernel prefetches, measured per machine").  So the first
decoding calls of a process over caches larger than L2 take the six ways
(both, KEYS, VALUES, neither, and KEYS far with VALUES and without) in
turn, TRIALS calls each, and the way with
the shortest time per byte of cache is kept for the rest of the process,
per SIMD path, thread count, cache storage and layout (dense or paged).
One call is timed at a time: a call made while another thread's
is being timed takes the default, untimed.  No result depends on the choice
(a prefetch only moves data between caches; tests/test_tuning.py checks the
bits).  FASTATTN_PREFETCH fixes it, for benchmarks of one way:
"keys,values", "keys", "values", "none", or "far" with keys ("keys,far",
"keys,values,far"); "auto", the default, measures, and anything else
warns and measures.
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from . import _core

PREFETCH_ENV = "FASTATTN_PREFETCH"
KEYS, VALUES, FAR = _core.PREFETCH_KEYS, _core.PREFETCH_VALUES, _core.PREFETCH_FAR
# the ways, in the order the first calls take them; the first is the default
# before any measurement, and for calls too small to measure
WAYS = (KEYS | VALUES, KEYS, VALUES, 0, KEYS | FAR, KEYS | VALUES | FAR)
DEFAULT = WAYS[0]
# calls of each way before choosing: the fastest of 5 is robust to a few
# calls slowed by other processes
TRIALS = 5
# keys and values below this stay in L2 (1-2 MB per core) or L3 after the
# first call: their time says nothing of memory access
MIN_BYTES = 8 << 20
# query rows per head up to which a call is a decoding step (the row
# kernel's FA_ROWS_MAX, csrc/fa_internal.h)
DECODE_ROWS = 4

Key = Tuple[int, int, int, bool, int]  # SIMD path, threads, key/value storage, paged, precision
_NAMES = {"keys": KEYS, "values": VALUES, "far": FAR}


def describe(way: int) -> str:
    """A way as FASTATTN_PREFETCH spells it: "keys,values", "keys",
    "values", "none", "keys,far" or "keys,values,far"."""
    return ",".join(name for name, bit in _NAMES.items() if way & bit) or "none"


def distinct_bytes(*arrays: np.ndarray) -> int:
    """The bytes a call reads of the arrays: a broadcast axis (stride 0)
    counted once, so that a small cache seen by many queries is not taken
    for a large one."""
    return sum(a.itemsize * math.prod(n for n, s in zip(a.shape, a.strides) if s != 0)
               for a in arrays)


def _from_env() -> Optional[int]:
    raw = os.environ.get(PREFETCH_ENV, "auto")
    value = raw.strip(" \t").lower() if raw.isascii() else None  # no look-alike letters
    if value in ("", "auto"):
        return None
    if value == "none":
        return 0
    parts = [part.strip(" \t") for part in value.split(",")] if value is not None else []
    if parts and all(part in _NAMES for part in parts):
        way = 0
        for part in parts:
            way |= _NAMES[part]
        if way in WAYS:  # "far" only with "keys"
            return way
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    warnings.warn(f"{PREFETCH_ENV}={shown!r} is not one of 'auto', 'none', 'keys', 'values', "
                  "'keys,values', 'keys,far', 'keys,values,far'; using 'auto'", RuntimeWarning,
                  stacklevel=2)
    return None


_forced: Optional[int] = _from_env()
_lock = threading.Lock()
_timing = threading.Lock()  # held by the one call being timed
_seconds_per_byte: Dict[Key, Dict[int, List[float]]] = {}  # per way
_chosen: Dict[Key, int] = {}


def force(way: Optional[int]) -> None:
    """Fix the choice (a bitwise or of KEYS, VALUES and FAR) or, with None,
    return to measuring; forgets what was measured."""
    global _forced
    with _lock:
        _forced = way
        _seconds_per_byte.clear()
        _chosen.clear()


def chosen() -> Dict[Key, int]:
    """The choices made so far, by (SIMD path, threads, storage)."""
    with _lock:
        return dict(_chosen)


def in_use() -> Optional[int]:
    """The fixed choice, else the one choice made so far (a benchmark's
    process makes one), else None."""
    with _lock:
        ways = {_forced} if _forced is not None else set(_chosen.values())
    return ways.pop() if len(ways) == 1 else None


def current(key: Key) -> int:
    """The way for a call that is not measured: the choice for key so far
    (a dictionary read, atomic: no lock on a tiny call's path)."""
    forced = _forced
    return forced if forced is not None else _chosen.get(key, DEFAULT)


def run(key: Key, nbytes: int, decoding: bool, kernel: Callable[[int], object]) -> None:
    """kernel(prefetch), once.  Decoding calls over nbytes >= MIN_BYTES of
    keys and values are timed, each way in turn, until key's choice is made;
    other calls get the choice as it stands (DEFAULT before one).  Without a
    measurement to make, this costs a few dictionary reads: a tiny call's
    time is mostly Python's."""
    way = _forced if _forced is not None else _chosen.get(key)
    if way is not None or not decoding or nbytes < MIN_BYTES:
        kernel(DEFAULT if way is None else way)
        return
    if not _timing.acquire(blocking=False):  # another thread's call is timed
        kernel(DEFAULT)
        return
    try:
        with _lock:
            times = _seconds_per_byte.setdefault(key, {w: [] for w in WAYS})
            way = min(WAYS, key=lambda w: len(times[w]))  # each way in turn, in WAYS' order
        start = time.perf_counter()
        kernel(way)  # a call that raises is not counted
        seconds = time.perf_counter() - start
    finally:
        _timing.release()
    with _lock:
        if _seconds_per_byte.get(key) is not times:  # forgotten or decided meanwhile
            return
        times[way].append(seconds / nbytes)
        if min(len(t) for t in times.values()) >= TRIALS:
            _chosen[key] = min(WAYS, key=lambda w: min(times[w]))
            del _seconds_per_byte[key]
