"""Shared pieces of the pytest-benchmark suite (run with `pytest benchmarks/`,
never part of the plain `pytest`, whose testpaths is tests/)."""
import functools

import pytest

from fastattn.bench import ALL_SHAPES, THREADS, measure


@functools.lru_cache(maxsize=2)
def _inputs(shape_name):
    return ALL_SHAPES[shape_name].inputs(seed=0)


@pytest.fixture
def attention_inputs():
    """query, key, value of a shape by name (the same seed as `fastattn bench`)."""
    return _inputs


def pytest_benchmark_update_machine_info(config, machine_info):
    """Record with the timings what they depend on: the CPU, fastattn's SIMD
    path, and this machine's FMA peak and read bandwidth at each thread
    count (the loops of csrc/fa_peak*.c)."""
    machine_info["fastattn"] = measure.machine_info()
    machine_info["fastattn_peaks"] = {
        str(n): {"fma_gflops": measure.fma_peak(n)["gflops"],
                 "read_gbps": measure.read_bandwidth(n)["gbps"]} for n in THREADS}
