"""`python -m benchmarks.decode_step`: decode-step time at 512 tokens of context against 16, batch 1 and 8.

The model is a randomly initialised `gpt-lm-6` (the paper's LM shape: 6 layers, 512 wide, 8 heads) with a
context of 1024, once with MultiMax (attention + output, the paper's Table 8 parameters) and once with softmax.
Paths:
  genai      the onnxruntime-genai folder export (`python -m export CKPT -o DIR`): a cache buffer of the whole
             context (max_length 1024 for both contexts) shared by past and present, new keys written in place
             (MultiMax: multimax::MultiMaxAttention with the fused library; softmax: GroupQueryAttention)
  concat     the single-file export in onnxruntime, the cache fed back as present = concat(past, new) (what the
             server's backend does; MultiMax model, fused library registered)
Both paths run onnxruntime with one intra-op thread. Each round, per path and batch size, the two contexts in
alternating order: a prefill of exactly that many tokens, one untimed step, then --steps timed steps (genai:
the cache grows by one per step; concat: every step from the same cache). Per round the ratio of the medians;
reported: the median over rounds of those ratios and the median step times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

CONTEXTS = (16, 512)
BATCHES = (1, 8)
BLOCK = 1024
THREADS = 1  # onnxruntime intra-op threads on both paths: on a shared 2-core machine a second spinning
             # thread made step times depend on the neighbours' load more than on the model


def build(work: Path) -> dict[str, Path]:
    """The exports (made once per work directory): genai folders of both models, the MultiMax single file."""
    import torch

    from export.genai_folder import write_folder
    from export.onnx_export import export_text
    from models.checkpoint import Checkpoint
    from models.gpt import GPT, GPTConfig, set_paper_params
    from models.tokenizer import ByteTokenizer

    paths = {"multimax_genai": work / "multimax", "softmax_genai": work / "softmax",
             "multimax_concat": work / "multimax.onnx"}
    for name, multimax in (("multimax", True), ("softmax", False)):
        torch.manual_seed(0)
        config = GPTConfig.from_preset("gpt-lm-6", block_size=BLOCK, multimax_attention=multimax,
                                       multimax_output=multimax)
        model = GPT(config).eval()
        if multimax:
            set_paper_params(model)
        ckpt = Checkpoint("gpt", config.to_dict(), model.state_dict(), tokenizer=ByteTokenizer().to_dict())
        folder = paths[f"{name}_genai"]
        if not (folder / "genai_config.json").exists():
            write_folder(model, ckpt, folder)
            config = json.loads((folder / "genai_config.json").read_text())
            config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = THREADS
            (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
        if multimax and not paths["multimax_concat"].exists():
            export_text(model, ckpt, paths["multimax_concat"])
    return paths


def genai_steps(folder: Path) -> Callable[[int, int, int], list[float]]:
    import onnxruntime_genai as og

    model = og.Model(str(folder))

    def run(context: int, batch: int, steps: int) -> list[float]:
        rng = np.random.default_rng(context)
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=BLOCK, do_sample=False, batch_size=batch)
        generator = og.Generator(model, params)
        generator.append_tokens(rng.integers(0, 256, (batch, context), dtype=np.int32))
        generator.generate_next_token()  # untimed
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            generator.generate_next_token()
            times.append(time.perf_counter() - t0)
        return times

    return run


def concat_steps(path: Path) -> Callable[[int, int, int], list[float]]:
    import onnxruntime as ort

    from models.onnx_contract import text_feeds
    from plugins.ort_ops import register

    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    register(options)
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = {i.name: i for i in session.get_inputs()}
    heads, dim = inputs["past_key_values.0.key"].shape[1], inputs["past_key_values.0.key"].shape[3]
    layers = sum(name.endswith(".key") for name in inputs)

    def run(context: int, batch: int, steps: int) -> list[float]:
        rng = np.random.default_rng(context)
        empty = np.zeros((batch, heads, 0, dim), np.float32)
        ids = rng.integers(0, 256, (batch, context), dtype=np.int64)
        positions = np.broadcast_to(np.arange(context), (batch, context)).copy()
        _, *presents = session.run(None, text_feeds(ids, np.ones_like(ids), positions, [(empty, empty)] * layers))
        past = list(zip(presents[0::2], presents[1::2], strict=True))
        feed = text_feeds(rng.integers(0, 256, (batch, 1), dtype=np.int64), np.ones((batch, context + 1), np.int64),
                          np.full((batch, 1), context, np.int64), past)
        session.run(None, feed)  # untimed
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            session.run(None, feed)
            times.append(time.perf_counter() - t0)
        return times

    return run


def measure(runners: dict[str, Callable[[int, int, int], list[float]]], rounds: int, steps: int) -> dict[str, Any]:
    step_ms: dict[str, dict[int, list[float]]] = {}
    ratios: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, run in runners.items():
            for batch in BATCHES:
                key = f"{name}_batch{batch}"
                medians = {}
                for context in (CONTEXTS if r % 2 == 0 else CONTEXTS[::-1]):
                    medians[context] = statistics.median(run(context, batch, steps)) * 1e3
                    step_ms.setdefault(key, {}).setdefault(context, []).append(medians[context])
                ratios.setdefault(key, []).append(medians[CONTEXTS[1]] / medians[CONTEXTS[0]])
                print(json.dumps({"round": r, key: {str(c): round(m, 3) for c, m in medians.items()},
                                  "ratio": round(ratios[key][-1], 3)}), flush=True)
    return {
        key: {
            **{f"step_ms_context_{c}": round(statistics.median(v), 3) for c, v in step_ms[key].items()},
            "ratio_median": round(statistics.median(ratios[key]), 3),
            "ratios": [round(x, 3) for x in ratios[key]],
        }
        for key in ratios
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per measurement")
    p.add_argument("--work", type=Path, default=Path("decode_step_work"), help="where the exports are kept")
    p.add_argument("--only", help="comma-separated paths (multimax_genai, softmax_genai, multimax_concat)")
    p.add_argument("-o", "--output", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        print("error: onnxruntime-genai is not installed (pip install --no-deps 'onnxruntime-genai==0.18.*')",
              file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    paths = build(args.work)
    makers = {"multimax_genai": genai_steps, "softmax_genai": genai_steps, "multimax_concat": concat_steps}
    chosen = args.only.split(",") if args.only else list(makers)
    unknown = sorted(set(chosen) - set(makers))
    if unknown:
        p.error(f"unknown path(s) {', '.join(unknown)}; known: {', '.join(makers)}")
    runners = {name: makers[name](paths[name]) for name in chosen}
    results = {"model": f"random gpt-lm-6 (6 layers, 512 wide, 8 heads), context {BLOCK}",
               "contexts": list(CONTEXTS), "rounds": args.rounds, "steps": args.steps,
               "load_average_at_start": os.getloadavg(), "results": measure(runners, args.rounds, args.steps)}
    print(json.dumps(results["results"], indent=2))
    if args.output:
        args.output.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
