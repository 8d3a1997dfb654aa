"""Command line: `fastattn info | demo | bench`."""
import argparse
import os
import sys


def info():
    import numpy

    import fastattn
    from fastattn import _core

    print(f"fastattn {fastattn.__version__}")
    print(f"SIMD path: {fastattn.simd_path()} (available: "
          f"{', '.join(fastattn.available_simd_paths())}; set FASTATTN_SIMD to choose)")
    print(f"OpenMP: {'compiled in' if fastattn.openmp_enabled() else 'not compiled in (serial build)'}")
    print(f"threads: {fastattn.get_num_threads()}")
    print(f"query rows per block: {_core.attn_query_block(4)} (float32), "
          f"{_core.attn_query_block(8)} (float64)")
    print(f"numpy {numpy.__version__}, python {sys.version.split()[0]}")
    return 0


def main(argv=None):
    try:
        try:
            return _run(argv)
        finally:  # --help and usage errors too (SystemExit)
            # stdout into a pipe is block buffered unless PYTHONUNBUFFERED is set: the
            # write that finds the pipe closed is often this last flush, not a print
            sys.stdout.flush()
    except BrokenPipeError:  # the reader stopped early (fastattn demo | head): end quietly
        # Python's recipe: stdout onto devnull, so that the flush at exit fails no more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _run(argv):
    parser = argparse.ArgumentParser(prog="fastattn", description="CPU attention kernels")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="version, SIMD path, OpenMP and thread count")
    demo = sub.add_parser("demo", help="the tutorials' worked examples, step by step")
    demo.add_argument("--plot", metavar="FILE.png", help="draw the weight matrices as heatmaps")
    from fastattn.bench import cli as bench_cli
    bench = sub.add_parser("bench", help="fastattn vs NumPy, PyTorch and ONNX Runtime: a table",
                           description=bench_cli.__doc__)
    bench_cli.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command == "info":
        return info()
    if args.command == "bench":
        return bench_cli.main(args)
    from fastattn import demo as demo_mod
    return demo_mod.main(args.plot)


if __name__ == "__main__":
    sys.exit(main())
