"""The demo models: what they are, how they are rebuilt, and a short demonstration with them.

They ship in `models/demo/` (a few MB, produced by `python -m models.training train demos`), so a fresh
machine reaches a real prediction without training; the same command rebuilds them bit for bit
from the seed on the same software versions.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from models.checkpoint import Checkpoint, save_checkpoint
from models.demo import DEMO_DIR, DEMO_FILES, LLM_DEMO, TEXT_MULTIMAX, VISION_MULTIMAX, VISION_SOFTMAX

TEXT_PROMPTS = ("Return the", "If the file", "This module provides")


def vision_checkpoint(result: dict[str, Any]) -> Checkpoint:
    """What `train_vision` returned, as a checkpoint."""
    return Checkpoint(
        "deit",
        result["config"],
        result["state_dict"],
        labels=result["labels"],
        preprocess=result["preprocess"],
        meta={"metrics": result["metrics"],
              "trained_on": "scikit-learn digits (upscaled to 32x32) and digits drawn from stroke paths"},
    )


def text_checkpoint(result: dict[str, Any]) -> Checkpoint:
    """What `train_text` returned, as a checkpoint (its samples kept in meta)."""
    return Checkpoint(
        "gpt",
        result["config"],
        result["state_dict"],
        tokenizer=result["tokenizer"],
        meta={
            "metrics": result["metrics"],
            "samples": result["samples"],
            "trained_on": "docstrings of the Python standard library",
        },
    )


def build_demos(out_dir: Path, seed: int = 0, progress: bool = True,
                kinds: tuple[str, ...] = ("vision", "text", "llm")) -> dict[str, Any]:
    """Train the demo models of `kinds` and write them into `out_dir`, with report.json (entries of the kinds not
    retrained are kept)."""
    from models.training.fingerprint import training_fingerprint
    from models.training.text import train_text
    from models.training.vision import train_vision

    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.json"
    report: dict[str, Any] = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report |= {"seed": seed, "torch": torch.__version__}
    report.setdefault("fingerprint", {})
    report.setdefault("threads", {})
    if "vision" in kinds:
        for name, places in ((VISION_MULTIMAX, ("attention", "output")), (VISION_SOFTMAX, ())):
            result = train_vision(multimax=places, seed=seed, progress=progress)
            save_checkpoint(vision_checkpoint(result), out_dir / name)
            report[name] = result["metrics"]
    if "text" in kinds:
        result = train_text(seed=seed, progress=progress)
        save_checkpoint(text_checkpoint(result), out_dir / TEXT_MULTIMAX)
        report[TEXT_MULTIMAX] = result["metrics"] | {"samples": result["samples"]}
    if "llm" in kinds:
        from models.training.llm import save_llm, train_llm

        llm = train_llm(seed=seed, progress=progress)
        save_llm(llm, out_dir / LLM_DEMO)
        report[LLM_DEMO] = llm["metrics"] | {"samples_greedy": llm["samples_greedy"]}
    for kind in kinds:
        report["fingerprint"][kind] = training_fingerprint(kind)
        report["threads"][kind] = torch.get_num_threads()  # float sums, hence bits, depend on the thread count
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def ensure_demos(demo_dir: Path = DEMO_DIR, rebuild: bool = False) -> Path:
    if rebuild or not all((demo_dir / f).is_file() for f in DEMO_FILES):
        print(f"building the demo models in {demo_dir} (a few minutes on 2 cores)")
        build_demos(demo_dir)
    return demo_dir


def run_demo(demo_dir: Path = DEMO_DIR, rebuild: bool = False) -> int:
    from models.checkpoint import load
    from models.deit import DeiT
    from models.generate import generate
    from models.gpt import GPT
    from models.tokenizer import ByteTokenizer
    from models.training.drawn_digits import TEST_SIZE, drawn_accuracy
    from models.training.vision import accuracy, digits_split, normalize

    ensure_demos(demo_dir, rebuild)
    _, _, x_test, y_test = digits_split(seed=0)
    print(f"image classification: {len(y_test)} held-out digits (scikit-learn, upscaled to 32x32), "
          f"{TEST_SIZE} drawn in a paint program")
    for name in (VISION_MULTIMAX, VISION_SOFTMAX):
        model, ckpt, _ = load(demo_dir / name)
        assert isinstance(model, DeiT) and ckpt.labels is not None
        start = time.perf_counter()
        acc = accuracy(model, x_test, y_test)
        ms = (time.perf_counter() - start) * 1000 / len(y_test)
        with torch.no_grad():
            probs = torch.softmax(model(normalize(x_test[:5])), -1)
        top = [f"{ckpt.labels[int(i)]}({float(p):.2f})" for p, i in zip(*probs.max(-1), strict=True)]
        drawn = drawn_accuracy(model)
        print(f"  {name:<20} accuracy {acc:.2%}  drawn {drawn:.2%}  ({ms:.2f} ms/image)  first 5: {' '.join(top)}")
    print(f"  true labels of the first 5: {' '.join(str(int(y)) for y in y_test[:5])}")

    model, ckpt, _ = load(demo_dir / TEXT_MULTIMAX)
    assert isinstance(model, GPT)
    tok = ByteTokenizer.from_dict(ckpt.tokenizer or {})
    bpb = ckpt.meta.get("metrics", {}).get("heldout_bpb")
    print(f"\ntext generation: {TEXT_MULTIMAX} (held-out {bpb:.3f} bits/byte), temperature 0.8, seed 0")
    for prompt in TEXT_PROMPTS:
        out = generate(model, [tok.encode(prompt)], max_new_tokens=60, temperature=0.8, top_k=40, seed=0,
                       tokenizer=tok, eos_id=tok.eos_id)[0]
        print(f"  {prompt!r} -> {tok.decode(out)!r}")

    from models.hf_folder import load_folder

    if not (demo_dir / LLM_DEMO).is_dir():
        print(f"\n(no demo LLM in {demo_dir / LLM_DEMO}: python -m models.training train demos --only llm --threads 2)")
        return 0
    llm, folder = load_folder(demo_dir / LLM_DEMO)
    loss = json.loads((demo_dir / "report.json").read_text()).get(LLM_DEMO, {}).get("heldout_loss")
    print(f"\ntext generation: {LLM_DEMO} (Llama with a SegLU head, BPE tokenizer; held-out {loss:.3f} nats/token), "
          "greedy")
    hf_tok = folder.tokenizer
    for prompt in TEXT_PROMPTS:
        out = generate(llm, [hf_tok.encode(prompt)], max_new_tokens=24, temperature=0.0, tokenizer=hf_tok,
                       eos_id=hf_tok.eos_ids)[0]
        print(f"  {prompt!r} -> {hf_tok.decode(out)!r}")
    return 0
