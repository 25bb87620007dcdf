"""`python -m models.training compare`: the digits DeiT demo trained with every attention reweighting function.

Same recipe, seed and budget as the shipped MultiMax and softmax twins (`train_vision`'s defaults: 120
epochs, seed 0); each other function replaces the attention step and keeps plain logits at the output, as the
softmax twin does. The two twins are not retrained: their numbers are the shipped checkpoints' (training time
from models/demo/report.json), measured the same way. Training time is wall time (under whatever load the
machine had) and the process's CPU time; the table's "step vs SoftMax" column comes from
benchmarks.reweighting_train_cost, which times all functions side by side in one run. Each function's result is
written to the results JSON as soon as it is done, so an interrupted run resumes where it stopped (a result with
another recipe is redone).

`extra_seeds` (`--seeds 1,2`) trains every function again with other seeds (the seed sets the initialisation,
the augmentation and the stratified held-out split, as in `train vision --seed`); the table's "over seeds"
column then gives the accuracy's mean and spread over all seeds, which one seed's (one image is 0.28%) cannot. Each
result is merged into the file under a lock on its directory, so runs for different seeds can share one file
side by side (one per core at one thread each).

Attention metrics, on the held-out images, every layer and head: the paper's multi-modality M (definition 3.2)
and sparsity S (3.3, reference s = the row's smallest softmax probability) with the threshold eps = the row mean
of the scores (relevant: above the mean; irrelevant: below), plus the share of exactly-zero weights and the mean
entropy of the rows.
"""

from __future__ import annotations

import fcntl
import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
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
HELDOUT_IMAGES = 360  # every seed's stratified 20% of the 1797 digits


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


def _drawn_per_batch() -> int:
    """The current demo recipe's drawings per batch (train_vision's default; 0: the recipe before drawn digits)."""
    import inspect

    from models.training.vision import train_vision

    return int(inspect.signature(train_vision).parameters["drawn_per_batch"].default)


def _recipe(epochs: int | None, seed: int) -> dict[str, Any]:
    return {"epochs": epochs or 120, "seed": seed, "drawn_per_batch": _drawn_per_batch(),
            "threads": torch.get_num_threads()}


def _same_budget(data: dict[str, Any], recipe: dict[str, Any]) -> bool:
    """Results of another budget or training recipe are never mixed (results without `drawn_per_batch` predate it)."""
    held = data.get("recipe", {})
    return all(held.get(k, 0 if k == "drawn_per_batch" else None) == recipe[k]
               for k in ("epochs", "seed", "drawn_per_batch"))


def _shipped_recipe(name: str) -> dict[str, Any]:
    report = json.loads((DEMO_DIR / "report.json").read_text()).get(SHIPPED[name], {})
    return {"epochs": report.get("epochs"), "seed": report.get("seed"),
            "drawn_per_batch": report.get("drawn_per_batch", 0)}


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the results file's directory: the file itself is replaced by each write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def update_results(path: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Read the results JSON, apply `change` to it, write it back atomically; under the lock, so concurrent
    writers (compare runs for other seeds, benchmarks.reweighting_train_cost --into) lose nothing."""
    with _locked(path):
        data: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
        change(data)
        with staging_dir(path) as staging:
            (staging / path.name).write_text(json.dumps(data, indent=2) + "\n")
            publish(staging / path.name, path)
    return data


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


def _trained(name: str, seed: int, epochs: int | None, progress: bool, checkpoint: Path | None) -> dict[str, Any]:
    """Train `name`'s digits model with `seed`; its entry (metrics on that seed's held-out images)."""
    from models.training.demo import vision_checkpoint
    from models.training.vision import digits_split, train_vision

    kwargs: dict[str, Any] = {"epochs": epochs} if epochs else {}
    function = None if name in SHIPPED else name
    cpu = time.process_time()  # CPU time: far less sensitive than wall time to the shared machine's load
    result = train_vision(
        multimax=("attention", "output") if name == "multimax" else (), seed=seed, progress=progress,
        attention_function=function, attention_options=OPTIONS.get(name), **kwargs
    )
    cpu = time.process_time() - cpu
    ckpt = vision_checkpoint(result)
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        save_checkpoint(ckpt, checkpoint)
    model = build_model(ckpt)
    assert isinstance(model, DeiT)
    metrics = result["metrics"]
    _, _, x_test, _ = digits_split(seed=seed)
    return {
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


def _record(
    data: dict[str, Any], *, recipe: dict[str, Any], extra_seed: int | None, name: str, entry: dict[str, Any]
) -> None:
    """Put one result into the results (an extra seed's under "seeds"), unless another run changed the budget."""
    if not _same_budget(data, recipe):
        raise RuntimeError(f"another run changed the results' recipe to {data.get('recipe')}; this one has {recipe}")
    where = data["results"] if extra_seed is None else data.setdefault("seeds", {}).setdefault(str(extra_seed), {})
    where[name] = entry


def compare(
    names: Iterable[str] = ALL,
    results: Path = RESULTS,
    epochs: int | None = None,
    seed: int = 0,
    checkpoints: Path | None = None,
    progress: bool = True,
    retrain_twins: bool = False,
    extra_seeds: Iterable[int] = (),
) -> dict[str, Any]:
    """Train (or read) each function's digits model; each result is merged into the results JSON when done.

    The shipped twins stand in for the MultiMax and softmax runs of their own recipe (120 epochs, seed 0);
    `retrain_twins`: train them here too (their training time measured under the same load as the others')
    instead of reading the shipped checkpoints; the shipped files are not touched. `extra_seeds`: also train
    every function (the twins included: only seed 0 ships) with these seeds; their results go under "seeds".
    """
    from models.training.vision import digits_split

    names, extra_seeds = list(names), list(extra_seeds)
    unknown = [n for n in names if n not in FUNCTIONS]
    if unknown:
        raise ValueError(f"unknown function(s) {', '.join(unknown)}; known: {', '.join(ALL)}")
    if seed in extra_seeds or len(set(extra_seeds)) < len(extra_seeds):
        raise ValueError(f"--seeds {','.join(map(str, extra_seeds))}: each seed once, and not the main seed {seed}")
    recipe = _recipe(epochs, seed)

    def start(data: dict[str, Any]) -> None:
        if not _same_budget(data, recipe):
            data.clear()  # another budget: nothing to resume
        data["recipe"] = recipe
        data.setdefault("results", {})

    data = update_results(results, start)
    _, _, x_test, y_test = digits_split(seed=0)
    for run_seed in [seed, *extra_seeds]:
        main = run_seed == seed
        for name in names:
            done = _by_seed(data, name).get(run_seed)
            if done is not None and not (retrain_twins and str(done.get("trained", "")).startswith("shipped")):
                print(f"{name} (seed {run_seed}): done before, kept ({results})", flush=True)
                continue
            began = time.perf_counter()
            # the shipped twins stand in only for their own recipe
            shipped = _shipped_recipe(name) if name in SHIPPED else None
            if main and shipped is not None and not retrain_twins and all(recipe[k] == v for k, v in shipped.items()):
                entry = _shipped(name, x_test, y_test)
            else:
                file = f"digits_{name}.pt" if main else f"digits_{name}_seed{run_seed}.pt"
                entry = _trained(name, run_seed, epochs, progress, checkpoints / file if checkpoints else None)
            extra = None if main else run_seed
            data = update_results(results, partial(_record, recipe=recipe, extra_seed=extra, name=name, entry=entry))
            took = time.perf_counter() - began
            print(f"{name} (seed {run_seed}): accuracy {entry['heldout_accuracy']:.2%}, {took:.0f} s", flush=True)
    return data


def _by_seed(data: dict[str, Any], name: str) -> dict[int, dict[str, Any]]:
    main = data.get("recipe", {}).get("seed", 0)
    runs = {int(seed): by_name.get(name) for seed, by_name in data.get("seeds", {}).items()}
    runs[main] = data.get("results", {}).get(name)
    return {seed: runs[seed] for seed in sorted(runs, key=lambda s: (s != main, s)) if runs[seed] is not None}


def seed_runs(data: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """`name`'s result for the main seed and each extra seed that has one (in that order)."""
    return list(_by_seed(data, name).values())


def paired_to_softmax(data: dict[str, Any], name: str) -> list[float]:
    """Per seed that both ran: `name`'s held-out images right minus SoftMax's. The seed fixes the split and the
    augmentation for every function, so these differences are far less noisy than the accuracies."""
    base = _by_seed(data, "softmax")
    return [
        round((r["heldout_accuracy"] - base[seed]["heldout_accuracy"]) * HELDOUT_IMAGES, 3)
        for seed, r in _by_seed(data, name).items()
        if seed in base
    ]


def _paired(diffs: list[float]) -> str:
    if len(diffs) < 2:
        return "?"
    return f"{statistics.mean(diffs):+.1f} ± {statistics.stdev(diffs) / len(diffs) ** 0.5:.1f} ({len(diffs)})"


def _over_seeds(runs: list[dict[str, Any]]) -> str:
    accs = [r["heldout_accuracy"] for r in runs]
    if len(accs) < 2:
        return "1 seed"
    return f"{statistics.mean(accs):.2%} ± {statistics.stdev(accs):.2%} ({len(accs)})"


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table (functions in the order of ALL; missing ones say 'not run yet').

    Accuracy and the attention metrics are the main seed's; "over seeds" is the mean ± sample standard deviation
    of the held-out accuracy over every seed run (their count in brackets); "vs SoftMax" is the mean ± standard
    error of the per-seed difference in images right (paired_to_softmax); training time is the median over the
    seeds (each was taken under the shared machine's load of its moment)."""
    rows = [
        "| function | options | held-out accuracy | over seeds | vs SoftMax, images | training s (wall) "
        "| step vs SoftMax | multi-modality M | sparsity S | zero weights | entropy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    results = data.get("results", {})
    # Training-step cost ratios measured side by side (benchmarks.reweighting_train_cost --into): the wall
    # times were taken one function after another under the shared machine's load of the moment.
    steps = data.get("train_step", {}).get("ratio_to_softmax", {})
    for name in ALL:
        r = results.get(name)
        if r is None:
            rows.append(f"| {name} | | not run yet | | | | | | | | |")
            continue
        runs = seed_runs(data, name)
        opts = ", ".join(f"{k}={v:g}" for k, v in r.get("options", {}).items())
        seconds = [x["seconds"] for x in runs if x.get("seconds") is not None]
        secs = f"{statistics.median(seconds):.0f}" if seconds else "?"
        step = f"{steps[name]:.2f}" if name in steps else "?"
        paired = "(base)" if name == "softmax" else _paired(paired_to_softmax(data, name))
        rows.append(
            f"| {name} | {opts} | {r['heldout_accuracy']:.2%} | {_over_seeds(runs)} | {paired} | {secs} | {step} | "
            f"{r['multimodality']:.3f} | {r['sparsity']:.3f} | {r['zero_share']:.1%} | {r['entropy']:.2f} |"
        )
    return "\n".join(rows)
