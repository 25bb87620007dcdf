"""Every reweighting function on the same inputs, in the manner of the MultiMax paper's Figure 1.

Inputs are 3-entry score vectors x = (x1, x2, 0) on a grid. Top row: each input's output p, a point of the
2-simplex, shown as the colour (p1, p2, p3) over the input plane: pure red/green/blue where one entry takes all
the weight (the sparse functions' flat regions), mixtures where the weight is shared. Bottom row: the same
outputs as points on the simplex triangle (corners: one-hot; edges: one entry exactly 0).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from models.multimax import PAPER_TABLE_7, multimax, paper_row_to_params
from models.reweighting import FUNCTIONS, Reweight
from models.training.plot import save_figure

LIMIT = 3.0  # the grid spans [-LIMIT, LIMIT]^2 for (x1, x2)
GRID = 121


def _functions() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    ranges, ts = (torch.tensor(v) for v in paper_row_to_params(PAPER_TABLE_7[-1]))  # the paper's deepest layer
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "softmax": lambda x: torch.softmax(x, -1),
        "multimax (Table 7, layer 12)": lambda x: multimax(x, ranges, ts),
    }
    shown: dict[str, dict[str, float]] = {"topk_softmax": {"k": 2}, "gaussian": {"offset": 0.0, "scale": 1.0},
                                          "laplacian": {"offset": 0.0, "scale": 1.0}}  # fmt: skip
    for name, spec in FUNCTIONS.items():
        if spec.fn is None or name == "softmax":
            continue
        kw: dict[str, float] = {**spec.options, **shown.get(name, {})}
        label = name + (f" ({', '.join(f'{k}={v:g}' for k, v in kw.items())})" if kw else "")
        out[label] = _bound(spec.fn, kw)
    return out


def _bound(fn: Reweight, kw: dict[str, float]) -> Callable[[torch.Tensor], torch.Tensor]:
    """fn with its options, on unmasked rows."""
    return lambda x: fn(x, None, -1, **kw)


def simplex_xy(p: torch.Tensor) -> torch.Tensor:
    """Barycentric -> plane: corners (0, 0), (1, 0), (1/2, sqrt(3)/2) for entries 1, 2, 3."""
    return torch.stack([p[..., 1] + 0.5 * p[..., 2], (3**0.5 / 2) * p[..., 2]], -1)


def plot_simplex(out: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = torch.linspace(-LIMIT, LIMIT, GRID, dtype=torch.float64)
    x1, x2 = torch.meshgrid(axis, axis, indexing="xy")
    x = torch.stack([x1, x2, torch.zeros_like(x1)], -1)
    functions = _functions()
    fig, axes = plt.subplots(2, len(functions), figsize=(2.3 * len(functions), 4.9))
    triangle = torch.tensor([[0, 0], [1, 0], [0.5, 3**0.5 / 2], [0, 0]])
    coarse = x[::6, ::6].reshape(-1, 3)
    for col, (label, fn) in enumerate(functions.items()):
        with torch.no_grad():
            p = fn(x).clamp(0, 1)
        top, bottom = axes[0, col], axes[1, col]
        top.imshow(p.numpy(), origin="lower", extent=(-LIMIT, LIMIT, -LIMIT, LIMIT))
        zero = (p == 0).any(-1).float().mean().item()
        top.set_title(f"{label}\n{zero:.0%} of inputs: some p_i = 0", fontsize=7)
        top.set_xlabel("x1", fontsize=7)
        top.set_ylabel("x2 (x3 = 0)", fontsize=7)
        top.tick_params(labelsize=6)
        with torch.no_grad():
            q = fn(coarse).clamp(0, 1)
        xy = simplex_xy(q)
        bottom.plot(triangle[:, 0], triangle[:, 1], color="0.6", lw=0.8)
        bottom.scatter(xy[:, 0], xy[:, 1], c=q.numpy(), s=5)
        bottom.set_aspect("equal")
        bottom.axis("off")
    axes[1, 0].text(-0.05, -0.08, "p1", fontsize=7)
    axes[1, 0].text(0.98, -0.08, "p2", fontsize=7)
    axes[1, 0].text(0.47, 0.9, "p3", fontsize=7)
    fig.suptitle("Each reweighting function on x = (x1, x2, 0): output colour = (p1, p2, p3) (top); "
                 "outputs on the simplex (bottom)", fontsize=9)  # fmt: skip
    return save_figure(fig, out, dpi=130)
