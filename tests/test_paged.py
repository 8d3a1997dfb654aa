"""paged_attention: each sequence of a ragged batch over a paged cache gives
the bits of scaled_dot_product_attention on its own keys and values, and
the float64 reference's values within the suite's bound."""
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import assert_close, f64

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention


class Pool:
    """Sequences' keys and values (each (Hkv, S_b, E)) scattered over a pool
    of blocks in random order; every slot no sequence owns holds NaN (int8:
    the largest code), so that a read of one would show in the output."""

    def __init__(self, rng, keys, values, block_size, dtype=np.float32, spare=3):
        self.keys, self.values, self.block_size = keys, values, block_size
        Hkv, E, Ev = keys[0].shape[0], keys[0].shape[2], values[0].shape[2]
        need = [-(-k.shape[1] // block_size) for k in keys]
        n = sum(need) + spare
        # (uint8: NaN as float8 codes, and as an int4 block's scale)
        junk = np.iinfo(dtype).max if np.dtype(dtype).kind in "iu" else np.nan
        self.key_cache = np.full((n, Hkv, block_size, E), junk, dtype)
        self.value_cache = np.full((n, Hkv, block_size, Ev), junk, dtype)
        order = rng.permutation(n)
        self.table = np.full((len(keys), max(need + [0]) + 2), -1, np.int32)  # -1: never read
        used = 0
        for b, (k, v) in enumerate(zip(keys, values)):
            blocks = order[used:used + need[b]]
            used += need[b]
            self.table[b, :need[b]] = blocks
            j = np.arange(k.shape[1])
            self.key_cache[blocks[j // block_size], :, j % block_size] = k.transpose(1, 0, 2)
            self.value_cache[blocks[j // block_size], :, j % block_size] = v.transpose(1, 0, 2)
        self.seq_lens = np.array([k.shape[1] for k in keys], np.int32)


def ragged(rng, q_lens, k_lens, Hq=4, Hkv=2, E=16, Ev=12, dtype=np.float32):
    queries = [rng.standard_normal((Hq, L, E)).astype(dtype) for L in q_lens]
    keys = [rng.standard_normal((Hkv, S, E)).astype(dtype) for S in k_lens]
    values = [rng.standard_normal((Hkv, S, Ev)).astype(dtype) for S in k_lens]
    return queries, keys, values


def packed(queries):
    cu = np.concatenate([[0], np.cumsum([q.shape[1] for q in queries])]).astype(np.int32)
    return np.concatenate([q.transpose(1, 0, 2) for q in queries]), cu


def per_sequence(x, cu, b):
    """Sequence b's rows of a packed (total_q, Hq, D) output as (Hq, L, D)."""
    return x[cu[b]:cu[b + 1]].transpose(1, 0, 2)


# prefill chunks, decoding tokens (one beyond a split: S >= 2048), a few
# speculative tokens, a sequence with no query, one with one key
Q_LENS = [70, 1, 3, 0, 1, 2, 1]
K_LENS = [90, 2100, 40, 7, 1, 2, 300]


@pytest.mark.parametrize("block_size", [1, 16, 24, 128])
def test_each_sequence_is_its_own_call_bit_for_bit(simd, block_size):
    rng = np.random.default_rng(block_size)
    queries, keys, values = ragged(rng, Q_LENS, K_LENS)
    pool = Pool(rng, keys, values, block_size)
    query, cu = packed(queries)
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, return_lse=True)
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        if q.shape[1] == 0:
            continue
        want, want_lse = sdpa(q, k, v, is_causal=True, causal_alignment="lower_right",
                              enable_gqa=True, return_lse=True)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], want_lse)


OPTIONS = [dict(), dict(is_causal=False), dict(window_size=(20, 0)), dict(softcap=3.0),
           dict(scale=0.3), dict(alibi_slopes="per_head"), dict(alibi_slopes="per_sequence"),
           dict(sinks="per_head"), dict(window_size=(5, 5), is_causal=False)]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "plain")
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_options_against_the_reference(simd, options, dtype):
    rng = np.random.default_rng(3)
    q_lens, k_lens = [70, 1, 3, 1, 2], [90, 2100, 40, 1, 33]
    Hq = 4
    queries, keys, values = ragged(rng, q_lens, k_lens, Hq=Hq, dtype=dtype)
    pool = Pool(rng, keys, values, 16, dtype)
    query, cu = packed(queries)
    options = dict(options)
    if options.get("alibi_slopes") == "per_head":
        options["alibi_slopes"] = rng.random(Hq)
    elif options.get("alibi_slopes") == "per_sequence":
        options["alibi_slopes"] = rng.random((len(q_lens), Hq))
    if options.get("sinks") == "per_head":
        options["sinks"] = rng.standard_normal(Hq)
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, return_lse=True, **options)
    assert out.dtype == dtype and lse.shape == (Hq, cu[-1])
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        seq_options = dict(options)
        slopes = seq_options.get("alibi_slopes")
        if slopes is not None and slopes.ndim == 2:
            seq_options["alibi_slopes"] = slopes[b]
        causal = seq_options.pop("is_causal", True)
        r_out, r_lse = ref.scaled_dot_product_attention(
            *f64(q, k, v), is_causal=causal, causal_alignment="lower_right", enable_gqa=True,
            return_lse=True, **seq_options)
        n = q.shape[-1] + k.shape[1]
        assert_close(per_sequence(out, cu, b), r_out, dtype, n)
        assert_close(lse[:, cu[b]:cu[b + 1]], r_lse.astype(dtype), dtype, n,
                     magnitude=float(np.abs(r_lse).max(initial=1)))
        want = sdpa(q, k, v, is_causal=causal, causal_alignment="lower_right", enable_gqa=True,
                    **seq_options)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)


@pytest.mark.parametrize("threads", [1, 2])
def test_other_sequences_and_threads_change_no_bit(threads):
    """A sequence alone, in a batch, and in the batch reversed (its blocks
    elsewhere in memory) gives one result, at any thread count."""
    rng = np.random.default_rng(8)
    queries, keys, values = ragged(rng, Q_LENS, K_LENS)
    query, cu = packed(queries)
    pool = Pool(rng, keys, values, 16)
    out = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                   pool.seq_lens, cu, num_threads=threads)
    back = Pool(rng, keys[::-1], values[::-1], 16)
    query_r, cu_r = packed(queries[::-1])
    out_r = fastattn.paged_attention(query_r, back.key_cache, back.value_cache, back.table,
                                     back.seq_lens, cu_r, num_threads=threads)
    B = len(queries)
    for b in range(B):
        alone = Pool(rng, keys[b:b + 1], values[b:b + 1], 16)
        q1, cu1 = packed(queries[b:b + 1])
        one = fastattn.paged_attention(q1, alone.key_cache, alone.value_cache, alone.table,
                                       alone.seq_lens, cu1, num_threads=1)
        np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], one)
        np.testing.assert_array_equal(out_r[cu_r[B - 1 - b]:cu_r[B - b]], one)


STORAGES = ["float32", "float16", "bfloat16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"]


# (E, Ev): a tail of 4 elements after AVX2's vectors (AVX-512 runs the AVX2
# kernels there), and whole AVX-512 vectors
@pytest.mark.parametrize("E,Ev", [(44, 12), (48, 16)])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("storage", STORAGES)
def test_cache_storages_read_as_kvcache_reads_them(simd, storage, block_size, E, Ev):
    """A pool holding a KVCache's stored keys and values (its 16-bit
    elements, its codes and row scales) gives, per sequence, the bits of
    KVCache.attend.  Blocks of one key have the row kernel take its key
    rows one at a time; the dense cache and blocks of 16 have it take them
    a vector's width at a time, their dot products' lanes summed together."""
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    Hq, Hkv = 4, 2
    q_lens, k_lens = [5, 1, 1], [37, 2100, 1]
    caches, queries = [], []
    for L, S in zip(q_lens, k_lens):
        cache = fastattn.KVCache(1, Hkv, S, E, value_dim=Ev, storage=storage)
        cache.append(3 * rng.standard_normal((1, Hkv, S, E)).astype(np.float32),
                     rng.standard_normal((1, Hkv, S, Ev)).astype(np.float32))
        caches.append(cache)
        queries.append(rng.standard_normal((Hq, L, E)).astype(np.float32))
    stored = [(c._key[0], c._value[0]) for c in caches]
    pool = Pool(rng, [k for k, _ in stored], [v for _, v in stored], block_size,
                dtype=stored[0][0].dtype)
    options = {}
    if caches[0]._key_scale is not None:  # the scales in the blocks of their rows
        for name, src in (("k_scale", "_key_scale"), ("v_scale", "_value_scale")):
            s = np.full(pool.key_cache.shape[:3], np.nan, np.float32)
            for b, c in enumerate(caches):
                j = np.arange(k_lens[b])
                s[pool.table[b, j // block_size], :, j % block_size] = getattr(c, src)[0].T
            options[name] = s
    if pool.key_cache.dtype == np.uint8:  # codes: vLLM's kv_cache_dtype names them
        options["kv_cache_dtype"] = storage
    if storage == "int4":  # rows of Ev values fill part of a block
        options["value_dim"] = Ev
    query, cu = packed(queries)
    out = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                   pool.seq_lens, cu, **options)
    for b, (c, q) in enumerate(zip(caches, queries)):
        np.testing.assert_array_equal(per_sequence(out, cu, b), c.attend(q[None])[0])


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_16_bit_queries_and_caches(half):
    if half == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(np.float16)
    rng = np.random.default_rng(6)
    queries, keys, values = ragged(rng, [3, 1], [50, 2100], dtype=dtype)
    pool = Pool(rng, keys, values, 24, dtype)
    query, cu = packed(queries)
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, return_lse=True)
    assert out.dtype == dtype and lse.dtype == np.float32
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        want = sdpa(q, k, v, is_causal=True, causal_alignment="lower_right", enable_gqa=True)
        np.testing.assert_array_equal(per_sequence(out, cu, b).view(np.uint16),
                                      want.view(np.uint16))


def test_out_array_and_no_keys():
    """out is written in place; a sequence with no key (is_causal=False)
    gives zero rows and lse -inf."""
    rng = np.random.default_rng(9)
    queries, keys, values = ragged(rng, [2, 3], [0, 10])
    pool = Pool(rng, keys, values, 4)
    query, cu = packed(queries)
    out = np.full((5, 4, 12), 7.0, np.float32)
    got, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, is_causal=False, return_lse=True,
                                        out=out)
    assert got is out
    assert not out[:2].any() and (lse[:, :2] == -np.inf).all()
    want = sdpa(queries[1], keys[1], values[1], enable_gqa=True)
    np.testing.assert_array_equal(per_sequence(out, cu, 1), want)


def test_inputs_unchanged():
    rng = np.random.default_rng(10)
    queries, keys, values = ragged(rng, [3, 1], [20, 9])
    pool = Pool(rng, keys, values, 8)
    query, cu = packed(queries)
    args = [query, pool.key_cache, pool.value_cache, pool.table, pool.seq_lens, cu]
    before = [a.copy() for a in args]
    fastattn.paged_attention(*args)
    for a, b in zip(args, before):
        np.testing.assert_array_equal(a, b)


def bad_call(**change):
    rng = np.random.default_rng(11)
    queries, keys, values = ragged(rng, [3, 1], [20, 9])
    pool = Pool(rng, keys, values, 8)
    query, cu = packed(queries)
    args = dict(query=query, key_cache=pool.key_cache, value_cache=pool.value_cache,
                block_table=pool.table, seq_lens=pool.seq_lens, cu_seqlens_q=cu)
    for name, f in change.items():
        args[name] = f(args[name]) if callable(f) else f
    q = args.pop("query")
    return fastattn.paged_attention(q, **args)


def table_with(b, i, value):
    def change(t):
        t = t.copy()
        t[b, i] = value
        return t
    return change


@pytest.mark.parametrize("change,error,words", [
    (dict(block_table=table_with(1, 1, 99)), ValueError, "block_table[1, 1] = 99"),
    (dict(block_table=table_with(0, 0, -1)), ValueError, "sequence 0 holds 20 keys"),
    (dict(key_cache=lambda k: k[:0], value_cache=lambda v: v[:0]), ValueError,
     "they hold no block: num_blocks = 0"),
    (dict(block_table=lambda t: t.astype(np.float32)), TypeError, "block_table has dtype"),
    (dict(block_table=lambda t: t[:1]), ValueError, "one row per sequence"),
    (dict(seq_lens=np.array([20, -1])), ValueError, "seq_lens[1] = -1"),
    (dict(seq_lens=np.array([20, 99])), ValueError, "sequence 1 can hold 0 to"),
    (dict(seq_lens=np.array([2, 9])), ValueError, "sequence 0 has 3 queries but seq_lens[0] = 2"),
    (dict(cu_seqlens_q=np.array([0, 1, 5])), ValueError, "cu_seqlens_q"),
    (dict(value_cache=lambda v: v.astype(np.float64)), TypeError, "value_cache"),
    (dict(key_cache=lambda k: k[:, :, :, :5]), ValueError, "do not agree"),
    (dict(key_cache=lambda k: np.zeros(k.shape, np.int8),
          value_cache=lambda v: np.zeros(v.shape, np.int8)), TypeError, "int8 caches need k_scale"),
    (dict(k_scale=np.ones((5, 2, 8), np.float32)), TypeError, "scales of int8 and float8_e4m3fn caches"),
    (dict(query=lambda q: q[:, :3]), ValueError, "multiple of key/value heads"),
    (dict(query=lambda q: q.tolist()), TypeError, "numpy.ndarray"),
    (dict(seq_lens=[20, 9]), TypeError, "pass np.asarray(seq_lens, dtype=np.int32)"),
    (dict(block_table=lambda t: t.tolist()), TypeError, "np.asarray(block_table, dtype=np.int32)"),
])
def test_bad_input_is_a_clear_error(change, error, words):
    with pytest.raises(error) as e:
        bad_call(**change)
    assert words in str(e.value)


def test_entries_past_a_sequence_may_hold_anything():
    """Only a sequence's own blocks are read: the rest of its row of the
    table may hold any value, even one beyond int32 in an int64 table."""
    rng = np.random.default_rng(12)
    queries, keys, values = ragged(rng, [3, 1], [20, 9])
    pool = Pool(rng, keys, values, 8)
    query, cu = packed(queries)
    want = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                    pool.seq_lens, cu)
    table = pool.table.astype(np.int64)
    table[0, 3:] = 2**40
    table[1, 2:] = -(2**35)
    got = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, table,
                                   pool.seq_lens, cu)
    np.testing.assert_array_equal(got, want)


NEVER_READ = r"""
import ctypes, mmap, sys
import numpy as np
import fastattn
fastattn.set_simd_path(sys.argv[1])
# one page per row: E = 1024 float32, so that every row outside a
# sequence's keys can be made unreadable (PROT_NONE) on its own
page = mmap.PAGESIZE
E, bs, nblocks = page // 4, 4, 12
rows = 2 * nblocks * bs
buf = mmap.mmap(-1, rows * page + page)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
start = (-base) % page
pool = np.frombuffer(buf, np.float32, rows * E, start).reshape(2, nblocks, 1, bs, E)
rng = np.random.default_rng(0)
pool[:] = rng.standard_normal(pool.shape)
kc, vc = pool[0], pool[1]
table = np.array([[7, 2, 9, 0], [4, 11, 0, 0]], np.int32)  # entries past the blocks: 0
lens = np.array([10, 5])
keep = {(7, r) for r in range(4)} | {(2, r) for r in range(4)} | {(9, 0), (9, 1)}
keep |= {(4, r) for r in range(4)} | {(11, 0)}
q = rng.standard_normal((3, 2, E)).astype(np.float32)
cu = np.array([0, 2, 3])
want = fastattn.paged_attention(q, kc.copy(), vc.copy(), table, lens, cu)
libc = ctypes.CDLL(None)
for c in (kc, vc):
    for blk in range(nblocks):
        for r in range(bs):
            if (blk, r) not in keep:
                assert libc.mprotect(ctypes.c_void_p(c[blk, 0, r].ctypes.data), page, 0) == 0
got = fastattn.paged_attention(q, kc, vc, table, lens, cu, num_threads=2)
assert np.array_equal(got, want)
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through ctypes, Linux")
@pytest.mark.parametrize("path", fastattn.available_simd_paths())
def test_rows_outside_the_sequences_are_never_read(path):
    """Every row of the pool that no sequence holds, the free blocks, the
    block that table entries past a sequence name, and the rows past a
    sequence's length in its last block, made unreadable: the call must not
    touch them (a read ends the process with SIGSEGV)."""
    r = subprocess.run([sys.executable, "-c", NEVER_READ, path], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_rows_computed_again_as_alone():
    """Values near float32's largest overflow the online sum: such rows are
    computed again (the row kernel's normalized rerun), per head, also when
    the query heads of a key/value head are computed together and when the
    keys are split: still the bits of each sequence alone."""
    rng = np.random.default_rng(13)
    queries, keys, values = ragged(rng, [1, 2, 1], [2100, 30, 5], Hq=8, Hkv=2)
    for v in values:
        v[:, ::3] = 3e38
    pool = Pool(rng, keys, values, 16)
    query, cu = packed(queries)
    out, lse = fastattn.paged_attention(query, pool.key_cache, pool.value_cache, pool.table,
                                        pool.seq_lens, cu, return_lse=True)
    assert np.isfinite(out).all()
    for b, (q, k, v) in enumerate(zip(queries, keys, values)):
        want, want_lse = sdpa(q, k, v, is_causal=True, causal_alignment="lower_right",
                              enable_gqa=True, return_lse=True)
        np.testing.assert_array_equal(per_sequence(out, cu, b), want)
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], want_lse)
