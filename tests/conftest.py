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
import numpy as np
import pytest

import fastattn


def tolerance(dtype, n):
    return 8 * max(int(n), 16) * float(np.finfo(dtype).eps)


def assert_close(actual, expected, dtype, n, magnitude=1.0):
    """actual (dtype) within the bound of a length-n reduction of expected (float64)."""
    assert actual.dtype == np.dtype(dtype)
    assert actual.shape == expected.shape
    tol = tolerance(dtype, n) * max(1.0, magnitude)
    np.testing.assert_allclose(actual, expected, rtol=tol, atol=tol)


@pytest.fixture(params=fastattn.available_simd_paths())
def simd(request):
    """Runs a test once per SIMD path this CPU has (portable, and avx2 when present)."""
    before = fastattn.simd_path()
    fastattn.set_simd_path(request.param)
    yield request.param
    fastattn.set_simd_path(before)


@pytest.fixture(params=[np.float32, np.float64], ids=["f32", "f64"])
def dtype(request):
    return np.dtype(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(12345)


def f64(*arrays):
    return [None if a is None else (a.astype(np.float64) if a.dtype.kind == "f" else a)
            for a in arrays]


def load_example(name):
    """examples/<name>.py of the source tree, imported as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"fastattn_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
