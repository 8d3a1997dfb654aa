"""The short route of scaled_dot_product_attention (_dispatch.common_call):
the calls it takes give bitwise the result of the general path, and every
call it leaves, valid or not, gets the general path's result or error."""
import math
import pickle

import numpy as np
import pytest
from conftest import assert_close, f64
from test_errors import HOSTILE, misaligned, self_overlapping

import fastattn
from fastattn import _checks as C
from fastattn import _dispatch, _runtime, _storage
from fastattn import reference as ref

sdpa = fastattn.scaled_dot_product_attention
short_route = _dispatch.common_call  # kept: the fixture below switches it off
bcast = np.broadcast_to


def data(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def common_call(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                enable_gqa=False, causal_alignment="upper_left", out=None, num_threads=None):
    """What the short route returns for a call with these arguments."""
    return short_route(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                       causal_alignment, out, num_threads)


def general_path(monkeypatch, call):
    """call() with the short route switched off."""
    with monkeypatch.context() as m:
        m.setattr(_dispatch, "common_call", lambda *args: None)
        return call()


def case(B, H, L, S, E, Ev, dtype=np.float32, **kwargs):
    """(q, k, v, kwargs) of one call, built from a seed of its own."""
    rng = np.random.default_rng([L, S, E, Ev])
    batch = tuple(d for d in (B, H) if d is not None)
    return (data(rng, batch + (L, E), dtype), data(rng, batch + (S, E), dtype),
            data(rng, batch + (S, Ev), dtype), kwargs)


rng0 = np.random.default_rng(7)
TAKEN = {  # calls the short route takes
    "tiny": case(1, 1, 4, 4, 8, 8),
    "float64": case(2, 3, 37, 53, 20, 7, np.float64),
    "2-D": case(None, None, 5, 9, 16, 16),
    "3-D, L > S, E != Ev": case(3, None, 70, 20, 24, 12),
    "causal": case(2, 2, 40, 40, 16, 16, is_causal=True),
    "causal lower_right": case(1, 2, 5, 60, 8, 8, is_causal=True, causal_alignment="lower_right"),
    "scale": case(1, 2, 9, 9, 8, 8, scale=0.3),
    "scale 0": case(1, 2, 9, 9, 8, 8, scale=0.0),
    "dropout int 0": case(1, 1, 4, 4, 8, 8, dropout_p=0),
    "2 threads": case(2, 4, 70, 70, 32, 32, num_threads=2),
    "bool mask (L, S)": case(2, 3, 6, 7, 8, 8, attn_mask=rng0.random((6, 7)) > 0.3),
    "bool mask (B, 1, 1, S)": case(2, 3, 6, 7, 8, 8, attn_mask=rng0.random((2, 1, 1, 7)) > 0.3),
    "bool mask (L, S), one head": case(1, 1, 6, 7, 8, 8, attn_mask=rng0.random((6, 7)) > 0.3),
    "bool mask full": case(2, 3, 6, 7, 8, 8, attn_mask=rng0.random((2, 3, 6, 7)) > 0.3),
    "float mask": case(2, 3, 6, 7, 8, 8, attn_mask=np.where(
        rng0.random((6, 7)) > 0.3, rng0.standard_normal((6, 7)), -np.inf).astype(np.float32)),
    "mask and causal": case(1, 2, 6, 6, 8, 8, is_causal=True, attn_mask=rng0.random((6, 6)) > 0.5),
    "L = 0": case(1, 2, 0, 5, 8, 8),
    "S = 0": case(1, 2, 5, 0, 8, 8),
    "E = 0": case(1, 2, 5, 5, 0, 8),
}


def strided(rng):
    """The (B, L, H, E) layout seen as (B, H, L, E), a reversed axis, a
    misaligned copy of the value and a non-contiguous mask."""
    q = data(rng, (2, 9, 3, 8)).transpose(0, 2, 1, 3)
    k = data(rng, (2, 3, 11, 8))[:, :, ::-1]
    v = misaligned((2, 3, 11, 6))
    v[...] = data(rng, (2, 3, 11, 6))
    mask = (rng.random((2, 3, 11, 9)) > 0.3).transpose(0, 1, 3, 2)
    return q, k, v, {"attn_mask": mask}


TAKEN["strided, misaligned"] = strided(np.random.default_rng(1))


def gqa(B, Hq, Hkv, L, S, E, Ev, **kwargs):
    """(q, k, v, kwargs) of a grouped-query call: Hq query heads, Hkv key/value heads."""
    q, _, _, _ = case(B, Hq, L, S, E, Ev)
    _, k, v, _ = case(B, Hkv, L, S, E, Ev)
    return q, k, v, dict(kwargs, enable_gqa=True)


def decode_step(rng):
    """A model's decoding step: one token of 8 query heads over 2 key/value
    heads, written through out= into the (B, L, H, Ev) layout it returns."""
    q = data(rng, (2, 1, 8, 16)).transpose(0, 2, 1, 3)
    k, v = data(rng, (2, 2, 30, 16)), data(rng, (2, 2, 30, 16))
    out = np.full((2, 1, 8, 16), np.nan, np.float32).transpose(0, 2, 1, 3)
    mask = rng.random((2, 1, 1, 30)) > 0.2
    return q, k, v, {"enable_gqa": True, "out": out, "attn_mask": mask, "is_causal": True,
                     "causal_alignment": "lower_right"}


TAKEN.update({
    "grouped-query": gqa(2, 6, 2, 9, 11, 8, 8),
    "grouped-query, Hq = Hkv": gqa(1, 3, 3, 5, 7, 8, 4),
    "grouped-query 3-D": (data(rng0, (4, 3, 8)), data(rng0, (2, 5, 8)), data(rng0, (2, 5, 8)),
                          {"enable_gqa": True}),
    "out": case(2, 3, 6, 7, 8, 5, out=np.empty((2, 3, 6, 5), np.float32)),
    "out Fortran-ordered": case(2, 3, 6, 7, 8, 8, out=np.empty((2, 3, 6, 8), np.float32, order="F")),
    "out float64, causal": case(1, 2, 9, 9, 8, 8, np.float64, is_causal=True,
                                out=np.empty((1, 2, 9, 8))),
    "decoding step": decode_step(np.random.default_rng(2)),
    # unpickled arrays (multiprocessing) carry an equal dtype that is another object
    "unpickled": pickle.loads(pickle.dumps(case(1, 2, 6, 7, 8, 8, attn_mask=rng0.random((6, 7)) > 0.5,
                                                out=np.empty((1, 2, 6, 8), np.float32)))),
})

LEFT = {  # valid calls the short route leaves to the general path
    "leading axes broadcast": case(2, 3, 6, 7, 8, 8)[:2] + (data(rng0, (1, 3, 7, 8)), {}),
    "np.bool_ flag": case(1, 2, 6, 6, 8, 8, is_causal=np.True_),
    "int scale": case(1, 2, 6, 6, 8, 8, scale=1),
    "np.float64 scale": case(1, 2, 6, 6, 8, 8, scale=np.float64(0.5)),
    "float16 mask": case(1, 2, 6, 7, 8, 8, attn_mask=rng0.standard_normal((6, 7)).astype(np.float16)),
    "float64 mask, float32 call": case(1, 2, 6, 7, 8, 8, attn_mask=rng0.standard_normal((6, 7))),
    "float16 inputs": case(1, 2, 6, 7, 8, 8, np.float16),
    "alignment a str subclass": case(1, 2, 4, 6, 8, 8, is_causal=True,
                                     causal_alignment=np.str_("lower_right")),
    "grouped-query, batch broadcast": gqa(2, 4, 2, 5, 6, 8, 8)[:1] + (
        data(rng0, (1, 2, 6, 8)), data(rng0, (1, 2, 6, 8)), {"enable_gqa": True}),
    "grouped-query flag np.True_": gqa(1, 4, 2, 5, 6, 8, 8)[:3] + ({"enable_gqa": np.True_},),
}


def expected(q, k, v, kwargs):
    kwargs = dict(kwargs)
    for name in ("num_threads", "dropout_p", "out"):
        kwargs.pop(name, None)
    mask = kwargs.pop("attn_mask", None)
    rq, rk, rv = f64(q, k, v)
    if mask is not None:
        mask = mask if mask.dtype == bool else mask.astype(q.dtype).astype(np.float64)
    return ref.scaled_dot_product_attention(rq, rk, rv, attn_mask=mask, **kwargs)


def check(q, k, v, kwargs, monkeypatch):
    """sdpa against the general path (bitwise) and the float64 reference;
    an out array is the result, each path writing its own copy of it."""
    given = kwargs.get("out")
    out = sdpa(q, k, v, **dict(kwargs, out=None if given is None else given.copy()))
    general = general_path(monkeypatch, lambda: sdpa(
        q, k, v, **dict(kwargs, out=None if given is None else given.copy())))
    np.testing.assert_array_equal(out, general)
    if given is not None:
        mine = given.copy()
        assert sdpa(q, k, v, **dict(kwargs, out=mine)) is mine
        np.testing.assert_array_equal(mine, out)
    r = expected(q, k, v, kwargs)
    assert_close(out, r, q.dtype, q.shape[-1] + k.shape[-2],
                 magnitude=float(np.abs(v).max(initial=1)))


@pytest.mark.parametrize("name", TAKEN)
def test_calls_taken_give_the_general_paths_result(name, monkeypatch):
    q, k, v, kwargs = TAKEN[name]
    assert common_call(q, k, v, **kwargs) is not None
    check(q, k, v, kwargs, monkeypatch)


@pytest.mark.parametrize("name", LEFT)
def test_valid_calls_left_to_the_general_path(name, monkeypatch):
    q, k, v, kwargs = LEFT[name]
    assert common_call(q, k, v, **kwargs) is None
    check(q, k, v, kwargs, monkeypatch)


def test_only_plain_ndarrays_and_default_options_reach_it(monkeypatch):
    """Subclasses and the options the short route does not read (the
    variants, need_weights, return_lse) never reach it."""
    q, k, v, _ = TAKEN["tiny"]

    class Sub(np.ndarray):
        pass

    seen = []
    monkeypatch.setattr(_dispatch, "common_call", lambda *args: seen.append(args))
    for args, kwargs in [((q.view(Sub), k, v), {}), ((q, k, v), {"out": np.empty_like(q).view(Sub)}),
                         ((q, k, v), {"need_weights": True}),
                         ((q, k, v), {"return_lse": True}), ((q, k, v), {"window_size": (2, 0)}),
                         ((q, k, v), {"softcap": 30.0}),
                         ((q, k, v), {"alibi_slopes": np.ones(1)}),
                         ((q, k, v), {"sinks": np.zeros(1)})]:
        sdpa(*args, **kwargs)
    assert seen == []
    sdpa(q, k, v)
    assert len(seen) == 1


# Bad calls that pass the caller's test for the short route, chosen at its
# own checks' edges; the hostile table adds many more.
f32 = np.zeros((2, 3, 4, 8), np.float32)
EDGES = [
    ((f32, f32, f32), {"scale": float("inf")}),
    ((f32, f32, f32), {"scale": np.float32("nan")}),
    ((f32, f32, f32), {"dropout_p": True}),
    ((f32, f32, f32), {"dropout_p": -0.5}),
    ((f32, f32, f32), {"causal_alignment": "Upper_Left"}),
    ((f32, f32, f32), {"is_causal": np.int8(1)}),
    ((f32, f32, f32), {"num_threads": np.int64(0)}),
    ((f32, f32, f32), {"num_threads": _runtime.MAX_THREADS + 1}),
    ((f32, f32, f32), {"attn_mask": f32[0, 0, :, :4].astype(np.int8)}),
    ((f32, f32, f32), {"attn_mask": np.zeros((4, 5), np.float32)}),
    ((f32, f32, f32), {"attn_mask": np.zeros((7, 2, 3, 4, 4), bool)}),
    ((f32, f32[..., :1, :], f32), {}),
    ((f32, f32, f32[:, :2]), {}),
    ((f32[0, :2], f32, f32), {}),
    ((f32, f32, f32.astype(np.float64)), {}),
    ((f32.astype(">f4"), f32.astype(">f4"), f32.astype(">f4")), {}),
    ((bcast(np.zeros((1, 1), np.float32), (4, 2**20 + 1)),) * 3, {}),  # E past the bound
    ((bcast(np.zeros((1, 1, 1), np.float32), (2**40, 2**12, 1)),) * 3, {}),  # the scores
    ((f32, f32, f32), {"out": np.empty((2, 3, 4, 7), np.float32)}),
    ((f32, f32, f32), {"out": np.empty((2, 3, 4, 8), np.float64)}),
    ((f32, f32, f32), {"out": np.frombuffer(bytes(f32.nbytes), np.float32).reshape(f32.shape)}),
    ((f32, f32, f32), {"out": bcast(np.zeros(8, np.float32), f32.shape)}),
    ((f32, f32, f32), {"out": self_overlapping(f32.shape)}),
    ((f32, f32, f32), {"out": misaligned(f32.shape)}),
    ((f32, f32, f32), {"out": f32}),
    ((f32, f32, f32), {"out": np.empty((2, 3, 4, 8), np.float32), "num_threads": 0}),
    ((f32, f32, f32), {"out": np.empty((2, 3, 4, 7), np.float32), "num_threads": 0}),
    ((f32, f32[:, :2], f32[:, :2]), {"enable_gqa": True}),
    ((f32, f32[:, :0], f32[:, :0]), {"enable_gqa": True}),
    ((f32, f32[:, :1], f32[:, :3]), {"enable_gqa": True}),
    ((f32[0, 0], f32[0, 0], f32[0, 0]), {"enable_gqa": True}),
    ((f32, f32[:, :1], f32[:, :1]), {"enable_gqa": 1}),
]


def raised(call):
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("args,kwargs", EDGES + [(p.values[1], p.values[2]) for p in HOSTILE
                                                 if p.values[0] is sdpa])
def test_errors_are_the_general_paths(args, kwargs, monkeypatch):
    with_route = raised(lambda: sdpa(*args, **kwargs))
    assert general_path(monkeypatch, lambda: raised(lambda: sdpa(*args, **kwargs))) == with_route


@pytest.mark.parametrize("storage", _storage.FLOAT32_STORAGES)
@pytest.mark.parametrize("padding", [False, True])
def test_a_cache_step_takes_it(padding, storage, monkeypatch):
    """KVCache.attend on a float32 cache in any storage, queries of its
    dtype, grouped-query heads, Ev != E: the short route, with the general
    path's bits (the kernel reads every storage itself)."""
    rng = np.random.default_rng(3)
    cache = fastattn.KVCache(2, 2, 40, 16, value_dim=32, storage=storage)
    pad = np.arange(30) >= np.array([[30], [25]]) if padding else None  # True = padding
    cache.append(data(rng, (2, 2, 30, 16)), data(rng, (2, 2, 30, 32)), key_padding_mask=pad)
    q, out = data(rng, (2, 6, 1, 16)), np.empty((2, 6, 1, 32), np.float32)
    seen = []
    taken = _dispatch.common_call
    monkeypatch.setattr(_dispatch, "common_call",
                        lambda *a: seen.append(a[-1] is None) or taken(*a))
    mine = cache.attend(q, out=out)
    # the cache's own buffers are passed as stored (their storage) unless float32
    assert mine is out and seen == [storage == "float32"]
    general = general_path(monkeypatch, lambda: cache.attend(q))
    np.testing.assert_array_equal(mine, general)
    # a float16 query on the same cache: left to the general path (which
    # rounds the float32 result once), the same result as before
    seen.clear()
    q16 = q.astype(np.float16)
    half = cache.attend(q16)
    assert len(seen) == 1 and half.dtype == np.float16
    np.testing.assert_array_equal(half, cache.attend(q16.astype(np.float32)).astype(np.float16))


def test_num_threads_is_resolved_once(monkeypatch):
    """A call on the short route asks resolve_threads once, with the argument."""
    calls = []
    resolve = _runtime.resolve_threads
    monkeypatch.setattr(_runtime, "resolve_threads", lambda n: calls.append(n) or resolve(n))
    q, k, v, _ = TAKEN["tiny"]
    sdpa(q, k, v, num_threads=1)
    sdpa(q, k, v)
    assert calls == [1, None]



@pytest.mark.parametrize("shape,target", [((4, 5), (1, 1, 4, 5)), ((3, 1, 5), (1, 3, 1, 5)),
                                          ((), (1, 1)), ((4, 5), (2, 4, 5)),
                                          ((1, 5), (3, 4, 5)), ((2, 4, 5), (2, 4, 5))])
def test_broadcast_view_is_a_view_of_the_target_shape(shape, target):
    """Leading axes of 1 are added by indexing (a tenth of broadcast_to's
    time), anything else by broadcast_to: either way a view, no copy."""
    a = np.arange(math.prod(shape), dtype=np.float32).reshape(shape)
    view = C.broadcast_view(a, target)
    assert view.shape == target
    assert np.shares_memory(view, a)
    np.testing.assert_array_equal(view, np.broadcast_to(a, target))
