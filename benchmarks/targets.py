"""The project's own targets (those of the issues that set them), judged on a
`fastattn bench --json` file: a developer's check, not part of what
`fastattn bench` shows its users.

    fastattn bench --json bench.json
    python benchmarks/targets.py bench.json [--simd avx2]

Prints one line per target with `met` or `NOT met` and the figures behind
it; exits with status 1 when a target is not met.  fastattn is judged on
one SIMD path: --simd, else the first of the run.
"""
import argparse
import json
import sys

from fastattn.bench.report import MB
from fastattn.bench.shapes import ALL_SHAPES, SHAPES


def targets(report, simd=None):
    """The project's targets against one run (a `fastattn bench --json`
    report): [(target, verdict, detail)], verdict "met" or "NOT met".  simd:
    judge fastattn on that SIMD path (default: the first the run measured)."""
    simd = simd or report["settings"].get("simd", [None])[0]
    ok = [c for c in report["cases"] if c.get("status") == "ok"]
    fa = [c for c in ok if c["runner"] == "fastattn" and c.get("simd") == simd]
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
    full = {c["threads"]: c["median"] for c in timed if c["shape"] == "causal-8192"}
    window = [(c, full[c["threads"]] / c["median"]) for c in timed
              if c["shape"] == "window-8192" and c["threads"] in full]
    if window:
        out.append(("a window of 1024 at least 4x faster than full causal attention (L = 8192)",
                    verdict(min(r for _, r in window) >= 4),
                    ", ".join(f"{c['threads']} thread(s) {r:.1f}x" for c, r in window)))
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


def format_targets(report, simd=None):
    rows = targets(report, simd)
    simd = simd or report["settings"].get("simd", ["?"])[0]
    lines = [f"The project's targets, fastattn on {simd} (this run):"]
    lines += [f"  [{v}] {t}: {d}" for t, v, d in rows]
    if not rows:
        lines.append("  none applies to the shapes and runners measured")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", help="the file of fastattn bench --json FILE")
    parser.add_argument("--simd", help="the SIMD path to judge (default: the run's first)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        report = json.load(f)
    measured = report["settings"].get("simd", [])
    if args.simd and args.simd not in measured:
        parser.error(f"--simd {args.simd}: the run measured {', '.join(measured) or 'no path'}")
    print(format_targets(report, args.simd))
    return 1 if any(v != "met" for _, v, _ in targets(report, args.simd)) else 0


if __name__ == "__main__":
    sys.exit(main())
