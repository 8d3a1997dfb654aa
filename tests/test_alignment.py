"""Misaligned arrays (views one byte into a buffer, which np.ascontiguousarray
keeps as they are) are copied before C reads them: the C code loads whole
elements and may assume their alignment.  A spy on the compiled module checks
every array that reaches it; CI's sanitizer build (.ci/sanitize.sh, UBSan's
alignment check) would also stop at any misaligned load."""
import numpy as np
import pytest
from test_errors import misaligned as misaligned_zeros

import fastattn
from fastattn import _core

ENTRIES = ("attention", "ragged", "rotary", "narrow", "int8_operands", "int8_rows", "col_sums")


def misaligned(a):
    """A C-contiguous copy of a whose elements start one byte off alignment."""
    a = np.asarray(a)
    m = misaligned_zeros(a.shape, a.dtype)
    m[...] = a
    assert not m.flags.aligned and m.flags.c_contiguous
    return m


@pytest.fixture
def spy(monkeypatch):
    """Fails a call of the compiled entries that passes a misaligned array."""
    for name in ENTRIES:
        def checked(*args, _call=getattr(_core, name), _name=name, **kwargs):
            for i, a in enumerate(list(args) + list(kwargs.values())):
                if isinstance(a, np.ndarray):
                    assert a.flags.aligned, f"_core.{_name}: argument {i} is misaligned"
            return _call(*args, **kwargs)
        monkeypatch.setattr(_core, name, checked)


def test_the_spy_catches_a_misaligned_array(spy):
    x = misaligned(np.arange(6, dtype=np.float32))
    with pytest.raises(AssertionError, match="misaligned"):
        _core.narrow(0, _core.STORE_F16, x, np.empty(6, np.float16), 1)


def test_paged_attention(spy, rng):
    Hq, Hkv, E, bs = 4, 2, 16, 4
    kc, vc = (rng.standard_normal((6, Hkv, bs, E)).astype(np.float32) for _ in range(2))
    q = rng.standard_normal((3, Hq, E)).astype(np.float32)
    table = np.array([[2, 0], [5, 1]], np.int32)
    lens, cu = np.array([7, 5], np.int64), np.array([0, 1, 3], np.int64)
    options = dict(alibi_slopes=np.linspace(0.1, 0.5, Hq), sinks=np.linspace(-1, 1, Hq),
                   return_lse=True)
    want = fastattn.paged_attention(q, kc, vc, table, lens, cu, **options)
    got = fastattn.paged_attention(
        misaligned(q), misaligned(kc), misaligned(vc), misaligned(table), misaligned(lens),
        misaligned(cu), **{**options, "alibi_slopes": misaligned(options["alibi_slopes"]),
                           "sinks": misaligned(options["sinks"])})
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)


def test_varlen_attention(spy, rng):
    q, k, v = (rng.standard_normal((7, 2, 8)) for _ in range(3))
    cu = np.array([0, 3, 7], np.int64)  # (int32 ones are converted: copied)
    want = fastattn.varlen_attention(q, k, v, cu, cu, is_causal=True)
    got = fastattn.varlen_attention(misaligned(q), misaligned(k), misaligned(v), misaligned(cu),
                                    misaligned(cu), is_causal=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("E", [4, 40])
def test_the_int8_modes_operands(spy, rng, E):
    """The int8 mode rounds the keys and values in C (its one call, and the
    general path a mask takes): misaligned inputs are copied first (UBSan
    stopped at their loads)."""
    q, k, v = (rng.standard_normal((1, 2, 3, E)).astype(np.float32) for _ in range(3))
    mask = np.tril(np.ones((3, 3), np.bool_))
    for options in ({}, {"attn_mask": mask}):
        want = fastattn.scaled_dot_product_attention(q, k, v, precision="int8", **options)
        got = fastattn.scaled_dot_product_attention(misaligned(q), misaligned(k), misaligned(v),
                                                    precision="int8", **options)
        np.testing.assert_array_equal(got, want)
    cu = np.array([0, 1, 3], np.int64)
    want = fastattn.varlen_attention(q[0, 0, :, None], k[0, 0, :, None], v[0, 0, :, None], cu, cu,
                                     precision="int8")
    got = fastattn.varlen_attention(misaligned(q[0, 0, :, None]), misaligned(k[0, 0, :, None]),
                                    misaligned(v[0, 0, :, None]), cu, cu, precision="int8")
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("storage", ["float16", "bfloat16", "int8"])
def test_cache_appends(spy, rng, storage):
    if storage == "bfloat16":
        pytest.importorskip("ml_dtypes")
    key, value = (rng.standard_normal((5, 2, 8)).astype(np.float32) for _ in range(2))
    caches = [fastattn.PagedKVCache(4, 4, 2, 8, storage=storage) for _ in range(2)]
    for cache, rows in zip(caches, ((key, value), (misaligned(key), misaligned(value)))):
        s = cache.add_sequence()
        cache.append([s], *rows, cu_seqlens=misaligned(np.array([0, 5])))
    np.testing.assert_array_equal(caches[1].key_cache, caches[0].key_cache)
    np.testing.assert_array_equal(caches[1].value_cache, caches[0].value_cache)
    dense = fastattn.KVCache(1, 2, 8, 8, storage=storage)
    dense.append(misaligned(key.transpose(1, 0, 2)[None]), misaligned(value.transpose(1, 0, 2)[None]))
    q = rng.standard_normal((1, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(dense.attend(q[:, :, None], is_causal=False)[:, :, 0],
                                  caches[0].attend([0], q, is_causal=False))


def test_rotary_and_half_precision(spy, rng):
    x = rng.standard_normal((5, 2, 8)).astype(np.float32)
    angles = np.arange(16)[:, None] * 0.1 ** np.arange(4)[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    positions = np.array([3, 0, 9, 15, 2], np.int64)
    np.testing.assert_array_equal(
        fastattn.rotary(misaligned(x), misaligned(positions), misaligned(cos), misaligned(sin)),
        fastattn.rotary(x, positions, cos, sin))
    q = rng.standard_normal((2, 3, 8)).astype(np.float16)
    np.testing.assert_array_equal(fastattn.scaled_dot_product_attention(*(misaligned(q),) * 3),
                                  fastattn.scaled_dot_product_attention(q, q, q))
