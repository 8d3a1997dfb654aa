"""fastattn's time against the faster of PyTorch and ONNX Runtime, per
shape, from the benchmark records (benchmarks/records/*.json): above 1,
fastattn is faster."""
import glob
import json
import os

import matplotlib.pyplot as plt

here = os.getcwd()  # the plot directive runs this in docs/plots/
records = sorted(glob.glob(os.path.join(here, "..", "..", "benchmarks", "records", "*thread*.json")))
fig, axes = plt.subplots(len(records), 1, figsize=(8, 3.2 * len(records)), squeeze=False,
                         layout="constrained")
for ax, path in zip(axes[:, 0], records):
    run = json.load(open(path))
    rows = {}
    for c in run["cases"]:
        if c["runner"] == "fastattn" and "speedup_vs_best_peer" in c:
            rows.setdefault((c["threads"], c["simd"]), {})[c["shape"]] = c["speedup_vs_best_peer"]
    shapes = sorted({s for r in rows.values() for s in r}, key=lambda s: s)
    width = 0.8 / max(len(rows), 1)
    for k, ((threads, simd), r) in enumerate(sorted(rows.items())):
        ax.bar([i + k * width for i in range(len(shapes))], [r.get(s, 0) for s in shapes], width,
               label=f"{simd}, {threads} thread{'s' * (threads > 1)}")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))], shapes, rotation=30,
                  ha="right", fontsize=8)
    ax.set_ylabel("best peer's time / fastattn's")
    cpu = run["machine"].get("cpu_id", {}).get("name") or run["machine"]["cpu"]
    ax.set_title(f"{os.path.basename(path)} ({cpu})", fontsize=9)
    ax.legend(fontsize=7)
