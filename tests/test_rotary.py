"""fastattn.rotary: the bits of the formula in NumPy (fastattn.reference.rotary)
and of Hugging Face transformers' apply_rotary_pos_emb."""
import numpy as np
import pytest

import fastattn
from fastattn import reference as ref


def tables(max_pos, rotary_dim, dtype=np.float32, base=10000.0):
    """Llama's cos / sin tables, (max_pos, rotary_dim / 2)."""
    inv_freq = 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.arange(max_pos)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,rotary_dim", [(64, 64), (64, 32), (10, 4), (6, 0)])
def test_the_formula_bit_for_bit(dtype, interleaved, D, rotary_dim):
    rng = np.random.default_rng(D + rotary_dim)
    x = rng.standard_normal((13, 3, D)).astype(dtype)
    positions = rng.integers(0, 50, 13)
    cos, sin = tables(50, rotary_dim, dtype)
    got = fastattn.rotary(x, positions, cos, sin, interleaved=interleaved)
    want = ref.rotary(x, positions, cos, sin, interleaved)
    assert got.dtype == dtype and got.shape == x.shape
    np.testing.assert_array_equal(got, want)


def test_strided_input_and_threads():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 20, 4, 32)).astype(np.float32).transpose(1, 2, 0, 3)[:, :, 1]
    positions = np.arange(20)[::-1].copy()
    cos, sin = tables(20, 32)
    want = ref.rotary(x, positions, cos, sin)
    for threads in (1, 2):
        np.testing.assert_array_equal(fastattn.rotary(x, positions, cos, sin,
                                                      num_threads=threads), want)


def test_the_angle_rotates_each_pair():
    """A pair rotated by a quarter turn: (1, 0) -> (0, 1); the norm of each
    pair kept (what makes q . k depend on the positions' difference)."""
    x = np.zeros((1, 1, 4), np.float32)
    x[0, 0, 0] = 1.0
    cos = np.array([[0.0, 1.0]], np.float32)
    sin = np.array([[1.0, 0.0]], np.float32)
    y = fastattn.rotary(x, np.array([0]), cos, sin)
    np.testing.assert_array_equal(y[0, 0], [0, 0, 1, 0])


def test_relative_positions():
    """q at m and k at n: rotary(q) . rotary(k) depends on m - n only."""
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 1, 1, 16))
    cos, sin = tables(40, 16, np.float64)
    dots = [float((fastattn.rotary(q, np.array([m]), cos, sin) *
                   fastattn.rotary(k, np.array([m - 5]), cos, sin)).sum()) for m in (5, 17, 39)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-12)


def test_transformers_apply_rotary_pos_emb():
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    rng = np.random.default_rng(3)
    n, H, D = 9, 4, 32
    q = rng.standard_normal((n, H, D)).astype(np.float32)
    k = rng.standard_normal((n, H, D)).astype(np.float32)
    positions = rng.integers(0, 64, n)
    cos, sin = tables(64, D)
    # transformers: (batch, heads, seq, D) with the tables repeated over both halves
    full_cos = torch.from_numpy(np.concatenate([cos, cos], axis=-1)[positions][None])
    full_sin = torch.from_numpy(np.concatenate([sin, sin], axis=-1)[positions][None])
    tq, tk = (torch.from_numpy(a.transpose(1, 0, 2)[None].copy()) for a in (q, k))
    rq, rk = llama.apply_rotary_pos_emb(tq, tk, full_cos, full_sin)
    for ours, theirs in ((fastattn.rotary(q, positions, cos, sin), rq),
                         (fastattn.rotary(k, positions, cos, sin), rk)):
        np.testing.assert_array_equal(ours, theirs[0].numpy().transpose(1, 0, 2))


@pytest.mark.parametrize("args,error,words", [
    (dict(x=np.zeros((2, 1, 4), np.float16)), TypeError, "x has dtype float16"),
    (dict(x=np.zeros((2, 4))), ValueError, "expected (n, H, D)"),
    (dict(positions=np.array([0, 9])), ValueError, "positions[1] = 9 is outside"),
    (dict(positions=np.array([0, -1])), ValueError, "positions[1] = -1"),
    (dict(positions=np.array([0.0, 1.0])), TypeError, "positions has dtype float64"),
    (dict(positions=np.array([0])), ValueError, "one per token, (2,)"),
    (dict(cos=np.zeros((5, 3))), ValueError, "rotary_dim <= the head size 4"),
    (dict(sin=np.zeros((5, 1))), ValueError, "must have one shape"),
    (dict(cos=np.zeros((5, 2), np.int64)), TypeError, "cos has dtype int64"),
    (dict(interleaved=1), TypeError, "interleaved must be a bool"),
])
def test_bad_input(args, error, words):
    call = dict(x=np.zeros((2, 1, 4)), positions=np.array([0, 1]), cos=np.zeros((5, 2)),
                sin=np.zeros((5, 2)))
    call.update(args)
    x = call.pop("x")
    with pytest.raises(error) as e:
        fastattn.rotary(x, **call)
    assert words in str(e.value)
