"""README's speed table, rendered from the benchmark records.

    python benchmarks/render_readme.py            # print the table
    python benchmarks/render_readme.py --write    # put it in README.md, between its markers

Each row is one shape on one CPU, from one record of `fastattn bench --json
--threads 1,2` in benchmarks/records/ (listed in RECORDS, on the path the
record's machine used by default), so that every figure of README can be
traced to a file and every new machine adds its rows: add its record to
RECORDS and run --write.  tests/test_records.py fails when README's table is
not this script's output.
"""
import argparse
import json
import os
import sys

from fastattn.bench.shapes import ALL_SHAPES

HERE = os.path.dirname(os.path.abspath(__file__))
RECORDS_DIR = os.path.join(HERE, "records")
README = os.path.join(HERE, "..", "README.md")
# the records README's table is drawn from, in order
RECORDS = ["zen4-2026-12-04-eleven-shapes-grouped-lanes.json",
           "zen3-2026-12-03-readme-after-l2-prefetch.json"]
BEGIN = ("<!-- speed table: benchmarks/render_readme.py --write renders it from "
         "benchmarks/records -->")
END = "<!-- end of the speed table -->"
# the peers' columns: fastattn's speed-up over each (its JSON key, the header)
PEERS = {"torch": "xPyTorch", "onnxruntime": "xORT", "openvino": "xOV"}
# (B, H, L, S, E) of each shape, for the reader
SHAPE_DIMS = {n: (s.B, s.H, s.L, s.S, s.E) for n, s in ALL_SHAPES.items()}


def cpu_cell(machine):
    """A row's CPU: the microarchitecture from the record's CPUID, its CPU
    count and the SIMD path measured."""
    cpu = machine.get("cpu_id") or {}
    name = cpu.get("name") or machine.get("cpu", "unknown CPU")
    return f"{name}, {machine['logical_cpus']} CPUs, {machine['fastattn_simd']}"


def duration(seconds):
    if seconds < 1e-4:
        return f"{seconds * 1e6:.2g} µs"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def ratio(x):
    return "" if x is None else f"{x:.2f}"


def rows(record):
    machine, settings = record["machine"], record["settings"]
    path = machine["fastattn_simd"]
    cases = {(c["shape"], c["threads"]): c for c in record["cases"]
             if c["runner"] == "fastattn" and c.get("simd") == path and c["status"] == "ok"}
    for shape in settings["shapes"]:
        cells = [cpu_cell(machine), f"{shape} {SHAPE_DIMS[shape]}" if shape in SHAPE_DIMS
                 else shape]
        for threads in (1, 2):
            c = cases.get((shape, threads))
            if c is None:
                cells += [""] * (2 + len(PEERS))
                continue
            pct = c.get("pct_peak")
            cells += [duration(c["median"]), "" if pct is None else f"{pct:.0f}"]
            cells += [ratio(c.get(f"speedup_vs_{peer}")) for peer in PEERS]
        yield "| " + " | ".join(cells) + " |"


def render(records=RECORDS, directory=RECORDS_DIR):
    peers = " | ".join(PEERS.values())
    lines = [BEGIN,
             f"| CPU | shape (B, H, L, S, E) | 1 thread | %peak | {peers} | 2 threads | %peak "
             f"| {peers} |",
             "|---" * (2 + 2 * (2 + len(PEERS))) + "|"]
    for name in records:
        with open(os.path.join(directory, name)) as f:
            lines += list(rows(json.load(f)))
    return "\n".join(lines + [END]) + "\n"


def replace(text, table):
    """text with the part from BEGIN to END (inclusive) replaced by table."""
    start, stop = text.index(BEGIN), text.index(END) + len(END) + 1
    return text[:start] + table + text[stop:]


def main(argv=None):
    p = argparse.ArgumentParser(description="Render README's speed table from the records.")
    p.add_argument("--write", action="store_true", help="replace the table in README.md")
    args = p.parse_args(argv)
    table = render()
    if not args.write:
        sys.stdout.write(table)
        return 0
    with open(README) as f:
        text = f.read()
    with open(README, "w") as f:
        f.write(replace(text, table))
    print(f"wrote the speed table of {os.path.normpath(README)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
