"""PagedKVCache(enable_prefix_caching=True): vLLM's automatic prefix caching.

Full blocks are named by their tokens' ids chained with the blocks before
them; match_prefix shares the blocks of the longest cached prefix with a
new sequence.  Checked: the blocks are the same physical ones, the results
are bitwise those of computing the prefix again, freed named blocks wait
idle (counted free) and are evicted least recently freed first, never
while a sequence holds them, and shared blocks are copied before a write."""
import numpy as np
import pytest

import fastattn

H, E, BS = 2, 16, 4


def prompt_kv(tokens):
    """Keys and values that depend on the token ids and positions alone, as
    a model's would: the same prefix gives the same rows."""
    t = np.asarray(tokens, np.float64)[:, None, None]
    pos = np.arange(len(tokens), dtype=np.float64)[:, None, None]
    grid = np.arange(H * E, dtype=np.float64).reshape(1, H, E)
    k = np.sin(0.37 * t + 0.11 * pos + 0.05 * grid).astype(np.float32)
    v = np.cos(0.23 * t - 0.07 * pos + 0.03 * grid).astype(np.float32)
    return k, v


def prefill(cache, tokens, seq=None):
    """A new sequence for tokens: its cached prefix matched, the rest
    appended; (seq_id, positions matched)."""
    seq = cache.add_sequence() if seq is None else seq
    n = cache.match_prefix(seq, np.array(tokens))
    k, v = prompt_kv(tokens)
    cache.append([seq], k[n:], v[n:], np.array([0, len(tokens) - n]),
                 token_ids=np.array(tokens[n:]))
    return seq, n


def test_a_shared_prompt_is_matched_and_gives_the_same_bits():
    cache = fastattn.PagedKVCache(32, BS, H, E, enable_prefix_caching=True)
    system = list(range(100, 111))  # 11 tokens: two whole blocks, then 3
    a, n_a = prefill(cache, system + [1, 2, 3])
    assert n_a == 0
    b, n_b = prefill(cache, system + [7, 8])
    assert n_b == 8  # the two whole blocks of the system prompt
    assert cache.block_table([b])[0, :2].tolist() == cache.block_table([a])[0, :2].tolist()
    q = np.random.default_rng(0).standard_normal((1, 2 * H, E)).astype(np.float32)
    plain = fastattn.PagedKVCache(32, BS, H, E)
    c = plain.add_sequence()
    k, v = prompt_kv(system + [7, 8])
    plain.append([c], k, v, np.array([0, 13]))
    np.testing.assert_array_equal(cache.attend([b], q), plain.attend([c], q))


def test_the_last_token_is_always_computed():
    cache = fastattn.PagedKVCache(16, BS, H, E, enable_prefix_caching=True)
    prefill(cache, list(range(8)))
    s = cache.add_sequence()
    assert cache.match_prefix(s, np.arange(8)) == 4  # not 8: the last token is left
    assert cache.match_prefix(cache.add_sequence(), np.arange(9)) == 8


def test_freed_blocks_wait_idle_and_are_evicted_least_recent_first():
    cache = fastattn.PagedKVCache(6, BS, H, E, enable_prefix_caching=True)
    a, _ = prefill(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])   # 3 blocks, 2 named
    b, _ = prefill(cache, [20, 21, 22, 23, 24])          # 2 blocks, 1 named
    assert cache.num_free_blocks == 1
    cache.free(a)
    cache.free(b)
    assert cache.num_free_blocks == 6  # idle named blocks count as free
    # a's prompt again: its two named blocks, idle, are matched back
    a2, n = prefill(cache, [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert n == 8
    # filling the pool evicts b's named block (freed first among the idle)
    c, _ = prefill(cache, list(range(50, 62)))  # 3 blocks: 2 plain free + 1 evicted
    assert cache.match_prefix(cache.add_sequence(), np.array([20, 21, 22, 23, 24])) == 0
    # a2's blocks were held throughout: still matched
    assert cache.match_prefix(cache.add_sequence(), np.array([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 8


def test_an_eviction_never_touches_a_live_sequence():
    cache = fastattn.PagedKVCache(4, BS, H, E, enable_prefix_caching=True)
    a, _ = prefill(cache, list(range(9)))  # 3 blocks held
    q = np.ones((1, 2 * H, E), np.float32)
    before = cache.attend([a], q)
    cache.append([cache.add_sequence()], *prompt_kv([5] * 4), np.array([0, 4]))
    with pytest.raises(fastattn.OutOfBlocksError):
        cache.append([cache.add_sequence()], *prompt_kv([6] * 4), np.array([0, 4]))
    np.testing.assert_array_equal(cache.attend([a], q), before)


def test_shared_blocks_are_copied_before_a_write():
    cache = fastattn.PagedKVCache(16, BS, H, E, enable_prefix_caching=True)
    a, _ = prefill(cache, list(range(10)))
    q = np.ones((1, 2 * H, E), np.float32)
    before = cache.attend([a], q)
    b = cache.add_sequence()
    assert cache.match_prefix(b, np.arange(10)) == 8
    cache.truncate([b], [6])  # into a shared named block
    cache.append([b], *prompt_kv([99, 98]), np.array([0, 2]), token_ids=np.array([99, 98]))
    np.testing.assert_array_equal(cache.attend([a], q), before)
    assert cache.block_table([b])[0, 1] != cache.block_table([a])[0, 1]
    # the block truncated into lost its name (b could have written into it
    # in place had a let go first): only the first block still matches
    cache.free(a)
    assert cache.match_prefix(cache.add_sequence(), np.arange(10)) == 4


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="smooth_k"):
        fastattn.PagedKVCache(4, BS, H, E, enable_prefix_caching=True, smooth_k=True)
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        fastattn.PagedKVCache(4, BS, H, E, enable_prefix_caching=1)
    plain = fastattn.PagedKVCache(4, BS, H, E)
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        plain.match_prefix(plain.add_sequence(), np.arange(5))
    cache = fastattn.PagedKVCache(8, BS, H, E, enable_prefix_caching=True)
    s, _ = prefill(cache, list(range(5)))
    with pytest.raises(ValueError, match="holds 5 positions"):
        cache.match_prefix(s, np.arange(5))
    with pytest.raises(TypeError, match="1-D array of ints"):
        cache.match_prefix(cache.add_sequence(), np.arange(5.0))
    with pytest.raises(ValueError, match="one per token"):
        cache.append([cache.add_sequence()], *prompt_kv([1, 2]), np.array([0, 2]),
                     token_ids=np.array([1]))
    # tokens appended without ids name no block
    t = cache.add_sequence()
    cache.append([t], *prompt_kv(list(range(30, 38))), np.array([0, 8]))
    assert cache.match_prefix(cache.add_sequence(), np.arange(30, 39)) == 0


def test_forks_keep_their_names():
    cache = fastattn.PagedKVCache(16, BS, H, E, enable_prefix_caching=True)
    a, _ = prefill(cache, list(range(6)))
    child = cache.fork(a)
    cache.append([child], *prompt_kv([6, 7]), np.array([0, 2]), token_ids=np.array([6, 7]))
    # the child's block 1 is now full: named as tokens 4..7 after tokens 0..3
    assert cache.match_prefix(cache.add_sequence(), np.arange(9)) == 8


def test_a_truncate_into_a_shared_named_block_unnames_it():
    """A truncate ends mid-block in a block another sequence still holds:
    once that one lets go, the truncated sequence writes into it in place,
    so the block must no longer be matched by its old name."""
    cache = fastattn.PagedKVCache(16, BS, H, E, enable_prefix_caching=True)
    tokens = list(range(100, 109))
    a, _ = prefill(cache, tokens)
    b = cache.add_sequence()
    assert cache.match_prefix(b, np.array(tokens)) == 8
    cache.truncate([b], [2])  # into block 0, which a holds too
    cache.free(a)
    cache.append([b], *prompt_kv([900, 901]), np.array([0, 2]), token_ids=np.array([900, 901]))
    c, n = prefill(cache, tokens)
    plain = fastattn.PagedKVCache(8, BS, H, E)
    r = plain.add_sequence()
    plain.append([r], *prompt_kv(tokens), np.array([0, len(tokens)]))
    q = np.ones((1, 2 * H, E), np.float32)
    np.testing.assert_array_equal(cache.attend([c], q), plain.attend([r], q))


def test_token_ids_are_int64_and_checked_before_writing():
    cache = fastattn.PagedKVCache(8, 2, H, E, enable_prefix_caching=True)
    s, t = cache.add_sequence(), cache.add_sequence()
    k, v = prompt_kv([1, 2, 3, 4])
    with pytest.raises(ValueError, match="int64"):
        cache.append([s, t], k, v, np.array([0, 2, 4]),
                     token_ids=np.array([2**63, 5, 6, 7], np.uint64))
    assert cache.seq_lens == {s: 0, t: 0} and cache.num_free_blocks == 8
    cache.append([s, t], k, v, np.array([0, 2, 4]), token_ids=[1, 2, 3, 4])  # a list will do
    assert cache.match_prefix(cache.add_sequence(), [1, 2, 9]) == 2


def test_a_freed_chain_is_evicted_from_its_tail():
    cache = fastattn.PagedKVCache(3, 2, H, E, enable_prefix_caching=True)
    a, _ = prefill(cache, [1, 2, 3, 4, 5, 6])
    cache.free(a)  # three named blocks idle
    cache.append([cache.add_sequence()], *prompt_kv([7, 8]), np.array([0, 2]))
    # the tail went: the first two blocks still match
    assert cache.match_prefix(cache.add_sequence(), np.array([1, 2, 3, 4, 5, 6])) == 4
