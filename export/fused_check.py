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


def discontinuous_ops(path: Path) -> list[str]:
    """The model's reweighting op types whose weights jump at a cut (models.reweighting `continuous=False`).

    The fused op and its body agree on identical inputs (tested per op), but in a whole model the float32
    rounding of the layers before (a different exp, another summation order) can move an entry that sits at
    the cut across it, which changes that entry's weight by a whole amount: measured up to 3.5e-5 on the
    logits of an untrained Ev-SoftMax DeiT-small. Such models are held to the logits' limit instead.
    """
    import onnx

    from models.reweighting import FUNCTIONS

    cut = {op for spec in FUNCTIONS.values() if not spec.continuous for op in spec.op_types}
    proto = onnx.load(str(path), load_external_data=False)
    return sorted({node.op_type for node in proto.graph.node if node.op_type in cut})


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
    loose_atol: float | None = None,
) -> dict[str, Any]:
    """Max abs difference over every output and feed, with vs without the library; `failures` if > atol.

    `loose_atol` (the logits' limit against PyTorch) replaces `atol` for models with discontinuous ops
    (`discontinuous_ops`), which the report lists under "discontinuous_ops".

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
    cut_ops = discontinuous_ops(path)
    if cut_ops and atol is not None:
        atol = max(atol, loose_atol if loose_atol is not None else atol)
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
        "max_abs_vs_function_bodies": worst, "atol": atol, "discontinuous_ops": cut_ops, "failures": failures,
    }  # fmt: skip


def fused_summary(report: dict[str, Any]) -> str:
    """One line for the export's summary."""
    if not report["in_use"]:
        return f"fused ops (onnxruntime): not used, {report['reason']}"
    if report["atol"] is None:
        limit = "(reported, not enforced)"
    elif report.get("discontinuous_ops"):
        limit = f"(limit {report['atol']:g}, the logits' one: {', '.join(report['discontinuous_ops'])} cut rows)"
    else:
        limit = f"(limit {report['atol']:g})"
    return (
        f"fused ops (onnxruntime, {report['kernel_path']}): max|diff| vs function bodies "
        f"{report['max_abs_vs_function_bodies']:.2e} {limit}"
    )
