"""Validation of an exported vision model against PyTorch in onnxruntime (CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn
from tqdm import tqdm

from export.onnx_export import VISION_INPUT, VISION_OUTPUT

LOGITS_ATOL = 1e-4
LEVELS = {"ORT_ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
          "ORT_ENABLE_BASIC": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}


def check_graph(path: Path) -> dict[str, Any]:
    """Full checker, names and the dynamic batch axis as specified."""
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    nodes = [f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain]
    problems = []
    if list(inputs) != [VISION_INPUT] or inputs[VISION_INPUT][0] != "batch":
        problems.append(f"inputs {inputs}: expected {VISION_INPUT} with a leading 'batch' axis")
    if list(outputs) != [VISION_OUTPUT] or outputs[VISION_OUTPUT][0] != "batch":
        problems.append(f"outputs {outputs}: expected {VISION_OUTPUT} with a leading 'batch' axis")
    return {
        "checker": "passed (full_check)",
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": inputs,
        "outputs": outputs,
        "multimax_nodes": len(nodes),
        "custom_nodes": sorted(set(nodes)),
        "functions": [f"{f.domain}::{f.name}" for f in model.functions],
        "problems": problems,
    }


def _stats(diffs: list[np.ndarray], rels: list[np.ndarray]) -> dict[str, float]:
    d, r = np.concatenate(diffs), np.concatenate(rels)
    return {
        "max_abs": float(d.max()),
        "mean_abs": float(d.mean()),
        "p99_abs": float(np.percentile(d, 99)),
        "max_rel": float(r.max()),
        "mean_rel": float(r.mean()),
        "p99_rel": float(np.percentile(r, 99)),
    }


def validate_vision(
    model: nn.Module,
    path: Path,
    config: dict[str, Any],
    samples: int = 100,
    batch_sizes: tuple[int, ...] = (1, 2, 8),
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """`samples` random images spread over `batch_sizes`, compared at two ORT optimisation levels."""
    shape = (config["in_chans"], config["img_size"], config["img_size"])
    generator = torch.Generator().manual_seed(seed)
    batches = []
    remaining, i = samples, 0
    while remaining > 0:
        b = min(batch_sizes[i % len(batch_sizes)], remaining)
        batches.append(torch.randn((b, *shape), generator=generator))
        remaining -= b
        i += 1
    with torch.no_grad():
        refs = [model(x).numpy() for x in batches]
    report: dict[str, Any] = {"samples": samples, "batch_sizes": list(batch_sizes), "tolerance_abs": LOGITS_ATOL}
    bar = tqdm(total=len(LEVELS) * len(batches), desc="validate", disable=not progress, unit="batch")
    for name, level in LEVELS.items():
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        diffs, rels, agree, nans = [], [], 0, 0
        for x, ref in zip(batches, refs, strict=True):
            out = session.run([VISION_OUTPUT], {VISION_INPUT: x.numpy()})[0]
            nans += int(np.isnan(out).sum())
            diff = np.abs(out - ref)
            diffs.append(diff.ravel())
            rels.append((diff / np.maximum(np.abs(ref), 1e-6)).ravel())
            agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
            bar.update()
        stats = _stats(diffs, rels)
        report[name] = stats | {"top1_agreement": agree / samples, "nan_count": nans}
    bar.close()
    failures = [
        f"{name}: max abs diff {report[name]['max_abs']:.3g} > {LOGITS_ATOL}"
        for name in LEVELS
        if not report[name]["max_abs"] <= LOGITS_ATOL
    ] + [f"{name}: top-1 agreement {report[name]['top1_agreement']:.2%}" for name in LEVELS
         if report[name]["top1_agreement"] < 1.0] + [f"{name}: {report[name]['nan_count']} NaN" for name in LEVELS
                                                     if report[name]["nan_count"]]
    report["failures"] = failures
    report["passed"] = not failures
    return report
