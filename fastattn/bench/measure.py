"""How the benchmark measures: call times, the peak memory of a call, and
the machine's own limits (FMA throughput, memory read bandwidth) at a
given thread count, with the loops of csrc/fa_peak*.c."""
import gc
import os
import statistics
from dataclasses import asdict, dataclass
from time import perf_counter

import numpy as np

import fastattn
from fastattn import _core, _peak, _runtime

from .cpu import describe


@dataclass
class Timing:
    median: float    # seconds per call
    mean: float      # the mean shows the calls that wait on a busy machine
    min: float
    max: float
    calls: int

    def asdict(self):
        return asdict(self)


def time_call(call, *, repeat=5, min_time=1.0, warmup=1, max_calls=100_000):
    """Seconds per call of call(): warmup untimed calls, then timed calls
    (time.perf_counter around each) until there are at least repeat of them
    and they add up to at least min_time seconds (at most max_calls)."""
    for _ in range(warmup):
        call()
    times = []
    total = 0.0
    while len(times) < repeat or (total < min_time and len(times) < max_calls):
        start = perf_counter()
        call()
        times.append(perf_counter() - start)
        total += times[-1]
    return Timing(statistics.median(times), statistics.fmean(times), min(times), max(times),
                  len(times))


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


class PeakRSS:
    """Peak resident memory added by the code inside the with-block, in bytes
    (self.bytes), or None where it cannot be measured (self.why says why).

    Linux only: on entry the current resident set size (VmRSS) is the
    baseline and the kernel's high-water mark (VmHWM) is reset to it by
    writing 5 to /proc/self/clear_refs; on exit the new high-water mark minus
    the baseline is the peak.  Everything already resident on entry (the
    inputs, the imported libraries) is excluded; everything the block
    allocates and touches, its output included, counts."""

    def __init__(self):
        self.bytes = None
        self.why = None

    def __enter__(self):
        gc.collect()
        try:
            self._base = _status_kib("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            if _status_kib("VmHWM") > self._base + 1024:
                raise OSError("the high-water mark did not reset")
        except OSError as e:
            self._base = None
            self.why = f"peak memory needs Linux's /proc/self/clear_refs ({e})"
        return self

    def __exit__(self, *exc):
        if self._base is not None:
            self.bytes = 1024 * (_status_kib("VmHWM") - self._base)
        return False


class OtherLoad:
    """CPU used by other processes while the with-block runs, in cores
    (self.cores: 0.0 on an idle machine, 1.0 when another process kept one
    core busy throughout), or None where it cannot be measured.

    Linux only: the machine's busy time from /proc/stat (user, nice,
    system, irq, softirq, steal) minus this process's own CPU time
    (os.times), over the wall time.  The benchmark's machine may be shared:
    this says which numbers were taken while it was."""

    def __init__(self):
        self.cores = None

    @staticmethod
    def _busy_seconds():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        try:
            self._start = (self._busy_seconds(), os.times(), perf_counter())
        except (OSError, ValueError, AttributeError):
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            busy0, times0, wall0 = self._start
            times1, wall = os.times(), perf_counter() - wall0
            own = (times1.user - times0.user) + (times1.system - times0.system)
            if wall > 0:
                self.cores = max(0.0, (self._busy_seconds() - busy0 - own) / wall)
        return False


def fma_peak(num_threads, *, isa=None, seconds=0.2, repeat=5):
    """FMA throughput of the machine at num_threads threads, GFLOP/s: the
    best of repeat runs of fa_peak_fma_f32 on every thread at once, each run
    sized to last about `seconds`.  The best, not the median: a peak is what
    the machine can do, and other processes can only lower a run.  isa: a
    path of fastattn.available_simd_paths(); default: the one the kernels
    use (fastattn.simd_path()).

    Returns a dict with gflops (the best), samples, threads_seen and
    other_cores (see OtherLoad)."""
    isa = isa or fastattn.simd_path()
    iters = 100_000
    flops, elapsed, _ = _peak.fma_run(isa, iters, num_threads)  # starts the threads
    while elapsed < 0.02:
        iters *= 4
        flops, elapsed, _ = _peak.fma_run(isa, iters, num_threads)
    iters = max(1, int(iters * seconds / elapsed))
    samples, seen = [], 0
    with OtherLoad() as load:
        for _ in range(repeat):
            flops, elapsed, seen = _peak.fma_run(isa, iters, num_threads)
            samples.append(flops / elapsed / 1e9)
    return {"isa": isa, "gflops": max(samples), "samples": samples,
            "threads_seen": seen, "other_cores": load.cores}


# 256 MB: 8 times the 32 MB L3 of the machine, and larger than the
# last-level cache of any current CPU, so every pass streams from DRAM.
BANDWIDTH_BUFFER_BYTES = 256 << 20


def read_bandwidth(num_threads, arrays=None, *, min_time=0.2, repeat=5):
    """Memory read bandwidth at num_threads threads, GB/s (1e9 bytes/s): the
    best of passes of fa_peak_read_f32 over arrays (C-contiguous float32;
    default: a fresh 256 MB buffer), each thread reading its share, until at
    least repeat passes and min_time seconds.  Pass the arrays a kernel reads
    (say a decoding step's key and value) to measure on the same bytes.

    Returns a dict with gbps (the best, as for fma_peak), samples, bytes and
    other_cores."""
    if arrays is None:
        arrays = [np.ones(BANDWIDTH_BUFFER_BYTES // 4, np.float32)]  # ones: every page touched
    isa = fastattn.simd_path()
    _peak.read_run(isa, arrays, num_threads)  # starts the threads, maps the pages
    samples, total = [], 0.0
    with OtherLoad() as load:
        while len(samples) < repeat or total < min_time:
            nbytes, elapsed, _ = _peak.read_run(isa, arrays, num_threads)
            samples.append(nbytes / elapsed / 1e9)
            total += elapsed
    return {"gbps": max(samples), "samples": samples, "bytes": int(nbytes),
            "other_cores": load.cores}


def paired_read(call, arrays, num_threads, *, repeat=5, min_time=1.0):
    """A decoding call's speed against the read bandwidth of the same moment:
    rounds of one pass of fa_peak_read_f32 over arrays (the bytes the call
    reads, or a copy of them) at num_threads threads, then one call, until
    at least repeat rounds and min_time seconds of calls.

    A VM's bandwidth drifts over minutes and can be bimodal at 2 threads
    (a Zen 4 VM gave 36-38 or 62-64 GB/s from one second to the next, as its
    virtual CPUs moved), so a call timed apart from the bandwidth can be
    compared with a state of the machine it never ran in.  Each round's
    ratio (pass time / call time, the share of the bandwidth the call got
    when both read the same number of bytes) compares like with like.

    Returns a dict: rounds, pct_read (100 x the median ratio), read_gbps
    (the median pass), other_cores."""
    isa = fastattn.simd_path()
    ratios, passes, total = [], [], 0.0
    with OtherLoad() as load:
        while len(ratios) < repeat or total < min_time:
            nbytes, read_s, _ = _peak.read_run(isa, arrays, num_threads)
            start = perf_counter()
            call()
            call_s = perf_counter() - start
            total += call_s
            ratios.append(read_s / call_s)
            passes.append(nbytes / read_s / 1e9)
    return {"rounds": len(ratios), "pct_read": 100 * statistics.median(ratios),
            "read_gbps": statistics.median(passes), "other_cores": load.cores}


def machine_info():
    """What the numbers depend on: CPU, SIMD paths, library versions."""
    import platform
    import sys

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpu_id": describe(), "logical_cpus": os.cpu_count(), "simd_paths": fastattn.available_simd_paths(),
            "fastattn": fastattn.__version__, "fastattn_simd": fastattn.simd_path(),
            "avx512_vnni": _core.cpu_has_avx512_vnni(),
            "avx_vnni": _core.cpu_has_avx_vnni(), "neon_dotprod": _core.cpu_has_neon_dotprod(),
            "int8_dot": _runtime.int8_dot(),
            "openmp": fastattn.openmp_enabled(), "numpy": np.__version__,
            "python": sys.version.split()[0]}
