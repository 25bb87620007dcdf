"""`python -m benchmarks.reweighting_train_cost`: each reweighting function's training-step cost against SoftMax
in the digits DeiT of `python -m models.training compare`, measured side by side.

A step is what `train_vision` does per batch: forward, the recipe's loss, backward, gradient clipping, an AdamW
step, on one fixed batch of the recipe's size (64 augmented digits, made once: augmentation is the same for every
function and left out). Every function's model (the compare command's configs and options; the MultiMax twin
with its MultiMax output) steps in interleaved rounds (alternating who goes first); the ratio is the median of
the per-round ratios to SoftMax. Unlike the compare table's wall times, which were taken one function after
another under whatever load the shared machine had, the ratios come from one run.

`--into RESULTS` also writes them into the compare results JSON (docs/reweighting_results.json), whose table
(`python -m models.training compare --table`) then shows them as "step vs SoftMax".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import date
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.export_time import interleaved, write_results
from models.deit import DeiT
from models.training.compare import ALL, OPTIONS, update_results
from models.training.optim import param_groups
from models.training.vision import augment, demo_config, digits_8x8_split, normalize

TRAIN_STEP = "train_step"  # the results JSON's key for these ratios


def step_fn(name: str, images: torch.Tensor, labels: torch.Tensor, seed: int = 0) -> Callable[[], None]:
    """One training step of `name`'s digits model, as train_vision takes it, on a fixed batch."""
    torch.manual_seed(seed)
    multimax = ("attention", "output") if name == "multimax" else ()
    function = None if name in ("multimax", "softmax") else name
    model = DeiT(demo_config(multimax, function, OPTIONS.get(name))).train()
    optimizer = torch.optim.AdamW(param_groups(model, 0.05), lr=2e-3)

    def step() -> None:
        loss = F.cross_entropy(model(images), labels, label_smoothing=0.1)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def measure(names: list[str], rounds: int, steps: int, batch: int = 64) -> dict[str, dict[str, float]]:
    """{function: {median_ms, ratio_to_softmax}} with softmax first (the base)."""
    x_train, y_train, _, _ = digits_8x8_split(0)
    generator = torch.Generator().manual_seed(0)
    images, labels = normalize(augment(x_train[:batch], generator)), y_train[:batch]
    order = ["softmax", *(n for n in names if n != "softmax")]
    return interleaved({n: step_fn(n, images, labels) for n in order}, rounds, steps, "training steps")


def markdown(results: dict[str, Any]) -> str:
    rows = [
        f"Measured {results['date']} with `{results['command']}` ({results['machine']})",
        "",
        "| function (digits DeiT) | training step / SoftMax | ms per step |",
        "|---|---:|---:|",
    ]
    for name, r in results["functions"].items():
        rows.append(f"| {name} | {r['ratio_to_softmax']:.3f} | {r['median_ms']:.1f} |")
    return "\n".join(rows)


def write_into(results_json: Path, results: dict[str, Any]) -> None:
    """Put the ratios into the compare results JSON under TRAIN_STEP (atomically, under compare's lock; the rest
    kept as it is)."""

    def put(data: dict[str, Any]) -> None:
        data[TRAIN_STEP] = {
            "command": results["command"], "date": results["date"], "machine": results["machine"],
            "ratio_to_softmax": {n: round(r["ratio_to_softmax"], 3) for n, r in results["functions"].items()},
        }  # fmt: skip

    update_results(results_json, put)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.reweighting_train_cost", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    p.add_argument("--steps", type=int, default=3, help="training steps per function and round")
    p.add_argument("--only", nargs="+", choices=ALL, default=list(ALL), metavar="FUNCTION",
                   help=f"functions to measure besides softmax (default all: {', '.join(ALL)})")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1, the compare recipe's)")
    p.add_argument("--into", type=Path, metavar="RESULTS", help="also write the ratios into this compare results JSON")
    p.add_argument("-o", "--output", default="runs/bench_train_cost.json")
    args = p.parse_args(argv)
    if min(args.rounds, args.steps, args.threads) < 1:
        p.error("--rounds, --steps and --threads must be >= 1")
    if args.into is not None and args.into.exists() and not args.into.is_file():
        p.error(f"--into {args.into}: not a file")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        results = run(args, argv)
    finally:
        torch.set_num_threads(threads)  # called in-process (tests): leave the caller's setting
    if args.into is not None:
        write_into(args.into, results)
    return write_results(results, Path(args.output), markdown(results))


def run(args: argparse.Namespace, argv: list[str] | None) -> dict[str, Any]:
    results: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "python -m benchmarks.reweighting_train_cost " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{os.cpu_count()} CPUs, {args.threads} torch thread(s), load average {os.getloadavg()[0]:.1f} "
        "at the start",
    }
    results["functions"] = measure(args.only, args.rounds, args.steps)
    results["machine"] += f", {os.getloadavg()[0]:.1f} at the end"
    return results


if __name__ == "__main__":
    raise SystemExit(main())
