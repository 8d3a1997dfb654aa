"""Results are bitwise identical whatever the thread count, from any number
of Python threads at once, while the settings change."""
import concurrent.futures
import functools
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest

import fastattn


@pytest.fixture
def big(rng, dtype):
    B, H, L, S, E = 2, 3, 150, 260, 32
    q = rng.standard_normal((B, H, L, E)).astype(dtype)
    k = rng.standard_normal((B, H, S, E)).astype(dtype)
    v = rng.standard_normal((B, H, S, E)).astype(dtype)
    mask = rng.random((B, 1, L, S)) > 0.2
    return q, k, v, mask


@pytest.mark.parametrize("causal", [False, True])
def test_attention_thread_counts(simd, big, causal):
    q, k, v, mask = big
    results = [fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                     need_weights=True, num_threads=n)
               for n in (1, 2, 4)]
    for out, w in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(w, results[0][1])


@pytest.mark.parametrize("threads", [1, 2])
def test_attention_beyond_l2_matches_calls_per_head(simd, rng, threads):
    """Operands beyond the threads' L2 (10 MiB here) make the kernels ask the
    cache for the next task's rows (prefetch hints); per head they fit and
    get none: the results must be the same bits."""
    H, L, S, E = 64, 512, 128, 32
    q = rng.standard_normal((H, L, E)).astype(np.float32)
    k, v = (rng.standard_normal((H, S, E)).astype(np.float32) for _ in range(2))
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=threads)
    for h in range(0, H, 8):
        np.testing.assert_array_equal(
            out[h], fastattn.scaled_dot_product_attention(q[h], k[h], v[h], is_causal=True,
                                                          num_threads=threads))


@pytest.mark.parametrize("padded", [False, True])
def test_keys_beyond_l2_give_the_bits_without_block_prefetch(simd, rng, dtype, monkeypatch,
                                                             padded):
    """One item's keys and values beyond L2 (8-16 MB here) make the block
    kernel ask for each next key block as it computes one
    (FA_PREFETCH_BLOCKS); without the hint the results must be the same
    bits."""
    L, S, E = 8, 2 ** 15 + 37, 32  # a partial last key block
    q = rng.standard_normal((1, L, E)).astype(dtype)
    k, v = (rng.standard_normal((1, S, E)).astype(dtype) for _ in range(2))
    mask = rng.random((1, 1, S)) > 0.3 if padded else None
    hinted = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, num_threads=1)
    monkeypatch.setattr(fastattn._core, "attention",
                        functools.partial(fastattn._core.attention, ahead_blocks=False))
    plain = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, num_threads=1)
    np.testing.assert_array_equal(hinted, plain)


@pytest.mark.parametrize("storage", ["float32", "float64", "float16", "int8"])
def test_paged_keys_beyond_l2_give_the_bits_without_block_prefetch(simd, rng, monkeypatch,
                                                                   storage):
    """A sequence whose keys and values in a paged cache exceed L2 makes the
    block kernel ask for each next key block, through the block table, in
    any storage; without the hint the results must be the same bits."""
    L, S, E, bs, Hq = 8, 2 ** 15 + 37, 32, 16, 2
    nb = -(-S // bs)
    compute = np.float64 if storage == "float64" else np.float32
    q = rng.standard_normal((L, Hq, E)).astype(compute)
    kc, vc = (rng.standard_normal((nb + 3, 1, bs, E)).astype(compute) for _ in range(2))
    extra = {}
    if storage == "int8":
        scales = [(np.abs(x).max(-1) / 127).astype(np.float32) for x in (kc, vc)]
        kc, vc = (np.round(x / sc[..., None]).astype(np.int8) for x, sc in zip((kc, vc), scales))
        extra = dict(k_scale=scales[0], v_scale=scales[1])
    elif storage == "float16":
        kc, vc = kc.astype(np.float16), vc.astype(np.float16)
    table = rng.permutation(nb + 3)[:nb].astype(np.int32)[None]
    args = (q, kc, vc, table, np.array([S]), np.array([0, L]))
    hinted = fastattn.paged_attention(*args, num_threads=1, **extra)
    monkeypatch.setattr(fastattn._core, "ragged",
                        functools.partial(fastattn._core.ragged, ahead_blocks=False))
    plain = fastattn.paged_attention(*args, num_threads=1, **extra)
    np.testing.assert_array_equal(hinted, plain)


def test_ops_thread_counts(simd, rng, dtype):
    a = rng.standard_normal((3, 200, 300)).astype(dtype)
    b = rng.standard_normal((300, 270)).astype(dtype)
    mm = [fastattn.matmul(a, b, num_threads=n) for n in (1, 2, 4)]
    sm = [fastattn.softmax(a, axis=1, num_threads=n) for n in (1, 2, 4)]
    mh = [fastattn.merge_heads(a.reshape(3, 4, 50, 300), num_threads=n) for n in (1, 2, 4)]
    for results in (mm, sm, mh):
        for r in results[1:]:
            np.testing.assert_array_equal(r, results[0])


def test_global_thread_setting(big):
    q, k, v, _ = big
    before = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(1)
        assert fastattn.get_num_threads() == 1
        one = fastattn.scaled_dot_product_attention(q, k, v)
        fastattn.set_num_threads(3)
        assert fastattn.get_num_threads() == (3 if fastattn.openmp_enabled() else 1)
        np.testing.assert_array_equal(fastattn.scaled_dot_product_attention(q, k, v), one)
    finally:
        fastattn.set_num_threads(None)
    assert fastattn.get_num_threads() == before


@pytest.mark.skipif(not fastattn.openmp_enabled(), reason="serial build: always 1 thread")
def test_omp_num_threads_is_capped():
    # the default count comes from OMP_NUM_THREADS, read when OpenMP starts:
    # a fresh process
    code = ("import fastattn, numpy as np; print(fastattn.get_num_threads()); "
            "q = np.ones((1, 1, 4, 8), np.float32); "
            "print(fastattn.scaled_dot_product_attention(q, q, q).sum())")
    env = dict(os.environ, OMP_NUM_THREADS="100000")
    with tempfile.TemporaryDirectory() as cwd:  # not the source tree, which would hide the build
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(fastattn._runtime.MAX_THREADS), "32.0"]


def test_concurrent_python_threads(big):
    """Calls from several Python threads at once (the GIL is released in C)."""
    q, k, v, mask = big
    expected = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fastattn.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                               num_threads=1 + i % 2) for i in range(12)]
        for f in futures:
            np.testing.assert_array_equal(f.result(), expected)


def scratch_jobs(rng):
    """Calls through each of the kernels' loops (dense, int8 mode, ragged,
    paged, backward, matmul, softmax), each returning arrays."""
    def arr(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = arr(1, 4, 130, 64), arr(1, 4, 200, 64), arr(1, 4, 200, 64)
    cache = fastattn.KVCache(1, 4, 64, 64, storage="int8")
    cache.append(k[:, :, :64], v[:, :, :64])
    cu = np.array([0, 50, 130], np.int64)
    packed = [x[0].transpose(1, 0, 2)[:130].copy() for x in (q, k, v)]
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)
    return [
        lambda n: fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, num_threads=n),
        lambda n: fastattn.scaled_dot_product_attention(q, k, v, num_threads=n, precision="int8"),
        lambda n: cache.attend(q[:, :, :1], num_threads=n, precision="int8"),
        lambda n: fastattn.varlen_attention(*packed, cu, cu, is_causal=True, num_threads=n),
        lambda n: fastattn.attention_backward(np.ones_like(out), q, k, v, out, lse,
                                              is_causal=True, num_threads=n)[0],
        lambda n: fastattn.matmul(q[0], k[0].transpose(0, 2, 1), num_threads=n),
        lambda n: fastattn.softmax(q[0] * 10, mask=q[0] > -1, num_threads=n),
    ]


def test_kept_scratch_gives_the_bits_of_fresh_scratch(rng, monkeypatch):
    """The kernels' scratch kept between calls (_core.SCRATCH_KEEP) and
    scratch allocated per call give the same bits, as the buffer grows from
    a small call to a larger one, filled with NaN bytes by the test (no
    kernel reads scratch it did not write), and a thread keeps one buffer."""
    from fastattn import _core
    jobs = scratch_jobs(rng)
    kept = [[job(n) for job in jobs] for n in (1, 2)]
    buf = _core._kept.buf
    for n in (1, 2):
        for i, job in enumerate(jobs):
            buf.fill(0xFF)
            assert same_bits(job(n), kept[n - 1][i]), f"job {i}, {n} threads, NaN scratch"
    assert _core._kept.buf is buf  # no new buffer for calls of the same sizes
    monkeypatch.setattr(_core, "SCRATCH_KEEP", 0)  # each thread's own, freed after
    for j, n in enumerate((1, 2)):
        for i, job in enumerate(jobs):
            assert same_bits(job(n), kept[j][i]), f"job {i}, {n} threads"


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="no interval timer signals here")
def test_calls_from_a_signal_handler_during_a_call(rng):
    """A signal handler runs while a call waits for its threads (the loops
    check for signals): its own calls, smaller and larger than the running
    call, leave the running call's kept scratch alone and get their bits."""
    sdpa = fastattn.scaled_dot_product_attention
    q = rng.standard_normal((1, 8, 2048, 64)).astype(np.float32)  # 20-50 ms: signal checks
    small = rng.standard_normal((1, 1, 64, 256)).astype(np.float32)
    large = rng.standard_normal((1, 1, 4, 1000)).astype(np.float32)
    expected = sdpa(q, q, q, num_threads=2)
    nested = {id(x): sdpa(x, x, x, num_threads=1) for x in (small, large)}
    wrong, calls = [], []

    def handler(signum, frame):
        x = small if len(calls) % 2 else large
        calls.append(1)
        if not same_bits(sdpa(x, x, x, num_threads=1), nested[id(x)]):
            wrong.append("handler's call")

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        for _ in range(4):
            signal.setitimer(signal.ITIMER_REAL, 0.003, 0.003)
            got = sdpa(q, q, q, num_threads=2)
            signal.setitimer(signal.ITIMER_REAL, 0, 0)
            if not same_bits(got, expected):
                wrong.append("the running call")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
    assert calls and not wrong


def mixed_jobs(rng):
    """(function, args, kwargs): every function, float32 and float64, the
    row kernel and the block kernel, masks, GQA, strided views."""
    def arr(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    sdpa = fastattn.scaled_dot_product_attention
    q64 = arr(1, 8, 70, 16, dtype=np.float64)
    kv64 = arr(1, 2, 90, 16, dtype=np.float64)
    fmask = np.where(rng.random((70, 90)) > 0.2, rng.standard_normal((70, 90)), -np.inf)
    blhe = arr(2, 40, 3, 16)
    return [
        (sdpa, (arr(2, 3, 150, 32), arr(2, 3, 260, 32), arr(2, 3, 260, 24)),
         {"attn_mask": rng.random((2, 1, 150, 260)) > 0.3, "is_causal": True}),
        (sdpa, (q64, kv64, kv64[..., ::-1]),
         {"attn_mask": fmask, "enable_gqa": True, "is_causal": True,
          "causal_alignment": "lower_right", "need_weights": True}),
        (sdpa, (arr(4, 1, 32), arr(4, 300, 32), arr(4, 300, 32)), {}),  # one query row
        (sdpa, (blhe.transpose(0, 2, 1, 3)[:, :, :3],) * 3, {"is_causal": True}),
        (fastattn.matmul, (arr(3, 200, 300), arr(300, 270)), {}),
        (fastattn.matmul, (arr(97, 257, dtype=np.float64), arr(129, 257, dtype=np.float64).T), {}),
        (fastattn.softmax, (arr(5, 1000) * 10,), {"mask": rng.random(1000) > 0.1}),
        (fastattn.softmax, (arr(40, 33, 7, dtype=np.float64),), {"axis": 1}),
        (fastattn.merge_heads, (arr(2, 4, 50, 16),), {}),
        (fastattn.merge_heads, (arr(3, 2, 7, 5, dtype=np.float64)[:, :, ::-1],), {}),
    ]


def same_bits(a, b):
    """a and b (arrays, or tuples of arrays) are identical bit for bit."""
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return all(x.shape == y.shape and x.dtype == y.dtype and
               np.ascontiguousarray(x).tobytes() == np.ascontiguousarray(y).tobytes()
               for x, y in pairs)


def test_many_threads_mixed_calls(rng):
    """Many Python threads calling every function at once, with different
    shapes and thread counts, get the serial results bit for bit, on every
    repetition."""
    jobs = mixed_jobs(rng)
    serial = [fn(*args, num_threads=1, **kwargs) for fn, args, kwargs in jobs]
    order = [(j, n) for j in range(len(jobs)) for n in (1, 2, 3, 4)] * 2
    rng.shuffle(order)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [(j, pool.submit(jobs[j][0], *jobs[j][1], num_threads=n, **jobs[j][2]))
                   for j, n in order]
        for j, f in futures:
            assert same_bits(f.result(), serial[j]), f"job {j}"


def test_settings_changed_while_calls_run(rng):
    """set_num_threads and set_simd_path flipped from one thread while others
    compute: every call reads the settings once, at its start, so its result
    is the serial result of one of the SIMD paths, bit for bit."""
    jobs = mixed_jobs(rng)
    paths, before = fastattn.available_simd_paths(), fastattn.simd_path()
    expected = []
    for path in paths:
        fastattn.set_simd_path(path)
        expected.append([fn(*args, num_threads=1, **kwargs) for fn, args, kwargs in jobs])
    stop = threading.Event()

    def flip():
        for i in itertools.count():
            if stop.is_set():
                return
            fastattn.set_num_threads((1, 2, 3, None)[i % 4])
            fastattn.set_simd_path(paths[i % len(paths)])

    def work(j):
        fn, args, kwargs = jobs[j]
        for _ in range(6):
            result = fn(*args, **kwargs)
            assert any(same_bits(result, e[j]) for e in expected), f"job {j}"

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for f in [pool.submit(work, j) for j in range(len(jobs))]:
                f.result()
    finally:
        stop.set()
        flipper.join()
        fastattn.set_num_threads(None)
        fastattn.set_simd_path(before)


FORK_CHILD = r"""
import multiprocessing as mp
import numpy as np
import fastattn
q = np.random.default_rng(0).standard_normal((1, 8, 200, 32)).astype(np.float32)
want = fastattn.scaled_dot_product_attention(q, q, q, num_threads=2)  # the parent's team

def call(i):
    return fastattn.scaled_dot_product_attention(q, q, q, num_threads=2), fastattn.get_num_threads()

with mp.get_context("fork").Pool(2) as pool:
    results = pool.map(call, range(4))
assert all(np.array_equal(out, want) for out, _ in results)
print([n for _, n in results])
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork()")
def test_forked_children_run_on_one_thread():
    """A child forked after the parent ran a team: OpenMP's threads are not
    there, so a team would wait forever; fastattn runs it on one thread
    (bitwise the same result).  The timeout only keeps a hang from stopping
    the suite."""
    with tempfile.TemporaryDirectory() as cwd:
        r = subprocess.run([sys.executable, "-c", FORK_CHILD], capture_output=True, text=True,
                           timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "[1, 1, 1, 1]"


def test_a_paged_cache_from_eight_threads():
    """Eight threads add, append to, fork, attend and free their own
    sequences of one PagedKVCache at once, in a pool small enough that
    appends run out of blocks: the bookkeeping's lock leaves no error but
    OutOfBlocksError, every block accounted for, and every sequence holding
    the rows its thread appended."""
    Hkv, D, bs = 1, 4, 2
    cache = fastattn.PagedKVCache(24, bs, Hkv, D)
    errors = []

    def rows_of(cache, s):
        n, table = cache.seq_lens[s], cache.block_table([s])[0]
        return cache.key_cache[table, 0].reshape(-1, D)[:n, 0]

    def work(t):
        rng = np.random.default_rng(t)
        held = {}  # sequence -> the first feature of each row appended
        try:
            for i in range(4000):
                what = rng.integers(6)
                if what == 0 or not held:
                    held[cache.add_sequence()] = []
                elif what == 1:
                    s = list(held)[rng.integers(len(held))]
                    held[cache.fork(s)] = list(held[s])
                elif what == 2 or (what == 3 and len(held) > 1):
                    s = list(held)[rng.integers(len(held))]
                    cache.free(s)
                    del held[s]
                else:
                    s = list(held)[rng.integers(len(held))]
                    n = int(rng.integers(1, 6))
                    key = np.full((n, Hkv, D), t * 1000 + i, np.float32)
                    key[:, 0, 0] += np.arange(n) / 4
                    try:
                        cache.append([s], key, key, np.array([0, n]))
                        held[s] += list(key[:, 0, 0])
                    except fastattn.OutOfBlocksError:
                        pass
                    out = cache.attend([s], np.zeros((1, 1, D), np.float32), is_causal=False)
                    assert np.isfinite(out).all()
                if i % 500 == 499:
                    for s, rows in held.items():
                        assert rows_of(cache, s).tolist() == rows
        except BaseException as e:  # noqa: B902 - reported below, with its thread
            errors.append((t, repr(e)))
        return held

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads change places often
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            held = [h for h in pool.map(work, range(8))]
    finally:
        sys.setswitchinterval(switch)
    assert errors == []
    live = [s for h in held for s in h]
    assert sorted(live) == sorted(cache.seq_ids)
    blocks = set(cache.block_table(live)[cache.block_table(live) >= 0].tolist()) if live else set()
    assert len(blocks) + cache.num_free_blocks == cache.num_blocks
