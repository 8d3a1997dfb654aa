"""PagedKVCache: a stream of sequences joining, growing, forking and leaving
gives each one the bits of a KVCache of its own, in every storage; blocks
come back to the pool; a failed append writes nothing."""
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import fastattn
from fastattn import reference as ref

Hq, Hkv, D, Dv = 4, 2, 16, 12


class Twin:
    """A sequence as a KVCache of its own, fed the same rows."""

    def __init__(self, storage, keys=None, values=None, capacity=600):
        self.cache = fastattn.KVCache(1, Hkv, capacity, D, value_dim=Dv, storage=storage)
        self.keys, self.values = [], []
        if keys is not None:
            for k, v in zip(keys, values):
                self.append(k, v)

    def append(self, k, v):  # (n, Hkv, D)
        self.keys.append(k)
        self.values.append(v)
        self.cache.append(k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None])

    def attend(self, q, **options):  # (L, Hq, D)
        return self.cache.attend(q.transpose(1, 0, 2)[None], **options)[0].transpose(1, 0, 2)


def step(rng, cache, twins, chunks, **options):
    """Append chunks[s] new tokens to each sequence s, then attend with as
    many queries; each sequence's output must be its twin's, bit for bit."""
    ids = list(chunks)
    counts = [chunks[s] for s in ids]
    cu = np.concatenate([[0], np.cumsum(counts)])
    k = rng.standard_normal((cu[-1], Hkv, D)).astype(np.float32)
    v = rng.standard_normal((cu[-1], Hkv, Dv)).astype(np.float32)
    q = rng.standard_normal((cu[-1], Hq, D)).astype(np.float32)
    cache.append(ids, k, v, cu)
    out = cache.attend(ids, q, cu, **options)
    for b, s in enumerate(ids):
        twins[s].append(k[cu[b]:cu[b + 1]], v[cu[b]:cu[b + 1]])
        want = twins[s].attend(q[cu[b]:cu[b + 1]], **options)
        np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], want)
    return out


@pytest.mark.parametrize("storage", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("block_size", [1, 16, 24])
def test_a_stream_of_requests(storage, block_size):
    """Requests join with prompts (chunked), decode a token a step, fork,
    and leave; every step's output is each sequence's own KVCache's."""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(block_size)
    cache = fastattn.PagedKVCache(400, block_size, Hkv, D, value_dim=Dv, storage=storage)
    twins = {}
    for prompt in (37, 5, 64):
        s = cache.add_sequence()
        twins[s] = Twin(storage)
        step(rng, cache, twins, {s: prompt})
    for t in range(12):
        if t == 3:  # a new request's first chunk beside the decoding ones
            s = cache.add_sequence()
            twins[s] = Twin(storage)
            step(rng, cache, twins, {**{x: 1 for x in twins if x != s}, s: 20})
            continue
        if t == 5:  # sample twice from sequence 0
            child = cache.fork(0)
            twins[child] = Twin(storage, twins[0].keys, twins[0].values)
        if t == 8:  # sequence 1 finished
            cache.free(1)
            del twins[1]
        step(rng, cache, twins, {s: 1 + (t % 3 == 0) for s in twins})
    held = sum(-(-n // block_size) for n in cache.seq_lens.values())
    assert cache.num_free_blocks >= 400 - held  # shared blocks counted once


def test_a_decoding_sequence_beyond_the_split_and_options():
    """A long sequence (its keys split like scaled_dot_product_attention's)
    beside short ones, with every variant option."""
    rng = np.random.default_rng(2)
    cache = fastattn.PagedKVCache(200, 16, Hkv, D, value_dim=Dv)
    twins = {}
    for prompt in (2100, 3, 1):
        s = cache.add_sequence()
        twins[s] = Twin("float32", capacity=2200)
        step(rng, cache, twins, {s: prompt})
    options = dict(window_size=(700, 0), softcap=4.0, alibi_slopes=rng.random(Hq),
                   sinks=rng.standard_normal(Hq), scale=0.2)
    for _ in range(3):
        step(rng, cache, twins, {0: 1, 1: 2, 2: 1}, **options)


def test_fork_copies_the_shared_block_on_write():
    rng = np.random.default_rng(3)
    cache = fastattn.PagedKVCache(10, 4, Hkv, D, value_dim=Dv)
    parent = cache.add_sequence()
    twins = {parent: Twin("float32")}
    step(rng, cache, twins, {parent: 6})  # blocks: 4 + 2 of 4
    free = cache.num_free_blocks
    child = cache.fork(parent)
    assert cache.num_free_blocks == free  # nothing copied yet
    np.testing.assert_array_equal(cache.block_table([child]), cache.block_table([parent]))
    before = cache.key_cache.copy(), cache.value_cache.copy()
    twins[child] = Twin("float32", twins[parent].keys, twins[parent].values)
    step(rng, cache, twins, {child: 3})  # the shared partial block is copied first
    assert cache.num_free_blocks == free - 2
    parent_blocks = cache.block_table([parent])[0]
    child_blocks = cache.block_table([child])[0]
    assert child_blocks[0] == parent_blocks[0] and child_blocks[1] != parent_blocks[1]
    for a, b in zip((cache.key_cache, cache.value_cache), before):
        np.testing.assert_array_equal(a[parent_blocks], b[parent_blocks])  # parent unchanged
    q = rng.standard_normal((1, Hq, D)).astype(np.float32)
    np.testing.assert_array_equal(cache.attend([parent], q), twins[parent].attend(q))
    step(rng, cache, twins, {parent: 1, child: 1})
    cache.free(parent)
    assert cache.num_free_blocks == free - 2 + 1  # the shared full block stays with the child
    cache.free(child)
    assert cache.num_free_blocks == 10


def test_free_then_reuse():
    """Freed blocks go back at once and serve a new sequence, whose result
    is its own (the stale rows of a reused block are never read)."""
    rng = np.random.default_rng(4)
    cache = fastattn.PagedKVCache(6, 8, Hkv, D, value_dim=Dv)
    twins = {}
    a = cache.add_sequence()
    twins[a] = Twin("float32")
    step(rng, cache, twins, {a: 45})
    assert cache.num_free_blocks == 0
    cache.free(a)
    del twins[a]
    assert cache.num_free_blocks == 6 and cache.seq_ids == []
    b = cache.add_sequence()
    twins[b] = Twin("float32")
    step(rng, cache, twins, {b: 3})  # in a block whose rows 3.. hold a's keys
    step(rng, cache, twins, {b: 1})
    with pytest.raises(ValueError, match="is not a live sequence"):
        cache.attend([a], np.zeros((1, Hq, D), np.float32))


def test_out_of_blocks_writes_nothing():
    rng = np.random.default_rng(5)
    cache = fastattn.PagedKVCache(4, 4, Hkv, D, value_dim=Dv, storage="int8")
    a, b = cache.add_sequence(), cache.add_sequence()
    cache.append([a], rng.standard_normal((10, Hkv, D)).astype(np.float32),
                 rng.standard_normal((10, Hkv, Dv)).astype(np.float32), np.array([0, 10]))
    state = (cache.seq_lens, cache.num_free_blocks, cache.block_table([a, b]),
             cache.key_cache.copy(), cache.value_cache.copy(), cache.k_scale.copy())
    assert cache.blocks_needed([a, b], [3, 5]) == 3
    with pytest.raises(fastattn.OutOfBlocksError, match="needs 3 free blocks .* has 1"):
        cache.append([a, b], rng.standard_normal((8, Hkv, D)).astype(np.float32),
                     rng.standard_normal((8, Hkv, Dv)).astype(np.float32), np.array([0, 3, 8]))
    after = (cache.seq_lens, cache.num_free_blocks, cache.block_table([a, b]),
             cache.key_cache, cache.value_cache, cache.k_scale)
    assert after[:2] == state[:2]
    for x, y in zip(after[2:], state[2:]):
        np.testing.assert_array_equal(x, y)
    assert isinstance(fastattn.OutOfBlocksError("x"), MemoryError)


def test_a_failed_attend_takes_the_append_back():
    """MultiHeadAttention's step appends then attends; an attend that fails
    (here a bad option) leaves the sequences as before the step."""
    rng = np.random.default_rng(6)
    mha = fastattn.MultiHeadAttention(32, 4, num_kv_heads=2, rng=rng)
    cache = mha.new_paged_cache(8, 4)
    s = cache.add_sequence()
    mha(rng.standard_normal((1, 6, 32)).astype(np.float32), cache=cache, seq_ids=[s])
    before = cache.seq_lens, cache.num_free_blocks
    with pytest.raises(ValueError, match="softcap"):
        mha(rng.standard_normal((1, 3, 32)).astype(np.float32), cache=cache, seq_ids=[s],
            softcap=-1.0)
    assert (cache.seq_lens, cache.num_free_blocks) == before


def test_rotary_at_append_and_attend():
    """rotary= rotates each key at its position in its sequence as it is
    written, and each query at its own: what rotating them beforehand gives."""
    rng = np.random.default_rng(7)
    cos, sin = (f(np.arange(64)[:, None] * 0.1 * np.arange(1, D // 2 + 1)).astype(np.float32)
                for f in (np.cos, np.sin))
    plain = fastattn.PagedKVCache(20, 4, Hkv, D, value_dim=Dv)
    roped = fastattn.PagedKVCache(20, 4, Hkv, D, value_dim=Dv)
    ids = [plain.add_sequence(), plain.add_sequence()]
    assert [roped.add_sequence(), roped.add_sequence()] == ids
    held = [0, 0]
    for counts in ([5, 2], [1, 1], [3, 1]):
        cu = np.concatenate([[0], np.cumsum(counts)])
        k = rng.standard_normal((cu[-1], Hkv, D)).astype(np.float32)
        v = rng.standard_normal((cu[-1], Hkv, Dv)).astype(np.float32)
        q = rng.standard_normal((cu[-1], Hq, D)).astype(np.float32)
        pos = np.concatenate([held[b] + np.arange(c) for b, c in enumerate(counts)])
        plain.append(ids, fastattn.rotary(k, pos, cos, sin), v, cu)
        roped.append(ids, k, v, cu, rotary=(cos, sin))
        held = [h + c for h, c in zip(held, counts)]
        want = plain.attend(ids, fastattn.rotary(q, pos, cos, sin), cu)
        np.testing.assert_array_equal(roped.attend(ids, q, cu, rotary=(cos, sin)), want)


def test_mha_ragged_steps_match_a_cache_per_sequence():
    """MultiHeadAttention over a PagedKVCache, a prefill chunk and decoding
    tokens in one packed call, matches the same layer over one KVCache per
    sequence (the projections' BLAS may round another batch differently in
    the last bits, so to float32 rounding)."""
    rng = np.random.default_rng(8)
    mha = fastattn.MultiHeadAttention(32, 4, num_kv_heads=2, rng=rng)
    paged = mha.new_paged_cache(32, 8)
    dense = {}
    ids = []
    for prompt in (11, 4):
        s = paged.add_sequence()
        ids.append(s)
        dense[s] = mha.new_cache(1, 64)
        x = rng.standard_normal((1, prompt, 32)).astype(np.float32)
        y, _ = mha(x, cache=paged, seq_ids=[s])
        want, _ = mha(x, cache=dense[s])
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    late = paged.add_sequence()
    dense[late] = mha.new_cache(1, 64)
    for counts in ([1, 1, 9], [1, 1, 1]):
        cu = np.concatenate([[0], np.cumsum(counts)])
        x = rng.standard_normal((cu[-1], 32)).astype(np.float32)
        y, w = mha(x, cache=paged, seq_ids=ids + [late], cu_seqlens=cu)
        assert w is None and y.shape == (cu[-1], 32)
        for b, s in enumerate(ids + [late]):
            want, _ = mha(x[None, cu[b]:cu[b + 1]], cache=dense[s])
            np.testing.assert_allclose(y[cu[b]:cu[b + 1]], want[0], rtol=1e-5, atol=1e-6)


def test_against_the_reference():
    """The pool read through the block table (fastattn.reference's paged
    attention) within the suite's float32 bound."""
    rng = np.random.default_rng(9)
    cache = fastattn.PagedKVCache(40, 5, Hkv, D, value_dim=Dv)
    ids = [cache.add_sequence() for _ in range(3)]
    cu = np.array([0, 7, 8, 20])
    cache.append(ids, rng.standard_normal((20, Hkv, D)).astype(np.float32),
                 rng.standard_normal((20, Hkv, Dv)).astype(np.float32), cu)
    q = rng.standard_normal((20, Hq, D)).astype(np.float32)
    out = cache.attend(ids, q, cu)
    want = ref.paged_attention(q.astype(float), cache.key_cache.astype(float),
                               cache.value_cache.astype(float), cache.block_table(ids),
                               np.diff(cu), cu)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_views_are_read_only_and_sizes():
    cache = fastattn.PagedKVCache(3, 4, Hkv, D, value_dim=Dv, storage="int8")
    for a in (cache.key_cache, cache.value_cache, cache.k_scale, cache.v_scale):
        assert not a.flags.writeable
    assert cache.key_cache.shape == (3, Hkv, 4, D) and cache.key_cache.dtype == np.int8
    assert cache.nbytes == 3 * Hkv * 4 * (D + Dv) + 2 * 3 * Hkv * 4 * 4
    assert "free blocks=3" in repr(cache)


@pytest.mark.parametrize("call,error,words", [
    (lambda c: c.append([0, 0], *kv(2)), ValueError, "names a sequence twice"),
    (lambda c: c.append([7], *kv(1)), ValueError, "seq_ids[0] = 7 is not a live sequence"),
    (lambda c: c.append([0], *kv(2)), ValueError, "one token: expected 1 rows, got 2"),
    (lambda c: c.append([0], *kv(2), np.array([0, 1, 2])), ValueError, "one more than the 1"),
    (lambda c: c.append([0], *kv(1, np.float64)), TypeError, "holds float32"),
    (lambda c: c.append([0], *kv(1, np.float16)), TypeError, "storage='float16'"),
    (lambda c: c.append(0, *kv(1)), TypeError, "seq_ids must be a list"),
    (lambda c: c.append([0], kv(1)[0][:, :1], kv(1)[1]), ValueError, "(n, num_kv_heads, head_dim)"),
    (lambda c: c.append([0], *kv(1), rotary=np.zeros((4, 8))), TypeError, "pair (cos, sin)"),
    (lambda c: c.attend([0], np.zeros((1, Hq, D), np.float32)), ValueError,
     "sequence 0 has 1 query but holds 0 positions"),
    (lambda c: c.attend([0, 0], np.zeros((2, Hq, D), np.float32), is_causal=False), ValueError,
     "names a sequence twice"),
    (lambda c: c.attend([0], np.zeros((1, 3, D), np.float32)), ValueError,
     "query heads (3) must be a multiple of key/value heads (2)"),
    (lambda c: c.attend([0], np.zeros((1, Hq, D), np.float32), is_causal=False, dropout=0.1),
     TypeError, "unexpected keyword argument 'dropout'"),
    (lambda c: c.attend([0], np.zeros((1, Hq, D), np.float32), kv_cache_dtype="int4"),
     TypeError, "unexpected keyword argument 'kv_cache_dtype'"),
    (lambda c: c.fork(5), ValueError, "seq_id = 5 is not a live sequence"),
    (lambda c: c.fork(-1), ValueError, "seq_id must be >= 0, got -1"),
    (lambda c: c.append([0], np.zeros((Hkv, 1, D), np.float32), np.zeros((1, Hkv, Dv),
                                                                         np.float32)),
     ValueError, f"key has shape ({Hkv}, 1, {D}); expected (n, num_kv_heads, head_dim) = "
     f"(n, {Hkv}, {D}); if its axes are in another order, pass key.transpose(1, 0, 2)"),
    (lambda c: c.truncate([0], [1]), ValueError,
     "lengths[0] = 1; sequence 0 holds 0 positions: truncate keeps a prefix"),
    (lambda c: c.truncate([0], [0, 0]), ValueError, "lengths has 2 entries; expected one"),
    (lambda c: c.truncate([0, 0], [0, 0]), ValueError, "names a sequence twice"),
    (lambda c: c.truncate([3], [0]), ValueError, "seq_ids[0] = 3 is not a live sequence"),
    (lambda c: c.seq_lens_of([1]), ValueError, "seq_ids[0] = 1 is not a live sequence"),
    (lambda c: fastattn.PagedKVCache(0, 4, 1, 8), ValueError, "num_blocks must be >= 1"),
    (lambda c: fastattn.PagedKVCache(1, 4, 1, 8, storage="int2"), ValueError, "storage must be"),
])
def test_bad_input(call, error, words):
    cache = fastattn.PagedKVCache(4, 4, Hkv, D, value_dim=Dv)
    cache.add_sequence()
    with pytest.raises(error) as e:
        call(cache)
    assert words in str(e.value)


STORAGES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"]
OPTIONS = [{}, {"is_causal": False}, {"return_lse": True, "num_threads": 2},
           {"window_size": (5, 0), "softcap": 3.0, "alibi_slopes": np.linspace(0.1, 0.4, Hq),
            "sinks": np.linspace(-1, 1, Hq), "scale": 0.3}]


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("options", range(len(OPTIONS)))
def test_attend_is_paged_attention_on_its_own_arrays(storage, options):
    """attend skips paged_attention's checks of the pool, table, lengths
    and scales it keeps: the same call otherwise, bit for bit, float16
    queries and out= included."""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    options = OPTIONS[options]
    rng = np.random.default_rng(len(storage))
    cache = fastattn.PagedKVCache(40, 8, Hkv, 64, value_dim=40, storage=storage)
    ids = [cache.add_sequence() for _ in range(3)]
    counts = np.array([30, 1, 17])
    cu = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    cache.append(ids, rng.standard_normal((cu[-1], Hkv, 64)).astype(np.float32),
                 rng.standard_normal((cu[-1], Hkv, 40)).astype(np.float32), cu)
    qcu = np.array([0, 2, 3, 7], np.int32)
    lens = np.array([cache.seq_lens[s] for s in ids])
    for dtype in (np.float32, np.float16):
        q = rng.standard_normal((7, Hq, 64)).astype(dtype)
        got = cache.attend(ids, q, qcu, **options)
        want = fastattn.paged_attention(
            q, cache.key_cache, cache.value_cache, cache.block_table(ids), lens, qcu,
            k_scale=cache.k_scale, v_scale=cache.v_scale,
            kv_cache_dtype=storage if storage in ("float8_e4m3fn", "float8_e5m2", "int4")
            else "auto", value_dim=40 if storage == "int4" else None, **options)
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    out = np.full((7, Hq, 40), np.nan, np.float32)
    q = rng.standard_normal((7, Hq, 64)).astype(np.float32)
    res = cache.attend(ids, q, qcu, out=out, **options)
    np.testing.assert_array_equal(res[0] if isinstance(res, tuple) else res,
                                  cache.attend(ids, q, qcu, **options)[0]
                                  if isinstance(res, tuple) else cache.attend(ids, q, qcu, **options))
    assert (res[0] if isinstance(res, tuple) else res) is out


def test_attend_checks_what_paged_attention_checked():
    """attend leaves the cache's arrays unchecked, not the call: heads wider
    than the kernels take are a ValueError (not the kernel's internal
    error), and out may not be the query even when rotary rotates a copy."""
    wide = fastattn._core.ATTN_MAX_FEATURES + 1
    for E, Ev in ((wide, 4), (4, wide)):
        cache = fastattn.PagedKVCache(1, 1, 1, E, value_dim=Ev)
        s = cache.add_sequence()
        cache.append([s], np.ones((1, 1, E), np.float32), np.ones((1, 1, Ev), np.float32))
        with pytest.raises(ValueError, match=f"at most {wide - 1} features"):
            cache.attend([s], np.ones((1, 1, E), np.float32))
    cache = fastattn.PagedKVCache(4, 4, 1, 8)
    s = cache.add_sequence()
    cache.append([s], np.ones((2, 1, 8), np.float32), np.ones((2, 1, 8), np.float32),
                 np.array([0, 2], np.int32))
    q = np.ones((1, 1, 8), np.float32)
    rotary = (np.ones((8, 4), np.float32), np.zeros((8, 4), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        cache.attend([s], q, rotary=rotary, out=q)
    assert np.all(q == 1)


def kv(n, dtype=np.float32):
    return np.zeros((n, Hkv, D), dtype), np.zeros((n, Hkv, Dv), dtype)


NEVER_READ = r"""
import ctypes, mmap, sys
import numpy as np
import fastattn
fastattn.set_simd_path(sys.argv[1])
# rows of one page (Hkv = 1, head_dim 1024 float32), each block 2 rows: the
# freed blocks made unreadable (PROT_NONE) must not be touched by the
# sequences left
page = mmap.PAGESIZE
E = page // 4
cache = fastattn.PagedKVCache(12, 2, 1, E)
buf = mmap.mmap(-1, 2 * cache._key.nbytes + page)  # the pool moved to page-aligned memory
start = (-ctypes.addressof(ctypes.c_char.from_buffer(buf))) % page
pools = np.frombuffer(buf, np.float32, 2 * cache._key.size, start).reshape((2,) + cache._key.shape)
cache._key, cache._value = pools[0], pools[1]
rng = np.random.default_rng(0)
a, b, c = (cache.add_sequence() for _ in range(3))
rows = lambda n: rng.standard_normal((n, 1, E)).astype(np.float32)
cache.append([a, b, c], rows(14), rows(14), np.array([0, 5, 10, 14]))
gone = cache.block_table([b])[0]
cache.free(b)
q = rng.standard_normal((2, 2, E)).astype(np.float32)
want = cache.attend([a, c], q)
libc = ctypes.CDLL(None)
for pool in (cache._key, cache._value):
    for block in gone:
        assert pool[block].ctypes.data % page == 0
        assert libc.mprotect(ctypes.c_void_p(pool[block].ctypes.data), 2 * page, 0) == 0
got = cache.attend([a, c], q, num_threads=2)
assert np.array_equal(got, want)
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through ctypes, Linux")
@pytest.mark.parametrize("path", fastattn.available_simd_paths())
def test_freed_blocks_are_never_read(path):
    r = subprocess.run([sys.executable, "-c", NEVER_READ, path], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_a_parent_and_its_fork_appending_together_take_one_copy():
    """Both holders of a shared, partly filled block append in one call: the
    first copies it, the last writes into it in place; no block is lost
    (a fresh user's finding: two copies, the original never freed)."""
    rng = np.random.default_rng(11)
    cache = fastattn.PagedKVCache(4, 16, Hkv, D, value_dim=Dv)
    a = cache.add_sequence()
    twins = {a: Twin("float32")}
    step(rng, cache, twins, {a: 5})
    b = cache.fork(a)
    c = cache.fork(a)
    twins[b] = Twin("float32", twins[a].keys, twins[a].values)
    twins[c] = Twin("float32", twins[a].keys, twins[a].values)
    assert cache.blocks_needed([a, b, c], [1, 1, 1]) == 2
    step(rng, cache, twins, {a: 1, b: 2, c: 1})
    assert cache.num_free_blocks == 1
    for s in (a, b, c):
        cache.free(s)
    assert cache.num_free_blocks == 4


def test_no_key_at_all_gives_zero_rows():
    """Every sequence empty (a block table of no column), is_causal=False:
    zero rows and lse -inf, not what out held."""
    q = np.ones((1, 2, 4), np.float32)
    kc = np.ones((3, 1, 4, 4), np.float32)
    out = np.full((1, 2, 4), 7.0, np.float32)
    got, lse = fastattn.paged_attention(q, kc, kc, np.zeros((1, 0), np.int32), np.array([0]),
                                        np.array([0, 1]), is_causal=False, out=out,
                                        return_lse=True)
    assert got is out and not out.any() and (lse == -np.inf).all()
    cache = fastattn.PagedKVCache(4, 4, 1, 4)
    s = cache.add_sequence()
    assert not cache.attend([s], q, is_causal=False).any()


def test_rotary_past_the_tables_names_the_position():
    cache = fastattn.PagedKVCache(8, 4, 1, 8)
    s = cache.add_sequence()
    cos = sin = np.ones((4, 4), np.float32)
    with pytest.raises(ValueError, match="cover positions 0 to 3 and this step reaches position 5"):
        cache.append([s], *(np.ones((6, 1, 8), np.float32),) * 2, np.array([0, 6]),
                     rotary=(cos, sin))
    assert cache.seq_lens[s] == 0


def test_an_append_that_cannot_fit_fails_before_any_work():
    """The pool is checked before the rows are converted or placed: 2**26
    broadcast tokens into 8 blocks fail at once, without allocating for
    them, and 2**33 ones with OutOfBlocksError, not NumPy's MemoryError."""
    import tracemalloc
    cache = fastattn.PagedKVCache(8, 4, Hkv, D, value_dim=Dv, storage="int8")
    s = cache.add_sequence()
    for n in (2**26, 2**33):
        key = np.broadcast_to(np.ones((1, Hkv, D), np.float32), (n, Hkv, D))
        value = np.broadcast_to(np.ones((1, Hkv, Dv), np.float32), (n, Hkv, Dv))
        tracemalloc.start()
        try:
            with pytest.raises(fastattn.OutOfBlocksError, match=f"needs {n // 4} free blocks"):
                cache.append([s], key, value, np.array([0, n]))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**20, f"{peak} bytes allocated for an append of {n} tokens that fails"
    assert cache.seq_lens == {s: 0} and cache.num_free_blocks == 8


def test_out_may_not_hold_cu_seqlens_q():
    """The kernels read cu_seqlens_q while they write out: an out sharing
    its memory is refused, as paged_attention refuses it."""
    cache = fastattn.PagedKVCache(4, 4, Hkv, D, value_dim=Dv)
    ids = [cache.add_sequence(), cache.add_sequence()]
    cache.append(ids, *kv(6), np.array([0, 3, 6]))
    out = np.zeros((2, Hq, Dv), np.float32)
    cu = out.reshape(-1)[:6].view(np.int64)
    cu[:] = [0, 1, 2]
    with pytest.raises(ValueError, match="out overlaps cu_seqlens_q"):
        cache.attend(ids, np.zeros((2, Hq, D), np.float32), cu, out=out)


def test_a_pool_of_2_31_blocks_is_cheap_to_make():
    """The free blocks are a counter and a stack of those given back, not a
    list of every block: the largest pool the int32 tables allow is made at
    once (its key and value rows of 0 features take no memory) and hands
    out its blocks lowest first, a freed one first again."""
    cache = fastattn.PagedKVCache(2**31, 1, 1, 0)
    assert cache.num_free_blocks == 2**31
    a, b = cache.add_sequence(), cache.add_sequence()
    empty = np.zeros((3, 1, 0), np.float32)
    cache.append([a, b], empty, empty, np.array([0, 2, 3]))
    assert cache.block_table([a, b]).tolist() == [[0, 1], [2, -1]]
    cache.free(a)
    cache.append([b], empty[:1], empty[:1])
    assert cache.block_table([b]).tolist() == [[2, 1]]
    assert cache.num_free_blocks == 2**31 - 2


def test_truncate_gives_blocks_back_and_keeps_forks_whole():
    """Rejected draft tokens of a sequence whose prompt a fork shares: the
    sequence is as if it never held them (its next tokens attend bit for bit
    as a twin's that never did), the blocks past it are free again, and the
    fork, which shares the block cut into, keeps every position."""
    rng = np.random.default_rng(21)
    cache = fastattn.PagedKVCache(12, 4, Hkv, D, value_dim=Dv)
    parent = cache.add_sequence()
    twins = {parent: Twin("float32")}
    step(rng, cache, twins, {parent: 6})  # blocks: 4 + 2 of 4
    child = cache.fork(parent)
    twins[child] = Twin("float32", twins[parent].keys, twins[parent].values)
    free = cache.num_free_blocks
    k = rng.standard_normal((7, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((7, Hkv, Dv)).astype(np.float32)
    cache.append([parent], k, v, np.array([0, 7]))  # drafts: the shared block copied, 2 more
    assert cache.seq_lens_of([parent, child]).tolist() == [13, 6]
    cache.truncate([parent], [5])  # into the first two blocks, shared with the child
    assert cache.seq_lens_of([parent, child]).tolist() == [5, 6]
    assert cache.num_free_blocks == free - 1  # the parent's copy of block 2 is kept
    twins[parent] = Twin("float32", [twins[parent].keys[0][:5]], [twins[parent].values[0][:5]])
    step(rng, cache, twins, {parent: 3, child: 2})
    q = rng.standard_normal((1, Hq, D)).astype(np.float32)
    for s in (parent, child):
        np.testing.assert_array_equal(cache.attend([s], q), twins[s].attend(q))
    cache.truncate([parent, child], [0, 0])
    assert cache.num_free_blocks == 12
