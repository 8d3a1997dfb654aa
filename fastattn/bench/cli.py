"""`fastattn bench`: fastattn against its peers (runners.RUNNERS) on the same shapes: a
table of times, speed-ups, % of this machine's peak, accuracy and memory per case."""
import argparse
import json
import math
import os
import sys

from .._extras import require, require_extra  # noqa: F401  (require: the tests' name)
from .runners import RUNNERS, peer_names
from .shapes import LONG_16384, SHAPES, THREADS, TINY

QUICK = {"repeat": 3, "min_time": 0.2, "peak_seconds": 0.05}
DEFAULT = {"repeat": 5, "min_time": 1.0, "peak_seconds": 0.2}
# `fastattn bench --help`'s description
DESCRIPTION = (f"fastattn against {peer_names()} on the same shapes: a table of times, "
               "speed-ups, % of this machine's peak, accuracy and memory per case.")
# without --shapes: every shape of the table and tiny (LONG_16384 is --memory's)
DEFAULT_SHAPES = tuple(s.name for s in SHAPES) + (TINY.name,)
# --quick without --shapes: prefill, causal and decoding shapes, none whose
# peers take seconds a call (the 8192-position ones, packed-16): a run of
# minutes, where fewer calls per case left the process each case starts
QUICK_SHAPES = ("bert-base", "encoder-512", "causal-2048", "head-128", "decode-4096",
                "decode-8192", "tiny")
SOFTCAP_4096 = "softcap-4096"  # --backward's own shape (fastattn/bench/backward.py)


def _names(text, known, what):
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {', '.join(unknown) or '(none given)'}; expected some of: "
            f"{', '.join(known)}")
    return list(dict.fromkeys(names))  # each once, in the order first given


def _simd_paths(text):
    import fastattn

    known = fastattn.available_simd_paths()
    names = _names(text, ["portable", "avx2", "avx512", "neon"], "SIMD path")
    absent = [n for n in names if n not in known]
    if absent:
        raise argparse.ArgumentTypeError(
            f"SIMD path {', '.join(absent)} not available on this CPU or build; available: "
            f"{', '.join(known)}")
    return names


def _threads(text):
    from fastattn._runtime import MAX_THREADS

    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        values = []
    # OpenMP ends the process when it cannot create a thread it was asked for
    if not values or any(not 1 <= v <= MAX_THREADS for v in values):
        raise argparse.ArgumentTypeError(
            f"expected thread counts from 1 to {MAX_THREADS} like 1,2, got {text!r}")
    return list(dict.fromkeys(values))


def _at_least(kind, low):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"expected a number >= {low}, got {text!r}")
        return value
    return parse


def output_file(suffix=None):
    """An argparse type for a file the command will write: checked when the
    arguments are read, before any work, so that a wrong path costs nothing.
    The directory must exist and be writable, and the path must not be a
    directory; with suffix (".png"), the name must end in it (the file is
    written under exactly the name given, never with a suffix added)."""
    def parse(path):
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise argparse.ArgumentTypeError(f"cannot write {path}: it is a directory")
        if suffix and not path.lower().endswith(suffix):
            raise argparse.ArgumentTypeError(
                f"{path!r} does not end in {suffix}: give the file's whole name, like "
                f"{os.path.splitext(path)[0].rstrip('.') or 'out'}{suffix}")
        if not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"cannot write {path}: no such directory {folder}")
        existed = os.path.exists(path)
        try:  # really open it: permissions, read-only or special file systems (/proc)
            with open(path, "a"):
                pass
        except OSError as e:
            raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror}") from None
        if not existed:
            os.remove(path)
        return path
    return parse


def add_arguments(p):
    shape_names = list(DEFAULT_SHAPES)
    p.add_argument("--shapes", type=lambda t: _names(t, shape_names + [LONG_16384.name,
                                                         SOFTCAP_4096], "shape"),
                   metavar="LIST",
                   help=f"comma-separated, from: {', '.join(shape_names)}, "
                        f"{LONG_16384.name}, {SOFTCAP_4096} (default: all but "
                        f"{LONG_16384.name}, the shape of --memory, and {SOFTCAP_4096}, "
                        f"--backward's; with --quick: {', '.join(QUICK_SHAPES)})")
    p.add_argument("--runners", type=lambda t: _names(t, list(RUNNERS), "runner"),
                   default=list(RUNNERS), metavar="LIST",
                   help=f"comma-separated, from: {', '.join(RUNNERS)} (default: all; "
                        "those not installed are skipped with a note)")
    p.add_argument("--simd", type=_simd_paths, metavar="PATHS",
                   help="fastattn's SIMD paths to compare, comma-separated, e.g. avx2,avx512: "
                        "each case runs once per path (default: the path in use, "
                        "fastattn.simd_path(); FASTATTN_SIMD chooses it)")
    p.add_argument("--threads", type=_threads, default=list(THREADS), metavar="LIST",
                   help="thread counts, comma-separated (default: 1,2)")
    p.add_argument("--repeat", type=_at_least(int, 1), metavar="N",
                   help=f"at least N timed calls per case (default {DEFAULT['repeat']}, "
                        f"--quick {QUICK['repeat']})")
    p.add_argument("--min-time", type=_at_least(float, 0.0), metavar="SECONDS",
                   help=f"and at least this much timed per case (default {DEFAULT['min_time']}, "
                        f"--quick {QUICK['min_time']})")
    p.add_argument("--warmup", type=_at_least(int, 0), default=1, metavar="N",
                   help="untimed calls before timing (default 1)")
    p.add_argument("--quick", action="store_true",
                   help="fewer calls per case and shorter peak loops, and without --shapes "
                        f"{len(QUICK_SHAPES)} shapes, not {len(shape_names)} (docs/guide/"
                        "benchmarks.md gives the time each takes)")
    p.add_argument("--memory", action="store_true",
                   help=f"only measure peak memory, at {LONG_16384.name} ({LONG_16384.describe()}; "
                        "--shapes is ignored)")
    p.add_argument("--serving", action="store_true",
                   help="instead of the shapes: one serving step of 64 sequences over a paged "
                        "cache (decoding; decoding mixed with prefill chunks; a tree of 8 draft "
                        "tokens each; 16 forks of a prompt of 8192 tokens) against a "
                        "padded cache, one call per sequence and PyTorch (fastattn/bench/"
                        "serving.py); --threads, --repeat, --seed and --json apply.  About 7 minutes "
                        "on 2 cores at 1,2 threads, and 12 GB of memory (its padded rows of the "
                        "mixed step take most of the time)")
    p.add_argument("--backward", action="store_true",
                   help="instead of the shapes: forward + backward (a training step's "
                        "attention) on fastattn against PyTorch's SDPA, flash and math "
                        "kernels, on the dense shapes of E = 64 and 128, window-8192 and "
                        f"{SOFTCAP_4096} (fastattn/bench/backward.py; fastattn alone where "
                        "torch is not installed); --shapes, --threads, --repeat, --min-time, "
                        "--quick, --seed and --json apply (docs/guide/training.md gives "
                        "the time and memory a run takes)")
    p.add_argument("--sharded", action="store_true",
                   help="instead of the shapes: decoding over a cache of --context positions "
                        "(8 key/value heads of 128, float16) sharded over 2 Ray actors, per "
                        "token, split into kernels, merges and transfer, against one process "
                        "and the cost model (fastattn/bench/sharded.py; needs Ray: pip install "
                        "'fastattn[ray]'); --repeat (tokens), --seed and --json apply.  About "
                        "2 minutes and 10 GB of memory at the default context")
    p.add_argument("--context", type=_at_least(int, 1), default=1 << 20, metavar="N",
                   help="positions of the --sharded cache (default 1048576: 4 GiB)")
    p.add_argument("--busy", type=_at_least(int, 0), default=0, metavar="N",
                   help="keep N cores busy with spinning processes while the cases run, "
                        "as other programs do on a shared machine; the table then gives the "
                        "mean time per call, which counts the calls that wait (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--json", metavar="FILE", type=output_file(),
                   help="write every measurement to FILE as JSON")
    p.add_argument("--plot", metavar="FILE.png", type=output_file(".png"),
                   help="draw bars per shape into FILE.png (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args):
    # missing packages before minutes of measuring (the output paths are
    # checked with the arguments)
    if args.sharded:  # Ray, and nothing of the extra "bench"
        if not require_extra("ray", "fastattn bench --sharded"):
            return 2
        return _sharded(args)
    if args.backward:  # fastattn alone, or beside torch where it is installed
        return _backward(args)
    if not require_extra("bench", "fastattn bench"):
        return 2
    if args.plot and not require_extra("plot", "fastattn bench --plot"):
        return 2
    if args.serving:
        return _serving(args)
    from . import report as rep
    from .suite import run_suite

    settings = dict(QUICK if args.quick else DEFAULT)
    if args.repeat is not None:
        settings["repeat"] = args.repeat
    if args.min_time is not None:
        settings["min_time"] = args.min_time
    shapes = args.shapes or list(QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    if args.memory:  # one untimed call per runner: its peak memory and its error
        shapes, settings["repeat"], settings["min_time"] = [LONG_16384.name], 0, 0.0
    # at the memory shape the score matrix alone is 8 GiB: computed, not run
    runners = [r for r in args.runners if not (args.memory and RUNNERS[r].holds_scores)]
    result = run_suite(shapes, runners, args.threads, simd=args.simd, repeat=settings["repeat"],
                       min_time=settings["min_time"], warmup=args.warmup,
                       peak_seconds=settings["peak_seconds"], seed=args.seed,
                       busy=args.busy, progress=not args.no_progress)
    rep.derive(result)
    # the files first: a reader that stops early (fastattn bench | head) must not cost them
    written = []
    try:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
            written.append(args.json)
        if args.plot and not args.memory:
            rep.plot(result, args.plot)
            written.append(args.plot)
    except OSError as e:
        print(f"fastattn bench: cannot write {e.filename or args.plot}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    if args.memory:
        print(rep.format_memory(result, [r for r in args.runners if RUNNERS[r].holds_scores]))
    else:
        print(rep.format_table(result))
    for path in written:
        print(f"wrote {path}")
    if result["settings"].get("interrupted"):
        print(f"fastattn bench: interrupted; {len(result['cases'])} case(s) finished, shown above"
              + (" and written" if written else ""), file=sys.stderr)
        return 130  # the shell's status of a command ended by SIGINT
    return 0


def _serving(args):
    from . import serving

    result = serving.run(args.threads, rounds=args.repeat or DEFAULT["repeat"], seed=args.seed,
                         progress=not args.no_progress)
    return _report(args, result, serving.format_table)


def _backward(args):
    from . import backward

    known = [c.name for c in backward.CASES]
    names = args.shapes or list(backward.QUICK if args.quick else known)
    unknown = [n for n in names if n not in known]
    if unknown:
        print(f"fastattn bench --backward: no backward case {', '.join(unknown)}; its shapes: "
              f"{', '.join(known)}", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else DEFAULT
    result = backward.run(args.threads, names, repeat=args.repeat or 3,
                          min_time=settings["min_time"] if args.min_time is None
                          else args.min_time, seed=args.seed, progress=not args.no_progress)
    return _report(args, result, backward.format_table)


def _sharded(args):
    from . import sharded

    result = sharded.run(args.context, tokens=args.repeat or 8, seed=args.seed,
                         progress=not args.no_progress)
    return _report(args, result, sharded.format_table)


def _report(args, result, format_table):
    """Writes result to --json, then prints its table."""
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        except OSError as e:
            print(f"fastattn bench: cannot write {args.json}: {e.strerror or e}", file=sys.stderr)
            return 1
    print(format_table(result))
    if args.json:
        print(f"wrote {args.json}")
    return 0
