"""The export's check of the fused ops (MultiMax and the other reweighting functions): the same inputs
through onnxruntime with the custom-op library (plugins.ort_ops) and with the function bodies, outputs compared.

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


def compare_fused(
    path: Path,
    feeds: list[dict[str, np.ndarray]],
    fused_outputs: list[list[np.ndarray]] | None = None,
    atol: float | None = FUSED_ATOL,
) -> dict[str, Any]:
    """Max abs difference over every output and feed, with vs without the library; `failures` if > atol.

    `atol=None`: reported, not enforced (int8 graphs: a float32 rounding difference in front of a dynamic
    quantization can move a value by a whole quantization step, 2.2e-3 on the digits model).

    `fused_outputs`: every output of each feed, as a session with the library (ORT_ENABLE_ALL) already returned
    them (the validation's own run), so only the function-body session is built here.
    """
    lib = ort_ops.library()
    if not ort_ops.uses_multimax(path):
        return {"in_use": False, "reason": "the model has no multimax nodes", "failures": []}
    if not lib.available:
        return {"in_use": False, "reason": lib.reason, "failures": []}
    if fused_outputs is None:
        fused = cpu_session(path, fused=True)
        fused_outputs = [fused.run(None, feed) for feed in feeds]
    bodies = cpu_session(path, fused=False)
    worst = 0.0
    for feed, outputs in zip(feeds, fused_outputs, strict=True):
        for a, b in zip(outputs, bodies.run(None, feed), strict=True):
            worst = max(worst, float(np.abs(a.astype(np.float64) - b).max(initial=0.0)))
    failures = [] if atol is None or worst <= atol else [
        f"fused ops: max abs diff {worst:.3g} > {atol} vs function bodies"
    ]
    return {
        "in_use": True, "library": str(lib.path), "kernel_path": ort_ops.kernel_path(), "feeds": len(feeds),
        "max_abs_vs_function_bodies": worst, "atol": atol, "failures": failures,
    }  # fmt: skip


def fused_summary(report: dict[str, Any]) -> str:
    """One line for the export's summary."""
    if not report["in_use"]:
        return f"fused ops (onnxruntime): not used, {report['reason']}"
    return (
        f"fused ops (onnxruntime, {report['kernel_path']}): max|diff| vs function bodies "
        f"{report['max_abs_vs_function_bodies']:.2e} "
        + ("(reported, not enforced)" if report["atol"] is None else f"(limit {report['atol']:g})")
    )
