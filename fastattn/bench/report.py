"""From raw results (suite.run_suite) to derived figures, the printed
table and the plot."""
import textwrap

from .cpu import machine_label
from .runners import BASELINES, PEERS, RUNNERS
from .shapes import ALL_SHAPES

MB = 1 << 20
BUSY = 0.1  # cores used by other processes above which a measurement is disturbed


def statistic(report):
    """The time per call the table uses: the median, or the mean on a
    machine kept busy (--busy), where the calls that wait are the point."""
    return "mean" if report["settings"].get("busy") else "median"


def derive(report):
    """Add to every measured case: gflops (compute shapes) or gbps (decode:
    key and value bytes over the time) or us (the tiny shape); pct_peak (of
    the FMA peak at that thread count: for fastattn that of the SIMD path the
    case ran, for the others that of the CPU's widest path, or for decoding
    of the read bandwidth on the shape's own bytes: the median share of
    measure.paired_read's rounds, or, in a record without them, against the
    best pass measured before the cases);
    speedup_vs_<library> = the
    time (statistic()) of that library's faster runner / this one's (> 1: faster;
    libraries: runners.BASELINES; none against its own library: an ORT row
    has no xORT); speedup_vs_best_peer, the smallest of those of
    runners.PEERS."""
    widest = report["machine"]["simd_paths"][-1]
    stat = statistic(report)
    cases = [c for c in report["cases"] if c.get("status") == "ok" and stat in c]
    times = {(c["shape"], c["threads"], c["runner"]): c[stat] for c in cases}
    for c in cases:
        shape, peaks = ALL_SHAPES[c["shape"]], report["peaks"].get(str(c["threads"]), {})
        t = c[stat]
        if shape.kind == "compute":
            c["gflops"] = shape.flops / t / 1e9
            fma = peaks.get("fma", {}).get(c.get("simd", widest))
            if fma:
                c["pct_peak"] = 100 * c["gflops"] / fma["gflops"]
        elif shape.kind == "decode":
            c["gbps"] = shape.kv_bytes / t / 1e9
            same = peaks.get(f"read:{shape.name}")
            if "paired_read" in c:
                c["pct_peak"] = c["paired_read"]["pct_read"]
            elif same:
                c["pct_peak"] = 100 * c["gbps"] / same["gbps"]
        elif shape.kind == "overhead":
            c["us"] = t * 1e6
        for library, runners in BASELINES.items():
            if c["runner"] in runners:  # a library against itself: no column
                continue
            theirs = [times[key] for key in ((c["shape"], c["threads"], r) for r in runners)
                      if key in times]
            if theirs:
                c[f"speedup_vs_{library}"] = min(theirs) / t
        peers = [c[f"speedup_vs_{p}"] for p in PEERS if f"speedup_vs_{p}" in c]
        if peers:
            c["speedup_vs_best_peer"] = min(peers)
    return report


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def label(case):
    """The row label of a case: the runner's, and for fastattn its SIMD path."""
    return " ".join([RUNNERS[case["runner"]].label] + ([case["simd"]] if "simd" in case else []))


def _case_rows(report, n):
    for shape_name in report["settings"]["shapes"]:
        for c in report["cases"]:  # in the order run: runners, fastattn's paths
            if c["threads"] == n and c["shape"] == shape_name:
                yield ALL_SHAPES[shape_name], c


def format_peaks(report):
    peaks = report["peaks"]
    paths = list(dict.fromkeys(isa for p in peaks.values() for isa in p.get("fma", {})))
    head = "".join(f"  {'FMA ' + isa:>12}" for isa in paths)
    lines = ["Machine peaks measured in this run (best of the runs of csrc/fa_peak*.c), "
             "FMA in GFLOP/s:", f"  {'threads':>7}{head}  {'read GB/s':>10}"]
    for n, p in peaks.items():
        read = p.get("read")
        fma = [(p.get("fma", {}).get(isa) or {}).get("gflops") for isa in paths]
        lines.append(f"  {n:>7}" + "".join(f"  {_fmt(f, '12.1f'):>12}" for f in fma)
                     + f"  {_fmt(read and read['gbps'], '10.1f'):>10}")
        for key, value in p.items():
            if key.startswith("read:"):
                lines.append(f"  {'':>7}  read GB/s on {key[5:]}'s own key and value "
                             f"({value['bytes'] / MB:.0f} MB): {value['gbps']:.1f}")
    if paths:
        lines.append("  FMA: a loop of independent FMAs in each SIMD path's instructions.  read: "
                     "a 256 MB buffer, 8 x a 32 MB L3.")
    return lines


def format_disturbance(report):
    """Notes on what other processes took from this run, or none."""
    lines = []
    # a decoding case's %peak comes from its paired read passes where it has them
    unpaired = {(c["shape"], str(c["threads"])) for c in report["cases"]
                if "paired_read" not in c}
    for n, p in report["peaks"].items():
        measured = [(f"the {isa} FMA peak", v) for isa, v in p.get("fma", {}).items()]
        measured += [(f"the read bandwidth{' on ' + k[5:] if k != 'read' else ''}", v)
                     for k, v in p.items()
                     if k == "read" or k.startswith("read:") and (k[5:], n) in unpaired]
        busy = [(what, v["other_cores"]) for what, v in measured
                if (v.get("other_cores") or 0) > BUSY]
        if busy:
            lines.append(f"Note: at {n} thread(s) other processes used "
                         + ", ".join(f"{c:.2f} cores during {what}" for what, c in busy)
                         + ": those peaks are low, and %peak against them high.")
    widest = report["machine"]["simd_paths"][-1]
    one = report["peaks"].get("1", {}).get("fma", {}).get(widest)
    for n, p in report["peaks"].items():
        fma = p.get("fma", {}).get(widest)
        if one and fma and int(n) > 1 and fma["gflops"] < 0.8 * int(n) * one["gflops"]:
            lines.append(f"Note: the FMA peak at {n} threads is "
                         f"{fma['gflops'] / one['gflops']:.2f} x the 1-thread one: other processes were using the cores, so the "
                         f"{n}-thread numbers are disturbed.")
    kept = report["settings"].get("busy", 0)  # the cores --busy took on purpose
    timed = [c for c in report["cases"] if c.get("other_cores") is not None]
    busy = [c for c in timed if c["other_cores"] - kept > BUSY]
    if busy:
        lines.append(f"Note: other processes used more than {BUSY} cores"
                     f"{f' beyond the {kept} of --busy' if kept else ''} during {len(busy)} of "
                     f"{len(timed)} timed cases (column other): their times are slower than this "
                     "machine can do. For numbers to compare, run on an idle machine.")
    return lines


def format_table(report):
    """The comparison as text, one block per thread count, then notes on
    other processes' load when there was any."""
    s = report["settings"]
    m = report["machine"]
    stat = statistic(report)
    lines = [f"fastattn bench: float32 (a decode-8192-* cache in its storage), {stat} of >= {s['repeat']} calls and >= {s['min_time']} s "
             f"per case after {s['warmup']} warm-up call(s), each case in a fresh process"
             + (f", {s['busy']} core(s) kept busy by other processes (--busy)"
                if s.get("busy") else ""),
             f"CPU: {machine_label(m)} ({m['logical_cpus']} logical CPUs; SIMD paths "
             f"{', '.join(m['simd_paths'])})",
             f"fastattn {m['fastattn']} (SIMD path{'s' * (len(s.get('simd', [])) > 1)} measured: "
             f"{', '.join(s.get('simd', [m['fastattn_simd']]))}; OpenMP "
             f"{'on' if m['openmp'] else 'off'}"
             + ("; int8 mode without the CPU's dot products, FASTATTN_INT8_DOT=off"
                if m.get("int8_dot") is False else "")
             + f"), numpy {m['numpy']}, python {m['python']}"]
    versions = sorted({f"{RUNNERS[c['runner']].library} {c['version']}" for c in report["cases"]
                       if c.get("version") and RUNNERS[c["runner"]].library in PEERS})
    if versions:
        lines.append("peers: " + ", ".join(versions))
    if report["peaks"]:
        lines += format_peaks(report)
    width = max([9] + [len(label(c)) for c in report["cases"]])
    sw = max([13] + [len(c["shape"]) for c in report["cases"]])  # the shape column
    head = (f"{'shape':<{sw}} {'runner':<{width}} {'time':>10} {'speed':>14} {'xNumPy':>7} "
            f"{'xPyTorch':>8} {'xORT':>6} {'xOV':>6} {'%peak':>6} {'+MB':>7} {'max err':>8} {'rms err':>8} {'other':>5}")
    for n in s["threads"]:
        if not any(c["threads"] == n for c in report["cases"]):  # Ctrl-C came before them
            continue
        lines += ["", f"== {n} thread{'s' if n > 1 else ''} ==", head]
        previous = None
        for shape, c in _case_rows(report, n):
            name = shape.name if shape.name != previous else ""
            previous = shape.name
            if c.get("status") != "ok":
                lines.append(f"{name:<{sw}} {label(c):<{width}} {c.get('status')}: {c.get('note')}")
                continue
            if stat not in c:
                time_s = speed = "-"
            elif shape.kind == "overhead":
                time_s, speed = f"{c['us']:.1f} us", "(per call)"
            else:
                time_s = f"{c[stat] * 1e3:.3f} ms"
                speed = (f"{c['gbps']:.1f} GB/s" if "gbps" in c
                         else f"{c['gflops']:.1f} GFLOP/s" if "gflops" in c else "-")
            mem = c.get("peak_extra_bytes")
            lines.append(
                f"{name:<{sw}} {label(c):<{width}} {time_s:>10} {speed:>14} "
                f"{_fmt(c.get('speedup_vs_numpy'), '7.2f'):>7} "
                f"{_fmt(c.get('speedup_vs_torch'), '8.2f'):>8} "
                f"{_fmt(c.get('speedup_vs_onnxruntime'), '6.2f'):>6} "
                f"{_fmt(c.get('speedup_vs_openvino'), '6.2f'):>6} "
                f"{_fmt(c.get('pct_peak'), '6.1f'):>6} "
                f"{_fmt(None if mem is None else mem / MB, '7.1f'):>7} "
                f"{_fmt(c.get('max_abs_err'), '8.1e'):>8} "
                f"{_fmt(c.get('rms_err'), '8.1e'):>8} "
                f"{_fmt(c.get('other_cores'), '5.2f'):>5}")
    lines += [""] + textwrap.wrap(
              f"time: {stat} per call.  speed: 4·B·H·L·S·E FLOP (halved when causal) per "
              "second, or for decoding the bytes of key+value (in their storage) per second.  xNumPy, xPyTorch, "
              "xORT, xOV: that library's time / this row's (> 1: this row is faster; none on that "
              "library's own rows), ORT: the faster of its two key/value layouts, BSD = (B, S, "
              "H·E), BHSD = (B, H, S, E); OV: OpenVINO's ScaledDotProductAttention op in f32, "
              "decoding through its stateful key/value-cache graph (an f32 cache).  %peak: of "
              "the FMA peak at that thread count, for fastattn of its row's SIMD path, for the "
              f"others of the widest path ({m['simd_paths'][-1]}); for decoding of the read "
              "bandwidth on the same bytes, a pass of the read loop before each of as many "
              "calls again, the median of their ratios (a machine's bandwidth drifts).  +MB: "
              "peak resident memory of the first "
              "call above the inputs and the output (fresh process).  max err, rms err: largest "
              "and root-mean-square |out - float64 reference| over up to 64 query rows per "
              "head.  other: CPU cores used by other processes during the timed calls (the "
              "machine may be shared; above 0.1 the numbers are disturbed).", width=100)
    notes = format_disturbance(report)
    if notes:
        lines.append("")
        lines += [wrapped for note in notes for wrapped in textwrap.wrap(note, width=100)]
    return "\n".join(lines)


def format_memory(report, estimated=()):
    """The peak-memory measurement at the memory shape; the runners in
    estimated hold the whole score matrix and get its size instead."""
    m = report["machine"]
    lines = [f"fastattn bench --memory: one call per runner, each in a fresh process; peak "
             f"resident memory above the inputs and the output (Linux VmHWM); CPU: {machine_label(m)}"]
    for shape_name in report["settings"]["shapes"]:
        shape = ALL_SHAPES[shape_name]
        lines += [f"== peak memory, {shape.name} ({shape.describe()}; inputs + output "
                  f"{shape.io_bytes / MB:.0f} MB) ==",
                  f"{'runner':<15} {'threads':>7} {'+MB above inputs and output':>28} {'max err':>8}"]
        for c in report["cases"]:
            if c["shape"] != shape.name:
                continue
            if c.get("status") != "ok":
                lines.append(f"{label(c):<15} {c['threads']:>7} {c.get('status')}: {c.get('note')}")
                continue
            mem = c.get("peak_extra_bytes")
            lines.append(f"{label(c):<15} {c['threads']:>7} "
                         f"{_fmt(None if mem is None else mem / MB, '28.1f', c.get('peak_note')):>28} "
                         f"{_fmt(c.get('max_abs_err'), '8.1e'):>8}")
        for name in estimated:
            lines.append(f"{RUNNERS[name].label:<15} {'any':>7} "
                         f"{'>= ' + format(shape.scores_bytes / MB, '.0f'):>28}  not run: the "
                         f"{shape.B}x{shape.H}x{shape.L}x{shape.S} float32 score matrix it holds")
    return "\n".join(lines)


def plot(report, path):
    """Bars per shape: the %peak of every row (runner, and for fastattn SIMD
    path), one panel per thread count; written to path as PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = report["settings"]["threads"]
    widest = report["machine"]["simd_paths"][-1]
    series = list(dict.fromkeys(label(c) for c in report["cases"]))
    shapes = [s for s in report["settings"]["shapes"] if ALL_SHAPES[s].kind in ("compute", "decode")]
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(8, 1.6 * len(shapes) + 4), 3.2 * len(threads)),
                             squeeze=False, layout="constrained")
    width = 0.8 / max(1, len(series))
    by_key = {(c["shape"], c["threads"], label(c)): c for c in report["cases"]}
    for ax, n in zip(axes[:, 0], threads):
        for i, name in enumerate(series):
            values = [by_key.get((s, n, name), {}).get("pct_peak", 0.0) for s in shapes]
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(shapes))],
                   values, width, label=name)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_ylabel("% of peak")
        ax.set_title(f"{n} thread{'s' if n > 1 else ''}: % of the FMA peak, fastattn of its SIMD "
                     f"path's, the others of {widest}'s\n(decode: of the read bandwidth)",
                     fontsize="medium")
        ax.axhline(100, color="grey", linewidth=0.5)
        fma = report["peaks"].get(str(n), {}).get("fma", {})
        for isa, peak in fma.items():  # the narrower paths' ceilings, as a share of the widest
            if isa != widest and widest in fma:
                ax.axhline(100 * peak["gflops"] / fma[widest]["gflops"], color="grey",
                           linestyle="--", linewidth=0.8,
                           label=f"{isa} FMA peak, as % of {widest}'s")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
