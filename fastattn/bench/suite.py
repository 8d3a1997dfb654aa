"""Runs the benchmark: the machine's peaks per thread count (in this
process), then every case (runner x shape x thread count, and for fastattn x
SIMD path) in a fresh process (fastattn.bench.worker).  Returns the raw
results that report.py turns into the table, the JSON file and the plot."""
import json
import os
import subprocess
import sys
import time

import fastattn
from fastattn._runtime import SIMD_ENV

from . import measure
from .runners import RUNNERS
from .shapes import ALL_SHAPES
from .worker import RESULT_TAG

LIBGOMP_DEFAULT_SPIN = "300000"  # libgomp's spin count when no wait policy is set
CASE_TIMEOUT = 1800  # seconds; a case that hangs is reported as an error
# `python -m` puts the working directory first on sys.path: run workers
# where they import the same fastattn as this process (not, say, a source
# tree without its compiled modules).
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))


def worker_env(spec, environ=os.environ):
    """The environment of a case's process: FASTATTN_SIMD for fastattn's
    path; for the peers, libgomp's default spin unless the user chose one
    (the worker imports fastattn, whose short spin would otherwise reach
    PyTorch too: one libgomp per process)."""
    env = dict(environ, **({SIMD_ENV: spec["simd"]} if "simd" in spec else {}))
    if (RUNNERS[spec["runner"]].library != "fastattn"
            and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & env.keys()):
        env["GOMP_SPINCOUNT"] = LIBGOMP_DEFAULT_SPIN
    return env


def run_worker(spec, timeout=CASE_TIMEOUT):
    """One case in a fresh Python process; returns its result dict.  With
    spec["simd"], the process runs fastattn on that SIMD path (FASTATTN_SIMD
    in its environment, read when fastattn is imported)."""
    base = {key: spec[key] for key in ("runner", "shape", "threads", "simd") if key in spec}
    try:
        proc = subprocess.run([sys.executable, "-m", "fastattn.bench.worker", json.dumps(spec)],
                              capture_output=True, text=True, timeout=timeout,
                              cwd=PACKAGE_PARENT, env=worker_env(spec))
    except subprocess.TimeoutExpired:
        return dict(base, status="error", note=f"timed out after {timeout} s")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return dict(base, status="error", note=f"worker exited with {proc.returncode}: {tail}")


def _progress(total, enabled):
    from tqdm import tqdm
    return tqdm(total=total, desc="fastattn bench", unit="step", file=sys.stderr,
                disable=not enabled, dynamic_ncols=True)


class BusyCores:
    """n processes that spin for the duration of the with-block: a machine
    where other programs keep n cores busy."""

    def __init__(self, n):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(self.n)]
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def _variants(runner_names, simd):
    """(runner, extra spec) for every row of a case: fastattn once per SIMD path."""
    for name in runner_names:
        if RUNNERS[name].library == "fastattn":
            yield from ((name, {"simd": path}) for path in simd)
        else:
            yield name, {}


def run_suite(shape_names, runner_names, threads, *, simd=None, repeat=5, min_time=1.0,
              warmup=1, peak_seconds=0.2, seed=0, busy=0, progress=True):
    """Measure every runner on every shape at every thread count, fastattn on
    each SIMD path of simd (default: the one in use, fastattn.simd_path()),
    with busy cores kept busy by other processes while the cases run (the
    machine's peaks are measured without them).

    Returns {"machine", "settings", "peaks": {threads: {...}}, "cases": [...]}:
    peaks[threads]["fma"] holds the FMA peak of every path of simd and of the
    CPU's other vector widths (keyed by path).  Runners that cannot run here
    get a "skipped" case with the reason.  A KeyboardInterrupt (Ctrl-C) ends
    the run: the report then holds the cases finished, and settings
    "interrupted" is True."""
    shapes = [ALL_SHAPES[n] for n in shape_names]
    simd = list(simd or [fastattn.simd_path()])
    variants = list(_variants(runner_names, simd))
    machine = measure.machine_info()
    # the paths measured, and the other vector widths: the ceilings of peers that use them
    fma_paths = [p for p in machine["simd_paths"] if p in simd or p != "portable"]
    timed = repeat > 0
    started = time.time()
    steps = len(threads) * (len(shapes) * len(variants) + (2 if timed else 0))
    steps += sum(s.kind == "decode" for s in shapes) * len(threads)
    report = {"machine": machine,
              "settings": {"shapes": list(shape_names), "runners": list(runner_names),
                           "simd": simd, "threads": list(threads), "repeat": repeat,
                           "min_time": min_time, "warmup": warmup, "seed": seed,
                           "busy": busy, "dtype": "float32"},
              "peaks": {}, "cases": []}
    try:
        _measure(report, shapes, variants, threads, fma_paths, timed, steps, progress,
                 repeat=repeat, min_time=min_time, warmup=warmup, peak_seconds=peak_seconds,
                 seed=seed, busy=busy)
    except KeyboardInterrupt:  # Ctrl-C: the cases finished so far are the report
        report["settings"]["interrupted"] = True
    report["settings"]["wall_seconds"] = round(time.time() - started, 1)
    return report


def _measure(report, shapes, variants, threads, fma_paths, timed, steps, progress, *,
             repeat, min_time, warmup, peak_seconds, seed, busy):
    """run_suite's measurements, added to report as they finish."""
    with _progress(steps, progress) as bar:
        for n in threads:
            peaks = report["peaks"].setdefault(str(n), {})
            if timed:
                bar.set_postfix_str(f"FMA peak, {n} thread(s)")
                peaks["fma"] = {isa: measure.fma_peak(n, isa=isa, seconds=peak_seconds)
                                for isa in fma_paths}
                bar.update()
                bar.set_postfix_str(f"read bandwidth, {n} thread(s)")
                peaks["read"] = measure.read_bandwidth(n, min_time=peak_seconds)
                bar.update()
            for shape in shapes:  # without the busy cores, like the other peaks
                if shape.kind == "decode":
                    bar.set_postfix_str(f"read bandwidth on {shape.name}'s key and value")
                    stored = shape.stored_kv(seed)
                    peaks[f"read:{shape.name}"] = measure.read_bandwidth(n, stored,
                                                                         min_time=peak_seconds)
                    del stored
                    bar.update()
            with BusyCores(busy):
                for shape in shapes:
                    for name, extra in variants:
                        bar.set_postfix_str(" ".join([shape.name, name, *extra.values(),
                                                      f"{n} thread(s)"]))
                        report["cases"].append(_case(name, shape, n, extra, repeat=repeat,
                                                     min_time=min_time, warmup=warmup,
                                                     seed=seed))
                        bar.update()


def _case(name, shape, n, extra, **settings):
    """One case's result: measured in a fresh process, or skipped with the reason."""
    why = RUNNERS[name].missing(shape)
    if why:
        return {"runner": name, "shape": shape.name, "threads": n, **extra,
                "status": "skipped", "note": why}
    return run_worker({"runner": name, "shape": shape.name, "threads": n, **settings, **extra})
