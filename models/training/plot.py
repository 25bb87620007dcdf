"""Plots of learned MultiMax modulations (the paper's Figure 3) from any supported checkpoint."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.atomic import publish, staging_dir
from models.multimax import sigma


def save_figure(fig: Any, out: str | Path, dpi: int) -> Path:
    """Lay out, write atomically as PNG (an interrupted run leaves the old file, never half a PNG), close."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(out) as staging:
        fig.savefig(staging / out.name, dpi=dpi, format="png")
        publish(staging / out.name, out)
    plt.close(fig)
    return out


@dataclass
class LearnedModulation:
    name: str  # "layer 3" or "output"
    ranges: torch.Tensor
    ts: torch.Tensor
    order: int
    affine: tuple[float, float] | None = None  # V2's (t, b)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.affine is not None:
            x = self.affine[0] * x + self.affine[1]
        return sigma(x, self.ranges, self.ts, self.order)


def learned_modulations(state_dict: dict[str, torch.Tensor], variant: str) -> list[LearnedModulation]:
    """Every MultiMax place in a state dict, attention layers in depth order, then the output."""
    order = 2 if variant == "second" else 1
    found: list[tuple[float, LearnedModulation]] = []
    for key in state_dict:
        if not key.endswith("ranges"):
            continue
        prefix = key[: -len("ranges")]
        if prefix + "ts" not in state_dict:
            continue
        layer = re.search(r"(?:blocks|layers|h)\.(\d+)\.", key)
        affine = None
        if prefix + "t" in state_dict and prefix + "b" in state_dict:
            affine = (float(state_dict[prefix + "t"]), float(state_dict[prefix + "b"]))
        mod = LearnedModulation(
            name=f"layer {int(layer.group(1)) + 1}" if layer else "output",
            ranges=state_dict[key].detach().float(),
            ts=state_dict[prefix + "ts"].detach().float(),
            order=order,
            affine=affine,
        )
        found.append((int(layer.group(1)) if layer else math.inf, mod))
    return [m for _, m in sorted(found, key=lambda item: item[0])]


def plot_sigma(mods: list[LearnedModulation], out: str | Path, title: str, span: float = 6.0) -> Path:
    """One panel per place: learned sigma (solid) against the identity (dashed), as in Figure 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not mods:
        raise ValueError("the checkpoint has no MultiMax parameters to plot (a softmax model)")
    cols = min(4, len(mods))
    rows = math.ceil(len(mods) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.9 * rows), squeeze=False)
    x = torch.linspace(-span, span, 601)
    for ax, mod in zip(axes.flat, mods, strict=False):
        ax.plot(x, x, "k--", linewidth=1, label="identity (SoftMax)")
        ax.plot(x, mod(x), color="tab:red", linewidth=1.8, label="learned σ")
        ax.set_title(mod.name, fontsize=10)
        ax.set_ylim(-2.5 * span, 2.5 * span)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(mods) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(title)
    fig.supxlabel("SoftMax input x")
    fig.supylabel("σ(x)")
    return save_figure(fig, out, dpi=110)
