"""What an export's report says to a person: the verdict line and the console summary."""

from __future__ import annotations

from pathlib import Path

from export.fused_check import fused_summary
from export.limits import describe
from export.progress import Phases
from export.tasks import ExportTask, export_task


def multimax_line(report: dict) -> str:
    """What the graph holds, said plainly (a model without MultiMax says so)."""
    line = _graph_line(report)
    output = report.get("output_function")
    return f"{line}; output {output} (the graph outputs the logits it is taken of)" if output else line


def _graph_line(report: dict) -> str:
    g, places = report["graph"], report["multimax_places"]
    function = report.get("attention_function")
    if function in (None, "multimax", "softmax"):
        function = None  # MultiMax's own places say it
    if not places and function is None:
        return "no MultiMax in this model (softmax only)"
    where = " + ".join([*([f"attention: {function}"] if function else []), *places])
    if report["inlined"]:
        return f"{'MultiMax' if not function else 'custom ops'} ({where}) inlined as elementwise ops (--inline)"
    kind = "MultiMax" if not function else "custom"
    return f"{g['multimax_nodes']} {kind} nodes ({where}): {', '.join(g['custom_nodes'])}"


FUSED_SKIPPED = "fused ops library unavailable"
LEVELS = ("ORT_ENABLE_ALL", "ORT_ENABLE_BASIC")


def skipped_checks(report: dict) -> list[dict[str, str]]:
    """The validation's checks that did not run, each {"check", "skipped" (the verdict's words), "reason"}: the
    fused ops of a graph that has them, not compared with their bodies (export.fused_check without its library),
    and a part of the report that says `skipped` (export.genai_validate without onnxruntime-genai, or with a
    tokenizer it cannot read). A graph without fused nodes (no MultiMax, --inline) has no fused check to skip."""
    v = report.get("validation")
    if not v:
        return []
    out = []
    fused = v.get("fused_ops")
    if fused is not None and not fused["in_use"] and report["graph"]["multimax_nodes"]:
        out.append({"check": "fused ops", "skipped": FUSED_SKIPPED, "reason": fused["reason"]})
    genai = v.get("genai") or {}
    for check, part in (("onnxruntime-genai", genai), ("onnxruntime-genai tokenizer", genai.get("tokenizer"))):
        if isinstance(part, dict) and part.get("skipped"):
            out.append({"check": check, "skipped": part["skipped"], "reason": part.get("reason", "")})
    return out


def _skips(skipped: list[dict[str, str]]) -> str:
    """What the verdict says of them, e.g. `1 check skipped: onnxruntime-genai not installed`."""
    count = f"{len(skipped)} check{'s' if len(skipped) != 1 else ''} skipped"
    return f"{count}: {'; '.join(s['skipped'] for s in skipped)}"


def verdict(report: dict, task: ExportTask | None = None) -> str:
    """One honest line: "passed" only when the enforced limits were checked and held, "passed (1 check skipped:
    onnxruntime-genai not installed)" when one could not run (`report["skipped"]`; still exit code 0).
    `task`: the export side of the model's task (export.pipeline has it), else looked up from the report's arch."""
    if report["problems"]:
        return "FAILED: " + "; ".join(report["problems"])
    v = report.get("validation")
    if not v:
        return "not validated (--no-validate): graph checked only"
    skipped = report.get("skipped", [])
    tol = v["tolerance"]
    if tol["tol"] is None and tol["top1_min"] is None:
        key = (task or export_task(report["arch"])).agreement_key
        worst = min(v[level][key] for level in LEVELS)
        logits = max((v[level]["limits"]["logits"] for level in LEVELS), key=lambda e: e["max_abs"])
        return (f"{report['precision']}: deltas reported, not enforced: top-1 {worst:.0%}, max|diff| "
                f"{logits['max_abs']:.2g} = {logits['relative']:.2g} x scale {logits['scale']:.3g} (no NaN: checked)"
                + (f"; {_skips(skipped)}" if skipped else ""))
    return f"passed ({_skips(skipped)})" if skipped else "passed"


def summary(report: dict, report_path: Path, phases: Phases, task: ExportTask | None = None) -> str:
    """The console summary; `task` as `verdict`'s."""
    task = task or export_task(report["arch"])
    g = report["graph"]
    wrote = f"the onnxruntime-genai folder {report['genai_folder']}" if "genai_folder" in report else report["onnx"]
    lines = [
        f"wrote {wrote} in {report['export_seconds']:.1f} s (opset {g['opset'].get('ai.onnx')}, "
        f"{multimax_line(report)})",
    ]
    v = report.get("validation")
    if v:
        top1 = task.agreement_key
        for level in LEVELS:
            s = v[level]
            present = s["limits"].get("present")
            kv = f"  present {describe(present)}" if present else ""
            lines.append(
                f"  {level:<17} max|diff| {describe(s['limits']['logits'])}  mean {s['mean_abs']:.2e}  "
                f"p99 {s['p99_abs']:.2e}{kv}  top-1 agreement {s[top1]:.0%}  NaN {s['nan_count']}"
            )
        probs = v["ORT_ENABLE_ALL"].get("probabilities")
        if probs:  # a sparse output function: the distribution the server returns, compared too
            lines.append(
                f"  {probs['function']} probabilities: max|diff| {describe(probs)}, "
                f"same support in {probs['support_agreement']:.0%} of rows"
            )
        if "greedy" in v:
            gen = v["greedy"]
            lines.append(
                f"  greedy generation: {gen['identical']}/{gen['prompts']} identical over {gen['tokens']} tokens"
            )
        if "genai" in v:
            lines.append("  " + genai_line(v["genai"]))
        if "fused_ops" in v:
            lines.append("  " + fused_summary(v["fused_ops"]))
        lines.append(f"  {v['samples']} random inputs, {task.shapes(v)}; limits: {limits(v['tolerance'], task)}")
    engine = report.get("engine")
    if engine and "path" in engine:
        lines.append(f"  TensorRT engine with the MultiMax plugin: {engine['path']} ({engine['seconds']:.1f} s)")
    lines.append(f"  times: {phases.summary()} (PyTorch threads {report['torch_threads']})")
    lines.append(report["verdict"])
    lines.append(f"report: {report_path}")
    return "\n".join(lines)


def limits(tolerance: dict, task: ExportTask) -> str:
    parts = []
    if tolerance["tol"] is not None:  # export.limits' rule, per compared kind (logits, present)
        parts.append(f"max|diff| <= {tolerance['tol']:g} x max(1, max|reference|)")
    if tolerance["top1_min"] is not None:
        parts.append(f"top-1 >= {tolerance['top1_min']:.0%}")
    if tolerance["greedy_exact"] and task.greedy_checked:
        parts.append("identical greedy text")
    return ", ".join([*parts, "no NaN"])


def _agreement(run: dict) -> str:
    """A reduced-precision run's share of greedy tokens equal to PyTorch's (shown only below 100%)."""
    share = run.get("token_agreement", 1.0)
    return f" ({share:.1%} of tokens)" if share < 1 else ""


def genai_line(genai: dict) -> str:
    """The folder export's onnxruntime-genai check, one line."""
    if not genai["checked"]:
        return f"onnxruntime-genai: not checked, {genai['reason']}"
    runs = [f"{name.replace('_', ' ')} {genai[name]['identical']}/{genai['prompts']}" + _agreement(genai[name])
            for name in ("library", "function_bodies") if name in genai]
    tok = genai["tokenizer"]
    words = (f"tokenizer {tok['identical']}/{tok['texts']} texts identical" if tok.get("checked", True)
             else f"tokenizer not checked: {tok['reason']}")
    if "raw_texts_identical" in tok:  # a fairseq word-level folder: exact on fairseq-normalised text
        words += f" (fairseq-normalised; as written {tok['raw_texts_identical']}/{tok['texts']})"
    return f"onnxruntime-genai: greedy == PyTorch ({', '.join(runs)}, {genai['tokens']} tokens); {words}"
