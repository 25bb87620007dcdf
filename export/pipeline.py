"""The export pipeline as a library function: a checkpoint path and options in, a report out.

`export_checkpoint` loads the checkpoint, exports it, checks the graph, validates it against PyTorch in
onnxruntime (both optimisation levels, the fused MultiMax ops against their function bodies), optionally
builds a TensorRT engine, and writes `<name>.validation.json` beside the ONNX file. `python -m export` is a thin
CLI over it; the demo exporter and the benchmarks call it directly.

Bad input raises `ExportError` or `CheckpointError` (one line each, exit code 2 in the CLI) before anything is
written; a missed tolerance is not an exception but `passed=False` in the report (exit code 1).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from export.genai_folder import MODEL_FILE, REPORT_FILE, check_folder_target, is_folder_output, write_folder
from export.onnx_export import DEFAULT_OPSET, ExportError
from export.precision import Precision
from export.progress import Phases, exporter_stages
from export.summary import skipped_checks, summary, verdict
from export.tasks import EXPORT_TASKS
from export.threads import idle_cores
from export.validate import TOLERANCES, check_graph
from models.checkpoint import HINT_FLAGS, Checkpoint, load
from models.hf_folder import folder_checkpoint, is_model_folder, load_folder
from models.labels import read_labels
from models.onnx_contract import attention_function
from models.onnx_weights import ExternalDataError
from models.registry import TextModel
from models.spec import ModelSpec, TextSpec, VisionSpec
from plugins.trt_plugin import tensorrt_unavailable

MIN_OPSET = 18
FOLDER_ONLY = ("int4",)  # precisions of the onnxruntime-genai folder export only
DEFAULT_BATCH_SIZES = (1, 2, 8)


@dataclass(frozen=True)
class ExportOptions:
    """How to export; the defaults are `python -m export CKPT`'s."""

    # None: <checkpoint stem>[.<precision>].onnx in the current directory; a name without .onnx: the
    # onnxruntime-genai folder export of a text model (export.genai_folder)
    output: Path | None = None
    opset: int = DEFAULT_OPSET
    inline: bool = False  # the flat elementwise graph instead of MultiMax nodes
    fuse: bool = True  # the folder export's graph with its small nodes fused (export.genai_fusions)
    precision: Precision = "fp32"
    validate: bool = True
    samples: int | None = None  # None: 100 (vision: fewer for large models, every batch size at least once)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    # Foreign checkpoints (official / timm DeiT) whose weights do not say everything: as `python -m models info`.
    num_heads: int | None = None
    ln_eps: float | None = None
    qk_scale: float | None = None
    preset: str | None = None
    variant: str | None = None  # MultiMax variant, when the weights cannot tell
    use_ema: bool = False  # a DeiT training checkpoint's `model_ema`
    labels: Path | None = None  # class names to attach to a vision model (models.labels formats)
    dictionary: Path | None = None  # a fairseq LM's dict.txt; None: dict.txt beside the checkpoint
    trt: bool = False
    threads: int | None = None  # PyTorch threads for the reference pass; None: the cores idle at the start
    progress: bool = True
    # Name the checkpoint and ONNX file in the report relative to this directory (the shipped demo reports
    # name files, not this machine's paths); None: as given.
    report_relative_to: Path | None = None
    # Told one line before an earlier file is replaced ("replacing existing x.onnx"); None: silent.
    notify: Callable[[str], None] | None = None

    def load_hints(self) -> dict[str, Any]:
        hints = {"num_heads": self.num_heads, "ln_eps": self.ln_eps, "qk_scale": self.qk_scale,
                 "preset": self.preset, "variant": self.variant, "use_ema": self.use_ema or None,
                 "dictionary": str(self.dictionary) if self.dictionary else None}
        return {k: v for k, v in hints.items() if v is not None}


@dataclass
class ExportReport:
    """What an export produced and found; `data` is the JSON written to `report_path`."""

    onnx: Path
    report_path: Path
    data: dict[str, Any]
    summary: str = field(repr=False)

    @property
    def passed(self) -> bool:
        return bool(self.data["passed"])

    @property
    def verdict(self) -> str:
        return str(self.data["verdict"])

    @property
    def problems(self) -> list[str]:
        return list(self.data["problems"])

    @property
    def skipped(self) -> list[dict[str, str]]:
        """The checks that could not run (export.summary.skipped_checks); the verdict names them."""
        return list(self.data.get("skipped", []))

    @property
    def exit_code(self) -> int:
        """0 passed (also with a check skipped, or reported / not validated), 1 a tolerance was missed."""
        return 0 if self.passed else 1


def check_options(options: ExportOptions) -> None:
    """Every option error, before any work (ExportError: one line for the user)."""
    if options.opset < MIN_OPSET:
        raise ExportError(f"--opset {options.opset} is too old; MultiMax export needs opset >= {MIN_OPSET}")
    if options.samples is not None and options.samples < 1:
        raise ExportError(f"--samples must be >= 1, got {options.samples}")
    if not options.batch_sizes or min(options.batch_sizes) < 1:
        raise ExportError(f"batch sizes must be >= 1, got {list(options.batch_sizes)}")
    if options.threads is not None and options.threads < 1:
        raise ExportError(f"--threads must be >= 1, got {options.threads}")
    if options.precision not in TOLERANCES:
        raise ExportError(f"unknown precision {options.precision!r} (known: {', '.join(TOLERANCES)})")
    if is_folder_output(options.output):
        assert options.output is not None
        asked = [flag for flag, on in (("--int8", options.precision == "int8"), ("--inline", options.inline),
                                       ("--trt", options.trt)) if on]
        if asked:
            raise ExportError(f"{', '.join(asked)}: not available for the onnxruntime-genai folder export (fp32, "
                              "--fp16 or --int4, fused nodes); name a .onnx file with -o for a single-file export")
        check_folder_target(options.output)
    elif options.precision in FOLDER_ONLY:
        raise ExportError(f"--{options.precision}: only for the onnxruntime-genai folder export (-o DIR); a single "
                          "file takes --fp16 or --int8")
    elif not options.fuse:
        raise ExportError("--no-fuse: only for the onnxruntime-genai folder export (-o DIR); a single file is "
                          "never fused")
    if options.trt:
        reason = tensorrt_unavailable()
        if reason:
            raise ExportError(f"--trt: {reason}")


def export_checkpoint(checkpoint: str | os.PathLike[str], options: ExportOptions = ExportOptions()) -> ExportReport:
    """Export `checkpoint` to ONNX, check and validate it, write the JSON report; see the module docstring."""
    check_options(options)
    previous = torch.get_num_threads()
    torch.set_num_threads(options.threads or idle_cores())
    try:
        return _export(Path(checkpoint), options)
    finally:
        torch.set_num_threads(previous)  # a caller in the same process (tests, export.demos) keeps its own


def _export(ckpt_path: Path, options: ExportOptions) -> ExportReport:
    """One export. The model's description (models.spec) is computed once, from the checkpoint, and handed to
    everything that needs it (the exporter, the folder export, validation); the task's export side is looked up
    once from it and handed to the summary."""
    precision = options.precision
    phases = Phases(show=options.progress)
    source_folder = None
    model: torch.nn.Module
    with phases.phase("load checkpoint"):
        if is_model_folder(ckpt_path):  # a Hugging Face ForCausalLM folder (Llama, Qwen2, Qwen3)
            folder_model, ckpt, source_folder = _load_hf_folder(ckpt_path, options)
            model = cast(torch.nn.Module, folder_model)
        else:
            model, ckpt, _ = load(ckpt_path, **options.load_hints())
    spec = ckpt.spec()
    if options.labels is not None:
        spec = attach_labels(ckpt, options.labels, spec)
    suffix = ".onnx" if precision == "fp32" else f".{precision}.onnx"
    stem = ckpt_path.name if source_folder else ckpt_path.stem
    folder = options.output if options.output is not None and is_folder_output(options.output) else None
    out = folder / MODEL_FILE if folder else Path(options.output) if options.output else Path(stem + suffix)
    if not out.parent.is_dir() and not folder:
        raise ExportError(f"cannot write {out}: directory {out.parent} does not exist")
    if out.exists() and options.notify is not None:
        options.notify(f"replacing existing {out}")  # README flows re-export on purpose; a surprise otherwise
    task = EXPORT_TASKS[spec.task]
    if folder and not isinstance(spec, TextSpec):
        raise ExportError(f"-o {folder}: the onnxruntime-genai folder export is for text models, {ckpt.arch} is not "
                          "one; name a .onnx file")
    # the folder export's attention layers (models.attention_hook): read once, for its graph, config and validation
    layers = cast(TextModel, model).attention_layers() if folder else None
    label = f"export {ckpt.arch} ({precision})"
    with phases.phase(label) as bar, exporter_stages(bar, label):
        try:
            if folder:
                assert isinstance(spec, TextSpec)  # other tasks were refused above
                write_folder(cast(TextModel, model), ckpt, folder, opset=options.opset, verbose=True,
                             tokenizer_source=source_folder, precision=precision, spec=spec, layers=layers,
                             fuse=options.fuse)
            else:
                task.export(model, ckpt, out, opset=options.opset, inline=options.inline, precision=precision,
                            verbose=True, spec=spec)
        except OSError as exc:
            raise ExportError(f"cannot write {folder or out}: {exc.strerror or exc}") from None
    report: dict[str, Any] = {
        "checkpoint": _named(ckpt_path, options.report_relative_to),
        "onnx": _named(out, options.report_relative_to),
        **({"genai_folder": _named(folder, options.report_relative_to)} if folder else {}),
        "arch": ckpt.arch,
        "precision": precision,
        "multimax_places": [p for p in ("attention", "output") if ckpt.config.get(f"multimax_{p}")],
        "attention_function": attention_function(ckpt.config),  # models.reweighting's name
        "output_function": ckpt.config.get("output_function"),  # models.output_function's name, or None
        "inlined": options.inline,
        "export_seconds": round(phases.times[label], 2),
        "torch_threads": torch.get_num_threads(),
    }
    with phases.phase("check graph"):
        try:
            report["graph"] = check_graph(out, task.graph_problems)
        except ExternalDataError as exc:  # the weights written are not all there: nothing to validate
            raise ExportError(str(exc)) from None
    if options.validate:
        start = time.perf_counter()
        tolerance = TOLERANCES[precision]
        if folder:
            from export.genai_validate import validate_genai_folder

            assert isinstance(spec, TextSpec)  # other tasks were refused above
            report["validation"] = validate_genai_folder(cast(TextModel, model), folder, options.samples or 100,
                                                         tolerance=tolerance, phases=phases, precision=precision,
                                                         spec=spec, layers=layers)
        else:
            report["validation"] = task.validate(model, out, spec, options.samples, options.batch_sizes, tolerance,
                                                 phases)
        report["validation_seconds"] = round(time.perf_counter() - start, 2)
    problems = report["graph"]["problems"] + report.get("validation", {}).get("failures", [])
    if options.trt and not problems:
        with phases.phase("TensorRT engine"):
            report["engine"] = build_trt_engine(out, fp16=precision == "fp16")
        problems += [report["engine"]["error"]] if "error" in report["engine"] else []
    report["problems"] = problems
    report["passed"] = not problems  # a skipped check (below) is no problem: exit code 0, the verdict names it
    report["skipped"] = skipped_checks(report)
    report["verdict"] = verdict(report, task)
    report["phase_seconds"] = {name: round(t, 2) for name, t in phases.times.items()}
    report_path = folder / REPORT_FILE if folder else out.with_name(out.name.removesuffix(".onnx") + ".validation.json")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return ExportReport(out, report_path, report, summary(report, report_path, phases, task))


def _load_hf_folder(path: Path, options: ExportOptions) -> tuple[TextModel, Checkpoint, Path]:
    """A Hugging Face model folder as a model and the checkpoint record the export's metadata is made from."""
    flags = [HINT_FLAGS.get(k, k) for k in options.load_hints()]
    if flags:
        raise ExportError(f"{path}: {', '.join(flags)} apply to checkpoint files; a Hugging Face folder's config.json "
                          "says everything")
    model, info = load_folder(path)
    if model.dtype != torch.float32:  # bf16/fp16 folders: exported and validated in fp32 (--fp16 for half)
        model = model.float()
    return model, folder_checkpoint(info), info.path


def attach_labels(ckpt: Checkpoint, path: Path, spec: ModelSpec) -> VisionSpec:
    """Replace a vision checkpoint's class names by those in `path` (counted against its classes); returns its
    description (`spec`, the checkpoint's) with them."""
    if not isinstance(spec, VisionSpec):
        raise ExportError(f"--labels is for image classifiers; this checkpoint is a {ckpt.arch} ({spec.task}) model")
    ckpt.labels = read_labels(path, spec.classes)
    return dataclasses.replace(spec, labels=tuple(ckpt.labels))


def _named(path: Path, base: Path | None) -> str:
    return str(path) if base is None else os.path.relpath(path.resolve(), base.resolve())


def build_trt_engine(onnx_path: Path, fp16: bool) -> dict:
    """The engine with the MultiMax plugin; a fallback to the elementwise bodies is a failure (exit 1)."""
    from plugins.build_engine import BuildError, PluginFallbackError, build_engine

    start = time.perf_counter()
    try:
        engine = build_engine(onnx_path, onnx_path.with_suffix(".engine"), fp16=fp16)
    except BuildError as exc:
        raise ExportError(f"--trt: {exc}") from None
    except PluginFallbackError as exc:
        return {"error": str(exc)}
    return {"path": str(engine), "seconds": round(time.perf_counter() - start, 2)}
