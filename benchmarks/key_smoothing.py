"""What smooth_k and rotate_k do to the error of a quantised cache.

    python benchmarks/key_smoothing.py            # Markdown table on stdout
    python benchmarks/key_smoothing.py --no-real  # synthetic data only

Each row: one storage (int8, int4), one choice of the two options, the
output's relative RMS error and mean cosine similarity against float64
attention over the data before it was stored, read exactly and in the int8
mode.  A decoding step: one query over 4096 keys of 8 heads of 128.
Keys: (a) random normal; (b) the same plus a per-channel bias four times
their spread, the same for every position (the case SageAttention's
smoothing is for); (c) four channels twenty times the others' spread (the
outliers Hadamard rotation spreads).  With (d), if the bundled
all-MiniLM-L6-v2 is installed (int4_granularity.minilm), the real queries,
keys and values of its 6 layers x 12 heads of 32 on 512 tokens: the last 4
positions' queries, one at a time, over every key.
"""
from __future__ import annotations

import argparse

import numpy as np

import fastattn
from fastattn import reference as ref

OPTIONS = [(False, False), (True, False), (False, True), (True, True)]


def synthetic(rng, kind):
    shape = (1, 8, 4096, 128)
    k = rng.standard_normal(shape).astype(np.float32)
    if kind == "bias 4x":
        k += np.float32(4.0) * rng.standard_normal(128).astype(np.float32)
    if kind == "outlier channels":
        k[..., rng.choice(128, 4, replace=False)] *= 20
    v = rng.standard_normal(shape).astype(np.float32)
    q = rng.standard_normal((1, 8, 1, 128)).astype(np.float32)
    return q, k, v


def real(queries=4):
    from int4_granularity import minilm
    qkv = minilm(512)
    if qkv is None:
        return None
    q, k, v = (x.astype(np.float32)[None] for x in qkv)  # (1, 72, S, 32)
    return q[:, :, -queries:], k, v


def errors(q, k, v, storage, smooth, rotate, precision):
    """rel RMS and mean cosine of each query row, one call per row (decoding)."""
    cache = fastattn.KVCache(1, k.shape[1], k.shape[2], k.shape[3], storage=storage,
                             smooth_k=smooth, rotate_k=rotate)
    cache.append(k, v)
    out = np.concatenate([cache.attend(q[:, :, i:i + 1], is_causal=False, precision=precision)
                          for i in range(q.shape[2])], axis=2).astype(np.float64)
    exact = ref.scaled_dot_product_attention(*(x.astype(np.float64) for x in (q, k, v)))
    rel = np.sqrt(np.mean((out - exact) ** 2) / np.mean(exact ** 2))
    a, b = out.reshape(-1, out.shape[-1]), exact.reshape(-1, exact.shape[-1])
    cos = np.mean(np.sum(a * b, axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))
    return rel, cos


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-real", action="store_true", help="synthetic data only")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    data = [(kind, synthetic(rng, kind)) for kind in ("normal", "bias 4x", "outlier channels")]
    if not args.no_real:
        qkv = real()
        if qkv is not None:
            data.append(("MiniLM layers", qkv))
    print("| keys | cache | smooth_k | rotate_k | exact: rel RMS | cosine "
          "| int8 mode: rel RMS | cosine |")
    print("|---|---|---|---|---|---|---|---|")
    for kind, (q, k, v) in data:
        for storage in ("int8", "int4"):
            for smooth, rotate in OPTIONS:
                cells = []
                for precision in ("exact", "int8"):
                    rel, cos = errors(q, k, v, storage, smooth, rotate, precision)
                    cells += [f"{rel:.2e}", f"{cos:.4f}"]
                print(f"| {kind} | {storage} | {'yes' if smooth else '-'} | "
                      f"{'yes' if rotate else '-'} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
