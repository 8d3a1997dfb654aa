"""Property-based tests (hypothesis) of attention, softmax, matmul and the
head layout.

Each example draws shapes (0, 1, primes and both sides of every block size
of the kernels), the strides of every operand (axes transposed in memory,
sliced with a step, reversed, broadcast with stride 0), boolean or float
masks of any broadcastable shape with fully hidden rows and -inf, both
causal alignments, grouped-query attention, float32 or float64, a SIMD path
and a thread count.  Every result is compared with the float64 NumPy
reference under the tolerance model of conftest.py; every thread count,
contiguous copies of the operands and (attention) a batch item computed
alone must give the same bits; an ``out`` array is written through its
strides and nowhere else; the inputs are never modified.

The number of examples comes from the hypothesis profile (conftest.py):
"ci" by default, ``pytest --hypothesis-profile=thorough`` for thousands.
"""
import contextlib

import numpy as np
from conftest import assert_close, check_attention, f64, simd_path
from hypothesis import given
from hypothesis import strategies as st

import fastattn
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention

DTYPES = st.sampled_from([np.dtype(np.float32), np.dtype(np.float64)])
PATHS = st.sampled_from(fastattn.available_simd_paths())
THREADS = st.integers(1, 4)
SEEDS = st.integers(0, 2**32 - 1)
# Both sides of the kernels' blocks: the row kernel (up to 4 query rows),
# the query block (64 rows in float32, 32 in float64), the key blocks (128,
# 256), the matmul cache blocks (96, 256) and micro-tile (6 x 16 floats, 6 x
# 8 doubles); and primes.
EDGES = [11, 13, 16, 17, 31, 32, 33, 37, 63, 64, 65, 67, 68, 69, 95, 96, 97, 127, 128, 129,
         255, 256, 257]
LENGTHS = st.one_of(st.integers(0, 9), st.sampled_from(EDGES))
# Keys: also about the row kernel's blocks (1024) and past 2048, where
# decoding (few rows and heads) splits them in pieces computed apart and
# merged.
KEYS = st.one_of(LENGTHS, st.sampled_from([1023, 1024, 1025, 2047, 2048, 3001, 4161]))
FEATURES = st.one_of(st.integers(0, 9), st.sampled_from([16, 17, 31, 33, 64, 65]))
BATCH = st.sampled_from([1, 2, 3, 1, 2, 3, 0])  # a zero now and then


@st.composite
def layouts(draw, ndim, broadcast=True):
    """How an array is stored: its axes' order in memory, a step per axis
    (every 2nd or 3rd element), reversed axes, and broadcast (stride-0) axes."""
    def flags():
        return st.lists(st.booleans(), min_size=ndim, max_size=ndim)
    return (draw(st.permutations(range(ndim))),
            draw(st.lists(st.sampled_from([1, 2, 3]), min_size=ndim, max_size=ndim)),
            draw(flags()),
            draw(flags()) if broadcast else [False] * ndim)


def stored_shape(shape, layout):
    """The shape of the values to store: 1 on the broadcast axes."""
    return tuple(1 if b else n for n, b in zip(shape, layout[3]))


class Stored:
    """values laid out in memory as layout says and seen with shape; the
    gaps between elements hold fill."""

    def __init__(self, values, shape, layout, fill):
        order, steps, flips, _ = layout
        self.fill = fill
        values = np.asarray(values)
        self.base = np.full([values.shape[a] * steps[a] for a in order], fill, values.dtype)
        self.view = self.base.transpose(np.argsort(order))[
            (...,) + tuple(slice(None, None, -s if f else s) for s, f in zip(steps, flips))]
        self.view[...] = values
        self.array = self.view if self.view.shape == tuple(shape) else np.broadcast_to(self.view, shape)

    def gaps_untouched(self):
        """True when nothing was written outside the view."""
        saved = self.view.copy()
        self.view[...] = self.fill
        untouched = np.array_equal(self.base, np.full_like(self.base, self.fill), equal_nan=True)
        self.view[...] = saved
        return untouched


def operand_shape(draw, full):
    """A shape that broadcasts to full: leading axes dropped, others set to 1."""
    dims = full[draw(st.integers(0, len(full))):]
    return tuple(1 if draw(st.booleans()) else n for n in dims)


def nonzero_in_float32(scale):
    """A drawn scale, 0 where float32 would round it to 0 (refused then)."""
    return scale if scale == 0 or abs(scale) >= 1e-38 else 0.0


def random_array(draw, rng, shape, dtype, scale=1.0, minus_inf=0.0, broadcast=True):
    """Normal values of shape and dtype (a fraction minus_inf of them -inf),
    stored with a random layout whose gaps hold NaN (any read of a gap shows
    in the result)."""
    layout = draw(layouts(len(shape), broadcast))
    vshape = stored_shape(shape, layout)
    values = (rng.standard_normal(vshape) * scale).astype(dtype)
    values[rng.random(vshape) < minus_inf] = -np.inf
    return Stored(values, shape, layout, np.nan).array


def random_mask(draw, rng, target, dtype):
    """None, or a bool or float mask broadcastable to target (the last two
    axes are the rows and the keys), with -inf and fully hidden rows."""
    kind = draw(st.sampled_from([None, "bool", "float32", "float64"]))
    if kind is None:
        return None
    shape = operand_shape(draw, target)
    layout = draw(layouts(len(shape)))
    vshape = stored_shape(shape, layout)
    visible = rng.random(vshape) < draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
    if len(vshape) >= 2 and vshape[-2] > 0 and draw(st.booleans()):
        rows = rng.random(vshape[-2]) < 0.5
        visible[..., rows, :] = False
    if kind == "bool":
        return Stored(visible, shape, layout, True).array
    values = np.where(visible, rng.standard_normal(vshape) * 2, -np.inf).astype(kind)
    return Stored(values, shape, layout, np.nan).array


def random_out(draw, shape, dtype):
    """None, or a writeable out array with a random layout (no broadcast)."""
    if not draw(st.booleans()):
        return None
    return Stored(np.zeros(shape, dtype), shape, draw(layouts(len(shape), broadcast=False)), 1234.5)


@contextlib.contextmanager
def unchanged(*arrays):
    """The memory behind arrays is the same after the block as before it."""
    owners = []
    for a in arrays:
        while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray):
            a = a.base
        if isinstance(a, np.ndarray):
            owners.append((a, a.copy()))
    yield
    for a, copy in owners:
        np.testing.assert_array_equal(a, copy)


def check_out_and_threads(fn, args, kwargs, expected, out, n):
    """fn(*args, **kwargs) gives expected bit for bit with n threads, and
    through out when given, writing nothing outside it."""
    np.testing.assert_array_equal(fn(*args, num_threads=n, **kwargs), expected)
    if out is not None:
        assert fn(*args, out=out.view, **kwargs) is out.view
        np.testing.assert_array_equal(out.view, expected)
        assert out.gaps_untouched()


@given(st.data())
def test_attention(data):
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    L, S, E, Ev = draw(LENGTHS), draw(KEYS), draw(FEATURES), draw(FEATURES)
    gqa = draw(st.booleans())
    if gqa:
        outer = tuple(draw(st.lists(BATCH, max_size=1)))
        Hkv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        qb, kb, vb = (operand_shape(draw, outer) + (h,) for h in (Hkv * group, Hkv, Hkv))
        batch = np.broadcast_shapes(qb[:-1], kb[:-1], vb[:-1]) + (Hkv * group,)
    else:
        full = tuple(draw(st.lists(BATCH, max_size=3)))
        qb, kb, vb = (operand_shape(draw, full) for _ in range(3))
        batch = np.broadcast_shapes(qb, kb, vb)
    q = random_array(draw, rng, qb + (L, E), dtype)
    k = random_array(draw, rng, kb + (S, E), dtype)
    v = random_array(draw, rng, vb + (S, Ev), dtype)
    kwargs = dict(attn_mask=random_mask(draw, rng, batch + (L, S), dtype),
                  is_causal=draw(st.booleans()),
                  causal_alignment=draw(st.sampled_from(["upper_left", "lower_right"])),
                  scale=draw(st.one_of(st.none(), st.floats(-2, 2).map(nonzero_in_float32))),
                  enable_gqa=gqa)
    with simd_path(draw(PATHS)), unchanged(q, k, v, kwargs["attn_mask"]):
        out, _ = check_attention(q, k, v, dtype, **kwargs)
        check_out_and_threads(sdpa, (q, k, v), kwargs, out,
                              random_out(draw, out.shape, dtype), draw(THREADS))
        check_layout_and_batch(draw, (q, k, v), kwargs, out, batch, gqa)


def check_layout_and_batch(draw, qkv, kwargs, out, batch, gqa):
    """The same numbers give the same bits in any layout, and a batch item
    the same bits alone as inside its batch."""
    mask = kwargs["attn_mask"]
    dense = dict(kwargs, attn_mask=None if mask is None else np.ascontiguousarray(mask))
    np.testing.assert_array_equal(sdpa(*(np.ascontiguousarray(a) for a in qkv), **dense), out)
    # one item of the first batch axis (not the head axis under GQA, whose
    # query heads come in groups)
    if len(batch) < 1 + gqa or batch[0] == 0:
        return
    i = draw(st.integers(0, batch[0] - 1))
    lead = batch[:-1] if gqa else batch
    core = 2 + len(batch) - len(lead)  # (L or S, E), after the head axis under GQA
    item = [np.broadcast_to(a, lead + a.shape[-core:])[i:i + 1] for a in qkv]
    if mask is not None:
        mask = np.broadcast_to(mask, batch + (out.shape[-2], qkv[1].shape[-2]))[i:i + 1]
    np.testing.assert_array_equal(sdpa(*item, **dict(kwargs, attn_mask=mask)), out[i:i + 1])


@given(st.data())
def test_attention_nonfinite(data):
    """NaN and infinities in query, key and value: the same NaN and inf
    entries as the reference, and the finite ones within tolerance.  Hidden
    keys never leak; a row with nothing visible is zeros."""
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    L = draw(st.one_of(st.integers(1, 9), st.sampled_from([17, 33, 65, 69])))
    S = draw(st.one_of(st.integers(1, 9), st.sampled_from([129, 130, 2049])))
    E, Ev, H = draw(st.integers(1, 9)), draw(st.integers(1, 9)), draw(st.integers(1, 2))
    arrays = []
    for shape in ((H, L, E), (H, S, E), (H, S, Ev)):
        a = random_array(draw, rng, shape, dtype, broadcast=False)
        for _ in range(draw(st.integers(0, 3))):
            a[tuple(rng.integers(0, n) for n in shape)] = draw(
                st.sampled_from([np.nan, np.inf, -np.inf]))
        arrays.append(a)
    q, k, v = arrays
    # bool masks, or 0 / -inf: a large finite bias could push a weight below
    # float32's range while the float64 reference keeps it
    mask = draw(st.sampled_from([None, "bool", "float"]))
    if mask is not None:
        visible = rng.random((H, L, S)) < draw(st.sampled_from([0.0, 0.5, 0.9]))
        mask = visible if mask == "bool" else np.where(visible, 0, -np.inf).astype(dtype)
    kwargs = dict(attn_mask=mask, is_causal=draw(st.booleans()),
                  causal_alignment=draw(st.sampled_from(["upper_left", "lower_right"])))
    with simd_path(draw(PATHS)):
        out_w, w = sdpa(q, k, v, need_weights=True, **kwargs)
        out = sdpa(q, k, v, **kwargs)
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=draw(THREADS), **kwargs), out)
    with np.errstate(invalid="ignore", over="ignore"):
        r_out, r_w = ref.scaled_dot_product_attention(*f64(q, k, v), need_weights=True,
                                                      **dict(kwargs, attn_mask=f64(mask)[0]))
    magnitude = np.abs(v[np.isfinite(v)]).max(initial=1)
    for got, want, magnitude in ((out, r_out, magnitude), (out_w, r_out, magnitude), (w, r_w, 1)):
        for kind in (np.isnan, np.isposinf, np.isneginf):
            np.testing.assert_array_equal(kind(got), kind(want), err_msg=kind.__name__)
        fin = np.isfinite(want)
        assert_close(got[fin], want[fin], dtype, E + S, magnitude=float(magnitude))


@given(st.data())
def test_softmax(data):
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    ndim = draw(st.integers(1, 3))
    shape = [draw(st.integers(0, 5)) for _ in range(ndim)]
    axis = draw(st.integers(-ndim, ndim - 1))
    shape[axis] = draw(st.one_of(LENGTHS, st.sampled_from([1000, 1031])))
    shape = tuple(shape)
    in_place = draw(st.booleans())
    x = random_array(draw, rng, shape, dtype, scale=draw(st.sampled_from([1, 20, 100])),
                     minus_inf=draw(st.sampled_from([0, 0, 0.3, 0.9, 1])), broadcast=not in_place)
    target = np.moveaxis(np.empty(shape), axis, -1).shape  # mask rows along the axis
    mask = random_mask(draw, rng, target, dtype)
    if mask is not None:
        mask = np.moveaxis(np.broadcast_to(mask, target), -1, axis)
    rmask = None if mask is None else f64(mask.astype(dtype) if mask.dtype.kind == "f" else mask)[0]
    expected = ref.softmax(f64(x)[0], axis=axis, mask=rmask)
    with simd_path(draw(PATHS)):
        with unchanged(x, mask):
            y = fastattn.softmax(x, axis, mask=mask)
            check_out_and_threads(fastattn.softmax, (x, axis), {"mask": mask}, y,
                                  random_out(draw, shape, dtype), draw(THREADS))
        assert_close(y, expected, dtype, shape[axis])
        dense_mask = None if mask is None else np.ascontiguousarray(mask)
        np.testing.assert_array_equal(
            fastattn.softmax(np.ascontiguousarray(x), axis, mask=dense_mask), y)
        if in_place:
            assert fastattn.softmax(x, axis, mask=mask, out=x) is x
            np.testing.assert_array_equal(x, y)


@given(st.data())
def test_matmul(data):
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    M, K, N = draw(LENGTHS), draw(LENGTHS), draw(LENGTHS)
    full = tuple(draw(st.lists(BATCH, max_size=2)))
    a = random_array(draw, rng, operand_shape(draw, full) + (M, K), dtype)
    b = random_array(draw, rng, operand_shape(draw, full) + (K, N), dtype)
    expected = f64(a)[0] @ f64(b)[0]
    with simd_path(draw(PATHS)), unchanged(a, b):
        c = fastattn.matmul(a, b)
        assert_close(c, expected, dtype, K, magnitude=np.sqrt(max(K, 1)))
        np.testing.assert_array_equal(
            fastattn.matmul(np.ascontiguousarray(a), np.ascontiguousarray(b)), c)
        check_out_and_threads(fastattn.matmul, (a, b), {}, c, random_out(draw, c.shape, dtype),
                              draw(THREADS))


@given(st.data())
def test_head_layout(data):
    """split_heads is a view equal to the reference; merge_heads copies it
    back bit for bit; merge_heads of any strided array equals the reference."""
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    lead = tuple(draw(st.lists(BATCH, max_size=2)))
    L, H, D = draw(LENGTHS), draw(st.integers(1, 5)), draw(FEATURES)
    x = random_array(draw, rng, lead + (L, H * D), dtype)
    with unchanged(x):
        heads = fastattn.split_heads(x, H)
        assert heads.shape == lead + (H, L, D)
        assert heads.size == 0 or np.shares_memory(heads, x)
        np.testing.assert_array_equal(heads, ref.split_heads(x, H))
        merged = fastattn.merge_heads(heads, num_threads=draw(THREADS))
        assert merged.flags.c_contiguous and merged.dtype == dtype
        np.testing.assert_array_equal(merged, x)
    y = random_array(draw, rng, lead + (H, L, D), dtype)
    np.testing.assert_array_equal(fastattn.merge_heads(y), ref.merge_heads(y))

