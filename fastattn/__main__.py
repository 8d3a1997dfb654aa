"""Command line: `fastattn info | demo | bench`."""
import argparse
import os
import sys


def info():
    import numpy

    import fastattn
    from fastattn import _core, _runtime

    print(f"fastattn {fastattn.__version__}")
    print(f"SIMD path: {fastattn.simd_path()} (available: "
          f"{', '.join(fastattn.available_simd_paths())}; set FASTATTN_SIMD to choose)")
    off = "" if _runtime.int8_dot() else ": not used, FASTATTN_INT8_DOT=off"
    if _core.cpu_has_avx512_vnni():
        print(f"int8 mode's integer products: AVX-512 VNNI (vpdpbusd) on the avx512 path{off}")
    if _core.cpu_has_avx_vnni():
        print(f"int8 mode's integer products: AVX-VNNI (vpdpbusd) on the avx2 path{off}")
    if _core.cpu_has_neon_dotprod():
        print(f"int8 mode's integer products: ARMv8.2 dot products (sdot) on the neon path{off}")
    if _core.cpu_has_neon():  # what a reduced-precision path would use; no kernel does yet
        print(f"aarch64 half precision: fp16 arithmetic "
              f"{'yes' if _core.cpu_has_neon_fp16() else 'no'}, bf16 dot products "
              f"{'yes' if _core.cpu_has_neon_bf16() else 'no'} (not used by the kernels yet)")
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
            sys.stderr.flush()  # the help and the progress bar go there
    except BrokenPipeError:  # the reader stopped early (fastattn demo | head): end quietly
        # Python's recipe: the streams onto devnull, so that the flush at exit fails no more
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            os.dup2(devnull, stream.fileno())
        return 1


def _run(argv):
    import fastattn
    from fastattn._extras import require_extra
    from fastattn.bench import cli as bench_cli

    parser = argparse.ArgumentParser(
        prog="fastattn", description="Exact attention on the CPU: C kernels under a small NumPy "
        "API.", epilog="`fastattn COMMAND --help` describes a command and its options.")
    parser.add_argument("--version", action="version", version=f"fastattn {fastattn.__version__}")
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sub.add_parser("info", help="version, SIMD path, OpenMP and thread count",
                   description="Print fastattn's version, the SIMD path its kernels use (and "
                               "those this CPU has), whether OpenMP is compiled in, and the "
                               "thread count.")
    from fastattn import demo as demo_mod
    demo = sub.add_parser("demo", help="two worked examples of attention, step by step",
                          description=demo_mod.DESCRIPTION)
    demo.add_argument("--plot", metavar="FILE.png", type=bench_cli.output_file(".png"),
                      help="also draw the weight matrices as heatmaps into FILE.png (a PNG "
                           "file, written under exactly that name; needs matplotlib)")
    bench = sub.add_parser("bench", help=f"fastattn vs {bench_cli.peer_names()}: a table",
                           description=bench_cli.DESCRIPTION)
    bench_cli.add_arguments(bench)
    args = parser.parse_args(argv)
    if args.command is None:  # a usage error, but the help says more than "required"
        parser.print_help(sys.stderr)
        return 2
    if args.command == "info":
        return info()
    if args.command == "bench":
        return bench_cli.main(args)
    # checked before the demo runs, not after it has printed everything
    if args.plot and not require_extra("plot", "fastattn demo --plot"):
        return 2
    return demo_mod.main(args.plot)


if __name__ == "__main__":
    sys.exit(main())
