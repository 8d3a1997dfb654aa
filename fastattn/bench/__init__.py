"""Benchmarks: fastattn against NumPy, PyTorch's
scaled_dot_product_attention, ONNX Runtime's MultiHeadAttention and
OpenVINO's ScaledDotProductAttention op, with the machine's own peaks (FMA throughput, memory read bandwidth) measured in the
same run.

* shapes: the shapes table and the work of each call
* runners: each implementation called the way its users call it
* measure: timing, peak memory, the peak loops of csrc/fa_peak*.c
* worker / suite: one case per fresh process (fastattn on each SIMD path
  asked for), the whole run
* report / cli: the table, JSON and plot; `fastattn bench`

The project's own targets are judged apart, from the JSON, by
benchmarks/targets.py.

Used by `fastattn bench` and by the pytest-benchmark suite in benchmarks/.
"""
from .measure import PeakRSS, fma_peak, read_bandwidth, time_call
from .runners import PEERS, RUNNERS, Prepared, Runner, numpy_attention
from .shapes import ALL_SHAPES, LONG_16384, SHAPES, THREADS, TINY, Shape

__all__ = ["SHAPES", "THREADS", "TINY", "LONG_16384", "ALL_SHAPES", "Shape", "RUNNERS", "PEERS", "Runner",
           "Prepared", "numpy_attention", "time_call", "PeakRSS", "fma_peak", "read_bandwidth"]
