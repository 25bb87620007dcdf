"""Decode speed of a Llama of real shape in three engines, side by side, same threads, interleaved rounds:

    server     `python -m service --model-dir` on 127.0.0.1 serving the project's own export of the model
               (`python -m export HF -o DIR`: fp32, and `--int4`: every weight MatMul as MatMulNBits, 4-bit
               symmetric blocks of 32), N concurrent streamed /v1/completions (token-id prompts, greedy, ignore_eos,
               fixed max_tokens)
    genai      onnxruntime-genai's own loop on the same exported folder: `og.Generator`, one batched Generator for
               N streams (every prompt is as long and asks as many tokens, all sent at once: a static batch's best
               case, which no server meets with requests that come and go)
    genai-engine  onnxruntime-genai's own serving loop on that folder: `og.Engine` (its continuous batching), the N
               requests submitted at once; run only where it gives og.Generator's greedy tokens for prompts of
               different lengths batched together (else skipped, with the reason)
    llama.cpp  `llama-server --parallel N --cont-batching` on 127.0.0.1 serving a GGUF made from the same Hugging
               Face folder by llama.cpp's own convert_hf_to_gguf.py and llama-quantize: f32 against our fp32,
               q4_0 (`--pure`: every matrix 4-bit symmetric blocks of 32, as ours) against our int4, and q8_0;
               weights read into memory (no mmap), the same requests read by the same client as the server's

The model: transformers' LlamaForCausalLM with random weights (seeded), 12 layers, hidden 768, 12 heads and 4
key/value heads (GQA), intermediate 2048 (Llama's 8/3 x hidden), untied embeddings (as Llama 2), context 2048,
and a 32,000-token tokenizer in Llama 2's layout (<unk> <s> </s>, 256 byte-fallback tokens, then BPE merges,
SentencePiece-style spaces) trained with `tokenizers` on the standard library's docstrings: llama.cpp's converter
reads it as Llama 2's (no pre-tokenizer hash involved). About 125M parameters. `--seglu`: the server and genai run
the folder with PaddleFleet's SegLU head (the paper's Table 8 values, `multimax_modules: ["lm_head"]`); llama.cpp
cannot, and runs the plain model.

    python -m benchmarks.engines [--work DIR] [--engines server,genai,llama.cpp] [--precisions fp32,int4,q8_0]
                                 [--streams 1,4,16] [--rounds 9] [--max-tokens 128] [--threads 2]
                                 [--llama-cpp DIR] [--seglu] [-o report.json]

Everything built (the folder, the exports, the GGUFs) is kept under --work, keyed by the shape and seed, and reused
by the next run (an export that other export code made is made anew). llama.cpp runs only when found: --llama-cpp
DIR (or $LLAMA_CPP_DIR) holding bin/llama-server, bin/llama-quantize and convert_hf_to_gguf.py (with its gguf-py
and conversion/), or llama-server on PATH with the converter in the folder above its bin/; its converter needs
`sentencepiece` installed. Prompts are 32-token windows of the tokenized corpus (a BOS first), the same ids to every
engine.

Each figure is output tokens/s over all streams (tokens asked for / wall time from the first send to the last
token), time to first token p50 (from each request's send) and inter-token latency p50/p99 (gaps between a stream's
SSE events or, for genai, its decode steps). The ratios server/genai, server/genai-engine and server/llama.cpp
(same precision) are medians of per-round ratios; each round runs every engine once per stream count, in alternating
order, each after a pause of 0.25 s (genai_vs_server.SETTLE_S: onnxruntime-genai's spinning threads slowed the engine
after it).
Exit status 2 with one line for bad input; loopback only.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import genai_vs_server as gvs
from benchmarks.server import ROOT, start, stop
from service.engine.folder_export import code_identity

ENGINES = ("server", "genai", "genai-engine", "llama.cpp")
GENAI = ("genai", "genai-engine")  # in-process onnxruntime-genai loops over the server's own export
PRECISIONS = ("fp32", "int4", "q8_0")
# our precision -> llama.cpp's type for it (q8_0 has no counterpart in our export: llama.cpp's alone)
GGUF_TYPE = {"fp32": "f32", "int4": "q4_0", "q8_0": "q8_0"}
SPECIALS = ("<unk>", "<s>", "</s>")  # Llama 2's ids 0, 1, 2
BOS, EOS = 1, 2
MADE_BY = ".made-by"  # inside an export folder: the digest of the export code that made it
SEGLU_ROW = 5  # the paper's Table 8, last row: the SegLU head's (ranges, ts)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class BadInput(Exception):
    """Said on one line, exit status 2."""


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    kv_heads: int = 4
    intermediate: int = 2048  # Llama's SwiGLU width: 8/3 x hidden (rounded to 256) is 2048 at 768
    vocab: int = 32000
    context: int = 2048
    tied: bool = False  # Llama 2's embeddings are untied
    corpus_bytes: int = 8_000_000  # tokenizer training text (the stdlib's docstrings: about 1.7 MB in all)

    def key(self) -> str:
        return (f"llama-l{self.layers}-h{self.hidden}-a{self.heads}-kv{self.kv_heads}-i{self.intermediate}"
                f"-v{self.vocab}-c{self.context}-{'tied' if self.tied else 'untied'}")


# ---- the model: a tokenizer trained here, transformers' random Llama, PaddleFleet's SegLU tensors ---------------


def corpus(shape: Shape) -> tuple[str, ...]:
    from models.training.text import stdlib_docstring_list

    return stdlib_docstring_list(shape.corpus_bytes)


def train_tokenizer(out: Path, shape: Shape) -> None:
    """A BPE in Llama 2's tokenizer.json layout (what transformers writes for a Llama 2 folder), trained on the
    corpus: split at spaces as SentencePiece trains, byte fallback to <0xNN>, saved by PreTrainedTokenizerFast."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    # a capped alphabet: rarer characters fall back to bytes, as SentencePiece's character coverage does
    trainer = trainers.BpeTrainer(vocab_size=shape.vocab, special_tokens=[*SPECIALS, *alphabet],
                                  limit_alphabet=min(250, shape.vocab // 4), show_progress=False)
    tok.train_from_iterator(corpus(shape), trainer)
    if tok.get_vocab_size() != shape.vocab:
        raise SystemExit(f"error: the corpus gave a {tok.get_vocab_size()}-token vocabulary, not {shape.vocab}")
    data = json.loads(tok.to_str())  # the <0xNN> pieces are vocabulary (as in Llama 2's file), not added tokens
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in SPECIALS]
    tok = Tokenizer.from_str(json.dumps(data))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.pre_tokenizer = None
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                unk_token="<unk>")
    fast.save_pretrained(out)
    path = out / "tokenizer_config.json"  # what a Llama 2 folder says (onnxruntime-genai reads it by this class)
    config = json.loads(path.read_text())
    config.update(tokenizer_class="LlamaTokenizer", add_bos_token=True, add_eos_token=False)
    path.write_text(json.dumps(config, indent=2))


def build_hf(out: Path, shape: Shape, seed: int, threads: int) -> None:
    """The plain Llama folder: the tokenizer, then transformers' own random initialisation (seeded)."""
    import torch
    import transformers

    train_tokenizer(out, shape)
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.context, rms_norm_eps=1e-5, bos_token_id=BOS,  # RoPE theta: 10,000
        eos_token_id=EOS, tie_word_embeddings=shape.tied)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(out)
    finally:
        torch.set_num_threads(before)


def add_seglu(plain: Path, out: Path) -> None:
    """`plain` with PaddleFleet's SegLU head: two [4] tensors beside lm_head.weight and multimax_modules."""
    import torch
    from safetensors.torch import load_file, save_file

    from models.multimax import PAPER_TABLE_8, paper_row_to_params

    shutil.copytree(plain, out, dirs_exist_ok=True)
    ranges, ts = paper_row_to_params(PAPER_TABLE_8[SEGLU_ROW])
    path = out / "model.safetensors"
    tensors = load_file(path) | {"lm_head.multimax_ranges": torch.tensor(ranges),
                                 "lm_head.multimax_ts": torch.tensor(ts)}
    save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config | {"multimax_modules": ["lm_head"]}, indent=2))


def export_folder(hf: Path, out: Path, precision: str, threads: int, samples: int) -> None:
    """`python -m export HF -o OUT` (fp32, or --int4), validated on `samples` cases. A Llama 2 tokenizer's
    validation fails one way, known (tests/conformance/matrix.py): onnxruntime-genai's own detokenizer keeps the
    leading space that tokenizer.json's Strip removes. The benchmark hands onnxruntime-genai token ids, never text,
    so that failure is accepted and every other one is not."""
    cmd = [sys.executable, "-m", "export", str(hf), "-o", str(out), "--quiet", "--threads", str(threads),
           "--samples", str(samples), *(["--int4"] if precision == "int4" else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    report = out / "validation.json"
    problems = json.loads(report.read_text()).get("problems", []) if report.is_file() else None
    if done.returncode == 0 or (done.returncode == 1 and problems is not None
                                and all(p.startswith("tokenizer:") for p in problems)):
        return
    raise SystemExit(f"error: the export ({precision}) failed ({done.returncode}): "
                     f"{(done.stdout + done.stderr).strip()[-600:]}")


# ---- llama.cpp ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCpp:
    server: Path
    quantize: Path
    converter: Path

    def load_args(self) -> list[str]:
        """Weights read into memory at start (no mmap: no page faults inside the first round), in this build's
        spelling (`--load-mode none` replaced `--no-mmap`)."""
        text = subprocess.run([str(self.server), "--help"], capture_output=True, text=True).stdout
        return ["--load-mode", "none"] if "--load-mode" in text else ["--no-mmap"] if "--no-mmap" in text else []

    def version(self) -> str:
        out = subprocess.run([str(self.server), "--version"], capture_output=True, text=True)
        return next((line for line in (out.stdout + out.stderr).splitlines() if line.startswith("version")), "?")


def _in_dir(folder: Path) -> LlamaCpp | None:
    for server in (folder / "bin" / "llama-server", folder / "llama-server"):
        quantize = server.parent / "llama-quantize"
        converter = folder / "convert_hf_to_gguf.py"
        if server.is_file() and quantize.is_file() and converter.is_file():
            return LlamaCpp(server, quantize, converter)
    return None


def find_llama_cpp(folder: Path | None) -> tuple[LlamaCpp | None, str]:
    """llama.cpp from --llama-cpp DIR, $LLAMA_CPP_DIR, or llama-server on PATH (the converter in the folder above
    its bin/, or $LLAMA_CPP_CONVERTER): (found, '') or (None, why not). A folder named but incomplete is BadInput."""
    named = folder or (Path(os.environ["LLAMA_CPP_DIR"]) if os.environ.get("LLAMA_CPP_DIR") else None)
    if named is not None:
        found = _in_dir(named)
        if found is None:
            raise BadInput(f"{named} holds no bin/llama-server, bin/llama-quantize and convert_hf_to_gguf.py")
        return found, ""
    which = shutil.which("llama-server")
    if which is None:
        return None, "no llama-server (give --llama-cpp DIR, $LLAMA_CPP_DIR or put llama-server on PATH)"
    server = Path(which).resolve()
    quantize = Path(shutil.which("llama-quantize") or server.parent / "llama-quantize")
    converter = Path(os.environ.get("LLAMA_CPP_CONVERTER") or server.parent.parent / "convert_hf_to_gguf.py")
    if not quantize.is_file() or not converter.is_file():
        return None, f"llama-server is on PATH but not llama-quantize and convert_hf_to_gguf.py ({converter})"
    return LlamaCpp(server, quantize, converter), ""


def converter_missing() -> str:
    """Why llama.cpp's converter cannot run in this interpreter ('' if it can): it imports sentencepiece before
    it looks for a tokenizer.model, and transformers and torch."""
    missing = [m for m in ("sentencepiece", "transformers", "torch") if importlib.util.find_spec(m) is None]
    return f"llama.cpp's convert_hf_to_gguf.py needs {', '.join(missing)} (pip install)" if missing else ""


def make_gguf(llama: LlamaCpp, hf: Path, f32: Path, out: Path, kind: str, threads: int) -> None:
    """f32 by the converter from the folder; q8_0 / q4_0 by llama-quantize from the f32 file (`--pure`: no mix of
    types, the output matrix included, as our int4 quantizes every weight MatMul)."""
    if kind == "f32":
        cmd = [sys.executable, str(llama.converter), str(hf), "--outfile", str(out), "--outtype", "f32"]
    else:
        cmd = [str(llama.quantize), "--pure", str(f32), str(out), kind.upper(), str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.is_file():
        raise SystemExit(f"error: making the {kind} GGUF failed ({done.returncode}): "
                         f"{(done.stdout + done.stderr).strip()[-600:]}")


@contextlib.contextmanager
def llama_server(llama: LlamaCpp, gguf: Path, parallel: int, threads: int, slot_context: int,
                 log: Path) -> Iterator[str]:
    """`llama-server --parallel N --cont-batching` on a free loopback port, each slot `slot_context` tokens, its
    output in `log` (a file: a pipe nobody reads would stall it). Yields the URL."""
    args = ["-m", str(gguf), "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads), "--parallel",
            str(parallel), "--cont-batching", "-c", str(parallel * slot_context), "--no-webui", *llama.load_args()]
    with open(log, "w+") as out:
        proc, url = start(*args, command=[str(llama.server)], output=out, ready_timeout=300, ready_path="/health")
        try:
            yield url
        finally:
            stop(proc)


# ---- what is built once and kept ---------------------------------------------------------------------------


def _made(path: Path, make: Callable[[Path], None], made_by: str = "") -> Path:
    """`path`, made by `make(tmp)` beside it and renamed into place when it is missing: a run stopped halfway
    leaves no half-made folder that the next run would take for a made one. `made_by` (a folder's): what made it
    (the export code's digest), kept in MADE_BY inside; a folder another code made is made anew."""
    stamp = path / MADE_BY
    if path.exists() and (not made_by or (stamp.is_file() and stamp.read_text() == made_by)):
        return path
    if path.is_dir():
        print(f"{path} was made by other export code: making it anew", flush=True)
        shutil.rmtree(path)
    tmp = path.with_name(path.name + ".partial")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    elif tmp.exists():
        tmp.unlink()
    print(f"making {path}", flush=True)
    t0 = time.perf_counter()
    make(tmp)
    if made_by:
        (tmp / MADE_BY).write_text(made_by)
    tmp.rename(path)
    print(f"  {time.perf_counter() - t0:.1f} s", flush=True)
    return path


def _export_into(hf: Path, precision: str, threads: int, samples: int, out: Path) -> None:
    export_folder(hf, out, precision, threads, samples)


def _gguf_into(llama: LlamaCpp, hf: Path, f32: Path | None, kind: str, threads: int, out: Path) -> None:
    make_gguf(llama, hf, f32 or out, out, kind, threads)


@dataclass
class Built:
    hf: Path  # the plain folder (llama.cpp's)
    served: Path  # the folder exported for the server and genai (the plain one, or with the SegLU head)
    exports: dict[str, Path]  # precision -> onnxruntime-genai folder
    ggufs: dict[str, Path]  # precision -> GGUF file


def build(work: Path, shape: Shape, seed: int, seglu: bool, precisions: list[str], ours: bool,
          llama: LlamaCpp | None, threads: int, samples: int) -> Built:
    root = work / shape.key() / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    hf = _made(root / "hf", lambda p: build_hf(p, shape, seed, threads))
    served = _made(root / "hf-seglu", lambda p: add_seglu(hf, p)) if seglu else hf
    exports: dict[str, Path] = {}
    if ours:
        for prec in (p for p in precisions if p in ("fp32", "int4")):
            name = f"onnx-{'seglu-' if seglu else ''}{prec}"
            exports[prec] = _made(root / name, partial(_export_into, served, prec, threads, samples),
                                  made_by=code_identity())
    ggufs: dict[str, Path] = {}
    if llama is not None:
        f32 = _made(root / "model-f32.gguf", partial(_gguf_into, llama, hf, None, "f32", threads))
        for prec in precisions:
            kind = GGUF_TYPE[prec]
            ggufs[prec] = f32 if kind == "f32" else _made(root / f"model-{kind}.gguf",
                                                          partial(_gguf_into, llama, hf, f32, kind, threads))
    return Built(hf, served, exports, ggufs)


# ---- the rounds -------------------------------------------------------------------------------------------------


def corpus_ids(hf: Path, shape: Shape) -> list[int]:
    """The corpus tokenized by the folder's tokenizer (no specials): where prompts are cut from."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    docs = list(corpus(shape))[:2000]
    return [i for enc in tok.encode_batch(docs, add_special_tokens=False) for i in enc.ids]


def prompts(ids: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    """n prompts of `length` ids: a BOS, then a window of the tokenized corpus at a seeded offset."""
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, n).tolist()
    return [[BOS, *ids[s:s + length - 1]] for s in starts]


def complete(base: str, name: str, prompt: list[int], max_tokens: int) -> str:
    """A non-streamed greedy completion's text (the same body to both servers; llama-server ignores the name)."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with _NO_PROXY.open(req, timeout=600) as r:
        return str(json.loads(r.read())["choices"][0]["text"])


def _genai(model: Any, requests: list[gvs.Request], streams: int, engine: bool = False) -> gvs.Run:
    loop = gvs.genai_engine if engine else gvs.genai_generator
    return gvs.static_batches(partial(loop, model), requests, streams)[0]


def label(engine: str, precision: str) -> str:
    return f"{engine} {GGUF_TYPE[precision] if engine == 'llama.cpp' else precision}"


def ways_of(engines: list[str], precisions: list[str]) -> list[tuple[str, str]]:
    """(engine, precision) pairs measured: q8_0 is llama.cpp's alone."""
    return [(e, p) for p in precisions for e in engines if e == "llama.cpp" or p != "q8_0"]


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit status 2 (argparse adds its usage)
        raise BadInput(message)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = Parser(prog="python -m benchmarks.engines", description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "multimax-engines",
                    help="where the folder, exports and GGUFs are kept and reused (default: $TMPDIR/multimax-engines)")
    ap.add_argument("--engines", help=f"comma-separated, of {','.join(ENGINES)} (default: all; llama.cpp where found)")
    ap.add_argument("--precisions", default=",".join(PRECISIONS),
                    help="fp32 (llama.cpp f32), int4 (llama.cpp q4_0), q8_0 (llama.cpp only) (default: all)")
    ap.add_argument("--streams", default="1,4,16", help="concurrent streams, comma-separated (default 1,4,16)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--max-tokens", type=int, default=128, help="generated tokens a request (default 128)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens, a BOS first (default 32)")
    ap.add_argument("--threads", type=int, default=2, help="threads of every engine (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    ap.add_argument("--seglu", action="store_true", help="the server and genai run the model with a SegLU head")
    ap.add_argument("--llama-cpp", type=Path, help="a folder with bin/llama-server, bin/llama-quantize and "
                                                   "convert_hf_to_gguf.py (default: $LLAMA_CPP_DIR, or PATH)")
    ap.add_argument("--export-samples", type=int, default=8, help="cases the export validates (default 8)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `python -m service` option")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server option")
    ap.add_argument("--build-only", action="store_true", help="make what --work lacks, then stop")
    ap.add_argument("-o", "--output", type=Path, help="write the report as JSON here too")
    return ap.parse_args(argv)


def _list(text: str, what: str, allowed: tuple[str, ...]) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise BadInput(f"{what}: {','.join(bad) or repr(text)} not of {','.join(allowed)}")
    return list(dict.fromkeys(items))


def main(argv: list[str] | None = None, shape: Shape | None = None) -> int:
    """The command; `shape` other than the default is the tests' tiny model."""
    try:
        return _main(argv, shape or Shape())
    except BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None, shape: Shape) -> int:
    t_start = time.perf_counter()
    load_before = os.getloadavg()
    args = parse(argv)
    try:
        counts = [int(s) for s in args.streams.split(",")]
    except ValueError:
        raise BadInput(f"--streams: not a comma-separated list of integers: {args.streams!r}") from None
    if min(counts) < 1 or args.rounds < 1 or args.threads < 1 or args.max_tokens < 2 or args.prompt_len < 2 \
            or args.export_samples < 1:
        raise BadInput("--streams, --rounds, --threads, --export-samples must be >= 1, --max-tokens and "
                       "--prompt-len >= 2")
    if args.prompt_len + args.max_tokens > shape.context:
        raise BadInput(f"--prompt-len + --max-tokens = {args.prompt_len + args.max_tokens} is over the model's "
                       f"context of {shape.context}")
    if args.work.exists() and not args.work.is_dir():
        raise BadInput(f"--work {args.work} is not a folder")
    named = args.engines is not None
    engines = _list(args.engines or ",".join(ENGINES), "--engines", ENGINES)
    precisions = _list(args.precisions, "--precisions", PRECISIONS)
    skipped: dict[str, str] = {}
    llama: LlamaCpp | None = None
    if "llama.cpp" in engines:
        llama, why = find_llama_cpp(args.llama_cpp)
        why = why or converter_missing()
        if why:
            if named or args.llama_cpp is not None:
                raise BadInput(f"llama.cpp: {why}")
            llama = None
            skipped["llama.cpp"] = why
            engines.remove("llama.cpp")
            print(f"llama.cpp skipped: {why}", flush=True)
    ways = ways_of(engines, precisions)
    if not ways:
        raise BadInput(f"nothing to measure: --engines {','.join(engines)} with --precisions {args.precisions}")

    built = build(args.work, shape, args.seed, args.seglu, precisions, bool({"server", *GENAI} & set(engines)),
                  llama, args.threads, args.export_samples)
    build_seconds = round(time.perf_counter() - t_start, 1)
    if args.build_only:
        print(f"built in {build_seconds} s: {built.hf.parent}")
        return 0
    ids = corpus_ids(built.hf, shape)
    slot_context = min(shape.context, args.prompt_len + args.max_tokens + 16)
    results: dict[str, dict[int, list[gvs.Run]]] = {label(*w): {} for w in ways}
    ratios: dict[str, dict[int, list[float]]] = {}
    checks: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        servers = {p: stack.enter_context(gvs.server(built.exports[p], args.threads, [
            "--log-level", "warning", "--access-log", "false", *args.server_arg]))
            for p in precisions if ("server", p) in ways}
        models = {p: gvs.genai_model(built.exports[p], args.threads) for p in precisions
                  if any((g, p) in ways for g in GENAI)}
        for prec in [p for p in precisions if ("genai-engine", p) in ways]:
            usable, why = gvs.engine_is_correct(models[prec], shape.vocab, 16)
            print(f"og.Engine, {prec}: {why}", flush=True)
            if not usable:
                skipped[f"genai-engine {prec}"] = why
                ways.remove(("genai-engine", prec))
                del results[label("genai-engine", prec)]
        llamas: dict[tuple[str, int], str] = {}

        def llama_url(prec: str, n: int) -> str:
            """llama-server for this GGUF with N slots, started at first use and kept to the end (warmed)."""
            if (prec, n) not in llamas:
                assert llama is not None
                log = args.work / shape.key() / f"seed{args.seed}" / f"llama-server-{GGUF_TYPE[prec]}-{n}.log"
                llamas[prec, n] = url = stack.enter_context(llama_server(
                    llama, built.ggufs[prec], n, args.threads, slot_context, log))
                gvs.server_run(url, "model", [(prompts(ids, 1, args.prompt_len, 99_999)[0], 8)], 1)
            return llamas[prec, n]

        # Warm-up, and a look at whether the engines compute the same model: greedy text of one prompt.
        p = prompts(ids, 1, args.prompt_len, 12345)[0]
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(built.served / "tokenizer.json"))
        for prec in precisions:
            texts: dict[str, str] = {}
            if prec in models:
                texts["genai"] = tok.decode(gvs.genai_generator(models[prec], [p], 16)[1][0])
            if prec in servers:
                texts["server"] = complete(servers[prec], built.exports[prec].name, p, 16)
                gvs.server_run(servers[prec], built.exports[prec].name, [(p, 8)], 1)
            if ("llama.cpp", prec) in ways:
                texts["llama.cpp"] = complete(llama_url(prec, counts[0]), "model", p, 16)
            if len(texts) > 1:
                first, *rest = texts
                checks[prec] = {f"{first} == {k}": texts[first].strip() == texts[k].strip() for k in rest}
                checks[prec] |= {f"{first} / {k} common characters": _common(texts[first].strip(), texts[k].strip())
                                 for k in rest}
                print(f"greedy text of 16 tokens, {prec}: " + ", ".join(f"{k} {v}" for k, v in checks[prec].items()
                                                                          if "==" in k), flush=True)
        for rnd in range(args.rounds):
            for n in counts:
                requests = [(q, args.max_tokens) for q in prompts(ids, n, args.prompt_len, 1000 * rnd + n)]
                calls: dict[str, Callable[[], gvs.Run]] = {}
                for engine, prec in ways:
                    if engine == "server":
                        calls[label(engine, prec)] = partial(gvs.server_run, servers[prec],
                                                             built.exports[prec].name, requests, n)
                    elif engine in GENAI:
                        calls[label(engine, prec)] = partial(_genai, models[prec], requests, n, engine != "genai")
                    else:
                        url = llama_url(prec, n)  # started (and warmed) outside the timed calls
                        calls[label(engine, prec)] = partial(gvs.server_run, url, "model", requests, n)
                order = list(calls) if rnd % 2 == 0 else list(reversed(calls))
                got = {k: gvs.settled(calls[k]) for k in order}
                for k, run in got.items():
                    results[k].setdefault(n, []).append(run)
                for prec in precisions:
                    ours = got.get(label("server", prec))
                    for other in (*GENAI, "llama.cpp"):
                        theirs = got.get(label(other, prec))
                        if ours is not None and theirs is not None:
                            key = f"server/{other} {prec}"
                            ratios.setdefault(key, {}).setdefault(n, []).append(ours.tok_s / theirs.tok_s)
                print(f"round {rnd + 1} streams {n}: " + ", ".join(f"{k} {r.tok_s:.1f} tok/s" for k, r in
                                                                     got.items()), flush=True)
    load_after = os.getloadavg()
    report: dict[str, Any] = {
        "shape": asdict(shape) | {"key": shape.key()}, "seed": args.seed, "seglu": args.seglu,
        "threads": args.threads, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rounds": args.rounds,
        "streams": counts, "engines": [label(*w) for w in ways], "skipped": skipped,
        "llama_cpp": None if llama is None else {"server": str(llama.server), "version": llama.version()},
        "work": str(args.work.resolve() / shape.key() / f"seed{args.seed}"), "greedy_checks": checks,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "results": {k: {n: gvs.summary(v) for n, v in d.items()} for k, d in results.items()},
        "ratios": {k: {n: statistics.median(v) for n, v in d.items()} for k, d in ratios.items()},
        "build_seconds": build_seconds, "seconds": round(time.perf_counter() - t_start, 1)}
    print_report(report)
    if args.output:
        args.output.write_text(json.dumps(report, indent=1))
    return 0


def print_report(report: dict[str, Any]) -> None:
    shape = report["shape"]
    before, after = report["load_average_before"], report["load_average_after"]
    print(f"\n{shape['key']}{' (server, genai: SegLU head)' if report['seglu'] else ''}: {report['threads']} "
          f"threads, prompt {report['prompt_len']}, {report['max_tokens']} tokens a stream, median of "
          f"{report['rounds']} rounds; load average {before[0]:.2f} before, {after[0]:.2f} after; "
          f"{report['seconds']:.0f} s ({report['build_seconds']:.0f} s of it making what --work lacked)")
    print("| streams | engine | tok/s | TTFT p50 ms | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|")
    for n in report["streams"]:
        for k in report["engines"]:
            s = report["results"][k][n]
            print(f"| {n} | {k} | {s['tok_s']:.1f} | {s['ttft_p50_ms']:.1f} | {s['itl_p50_ms']:.2f} / "
                  f"{s['itl_p99_ms']:.2f} |")
    if report["ratios"]:
        keys = list(report["ratios"])
        print("\n| streams | " + " | ".join(keys) + " |")
        print("|---|" + "---|" * len(keys))
        for n in report["streams"]:
            print(f"| {n} | " + " | ".join(f"{report['ratios'][k][n]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    sys.exit(main())
