"""`python -m benchmarks.prefix_cache`: time to first token with a 1,000-token prefix the server has seen (warm)
against one it has not (cold), through the HTTP API.

The model: a randomly initialised Llama written by `transformers`' `save_pretrained` (--layers, --width; grouped-
query heads, 2,048 positions) with the demo LLM's tokenizer, served as a Hugging Face folder (the PyTorch backend)
or, with --onnx, as its `python -m export` file (onnxruntime). Per round: a fresh random prefix of --prefix token
ids; a request with it and one random 16-token question (cold: nothing cached starts that way), then the same
prefix with another question (warm: its whole blocks come from the prefix cache). Each request streams
(`/v1/completions`, one token) and the time to its first content event is the TTFT. Reported: every round, the
medians, the median of the per-round warm/cold ratios, and the server's prefix-cache counters; `-o` writes JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.server import in_thread

DEMO_LLM = Path(__file__).resolve().parents[1] / "models" / "demo" / "llama_seglu"
NAME = "prefix_llama"


def build_folder(out: Path, layers: int, width: int) -> Path:
    """A random Llama (the demo's 4,096-token vocabulary and tokenizer) as transformers writes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = out / NAME
    if (folder / "model.safetensors").exists():
        return folder
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=width, intermediate_size=3 * width, num_hidden_layers=layers,
                         num_attention_heads=width // 64, num_key_value_heads=max(1, width // 256),
                         max_position_embeddings=2048, eos_token_id=0, pad_token_id=0, bos_token_id=None,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_LLM / name, folder / name)
    return folder


def export_onnx(folder: Path, out: Path) -> Path:
    target = out / f"{NAME}.onnx"
    if not target.exists():
        subprocess.run([sys.executable, "-m", "export", str(folder), "-o", str(target), "--samples", "2"],
                       check=True, stdout=subprocess.DEVNULL)
    return target


def ttft(client: httpx.Client, url: str, ids: list[int]) -> float:
    body = {"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    out = {}
    for line in client.get(f"{url}/metrics").text.splitlines():
        if line.startswith("multimax_prefix_cache_") and f'model="{NAME}"' in line and "_created" not in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            out[name.removeprefix("multimax_prefix_cache_")] = value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, default=1000, help="shared prefix, tokens (default 1000)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads of the model")
    p.add_argument("--onnx", action="store_true", help="serve the export (onnxruntime) instead of the folder")
    p.add_argument("--work", type=Path, default=Path("runs/prefix_cache"), help="where the model is built")
    p.add_argument("-o", "--output", type=Path, help="write the results as JSON")
    args = p.parse_args(argv)
    from service.base.config import Settings
    from service.edge.app import create_app

    args.work.mkdir(parents=True, exist_ok=True)
    print(f"building a {args.layers}-layer, {args.width}-wide Llama in {args.work} ...", file=sys.stderr)
    folder = build_folder(args.work / "models", args.layers, args.width)
    if args.onnx:
        print("exporting it (python -m export) ...", file=sys.stderr)
        export_onnx(folder, args.work / "models")
        shutil.rmtree(folder)  # one model of that name in the directory: the export
    app = create_app(Settings(model_dir=args.work / "models", models=(NAME,), intra_op_threads=args.threads,
                              warmup_calls=1))
    rng = np.random.default_rng(0)
    rounds: list[dict[str, float]] = []
    with in_thread(app) as url, httpx.Client(timeout=600) as client:
        ttft(client, url, rng.integers(1, 4096, 32).tolist())  # the first request's one-off costs
        for r in range(args.rounds):
            prefix = rng.integers(1, 4096, args.prefix).tolist()
            cold = ttft(client, url, prefix + rng.integers(1, 4096, 16).tolist())
            warm = ttft(client, url, prefix + rng.integers(1, 4096, 16).tolist())
            rounds.append({"cold_s": cold, "warm_s": warm, "ratio": warm / cold})
            print(f"round {r + 1}: cold {cold * 1e3:.1f} ms, warm {warm * 1e3:.1f} ms, warm/cold "
                  f"{warm / cold:.3f}", file=sys.stderr)
        cache = counters(client, url)
    result: dict[str, Any] = {
        "model": {"layers": args.layers, "width": args.width, "vocab": 4096, "backend": "onnx" if args.onnx
                  else "torch (folder)", "threads": args.threads},
        "prefix_tokens": args.prefix, "rounds": rounds,
        "cold_ms_median": 1e3 * statistics.median(r["cold_s"] for r in rounds),
        "warm_ms_median": 1e3 * statistics.median(r["warm_s"] for r in rounds),
        "warm_over_cold": statistics.median(r["ratio"] for r in rounds), "prefix_cache": cache,
    }
    print(f"TTFT with a {args.prefix}-token prefix: cold {result['cold_ms_median']:.1f} ms, warm "
          f"{result['warm_ms_median']:.1f} ms; warm/cold {result['warm_over_cold']:.3f} (median of per-round "
          f"ratios); prefix cache {cache}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
