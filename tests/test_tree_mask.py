"""Tree masks of speculative decoding (paged_attention, PagedKVCache.attend,
KVCache.attend) and PagedKVCache.accept_draft: each sequence's output is
bitwise that of scaled_dot_product_attention with the same mask over all
its keys, within the suite's bound of the float64 reference, and the
accepted path's rows are those an append of it alone writes."""
import numpy as np
import pytest
from conftest import assert_close, f64
from test_paged import Pool, bad_call, packed, per_sequence, ragged

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention


def rotary_tables(n, D):
    """RoPE's cos and sin tables (n positions, D / 2 frequencies)."""
    angles = np.arange(n)[:, None] * 10000.0 ** (-np.arange(D // 2) / (D // 2))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def random_tree(rng, n):
    """A tree of n draft tokens in topological order (each parent earlier)
    as its (n, n) mask: True where token i may see token t (its ancestors
    and itself), and each token's depth."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    mask, depth = np.zeros((n, n), bool), np.zeros(n, np.int64)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            depth[i] += j != i
            j = parent[j]
    return mask, depth


def full_mask(tree, S):
    """The (L, S) mask of all S keys that the (L, L) tree stands for."""
    L = tree.shape[0]
    m = np.ones((L, S), bool)
    m[:, S - L:] = tree
    return m


# prefill-sized trees (block kernel), decoding-sized ones (row kernel), one
# over a split (S >= 2048), a plain token and a sequence with no query
Q_LENS = [8, 3, 12, 1, 4, 0]
K_LENS = [90, 40, 12, 9, 2200, 5]


@pytest.mark.parametrize("block_size", [1, 16, 128])
@pytest.mark.parametrize("options", [{}, {"softcap": 5.0}, {"sinks": "per head"}],
                         ids=["plain", "softcap", "sinks"])
def test_each_sequence_is_sdpa_with_its_mask_bit_for_bit(simd, block_size, options):
    rng = np.random.default_rng(block_size)
    queries, keys, values = ragged(rng, Q_LENS, K_LENS)
    pool = Pool(rng, keys, values, block_size)
    query, cu = packed(queries)
    Hq = query.shape[1]
    options = {k: (rng.uniform(0.1, 1, Hq) if v == "per head" else v) for k, v in options.items()}
    trees = [random_tree(rng, L)[0] for L in Q_LENS]
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, return_lse=True,
                                        tree_mask=np.concatenate([t.ravel() for t in trees]),
                                        **options)
    want_all = ref.paged_attention(*f64(query, pool.key_cache, pool.value_cache), pool.table,
                                   pool.seq_lens, cu,
                                   tree_mask=np.concatenate([t.ravel() for t in trees]),
                                   **{k: (f64(v)[0] if isinstance(v, np.ndarray) else v)
                                      for k, v in options.items()})
    assert_close(out, want_all, np.float32, 16 + max(K_LENS))
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        if q.shape[1] == 0:
            continue
        want, want_lse = sdpa(q, k, v, attn_mask=full_mask(trees[b], k.shape[1]),
                              is_causal=True, causal_alignment="lower_right", enable_gqa=True,
                              return_lse=True, **options)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], want_lse)


def test_indptr_gives_sequences_without_a_tree(simd):
    """A prefill chunk and a decoding token beside a tree, in one call: the
    plain sequences get their plain bits, and the tree its own."""
    rng = np.random.default_rng(3)
    q_lens, k_lens = [70, 1, 6], [90, 2100, 30]
    queries, keys, values = ragged(rng, q_lens, k_lens, dtype=np.float64)
    pool = Pool(rng, keys, values, 16, dtype=np.float64)
    query, cu = packed(queries)
    tree = random_tree(rng, 6)[0]
    out = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                   pool.seq_lens, cu, tree_mask=tree.ravel(),
                                   tree_mask_indptr=np.array([0, 0, 0, 36]))
    plain = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                     pool.seq_lens, cu)
    np.testing.assert_array_equal(out[:71], plain[:71])
    want = sdpa(queries[2], keys[2], values[2], attn_mask=full_mask(tree, 30), is_causal=True,
                causal_alignment="lower_right", enable_gqa=True)
    np.testing.assert_array_equal(per_sequence(out, cu, 2), want)
    assert not np.array_equal(out[71:], plain[71:])


@pytest.mark.parametrize("L", [3, 8])
def test_hidden_branches_values_never_leak(simd, L):
    """A NaN value and an inf key in a sibling branch: the tokens that do
    not see it stay finite (the row kernel for L <= 4, the block kernel
    above), with sdpa's bits under the same mask, and the values of the
    call without the bad rows (the block kernel computes rows that met a
    NaN again by the row kernel: their last bits may differ)."""
    rng = np.random.default_rng(L)
    S = 50
    queries, keys, values = ragged(rng, [L], [S])
    tree = np.tril(np.ones((L, L), bool))
    tree[2:, 1] = False  # token 1 is a leaf: only it sees itself
    bad_k, bad_v = keys[0].copy(), values[0].copy()
    bad_v[:, S - L + 1] = np.nan
    bad_k[:, S - L + 1] = np.inf
    query, cu = packed(queries)
    outs = []
    for k, v in ((keys[0], values[0]), (bad_k, bad_v)):
        pool = Pool(np.random.default_rng(0), [k], [v], 16)
        outs.append(fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                             pool.seq_lens, cu, tree_mask=tree.ravel()))
    others = [0] + list(range(2, L))
    np.testing.assert_allclose(outs[1][others], outs[0][others], rtol=1e-5, atol=1e-6)
    assert np.isnan(outs[1][1]).all()
    want = sdpa(queries[0], bad_k, bad_v, attn_mask=full_mask(tree, S), is_causal=True,
                causal_alignment="lower_right", enable_gqa=True)
    np.testing.assert_array_equal(per_sequence(outs[1], cu, 0), want)


def test_a_row_that_sees_nothing_gives_zeros():
    """S = L and a tree row hiding every token, itself included."""
    rng = np.random.default_rng(1)
    queries, keys, values = ragged(rng, [5], [5])
    tree = np.tril(np.ones((5, 5), bool))
    tree[3] = False
    pool = Pool(rng, keys, values, 4)
    query, cu = packed(queries)
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, tree_mask=tree.ravel(),
                                        return_lse=True)
    assert (out[3] == 0).all() and np.isneginf(lse[:, 3]).all()
    assert np.isfinite(out).all()


def test_threads_and_other_sequences_change_no_bit():
    rng = np.random.default_rng(7)
    queries, keys, values = ragged(rng, [8, 8, 2], [300, 2300, 20])
    trees = [random_tree(rng, L)[0] for L in (8, 8, 2)]
    pool = Pool(rng, keys, values, 32)
    query, cu = packed(queries)
    flat = np.concatenate([t.ravel() for t in trees])
    base = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                    pool.seq_lens, cu, tree_mask=flat, num_threads=1)
    for threads in (2, 3):
        again = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                         pool.seq_lens, cu, tree_mask=flat, num_threads=threads)
        np.testing.assert_array_equal(again, base)
    alone = fastattn.paged_attention(query[8:16], pool.key_cache, pool.value_cache,
                                     pool.table[1:2], pool.seq_lens[1:2], np.array([0, 8]),
                                     tree_mask=trees[1].ravel())
    np.testing.assert_array_equal(alone, base[8:16])


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8", "int4"])
def test_caches_agree_with_kvcache_and_its_mask(storage):
    """PagedKVCache.attend and KVCache.attend with the tree give the bits of
    KVCache.attend with the mask of all positions, whatever the storage."""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    Hkv, Hq, D, S, L = 2, 4, 32, 70, 8
    k = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((S, Hkv, D)).astype(np.float32)
    q = rng.standard_normal((L, Hq, D)).astype(np.float32)
    tree = random_tree(rng, L)[0]
    paged = fastattn.PagedKVCache(12, 8, Hkv, D, storage=storage)
    seq = paged.add_sequence()
    paged.append([seq], k, v, np.array([0, S]))
    got = paged.attend([seq], q, np.array([0, L]), tree_mask=tree.ravel())
    dense = fastattn.KVCache(1, Hkv, S, D, storage=storage)
    dense.append(k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])
    qd = q.transpose(1, 0, 2)[None]
    want = dense.attend(qd, attn_mask=full_mask(tree, S))
    np.testing.assert_array_equal(got.transpose(1, 0, 2)[None], want)
    np.testing.assert_array_equal(dense.attend(qd, tree_mask=tree), want)
    np.testing.assert_array_equal(dense.attend(qd, tree_mask=tree[None]), want)


def tree_call(**change):
    """test_paged's bad call (3 and 1 queries over 20 and 9 keys) with a
    tree mask of 3 x 3 + 1 x 1 entries."""
    return bad_call(**{"tree_mask": np.ones(10, bool), **change})


@pytest.mark.parametrize("change, error, words", [
    ({"tree_mask": np.ones(10, np.uint8)}, TypeError, "tree_mask has dtype uint8"),
    ({"tree_mask": [True] * 10}, TypeError, "tree_mask must be a numpy.ndarray"),
    ({"tree_mask": np.ones((10, 1), bool)}, ValueError, "tree_mask has shape (10, 1)"),
    ({"tree_mask": np.ones(9, bool)}, ValueError, "sum L_b**2 = 10"),
    ({"tree_mask_indptr": np.array([0, 9, 9])}, ValueError, "end at the total length 10"),
    ({"tree_mask_indptr": np.array([0, 8, 10])}, ValueError, "sequence 0 has 3 queries"),
    ({"tree_mask_indptr": np.array([0, 10])}, ValueError, "holds 2 values"),
    ({"tree_mask_indptr": np.array([0, 9, 10.0])}, TypeError, "tree_mask_indptr has dtype"),
    ({"tree_mask": None, "tree_mask_indptr": np.array([0, 9, 10])}, ValueError,
     "tree_mask_indptr was given without tree_mask"),
    ({"seq_lens": np.array([20, 0], np.int32), "is_causal": False}, ValueError,
     "sequence 1 has a tree of 1 tokens but holds 0 keys"),
])
def test_bad_input_is_a_clear_error(change, error, words):
    with pytest.raises(error) as info:
        tree_call(**change)
    assert words in str(info.value)


def test_indptr_may_leave_a_sequence_plain():
    tree_call(tree_mask=np.ones(9, bool), tree_mask_indptr=np.array([0, 9, 9]))
    tree_call(tree_mask=np.ones(1, bool), tree_mask_indptr=np.array([0, 0, 1]))


def test_kvcache_tree_mask_errors():
    cache = fastattn.KVCache(2, 1, 8, 4)
    cache.append(np.zeros((2, 1, 3, 4), np.float32), np.zeros((2, 1, 3, 4), np.float32))
    q = np.zeros((2, 1, 3, 4), np.float32)
    with pytest.raises(TypeError, match="tree_mask has dtype int64"):
        cache.attend(q, tree_mask=np.ones((3, 3), np.int64))
    with pytest.raises(ValueError, match=r"expected \(L, L\) or \(batch_size, L, L\)"):
        cache.attend(q, tree_mask=np.ones((3, 4), bool))
    with pytest.raises(ValueError, match="holds 3"):
        cache.attend(np.zeros((2, 1, 4, 4), np.float32), is_causal=False,
                     tree_mask=np.ones((4, 4), bool))


# ---- accept_draft -----------------------------------------------------------

def stored_rows(cache, seq):
    """The rows a sequence holds, as stored: keys, values and their scales."""
    n, bs = cache.seq_lens[seq], cache.block_size
    j = np.arange(n)
    blocks = cache.block_table([seq])[0][j // bs]
    parts = [cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale]
    return [None if p is None else p[blocks, :, j % bs].copy() for p in parts]


def assert_same_rows(a, b):
    for x, y in zip(a, b):
        if x is None:
            assert y is None
        else:
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("storage", ["float32", "int8", "int4"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_accepted_path_is_an_append_of_it_alone(storage, block_size):
    """A prompt, a tree of 9 drafts appended at their depths' rotary
    positions, one verify step, the path kept: the rows held are the bits of
    the prompt and the path appended alone, and a decoding step after it
    gives the bits of that cache's."""
    rng = np.random.default_rng(block_size)
    Hkv, Hq, D, P, n = 2, 4, 32, 13, 9
    cos, sin = rotary_tables(64, D)
    tree, depth = random_tree(rng, n)
    leaf = int(np.argmax(depth))
    path = list(np.flatnonzero(tree[leaf]))  # the root ... leaf, increasing
    k = rng.standard_normal((P + n, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((P + n, Hkv, D)).astype(np.float32)
    pos = np.concatenate([np.arange(P), P + depth])
    caches = [fastattn.PagedKVCache(40, block_size, Hkv, D, storage=storage) for _ in range(2)]
    spec, plain = (c.add_sequence() for c in caches)
    spec_cache, plain_cache = caches
    spec_cache.append([spec], k[:P], v[:P], np.array([0, P]), rotary=(cos, sin))
    spec_cache.append([spec], k[P:], v[P:], np.array([0, n]), rotary=(cos, sin),
                      positions=pos[P:])
    q = rng.standard_normal((n, Hq, D)).astype(np.float32)
    out = spec_cache.attend([spec], q, np.array([0, n]), rotary=(cos, sin), positions=pos[P:],
                            tree_mask=tree.ravel())
    keep = np.concatenate([np.arange(P), P + np.array(path)])
    plain_cache.append([plain], k[keep], v[keep], np.array([0, len(keep)]), rotary=(cos, sin))
    # the verify step: the leaf's row is the path's last query alone (another
    # count of query rows: the kernels' route, and last bits, may differ)
    want = plain_cache.attend([plain], q[path], np.array([0, len(path)]), rotary=(cos, sin))
    np.testing.assert_allclose(out[leaf], want[-1], rtol=1e-5, atol=1e-6)
    free = spec_cache.num_free_blocks
    spec_cache.accept_draft([spec], [n], [path])
    assert spec_cache.seq_lens == plain_cache.seq_lens
    assert_same_rows(stored_rows(spec_cache, spec), stored_rows(plain_cache, plain))
    assert spec_cache.num_free_blocks == free + (-(-(P + n) // block_size)
                                                 - -(-len(keep) // block_size))
    q1 = rng.standard_normal((1, Hq, D)).astype(np.float32)
    for c, s in ((spec_cache, spec), (plain_cache, plain)):
        c.append([s], k[:1], v[:1], rotary=(cos, sin))
    np.testing.assert_array_equal(spec_cache.attend([spec], q1, rotary=(cos, sin)),
                                  plain_cache.attend([plain], q1, rotary=(cos, sin)))


def test_accept_copies_shared_blocks_and_forks_keep_theirs():
    rng = np.random.default_rng(2)
    cache = fastattn.PagedKVCache(20, 4, 1, 8)
    s = cache.add_sequence()
    k = rng.standard_normal((10, 1, 8)).astype(np.float32)
    cache.append([s], k, k, np.array([0, 10]))
    child = cache.fork(s)  # shares every block, the drafts' too
    before = stored_rows(cache, child)
    free = cache.num_free_blocks
    cache.accept_draft([s], [6], [[0, 2, 5]])
    assert_same_rows(stored_rows(cache, child), before)
    rows = stored_rows(cache, s)
    np.testing.assert_array_equal(rows[0][:, 0], k[[0, 1, 2, 3, 4, 6, 9], 0])
    # blocks 1 (slots 4-7) was written: a copy taken; the parent's block 2 given up
    assert cache.num_free_blocks == free - 1


def test_accept_keeps_the_prefix_cache_right():
    """Blocks that accept_draft rewrote lose their old names and are named
    by the tokens they now hold: a later match shares the path's bits."""
    rng = np.random.default_rng(4)
    bs = 4
    cache = fastattn.PagedKVCache(30, bs, 1, 8, enable_prefix_caching=True)
    s = cache.add_sequence()
    ids = np.arange(100, 112)
    k = rng.standard_normal((12, 1, 8)).astype(np.float32)
    cache.append([s], k[:4], k[:4], np.array([0, 4]), token_ids=ids[:4])
    cache.append([s], k[4:], k[4:], np.array([0, 8]), token_ids=ids[4:])
    cache.accept_draft([s], [8], [[0, 1, 3, 4, 6]])
    kept = [0, 1, 2, 3, 4, 5, 7, 8, 10]
    other = cache.add_sequence()
    assert cache.match_prefix(other, np.append(ids[kept], 999)) == 8
    np.testing.assert_array_equal(stored_rows(cache, other)[0], k[kept[:8]])
    third = cache.add_sequence()  # the tokens first appended no longer match past block 0
    assert cache.match_prefix(third, ids) == 4


@pytest.mark.parametrize("args, error, words", [
    (([0], [20], [[0]]), ValueError, "sequence 0 holds 10 positions"),
    (([0], [5], [[1, 1]]), ValueError, "increasing indices below"),
    (([0], [5], [[0, 5]]), ValueError, "increasing indices below"),
    (([0], [5, 1], [[0]]), ValueError, "one per sequence"),
    (([0], [5], [0]), TypeError, "accepted[0] must be a list of indices, got int"),
    (([0], 5, [[0]]), TypeError, "num_draft_tokens must be a list of ints, got int"),
    (([0], [5], None), TypeError, "accepted must be a list"),
    (([0], [-1], [[]]), ValueError, "num_draft_tokens[0]"),
    (([7], [1], [[]]), ValueError, "is not a live sequence"),
])
def test_accept_bad_input_changes_nothing(args, error, words):
    cache = fastattn.PagedKVCache(8, 4, 1, 8)
    s = cache.add_sequence()
    k = np.arange(80, dtype=np.float32).reshape(10, 1, 8)
    cache.append([s], k, k, np.array([0, 10]))
    before = stored_rows(cache, s)
    with pytest.raises(error) as info:
        cache.accept_draft(*args)
    assert words in str(info.value)
    assert cache.seq_lens == {s: 10}
    assert_same_rows(stored_rows(cache, s), before)


def test_positions_need_rotary():
    cache = fastattn.PagedKVCache(8, 4, 1, 8)
    s = cache.add_sequence()
    k = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(ValueError, match="pass rotary too"):
        cache.append([s], k, k, np.array([0, 2]), positions=np.array([0, 1]))
    cos, sin = rotary_tables(8, 8)
    with pytest.raises(ValueError, match="one per token"):
        cache.append([s], k, k, np.array([0, 2]), rotary=(cos, sin), positions=np.array([0]))
    with pytest.raises(ValueError, match="positions holds -1"):
        cache.append([s], k, k, np.array([0, 2]), rotary=(cos, sin),
                     positions=np.array([0, -1]))
    with pytest.raises(TypeError, match="draft"):
        cache.append([s], k, k, np.array([0, 2]), draft="yes")
    assert cache.seq_lens == {s: 0}


def test_trees_refuse_windows_and_alibi():
    """A draft sits at its slot, not its depth: a window or ALiBi would
    count slots, so a tree refuses them (a fresh tester's finding: a path's
    bias differed from decoding it token by token)."""
    tree = np.ones(9, bool)
    for option in ({"window_size": (4, 0)}, {"alibi_slopes": np.ones(4)}):
        with pytest.raises(ValueError, match="does not go with window_size or alibi_slopes"):
            tree_call(tree_mask=tree, tree_mask_indptr=np.array([0, 9, 9]), **option)
    cache = fastattn.KVCache(1, 1, 8, 4)
    cache.append(np.ones((1, 1, 5, 4), np.float32), np.ones((1, 1, 5, 4), np.float32))
    with pytest.raises(ValueError, match="does not go with window_size"):
        cache.attend(np.ones((1, 1, 2, 4), np.float32), tree_mask=np.eye(2, dtype=bool),
                     window_size=(1, 0))


def test_sequences_with_more_queries_than_keys_beside_a_tree():
    """is_causal=False lets a sequence have more queries than keys; with a
    tree_mask in the call (its own range empty) it used to reach the kernel
    with a negative mask offset (a fresh tester's finding)."""
    q = np.ones((2, 1, 8), np.float32)
    kc = np.ones((1, 1, 4, 8), np.float32)
    args = (q, kc, kc, np.zeros((1, 1), np.int32), np.array([1]), np.array([0, 2]))
    want = fastattn.paged_attention(*args, is_causal=False)
    got = fastattn.paged_attention(*args, is_causal=False, tree_mask=np.zeros(0, bool),
                                   tree_mask_indptr=np.array([0, 0]))
    np.testing.assert_array_equal(got, want)


def test_kvcache_tree_of_no_query():
    cache = fastattn.KVCache(1, 1, 8, 4)
    cache.append(np.ones((1, 1, 3, 4), np.float32), np.ones((1, 1, 3, 4), np.float32))
    out = cache.attend(np.ones((1, 1, 0, 4), np.float32), tree_mask=np.zeros((0, 0), bool))
    assert out.shape == (1, 1, 0, 4)
    buf = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="out overlaps tree_mask"):
        cache.attend(np.ones((1, 1, 2, 4), np.float32), tree_mask=buf.view(bool)[:4].reshape(2, 2),
                     out=buf.reshape(1, 1, 2, 4))


def test_rejected_draft_blocks_keep_no_name():
    """A block of drafts the tree rejects goes back unnamed: its rows sit at
    their depths, not as the tokens in order (a fresh tester's finding: a
    later match served them)."""
    def rows(t, p):
        t, p = np.asarray(t, float)[:, None, None], np.asarray(p, float)[:, None, None]
        return np.sin(0.37 * t + 0.11 * p + 0.05 * np.arange(8)).astype(np.float32)

    for draft in (False, True):
        c = fastattn.PagedKVCache(8, 4, 1, 8, enable_prefix_caching=True)
        s = c.add_sequence()
        k = rows([1, 2, 3, 4], range(4))
        c.append([s], k, k, np.array([0, 4]), token_ids=np.array([1, 2, 3, 4]))
        k = rows([5, 6, 7, 8], 4 + np.array([0, 1, 1, 2]))  # 5 -> {6, 7}, 6 -> 8
        c.append([s], k, k, np.array([0, 4]), token_ids=np.array([5, 6, 7, 8]), draft=draft)
        if draft:  # not named before the verification either
            probe = c.add_sequence()
            assert c.match_prefix(probe, np.arange(1, 10)) == 4
            c.free(probe)
        c.accept_draft([s], [4], [[]])
        t = c.add_sequence()
        assert c.match_prefix(t, np.arange(1, 10)) == 4


def test_accept_counts_the_blocks_dropped_drafts_give_back():
    """A path that writes into a block shared with a fork, in a full pool:
    the block the rejected drafts free pays for the copy."""
    c = fastattn.PagedKVCache(3, 4, 1, 8)
    s = c.add_sequence()
    x = np.arange(96, dtype=np.float32).reshape(12, 1, 8)
    c.append([s], x[:8], x[:8], np.array([0, 8]))
    f = c.fork(s)
    before = stored_rows(c, f)
    c.append([s], x[8:], x[8:], np.array([0, 4]))  # the pool is now full
    c.accept_draft([s], [8], [[0, 2]])
    assert c.seq_lens[s] == 6
    np.testing.assert_array_equal(stored_rows(c, s)[0][:, 0], x[[0, 1, 2, 3, 4, 6], 0])
    assert_same_rows(stored_rows(c, f), before)


@pytest.mark.parametrize("alignment", ["lower_right", "upper_left"])
@pytest.mark.parametrize("is_causal", [True, False])
def test_varlen_trees_are_sdpa_with_their_masks(simd, alignment, is_causal):
    """varlen_attention's tree_mask over packed sequences: the same bits as
    paged_attention's, whatever the causal alignment (a tree covers each
    sequence's last L keys)."""
    rng = np.random.default_rng(17)
    queries, keys, values = ragged(rng, Q_LENS, K_LENS)
    query, cu = packed(queries)
    key = np.concatenate([k.transpose(1, 0, 2) for k in keys])
    value = np.concatenate([v.transpose(1, 0, 2) for v in values])
    cu_k = np.concatenate([[0], np.cumsum(K_LENS)]).astype(np.int32)
    trees = [random_tree(rng, L)[0] for L in Q_LENS]
    indptr = np.concatenate([[0], np.cumsum([0 if b == 1 else t.size
                                             for b, t in enumerate(trees)])])
    flat = np.concatenate([t.ravel() for b, t in enumerate(trees) if b != 1])
    out, lse = fastattn.varlen_attention(query, key, value, cu, cu_k, is_causal=is_causal,
                                         causal_alignment=alignment, return_lse=True,
                                         tree_mask=flat, tree_mask_indptr=indptr)
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        if q.shape[1] == 0:
            continue
        mask = full_mask(trees[b], k.shape[1]) if b != 1 else None  # sequence 1: no tree
        want, want_lse = sdpa(q, k, v, attn_mask=mask, is_causal=is_causal,
                              causal_alignment=alignment, enable_gqa=True, return_lse=True)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], want_lse)


def test_varlen_tree_errors():
    q = np.zeros((3, 2, 8), np.float32)
    k = np.zeros((5, 2, 8), np.float32)
    cu_q, cu_k = np.array([0, 3]), np.array([0, 5])
    with pytest.raises(ValueError, match="3 x 3 = 9 entries"):
        fastattn.varlen_attention(q, k, k, cu_q, cu_k, tree_mask=np.ones(4, bool),
                                  tree_mask_indptr=np.array([0, 4]))
    with pytest.raises(ValueError, match="window_size"):
        fastattn.varlen_attention(q, k, k, cu_q, cu_k, tree_mask=np.ones(9, bool),
                                  window_size=(2, 0))
    with pytest.raises(TypeError, match="tree_mask has dtype"):
        fastattn.varlen_attention(q, k, k, cu_q, cu_k, tree_mask=np.ones(9, np.int8))
