"""The conformance matrix: every model kind the project claims, through every artifact, with every served feature.

Each cell is declared here as working or refused (with the reason a user is given); tests/conformance runs every
cell against the kind's outside reference, and docs/SUPPORT.md is rendered from this table
(`python -m tests.conformance.matrix --write`; a test fails when the two disagree).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "SUPPORT.md"
BEGIN, END = "<!-- support-table: begin (python -m tests.conformance.matrix --write) -->", "<!-- support-table: end -->"


@dataclass(frozen=True)
class Kind:
    name: str
    task: str  # "text" or "vision"
    builder: str  # tests.conformance.builders: how the model is made
    what: str  # one line for the table
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return bool(self.options.get("chat"))

    @property
    def word_level(self) -> bool:
        return bool(self.options.get("word_level"))


KINDS: tuple[Kind, ...] = (
    Kind("gpt-byte", "text", "demo", "the project's byte-level GPT (MultiMax attention + output)",
         {"file": "text_multimax.pt"}),
    Kind("fairseq-word", "text", "fairseq", "fairseq transformer_lm, word dictionary (padded), post-norm, tied",
         {"fixture": "postnorm_tied", "word_level": True}),
    Kind("fairseq-word-prenorm", "text", "fairseq", "fairseq transformer_lm, word dictionary, pre-norm, untied",
         {"fixture": "prenorm_untied", "word_level": True}),
    Kind("fairseq-gpt2", "text", "fairseq", "fairseq transformer_lm, GPT-2 BPE dictionary",
         {"fixture": "gpt2_bpe"}),
    Kind("llama-seglu", "text", "hf", "Hugging Face Llama, SegLU head, bos token, untied, chat template",
         {"family": "llama", "seglu": True, "bos": True, "tied": False, "chat": True}),
    Kind("qwen2-plain", "text", "hf", "Hugging Face Qwen2, no SegLU, no bos token, tied, the demo LLM's chat "
         "template (ChatML that renders tools, Hermes `<tool_call>`)",
         {"family": "qwen2", "seglu": False, "bos": False, "tied": True, "chat": True, "tool_template": True}),
    Kind("llama-spm", "text", "hf", "Hugging Face Llama with Llama 2's SentencePiece-style tokenizer.json "
         "(Metaspace, byte fallback), SegLU head, chat template",
         {"family": "llama", "seglu": True, "bos": True, "tied": False, "chat": True, "spm": True}),
    Kind("qwen3-seglu", "text", "hf", "Hugging Face Qwen3, SegLU head, bos token, untied, no chat template",
         {"family": "qwen3", "seglu": True, "bos": True, "tied": False, "chat": False}),
    Kind("deit-project", "vision", "deit", "a fresh DeiT in the project's checkpoint format (MultiMax attention + "
         "output)", {"layout": "project"}),
    Kind("deit-official", "vision", "deit", "official-code DeiT training checkpoint (no class token, no qkv bias, "
         "second-order MultiMax in attention and output, `module.` prefix)", {"layout": "official"}),
    Kind("deit-official-v2", "vision", "deit", "official-code DeiT, the V2 variant (`attn.t`, `attn.b`)",
         {"layout": "official", "v2": True}),
    Kind("deit-timm", "vision", "deit", "timm DeiT (class token, qkv bias, softmax)", {"layout": "timm"}),
)

# artifact -> (what, `python -m export` arguments; None: the source served as it is, on the PyTorch backend)
ARTIFACTS: dict[str, tuple[str, list[str] | None]] = {
    "source": ("checkpoint / folder (PyTorch)", None),
    "onnx": ("single .onnx", []),
    "onnx-fp16": ("single .onnx --fp16", ["--fp16"]),
    "onnx-int8": ("single .onnx --int8", ["--int8"]),
    "genai": ("genai folder (-o DIR)", []),
    "genai-int4": ("genai folder --int4", ["--int4"]),
}
FOLDER_ARTIFACTS = ("genai", "genai-int4")
VISION_ARTIFACTS = ("source", "onnx", "onnx-fp16", "onnx-int8")  # genai folders are for text models
EXACT_ARTIFACTS = ("source", "onnx", "genai")  # fp32: greedy text and log-probs equal the reference's

TEXT_FEATURES: dict[str, str] = {
    "complete": "completions, greedy",
    "logprobs": "logprobs / top_logprobs",
    "echo": "echo (+ logprobs)",
    "stream": "stream",
    "n": "n > 1",
    "seed": "seed",
    "stop": "stop",
    "penalties": "presence / frequency penalty",
    "logit_bias": "logit_bias",
    "chat": "chat",
    "json_object": "response_format json_object",
    "json_schema": "response_format json_schema",
    "guided_choice": "guided_choice",
    "guided_regex": "guided_regex",
    "guided_grammar": "guided_grammar",
    "kserve_infer": "KServe infer",
    "kserve_classification": "KServe parameters.classification",
    "tools": "chat with a function tool (tool_choice required, parallel_tool_calls false): one call whose "
             "arguments validate, finish_reason tool_calls",
    "responses": "POST /v1/responses of the chat's conversation (greedy: chat's text)",
    "tokenize": "POST /tokenize of a prompt (the reference's ids), /detokenize back",
}
VISION_FEATURES: dict[str, str] = {
    "classify": "POST /v1/models/{name}/classify (an image)",
    "kserve_infer": "KServe infer (a pixel tensor)",
    "kserve_classification": "KServe parameters.classification (top-k classes)",
}
STRUCTURED = ("json_object", "json_schema", "guided_choice", "guided_regex", "guided_grammar")
CHAT_FEATURES = ("chat", "tools", "responses")  # a conversation rendered with the model's chat template


@dataclass(frozen=True)
class Cell:
    works: bool
    why: str = ""  # a refusal's reason, as the user is told it (a fragment of the message)
    status: int = 200  # what the request answers: 200, or the refusal's 4xx


@dataclass(frozen=True)
class ExportRefusal:
    why: str  # what the export says
    exit_code: int  # 2: refused before anything is written; 1: written, and its validation says FAILED


def export_refusal(kind: Kind, artifact: str) -> ExportRefusal | None:
    """Why `python -m export` does not pass this artifact of this kind, or None: it exports and validates."""
    if kind.options.get("spm") and artifact in FOLDER_ARTIFACTS:
        return ExportRefusal("onnxruntime-genai tokenizer", 1)
    return None


def cell(kind: Kind, artifact: str, feature: str) -> Cell:
    """What the matrix promises for one cell."""
    if (refusal := export_refusal(kind, artifact)) is not None:
        return Cell(False, refusal.why, 0)
    if kind.task == "vision":
        return Cell(True)
    if feature == "kserve_classification":
        return Cell(False, "classification", 400)
    if feature in CHAT_FEATURES and not kind.chat:
        return Cell(False, "chat template", 400)
    if feature in STRUCTURED and kind.word_level:
        return Cell(False, "cannot spell", 400)
    return Cell(True)


def artifacts_of(kind: Kind) -> list[str]:
    return list(ARTIFACTS) if kind.task == "text" else list(VISION_ARTIFACTS)


def features_of(task: str) -> dict[str, str]:
    return TEXT_FEATURES if task == "text" else VISION_FEATURES


def cells(task: str = "text") -> list[tuple[Kind, str, str]]:
    return [(k, a, f) for k in KINDS if k.task == task for a in artifacts_of(k) for f in features_of(task)]


def _table(task: str, refusals: dict[str, int]) -> str:
    """One task's part: its kinds, features, and a row per kind and artifact with a column per feature."""
    kinds = [k for k in KINDS if k.task == task]
    features = features_of(task)
    head = ["model kind", "artifact", *[f"`{f}`" for f in features]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for kind in kinds:
        for artifact in artifacts_of(kind):
            row = [kind.name, ARTIFACTS[artifact][0]]
            for f in features:
                c = cell(kind, artifact, f)
                row.append("yes" if c.works else f"no ({refusals.setdefault(c.why, len(refusals) + 1)})")
            lines.append("| " + " | ".join(row) + " |")
    n = len(cells(task))
    works = sum(cell(k, a, f).works for k, a, f in cells(task))
    listed = "\n".join(f"- `{k.name}`: {k.what}" for k in kinds)
    described = "\n".join(f"- `{f}`: {what}" for f, what in features.items())
    artifacts = len(artifacts_of(kinds[0]))
    return (f"### {task.capitalize()} models\n\n{len(kinds)} kinds x {artifacts} artifacts x {len(features)} "
            f"features = {n} cells: {works} work, {n - works} do not and say why (a 4xx, or an export that does not "
            f"pass).\n\n{listed}\n\n"
            f"{described}\n\n" + "\n".join(lines) + "\n")


def render() -> str:
    """The support tables (markdown), text then vision, and the refusals they number."""
    refusals: dict[str, int] = {}
    parts = [_table(task, refusals) for task in ("text", "vision")]
    notes = "\n".join(f"{i}. {_REASONS.get(why, why)}" for why, i in refusals.items())
    return "\n".join(parts) + f"\nRefusals:\n\n{notes}\n"


_REASONS = {
    "onnxruntime-genai tokenizer": "the genai folder of a SentencePiece-style tokenizer.json (Llama 2's layout): "
                                   "onnxruntime-genai 0.18's tokenizer reads it as a plain BPE (no bos, a leading "
                                   "space when decoding), so `python -m export -o DIR` ends `FAILED: tokenizer: 7 of "
                                   "8 texts encode or decode differently in onnxruntime-genai` (exit 1) and the "
                                   "folder is not served as passed; its `.onnx` exports serve every feature.",
    "classification": "KServe `parameters.classification` is for image models: a text model answers 400 naming it.",
    "chat template": "the model has no chat template (its tokenizer config names none): chat, tools on chat and "
                     "the Responses API are a 400 saying so; completions and /tokenize of a prompt work.",
    "cannot spell": "a word-level dictionary has no token for single characters, so it cannot spell a grammar's text: "
                    "structured output is a 400 (`unsupported_parameter`).",
}


def documented() -> str | None:
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text:
        return None
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance.matrix", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.name}")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        sys.stdout.write(table)
        return 0
    text = DOC.read_text(encoding="utf-8")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{BEGIN}\n{table}{END}{after}", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
