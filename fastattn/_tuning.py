"""Choices of memory access that depend on the CPU, made by timing the calls
they concern rather than by a table of CPUs.

The row kernel, which decodes (a few query rows against a long key/value
cache), can ask for a block's value rows into L2 while it reads the block's
keys, so that the weighted sum over them that follows finds them there
(fa_attn_args.value_prefetch, csrc/fastattn.h).  Whether that pays depends
on the CPU: on the machine of commit 770bd68 it took decode-8192 (float16,
AVX-512, 2 threads) from 5.0 to 3.5 ms; on an AMD Zen 4, where PREFETCHT1
reaches L2 only since that generation and is sometimes dropped (Wang et
al. 2024, arXiv:2411.02814), it makes float32 decoding at one thread 10-20 %
slower (about 65 % of the read bandwidth against 72 %).

So the first decoding calls of a process over caches larger than L2 take
the two ways in turn, TRIALS calls each, and the way with the shorter time
per byte of cache is kept for the rest of the process, per SIMD path,
thread count and cache storage.  No result depends on the choice (the
prefetch only moves data between caches; tests/test_tuning.py checks the
bits).  FASTATTN_VALUE_PREFETCH=1 or 0 fixes it, for benchmarks of one way.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

VALUE_PREFETCH_ENV = "FASTATTN_VALUE_PREFETCH"
# calls of each way before choosing: the fastest of 5 is robust to a few
# calls slowed by other processes
TRIALS = 5
# keys and values below this stay in L2 (1-2 MB per core) or L3 after the
# first call: their time says nothing of memory access
MIN_BYTES = 8 << 20
# the default before any measurement, and for calls too small to measure
DEFAULT = True
# query rows per head up to which a call is a decoding step (the row
# kernel's FA_ROWS_MAX, csrc/fa_internal.h)
DECODE_ROWS = 4

Key = Tuple[int, int, int]  # SIMD path, threads, key/value storage


def _from_env() -> Optional[bool]:
    value = os.environ.get(VALUE_PREFETCH_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value in ("0", "1"):
        return value == "1"
    warnings.warn(f"{VALUE_PREFETCH_ENV}={value!r} is not one of 'auto', '0', '1'; using 'auto'",
                  RuntimeWarning, stacklevel=2)
    return None


_forced: Optional[bool] = _from_env()
_lock = threading.Lock()
_seconds_per_byte: Dict[Key, Tuple[List[float], List[float]]] = {}  # [off], [on]
_chosen: Dict[Key, bool] = {}


def force(value: Optional[bool]) -> None:
    """Fix the choice (True: prefetch value rows, False: not) or, with None,
    return to measuring; forgets what was measured."""
    global _forced
    with _lock:
        _forced = value
        _seconds_per_byte.clear()
        _chosen.clear()


def chosen() -> Dict[Key, bool]:
    """The choices made so far, by (SIMD path, threads, storage)."""
    with _lock:
        return dict(_chosen)


def in_use() -> Optional[bool]:
    """The fixed choice, else the one choice made so far (a benchmark's
    process makes one), else None."""
    with _lock:
        ways = {_forced} if _forced is not None else set(_chosen.values())
    return ways.pop() if len(ways) == 1 else None


def current(key: Key) -> bool:
    """The flag for a call that is not measured: the choice for key so far
    (a dictionary read, atomic: no lock on a tiny call's path)."""
    forced = _forced
    return forced if forced is not None else _chosen.get(key, DEFAULT)


def run(key: Key, nbytes: int, decoding: bool, kernel: Callable[[bool], object]) -> None:
    """kernel(value_prefetch), once.  Decoding calls over nbytes >= MIN_BYTES
    of keys and values are timed, each way in turn, until key's choice is
    made; other calls get the choice as it stands (DEFAULT before one).
    Without a measurement to make, this costs a few dictionary reads: a
    tiny call's time is mostly Python's."""
    way = _forced if _forced is not None else _chosen.get(key)
    if way is not None or not decoding or nbytes < MIN_BYTES:
        kernel(DEFAULT if way is None else way)
        return
    with _lock:
        times = _seconds_per_byte.setdefault(key, ([], []))
        way = len(times[1]) < len(times[0])  # each way in turn, off first
    start = time.perf_counter()
    kernel(way)  # a call that raises is not counted
    seconds = time.perf_counter() - start
    with _lock:
        if _seconds_per_byte.get(key) is not times:  # forgotten or decided meanwhile
            return
        times[way].append(seconds / nbytes)
        if min(len(t) for t in times) >= TRIALS:
            _chosen[key] = min(times[1]) < min(times[0])
            del _seconds_per_byte[key]
