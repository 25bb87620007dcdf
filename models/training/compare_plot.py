"""The compare results as a figure: each function's held-out accuracy per seed, and its training-step cost.

Left: one row per function, a dot per seed (the main seed, the table's, ringed), the mean and ± one standard
deviation as a bar; a grid line every held-out image (0.28% of 360), so differences of one or two images
read as what they are. Right: one training step's cost relative to SoftMax (benchmarks.reweighting_train_cost).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from models.training.compare import ALL, HELDOUT_IMAGES, seed_runs
from models.training.plot import save_figure


def plot_seed_accuracies(data: dict[str, Any], out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ALL if data.get("results", {}).get(n)]
    if not names:
        raise ValueError("no results to plot (run compare first)")
    steps = data.get("train_step", {}).get("ratio_to_softmax", {})
    fig, (acc_ax, step_ax) = plt.subplots(
        1, 2, figsize=(11, 0.45 * len(names) + 1.6), sharey=True, gridspec_kw={"width_ratios": [3, 1]}
    )
    all_accs: list[float] = []
    for row, name in enumerate(names):
        accs = [100 * r["heldout_accuracy"] for r in seed_runs(data, name)]
        all_accs += accs
        # Seeds with the same accuracy (the same number of images) are stacked upwards, not hidden.
        ys = [row - 0.14 * accs[:i].count(a) for i, a in enumerate(accs[1:], start=1)]
        acc_ax.scatter(accs[1:], ys, color="tab:blue", alpha=0.6, s=28, zorder=3)
        acc_ax.scatter(accs[:1], [row], facecolor="none", edgecolor="black", s=70, zorder=4)
        if len(accs) > 1:
            mean, sd = statistics.mean(accs), statistics.stdev(accs)
            acc_ax.errorbar(mean, row + 0.3, xerr=sd, fmt="D", color="tab:red", ms=5, capsize=3, zorder=3)
        if name in steps:
            step_ax.barh(row, steps[name], color="tab:gray")
            step_ax.text(steps[name], row, f" {steps[name]:.2f}", va="center", fontsize=8)
    image = 100 / HELDOUT_IMAGES
    low, high = min(all_accs) - image, min(100.0, max(all_accs) + image)
    acc_ax.set_xticks([100 - image * k for k in range(int((100 - low) / image) + 1)], minor=True)
    acc_ax.grid(True, which="minor", axis="x", alpha=0.25)
    acc_ax.set_xlim(low, high + image / 2)
    acc_ax.set_yticks(range(len(names)), names)
    acc_ax.invert_yaxis()
    recipe, seeds = data.get("recipe", {}), 1 + len(data.get("seeds", {}))
    acc_ax.set_xlabel(
        f"held-out accuracy, % (grid: one image of {HELDOUT_IMAGES}; ring: seed {recipe.get('seed', 0)}; "
        "red: mean ± sd)"
    )
    acc_ax.set_title(f"digits DeiT, {recipe.get('epochs', '?')} epochs, {seeds} seed(s)")
    step_ax.axvline(1.0, color="black", lw=0.8)
    step_ax.set_xlabel("training step / SoftMax")
    step_ax.set_title("step cost (side by side)")
    step_ax.set_xlim(0, max([1.0, *steps.values()]) * 1.25)
    return save_figure(fig, out, dpi=120)
