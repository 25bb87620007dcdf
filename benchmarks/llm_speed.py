"""`python -m benchmarks.llm_speed`: what the SegLU head and a long context cost a Llama, side by side in one run.

Models: the shipped demo LLM (models/demo/llama_seglu: 4 layers, 128 wide, 4096 tokens) and a randomly
initialised Llama of the paper's WikiText-103 LM size (6 layers, 512 wide, 8 heads, FFN 2048, tied embeddings
over fairseq's 267,744-word vocabulary: 156M parameters; SegLU from the paper's Table 8, last row; nothing
shipped). Each model also as its twin without the SegLU (same weights, `output_multimax` removed).
Paths:
  torch   the PyTorch model as the server's PyTorch backend runs it: its KV cache grown in place
          (models.cache_growth), the prefill's logits for the last row only, the SegLU by the fused library's
          CPU kernel (plugins.cpu_sigma)
  onnx    the single-file export (`export.onnx_export.export_text`) in onnxruntime, fused ops registered, the cache
          fed back as present = concat(past, new) (the export the server runs); made once per --work directory
  genai   the onnxruntime-genai folder export (`export.genai_folder`) in onnxruntime-genai's own loop: one cache
          buffer of the whole context shared by past and present; made once per --work directory
Every path uses one intra-op thread (on a shared 2-core machine a second spinning thread measures the neighbours).
Measured, per round and pair, --steps timed calls of each side interleaved call by call (A B, then B A, ...)
after one untimed call each; per round the ratio B/A of the two sides' median times; reported: the median over
rounds of the per-round ratios, and the median times:
  seglu_prefill       a prompt of --prefill tokens at batch 1 from an empty cache, with SegLU / without
  seglu_decode        one decode step at batch 1 after a 128-token prefill, with SegLU / without
  context_batch{1,8}  one decode step (SegLU model) at 512 tokens of context / at 16
torch and onnx: every decode step starts from the same cache (it does not grow between timed calls); genai: the
generator grows by one token per step and is prefilled afresh (untimed) every --steps + 1 calls.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

# The paper's LM (MULTIMAX.md, fairseq transformer_lm) at Llama's layout.
PAPER_SHAPE: dict[str, Any] = dict(flavor="llama", vocab_size=267_744, block_size=1024, n_layer=6, n_head=8,
                                   dim=512, intermediate_size=2048, tie_word_embeddings=True, multimax_output=True)
CONTEXTS = (16, 512)
BATCHES = (1, 8)
DECODE_CONTEXT = 128
CHUNK = 32  # onnxruntime builds the cache this many tokens at a time (a whole 8 x 512 prompt: 4.4 GB of logits)
Timer = Callable[[], float]  # one timed call, seconds


def paper_model() -> Any:
    from models.llama import Llama, LlamaConfig, set_paper_params

    torch.manual_seed(0)
    model = Llama(LlamaConfig.from_dict(PAPER_SHAPE)).eval()
    set_paper_params(model)
    return model


def demo_folder() -> Path:
    from models.demo import DEMO_DIR, LLM_DEMO

    return Path(DEMO_DIR) / LLM_DEMO


def demo_model() -> Any:
    """The shipped folder, its context raised to 1024 for the 512-token measurement: the demo was trained on 256
    tokens (RoPE has no length limit, and the work of a step does not depend on what the weights know)."""
    from models.hf_folder import load_folder

    model = load_folder(demo_folder())[0]
    model.config = type(model.config).from_dict(model.config.to_dict() | {"block_size": 1024})
    for block in model.block_list():  # the cache buffers may grow to the new context
        block.attention.max_length = 1024
    return model


def without_seglu(model: Any) -> Any:
    """The same weights with a plain softmax head."""
    from models.llama import LlamaConfig

    twin = copy.copy(model)  # shares every tensor; only the head's modulation and the config differ
    twin._modules = dict(model._modules)
    twin._modules["output_multimax"] = None
    twin.config = LlamaConfig.from_dict(model.config.to_dict() | {"multimax_output": False})
    return twin


# ---- the two paths: a prefill timer and a decode-step timer per (model, batch, context) ------------------------

def _ids(vocab: int, batch: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, (batch, length), dtype=np.int64)


class _FirstColumn(torch.nn.Module):
    """Stands in for the LM head while a cache is built: one column instead of the vocabulary's logits."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[..., :1]


class TorchPath:
    def __init__(self, model: Any) -> None:
        from plugins.cpu_sigma import use_cpu_sigma

        self.model = model
        use_cpu_sigma(model)  # as the server's PyTorch backend: the fused library's SegLU

    def prefill(self, batch: int, length: int) -> Timer:
        ids = torch.from_numpy(_ids(self.model.config.vocab_size, batch, length, length))

        def run() -> float:
            with torch.no_grad():
                t0 = time.perf_counter()
                self.model(ids, logits_to_keep=1)  # the last row's logits: what generate and the server ask for
                return time.perf_counter() - t0

        return run

    @torch.no_grad()
    def decode(self, batch: int, context: int) -> Timer:
        vocab = self.model.config.vocab_size
        prompt = torch.from_numpy(_ids(vocab, batch, context, context))
        head = self.model._modules["output"]
        self.model._modules["output"] = _FirstColumn()  # the cache needs no logits (4.4 GB at paper size)
        try:
            # from an empty cache, as generate and the server do (its buffer then has room for the steps)
            _, past = self.model(prompt, past_key_values=self.model.empty_past(batch))
        finally:
            self.model._modules["output"] = head
        new = torch.from_numpy(_ids(vocab, batch, 1, context + 1))
        mask = torch.ones(batch, context + 1, dtype=torch.long)
        positions = torch.full((batch, 1), context, dtype=torch.long)

        def run() -> float:
            with torch.no_grad():
                t0 = time.perf_counter()
                self.model(new, position_ids=positions, attention_mask=mask, past_key_values=past)
                return time.perf_counter() - t0

        return run


class OnnxPath:
    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        from plugins.ort_ops import register

        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        register(options)
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        key = inputs["past_key_values.0.key"].shape
        self.heads, self.head_dim = key[1], key[3]
        self.layers = sum(name.endswith(".key") for name in inputs)
        meta = self.session.get_modelmeta().custom_metadata_map
        self.vocab = int(json.loads(meta["multimax.config"])["vocab_size"])

    def _feeds(self, ids: np.ndarray, past_len: int, past: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        from models.onnx_contract import text_feeds

        batch, length = ids.shape
        positions = np.broadcast_to(np.arange(past_len, past_len + length), (batch, length)).copy()
        return text_feeds(ids, np.ones((batch, past_len + length), np.int64), positions, past)

    def _empty(self, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        empty = np.zeros((batch, self.heads, 0, self.head_dim), np.float32)
        return [(empty, empty)] * self.layers

    def prefill(self, batch: int, length: int) -> Timer:
        feeds = self._feeds(_ids(self.vocab, batch, length, length), 0, self._empty(batch))

        def run() -> float:
            t0 = time.perf_counter()
            self.session.run(None, feeds)
            return time.perf_counter() - t0

        return run

    def decode(self, batch: int, context: int) -> Timer:
        prompt, past = _ids(self.vocab, batch, context, context), self._empty(batch)
        for start in range(0, context, CHUNK):
            _, *presents = self.session.run(None, self._feeds(prompt[:, start:start + CHUNK], start, past))
            past = list(zip(presents[0::2], presents[1::2], strict=True))
        feeds = self._feeds(_ids(self.vocab, batch, 1, context + 1), context, past)

        def run() -> float:
            t0 = time.perf_counter()
            self.session.run(None, feeds)
            return time.perf_counter() - t0

        return run


class GenaiPath:
    """onnxruntime-genai's own loop on the folder export: one cache buffer of the whole context shared by past and
    present (GroupQueryAttention writes the new keys in place), the SegLU one fused MultiMaxSigma node. A decode
    timer's generator grows by one token per call, so it is prefilled afresh (untimed) every `refill` calls."""

    def __init__(self, folder: Path, refill: int) -> None:
        import onnxruntime_genai as og

        self.og, self.model, self.refill = og, og.Model(str(folder)), refill
        config = json.loads((folder / "genai_config.json").read_text())["model"]
        self.vocab, self.context = int(config["vocab_size"]), int(config["context_length"])

    def _generator(self, batch: int) -> Any:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=self.context, do_sample=False, batch_size=batch)
        return self.og.Generator(self.model, params)

    def prefill(self, batch: int, length: int) -> Timer:
        ids = _ids(self.vocab, batch, length, length).astype(np.int32)

        def run() -> float:
            generator = self._generator(batch)
            t0 = time.perf_counter()
            generator.append_tokens(ids)
            return time.perf_counter() - t0

        return run

    def decode(self, batch: int, context: int) -> Timer:
        ids = _ids(self.vocab, batch, context, context).astype(np.int32)
        state: dict[str, Any] = {"generator": None, "calls": 0}

        def run() -> float:
            if state["generator"] is None or state["calls"] >= self.refill:
                state["generator"], state["calls"] = None, 0  # the old buffers go before the new ones come
                state["generator"] = self._generator(batch)
                state["generator"].append_tokens(ids)
            state["calls"] += 1
            t0 = time.perf_counter()
            state["generator"].generate_next_token()
            return time.perf_counter() - t0

        return run


def export_genai(model: Any, out: Path, tokenizer_source: Path | None) -> Path:
    """The onnxruntime-genai folder export of `model` with one intra-op thread (made once: reused while it exists)."""
    if (out / "genai_config.json").exists():
        return out
    from export.genai_folder import write_folder
    from models.checkpoint import Checkpoint

    ckpt = Checkpoint("llama", model.config.to_dict(), model.state_dict())
    write_folder(model, ckpt, out, tokenizer_source=tokenizer_source)
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    (out / "genai_config.json").write_text(json.dumps(config, indent=2))
    return out


def export_onnx(model: Any, out: Path) -> Path:
    """The single-file export of `model` (made once: reused while the file exists)."""
    if out.exists():
        return out
    from export.onnx_export import export_text
    from models.checkpoint import Checkpoint

    ckpt = Checkpoint("llama", model.config.to_dict(), model.state_dict())
    export_text(model, ckpt, out)
    return out


# ---- measurement ------------------------------------------------------------------------------------------

def paired(pairs: dict[str, tuple[Timer, Timer]], rounds: int, steps: int, log: bool = True) -> dict[str, Any]:
    """Per pair (A, B): per round both sides in alternating order, ratio of medians B/A; median over rounds."""
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in pairs}
    ratios: dict[str, list[float]] = {k: [] for k in pairs}
    for r in range(rounds):
        for key, (a, b) in pairs.items():
            a(), b()  # untimed
            samples: tuple[list[float], list[float]] = ([], [])
            for i in range(steps):  # call by call, A and B alternating who goes first: both see the same load
                for side in ((0, 1) if (r + i) % 2 == 0 else (1, 0)):
                    samples[side].append((a, b)[side]())
            med = {side: statistics.median(samples[side]) * 1e3 for side in (0, 1)}
            for side in (0, 1):
                times[key][side].append(med[side])
            ratios[key].append(med[1] / med[0])
            if log:
                print(json.dumps({"round": r, key: [round(med[0], 3), round(med[1], 3)],
                                  "ratio": round(ratios[key][-1], 4)}), flush=True)
    return {key: {"a_ms": round(statistics.median(times[key][0]), 3),
                  "b_ms": round(statistics.median(times[key][1]), 3),
                  "ratio_median": round(statistics.median(ratios[key]), 4),
                  "ratios": [round(x, 4) for x in ratios[key]]} for key in pairs}


def pairs_for(path_with: Any, path_without: Any, prefill: int) -> dict[str, tuple[Timer, Timer]]:
    """A = without SegLU / 16 tokens of context, B = with SegLU / 512 tokens."""
    out = {"seglu_prefill": (path_without.prefill(1, prefill), path_with.prefill(1, prefill)),
           "seglu_decode": (path_without.decode(1, DECODE_CONTEXT), path_with.decode(1, DECODE_CONTEXT))}
    for batch in BATCHES:
        out[f"context_batch{batch}"] = (path_with.decode(batch, CONTEXTS[0]), path_with.decode(batch, CONTEXTS[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llm_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="demo,paper", help="comma-separated: demo, paper")
    p.add_argument("--paths", default="torch,onnx,genai", help="comma-separated: torch, onnx, genai")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=9, help="timed calls per side and round")
    p.add_argument("--prefill", type=int, default=128, help="prompt tokens of the prefill measurement")
    p.add_argument("--work", type=Path, default=Path("llm_speed_work"), help="where the ONNX exports are kept")
    p.add_argument("-o", "--output", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    models, paths = args.models.split(","), args.paths.split(",")
    if args.rounds < 1 or args.steps < 1 or not 1 <= args.prefill <= 512:
        p.error("--rounds and --steps must be >= 1, --prefill 1..512")
    if set(models) - {"demo", "paper"} or set(paths) - {"torch", "onnx", "genai"}:
        p.error("--models takes demo and/or paper, --paths torch, onnx and/or genai")
    torch.set_num_threads(1)
    results: dict[str, Any] = {"rounds": args.rounds, "steps": args.steps, "prefill_tokens": args.prefill,
                               "decode_context_for_seglu": DECODE_CONTEXT, "contexts": list(CONTEXTS),
                               "threads": 1, "load_average_at_start": os.getloadavg(), "results": {}}
    for name in models:
        model = demo_model() if name == "demo" else paper_model()
        twin = without_seglu(model)
        results.setdefault("models", {})[name] = {
            "parameters": sum(p.numel() for p in model.parameters()), "config": model.config.to_dict()}
        for path in paths:
            if path == "torch":
                with_, without = TorchPath(model), TorchPath(twin)
            elif path == "genai":
                args.work.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                source = demo_folder() if name == "demo" else None
                with_ = GenaiPath(export_genai(model, args.work / f"{name}_seglu_genai", source), args.steps + 1)
                without = GenaiPath(export_genai(twin, args.work / f"{name}_plain_genai", source), args.steps + 1)
                print(f"{name}: genai folders ready in {time.perf_counter() - t0:.0f} s", flush=True)
            else:
                args.work.mkdir(parents=True, exist_ok=True)
                t0 = time.perf_counter()
                with_ = OnnxPath(export_onnx(model, args.work / f"{name}_seglu.onnx"))
                without = OnnxPath(export_onnx(twin, args.work / f"{name}_plain.onnx"))
                print(f"{name}: onnx exports ready in {time.perf_counter() - t0:.0f} s", flush=True)
            print(f"== {name} / {path} (load average {os.getloadavg()[0]:.2f})", flush=True)
            key = f"{name}_{path}"
            results["results"][key] = paired(pairs_for(with_, without, args.prefill), args.rounds, args.steps)
            results["results"][key]["load_average_after"] = os.getloadavg()
    print(json.dumps(results["results"], indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
