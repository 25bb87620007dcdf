"""Validation of an exported vision model against PyTorch in onnxruntime (CPU)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from export import limits
from export.fused_check import compare_fused, cpu_session
from export.limits import FUSED_FP32_TOL, TOLS, Measure
from export.onnx_io import check_model_file, load_graph
from export.progress import Phases
from models import onnx_contract as contract
from models import registry
from models.generate import generate
from models.onnx_contract import TEXT_INPUTS, VISION_INPUT, VISION_OUTPUT, text_feeds, text_io_names
from models.output_function import probabilities as output_probabilities
from models.registry import TextModel
from models.spec import TextSpec, VisionSpec
from plugins.onnx_functions import attribute_problems

# a graph's (inputs, outputs) name -> dims -> what differs from its task's contract
GraphProblems = Callable[[dict[str, list], dict[str, list]], list[str]]


@dataclass(frozen=True)
class Tolerance:
    """What a variant must meet against the fp32 PyTorch model. The limits are export.limits' rule: `tol` x
    max(1, max|reference|) of each compared kind (logits, presents; the sparse probabilities take the logits'
    limit); None: reported, not enforced."""

    tol: float | None
    top1_min: float | None
    greedy_exact: bool
    # the model's outputs with the fused ops vs the function bodies (export.fused_check), the same rule
    fused_tol: float | None = None


# int8: dynamic quantization changes logits by design; its accuracy change is measured on real data
# (docs/BENCHMARKS.md), random inputs only report the deltas (with their scale). int4 likewise.
TOLERANCES = {
    "fp32": Tolerance(TOLS["fp32"], 1.0, True, FUSED_FP32_TOL),
    # fp16: a float32 rounding difference in a fused node flips fp16 roundings after it (one step is 4.9e-4
    # near 1), so the outputs with and without the library are held to the variant's own tol; each fused
    # node is still held to float32 rounding on its own inputs (export.fused_check).
    "fp16": Tolerance(TOLS["fp16"], 0.99, False, TOLS["fp16"]),
    "int8": Tolerance(TOLS["int8"], None, False),
    "int4": Tolerance(TOLS["int4"], None, False),  # 4-bit weights: deltas and greedy agreement reported, not enforced
}
LEVELS = {"ORT_ENABLE_ALL": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
          "ORT_ENABLE_BASIC": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}
# The fused-ops check compares this level's session (the fused ops registered, as `cpu_session` does by default)
# with the function bodies, over the first inputs of the validation (vision: 4 batches, text: 8 calls).
FUSED_LEVEL = "ORT_ENABLE_ALL"
FUSED_CHECK_FEEDS = 4
FUSED_CHECK_TEXT_FEEDS = 8


def check_graph(path: Path, problems: GraphProblems | None = None) -> dict[str, Any]:
    """Full checker, names and the dynamic axes as specified (`problems`: the task's, its ExportTask's
    `graph_problems`; None: the vision task's)."""
    model = load_graph(path)  # without its weights: any size (export.onnx_io)
    check_model_file(path)
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    outputs = {o.name: [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    nodes = [f"{n.domain}::{n.op_type}" for n in model.graph.node if n.domain == contract.ONNX_DOMAIN]
    found = (problems or vision_graph_problems)(inputs, outputs) + attribute_problems(model)
    return {
        "checker": "passed (full_check)",
        "opset": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "inputs": inputs,
        "outputs": outputs,
        "multimax_nodes": len(nodes),
        "custom_nodes": sorted(set(nodes)),
        "functions": [f"{f.domain}::{f.name}" for f in model.functions],
        "problems": found,
    }


def vision_graph_problems(inputs: dict[str, list], outputs: dict[str, list]) -> list[str]:
    problems = []
    if list(inputs) != [VISION_INPUT] or inputs[VISION_INPUT][0] != contract.BATCH:
        problems.append(f"inputs {inputs}: expected {VISION_INPUT} with a leading '{contract.BATCH}' axis")
    if list(outputs) != [VISION_OUTPUT] or outputs[VISION_OUTPUT][0] != contract.BATCH:
        problems.append(f"outputs {outputs}: expected {VISION_OUTPUT} with a leading '{contract.BATCH}' axis")
    return problems


def text_graph_problems(inputs: dict[str, list], outputs: dict[str, list]) -> list[str]:
    n_layer = sum(name.endswith(".key") for name in inputs)
    want_in, want_out = text_io_names(n_layer)
    problems = []
    if list(inputs) != want_in or list(outputs) != want_out:
        problems.append(f"names {list(inputs)} -> {list(outputs)}: expected {want_in} -> {want_out}")
        return problems
    axes = {name: dims[0] for name, dims in {**inputs, **outputs}.items()}
    axes |= {name: dims[1] for name, dims in inputs.items() if name in TEXT_INPUTS}
    axes |= {name: dims[2] for name, dims in inputs.items() if name.startswith(contract.PAST_PREFIX)}
    for name, dim in axes.items():
        if not isinstance(dim, str):
            problems.append(f"{name}: axis fixed at {dim}, expected a named dynamic axis")
    return problems


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
    spec: VisionSpec,
    samples: int = 100,
    batch_sizes: tuple[int, ...] = (1, 2, 8),
    seed: int = 0,
    progress: bool = True,
    tolerance: Tolerance = TOLERANCES["fp32"],
    phases: Phases | None = None,
) -> dict[str, Any]:
    """`samples` random images spread over `batch_sizes`, compared at two ORT optimisation levels.

    The PyTorch reference is computed once and reused for both levels; each phase shows its progress.
    """
    phases = phases or Phases(progress)
    shape = (spec.channels, spec.image_size, spec.image_size)
    generator = torch.Generator().manual_seed(seed)
    batches = []
    remaining, i = samples, 0
    while remaining > 0:
        b = min(batch_sizes[i % len(batch_sizes)], remaining)
        batches.append(torch.randn((b, *shape), generator=generator))
        remaining -= b
        i += 1
    refs = []
    with phases.phase("reference (PyTorch)", total=samples, unit="image") as bar, torch.no_grad():
        for x in batches:
            refs.append(model(x).numpy())
            bar.update(len(x))
    report: dict[str, Any] = {"samples": samples, "batch_sizes": list(batch_sizes), "tolerance": asdict(tolerance)}
    failures: list[str] = []
    feeds = [{VISION_INPUT: x.numpy()} for x in batches]
    fused_feeds = feeds[:FUSED_CHECK_FEEDS]
    fused_outputs: list[list[np.ndarray]] = []  # ORT_ENABLE_ALL's, with the fused ops: reused by their check
    for name, level in LEVELS.items():
        with phases.phase(f"onnxruntime {name}", total=samples, unit="image") as bar:
            session = cpu_session(path, level)
            diffs, rels, agree, nans = [], [], 0, 0
            pairs: list[tuple[np.ndarray, np.ndarray]] = []
            logits = Measure()
            for feed, ref in zip(feeds, refs, strict=True):
                out = session.run([VISION_OUTPUT], feed)[0]
                pairs.append((out, ref))
                if name == FUSED_LEVEL and len(fused_outputs) < len(fused_feeds):
                    fused_outputs.append([out])
                nans += int(np.isnan(out).sum())
                diff = logits.add(out, ref)
                diffs.append(diff.ravel())
                rels.append((diff / np.maximum(np.abs(ref), 1e-6)).ravel())
                agree += int((out.argmax(-1) == ref.argmax(-1)).sum())
                bar.update(len(ref))
        report[name] = _stats(diffs, rels) | {"top1_agreement": agree / samples, "nan_count": nans,
                                              "limits": {"logits": logits.report(tolerance.tol)}}
        failures += _failures(name, report[name], tolerance)
        if spec.reweighting.output_distribution:
            report[name]["probabilities"], bad = probability_stats(spec.reweighting.output_distribution, pairs,
                                                                   tolerance, name, logits.scale)
            failures += bad
    with phases.phase("fused ops vs function bodies"):
        report["fused_ops"] = compare_fused(path, fused_feeds, fused_outputs, tolerance.fused_tol, tolerance.tol)
    failures += report["fused_ops"]["failures"]
    report["failures"] = failures
    report["passed"] = not failures
    return report


def probability_stats(
    output_function: str, pairs: list[tuple[np.ndarray, np.ndarray]], tolerance: Tolerance, level: str,
    logits_scale: float,
) -> tuple[dict[str, Any], list[str]]:
    """The served distribution (models.output_function) of onnxruntime's logits against PyTorch's: the largest
    probability difference and the share of rows whose support (the entries above 0) is the same.

    Enforced for the continuous functions (SparseMax, EntMax-1.5) at the logits' limit (`tolerance.tol` x
    `logits_scale`): a projection onto the simplex carries the logits' error over, it does not scale it by the
    probabilities' size. Ev-SoftMax's cut at the row mean can drop a class whose logit sits at the mean in one
    runtime, so it is reported only."""
    diff, same, rows = 0.0, 0, 0
    for out, ref in pairs:
        p = output_probabilities(output_function, torch.from_numpy(out).double().reshape(-1, out.shape[-1]))
        q = output_probabilities(output_function, torch.from_numpy(ref).double().reshape(-1, ref.shape[-1]))
        diff = max(diff, float((p - q).abs().max()))
        same += int(((p > 0) == (q > 0)).all(-1).sum())
        rows += p.shape[0]
    enforced = output_function in ("sparsemax", "entmax15")
    stats = {"function": output_function, "support_agreement": same / max(rows, 1),
             **limits.judged(diff, tolerance.tol if enforced else None, logits_scale)}
    return stats, limits.failure(level, f"{output_function} probabilities", stats)


def _failures(level: str, stats: dict[str, Any], tolerance: Tolerance, top1_key: str = "top1_agreement") -> list[str]:
    """The level's misses: each compared kind beyond its limit (export.limits), top-1 agreement, NaN."""
    out = [line for kind, entry in stats["limits"].items() for line in limits.failure(level, kind, entry)]
    if tolerance.top1_min is not None and stats[top1_key] < tolerance.top1_min:
        out.append(f"{level}: top-1 agreement {stats[top1_key]:.2%} < {tolerance.top1_min:.0%}")
    if stats["nan_count"]:
        out.append(f"{level}: {stats['nan_count']} NaN")
    return out


def _feed(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, past: list) -> dict[str, np.ndarray]:
    return text_feeds(ids.numpy(), mask.numpy(), positions.numpy(), [(k.numpy(), v.numpy()) for k, v in past])


def _text_case(model: TextModel, spec: TextSpec, rng: np.random.Generator, past_len: int
               ) -> tuple[dict, list[np.ndarray]]:
    """A random decoder call: batch 1-8, `past_len` cached tokens (computed by the model), 1-8 new ones.

    Rows after the first get random left padding, so masked columns and shifted positions are covered.
    """
    batch, new = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    total = past_len + new
    mask = torch.ones(batch, total, dtype=torch.long)
    for row in range(1, batch):
        mask[row, : int(rng.integers(0, total))] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids = torch.from_numpy(rng.integers(0, spec.vocab_size, (batch, total)))
    with torch.no_grad():
        past = model.empty_past(batch)
        if past_len:
            _, past = model(ids[:, :past_len], positions[:, :past_len], mask[:, :past_len], past)
        logits, presents = model(ids[:, past_len:], positions[:, past_len:], mask, past)
    refs = [logits.numpy()] + [t.numpy() for kv in presents for t in kv]
    return _feed(ids[:, past_len:], mask, positions[:, past_len:].contiguous(), past), refs


def ort_greedy(session: ort.InferenceSession, prompt: list[int], steps: int, n_layer: int) -> list[int]:
    """Greedy decoding with the exported graph alone: prefill from an empty past, then one token per step."""
    inputs = {i.name: i for i in session.get_inputs()}
    first_past = inputs[contract.past_names(1)[0][0]]
    n_head, head_dim = first_past.shape[1], first_past.shape[3]
    empty = np.zeros((1, n_head, 0, head_dim), dtype=np.float32)
    past = [(empty, empty)] * n_layer
    ids = np.array([prompt], dtype=np.int64)
    length, out = 0, []
    for _ in range(steps):
        feed = text_feeds(ids, np.ones((1, length + ids.shape[1]), dtype=np.int64),
                          np.arange(length, length + ids.shape[1], dtype=np.int64)[None], past)
        logits, *presents = session.run(None, feed)
        length += ids.shape[1]
        past = list(zip(presents[0::2], presents[1::2], strict=True))
        out.append(int(logits[0, -1].argmax()))
        ids = np.array([[out[-1]]], dtype=np.int64)
    return out


def validate_text(
    model: TextModel,
    path: Path,
    samples: int = 100,
    max_past: int = 16,
    prompts: int = 16,
    gen_tokens: int = 32,
    seed: int = 0,
    progress: bool = True,
    tolerance: Tolerance = TOLERANCES["fp32"],
    phases: Phases | None = None,
    spec: TextSpec | None = None,
) -> dict[str, Any]:
    """Random decoder calls (every 4th with an empty past) at two ORT levels, then greedy generation. `spec`: the
    model's description (export.pipeline computes it once per export), else described here."""
    phases = phases or Phases(progress)
    spec = spec or registry.describe_text_model(model)
    output_function = spec.reweighting.output_distribution
    rng = np.random.default_rng(seed)
    cases = []
    with phases.phase("reference (PyTorch)", total=samples, unit="case") as bar:
        for i in range(samples):
            cases.append(_text_case(model, spec, rng, 0 if i % 4 == 0 else int(rng.integers(1, max_past + 1))))
            bar.update()
    n_layer = spec.layers
    _, output_names = text_io_names(n_layer)
    report: dict[str, Any] = {
        "samples": samples, "batch_sizes": [1, 8], "past_lengths": [0, max_past], "new_tokens": [1, 8],
        "tolerance": asdict(tolerance),
    }
    failures: list[str] = []
    fused_outputs: list[list[np.ndarray]] = []  # ORT_ENABLE_ALL's, with the fused ops: reused by their check
    for name, level in LEVELS.items():
        with phases.phase(f"onnxruntime {name}", total=samples, unit="case") as bar:
            session = cpu_session(path, level)
            logit_diffs: list[np.ndarray] = []
            logit_rels: list[np.ndarray] = []
            logits, presents = Measure(), Measure()
            nans, agree, rows = 0, 0, 0
            pairs = []
            for feed, refs in cases:
                outs = session.run(output_names, feed)
                pairs.append((outs[0], refs[0]))
                if name == FUSED_LEVEL and len(fused_outputs) < FUSED_CHECK_TEXT_FEEDS:
                    fused_outputs.append(outs)
                nans += sum(int(np.isnan(o).sum()) for o in outs)
                diff = logits.add(outs[0], refs[0])
                logit_diffs.append(diff.ravel())
                logit_rels.append((diff / np.maximum(np.abs(refs[0]), 1e-6)).ravel())
                for o, r in zip(outs[1:], refs[1:], strict=True):
                    presents.add(o, r)
                agree += int((outs[0][:, -1].argmax(-1) == refs[0][:, -1].argmax(-1)).sum())
                rows += refs[0].shape[0]
                bar.update()
        del session  # one session's copy of the weights at a time (a large model's memory)
        report[name] = _stats(logit_diffs, logit_rels) | {
            "present_max_abs": presents.max_abs, "next_token_agreement": agree / rows, "nan_count": nans,
            "limits": {"logits": logits.report(tolerance.tol), "present": presents.report(tolerance.tol)},
        }
        failures += _failures(name, report[name], tolerance, "next_token_agreement")
        if output_function:
            report[name]["probabilities"], bad = probability_stats(output_function, pairs, tolerance, name,
                                                                   logits.scale)
            failures += bad
    identical = 0
    vocab = spec.vocab_size
    # printable ASCII for the byte vocabulary; past fairseq's four specials for a word vocabulary
    low, high = (32, 127) if vocab >= 127 else (min(4, vocab - 1), vocab)
    with phases.phase("greedy generation", total=prompts, unit="prompt") as bar:
        session = cpu_session(path, LEVELS["ORT_ENABLE_ALL"])
        for _ in range(prompts):
            prompt = [int(v) for v in rng.integers(low, high, int(rng.integers(1, 17)))]
            ref = generate(model, prompt, gen_tokens, temperature=0, spec=spec)[0]
            steps = min(gen_tokens, spec.context_length - len(prompt))  # as `generate`: within the context
            identical += ort_greedy(session, prompt, steps, n_layer) == ref
            bar.update()
    del session  # freed before the fused check builds its own
    report["greedy"] = {"prompts": prompts, "tokens": gen_tokens, "identical": identical}
    with phases.phase("fused ops vs function bodies"):
        feeds = [feed for feed, _ in cases[:FUSED_CHECK_TEXT_FEEDS]]
        report["fused_ops"] = compare_fused(path, feeds, fused_outputs, tolerance.fused_tol, tolerance.tol)
    failures += report["fused_ops"]["failures"]
    if tolerance.greedy_exact and identical < prompts:
        failures.append(f"greedy generation: {prompts - identical} of {prompts} prompts differ from PyTorch")
    report["failures"] = failures
    report["passed"] = not failures
    return report
