"""Shared fixtures and the tolerance model of the test suite.

Every kernel result is compared with fastattn.reference evaluated in
float64 on the same inputs.  The tolerance is the textbook forward-error
bound of a floating-point reduction of length n, gamma_n ~ n * eps (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., sec. 3.1), with
a factor 8 for the parts of attention that are not a plain sum (the exp,
within 1 ulp; the final division; the rescaling of the online softmax).
n is the longest reduction of the case (E for the scores plus S for the
weighted sum), and the bound is relative to the magnitude of the values.
"""
import contextlib
import os

import numpy as np
import pytest
from hypothesis import settings

import fastattn
from fastattn import reference as ref

# Property tests (test_properties.py): "ci", the default, is bounded and
# derandomized, so that every CI run draws the same examples; "thorough"
# draws many more, at random.  Choose with pytest --hypothesis-profile=NAME
# (or FASTATTN_HYPOTHESIS_PROFILE=NAME).  "emulated" is "ci" with a tenth of
# the examples, for .ci/aarch64.sh: under qemu every example costs some 30
# times as much, and the whole "ci" set alone would take over half an hour
# (tests/test_exp.py's sweeps take fewer inputs there too).
settings.register_profile("ci", max_examples=300, derandomize=True, deadline=None,
                          print_blob=True)
settings.register_profile("emulated", max_examples=30, derandomize=True, deadline=None,
                          print_blob=True)
settings.register_profile("thorough", max_examples=3000, deadline=None, print_blob=True)
PROFILE = os.environ.get("FASTATTN_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def tolerance(dtype, n):
    return 8 * max(int(n), 16) * float(np.finfo(dtype).eps)


def assert_close(actual, expected, dtype, n, magnitude=1.0):
    """actual (dtype) within the bound of a length-n reduction of expected (float64)."""
    assert actual.dtype == np.dtype(dtype)
    assert actual.shape == expected.shape
    tol = tolerance(dtype, n) * max(1.0, magnitude)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


@contextlib.contextmanager
def simd_path(name):
    """The SIMD path set to name inside the block, restored after it."""
    before = fastattn.simd_path()
    fastattn.set_simd_path(name)
    try:
        yield name
    finally:
        fastattn.set_simd_path(before)


@contextlib.contextmanager
def without_int8_dot():
    """The int8 mode's products without the CPU's dot-product instruction
    inside the block (FASTATTN_INT8_DOT=off), as on a CPU that lacks it."""
    from fastattn import _runtime
    before = _runtime._int8_dot
    _runtime._int8_dot = False
    try:
        yield
    finally:
        _runtime._int8_dot = before


@pytest.fixture(params=fastattn.available_simd_paths())
def simd(request):
    """Runs a test once per SIMD path this CPU has (portable, and avx2 when present)."""
    with simd_path(request.param):
        yield request.param


@pytest.fixture(params=[np.float32, np.float64], ids=["f32", "f64"])
def dtype(request):
    return np.dtype(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def f64(*arrays):
    return [None if a is None else (a.astype(np.float64) if a.dtype.kind == "f" else a)
            for a in arrays]


def load_script(relative):
    """A script of the source tree (its path from the top), imported as a
    module; the test skips where the tests run without the tree beside them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / relative
    if not path.exists():
        pytest.skip(f"{relative} is not beside the tests")
    spec = importlib.util.spec_from_file_location(f"fastattn_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example(name):
    """examples/<name>.py of the source tree, imported as a module."""
    return load_script(f"examples/{name}.py")


def check_attention(q, k, v, dtype, **kwargs):
    """scaled_dot_product_attention(q, k, v, **kwargs) against the float64
    reference, output and weights; asking for the weights must not change a
    bit of the output.  Returns the output and the weights."""
    out, w = fastattn.scaled_dot_product_attention(q, k, v, need_weights=True, **kwargs)
    mask = kwargs.pop("attn_mask", None)
    rq, rk, rv, rm = f64(q, k, v, mask)
    if rm is not None and mask.dtype.kind == "f":
        rm = mask.astype(dtype).astype(np.float64)  # the kernel adds the mask in query's dtype
    r_out, r_w = ref.scaled_dot_product_attention(rq, rk, rv, attn_mask=rm, need_weights=True,
                                                  **kwargs)
    # weights span every batch axis, those that only value has too
    r_w = np.broadcast_to(r_w, r_out.shape[:-2] + r_w.shape[-2:])
    n = q.shape[-1] + k.shape[-2]
    assert_close(out, r_out, dtype, n, magnitude=float(np.abs(rv).max(initial=1)))
    assert_close(w, r_w, dtype, n)
    plain = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)
    np.testing.assert_array_equal(plain, out)
    return plain, w
