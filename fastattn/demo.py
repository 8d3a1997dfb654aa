"""`fastattn demo`: the tutorials' worked examples, step by step, on the C kernels."""
import math

import numpy as np

from . import seeds


def _show(label, a, out=print):
    """A matrix to 4 decimals, rows aligned under the label."""
    rows = ["[" + ", ".join("-inf" if v == -np.inf else f"{v:.4f}" for v in r) + "]"
            for r in np.atleast_2d(a)]
    prefix = f"  {label:<10}= "
    out(prefix + "[" + (",\n" + " " * (len(prefix) + 1)).join(rows) + "]")


def run_example(ex, out=print):
    steps = seeds.compute(ex)
    out(f"\n== {ex.title}\n   from: {ex.source}\n   tokens: {' '.join(ex.tokens)}")
    _show("Q", ex.q, out=out)
    _show("K", ex.k, out=out)
    _show("V", ex.v, out=out)
    _show("Q K^T", steps["scores"], out=out)
    _show(f"/ sqrt({ex.q.shape[-1]})", steps["scaled"], out=out)
    _show("mask M", steps["mask"], out=out)
    _show("A", steps["weights"], out=out)
    _show("O = A V", steps["out"], out=out)
    agree = (np.allclose(steps["weights"], steps["fused_weights"], rtol=0, atol=1e-12)
             and np.allclose(steps["stepwise_out"], steps["out"], rtol=0, atol=1e-12))
    out(f"  fused kernel and step-by-step path agree to 1e-12: {'yes' if agree else 'NO'}")
    results = seeds.check(ex, steps)
    differ = 0
    for claim, exact, ok in results:
        label = f"{seeds.QUANTITIES[claim.quantity]}, row {ex.tokens[claim.row]}"
        printed = ", ".join(f"{p:.{claim.decimals}f}" for p in claim.printed)
        exact_s = ", ".join(f"{e:.4f}" for e in exact)
        if ok:
            out(f"  ok      {label}: tutorial [{printed}], exact [{exact_s}]")
        else:
            differ += 1
            out(f"  DIFFERS {label}: tutorial prints [{printed}], the exact value is [{exact_s}]")
    return differ, agree


def scaling_check(d_k=64, n=200_000, seed=0, out=print):
    """Why divide by sqrt(d_k): for q, k with independent unit-variance
    components, q.k has mean 0 and variance d_k; after the division, 1."""
    from . import matmul

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 1, d_k))
    k = rng.standard_normal((n, d_k, 1))
    dots = matmul(q, k).ravel()
    out(f"\n== Scaling by 1/sqrt(d_k), d_k = {d_k}, {n} random pairs")
    out(f"  q.k: mean {dots.mean():+.3f}, variance {dots.var():.2f} (theory: 0 and {d_k})")
    out(f"  q.k / sqrt(d_k): variance {(dots / math.sqrt(d_k)).var():.3f} (theory: 1)")
    out("  note: seed 003 says the dot product's expected value grows 64-fold; it is its "
        "variance that grows with d_k (seed 000 says so); the mean stays 0.")
    return dots


def plot(path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'fastattn[plot]'") from None
    romanised = {"我": "wo", "爱": "ai", "你": "ni"}
    fig, axes = plt.subplots(1, len(seeds.EXAMPLES), figsize=(4.6 * len(seeds.EXAMPLES), 4),
                             layout="constrained")
    for ax, ex in zip(axes, seeds.EXAMPLES):
        w = seeds.compute(ex)["weights"]
        labels = [romanised.get(t, t) for t in ex.tokens]
        im = ax.imshow(w, vmin=0, vmax=1, cmap="viridis")
        ax.set_xticks(range(len(labels)), labels)
        ax.set_yticks(range(len(labels)), labels)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(ex.title.replace(" 我 爱 你", " (wo ai ni)"), fontsize=9)
        for i in range(w.shape[0]):
            for j in range(w.shape[1]):
                ax.text(j, i, f"{w[i, j]:.4f}", ha="center", va="center",
                        color="white" if w[i, j] < 0.5 else "black", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="attention weight")
    fig.savefig(path, dpi=120)
    print(f"\nweights written to {path}")


def main(plot_path=None):
    from . import simd_path

    print(f"fastattn demo: the worked examples of two attention tutorials (in Chinese; their "
          f"titles are below), on the {simd_path()} kernels")
    differ, all_agree = 0, True
    for ex in seeds.EXAMPLES:
        d, agree = run_example(ex)
        differ += d
        all_agree &= agree
    scaling_check()
    print(f"\n{differ} printed value(s) in the tutorials differ from the exact result; "
          "fastattn gives the exact one.")
    if plot_path:
        plot(plot_path)
    return 0 if all_agree else 1
