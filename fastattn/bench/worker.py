"""One benchmark case (a runner, a shape, a thread count) in a fresh process.

    python -m fastattn.bench.worker '{"runner": "torch", "shape": "bert-base", "threads": 1, ...}'

A fresh process per case keeps the runners from disturbing each other (the
spinning worker threads of one library stealing the cores of the next, a
caching allocator holding memory) and gives each its own peak-memory
reading.  In order: build the inputs, set the runner up, make one call under
PeakRSS (its first call, so lazy allocations count), check that call's
output against the float64 reference, then time it (and a decoding call
again, each call after a pass of the read loop over the same bytes:
measure.paired_read).  The result is printed
as one JSON line after RESULT_TAG.
"""
import json
import sys
import traceback

import fastattn
from fastattn import _tuning

from .measure import OtherLoad, PeakRSS, paired_read, time_call
from .runners import RUNNERS, output_errors, reference_rows
from .shapes import ALL_SHAPES

RESULT_TAG = "FASTATTN-BENCH-RESULT "


def run_case(spec):
    """Measure one case; spec: runner, shape (a name of shapes.ALL_SHAPES),
    threads, repeat, min_time, warmup, seed.  Returns a JSON-able dict; for
    fastattn, with "simd": the SIMD path its kernels ran (set by the caller
    through FASTATTN_SIMD)."""
    runner = RUNNERS[spec["runner"]]
    shape = ALL_SHAPES[spec["shape"]]
    result = {"runner": runner.name, "shape": shape.name, "threads": spec["threads"]}
    if runner.library == "fastattn":
        result["simd"] = fastattn.simd_path()
    why = runner.missing(shape)
    if why:
        return dict(result, status="skipped", note=why)
    q, k, v = shape.inputs(spec.get("seed", 0))
    with runner.setup(q, k, v, shape, spec["threads"]) as prepared:
        with PeakRSS() as mem:
            out = prepared.call()
        out_bytes = 4 * shape.B * shape.H * shape.L * shape.Ev
        if mem.bytes is not None:
            # At least 0: a call that adds nothing and frees memory its set-up held
            # (OpenVINO on a masked shape) read below 0 on the kernel's approximate
            # RSS counters, which said "+MB -0.1"
            result["peak_extra_bytes"] = max(
                0, mem.bytes - (out_bytes if prepared.allocates_output else 0))
        else:
            result["peak_note"] = mem.why
        result["max_abs_err"], result["rms_err"] = output_errors(
            prepared.to_bhle(out), q, k, v, shape, reference_rows(shape))
        del out
        if runner.library == "fastattn" and shape.kind == "decode":
            # the first decoding calls of a process try each way of
            # prefetching (fastattn/_tuning.py): before the timed calls
            for _ in range(len(_tuning.WAYS) * _tuning.TRIALS):
                prepared.call()
            way = _tuning.in_use()
            result["prefetch"] = None if way is None else _tuning.describe(way)
        if spec.get("repeat", 0) > 0:
            with OtherLoad() as load:
                timing = time_call(prepared.call, repeat=spec["repeat"],
                                   min_time=spec.get("min_time", 0.0),
                                   warmup=spec.get("warmup", 1))
            result.update(timing.asdict(), other_cores=load.cores)
            if shape.kind == "decode":  # as many calls again, each after a read pass
                result["paired_read"] = paired_read(
                    prepared.call, shape.stored_kv(spec.get("seed", 0)), spec["threads"],
                    repeat=spec["repeat"], min_time=spec.get("min_time", 0.0))
    result["version"] = getattr(__import__(runner.library), "__version__", "?")
    return dict(result, status="ok")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    try:
        result = run_case(spec)
    except Exception as e:  # reported as the case's result, never a silent gap
        traceback.print_exc()
        result = {key: spec[key] for key in ("runner", "shape", "threads", "simd") if key in spec}
        result.update(status="error", note=f"{type(e).__name__}: {e}")
    print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
