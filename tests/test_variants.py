"""The attention variants (window, ALiBi, soft-cap, sinks, log-sum-exp),
merge_attention and varlen_attention: against the float64 reference under
hypothesis, alone and combined, on every SIMD path; against PyTorch with the
equivalent explicit bias where PyTorch can express it; key blocks outside
every window never read."""
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from conftest import assert_close, f64, simd_path
from hypothesis import given
from hypothesis import strategies as st
from test_properties import (BATCH, DTYPES, FEATURES, KEYS, LENGTHS, PATHS, SEEDS, THREADS,
                             check_layout_and_batch, random_array, random_mask)

import fastattn
from fastattn import reference as ref

try:  # bfloat16 inputs are ml_dtypes' (an optional dependency)
    import ml_dtypes
except ImportError:
    ml_dtypes = None

sdpa = fastattn.scaled_dot_product_attention


@st.composite
def variants(draw, rng, B, H, L, S):
    """Keyword arguments: any combination of the variants."""
    kw = {}
    if draw(st.booleans()):
        side = st.one_of(st.just(-1), st.integers(0, 9), st.integers(0, L + S + 2))
        kw["window_size"] = (draw(side), draw(side))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(H,), (B, H)] if B else [(H,)]))
        kw["alibi_slopes"] = rng.random(shape) * draw(st.sampled_from([0.05, 0.5, 1.0]))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([0.5, 2.0, 30.0]))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(H,), (B, H)] if B else [(H,)]))
        kw["sinks"] = rng.standard_normal(shape) * 2
        if draw(st.booleans()):
            kw["sinks"][..., 0] = -np.inf
    return kw


def check_lse(lse, expected, dtype, n):
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(expected))
    fin = np.isfinite(expected)
    assert_close(lse[fin], expected[fin], dtype, n,
                 magnitude=float(np.abs(expected[fin]).max(initial=1)))


@given(st.data())
def test_variants(data):
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    B, H = draw(BATCH), draw(st.integers(1, 3))
    L, S, E, Ev = draw(LENGTHS), draw(KEYS), draw(FEATURES), draw(FEATURES)
    q = random_array(draw, rng, (B, H, L, E), dtype)
    k = random_array(draw, rng, (B, H, S, E), dtype)
    v = random_array(draw, rng, (B, H, S, Ev), dtype)
    kwargs = dict(draw(variants(rng, B, H, L, S)),
                  attn_mask=random_mask(draw, rng, (B, H, L, S), dtype) if draw(st.booleans())
                  else None,
                  is_causal=draw(st.booleans()),
                  causal_alignment=draw(st.one_of(st.sampled_from(["upper_left", "lower_right"]),
                                                  st.integers(-(L + S + 2), L + S + 2))))
    mask = kwargs["attn_mask"]
    rmask = None if mask is None else (mask.astype(dtype) if mask.dtype.kind == "f"
                                       else mask).astype(np.float64 if mask.dtype.kind == "f"
                                                         else bool)
    with simd_path(draw(PATHS)):
        out, w, lse = sdpa(q, k, v, need_weights=True, return_lse=True, **kwargs)
        plain = sdpa(q, k, v, **kwargs)
        np.testing.assert_array_equal(plain, out)  # asking for more changes no bit
        np.testing.assert_array_equal(sdpa(q, k, v, num_threads=draw(THREADS), **kwargs), out)
        slopes = kwargs.get("alibi_slopes")
        if (slopes is None or slopes.ndim == 1) and np.ndim(kwargs.get("sinks")) < 2:
            check_layout_and_batch(draw, (q, k, v), kwargs, out, (B, H), False)
    r_out, r_w, r_lse = ref.scaled_dot_product_attention(
        *f64(q, k, v), need_weights=True, return_lse=True, **dict(kwargs, attn_mask=rmask))
    n = E + S
    assert_close(out, r_out, dtype, n, magnitude=float(np.abs(v).max(initial=1)))
    assert_close(w, r_w, dtype, n)
    check_lse(lse, r_lse, dtype, n)


@given(st.data())
def test_merge_attention_of_key_shards(data):
    """Attention over keys split in shards, merged: the attention over all,
    with the positional variants placed by an int causal_alignment per shard
    (query i at key position i + base - a in the shard of keys a..b-1) and
    the sinks given to one shard."""
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    H, L, S, E = draw(st.integers(1, 3)), draw(st.integers(1, 9)), draw(st.integers(1, 300)), 8
    q = rng.standard_normal((H, L, E)).astype(dtype)
    k = rng.standard_normal((H, S, E)).astype(dtype)
    v = rng.standard_normal((H, S, E)).astype(dtype)
    mask = rng.random((H, L, S)) < draw(st.sampled_from([0.0, 0.3, 1.0]))
    kw = dict(draw(variants(rng, 0, H, L, S)), is_causal=draw(st.booleans()))
    alignment = draw(st.sampled_from(["upper_left", "lower_right"]))
    base = S - L if alignment == "lower_right" else 0
    sinks = kw.pop("sinks", None)
    cuts = sorted(draw(st.lists(st.integers(0, S), max_size=3)))
    edges = [0] + cuts + [S]
    with simd_path(draw(PATHS)):
        parts = [sdpa(q, k[:, a:b], v[:, a:b], attn_mask=mask[:, :, a:b], return_lse=True,
                      causal_alignment=base - a, sinks=None if n else sinks, **kw)
                 for n, (a, b) in enumerate(zip(edges, edges[1:]))]
        out, lse = fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    r_out, r_lse = ref.scaled_dot_product_attention(*f64(q, k, v), attn_mask=mask,
                                                    return_lse=True, causal_alignment=alignment,
                                                    sinks=sinks, **kw)
    assert_close(out, r_out, dtype, E + S, magnitude=4)
    check_lse(lse, r_lse, dtype, E + S)


def test_merge_attention_returns_plain_arrays_in_the_outputs_layout(tmp_path):
    # a memmap (an ndarray subclass) in, a plain array out; parts given
    # transposed come back in their layout, the merge's sums those of
    # the contiguous parts
    rng = np.random.default_rng(0)
    outs = [rng.standard_normal((3, 4, 8)).astype(np.float32) for _ in range(2)]
    lses = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(2)]
    held = np.lib.format.open_memmap(tmp_path / "part.npy", "w+", np.float32, (3, 4, 8))
    held[...] = outs[0]
    out, lse = fastattn.merge_attention([held, outs[1]], lses)
    assert type(out) is np.ndarray and type(lse) is np.ndarray
    want, _ = fastattn.merge_attention(outs, lses)
    np.testing.assert_array_equal(out, want)
    swapped = [np.ascontiguousarray(o.transpose(1, 0, 2)).transpose(1, 0, 2) for o in outs]
    got, _ = fastattn.merge_attention(swapped, lses)
    np.testing.assert_array_equal(got, want)
    assert got.transpose(1, 0, 2).flags.c_contiguous


@given(st.data())
def test_varlen(data):
    """Packed sequences: each the reference's attention over its own keys,
    and bit for bit what scaled_dot_product_attention gives it alone."""
    draw = data.draw
    dtype = draw(DTYPES)
    rng = np.random.default_rng(draw(SEEDS))
    n = draw(st.integers(0, 5))
    lq = [draw(LENGTHS) for _ in range(n)]
    lk = [draw(LENGTHS) for _ in range(n)]
    Hkv, group, E, Ev = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(FEATURES), 5
    Hq = Hkv * group
    cq, ck = (np.concatenate([[0], np.cumsum(x, dtype=np.int64)]).astype(
        draw(st.sampled_from([np.int32, np.int64]))) for x in (lq, lk))
    q = random_array(draw, rng, (int(cq[-1]), Hq, E), dtype, broadcast=False)
    k = random_array(draw, rng, (int(ck[-1]), Hkv, E), dtype, broadcast=False)
    v = random_array(draw, rng, (int(ck[-1]), Hkv, Ev), dtype, broadcast=False)
    kwargs = dict(draw(variants(rng, n, Hq, max(lq, default=0), max(lk, default=0))),
                  is_causal=draw(st.booleans()),
                  causal_alignment=draw(st.sampled_from(["upper_left", "lower_right"])))
    if np.ndim(kwargs.get("sinks")) == 2:
        kwargs["sinks"] = kwargs["sinks"][0]
    with simd_path(draw(PATHS)):
        out, lse = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True,
                                             num_threads=draw(THREADS), **kwargs)
        for b in range(n):
            one = dict(kwargs)
            if np.ndim(one.get("alibi_slopes")) == 2:
                one["alibi_slopes"] = one["alibi_slopes"][b]
            qb, kb, vb = (x[c[b]:c[b + 1]].transpose(1, 0, 2)
                          for x, c in ((q, cq), (k, ck), (v, ck)))
            r_out, r_lse = ref.scaled_dot_product_attention(*f64(qb, kb, vb), enable_gqa=True,
                                                            return_lse=True, **one)
            got, got_lse = out[cq[b]:cq[b + 1]].transpose(1, 0, 2), lse[:, cq[b]:cq[b + 1]]
            assert_close(got, r_out, dtype, E + lk[b], magnitude=4)
            check_lse(got_lse, r_lse, dtype, E + lk[b])
            alone = sdpa(qb, kb, vb, enable_gqa=True, **one)
            np.testing.assert_array_equal(got, alone)


def test_variants_match_pytorch_explicit_bias(simd, dtype):
    """A window with ALiBi, causal or not, as PyTorch computes it with the
    same bias built as a float mask."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    B, H, L, S, E = 2, 4, 70, 200, 32
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in
               ((B, H, L, E), (B, H, S, E), (B, H, S, E)))
    slopes = 2.0 ** -np.arange(1, H + 1)  # BLOOM's slopes for 4 heads... halved each head
    i = np.arange(L)[:, None] + S - L
    j = np.arange(S)[None, :]
    for causal, window in ((True, (30, -1)), (False, (10, 25))):
        hidden = (j < i - window[0]) | ((j > i) if causal else (j > i + window[1]))
        bias = np.where(hidden, -np.inf, -slopes[:, None, None] * np.abs(i - j)).astype(dtype)
        ours = sdpa(q, k, v, is_causal=causal, causal_alignment="lower_right",
                    window_size=window, alibi_slopes=slopes)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), attn_mask=torch.from_numpy(bias)).numpy()
        assert_close(ours, theirs.astype(np.float64), dtype, E + S)


NEVER_READ = r"""
import ctypes, mmap, sys
import numpy as np
import fastattn
fastattn.set_simd_path(sys.argv[1])
S, E, L = 8192, 16, 64
page = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * S * E * 4 + page)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
start = (-base) % page
k = np.frombuffer(buf, np.float32, S * E, start).reshape(S, E)
v = np.frombuffer(buf, np.float32, S * E, start + S * E * 4).reshape(S, E)
rng = np.random.default_rng(0)
k[:], v[:] = rng.standard_normal((2, S, E))
q = rng.standard_normal((L, E)).astype(np.float32)
want = fastattn.reference.scaled_dot_product_attention(
    q.astype(float), k[-200:].astype(float), v[-200:].astype(float), is_causal=True,
    causal_alignment="lower_right", window_size=(100, 0))
# the first half of the keys and of the values: no access at all from here on
libc = ctypes.CDLL(None)
for a in (k, v):
    assert libc.mprotect(ctypes.c_void_p(a.ctypes.data), S * E * 2, 0) == 0
for rows in (L, 1):  # the block kernel, the row kernel
    out = fastattn.scaled_dot_product_attention(q[-rows:], k, v, is_causal=True,
                                                causal_alignment="lower_right",
                                                window_size=(100, 0))
    np.testing.assert_allclose(out, want[-rows:], rtol=1e-5, atol=1e-5)
print("ok")
"""


@pytest.mark.skipif(sys.platform != "linux", reason="mprotect through ctypes, Linux")
@pytest.mark.parametrize("path", fastattn.available_simd_paths())
def test_keys_outside_every_window_are_never_read(path):
    """The first half of the keys and values made unreadable (PROT_NONE):
    a window that does not reach them must not touch them (a read would
    end the process with SIGSEGV)."""
    r = subprocess.run([sys.executable, "-c", NEVER_READ, path], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_window_as_a_band_mask():
    """A causal window is the band mask it stands for: weights exactly 0
    outside, and the log-sum-exp of the band (the window sums its keys in
    blocks that start elsewhere, so to rounding, not bit for bit)."""
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 300, 16)).astype(np.float32)
    out, w, lse = sdpa(q, q, q, is_causal=True, window_size=(20, 0), need_weights=True,
                       return_lse=True)
    i, j = np.arange(300)[:, None], np.arange(300)[None, :]
    assert not w[..., (j < i - 20) | (j > i)].any()
    _, lse_band = sdpa(q, q, q, attn_mask=(j >= i - 20) & (j <= i), return_lse=True)
    np.testing.assert_allclose(lse, lse_band, rtol=1e-6)


def test_cache_steps_match_the_full_pass_with_variants():
    """MultiHeadAttention and its KVCache take the variants: a prompt then
    a token a step gives the rows of one causal pass with the same options
    (the positions count from the cache's start, bottom-right aligned)."""
    rng = np.random.default_rng(5)
    mha = fastattn.MultiHeadAttention(32, 4, num_kv_heads=2, rng=rng)
    x = rng.standard_normal((2, 12, 32)).astype(np.float32)
    options = dict(window_size=(3, 0), alibi_slopes=rng.random(4), softcap=5.0,
                   sinks=rng.standard_normal(4))
    full, _ = mha(x, is_causal=True, **options)
    cache = mha.new_cache(batch_size=2, capacity=16)
    steps = [mha(x[:, :5], cache=cache, **options)[0]]
    steps += [mha(x[:, t:t + 1], cache=cache, **options)[0] for t in range(5, 12)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=1e-5, atol=1e-6)


def test_flash_attention_off_values():
    """FlashAttention's "off" values mean off here too (issue 28): softcap
    0.0 is no soft-cap, and any negative window side is unbounded, as -1."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 9, 8)).astype(np.float32)
    plain = sdpa(q, q, q, is_causal=True)
    np.testing.assert_array_equal(sdpa(q, q, q, is_causal=True, softcap=0.0), plain)
    np.testing.assert_array_equal(sdpa(q, q, q, is_causal=True, window_size=(-5, -2)), plain)
    np.testing.assert_array_equal(sdpa(q, q, q, window_size=(-7, 2)),
                                  sdpa(q, q, q, window_size=(-1, 2)))


def test_varlen_causal_alignment_is_flash_attentions():
    """varlen_attention aligns its causal mask bottom-right by default, as
    flash_attn_varlen_func does: one query over two keys sees both."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 8)).astype(np.float32)
    k = rng.standard_normal((2, 1, 8)).astype(np.float32)
    v = rng.standard_normal((2, 1, 4)).astype(np.float32)
    cu_q, cu_k = np.array([0, 1]), np.array([0, 2])
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True)
    both = sdpa(q.transpose(1, 0, 2), k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    np.testing.assert_array_equal(out, both.transpose(1, 0, 2))
    upper = fastattn.varlen_attention(q, k, v, cu_q, cu_k, is_causal=True,
                                      causal_alignment="upper_left")
    np.testing.assert_array_equal(upper[0, 0], v[0, 0])


HALF = [np.float16] + ([ml_dtypes.bfloat16] if ml_dtypes is not None else [])


@pytest.mark.parametrize("dtype", [np.float32, np.float64] + HALF,
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("alignment", ["upper_left", "lower_right", -3, 5])
def test_varlen_is_sdpa_per_sequence_bit_for_bit(simd, dtype, alignment):
    """varlen_attention runs paged_attention's scheduler: a decoding
    sequence's keys split, the query heads of a key/value head together,
    16-bit inputs read as float32, an int alignment for every sequence; each
    sequence's output and lse are those of scaled_dot_product_attention on
    its rows alone, bit for bit."""
    rng = np.random.default_rng(7)
    lens_q, lens_k = [1, 3, 0, 70, 2, 1], [8192, 2500, 5, 70, 0, 17]
    Hq, Hkv, E, Ev = 8, 2, 32, 24
    cq, ck = (np.concatenate([[0], np.cumsum(x)]) for x in (lens_q, lens_k))
    q = rng.standard_normal((cq[-1], Hq, E)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hkv, E)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hkv, Ev)).astype(dtype)
    options = dict(is_causal=True, causal_alignment=alignment, softcap=20.0,
                   alibi_slopes=np.linspace(0.01, 0.2, Hq), sinks=np.linspace(-2, 1, Hq))
    out, lse = fastattn.varlen_attention(q, k, v, cq, ck, return_lse=True, **options)
    assert out.dtype == dtype and out.shape == (cq[-1], Hq, Ev)
    for b in range(len(lens_q)):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(1, 0, 2) for x, c in ((q, cq), (k, ck), (v, ck)))
        alone, alone_lse = sdpa(qb, kb, vb, enable_gqa=True, return_lse=True, **options)
        np.testing.assert_array_equal(out[cq[b]:cq[b + 1]].transpose(1, 0, 2), alone)
        np.testing.assert_array_equal(lse[:, cq[b]:cq[b + 1]], alone_lse)


@pytest.mark.parametrize("alignment", [-10, -3, 2, 9])
@pytest.mark.parametrize("window", [(0, 5), (2, 0), (4, 4), (-1, 1)])
def test_varlen_int_alignment_with_a_window(alignment, window):
    """The window's reach counts the alignment's offset (|i' - j| up to
    L + S + |k|): a side within it hides keys as scaled_dot_product_attention
    hides them."""
    rng = np.random.default_rng(5)
    lens_q, lens_k = [1, 4, 7], [1, 9, 3]
    cq, ck = (np.concatenate([[0], np.cumsum(x)]) for x in (lens_q, lens_k))
    q, k, v = (rng.standard_normal((c[-1], 2, 4)) for c in (cq, ck, ck))
    out = fastattn.varlen_attention(q, k, v, cq, ck, causal_alignment=alignment,
                                    window_size=window)
    for b in range(3):
        qb, kb, vb = (x[c[b]:c[b + 1]].transpose(1, 0, 2) for x, c in ((q, cq), (k, ck), (v, ck)))
        np.testing.assert_array_equal(
            out[cq[b]:cq[b + 1]].transpose(1, 0, 2),
            sdpa(qb, kb, vb, causal_alignment=alignment, window_size=window))


def test_varlen_alibi_bias_past_float32_is_refused():
    q = np.ones((1, 1, 4), np.float32)
    k = np.ones((2, 1, 4), np.float32)
    with pytest.raises(ValueError, match="alibi_slopes x 1e[+]09 must be finite in float32"):
        fastattn.varlen_attention(q, k, k, np.array([0, 1]), np.array([0, 2]),
                                  causal_alignment=10**9, alibi_slopes=np.array([1e30]))
