"""Train a small byte-level MultiMax GPT on text every machine has: the standard library's docstrings.

No download, no data set to ship: the corpus is rebuilt from `sysconfig.get_paths()["stdlib"]` in a
fixed order, so a demo checkpoint can be trained (and re-trained) anywhere in a few CPU minutes.
The caller saves the returned dict (models/checkpoint.py) and sets the thread count.
"""

from __future__ import annotations

import ast
import functools
import math
import sysconfig
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from models.generate import generate
from models.gpt import GPT, GPTConfig
from models.output_function import loss as output_loss
from models.output_function import probabilities as output_probabilities
from models.tokenizer import ByteTokenizer

# Tests and vendored packages are skipped: repetitive, and not part of every install.
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
SAMPLE_PROMPTS = ("Return the", "Create a new", "This module")


def _englishish(doc: str) -> bool:
    """ASCII prose: skips tiny stubs and docstrings that are mostly code, tables or symbols."""
    if len(doc) < 20 or not doc.isascii():
        return False
    letters = sum(c.isalpha() or c == " " for c in doc)
    return letters >= 0.7 * len(doc)


@functools.lru_cache(maxsize=2)  # parsing ~12 MB of source takes seconds
def stdlib_docstring_list(max_bytes: int = 4_000_000) -> tuple[str, ...]:
    """Module, class and function docstrings of the stdlib: sorted files, first occurrence kept, capped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    docs: list[str] = []
    seen: set[str] = set()
    total = 0
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, _DOC_NODES):
                continue
            doc = ast.get_docstring(node, clean=True)
            if doc and doc not in seen and _englishish(doc):
                seen.add(doc)
                docs.append(doc)
                total += len(doc) + 2
                if total >= max_bytes:
                    return tuple(docs)
    return tuple(docs)


def stdlib_docstrings(max_bytes: int = 4_000_000) -> str:
    """The corpus as one text, docstrings separated by a blank line."""
    return "\n\n".join(stdlib_docstring_list(max_bytes))


def split_docs(docs: Sequence[str], heldout_frac: float = 0.05) -> tuple[str, str]:
    """(train, held-out) texts: the LAST `heldout_frac` of the docstrings are held out, whole."""
    n_held = max(1, int(len(docs) * heldout_frac))
    return "\n\n".join(docs[:-n_held]), "\n\n".join(docs[-n_held:])


def _as_tensor(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def _heldout_batches(data: torch.Tensor, seq_len: int, batch_size: int) -> list[torch.Tensor]:
    """Consecutive windows of seq_len + 1 ids sharing their boundary id (every id after the first is predicted
    exactly once), batched, the shorter tail last."""
    n_full = (len(data) - 1) // seq_len
    windows = [data[s:s + seq_len + 1] for s in range(0, n_full * seq_len, seq_len)]
    batches = [torch.stack(windows[i:i + batch_size]) for i in range(0, n_full, batch_size)]
    tail = data[n_full * seq_len:]
    if len(tail) > 1:
        batches.append(tail[None])
    return batches


@torch.no_grad()
def bits_per_byte(model: GPT, data: torch.Tensor, seq_len: int | None = None, batch_size: int = 16) -> float:
    """Mean next-byte cross-entropy (nats) / ln 2 over `data` (1-D ids), in consecutive windows."""
    was_training = model.training
    model.eval()
    total_nats, count = 0.0, 0
    for batch in _heldout_batches(data, seq_len or model.config.block_size, batch_size):
        logits, _ = model(batch[:, :-1])
        total_nats += F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total_nats / max(count, 1) / math.log(2)


@torch.no_grad()
def heldout_output_stats(model: GPT, data: torch.Tensor, seq_len: int | None = None, batch_size: int = 16) -> dict:
    """For a sparse output function: its loss on `data` (nats, models.output_function.loss), the share of bytes it
    gives probability 0, and the mean support size (tokens with p > 0) per position."""
    was_training = model.training
    model.eval()
    name = model.config.output_function
    total, zeros, support, count = 0.0, 0, 0.0, 0
    for batch in _heldout_batches(data, seq_len or model.config.block_size, batch_size):
        logits, _ = model(batch[:, :-1])
        flat, targets = logits.flatten(0, 1).float(), batch[:, 1:].flatten()
        probs = output_probabilities(name, flat)
        total += output_loss(name, flat, targets).item() * len(targets)
        zeros += int((probs.gather(1, targets[:, None]) == 0).sum())
        support += float((probs > 0).sum())
        count += len(targets)
    model.train(was_training)
    n = max(count, 1)
    return {"heldout_loss": total / n, "heldout_zero_prob_share": zeros / n, "heldout_output_support": support / n}


def _lr_at(step: int, steps: int, lr: float, warmup: int, min_ratio: float = 0.1) -> float:
    """Linear warmup, then cosine decay to min_ratio * lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train_text(
    *,
    preset: str = "gpt-micro",
    multimax: Sequence[str] = ("attention", "output"),
    steps: int = 1350,
    seed: int = 0,
    batch_size: int = 16,
    seq_len: int = 128,
    short_seq_len: int | None = 64,
    short_frac: float = 0.8,
    lr: float = 6e-3,
    warmup: int = 50,
    weight_decay: float = 0.1,
    multimax_lr_scale: float = 0.1,
    n_samples: int = 3,
    sample_tokens: int = 120,
    max_eval_bytes: int | None = None,
    docs: Sequence[str] | None = None,
    progress: bool = True,
    **config_overrides: Any,
) -> dict[str, Any]:
    """Train a byte-level GPT on stdlib docstrings; returns config, state_dict, tokenizer, metrics, samples.

    `multimax` names the places that use MultiMax ("attention", "output"; empty for plain softmax).
    The model's context (block_size) is `seq_len` unless overridden. The first `short_frac` of the steps
    use `short_seq_len`-byte windows (same bytes per step) at random position offsets: the model leaves
    the early plateau where it ignores the context about twice as soon, short steps are cheaper (attention
    is quadratic), and the offsets keep every position embedding trained for the switch to full windows.
    `max_eval_bytes` caps the held-out bytes scored (for quick smoke runs; None scores all).
    `docs` replaces the corpus (default: `stdlib_docstring_list()`); its last 5% is held out.
    """
    unknown = set(multimax) - {"attention", "output"}
    if unknown:
        raise ValueError(f"unknown MultiMax place(s) {sorted(unknown)}; use 'attention' and/or 'output'")
    start = time.perf_counter()
    torch.manual_seed(seed)
    tok = ByteTokenizer()
    overrides = dict(
        vocab_size=tok.vocab_size,
        block_size=seq_len,
        multimax_attention="attention" in multimax,
        multimax_output="output" in multimax,
    )
    cfg = GPTConfig.from_preset(preset, **{**overrides, **config_overrides})
    seq_len = min(seq_len, cfg.block_size)
    short_len = min(short_seq_len or seq_len, seq_len)
    short_steps = int(steps * short_frac) if short_len < seq_len else 0
    train_text_, held_text = split_docs(stdlib_docstring_list() if docs is None else docs)
    train_data, held_data = _as_tensor(train_text_), _as_tensor(held_text)[:max_eval_bytes]

    model = GPT(cfg)
    # Decay matrices only. The MultiMax scalars get their own (smaller) learning rate: Adam moves every
    # parameter by about lr per step whatever its gradient, and these 8 numbers reshape every score.
    modulation = [p for n, p in model.named_parameters() if "multimax." in n]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and "multimax." not in n]
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": modulation, "weight_decay": 0.0, "lr_scale": multimax_lr_scale},
    ]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=(0.9, 0.95))
    data_gen = torch.Generator().manual_seed(seed)  # fixed batch order, independent of model RNG use
    train_start = time.perf_counter()
    model.train()
    loss_ema = None
    bar = tqdm(range(steps), disable=not progress, desc=f"train {preset}", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup) * group["lr_scale"]
        length, rows = (short_len, batch_size * seq_len // short_len) if step < short_steps else (seq_len, batch_size)
        idx = torch.randint(0, len(train_data) - length - 1, (rows,), generator=data_gen)
        batch = torch.stack([train_data[i:i + length + 1] for i in idx.tolist()])
        position_ids = None
        if length < seq_len:  # random offsets: short windows still train every position embedding
            offsets = torch.randint(0, seq_len - length + 1, (rows, 1), generator=data_gen)
            position_ids = offsets + torch.arange(length)
        logits, _ = model(batch[:, :-1], position_ids=position_ids)
        loss = output_loss(cfg.output_function, logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    bar.close()
    train_seconds = time.perf_counter() - train_start

    model.eval()
    # A sparse output gives some held-out bytes probability 0 (infinite NLL): its loss and that share instead.
    sparse = cfg.output_function is not None
    heldout = heldout_output_stats(model, held_data, seq_len) if sparse else {}
    heldout_bpb = None if sparse else bits_per_byte(model, held_data, seq_len=seq_len)
    samples = []
    for i, prompt in enumerate(SAMPLE_PROMPTS[:n_samples]):
        room = max(0, seq_len - len(tok.encode(prompt)))
        new = generate(model, tok.encode(prompt), min(sample_tokens, room), temperature=0.8, seed=seed + i)[0]
        samples.append(prompt + tok.decode(new))
    return {
        "config": cfg.to_dict(),
        "state_dict": {k: v.detach() for k, v in model.state_dict().items()},  # tied tensors stay shared
        "tokenizer": tok.to_dict(),
        "metrics": {
            "heldout_bpb": heldout_bpb,
            **heldout,
            "train_loss": loss_ema,  # smoothed (EMA) training loss in nats (the output function's own loss)
            "train_bpb": None if loss_ema is None or sparse else loss_ema / math.log(2),
            "steps": steps,
            "seconds": time.perf_counter() - start,
            "train_seconds": train_seconds,
            "train_bytes": len(train_data),
            "heldout_bytes": len(held_data),
            "seq_len": seq_len,
            "short_seq_len": short_len,
            "short_steps": short_steps,
            "batch_size": batch_size,
        },
        "samples": samples,
    }
