"""`python -m benchmarks.export_size`: export time and peak memory of models past protobuf's 2 GB, and serving one.

A Qwen2 folder of a real model's shape is made here with transformers (random weights, seeded; SegLU on the
head: `lm_head.multimax_ranges/ts` with the paper's Table 8 row 5, config `multimax_modules: ["lm_head"]`; a small
BPE tokenizer with a chat template; safetensors in shards), cached under ~/.cache/multimax-serve/export_size/
(or --cache). Each export runs `python -m export` in a child process, which reports its own peak RSS and its
children's (`resource.getrusage`, ru_maxrss); the figure is set against the weights' bytes on disk.

    --shape 0.5b   Qwen2.5-0.5B's shape: hidden 896, 24 layers, 14/2 heads, intermediate 4864, vocab 151936,
                   untied head (630M parameters, 2.5 GB in fp32)
    --shape 1.5b   Qwen2.5-1.5B's shape: hidden 1536, 28 layers, 12/2 heads, intermediate 8960, vocab 151936, tied
    --shape tiny   the same code on a few-MB model (the tests')

    python -m benchmarks.export_size --shape 0.5b --precision fp32,int4
    python -m benchmarks.export_size --shape 1.5b --precision int4 --serve [--no-validate]

`--precision fp32` is the single .onnx (`python -m export DIR -o OUT/model.onnx`), `int4` the onnxruntime-genai
folder (`-o OUT --int4`); `--serve` starts `python -m service` on each int4 folder and sends one chat request.
Exports are written under --work (default /tmp/multimax-export-size); each run replaces the previous one's.
Context is 4096 positions (the real models' 32768 would make the validation's cache buffers, not the export,
the memory figure).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.server import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "multimax-serve" / "export_size"
WORK = Path(tempfile.gettempdir()) / "multimax-export-size"
CONTEXT = 4096
SEGLU_ROW = 5  # models.multimax.PAPER_TABLE_8's row for the head
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CORPUS = ["MultiMax reweights the scores of attention and of the output layer.",
          "The quick brown fox jumps over the lazy dog; numbers 0123456789 and punctuation !?;:",
          "def add(a, b):\n    return a + b"]


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    shard: str  # save_pretrained's max_shard_size: two shards at 0.5b


SHAPES = {
    "tiny": Shape(64, 2, 4, 2, 128, 512, False, "400KB"),
    "0.5b": Shape(896, 24, 14, 2, 4864, 151936, False, "1500MB"),
    "1.5b": Shape(1536, 28, 12, 2, 8960, 151936, True, "4GB"),
}


def config(shape: Shape) -> Any:
    import transformers

    rope: dict[str, Any] = {"rope_theta": 1e6}  # Qwen2.5's (a keyword the stubs do not list)
    return transformers.Qwen2Config(
        **rope, vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=CONTEXT, tie_word_embeddings=shape.tied, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1)


def _tokenizer(out: Path) -> None:
    """A byte-level BPE of a few hundred tokens with a chat template (the ids are a corner of the vocabulary)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)


def _add_seglu(folder: Path) -> None:
    """The head's SegLU tensors in the first shard (as PaddleFleet writes them) and `multimax_modules`."""
    import torch
    from safetensors.torch import load_file, save_file

    from models.multimax import PAPER_TABLE_8, paper_row_to_params

    ranges, ts = paper_row_to_params(PAPER_TABLE_8[SEGLU_ROW])
    extra = {"lm_head.multimax_ranges": torch.tensor(ranges), "lm_head.multimax_ts": torch.tensor(ts)}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        meta = json.loads(index.read_text())
        shard = sorted(set(meta["weight_map"].values()))[0]
        meta["weight_map"].update(dict.fromkeys(extra, shard))
        index.write_text(json.dumps(meta, indent=2))
        path = folder / shard
    else:
        path = folder / "model.safetensors"
    save_file(load_file(path) | extra, path, metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"multimax_modules": ["lm_head"]}, indent=2))


def make_folder(name: str, cache: Path = CACHE) -> Path:
    """The Hugging Face folder of shape `name` (made once per cache; a half-made one is never reused)."""
    import torch
    import transformers

    out = cache / name
    if (out / "done").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    staging = cache / f".{name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(SHAPES[name]), dtype=torch.float32)
    model.save_pretrained(staging, max_shard_size=SHAPES[name].shard)
    del model
    _tokenizer(staging)
    _add_seglu(staging)
    (staging / "done").write_text("")
    staging.rename(out)
    return out


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def files_of(path: Path) -> dict[str, int]:
    """Name -> bytes of what an export wrote (a folder's files, or a .onnx and its data file)."""
    if path.is_dir():
        return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    return {p.name: p.stat().st_size for p in sorted(path.parent.glob(path.name + "*")) if p.is_file()}


def child(report: Path, args: list[str]) -> int:
    """Run `python -m export ARGS` in this process and write its exit code and peak RSS (self, children) to
    `report`: the parent's own memory never enters the figure."""
    from export.cli import main

    code = main(args)
    self_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kilobytes on Linux
    children_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    report.write_text(json.dumps({"code": code, "peak_rss_bytes": max(self_kb, children_kb) * 1024}))
    return code


def export_run(folder: Path, precision: str, work: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """One measured export of `folder`: fp32 to a single .onnx, int4 to a genai folder."""
    out = work / f"{folder.name}.{precision}"
    target = out / "model.onnx" if precision == "fp32" else out
    shutil.rmtree(out, ignore_errors=True)
    if precision == "fp32":
        out.mkdir(parents=True)
    args = [str(folder), "-o", str(target), "--quiet", *(["--int4"] if precision == "int4" else []), *(extra or [])]
    report = work / f"{folder.name}.{precision}.rss.json"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.export_size", "--child", str(report), "--", *args],
                          cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    measured = json.loads(report.read_text()) if report.is_file() else {"code": proc.returncode, "peak_rss_bytes": 0}
    validation = out / ("model.validation.json" if precision == "fp32" else "validation.json")
    data = json.loads(validation.read_text()) if validation.is_file() else {}
    weights = weight_bytes(folder)
    return {
        "shape": folder.name, "precision": precision, "output": str(target), "exit_code": measured["code"],
        "verdict": data.get("verdict", (proc.stderr or proc.stdout).strip().splitlines()[-1:]),
        "wall_seconds": round(wall, 1), "export_seconds": data.get("export_seconds"),
        "validation_seconds": data.get("validation_seconds"), "weights_bytes": weights,
        "peak_rss_bytes": measured["peak_rss_bytes"],
        "peak_rss_over_weights": round(measured["peak_rss_bytes"] / weights, 2),
        "files": files_of(target),
    }


def serve_once(folder: Path, prompt: str = "Say hello.", max_tokens: int = 8,
               ready_timeout: float = 900) -> dict[str, Any]:
    """`python -m service --model-dir` over a directory linking only `folder`; one /v1/chat/completions answer."""
    work = Path(tempfile.mkdtemp(prefix="export-size-serve-"))
    repo = work / "models"
    repo.mkdir()
    (repo / folder.name).symlink_to(folder.resolve(), target_is_directory=True)
    port = free_port()
    log = work / "server.log"
    start = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "service", "--model-dir", str(repo), "--host", "127.0.0.1",
                                 "--port", str(port), "--log-level", "warning"], cwd=ROOT, stdout=sink,
                                stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, ready_timeout)
        ready = time.perf_counter() - start
        body = json.dumps({"model": folder.name, "messages": [{"role": "user", "content": prompt}],
                           "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        t0 = time.perf_counter()
        with opener.open(request, timeout=300) as r:
            answer = json.loads(r.read())
        return {"ready_seconds": round(ready, 1), "request_seconds": round(time.perf_counter() - t0, 2),
                "finish_reason": answer["choices"][0]["finish_reason"],
                "completion_tokens": answer["usage"]["completion_tokens"],
                "content": answer["choices"][0]["message"]["content"]}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "log": log.read_text()[-2000:]}
    finally:
        stop(proc)
        shutil.rmtree(work, ignore_errors=True)


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| shape | precision | weights | written | export s | validation s | wall s | peak RSS | RSS / weights "
             "| verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        written = ", ".join(f"{k} {gb(v)}" for k, v in r["files"].items() if v > 10_000_000) or "-"
        lines.append(f"| {r['shape']} | {r['precision']} | {gb(r['weights_bytes'])} | {written} "
                     f"| {r['export_seconds']} | {r['validation_seconds']} | {r['wall_seconds']} "
                     f"| {gb(r['peak_rss_bytes'])} | {r['peak_rss_over_weights']} | {r['verdict']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.export_size", description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--precision", default="fp32,int4", help="comma-separated: fp32 (single .onnx), int4 (folder)")
    ap.add_argument("--serve", action="store_true", help="serve each int4 folder and send one chat request")
    ap.add_argument("--samples", type=int, help="validation cases (python -m export --samples; default its 100)")
    ap.add_argument("--no-validate", action="store_true", help="export only (python -m export --no-validate)")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the Hugging Face folders are made once")
    ap.add_argument("--work", type=Path, default=WORK, help="where the exports are written")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in ("fp32", "int4")]
    if unknown or not precisions:
        ap.error(f"--precision: fp32 and/or int4, got {args.precision!r}")
    start = time.perf_counter()
    folder = make_folder(args.shape, args.cache)
    print(f"{folder}: {gb(weight_bytes(folder))} of weights (made or found in {time.perf_counter() - start:.0f} s)",
          flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    extra = (["--samples", str(args.samples)] if args.samples else []) + (["--no-validate"] if args.no_validate else [])
    rows = []
    for precision in precisions:
        row = export_run(folder, precision, args.work, extra)
        if args.serve and precision == "int4" and row["exit_code"] == 0:
            row["serve"] = serve_once(Path(row["output"]))
        rows.append(row)
        print(json.dumps(row, indent=2), flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0 if all(r["exit_code"] == 0 and "error" not in r.get("serve", {}) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
