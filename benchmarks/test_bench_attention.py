"""pytest-benchmark suite of issue 3: fastattn, NumPy as a user writes it,
PyTorch's scaled_dot_product_attention, ONNX Runtime's MultiHeadAttention
(both key/value layouts) and OpenVINO's ScaledDotProductAttention op on
the shapes of fastattn.bench.SHAPES, at 1 and 2 threads.  One group per
shape and thread count.  The runners are those of `fastattn bench`
(fastattn/bench/runners.py); peers not installed are skipped.

    pip install -r requirements-bench.txt && pytest benchmarks/

Unlike `fastattn bench`, every case runs in this one process (no peak
memory, no % of peak); each one's output is checked against the float64
reference before it is timed, and the error is kept in extra_info."""
import pytest

from fastattn.bench import RUNNERS, SHAPES, THREADS
from fastattn.bench.runners import output_errors, reference_rows

pytest.importorskip("pytest_benchmark")

STORAGE_ROUNDING = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8, "int8": 1 / 254}


@pytest.mark.parametrize("threads", THREADS, ids=lambda n: f"{n}thr")
@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_attention(benchmark, attention_inputs, shape, runner, threads):
    why = RUNNERS[runner].missing(shape)
    if why:
        pytest.skip(why)
    q, k, v = attention_inputs(shape.name)
    benchmark.group = f"{shape.name} ({shape.describe()}), {threads} thread{'s' * (threads > 1)}"
    with RUNNERS[runner].setup(q, k, v, shape, threads) as prepared:
        out = prepared.call()  # the warm-up call, and the one that is checked
        err, rms = output_errors(prepared.to_bhle(out), q, k, v, shape, reference_rows(shape))
        del out
        benchmark(prepared.call)
    benchmark.extra_info["max_abs_err"], benchmark.extra_info["rms_err"] = err, rms
    if benchmark.stats is not None:  # None under --benchmark-disable
        median = benchmark.stats.stats.median
        if shape.kind == "decode":
            benchmark.extra_info["GB/s"] = shape.kv_bytes / median / 1e9
        else:
            benchmark.extra_info["GFLOP/s"] = shape.flops / median / 1e9
    # a runner whose answer is wrong must not report a speed; a 16- or 8-bit
    # cache moves each key and value element by its rounding (half an ulp,
    # int8: max|row| / 254), which moves the output by at most about twice
    # that times max|v| to first order (through the scores and the values)
    bound = 1e-4 + 2 * STORAGE_ROUNDING[shape.storage] * float(abs(v).max())
    assert err < bound, f"{runner} is off the float64 reference by {err:.2e} (bound {bound:.1e})"
