"""Validation of an onnxruntime-genai folder export (export.genai_folder) against PyTorch (fp32).

1. Decoder calls in onnxruntime with shared cache buffers (longer than the context, filled with noise past
   the cached tokens): logits and the written cache against PyTorch, the rest of the buffer untouched; both
   optimisation levels with the fused ops, then the fused ops against the function bodies; each held to
   export.limits' rule (tol x max(1, max|reference|) per kind: logits, the written cache).
2. onnxruntime-genai loads the folder as written and generates greedily (up to `tokens` new tokens, ending at
   the folder's end-of-sequence ids as onnxruntime-genai does): the tokens must equal models.generate's; then
   again from a copy without the library (the function bodies). fp16 / int4: the deltas and the greedy
   agreement (tokens equal before the first difference, of all compared) are reported, not enforced.
3. The folder's tokenizer through onnxruntime-genai against the `tokenizers` library reading the same
   tokenizer.json (the one the project's own tokenizer is or was converted to), on ASCII and non-ASCII text.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.fused_check import compare_fused, cpu_session
from export.genai_folder import CONFIG_FILE, LIBRARY_FILE, MODEL_FILE
from export.genai_graph import cache_dtype
from export.hf_tokenizer import FAIRSEQ_WORDS
from export.limits import Measure
from export.precision import Precision
from export.progress import Phases
from export.validate import LEVELS, TOLERANCES, Tolerance, _failures, _stats
from models.attention_hook import AttentionLayer
from models.generate import generate
from models.onnx_contract import text_feeds, text_io_names
from models.registry import TextModel, describe_text_model
from models.spec import TextSpec

TOKENIZER_TEXTS = (
    "hello world", "  two  spaces\n\ttab\r\n", "Grüße, naïve café", "мир, Ελληνικά", "日本語のテキスト",
    "emoji 🎉👍🏽 and ZWJ 👨‍👩‍👧", "mixed: a=1; b='x' # ~!@$%^&*()", "",
)
GENAI_PROMPTS = ("The quick brown fox", "Once upon a time", "1 + 1 =", "über", "a")


def _case(model: TextModel, spec: TextSpec, rng: np.random.Generator, past_len: int, padding: bool,
          dtypes: list[np.dtype]) -> tuple[dict, list[np.ndarray], int]:
    """A decoder call on a shared buffer: batch 1-8, `past_len` cached tokens, 1-8 new ones (GroupQueryAttention
    takes several new tokens on a cache only at batch 1, and no left padding: `padding=False` keeps to that)."""
    batch, new = int(rng.integers(1, 9)), int(rng.integers(1, 9))
    if not padding and past_len and batch > 1:
        new = 1
    total = past_len + new
    mask = torch.ones(batch, total, dtype=torch.long)
    if padding:
        for row in range(1, batch):
            mask[row, : int(rng.integers(0, total))] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids = torch.from_numpy(rng.integers(0, spec.vocab_size, (batch, total)))
    with torch.no_grad():
        past = model.empty_past(batch)
        if past_len:
            _, past = model(ids[:, :past_len], positions[:, :past_len], mask[:, :past_len], past)
        logits, presents = model(ids[:, past_len:], positions[:, past_len:], mask, past)
    size = total + int(rng.integers(0, 9))  # the buffer: longer than the context, noise after the past
    buffers = []
    for (k, v), dtype in zip(past, dtypes, strict=True):
        pair = []
        for t in (k, v):
            buf = rng.standard_normal((batch, t.shape[1], size, t.shape[3])).astype(dtype)
            buf[:, :, :past_len] = t.numpy()
            pair.append(buf)
        buffers.append((pair[0], pair[1]))
    feed = text_feeds(ids[:, past_len:].numpy(), mask.numpy(), positions[:, past_len:].contiguous().numpy(), buffers)
    refs = [logits.numpy()] + [t.numpy() for kv in presents for t in kv]
    return feed, refs, total


def decoder_calls(model: TextModel, spec: TextSpec, layers: list[AttentionLayer], path: Path, samples: int,
                   tolerance: Tolerance, phases: Phases, rng: np.random.Generator,
                   precision: Precision) -> tuple[dict[str, Any], list[str]]:
    # GroupQueryAttention takes no left padding, nor several new tokens on a cache at batch > 1: such calls only
    # where every layer is MultiMaxAttention
    padding = all(a.multimax is not None for a in layers)
    dtypes = [torch.empty(0, dtype=cache_dtype(layers, precision)).numpy().dtype] * len(layers)
    cases = []
    with phases.phase("reference (PyTorch)", total=samples, unit="case") as bar:
        for i in range(samples):
            cases.append(_case(model, spec, rng, 0 if i % 4 == 0 else int(rng.integers(1, 17)), padding, dtypes))
            bar.update()
    _, names = text_io_names(len(layers))
    past_names = [n for n in cases[0][0] if n.startswith("past_key_values.")]
    report: dict[str, Any] = {"samples": samples, "batch_sizes": [1, 8], "past_lengths": [0, 16],
                              "new_tokens": [1, 8], "left_padding": padding, "tolerance": asdict(tolerance)}
    failures: list[str] = []
    fused_outputs: list[list[np.ndarray]] = []
    for level_name, level in LEVELS.items():
        with phases.phase(f"onnxruntime {level_name}", total=samples, unit="case") as bar:
            session = cpu_session(path, level)
            diffs, rels, nans, agree, rows, untouched = [], [], 0, 0, 0, True
            logits, presents = Measure(), Measure()
            for feed, refs, total in cases:
                outs = session.run(names, feed)
                if level_name == "ORT_ENABLE_ALL" and len(fused_outputs) < 8:
                    fused_outputs.append(outs)
                nans += sum(int(np.isnan(o).sum()) for o in outs)
                diff = logits.add(outs[0], refs[0])
                diffs.append(diff.ravel())
                rels.append((diff / np.maximum(np.abs(refs[0]), 1e-6)).ravel())
                for out, ref, past in zip(outs[1:], refs[1:], (feed[n] for n in past_names), strict=True):
                    presents.add(out[:, :, :total].astype(np.float32), ref)
                    # MultiMaxAttention keeps the buffer after the total length (GroupQueryAttention need not)
                    untouched &= not padding or bool(np.array_equal(out[:, :, total:], past[:, :, total:]))
                agree += int((outs[0][:, -1].argmax(-1) == refs[0][:, -1].argmax(-1)).sum())
                rows += refs[0].shape[0]
                bar.update()
        del session  # one session's copy of the weights at a time (a large model's memory)
        report[level_name] = _stats(diffs, rels) | {
            "present_max_abs": presents.max_abs, "next_token_agreement": agree / rows,
            "nan_count": nans, **({"buffer_tail_untouched": untouched} if padding else {}),
            "limits": {"logits": logits.report(tolerance.tol), "present": presents.report(tolerance.tol)},
        }
        failures += _failures(level_name, report[level_name], tolerance, "next_token_agreement")
        if not untouched:
            failures.append(f"{level_name}: the cache buffer changed after the total length")
    with phases.phase("fused ops vs function bodies"):
        feeds = [feed for feed, _, _ in cases[:8]]
        report["fused_ops"] = compare_fused(path, feeds, fused_outputs, tolerance.fused_tol, tolerance.tol)
    return report, failures + report["fused_ops"]["failures"]


def genai_greedy(folder: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Greedy tokens from onnxruntime-genai for each prompt (one generator per prompt)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    context = _context(folder)
    out = []
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=min(len(prompt) + tokens, context), do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([prompt])
        new: list[int] = []
        while not generator.is_done():
            generator.generate_next_token()
            new.append(int(generator.get_next_tokens()[0]))
        out.append(new)
    return out


def without_library(folder: Path, into: Path) -> Path:
    """A copy of the folder whose config names no custom-op library (onnxruntime runs the function bodies)."""
    copy = into / folder.name
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(LIBRARY_FILE))
    config = json.loads((copy / CONFIG_FILE).read_text())
    config["model"]["decoder"]["session_options"].pop("custom_ops_library", None)
    (copy / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return copy


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens onnxruntime-genai returns: up to and including the first end-of-sequence id."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def _agreement(got: list[list[int]], refs: list[list[int]]) -> float:
    """Tokens equal before the first difference, over the reference tokens."""
    same = 0
    for a, b in zip(got, refs, strict=True):
        same += next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same / max(1, sum(len(r) for r in refs))


def _context(folder: Path) -> int:
    return int(json.loads((folder / CONFIG_FILE).read_text())["model"]["context_length"])


def _eos_ids(folder: Path) -> set[int]:
    eos = json.loads((folder / CONFIG_FILE).read_text())["model"]["eos_token_id"]
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _genai(model: TextModel, spec: TextSpec, folder: Path, tokens: int, phases: Phases,
           exact: bool) -> tuple[dict[str, Any], list[str]]:
    try:
        import onnxruntime_genai as og
    except ImportError as exc:
        # a check that did not run: the export's verdict names it ("skipped", export.summary.skipped_checks)
        return {"checked": False, "reason": f"onnxruntime-genai is not installed ({exc})",
                "skipped": "onnxruntime-genai not installed"}, []
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    context = _context(folder)  # a prompt gets what fits in the context, up to `tokens`
    prompts = [ids for ids in (list(tok.encode(p).ids) for p in GENAI_PROMPTS) if 0 < len(ids) < context]
    eos = _eos_ids(folder)
    refs = [_until_eos(generate(model, p, min(tokens, context - len(p)), temperature=0, spec=spec)[0], eos)
            for p in prompts]
    report: dict[str, Any] = {"checked": True, "version": og.__version__, "prompts": len(prompts), "tokens": tokens}
    failures = []
    has_library = (folder / LIBRARY_FILE).is_file()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"library": folder} if has_library else {}
        runs["function_bodies"] = without_library(folder, Path(tmp)) if has_library else folder
        for name, path in runs.items():
            with phases.phase(f"onnxruntime-genai greedy ({name.replace('_', ' ')})", total=len(prompts)):
                got = genai_greedy(path, prompts, tokens)
            same = sum(a == b for a, b in zip(got, refs, strict=True))
            report[name] = {"identical": same, "token_agreement": round(_agreement(got, refs), 4)}
            if same < len(prompts) and exact:
                failures.append(f"onnxruntime-genai ({name.replace('_', ' ')}): {len(prompts) - same} of "
                                f"{len(prompts)} greedy generations differ from PyTorch")
        with phases.phase("tokenizer (onnxruntime-genai)"):
            try:
                gtok = og.Tokenizer(og.Model(str(runs["function_bodies"])))
            except RuntimeError as exc:  # its C++ tokenizer reads BPE-like models, e.g. not WordLevel
                kind = json.loads((folder / "tokenizer.json").read_text())["model"]["type"]
                report["tokenizer"] = {"checked": False, "model": kind,
                                       "reason": f"onnxruntime-genai's tokenizer cannot read a {kind} tokenizer.json "
                                                 f"({str(exc).strip()[:80]}); give it token ids",
                                       "skipped": f"onnxruntime-genai's tokenizer cannot read a {kind} tokenizer.json"}
                return report, failures
            config = json.loads((folder / "tokenizer_config.json").read_text())
            if config.get(FAIRSEQ_WORDS):
                return _fairseq_words(report, failures, tok, gtok)
            same, with_specials = 0, 0
            for text in TOKENIZER_TEXTS:
                expected = list(tok.encode(text, add_special_tokens=False).ids)
                encoded = [int(i) for i in gtok.encode(text)]
                same += encoded == expected and gtok.decode(np.array(expected, dtype=np.int32)) == tok.decode(expected)
                with_specials += encoded == list(tok.encode(text).ids)
    # onnxruntime-genai's tokenizer encodes the text's tokens; tokenizer.json's template tokens (a bos, fairseq's
    # leading </s>) it adds only where its tokenizer_config says so: counted, not required
    report["tokenizer"] = {"checked": True, "texts": len(TOKENIZER_TEXTS), "identical": int(same),
                           "identical_with_template_tokens": int(with_specials)}
    if same < len(TOKENIZER_TEXTS):
        failures.append(f"tokenizer: {len(TOKENIZER_TEXTS) - same} of {len(TOKENIZER_TEXTS)} texts encode or decode "
                        "differently in onnxruntime-genai than with the tokenizers library")
    return report, failures


def _fairseq_words(report: dict[str, Any], failures: list[str], tok: Any,
                   gtok: Any) -> tuple[dict[str, Any], list[str]]:
    """A fairseq word-level folder (export.hf_tokenizer.word_level_for_genai): onnxruntime-genai's tokenizer must
    encode and decode as the tokenizers library does every text normalised as fairseq's tokenize_line normalises it
    (whitespace runs -> one space, stripped); on the raw texts it differs where its pre-tokenizer cannot follow
    (leading or trailing whitespace, a word after a newline or tab): counted, not required."""
    def same(text: str) -> tuple[bool, bool]:
        expected = list(tok.encode(text, add_special_tokens=False).ids)
        encoded = [int(i) for i in gtok.encode(text)]
        decoded = gtok.decode(np.array(expected, dtype=np.int32))
        return encoded == expected and decoded == tok.decode(expected), encoded == list(tok.encode(text).ids)

    normalised = [" ".join(t.split()) for t in TOKENIZER_TEXTS]
    checks = [same(t) for t in normalised]
    identical = sum(a for a, _ in checks)
    report["tokenizer"] = {"checked": True, "texts": len(normalised), "identical": identical,
                           "identical_with_template_tokens": sum(b for _, b in checks), "normalised": "fairseq",
                           "raw_texts_identical": sum(same(t)[0] for t in TOKENIZER_TEXTS)}
    if identical < len(normalised):
        failures.append(f"tokenizer: {len(normalised) - identical} of {len(normalised)} fairseq-normalised texts "
                        "encode or decode differently in onnxruntime-genai than with the tokenizers library")
    return report, failures


def validate_genai_folder(model: TextModel, folder: Path, samples: int = 100, tokens: int = 32, seed: int = 0,
                          tolerance: Tolerance = TOLERANCES["fp32"], phases: Phases | None = None,
                          precision: Precision = "fp32", spec: TextSpec | None = None,
                          layers: list[AttentionLayer] | None = None) -> dict[str, Any]:
    """See the module docstring. `spec` (the model's description) and `layers` (its `attention_layers()`): what
    export.pipeline computed once for this export, else computed here."""
    phases = phases or Phases(False)
    spec = spec or describe_text_model(model)
    layers = layers if layers is not None else model.attention_layers()
    rng = np.random.default_rng(seed)
    report, failures = decoder_calls(model, spec, layers, folder / MODEL_FILE, samples, tolerance, phases, rng,
                                      precision)
    report["genai"], bad = _genai(model, spec, folder, tokens, phases, tolerance.greedy_exact)
    failures += bad
    report["failures"] = failures
    report["passed"] = not failures
    return report
