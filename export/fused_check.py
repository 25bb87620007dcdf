"""The export's check of the fused MultiMax ops: the same inputs through onnxruntime with the custom-op
library (plugins.ort_ops) and with the function bodies, outputs compared.

Both are what users get (the library where it builds, the bodies elsewhere), so both must agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from plugins import ort_ops

FUSED_ATOL = 1e-5  # fused kernels vs the inlined bodies: float32 rounding only


def cpu_session(
    path: Path,
    level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    spinning: bool = True,
    fused: bool = True,
) -> ort.InferenceSession:
    """An onnxruntime CPU session; `spinning=False` stops idle threads busy-waiting after each run.

    `fused`: register the fused MultiMax ops (plugins.ort_ops) when available; False runs the function bodies.
    """
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    if fused:
        ort_ops.register(options)
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def compare_fused(path: Path, feeds: list[dict[str, np.ndarray]], atol: float = FUSED_ATOL) -> dict[str, Any]:
    """Max abs difference over every output and feed, with vs without the library; `failures` if > atol."""
    lib = ort_ops.library()
    if not ort_ops.uses_multimax(path):
        return {"in_use": False, "reason": "the model has no multimax nodes", "failures": []}
    if not lib.available:
        return {"in_use": False, "reason": lib.reason, "failures": []}
    fused, bodies = cpu_session(path, fused=True), cpu_session(path, fused=False)
    worst = 0.0
    for feed in feeds:
        for a, b in zip(fused.run(None, feed), bodies.run(None, feed), strict=True):
            worst = max(worst, float(np.abs(a.astype(np.float64) - b).max(initial=0.0)))
    failures = [] if worst <= atol else [f"fused MultiMax ops: max abs diff {worst:.3g} > {atol} vs function bodies"]
    return {
        "in_use": True, "library": str(lib.path), "kernel_path": ort_ops.kernel_path(), "feeds": len(feeds),
        "max_abs_vs_function_bodies": worst, "atol": atol, "failures": failures,
    }  # fmt: skip


def fused_summary(report: dict[str, Any]) -> str:
    """One line for the export's summary."""
    if not report["in_use"]:
        return f"fused MultiMax ops (onnxruntime): not used, {report['reason']}"
    return (
        f"fused MultiMax ops (onnxruntime, {report['kernel_path']}): max|diff| vs function bodies "
        f"{report['max_abs_vs_function_bodies']:.2e} (limit {report['atol']:g})"
    )
