"""`python -m models.training compare`: the digits DeiT demo trained with every attention reweighting function.

Same recipe, seed and budget as the shipped MultiMax and softmax twins (`train_vision`'s defaults: 120
epochs, seed 0); each other function replaces the attention step and keeps plain logits at the output, as the
softmax twin does. The two twins are not retrained: their numbers are the shipped checkpoints' (training time
from models/demo/report.json), measured the same way. Training time is wall time (under whatever load the
machine had) and the process's CPU time; the table's "step vs SoftMax" column comes from
benchmarks.reweighting_train_cost, which times all functions side by side in one run. Each function's result is
written to the results JSON as soon as it is done, so an interrupted run resumes where it stopped (a result with
another recipe is redone).

Attention metrics, on the held-out images, every layer and head: the paper's multi-modality M (definition 3.2)
and sparsity S (3.3, reference s = the row's smallest softmax probability) with the threshold eps = the row mean
of the scores (relevant: above the mean; irrelevant: below), plus the share of exactly-zero weights and the mean
entropy of the rows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from models.atomic import publish, staging_dir
from models.checkpoint import build_model, load, save_checkpoint
from models.deit import DeiT
from models.demo import DEMO_DIR, VISION_MULTIMAX, VISION_SOFTMAX
from models.metrics import multimodality, sparsity
from models.reweighting import FUNCTIONS, OTHER_FUNCTIONS

# Per function: its options for the digits model (16 tokens per row: top-k keeps a quarter of them).
OPTIONS: dict[str, dict[str, float]] = {"topk_softmax": {"k": 4}, "length_scaled": {"eps": 0.1, "m": 0.0}}
SHIPPED = {"multimax": VISION_MULTIMAX, "softmax": VISION_SOFTMAX}
ALL = ("multimax", "softmax", *OTHER_FUNCTIONS)
RESULTS = Path("docs/reweighting_results.json")


@torch.no_grad()
def attention_metrics(model: DeiT, images: torch.Tensor, batch_size: int = 120) -> dict[str, float]:
    """M, S, exact-zero share and entropy of every attention row of every layer and head (means)."""
    captured: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_hook(lambda m, a, o: captured.append(a[0])) for b in model.block_list()]
    sums = {"multimodality": 0.0, "sparsity": 0.0, "zero_share": 0.0, "entropy": 0.0}
    counts = dict.fromkeys(sums, 0)
    model.eval()
    try:
        for start in range(0, len(images), batch_size):
            captured.clear()
            model((images[start : start + batch_size] - 0.5) / 0.5)
            for block, x in zip(model.block_list(), captured, strict=True):
                scores, _ = block.attn.scores_and_values(x)
                probs = block.attn.probs(scores)
                eps = scores.mean(-1, keepdim=True)
                for key, values in (
                    ("multimodality", multimodality(scores, block.attn.probs, eps)),
                    ("sparsity", sparsity(scores, block.attn.probs, eps)),
                    ("zero_share", (probs == 0).float().mean(-1)),
                    ("entropy", -(probs * probs.clamp(min=1e-30).log()).sum(-1)),
                ):
                    ok = ~torch.isnan(values)
                    sums[key] += float(values[ok].sum())
                    counts[key] += int(ok.sum())
    finally:
        for h in hooks:
            h.remove()
    return {k: sums[k] / max(counts[k], 1) for k in sums}


def _recipe(epochs: int | None, seed: int) -> dict[str, Any]:
    return {"epochs": epochs or 120, "seed": seed, "threads": torch.get_num_threads()}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with staging_dir(path) as staging:
        (staging / path.name).write_text(json.dumps(data, indent=2) + "\n")
        publish(staging / path.name, path)


def _shipped(name: str, x_test: torch.Tensor, y_test: torch.Tensor) -> dict[str, Any]:
    from models.training.vision import accuracy

    model, ckpt, _ = load(DEMO_DIR / SHIPPED[name])
    assert isinstance(model, DeiT)
    report = json.loads((DEMO_DIR / "report.json").read_text()).get(SHIPPED[name], {})
    return {
        "heldout_accuracy": accuracy(model, x_test, y_test),
        "seconds": report.get("seconds"),
        "epochs": report.get("epochs"),
        "options": {},
        "output": "multimax" if ckpt.config.get("multimax_output") else "plain",
        "trained": f"shipped (models/demo/{SHIPPED[name]})",
        **attention_metrics(model, x_test),
    }


def compare(
    names: Iterable[str] = ALL,
    results: Path = RESULTS,
    epochs: int | None = None,
    seed: int = 0,
    checkpoints: Path | None = None,
    progress: bool = True,
    retrain_twins: bool = False,
) -> dict[str, Any]:
    """Train (or read) each function's digits model; the results JSON is rewritten after each one.

    `retrain_twins`: train the MultiMax and softmax twins here too (their training time measured under the
    same load as the others') instead of reading the shipped checkpoints; the shipped files are not touched.
    """
    from models.training.demo import vision_checkpoint
    from models.training.vision import digits_split, train_vision

    names = list(names)
    unknown = [n for n in names if n not in FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown function(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    recipe = _recipe(epochs, seed)
    data: dict[str, Any] = json.loads(results.read_text()) if results.is_file() else {}
    if {k: data.get("recipe", {}).get(k) for k in ("epochs", "seed")} != {k: recipe[k] for k in ("epochs", "seed")}:
        data = {}  # another budget: nothing to resume
    data["recipe"] = recipe
    data.setdefault("results", {})
    _, _, x_test, y_test = digits_split(seed=0)
    for name in names:
        done = data["results"].get(name)
        if done is not None and not (retrain_twins and str(done.get("trained", "")).startswith("shipped")):
            print(f"{name}: done before, kept ({results})", flush=True)
            continue
        start = time.perf_counter()
        if name in SHIPPED and not retrain_twins:
            entry = _shipped(name, x_test, y_test)
        else:
            kwargs: dict[str, Any] = {"epochs": epochs} if epochs else {}
            function = None if name in SHIPPED else name
            cpu = time.process_time()  # CPU time: far less sensitive than wall time to the shared machine's load
            result = train_vision(
                multimax=("attention", "output") if name == "multimax" else (), seed=seed, progress=progress,
                attention_function=function, attention_options=OPTIONS.get(name), **kwargs
            )
            cpu = time.process_time() - cpu
            ckpt = vision_checkpoint(result)
            if checkpoints is not None:
                checkpoints.mkdir(parents=True, exist_ok=True)
                save_checkpoint(ckpt, checkpoints / f"digits_{name}.pt")
            model = build_model(ckpt)
            assert isinstance(model, DeiT)
            metrics = result["metrics"]
            entry = {
                "heldout_accuracy": metrics["heldout_accuracy"],
                "heldout_accuracy_by_input": metrics["heldout_accuracy_by_input"],
                "seconds": metrics["seconds"],
                "cpu_seconds": round(cpu, 1),
                "epochs": metrics["epochs"],
                "options": result["config"].get("attention_options") or {},
                "output": "multimax" if name == "multimax" else "plain",
                "trained": "here",
                **attention_metrics(model, x_test),
            }
        data["results"][name] = entry
        _write(results, data)
        print(f"{name}: accuracy {entry['heldout_accuracy']:.2%}, {time.perf_counter() - start:.0f} s", flush=True)
    return data


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table (functions in the order of ALL; missing ones say 'not run yet')."""
    rows = [
        "| function | options | held-out accuracy | training s (wall) | step vs SoftMax | multi-modality M "
        "| sparsity S | zero weights | entropy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    results = data.get("results", {})
    # Training-step cost ratios measured side by side (benchmarks.reweighting_train_cost --into): the wall
    # times were taken one function after another under the shared machine's load of the moment.
    steps = data.get("train_step", {}).get("ratio_to_softmax", {})
    for name in ALL:
        r = results.get(name)
        if r is None:
            rows.append(f"| {name} | | not run yet | | | | | | |")
            continue
        opts = ", ".join(f"{k}={v:g}" for k, v in r.get("options", {}).items())
        secs = f"{r['seconds']:.0f}" if r.get("seconds") is not None else "?"
        step = f"{steps[name]:.2f}" if name in steps else "?"
        rows.append(
            f"| {name} | {opts} | {r['heldout_accuracy']:.2%} | {secs} | {step} | {r['multimodality']:.3f} | "
            f"{r['sparsity']:.3f} | {r['zero_share']:.1%} | {r['entropy']:.2f} |"
        )
    return "\n".join(rows)
