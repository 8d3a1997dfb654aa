"""Blocks that several sequences of one paged call hold (forks, a prompt
that prefix caching shares) are read from memory once for all of them:
decoding splits each sequence's keys in pieces of 1024 at multiples of
1024, and the pieces of different sequences over the same blocks run
together (fa_attn_parts), a few key rows at a time for every sequence.
Checked: each sequence's output and lse are bitwise those of the sequence
attended alone, whatever the other sequences, the thread count, the
storage, the options and the path; and they match the float64 reference."""
import numpy as np
import pytest
from conftest import assert_close

import fastattn
from fastattn import reference as ref

BS, HKV, E, EV = 16, 2, 16, 12


def forks(rng, n, prompt=2100, storage=None, dtype=np.float32, tails=None, spare=4,
          **cache_options):
    """A cache whose sequence 0 holds a prompt of `prompt` positions and n - 1
    forks of it; then each appends a tail of its own (tails[i] positions), so
    that their lengths differ.  Returns (cache, seq_ids, keys, values): each
    sequence's keys and values as appended, (S_b, HKV, E)."""
    tails = tails or [1 + 7 * i % 40 for i in range(n)]
    need = prompt // BS + 1 + sum(t // BS + 2 for t in tails)
    cache = fastattn.PagedKVCache(need + spare, BS, HKV, E, value_dim=EV, dtype=dtype,
                                  storage=storage, **cache_options)
    k0 = rng.standard_normal((prompt, HKV, E)).astype(dtype)
    v0 = rng.standard_normal((prompt, HKV, EV)).astype(dtype)
    first = cache.add_sequence()
    cache.append([first], k0, v0, np.array([0, prompt]))
    ids = [first] + [cache.fork(first) for _ in range(n - 1)]
    keys, values = [], []
    for s, t in zip(ids, tails):
        k = rng.standard_normal((t, HKV, E)).astype(dtype)
        v = rng.standard_normal((t, HKV, EV)).astype(dtype)
        cache.append([s], k, v, np.array([0, t]))
        keys.append(np.concatenate([k0, k]))
        values.append(np.concatenate([v0, v]))
    return cache, ids, keys, values


def alone(cache, ids, query, cu, **options):
    """Each sequence attended in a call of its own, packed as the batch's."""
    outs, lses = [], []
    for b, s in enumerate(ids):
        o, lse = cache.attend([s], query[cu[b]:cu[b + 1]], np.array([0, cu[b + 1] - cu[b]]),
                              return_lse=True, **options)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def queries(rng, n, Hq, L, dtype=np.float32):
    cu = np.arange(n + 1) * L
    return rng.standard_normal((n * L, Hq, E)).astype(dtype), cu


@pytest.mark.parametrize("G,L", [(1, 1), (2, 2), (4, 1), (8, 1)])
def test_forks_keep_the_bits_of_each_sequence_alone(simd, dtype, G, L):
    rng = np.random.default_rng(G * 10 + L)
    cache, ids, _, _ = forks(rng, 6, dtype=dtype)
    query, cu = queries(rng, len(ids), HKV * G, L, dtype)
    want, want_lse = alone(cache, ids, query, cu)
    for threads in (1, 2, 3):
        out, lse = cache.attend(ids, query, cu, return_lse=True, num_threads=threads)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("storage,precision", [
    ("float16", "exact"), ("bfloat16", "exact"), ("float8_e4m3fn", "exact"),
    ("float8_e5m2", "exact"), ("int8", "exact"), ("int4", "exact"), ("int8", "int8"),
    ("int4", "int8")])
def test_every_storage_and_precision(storage, precision):
    rng = np.random.default_rng(len(storage))
    cache, ids, _, _ = forks(rng, 5, storage=storage, tails=[1, 9, 30, 31, 64])
    query, cu = queries(rng, len(ids), HKV * 2, 1)
    want, want_lse = alone(cache, ids, query, cu, precision=precision)
    out, lse = cache.attend(ids, query, cu, return_lse=True, num_threads=2, precision=precision)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


@pytest.mark.parametrize("options", [
    {"window_size": (1500, 0)}, {"softcap": 2.0}, {"scale": 0.7},
    {"alibi_slopes": np.array([0.001, 0.002, 0.0005, 0.003])}, {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
    {"is_causal": False}], ids=["window", "softcap", "scale", "alibi", "sinks", "not-causal"])
def test_options_keep_the_bits(simd, options):
    """A window leaves sequences of different lengths different keys of a
    shared piece: they run alone, the others together."""
    rng = np.random.default_rng(3)
    cache, ids, _, _ = forks(rng, 5, tails=[1, 2, 200, 900, 1000])
    query, cu = queries(rng, len(ids), HKV * 2, 1)
    want, want_lse = alone(cache, ids, query, cu, **options)
    for threads in (1, 2):
        out, lse = cache.attend(ids, query, cu, return_lse=True, num_threads=threads, **options)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(lse, want_lse)


def test_more_sharers_than_one_run_takes():
    """FA_ATTN_PARTS_MAX (16) sequences a run: 37 forks make three."""
    rng = np.random.default_rng(37)
    cache, ids, _, _ = forks(rng, 37, prompt=3100)
    query, cu = queries(rng, len(ids), HKV, 1)
    want, want_lse = alone(cache, ids, query, cu)
    out, lse = cache.attend(ids, query, cu, return_lse=True, num_threads=2)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_a_batch_mixing_forks_prefill_and_strangers():
    """Forks decoding next to a prefill chunk of one of them, a sequence of
    its own and speculative tokens under a tree mask."""
    rng = np.random.default_rng(5)
    cache, ids, _, _ = forks(rng, 4, spare=2500 // BS + 2)
    other = cache.add_sequence()
    k = rng.standard_normal((2500, HKV, E)).astype(np.float32)
    cache.append([other], k, k[..., :EV], np.array([0, 2500]))
    seqs = ids + [other]
    lens = [1, 3, 1, 2, 1]  # the prefill chunk's 3 rows, 2 draft tokens
    cu = np.concatenate([[0], np.cumsum(lens)])
    query = rng.standard_normal((cu[-1], HKV * 2, E)).astype(np.float32)
    tree = np.array([[True, False], [True, True]])
    tree_mask = tree.ravel()
    indptr = np.array([0, 0, 0, 0, 4, 4])
    out, lse = cache.attend(seqs, query, cu, return_lse=True, tree_mask=tree_mask,
                            tree_mask_indptr=indptr, num_threads=2)
    for b, s in enumerate(seqs):
        n = lens[b]
        extra = {"tree_mask": tree_mask, "tree_mask_indptr": np.array([0, 4])} if b == 3 else {}
        o, l_ = cache.attend([s], query[cu[b]:cu[b + 1]], np.array([0, n]), return_lse=True,
                             **extra)
        np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], o)
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], l_)


def test_a_prompt_shared_by_prefix_caching():
    """Two requests whose prompts share 2048 positions (matched blocks),
    of different lengths after."""
    rng = np.random.default_rng(8)
    cache = fastattn.PagedKVCache(400, BS, HKV, E, enable_prefix_caching=True)
    tokens = rng.integers(0, 1000, 2600)
    k = rng.standard_normal((2600, HKV, E)).astype(np.float32)
    a = cache.add_sequence()
    cache.append([a], k[:2300], k[:2300], np.array([0, 2300]), token_ids=tokens[:2300])
    b = cache.add_sequence()
    n = cache.match_prefix(b, np.concatenate([tokens[:2048], [7] * 552]))
    assert n == 2048
    cache.append([b], k[2048:], k[2048:], np.array([0, 552]),
                 token_ids=np.full(552, 7))
    assert (cache.block_table([a])[0, :128] == cache.block_table([b])[0, :128]).all()
    query = rng.standard_normal((2, HKV, E)).astype(np.float32)
    cu = np.array([0, 1, 2])
    want, want_lse = alone(cache, [a, b], query, cu)
    out, lse = cache.attend([a, b], query, cu, return_lse=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse, want_lse)


def test_against_the_float64_reference(simd):
    rng = np.random.default_rng(11)
    cache, ids, keys, values = forks(rng, 4, dtype=np.float64)
    query, cu = queries(rng, len(ids), HKV * 2, 1, np.float64)
    out, lse = cache.attend(ids, query, cu, return_lse=True, num_threads=2)
    for b in range(len(ids)):
        q = query[cu[b]:cu[b + 1]].transpose(1, 0, 2)
        k = np.repeat(keys[b].transpose(1, 0, 2), 2, axis=0)
        v = np.repeat(values[b].transpose(1, 0, 2), 2, axis=0)
        want, want_lse = ref.scaled_dot_product_attention(
            q, k, v, is_causal=True, causal_alignment="lower_right", return_lse=True)
        S = k.shape[1]
        assert_close(out[cu[b]:cu[b + 1]].transpose(1, 0, 2), want, np.float64, E + S)
        assert_close(lse[:, cu[b]:cu[b + 1]], want_lse, np.float64, E + S,
                     magnitude=float(np.abs(want_lse).max()))


def test_the_plan_counts_a_shared_piece_once():
    """The bytes the kernels stream (fastattn bench --serving's "MB read"):
    the prompt's whole pieces once for the 8 forks, their own keys each."""
    from fastattn import _dispatch

    rng = np.random.default_rng(2)
    tails = [5, 17, 40, 64, 1, 2, 3, 4]
    cache, ids, _, _ = forks(rng, 8, prompt=4096, tails=tails)
    query, cu = queries(rng, len(ids), HKV * 4, 1)
    row = (E + EV) * 4  # a key row's and a value row's bytes
    with _dispatch.reads() as shared:
        cache.attend(ids, query, cu)
    with _dispatch.reads() as apart:
        for b, s in enumerate(ids):
            cache.attend([s], query[b:b + 1])
    assert sum(apart) == sum(4096 + t for t in tails) * HKV * row
    assert shared == [(4096 + sum(tails)) * HKV * row]


@pytest.mark.parametrize("options", [{}, {"softcap": 3.0}, {"sinks": np.array([0.5, -1.0, 2.0, 0.0])},
                                     {"is_causal": False}, {"scale": 0.4}],
                         ids=["plain", "softcap", "sinks", "not-causal", "scale"])
def test_cascade_matches_the_exact_call(simd, dtype, options):
    """cascade=True (opt-in): the common prefix once for all the queries,
    merged by log-sum-exp; within float rounding of the exact call (the
    merge adds a rounding: the suite's bound over S keys), the same bits
    for any thread count."""
    rng = np.random.default_rng(21)
    cache, ids, keys, values = forks(rng, 5, dtype=dtype, tails=[1, 30, 70, 200, 5])
    query, cu = queries(rng, len(ids), HKV * 2, 1, dtype)
    exact, exact_lse = cache.attend(ids, query, cu, return_lse=True, **options)
    out, lse = cache.attend(ids, query, cu, return_lse=True, cascade=True, **options)
    assert_close(out, exact, dtype, E + 2300)
    assert_close(lse, exact_lse, dtype, E + 2300, magnitude=float(np.abs(exact_lse).max()))
    for threads in (2, 3):
        again = cache.attend(ids, query, cu, return_lse=True, cascade=True,
                             num_threads=threads, **options)
        np.testing.assert_array_equal(again[0], out)
        np.testing.assert_array_equal(again[1], lse)


def test_cascade_with_trees_storage_and_idle_sequences():
    """Trees over the sequences' own keys, an int8 cache, a sequence with no
    query (which holds fewer keys) and out=."""
    rng = np.random.default_rng(22)
    cache, ids, _, _ = forks(rng, 4, storage="int8", tails=[3, 9, 40, 2])
    idle = cache.add_sequence()
    k = rng.standard_normal((10, HKV, E)).astype(np.float32)
    cache.append([idle], k, k[..., :EV], np.array([0, 10]))
    seqs = ids + [idle]
    lens = [1, 3, 1, 2, 0]
    cu = np.concatenate([[0], np.cumsum(lens)])
    query = rng.standard_normal((cu[-1], HKV * 2, E)).astype(np.float32)
    tree = np.array([True, False, False, True, True, False, True, False, True])  # 3 x 3
    indptr = np.array([0, 0, 9, 9, 9, 9])
    exact = cache.attend(seqs, query, cu, tree_mask=tree, tree_mask_indptr=indptr)
    out = np.empty_like(exact)
    got = cache.attend(seqs, query, cu, tree_mask=tree, tree_mask_indptr=indptr, cascade=True,
                       out=out)
    assert got is out
    assert_close(out, exact, np.float32, E + 2300)


def test_cascade_without_a_common_prefix_is_the_exact_call():
    rng = np.random.default_rng(23)
    cache, ids, _, _ = forks(rng, 3, spare=2500 // BS + 2)
    other = cache.add_sequence()  # shares no block with the forks
    k = rng.standard_normal((2500, HKV, E)).astype(np.float32)
    cache.append([other], k, k[..., :EV], np.array([0, 2500]))
    seqs = ids + [other]
    query, cu = queries(rng, len(seqs), HKV, 1)
    np.testing.assert_array_equal(cache.attend(seqs, query, cu, cascade=True),
                                  cache.attend(seqs, query, cu))


def test_cascade_takes_a_window_that_hides_nothing(rng):
    """FlashAttention's (-1, -1) and a window wider than every sequence are
    no window: the cascade takes them, with the bits it gives without."""
    cache, ids, _, _ = forks(rng, 3)
    query, cu = queries(rng, 3, HKV, 1)
    plain = cache.attend(ids, query, cu, cascade=True)
    for window in [(-1, -1), (10 ** 6, -5)]:
        np.testing.assert_array_equal(
            cache.attend(ids, query, cu, cascade=True, window_size=window), plain)


@pytest.mark.parametrize("options, words", [
    ({"window_size": (100, 0)}, "window_size"),
    ({"alibi_slopes": np.array([0.1, 0.2])}, "alibi_slopes"),
    ({"precision": "int8"}, "precision"),
    ({"cascade": "yes"}, "cascade")])
def test_cascade_refusals(options, words):
    rng = np.random.default_rng(24)
    cache, ids, _, _ = forks(rng, 2)
    query, cu = queries(rng, 2, HKV, 1)
    options = {"cascade": True, **options}
    error = TypeError if options["cascade"] == "yes" else ValueError
    with pytest.raises(error, match=words):
        cache.attend(ids, query, cu, **options)
    smooth = fastattn.PagedKVCache(300, BS, HKV, E, smooth_k=True)
    a = smooth.add_sequence()
    smooth.append([a], np.ones((2100, HKV, E), np.float32), np.ones((2100, HKV, E), np.float32),
                  np.array([0, 2100]))
    b = smooth.fork(a)
    with pytest.raises(ValueError, match="key means"):
        smooth.attend([a, b], np.ones((2, HKV, E), np.float32), cascade=True)


def test_the_plan_counts_pieces_a_window_leaves_apart_each():
    """Under a window the forks' pieces over the prompt hold other keys
    (fa_attn_parts computes them alone): each counted, in any order."""
    from fastattn import _dispatch

    rng = np.random.default_rng(4)
    cache, ids, _, _ = forks(rng, 2, tails=[1, 900])
    query, cu = queries(rng, 2, HKV, 1)
    counts = []
    for order in (ids, ids[::-1]):
        with _dispatch.reads() as shared:
            cache.attend(order, query, cu, window_size=(1500, 0))
        with _dispatch.reads() as apart:
            for b, s in enumerate(order):
                cache.attend([s], query[b:b + 1], window_size=(1500, 0))
        assert shared == [sum(apart)]
        counts.append(shared[0])
    assert counts[0] == counts[1]
