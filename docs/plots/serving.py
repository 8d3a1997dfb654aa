"""bench --serving from its record: each row's time over the paged call's."""
import glob
import json
import os

import matplotlib.pyplot as plt

here = os.getcwd()  # the plot directive runs this in docs/plots/
path = sorted(glob.glob(os.path.join(here, "..", "..", "benchmarks", "records", "*serving.json")))[-1]
run = json.load(open(path))
fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), layout="constrained")
for ax, step in zip(axes, ("decode-64", "mixed")):
    cases = [c for c in run["cases"] if c["step"] == step]
    names = list(cases[0]["rows"])
    for k, c in enumerate(cases):
        paged = c["rows"]["paged"]["median"]
        ax.bar([i + 0.4 * k for i in range(len(names))],
               [c["rows"][n]["median"] / paged for n in names], 0.4,
               label=f"{c['threads']} thread{'s' * (c['threads'] > 1)}")
    ax.set_yscale("log")
    ax.axhline(1, color="black", linewidth=0.8)
    ax.set_xticks([i + 0.2 for i in range(len(names))], names, rotation=30, ha="right", fontsize=8)
    ax.set_title(step, fontsize=9)
    ax.set_ylabel("time / the paged call's")
    ax.legend(fontsize=7)
