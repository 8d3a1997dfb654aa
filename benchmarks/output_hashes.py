"""Hashes of fastattn's outputs over a wide grid of calls: every entry point,
storage, variant, SIMD path, 1 and 2 threads, paged block sizes.  A change
that must keep the bits (a restructuring) prints the same lines before and
after it:

    python benchmarks/output_hashes.py > before.txt     (then, after the change)
    python benchmarks/output_hashes.py | diff before.txt -

Each line is `case path threads hash`, the hash a SHA-256 prefix of every
output array's bytes (lse and weights included).  Run it from outside the
source tree, against the installed build.
"""
from __future__ import annotations

import argparse
import hashlib
from typing import Any, Callable, Iterator

import numpy as np

import fastattn

try:
    import ml_dtypes
except ImportError:  # bfloat16 cases are left out (said on stderr)
    ml_dtypes = None

Case = Callable[[int], Any]


def arrays(result: Any) -> Iterator[np.ndarray]:
    """The arrays of a result: an array, or tuples of them (None left out)."""
    if isinstance(result, tuple):
        for r in result:
            yield from arrays(r)
    elif result is not None:
        yield np.ascontiguousarray(result)


def digest(result: Any) -> str:
    h = hashlib.sha256()
    for a in arrays(result):
        h.update(str(a.dtype).encode() + str(a.shape).encode() + a.tobytes())
    return h.hexdigest()[:16]


def dense_cases(rng: np.random.Generator) -> Iterator[tuple[str, Case]]:
    sdpa = fastattn.scaled_dot_product_attention
    dtypes = [np.float32, np.float64, np.float16] + ([ml_dtypes.bfloat16] if ml_dtypes else [])
    shapes = {"prefill": (2, 4, 2, 77, 77, 64), "cross": (1, 8, 8, 33, 300, 40),
              "decode-split": (1, 8, 2, 1, 8192, 128), "rows4": (2, 8, 2, 4, 600, 32),
              "split-odd-group": (2, 6, 2, 2, 2100, 32)}
    for (name, (B, Hq, Hkv, L, S, E)), dt in ((s, d) for s in shapes.items() for d in dtypes):
        q = rng.standard_normal((B, Hq, L, E)).astype(dt)
        k, v = (rng.standard_normal((B, Hkv, S, E)).astype(dt) for _ in range(2))
        pad = rng.random((B, 1, 1, S)) > 0.2
        add = np.where(rng.random((B, 1, L, S)) > 0.1, 0, -np.inf).astype(
            np.float32 if dt not in (np.float32, np.float64) else dt)
        tag = f"sdpa {name} {np.dtype(dt).name}"
        yield f"{tag} plain", lambda n, q=q, k=k, v=v: sdpa(q, k, v, enable_gqa=True,
                                                             num_threads=n)
        yield f"{tag} causal-lse", lambda n, q=q, k=k, v=v: sdpa(
            q, k, v, is_causal=True, causal_alignment="lower_right", enable_gqa=True,
            return_lse=True, num_threads=n)
        if dt in (np.float32, np.float64):
            yield f"{tag} bool-mask", lambda n, q=q, k=k, v=v, m=pad: sdpa(
                q, k, v, attn_mask=m, enable_gqa=True, num_threads=n)
            yield f"{tag} add-mask", lambda n, q=q, k=k, v=v, m=add: sdpa(
                q, k, v, attn_mask=m, enable_gqa=True, num_threads=n)
        yield f"{tag} variants", lambda n, q=q, k=k, v=v, H=Hq: sdpa(
            q, k, v, is_causal=True, causal_alignment=3, enable_gqa=True, window_size=(40, 2),
            alibi_slopes=np.linspace(0.05, 0.5, H), softcap=20.0, sinks=np.linspace(-1, 1, H),
            scale=0.11, return_lse=True, num_threads=n)
    q = rng.standard_normal((2, 3, 9, 16)).astype(np.float32)
    yield "sdpa weights", lambda n: sdpa(q, q, q, is_causal=True, need_weights=True,
                                         num_threads=n)


def varlen_cases(rng: np.random.Generator) -> Iterator[tuple[str, Case]]:
    lens_q, lens_k = [5, 1, 0, 64, 1], [9, 8192, 3, 64, 300]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]) for x in (lens_q, lens_k))
    for dt in (np.float32, np.float64):
        q = rng.standard_normal((cu_q[-1], 8, 64)).astype(dt)
        k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(dt) for _ in range(2))
        yield f"varlen {np.dtype(dt).name}", lambda n, q=q, k=k, v=v: fastattn.varlen_attention(
            q, k, v, cu_q, cu_k, is_causal=True, return_lse=True, num_threads=n)
        yield f"varlen {np.dtype(dt).name} variants", lambda n, q=q, k=k, v=v: \
            fastattn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True, window_size=(30, 0),
                                      alibi_slopes=np.linspace(0.1, 0.8, 8), softcap=15.0,
                                      sinks=np.zeros(8), num_threads=n)


STORAGES = ["float32", "float16", "int8", "float8_e4m3fn", "float8_e5m2", "int4"] + (
    ["bfloat16"] if ml_dtypes else [])


def cache_cases(rng: np.random.Generator) -> Iterator[tuple[str, Case]]:
    Hq, Hkv, D = 8, 2, 64
    lens = [1, 17, 300, 4100]
    keys = [rng.standard_normal((n, Hkv, D)).astype(np.float32) for n in lens]
    values = [rng.standard_normal((n, Hkv, D)).astype(np.float32) for n in lens]
    news = [1, 3, 1, 1]  # queries per sequence: the last positions
    q = rng.standard_normal((sum(news), Hq, D)).astype(np.float32)
    cu_q = np.concatenate([[0], np.cumsum(news)])
    for storage in STORAGES:
        for bs in (1, 16, 24, 128):
            if bs == 1 and storage != "float32":
                continue  # a block of one row: the gather's case, once
            def paged(n: int, storage: str = storage, bs: int = bs) -> Any:
                need = sum(-(-x // bs) for x in lens)
                cache = fastattn.PagedKVCache(need + len(lens), bs, Hkv, D, storage=storage)
                ids = [cache.add_sequence() for _ in lens]
                junk = cache.add_sequence()  # blocks interleaved with another sequence's
                for i, s in enumerate(ids):
                    cache.append([s], keys[i], values[i], np.array([0, lens[i]]))
                    cache.append([junk], keys[0][:1], values[0][:1])
                return cache.attend(ids, q, cu_q, return_lse=True, num_threads=n,
                                    alibi_slopes=np.linspace(0.01, 0.1, Hq))
            yield f"paged {storage} block {bs}", paged
        def dense(n: int, storage: str = storage) -> Any:
            cache = fastattn.KVCache(2, Hkv, 4200, D, storage=storage)
            cache.append(keys[3][None].transpose(0, 2, 1, 3).repeat(2, 0),
                         values[3][None].transpose(0, 2, 1, 3).repeat(2, 0))
            query = q[:2].transpose(1, 0, 2)[None].repeat(2, 0)
            return cache.attend(query, return_lse=True, num_threads=n)
        yield f"kvcache {storage}", dense


def int8_mode_cases(rng: np.random.Generator) -> Iterator[tuple[str, Case]]:
    """precision="int8": the block kernel's tiles (rows of 5 queries and up)
    and the row kernel, dense and against int8 / int4 caches."""
    sdpa = fastattn.scaled_dot_product_attention
    shapes = {"prefill": (2, 4, 2, 77, 77, 64), "cross": (1, 8, 8, 33, 300, 40),
              "encoder": (1, 4, 4, 256, 256, 128), "decode": (1, 8, 2, 1, 3000, 128)}
    for name, (B, Hq, Hkv, L, S, E) in shapes.items():
        q = rng.standard_normal((B, Hq, L, E)).astype(np.float32)
        k, v = (rng.standard_normal((B, Hkv, S, E)).astype(np.float32) for _ in range(2))
        k += np.linspace(-4, 4, E, dtype=np.float32)  # outlier channels: the key mean's case
        pad = rng.random((B, 1, 1, S)) > 0.2
        tag = f"sdpa-int8 {name}"
        yield f"{tag} plain", lambda n, q=q, k=k, v=v: sdpa(
            q, k, v, enable_gqa=True, return_lse=True, precision="int8", num_threads=n)
        yield f"{tag} causal mask", lambda n, q=q, k=k, v=v, m=pad: sdpa(
            q, k, v, attn_mask=m, is_causal=True, causal_alignment="lower_right",
            enable_gqa=True, precision="int8", num_threads=n)
        yield f"{tag} variants", lambda n, q=q, k=k, v=v, H=Hq: sdpa(
            q, k, v, is_causal=True, causal_alignment=3, enable_gqa=True, window_size=(40, 2),
            alibi_slopes=np.linspace(0.05, 0.5, H), softcap=20.0, sinks=np.linspace(-1, 1, H),
            scale=0.11, return_lse=True, precision="int8", num_threads=n)
    Hkv, D, S = 2, 64, 700
    k, v = (rng.standard_normal((1, Hkv, S, D)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((1, 8, 6, D)).astype(np.float32)
    for storage in ("int8", "int4"):
        def cached(n: int, storage: str = storage) -> Any:
            cache = fastattn.KVCache(1, Hkv, S, D, storage=storage)
            cache.append(k, v)
            return (cache.attend(q[:, :, :1], return_lse=True, precision="int8", num_threads=n),
                    cache.attend(q, is_causal=True, precision="int8", num_threads=n))
        yield f"kvcache-int8 {storage}", cached


def layer_cases(rng: np.random.Generator) -> Iterator[tuple[str, Case]]:
    mha = fastattn.MultiHeadAttention(64, 8, num_kv_heads=2, rng=1)
    x = rng.standard_normal((2, 21, 64)).astype(np.float32)
    yield "mha causal", lambda n: mha(x, is_causal=True, num_threads=n)
    def steps(n: int) -> Any:
        cache = mha.new_paged_cache(16, 4)
        ids = [cache.add_sequence(), cache.add_sequence()]
        outs = [mha(x[:, :5], cache=cache, seq_ids=ids, is_causal=True, num_threads=n)]
        for t in range(5, 9):
            outs.append(mha(x[:, t:t + 1], cache=cache, seq_ids=ids, num_threads=n))
        return tuple(outs)
    yield "mha paged steps", steps
    a, b = (rng.standard_normal((2, 4, 9, 32)).astype(np.float32) for _ in range(2))
    yield "matmul", lambda n: fastattn.matmul(a, b.swapaxes(-1, -2), num_threads=n)
    yield "softmax", lambda n: fastattn.softmax(a, num_threads=n)
    cos, sin = (f(np.arange(64)[:, None] * 0.1 ** np.arange(16)[None]) for f in (np.cos, np.sin))
    yield "rotary", lambda n: fastattn.rotary(a[0].transpose(1, 0, 2), np.arange(9) * 7,
                                              cos, sin, num_threads=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,2", help="thread counts (default 1,2)")
    args = parser.parse_args()
    if ml_dtypes is None:
        import sys
        print("output_hashes: no ml_dtypes, bfloat16 cases left out", file=sys.stderr)
    threads = [int(t) for t in args.threads.split(",")]
    rng = np.random.default_rng(20261206)
    cases = [*dense_cases(rng), *varlen_cases(rng), *cache_cases(rng), *layer_cases(rng),
             *int8_mode_cases(rng)]
    for path in fastattn.available_simd_paths():
        fastattn.set_simd_path(path)
        for name, case in cases:
            for n in threads:
                print(f"{name} | {path} | {n} | {digest(case(n))}", flush=True)


if __name__ == "__main__":
    main()
