"""`fastattn bench --backward`: a training step's attention, forward and
backward, on fastattn against PyTorch's CPU SDPA (its flash and math
kernels, chosen with torch.nn.attention.sdpa_kernel) in one process, side
by side per shape and thread count.

The shapes are the bench's dense ones of E = 64 and 128, and two that
PyTorch can run only through a materialised mask or score matrix:
window-8192 (a causal window of 1024: a boolean mask for SDPA) and
softcap-4096 (Gemma 2's soft-capping, which SDPA lacks: PyTorch's
operations one by one, eager autograd).  FLOPs: 4 L S E for the forward
and 10 L S E for the backward per head, over the visible (query, key)
pairs (half when causal).  Every runner's gradients are checked against
fastattn's (relative largest difference), and the peak resident memory
a step adds above its inputs is measured (PeakRSS), each runner in a
process of its own.
"""
import math
import statistics
from dataclasses import dataclass
from time import perf_counter

import numpy as np

import fastattn

from .cpu import machine_label
from .measure import PeakRSS, fma_peak, machine_info
from .shapes import SHAPES, Shape

# forward and backward multiply-adds per visible (query, key) pair and feature, times 2
FLOPS_PER_PAIR = (4 + 10) / 4  # Shape.flops counts the forward's 4 L S E


@dataclass(frozen=True)
class Case:
    shape: Shape
    softcap: float = 0.0

    @property
    def name(self):
        return self.shape.name

    @property
    def flops(self):
        return self.shape.flops * FLOPS_PER_PAIR


DENSE = tuple(Case(s) for s in SHAPES
              if s.kind == "compute" and not s.seqlens and s.window < 0 and s.E in (64, 128))
CASES = DENSE + (Case(next(s for s in SHAPES if s.name == "window-8192")),
                 Case(Shape("softcap-4096", 1, 8, 4096, 4096, 128, causal=True), softcap=50.0))
QUICK = ("bert-base", "encoder-512", "head-128", "causal-2048", "softcap-4096")


def _fastattn(case, q, k, v, do, threads):
    s = case.shape
    kw = dict(is_causal=s.causal, num_threads=threads,
              window_size=(s.window, 0) if s.window >= 0 else None,
              softcap=case.softcap or None)

    def step():
        out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, **kw)
        return fastattn.attention_backward(do, q, k, v, out, lse, **kw)
    return step


def _torch(case, q, k, v, do, threads, backend):
    """PyTorch's step: SDPA on one backend, or (softcap) its operations one by one."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(threads)
    s = case.shape
    leaves = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    grad_out = torch.from_numpy(do)
    mask = None if s.mask() is None else torch.from_numpy(s.mask())

    def forward():
        if case.softcap:
            scores = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(s.E)
            scores = case.softcap * torch.tanh(scores / case.softcap)
            hidden = torch.ones(s.L, s.S, dtype=torch.bool).triu(1)
            return scores.masked_fill(hidden, float("-inf")).softmax(-1) @ leaves[2]
        kind = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]
        with sdpa_kernel([kind]):
            return torch.nn.functional.scaled_dot_product_attention(
                *leaves, attn_mask=mask, is_causal=s.causal and mask is None)

    def step():
        for x in leaves:
            x.grad = None
        forward().backward(grad_out)
        return [x.grad.numpy() for x in leaves]
    return step


def _runners(case, have_torch):
    if not have_torch:
        return ["fastattn"]
    return ["fastattn", "torch-eager"] if case.softcap else ["fastattn", "torch-flash",
                                                             "torch-math"]


def _difference(grads, reference):
    return max(float(np.abs(g - r).max() / max(np.abs(r).max(), 1e-30))
               for g, r in zip(grads, reference))


def _inputs(case, seed):
    s = case.shape
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((s.B, s.H, n, s.E)).astype(np.float32)
               for n in (s.L, s.S, s.S))
    return q, k, v, rng.standard_normal((s.B, s.H, s.L, s.Ev)).astype(np.float32)


def _step(case, runner, inputs, threads):
    if runner == "fastattn":
        return _fastattn(case, *inputs, threads)
    return _torch(case, *inputs, threads, runner.split("-")[1])


def _peak(name, runner, seed):
    """In a fresh process: the resident memory one step adds above its inputs."""
    case = next(c for c in CASES if c.name == name)
    inputs = _inputs(case, seed)
    step = _step(case, runner, inputs, 1)
    with PeakRSS() as rss:
        step()
    return rss.bytes


def peak_memory(case, runner, seed):
    """_peak in a process of its own: in this one, memory that an earlier
    runner freed but the allocator kept would hide a runner's own."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_peak, (case.name, runner, seed))


def run(threads=(1, 2), names=None, repeat=3, min_time=1.0, seed=0, progress=True):
    """Every case at every thread count, the runners' steps interleaved
    (round after round, one step of each) so that a machine that slows down
    slows them alike: seconds per step (median), GFLOP/s, % of the FMA
    peak at that count, the gradients' difference from fastattn's, and the
    peak memory of one step at 1 thread, each runner in a fresh process.
    Returns a dict for --json."""
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    cases = [c for c in CASES if names is None or c.name in names]
    peaks = {t: fma_peak(t)["gflops"] for t in threads}
    rows = []
    for case in cases:
        inputs = _inputs(case, seed)
        runners = _runners(case, have_torch)
        if progress:
            print(f"\r{case.name}: peak memory" + " " * 30, end="", flush=True)
        memory = {r: peak_memory(case, r, seed) for r in runners}
        for t in threads:
            if progress:
                print(f"\r{case.name} at {t} thread(s)" + " " * 30, end="", flush=True)
            steps = {r: _step(case, r, inputs, t) for r in runners}
            grads = {r: step() for r, step in steps.items()}  # also the warm-up
            times = {r: [] for r in runners}
            while len(times["fastattn"]) < repeat or sum(times["fastattn"]) < min_time:
                for r, step in steps.items():
                    start = perf_counter()
                    step()
                    times[r].append(perf_counter() - start)
            for r in runners:
                seconds = statistics.median(times[r])
                rows.append({"case": case.name, "describe": case.shape.describe()
                             + (f" softcap {case.softcap:g}" if case.softcap else "")
                             + (f" window {case.shape.window}" if case.shape.window >= 0
                                else ""),
                             "threads": t, "runner": r, "seconds": seconds,
                             "times": times[r], "gflops": case.flops / seconds / 1e9,
                             "pct_peak": 100 * case.flops / seconds / 1e9 / peaks[t],
                             "difference": _difference(grads[r], grads["fastattn"]),
                             "peak_rss_bytes": memory[r]})
            del steps, grads
    if progress:
        print()
    return {"kind": "backward", "machine": machine_info(), "fma_peak_gflops":
            {str(t): g for t, g in peaks.items()}, "threads": list(threads), "rows": rows}


def format_table(r):
    lines = [f"fastattn bench --backward: forward + backward, float32, "
             f"CPU: {machine_label(r['machine'])}; FMA peak "
             + ", ".join(f"{g:.1f} GFLOP/s at {t}" for t, g in r["fma_peak_gflops"].items()),
             f"{'case':<14}{'thr':>4} {'runner':<12}{'ms':>10}{'GFLOP/s':>9}{'% peak':>8}"
             f"{'fastattn x':>11}{'grad diff':>11}{'peak MB':>9}"]
    ours = {(x["case"], x["threads"]): x["seconds"] for x in r["rows"] if x["runner"] == "fastattn"}
    for x in r["rows"]:
        speedup = x["seconds"] / ours[(x["case"], x["threads"])]
        memory = "" if x["peak_rss_bytes"] is None else f"{x['peak_rss_bytes'] / 2**20:.0f}"
        lines.append(f"{x['case']:<14}{x['threads']:>4} {x['runner']:<12}"
                     f"{1e3 * x['seconds']:>10.1f}{x['gflops']:>9.1f}{x['pct_peak']:>8.1f}"
                     f"{speedup:>11.2f}{x['difference']:>11.1e}{memory:>9}")
    lines.append("fastattn x: the runner's time over fastattn's (above 1: fastattn is faster); "
                 "grad diff: largest |difference| from fastattn's gradients over the largest "
                 "gradient; peak MB: resident memory a step adds above its inputs, at 1 "
                 "thread, in a process of its own")
    return "\n".join(lines)
