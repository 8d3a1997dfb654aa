"""From raw results (suite.run_suite) to derived figures, the printed
table, the issue's targets, and the plot."""
from .runners import BASELINES, PEERS, RUNNERS
from .shapes import ALL_SHAPES, SHAPES

MB = 1 << 20
BUSY = 0.1  # cores used by other processes above which a measurement is disturbed


def derive(report):
    """Add to every measured case: gflops (compute shapes) or gbps (decode:
    key and value bytes over the time) or us (the tiny shape); pct_peak (of
    the FMA peak at that thread count, or of the read bandwidth measured on
    the decode shape's own key and value); speedup_vs_<library> = the
    median time of that library's faster runner / this one's (> 1: faster;
    libraries: runners.BASELINES); speedup_vs_best_peer, the smallest of
    those of runners.PEERS."""
    cases = [c for c in report["cases"] if c.get("status") == "ok" and "median" in c]
    times = {(c["shape"], c["threads"], c["runner"]): c["median"] for c in cases}
    for c in cases:
        shape, peaks = ALL_SHAPES[c["shape"]], report["peaks"].get(str(c["threads"]), {})
        t = c["median"]
        if shape.kind == "compute":
            c["gflops"] = shape.flops / t / 1e9
            if "fma" in peaks:
                c["pct_peak"] = 100 * c["gflops"] / peaks["fma"]["gflops"]
        elif shape.kind == "decode":
            c["gbps"] = shape.kv_bytes / t / 1e9
            same = peaks.get(f"read:{shape.name}")
            if same:
                c["pct_peak"] = 100 * c["gbps"] / same["gbps"]
        elif shape.kind == "overhead":
            c["us"] = t * 1e6
        for library, runners in BASELINES.items():
            theirs = [times[key] for key in ((c["shape"], c["threads"], r) for r in runners)
                      if key in times and key[2] != c["runner"]]
            if theirs:
                c[f"speedup_vs_{library}"] = min(theirs) / t
        peers = [c[f"speedup_vs_{p}"] for p in PEERS if f"speedup_vs_{p}" in c]
        if peers:
            c["speedup_vs_best_peer"] = min(peers)
    return report


def _fmt(x, spec, missing="-"):
    return missing if x is None else format(x, spec)


def _case_rows(report, n):
    by_key = {(c["shape"], c["runner"]): c for c in report["cases"] if c["threads"] == n}
    for shape_name in report["settings"]["shapes"]:
        for runner in report["settings"]["runners"]:
            c = by_key.get((shape_name, runner))
            if c is not None:
                yield ALL_SHAPES[shape_name], c


def format_peaks(report):
    peaks = report["peaks"]
    kernel = next((p["fma"]["isa"] for p in peaks.values() if "fma" in p), None)
    others = sorted({isa for p in peaks.values() for isa in p.get("fma_others", {})})
    head = "".join(f"  {'FMA ' + isa:>12}" for isa in [kernel] + others if isa)
    lines = ["Machine peaks measured in this run (best of the runs of csrc/fa_peak*.c), "
             "FMA in GFLOP/s:", f"  {'threads':>7}{head}  {'read GB/s':>10}"]
    for n, p in peaks.items():
        fma = [p.get("fma")] + [p.get("fma_others", {}).get(isa) for isa in others]
        read = p.get("read")
        lines.append(f"  {n:>7}" + "".join(f"  {_fmt(f and f['gflops'], '12.1f'):>12}" for f in fma)
                     + f"  {_fmt(read and read['gbps'], '10.1f'):>10}")
        for key, value in p.items():
            if key.startswith("read:"):
                lines.append(f"  {'':>7}  read GB/s on {key[5:]}'s own key and value "
                             f"({value['bytes'] / MB:.0f} MB): {value['gbps']:.1f}")
    for n, p in peaks.items():
        busy = [(key, v["other_cores"]) for key, v in p.items() if isinstance(v, dict)
                and (v.get("other_cores") or 0) > BUSY]
        if busy:
            lines.append(f"  WARNING: at {n} thread(s) other processes used "
                         + ", ".join(f"{c:.2f} cores during {k}" for k, c in busy)
                         + ": those peaks are low, and %peak against them high")
    one = peaks.get("1", {}).get("fma")
    for n, p in peaks.items():
        if one and "fma" in p and int(n) > 1 and p["fma"]["gflops"] < 0.8 * int(n) * one["gflops"]:
            lines.append(f"  WARNING: the FMA peak at {n} threads is "
                         f"{p['fma']['gflops'] / one['gflops']:.2f} x the 1-thread one: other "
                         f"processes were using the cores, so the {n}-thread numbers are disturbed")
    if kernel:
        lines.append(f"  FMA {kernel}: the loop in the instruction set of fastattn's kernels; "
                     "%peak is of it." + (" The other widths: the ceilings of peers that use "
                                          "them." if others else "")
                     + "  read: a 256 MB buffer, 8 x a 32 MB L3.")
    return lines


def format_table(report):
    """The comparison as text, one block per thread count."""
    s = report["settings"]
    m = report["machine"]
    lines = [f"fastattn bench: float32, median of >= {s['repeat']} calls and >= {s['min_time']} s "
             f"per case after {s['warmup']} warm-up call(s), each case in a fresh process",
             f"CPU: {m['cpu']} ({m['logical_cpus']} logical CPUs); fastattn {m['fastattn']} "
             f"({m['fastattn_simd']}, OpenMP {'on' if m['openmp'] else 'off'}), "
             f"numpy {m['numpy']}, python {m['python']}"]
    versions = sorted({f"{RUNNERS[c['runner']].library} {c['version']}" for c in report["cases"]
                       if c.get("version") and RUNNERS[c["runner"]].library in PEERS})
    if versions:
        lines.append("peers: " + ", ".join(versions))
    if report["peaks"]:
        lines += format_peaks(report)
    head = (f"{'shape':<13} {'runner':<9} {'time':>10} {'speed':>14} {'xNumPy':>7} "
            f"{'xPyTorch':>8} {'xORT':>6} {'%peak':>6} {'+MB':>7} {'max err':>8} {'rms err':>8} {'other':>5}")
    for n in s["threads"]:
        lines += ["", f"== {n} thread{'s' if n > 1 else ''} ==", head]
        previous = None
        for shape, c in _case_rows(report, n):
            name = shape.name if shape.name != previous else ""
            previous = shape.name
            label = RUNNERS[c["runner"]].label
            if c.get("status") != "ok":
                lines.append(f"{name:<13} {label:<9} {c.get('status')}: {c.get('note')}")
                continue
            if "median" not in c:
                time_s = speed = "-"
            elif shape.kind == "overhead":
                time_s, speed = f"{c['us']:.1f} us", "(per call)"
            else:
                time_s = f"{c['median'] * 1e3:.3f} ms"
                speed = (f"{c['gbps']:.1f} GB/s" if "gbps" in c
                         else f"{c['gflops']:.1f} GFLOP/s" if "gflops" in c else "-")
            mem = c.get("peak_extra_bytes")
            lines.append(
                f"{name:<13} {label:<9} {time_s:>10} {speed:>14} "
                f"{_fmt(c.get('speedup_vs_numpy'), '7.2f'):>7} "
                f"{_fmt(c.get('speedup_vs_torch'), '8.2f'):>8} "
                f"{_fmt(c.get('speedup_vs_onnxruntime'), '6.2f'):>6} "
                f"{_fmt(c.get('pct_peak'), '6.1f'):>6} "
                f"{_fmt(None if mem is None else mem / MB, '7.1f'):>7} "
                f"{_fmt(c.get('max_abs_err'), '8.1e'):>8} "
                f"{_fmt(c.get('rms_err'), '8.1e'):>8} "
                f"{_fmt(c.get('other_cores'), '5.2f'):>5}")
    lines += ["", "time: median per call.  speed: 4·B·H·L·S·E FLOP (halved when causal) per "
              "second, or for decode-4096 bytes of key+value per second.  xNumPy, xPyTorch, "
              "xORT: that library's time / this one's (> 1: faster), ORT: the faster of its two "
              "key/value layouts, BSD = (B, S, H·E), BHSD = (B, H, S, E).  %peak: of the FMA peak at "
              "that thread count, or for decoding of the read bandwidth on the same key and "
              "value.  +MB: peak resident memory of the first call above the inputs and the "
              "output (fresh process).  max err, rms err: largest and root-mean-square "
              "|out - float64 reference| over up to 64 query rows per head.  other: CPU cores used by other processes during the timed "
              "calls (the machine may be shared; above 0.1 the numbers are disturbed)."]
    return "\n".join(lines)


def format_memory(report, estimated=()):
    """The peak-memory measurement at the memory shape; the runners in
    estimated hold the whole score matrix and get its size instead."""
    m = report["machine"]
    lines = [f"fastattn bench --memory: one call per runner, each in a fresh process; peak "
             f"resident memory above the inputs and the output (Linux VmHWM); CPU: {m['cpu']}"]
    for shape_name in report["settings"]["shapes"]:
        shape = ALL_SHAPES[shape_name]
        lines += [f"== peak memory, {shape.name} ({shape.describe()}; inputs + output "
                  f"{shape.io_bytes / MB:.0f} MB) ==",
                  f"{'runner':<14} {'threads':>7} {'+MB above inputs and output':>28} {'max err':>8}"]
        for c in report["cases"]:
            if c["shape"] != shape.name:
                continue
            label = RUNNERS[c["runner"]].label
            if c.get("status") != "ok":
                lines.append(f"{label:<14} {c['threads']:>7} {c.get('status')}: {c.get('note')}")
                continue
            mem = c.get("peak_extra_bytes")
            lines.append(f"{label:<14} {c['threads']:>7} "
                         f"{_fmt(None if mem is None else mem / MB, '28.1f', c.get('peak_note')):>28} "
                         f"{_fmt(c.get('max_abs_err'), '8.1e'):>8}")
        for name in estimated:
            lines.append(f"{RUNNERS[name].label:<14} {'any':>7} "
                         f"{'>= ' + format(shape.scores_bytes / MB, '.0f'):>28}  not run: the "
                         f"{shape.B}x{shape.H}x{shape.L}x{shape.S} float32 score matrix it holds")
    return "\n".join(lines)


def targets(report):
    """The project's speed targets against this run: (target, verdict, detail)."""
    ok = [c for c in report["cases"] if c.get("status") == "ok"]
    fa = [c for c in ok if c["runner"] == "fastattn"]
    table = {s.name for s in SHAPES}
    out = []

    def verdict(cond):
        return "met" if cond else "NOT met"

    timed = [c for c in fa if c["shape"] in table and "median" in c]
    vs_peer = [c for c in timed if "speedup_vs_best_peer" in c]

    def listing(cases, key, fmt, unit):
        return ", ".join(f"{c['shape']}@{c['threads']} {format(c[key], fmt)}{unit}" for c in cases)

    if vs_peer:
        worst = min(c["speedup_vs_best_peer"] for c in vs_peer)
        slower = [c for c in vs_peer if c["speedup_vs_best_peer"] <= 1]
        out.append(("faster than the faster peer on every shape", verdict(worst > 1),
                    f"{len(vs_peer) - len(slower)} of {len(vs_peer)} cases; not faster: "
                    + (listing(slower, "speedup_vs_best_peer", ".2f", "x") if slower else "none")))
        key = [c for c in vs_peer if c["shape"] in ("bert-base", "minilm-batch", "causal-2048")]
        if key:
            out.append(("at least 1.3x the faster peer on bert-base, minilm-batch, causal-2048",
                        verdict(min(c["speedup_vs_best_peer"] for c in key) >= 1.3),
                        listing(key, "speedup_vs_best_peer", ".2f", "x")))
    compute = [c for c in timed if c["shape"] in ("long-8192", "head-128") and "pct_peak" in c]
    if compute:
        out.append(("at least 85 % of the FMA peak on long-8192 and head-128",
                    verdict(min(c["pct_peak"] for c in compute) >= 85),
                    listing(compute, "pct_peak", ".1f", " %")))
    decode = [c for c in timed if ALL_SHAPES[c["shape"]].kind == "decode" and "pct_peak" in c]
    if decode:
        out.append(("decoding at least 80 % of the read bandwidth on the same bytes",
                    verdict(min(c["pct_peak"] for c in decode) >= 80),
                    listing(decode, "pct_peak", ".1f", " %")))
    big = [c for c in timed if ALL_SHAPES[c["shape"]].L >= 512 and "speedup_vs_numpy" in c]
    if big:
        out.append(("at least 3x NumPy on every shape with L >= 512",
                    verdict(min(c["speedup_vs_numpy"] for c in big) >= 3),
                    listing(big, "speedup_vs_numpy", ".1f", "x")))
    memory = [c for c in fa if ALL_SHAPES[c["shape"]].kind == "memory"
              and c.get("peak_extra_bytes") is not None]
    if memory:
        out.append(("at most 64 MB above inputs and output at L=S=16384",
                    verdict(max(c["peak_extra_bytes"] for c in memory) <= 64 * MB),
                    ", ".join(f"{c['threads']} thread(s) {c['peak_extra_bytes'] / MB:.1f} MB"
                              for c in memory)))
    # judged on the RMS error, the distance of the whole result; the largest
    # error, one rounding among thousands, is listed where it is larger
    torch_err = {(c["shape"], c["threads"]): c for c in ok
                 if c["runner"] == "torch" and c.get("rms_err") is not None}
    pairs = [(c, torch_err[(c["shape"], c["threads"])]) for c in fa
             if (c["shape"], c["threads"]) in torch_err and c.get("rms_err") is not None]
    if pairs:
        worse = [f"{c['shape']}@{c['threads']} {c['rms_err']:.2e} > {t['rms_err']:.2e}"
                 for c, t in pairs if c["rms_err"] > t["rms_err"]]
        worse_max = [f"{c['shape']}@{c['threads']} {c['max_abs_err']:.1e} > {t['max_abs_err']:.1e}"
                     for c, t in pairs if c["max_abs_err"] > t["max_abs_err"]]
        detail = ("RMS larger on: " + ", ".join(worse) if worse
                  else f"RMS no larger in {len(pairs)} cases")
        if worse_max:
            detail += "; largest error larger on: " + ", ".join(worse_max)
        out.append(("float32 error (RMS) no larger than PyTorch's", verdict(not worse), detail))
    tiny = [c for c in fa if ALL_SHAPES[c["shape"]].kind == "overhead" and "us" in c]
    if tiny:
        out.append(("a tiny call under 10 us (total call time, kernel included)",
                    verdict(max(c["us"] for c in tiny) < 10),
                    ", ".join(f"{c['threads']} thread(s) {c['us']:.1f} us" for c in tiny)))
    return out


def format_targets(report):
    rows = targets(report)
    lines = ["", "Speed targets of the project (this run):"]
    lines += [f"  [{v}] {t}: {d}" for t, v, d in rows]
    if not rows:
        lines.append("  none applies to the shapes and runners measured")
    return "\n".join(lines)


def plot(report, path):
    """Bars per shape: % of this machine's peak reached by each runner, one
    panel per thread count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = report["settings"]["threads"]
    runners = report["settings"]["runners"]
    shapes = [s for s in report["settings"]["shapes"] if ALL_SHAPES[s].kind in ("compute", "decode")]
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(8, 1.6 * len(shapes) + 4), 3.2 * len(threads)),
                             squeeze=False, layout="constrained")
    width = 0.8 / max(1, len(runners))
    by_key = {(c["shape"], c["threads"], c["runner"]): c for c in report["cases"]}
    for ax, n in zip(axes[:, 0], threads):
        for i, r in enumerate(runners):
            values = [by_key.get((s, n, r), {}).get("pct_peak", 0.0) for s in shapes]
            ax.bar([x + (i - (len(runners) - 1) / 2) * width for x in range(len(shapes))],
                   values, width, label=RUNNERS[r].label)
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes)
        ax.set_ylabel("% of machine peak")
        peaks = report["peaks"].get(str(n), {})
        kernel = peaks.get("fma", {}).get("isa", "")
        ax.set_title(f"{n} thread{'s' if n > 1 else ''}: % of the {kernel} FMA peak "
                     "(decode: of the read bandwidth)", fontsize="medium")
        ax.axhline(100, color="grey", linewidth=0.5)
        for isa, other in peaks.get("fma_others", {}).items():
            ax.axhline(100 * other["gflops"] / peaks["fma"]["gflops"], color="grey",
                       linestyle="--", linewidth=0.8, label=f"{isa} FMA peak")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, dpi=120)
    plt.close(fig)
