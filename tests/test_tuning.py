"""The measured choice of what the decoding kernel prefetches
(fastattn/_tuning.py): no result depends on it, and the first decoding calls
pick the fastest way."""
import itertools
import re
import types

import numpy as np
import pytest

import fastattn
from fastattn import _tuning


@pytest.fixture
def fresh():
    """Measuring from scratch, and back to the process's setting after."""
    before = _tuning._forced
    _tuning.force(None)
    yield
    _tuning.force(before)


@pytest.mark.parametrize("storage", ["float32", "float16", "int8", "int4"])
def test_bits_do_not_depend_on_the_choice(simd, fresh, storage):
    # two pieces of two key blocks each (FA_RB = 1024), grouped heads, a paged cache too
    rng = np.random.default_rng(3)
    B, Hq, Hkv, S, E = 2, 4, 2, 2100, 64
    q = rng.standard_normal((B, Hq, 1, E), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, E), dtype=np.float32)
    cache = fastattn.KVCache(B, Hkv, S, E, storage=storage)
    cache.append(k, v)
    paged = fastattn.PagedKVCache(2 * (S // 16 + 1), 16, Hkv, E, storage=storage)
    seqs = [paged.add_sequence() for _ in range(B)]
    cu = np.array([0, S, 2 * S])
    paged.append(seqs, np.concatenate([x.transpose(1, 0, 2) for x in k]),
                 np.concatenate([x.transpose(1, 0, 2) for x in v]), cu)
    outs = {}
    for way in _tuning.WAYS:
        _tuning.force(way)
        dense = fastattn.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        outs[way] = (dense, cache.attend(q),
                     paged.attend(seqs, q[:, :, 0].reshape(B, Hq, E)))
    assert sorted(outs) == [0, 1, 2, 3, 17, 19]
    for way in _tuning.WAYS[1:]:
        for a, b in zip(outs[_tuning.DEFAULT], outs[way]):
            np.testing.assert_array_equal(a, b)


def fake_clock(monkeypatch, durations):
    """perf_counter() returning times whose successive differences, call
    by call, are durations (a start, then an end per timed call)."""
    now = itertools.accumulate(itertools.chain.from_iterable((0.0, d) for d in durations))
    monkeypatch.setattr(_tuning, "time", types.SimpleNamespace(perf_counter=lambda: next(now)))


@pytest.mark.parametrize("fastest", range(6))
def test_the_fastest_way_is_kept(monkeypatch, fresh, fastest):
    key, nbytes = (1, 1, 0, False, 0), _tuning.MIN_BYTES
    n = len(_tuning.WAYS)
    ways = []
    # the calls take turns; the fastest way's calls take 1 s, the others'
    # 2, 3 or 4, the first call disturbed (9 s): the fastest of each decides
    durations = iter([9.0] + [1.0 + (i - fastest) % n for i in range(1, 100)])
    fake_clock(monkeypatch, (next(durations) for _ in itertools.count()))
    for _ in range(n * _tuning.TRIALS):
        _tuning.run(key, nbytes, True, ways.append)
    assert ways == list(_tuning.WAYS) * _tuning.TRIALS
    best = _tuning.WAYS[fastest]
    assert _tuning.chosen() == {key: best}
    assert _tuning.in_use() == best
    for _ in range(3):  # decided: no more turns
        _tuning.run(key, nbytes, True, ways.append)
    assert ways[-3:] == [best] * 3
    assert _tuning.current(key) == best
    assert _tuning.current((1, 2, 0, False)) == _tuning.DEFAULT  # another thread count: not yet


def test_small_or_non_decoding_calls_are_not_measured(monkeypatch, fresh):
    monkeypatch.setattr(_tuning, "time", None)  # any timing would fail
    for nbytes, decoding in ((_tuning.MIN_BYTES - 1, True), (_tuning.MIN_BYTES, False)):
        for _ in range(len(_tuning.WAYS) * _tuning.TRIALS + 1):
            ways = []
            _tuning.run((1, 1, 0, False, 0), nbytes, decoding, ways.append)
            assert ways == [_tuning.DEFAULT]
    assert _tuning.chosen() == {}


def test_a_small_cache_seen_by_many_queries_is_not_measured(monkeypatch, fresh):
    # 4 MB of keys and values broadcast over a batch of 8: 4 MB read, not 32
    monkeypatch.setattr(_tuning, "time", None)  # any timing would fail
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 4, 1024, 128), dtype=np.float32)
    q = rng.standard_normal((8, 4, 1, 128), dtype=np.float32)
    assert _tuning.distinct_bytes(np.broadcast_to(k, (8,) + k.shape[1:]), k) == 2 * k.nbytes
    for _ in range(len(_tuning.WAYS) * _tuning.TRIALS):
        fastattn.scaled_dot_product_attention(q, k, k)
        fastattn.scaled_dot_product_attention(q, np.broadcast_to(k, (8, 4, 1024, 128)), k)
    assert _tuning.chosen() == {}


def test_one_call_is_timed_at_a_time(monkeypatch, fresh):
    fake_clock(monkeypatch, itertools.repeat(1.0))
    key, ways = (1, 1, 0, False, 0), []
    with _tuning._timing:  # another thread's call is being timed
        _tuning.run(key, _tuning.MIN_BYTES, True, ways.append)
    assert ways == [_tuning.DEFAULT] and _tuning._seconds_per_byte == {}
    _tuning.run(key, _tuning.MIN_BYTES, True, ways.append)  # now timed: the first way
    assert len(_tuning._seconds_per_byte[key][_tuning.WAYS[0]]) == 1


def test_a_failed_call_is_not_counted(monkeypatch, fresh):
    fake_clock(monkeypatch, itertools.repeat(1.0))
    def fail(way):
        raise RuntimeError("the kernel call failed")

    with pytest.raises(RuntimeError):
        _tuning.run((1, 1, 0, False, 0), _tuning.MIN_BYTES, True, fail)
    ways = []
    _tuning.run((1, 1, 0, False, 0), _tuning.MIN_BYTES, True, ways.append)
    assert ways == [_tuning.WAYS[0]]  # still the first turn's way


@pytest.mark.parametrize("value, expected", [("keys,values", 3), (" Values , keys", 3),
                                             ("keys", 1), ("values", 2), ("none", 0),
                                             ("keys,far", 17), ("far, values, keys", 19),
                                             ("auto", None), (" ", None)])
def test_environment(monkeypatch, value, expected):
    monkeypatch.setenv(_tuning.PREFETCH_ENV, value)
    assert _tuning._from_env() == expected
    if expected is not None:  # what the bench's JSON records reads back
        monkeypatch.setenv(_tuning.PREFETCH_ENV, _tuning.describe(expected))
        assert _tuning._from_env() == expected


@pytest.mark.parametrize("value", ["yes", "1", "keys,", "KEYS;values", "\u212aeys", "keys\u00a0",
                                   "far", "values,far"])  # far: only with keys
def test_environment_typo_warns(monkeypatch, value):
    monkeypatch.setenv(_tuning.PREFETCH_ENV, value)
    with pytest.warns(RuntimeWarning, match=re.escape(f"FASTATTN_PREFETCH={value!r}")):
        assert _tuning._from_env() is None


def test_a_long_environment_value_is_shown_cut(monkeypatch):
    monkeypatch.setenv(_tuning.PREFETCH_ENV, "x" * 100_000)
    with pytest.warns(RuntimeWarning) as record:
        assert _tuning._from_env() is None
    assert len(str(record[0].message)) < 200
