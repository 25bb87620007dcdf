"""Train the demo LLM: a small Llama with a SegLU head and a byte-level BPE tokenizer, on the stdlib's docstrings.

The corpus is the byte-level text demo's (models.training.text: the docstrings of this Python's standard
library, rebuilt in a fixed order, nothing downloaded); the tokenizer is trained on the same training split with
`tokenizers`, the model is `models.llama.Llama` with `multimax_output` (PaddleFleet's SegLU on the LM-head
logits). The result is written by `models.training.llm_folder` in the Hugging Face layout, so transformers,
onnxruntime-genai's builder and this project all read the same folder. Same command, same thread count, same
software: same bytes (seeded model init and batch order; the BPE trainer is deterministic).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from models.generate import generate
from models.llama import Llama, LlamaConfig
from models.multimax import PAPER_TABLE_8, paper_params
from models.training.text import _lr_at, stdlib_docstring_list

# ChatML-style specials: <|endoftext|> separates documents (and pads), <|im_start|>/<|im_end|> frame chat turns.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
HELDOUT_FRAC = 0.05
SAMPLE_PROMPTS = ("Return the", "If the file", "This module provides")
# The demo's shape: 4 layers, 128 wide, 4 query / 2 key-value heads (grouped-query attention as in Llama 3),
# tied embeddings (about 1.3M parameters, 5 MB in fp32), a context of 256 tokens.
DEMO_SHAPE: dict[str, Any] = dict(flavor="llama", n_layer=4, n_head=4, n_local_heads=2, dim=128,
                                  intermediate_size=384, block_size=256, norm_eps=1e-5, rope_base=10000.0,
                                  tie_word_embeddings=True)


def train_tokenizer(texts: Sequence[str], vocab_size: int = 4096) -> Tokenizer:
    """GPT-2-style byte-level BPE (every byte representable: no unknown token), the specials first (ids 0-2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_corpus(tok: Tokenizer, docs: Sequence[str]) -> torch.Tensor:
    """All documents' ids, each followed by <|endoftext|> (the model learns where a docstring ends)."""
    eot = tok.token_to_id(ENDOFTEXT)
    assert eot is not None, "train_tokenizer adds the specials"
    ids: list[int] = []
    for enc in tok.encode_batch(list(docs)):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def heldout_loss(model: Llama, data: torch.Tensor, seq_len: int, batch_size: int = 16) -> float:
    """Mean next-token cross-entropy (nats) over consecutive windows of `data` (SegLU applied, as the model's)."""
    model.eval()
    n = (len(data) - 1) // seq_len
    windows = torch.stack([data[i * seq_len:i * seq_len + seq_len + 1] for i in range(n)])
    total, count = 0.0, 0
    for batch in windows.split(batch_size):
        logits, _ = model(batch[:, :-1])
        total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / max(count, 1)


def train_llm(
    *,
    steps: int = 500,
    seed: int = 0,
    batch_size: int = 16,
    seq_len: int = 128,
    vocab_size: int = 4096,
    lr: float = 5e-3,
    warmup: int = 40,
    weight_decay: float = 0.1,
    multimax_lr_scale: float = 0.1,
    sample_tokens: int = 48,
    docs: Sequence[str] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenizer, trained model and metrics. The SegLU starts from the paper's LM output row (Table 8, last row,
    as `models.llama.set_paper_params`), not PaddleFleet's zeros: an identity start leaves the thresholds without
    gradient until the slopes move, and a demo whose SegLU is the identity would prove nothing."""
    start = time.perf_counter()
    docs = stdlib_docstring_list() if docs is None else docs
    n_held = max(1, int(len(docs) * HELDOUT_FRAC))  # the last docstrings, whole (as models.training.text)
    train_docs, held_docs = list(docs[:-n_held]), list(docs[-n_held:])
    tok = train_tokenizer(train_docs, vocab_size)
    train_data, held_data = encode_corpus(tok, train_docs), encode_corpus(tok, held_docs)

    torch.manual_seed(seed)
    cfg = LlamaConfig.from_dict(DEMO_SHAPE | dict(vocab_size=tok.get_vocab_size(), multimax_output=True))
    seq_len = min(seq_len, cfg.block_size)
    model = Llama(cfg)
    assert model.output_multimax is not None
    with torch.no_grad():
        model.output_multimax.set_params(*paper_params(len(PAPER_TABLE_8) - 1, PAPER_TABLE_8))
    # PaddleFleet's rule: no weight decay on the SegLU; it also gets a smaller rate (8 numbers reshape every logit).
    seglu = [p for n, p in model.named_parameters() if n.startswith("output_multimax.")]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and not n.startswith("output_multimax.")]
    groups = [{"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
              {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
              {"params": seglu, "weight_decay": 0.0, "lr_scale": multimax_lr_scale}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    data_gen = torch.Generator().manual_seed(seed)
    model.train()
    loss_ema: float | None = None
    train_start = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc="train demo LLM", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, warmup) * group["lr_scale"]
        idx = torch.randint(0, len(train_data) - seq_len - 1, (batch_size,), generator=data_gen)
        batch = torch.stack([train_data[i:i + seq_len + 1] for i in idx.tolist()])
        logits, _ = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.95 * loss_ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
    bar.close()
    train_seconds = time.perf_counter() - train_start

    model.eval()
    held = heldout_loss(model, held_data, seq_len)
    samples = {}
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids
        new = generate(model, ids, sample_tokens, temperature=0.0, eos_id=tok.token_to_id(ENDOFTEXT))[0]
        samples[prompt] = tok.decode(new)
    held_bytes = sum(len(d.encode()) for d in held_docs)
    return {
        "config": cfg,
        "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "tokenizer": tok,
        "metrics": {
            "train_loss": loss_ema,  # smoothed (EMA) training cross-entropy, nats per token
            "heldout_loss": held,  # nats per token over the held-out docstrings
            "heldout_bits_per_byte": held * (len(held_data) - 1) / held_bytes / math.log(2),
            "steps": steps,
            "batch_size": batch_size,
            "seq_len": seq_len,
            "vocab_size": tok.get_vocab_size(),
            "train_tokens": len(train_data),
            "train_bytes": sum(len(d.encode()) for d in train_docs),
            "heldout_tokens": len(held_data),
            "heldout_bytes": held_bytes,
            "parameters": sum(p.numel() for p in model.parameters()),
            "seglu": {"ranges": [round(float(v), 6) for v in model.output_multimax.ranges.tolist()],
                      "ts": [round(float(v), 6) for v in model.output_multimax.ts.tolist()]},
            "train_seconds": round(train_seconds, 1),
            "seconds": round(time.perf_counter() - start, 1),
        },
        "samples_greedy": samples,
    }


def save_llm(result: dict[str, Any], out: Path) -> Path:
    """`train_llm`'s result as a Hugging Face folder (models.training.llm_folder); generation stops at the end of
    a document or of a chat turn."""
    from models.training.llm_folder import write_folder

    return write_folder(out, result["config"], result["state_dict"], result["tokenizer"], eos=ENDOFTEXT,
                        stop=(ENDOFTEXT, IM_END), pad=ENDOFTEXT)
