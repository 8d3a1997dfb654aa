"""fastattn's speed against the fastest of PyTorch, ONNX Runtime and
OpenVINO on each shape, at 1 and 2 threads, from the records README's speed
table is rendered from (RECORDS of benchmarks/render_readme.py), on each
record's default SIMD path, as that table: above 1, fastattn is faster."""
import importlib.util
import json
import os

import matplotlib.pyplot as plt

here = os.getcwd()  # the plot directive runs this in docs/plots/
script = os.path.join(here, "..", "..", "benchmarks", "render_readme.py")
spec = importlib.util.spec_from_file_location("render_readme", script)
render = importlib.util.module_from_spec(spec)
spec.loader.exec_module(render)

runs = []
for name in render.RECORDS:
    with open(os.path.join(render.RECORDS_DIR, name)) as f:
        run = json.load(f)
    path = run["machine"]["fastattn_simd"]
    # the cases README's table shows; the storages only fastattn runs have no peer
    ratios = {(c["shape"], c["threads"]): c["speedup_vs_best_peer"] for c in run["cases"]
              if c["runner"] == "fastattn" and c.get("simd") == path and c["status"] == "ok"
              and "speedup_vs_best_peer" in c}
    shapes = [s for s in run["settings"]["shapes"] if any(k[0] == s for k in ratios)]
    runs.append((name, run["machine"], shapes, ratios))

top = max(r for *_, ratios in runs for r in ratios.values())
fig, axes = plt.subplots(len(runs), 1, figsize=(8, 3.2 * len(runs)), squeeze=False,
                         sharey=True, layout="constrained")
for ax, (name, machine, shapes, ratios) in zip(axes[:, 0], runs):
    width = 0.4
    for k, threads in enumerate((1, 2)):
        bars = ax.bar([i + (k - 0.5) * width for i in range(len(shapes))],
                      [ratios.get((s, threads), 0) for s in shapes], width,
                      label=f"{threads} thread{'s' * (threads > 1)}")
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_ylim(0, top * 1.12)
    ax.set_xticks(range(len(shapes)), shapes, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fastest peer's time / fastattn's", fontsize=8)
    ax.set_title(f"{render.cpu_cell(machine)} ({name})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
