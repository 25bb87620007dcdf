"""`python -m benchmarks.structured_cost`: what structured output costs per generated token.

Each step of a guided sequence runs its `service.protocols.structured.GrammarProcessor` (llguidance advances
the matcher by the last token and computes the allowed-token bitmask; torch masks the logits) and then the
sampler (`service.engine.text.sampler.sample` with the row's processors: sampling among the allowed ids). Both are
timed per token here, with fresh random logits every step (the grammar alone decides validity, and random logits
walk every branch),
for four grammars and two tokenizers: the byte-level demo tokenizer (259 ids) and a byte-level BPE
tokenizer.json trained here on the Python standard library's sources (--vocab ids; nothing is downloaded).
Unconstrained sampling of the same logits (`sample_token`) is timed beside them as the baseline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from models.tokenizer import ByteTokenizer
from service.engine.text.sampler import SamplingParams, _OneRow, sample, sample_token
from service.protocols.structured import processors_for

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
GRAMMARS: dict[str, dict[str, Any]] = {
    "json_object": {"response_format": {"type": "json_object"}, "guided_whitespace_pattern": ""},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                    "guided_whitespace_pattern": ""},
    "regex": {"guided_regex": "[0-9]{3}-[a-z]{2,8}( [A-Z][a-z]{1,6}){0,6}"},
    "choice": {"guided_choice": ["positive", "negative", "neutral", "mixed feelings"]},
}


def _corpus() -> Iterator[str]:
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")


def bpe_tokenizer(folder: Path, vocab: int) -> HFTextTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return HFTextTokenizer(HFTokenizer.from_folder(folder))  # as the server holds a folder's tokenizer


def run(tok: Any, fields: dict[str, Any], sequences: int, max_tokens: int, seed: int) -> dict[str, Any]:
    eos = set(getattr(tok, "eos_ids", ()) or [tok.eos_id])
    gen = torch.Generator().manual_seed(seed)
    proc_us: list[float] = []
    bridge_us: list[float] = []
    plain_us: list[float] = []
    built: list[float] = []
    lengths = []
    for _ in range(sequences):
        t = time.perf_counter()
        processors = processors_for(fields, tok)
        built.append(time.perf_counter() - t)
        params = SamplingParams(max_tokens=max_tokens, processors=processors)
        out: list[int] = []
        for _ in range(max_tokens):
            logits = torch.randn(tok.vocab_size, generator=gen) * 3
            t0 = time.perf_counter()
            masked = processors[0](out, logits)
            t1 = time.perf_counter()
            tokens, errors = sample(logits[None], [_OneRow(params, gen, output_ids=out)])
            if errors[0] is not None:
                raise errors[0]
            token = tokens[0]
            t2 = time.perf_counter()
            sample_token(logits, 1.0, None, 1.0, gen)
            t3 = time.perf_counter()
            del masked
            proc_us.append((t1 - t0) * 1e6)
            bridge_us.append((t2 - t1) * 1e6 - proc_us[-1])  # the bridge runs the processor again: net of it
            plain_us.append((t3 - t2) * 1e6)
            if token in eos:
                break
            out.append(token)
        lengths.append(len(out))

    def pct(xs: list[float], q: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {"tokens": len(proc_us), "mean_len": statistics.mean(lengths),
            "compile_ms": round(statistics.median(built) * 1e3, 2),
            "mask_us_p50": round(pct(proc_us, 0.5), 1), "mask_us_p99": round(pct(proc_us, 0.99), 1),
            "mask_us_mean": round(statistics.mean(proc_us), 1),
            "bridge_us_p50": round(pct(bridge_us, 0.5), 1),
            "unconstrained_sample_us_p50": round(pct(plain_us, 0.5), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.structured_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=32000, help="BPE vocabulary size trained (default 32000)")
    ap.add_argument("--sequences", type=int, default=8, help="sequences per grammar and tokenizer")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.vocab < 300 or args.sequences < 1 or args.max_tokens < 1:
        print("error: --vocab >= 300, --sequences >= 1, --max-tokens >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        bpe = bpe_tokenizer(Path(tmp), args.vocab)
        trained = time.perf_counter() - t
        for name, tok in (("byte-259", ByteTokenizer()), (f"bpe-{bpe.vocab_size}", bpe)):
            t = time.perf_counter()
            processors_for(GRAMMARS["regex"], tok)  # the first grammar builds the llguidance tokenizer (once)
            first = time.perf_counter() - t
            results[name] = {"tokenizer_index_ms": round(first * 1e3, 1)}
            for grammar, fields in GRAMMARS.items():
                results[name][grammar] = run(tok, fields, args.sequences, args.max_tokens, args.seed)
    results["bpe_training_s"] = round(trained, 1)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"per generated token, microseconds (1 torch thread); BPE trained in {trained:.1f} s")
    print(f"{'tokenizer':<10} {'grammar':<12} {'tokens':>6} {'mask p50':>9} {'mask p99':>9} {'mean':>7} "
          f"{'bridge p50':>10} {'plain p50':>9} {'compile ms':>10}")
    for name in (k for k in results if k != "bpe_training_s"):
        for grammar in GRAMMARS:
            r = results[name][grammar]
            print(f"{name:<10} {grammar:<12} {r['tokens']:>6} {r['mask_us_p50']:>9} {r['mask_us_p99']:>9} "
                  f"{r['mask_us_mean']:>7} {r['bridge_us_p50']:>10} {r['unconstrained_sample_us_p50']:>9} "
                  f"{r['compile_ms']:>10}")
        print(f"{name:<10} (llguidance tokenizer index built once per tokenizer: "
              f"{results[name]['tokenizer_index_ms']} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
