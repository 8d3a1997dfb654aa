"""`fastattn demo`: two worked examples of attention, step by step, on the C kernels.

The examples, their inputs and the numbers their tutorials print are in
seeds.py; everything shown here is computed from those inputs."""
import math
import sys
import textwrap

import numpy as np

from . import seeds

DESCRIPTION = (
    "Walks through the worked examples of two attention tutorials (blog posts in Chinese): "
    "two tokens, without and with a causal mask, and three tokens 我 爱 你. For each it prints "
    "the inputs Q, K, V, then every step of softmax(Q K^T / sqrt(d_k) + M) V computed with "
    "fastattn's C kernels: the scores, the scaled scores, their exponentials and row sums, the "
    "weights A and the output O = A V. It checks these against the numbers the tutorial prints "
    "and says where one is wrong, then shows on random vectors why the scores are divided by "
    "sqrt(d_k).")


def _show(label, a, out=print):
    """A vector or a matrix to 4 decimals, rows aligned under the label."""
    rows = ["[" + ", ".join("-inf" if v == -np.inf else f"{v:.4f}" for v in r) + "]"
            for r in np.atleast_2d(a)]
    prefix = f"  {label:<14}= "
    if np.ndim(a) == 1:
        out(prefix + rows[0])
    else:
        out(prefix + "[" + (",\n" + " " * (len(prefix) + 1)).join(rows) + "]")


# the quantities of seeds.QUANTITIES, as a sentence names them
_NAMES = {"scores": "scores", "scaled": "scaled scores", "exps": "exps", "exp_sums": "sum",
          "weights": "weights", "out": "output"}


def _say(text, out=print):
    """A sentence of prose, wrapped and indented under the matrices."""
    out(textwrap.fill(text, width=100, initial_indent="  ", subsequent_indent="  "))


def _values(values, decimals):
    return ", ".join(f"{v:.{decimals}f}" for v in values)


def tutorial_note(ex, results):
    """One sentence on how the tutorial's printed numbers compare with the
    exact ones: they agree at its rounding, or where a row does not, what it
    prints and what the exact values are."""
    wrong = [(c, exact) for c, exact, ok in results if not ok]
    if not wrong:
        return (f"The {len(results)} rows of numbers the tutorial prints agree with these at "
                "its rounding.")
    rows = []
    for row in dict.fromkeys(c.row for c, _ in wrong):
        claims = [(c, exact) for c, exact in wrong if c.row == row]
        printed = " and ".join(f"{_NAMES[c.quantity]} {_values(c.printed, c.decimals)}"
                               for c, _ in claims)
        exact = " and ".join(_values(e, 4) for _, e in claims)
        rows.append(f"row {ex.tokens[row]}, which it prints as {printed}; the exact values "
                    f"are {exact}")
    return (f"The tutorial's other printed rows ({len(results) - len(wrong)}) agree with these "
            f"at its rounding; not so " + "; and ".join(rows) + ".")


def run_example(ex, out=print):
    """Print one example step by step; returns whether the fused kernel
    agrees with the step-by-step path."""
    steps = seeds.compute(ex)
    d_k = ex.q.shape[-1]
    out(f"\n== {ex.title}\n   from the tutorial \"{ex.source}\"\n"
        f"   tokens: {', '.join(ex.tokens)} (one row each); d_k = {d_k}")
    _show("Q", ex.q, out=out)
    _show("K", ex.k, out=out)
    _show("V", ex.v, out=out)
    _show("S = Q K^T", steps["scores"], out=out)
    _show(f"S / sqrt({d_k})", steps["scaled"], out=out)
    if ex.causal:
        _show("mask M", steps["mask"], out=out)
        _say("(a token sees itself and the tokens before it: M adds -inf after the diagonal)",
             out=out)
    _show("exp", steps["exps"], out=out)
    _show("row sums", steps["exp_sums"].ravel(), out=out)
    _show("A = exp / sum", steps["weights"], out=out)
    _show("O = A V", steps["out"], out=out)
    agree = (np.allclose(steps["weights"], steps["fused_weights"], rtol=0, atol=1e-12)
             and np.allclose(steps["stepwise_out"], steps["out"], rtol=0, atol=1e-12))
    _say("The fused kernel (scaled_dot_product_attention) gives the same A and O to 1e-12: "
         + ("yes." if agree else "NO."), out=out)
    _say(tutorial_note(ex, seeds.check(ex, steps)), out=out)
    return agree


def scaling_check(d_k=64, n=200_000, seed=0, out=print):
    """Why divide by sqrt(d_k): for q, k with independent unit-variance
    components, q.k has mean 0 and variance d_k; after the division, 1."""
    from . import matmul

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, 1, d_k))
    k = rng.standard_normal((n, d_k, 1))
    dots = matmul(q, k).ravel()
    out(f"\n== Why the scores are divided by sqrt(d_k): {n} random pairs q, k, d_k = {d_k}")
    _say("With independent unit-variance components, q.k has mean 0 and variance d_k, so "
         "unscaled scores spread out as d_k grows and the softmax saturates; divided by "
         "sqrt(d_k) their variance is 1 whatever d_k.", out=out)
    out(f"  q.k: mean {dots.mean():+.3f}, variance {dots.var():.2f} (theory: 0 and {d_k})")
    out(f"  q.k / sqrt(d_k): variance {(dots / math.sqrt(d_k)).var():.3f} (theory: 1)")
    return dots


def plot(path):
    """Draw the weight matrices of the examples as heatmaps into path, a PNG
    file written under exactly that name.  Needs matplotlib (ImportError
    otherwise); OSError when the file cannot be written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = weights_figure()
    try:
        fig.savefig(path, dpi=120, format="png")
    finally:
        plt.close(fig)


def weights_figure():
    """The weight matrices of the examples as heatmaps: a matplotlib figure
    (the documentation draws it while it builds)."""
    import matplotlib.pyplot as plt

    romanised = {"我": "wo", "爱": "ai", "你": "ni"}  # the default fonts have no CJK glyphs
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
    return fig


def main(plot_path=None):
    """Print the walk-through (and with plot_path draw the weights); 0 when
    the fused kernel agrees with the step-by-step path, else 1."""
    from . import simd_path

    print(textwrap.fill("fastattn demo: attention, softmax(Q K^T / sqrt(d_k) + M) V, step by step "
                        "on the worked examples of two tutorials (blog posts in Chinese), "
                        f"computed with fastattn's {simd_path()} kernels", width=100))
    all_agree = all([run_example(ex) for ex in seeds.EXAMPLES])
    scaling_check()
    if plot_path:
        try:
            plot(plot_path)
        except OSError as e:
            print(f"fastattn demo: cannot write {plot_path}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"\nweights drawn in {plot_path}")
    return 0 if all_agree else 1
