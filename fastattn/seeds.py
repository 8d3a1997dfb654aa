"""The worked examples of two attention tutorials (blog posts in Chinese,
named by their titles), as data: `fastattn demo` walks through them.

Each example gives its inputs and every number the tutorial prints, at the
precision it prints it.  The demo and the tests recompute all of them with
the C kernels; where a tutorial's number is not the exact result rounded to
its precision, the exact one wins and the difference is reported.
"""
import math
from dataclasses import dataclass, field

import numpy as np


QUANTITIES = {
    "scores": "scores Q K^T",
    "scaled": "scaled scores Q K^T / sqrt(d_k)",
    "exps": "exp of the scaled scores",
    "exp_sums": "sum of those exps",
    "weights": "weights A = softmax(scaled + M)",
    "out": "output O = A V",
}


@dataclass
class Claim:
    """Row `row` of `quantity` (a key of QUANTITIES), as a tutorial prints it."""
    quantity: str
    row: int
    printed: tuple
    decimals: int


@dataclass
class Example:
    title: str
    source: str              # the title of the tutorial it comes from
    tokens: tuple
    x: np.ndarray            # inputs, one row per token (already projected, or X with W = I)
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool = False
    claims: list = field(default_factory=list)


def _a(rows):
    return np.array(rows, dtype=np.float64)


SEED1 = "Transformer 中的 Attention 如何计算？"
SEED2 = "Attention计算全过程：从QK转置到Softmax加权求和一步步拆解"
_S1_Q = _a([[1, 0], [0, 1]])
_S1_V = _a([[2, 0], [0, 4]])
_S2_X = _a([[1, 0], [0, 1], [1, 1]])

EXAMPLES = [
    Example(
        "Two tokens, no mask", SEED1, ("t1", "t2"), _S1_Q, _S1_Q, _S1_Q, _S1_V,
        claims=[
            Claim("scaled", 0, (0.7071, 0.0), 4),
            Claim("weights", 0, (0.6698, 0.3302), 4),
            Claim("weights", 1, (0.3302, 0.6698), 4),
            Claim("out", 0, (1.3395, 1.3210), 4),
            Claim("out", 1, (0.6605, 2.6790), 4),
        ]),
    Example(
        "Two tokens, causal mask", SEED1, ("t1", "t2"), _S1_Q, _S1_Q, _S1_Q, _S1_V, causal=True,
        claims=[
            Claim("weights", 0, (1.0, 0.0), 4),
            Claim("out", 0, (2.0, 0.0), 4),
        ]),
    Example(
        "Three tokens 我 爱 你, W_Q = W_K = W_V = I", SEED2, ("我", "爱", "你"),
        _S2_X, _S2_X, _S2_X, _S2_X,
        claims=[
            Claim("scores", 0, (1, 0, 1), 0),
            Claim("scores", 1, (0, 1, 1), 0),
            Claim("scores", 2, (1, 1, 2), 0),
            Claim("scaled", 0, (0.71, 0, 0.71), 2),
            Claim("scaled", 1, (0, 0.71, 0.71), 2),
            Claim("scaled", 2, (0.71, 0.71, 1.41), 2),
            Claim("exps", 0, (2.03, 1.00, 2.03), 2),
            Claim("exp_sums", 0, (5.06,), 2),
            Claim("weights", 0, (0.40, 0.20, 0.40), 2),
            Claim("weights", 1, (0.20, 0.40, 0.40), 2),
            Claim("weights", 2, (0.27, 0.27, 0.46), 2),
            Claim("out", 2, (0.73, 0.73), 2),
        ]),
]


def compute(ex):
    """Every intermediate of one example, computed with the C kernels: the
    step-by-step path (matmul, scale, additive mask, softmax) and the fused
    kernel, which must agree."""
    import fastattn

    d_k = ex.q.shape[-1]
    scores = fastattn.matmul(ex.q, np.ascontiguousarray(ex.k.T))
    scaled = scores / math.sqrt(d_k)
    L, S = scores.shape
    visible = fastattn.reference.causal_mask(L, S) if ex.causal else np.ones((L, S), bool)
    mask = np.where(visible, 0.0, -np.inf)
    exps = np.where(visible, np.exp(scaled), 0.0)
    weights = fastattn.softmax(scaled, mask=mask)
    out, fused_weights = fastattn.scaled_dot_product_attention(
        ex.q, ex.k, ex.v, is_causal=ex.causal, need_weights=True)
    return dict(scores=scores, scaled=scaled, mask=mask, exps=exps,
                exp_sums=exps.sum(axis=-1, keepdims=True), weights=weights,
                stepwise_out=fastattn.matmul(weights, ex.v), fused_weights=fused_weights, out=out)


def check(ex, steps):
    """[(claim, exact value, matches)] for every claim of an example: a claim
    matches when every exact value rounds to the printed one."""
    results = []
    for c in ex.claims:
        exact = tuple(float(x) for x in steps[c.quantity][c.row])
        ok = all(round(e, c.decimals) == round(p, c.decimals) for e, p in zip(exact, c.printed))
        results.append((c, exact, ok))
    return results
