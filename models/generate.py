"""Sampling and stopping, shared by the model package and the server (in the manner of gpt-fast's generate.py).

- `top_k_filter`, `top_p_filter`, `sample_next`: next tokens for a batch of last-position logits (strict: bad
  parameters raise), as `generate` and training samples use them. The server's batched sampler
  (`service.engine.text.sampler`: per-row parameters, seeds, penalties, never raising on values the API accepts)
  takes its parameters in the same order: temperature, top_k, top_p;
- `stop_bytes`, `stop_match`: stop sequences on the decoded bytes;
- `left_pad`: prompts of different lengths right-aligned in one batch;
- `generate`: the reference generation loop with the KV cache (what the exported graph and the server are
  compared against).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import Tensor

from models.gpt import KVCache, PastKeyValues
from models.output_function import log_probabilities
from models.registry import TextModel, describe_text_model
from models.spec import TextSpec
from models.tokenizer import ByteTokenizer


class Detokenizer(Protocol):
    """What stop sequences need of a tokenizer (models.tokenizer.ByteTokenizer, models.hf_tokenizer.HFTokenizer)."""

    concatenates: bool  # the bytes of ids a + b are a's then b's: stop_match decodes only the last tokens

    def decode_bytes(self, ids: Sequence[int]) -> bytes: ...


def top_k_filter(logits: Tensor, top_k: int) -> Tensor:
    """Keep the k largest logits per row (ties at the k-th value survive), -inf elsewhere."""
    kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Nucleus: keep the smallest set of top tokens whose probability reaches top_p (the top one always)."""
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
    probs = sorted_logits.softmax(-1)
    drop_sorted = probs.cumsum(-1) - probs >= top_p  # mass strictly above this token already suffices
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def as_output_logits(output_function: str | None, scaled: Tensor) -> Tensor:
    """Logits whose softmax is the output function's distribution of `scaled` (its log: -inf where it gives 0),
    so that top-k, top-p and the final softmax work on that distribution unchanged. Softmax: `scaled` itself."""
    if output_function is None:
        return scaled
    return log_probabilities(output_function, scaled)


def sample_next(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    output_function: str | None = None,
) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V); temperature 0 is greedy. `output_function`
    (models.output_function) is the distribution drawn from, of logits / temperature, before top-k/top-p."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = as_output_logits(output_function, logits.float() / temperature)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1:
        logits = top_p_filter(logits, top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


def stop_bytes(stop: Sequence[str | bytes] | None) -> list[bytes]:
    """Stop sequences as UTF-8 bytes (empty ones dropped)."""
    out = [s.encode("utf-8") if isinstance(s, str) else bytes(s) for s in (stop or [])]
    return [s for s in out if s]


@dataclass(frozen=True)
class StopHit:
    """Where a stop sequence was found: how many tokens to keep (those wholly before it) and the bytes a token
    that straddles the stop's start held before it (the text keeps them: it ends exactly before the stop)."""

    keep: int
    tail: bytes = b""


def stop_match(tokens: Sequence[int], stops: Sequence[bytes], tokenizer: Detokenizer) -> StopHit | None:
    """Whether the last token completed a stop sequence anywhere in the text (inside that token too, with text
    after it in the same token), and where: the earliest such stop ends the text. Only what the last token can
    have completed is searched (its bytes and the longest stop's length before them): earlier stops ended the
    text when they appeared.

    A tokenizer whose bytes concatenate (`concatenates`: the text of a + b is a's then b's, as byte-level ones)
    has only its last tokens decoded, as many as hold the longest stop before the last one, so the check costs the
    same at the 2,000th token as at the 10th (decoding the whole text each step cost the demo LLM 316 us a sequence
    and step at 2,000 tokens). Other tokenizers decode the whole text, which they need for its spacing."""
    if not stops or not tokens:
        return None
    longest = max(map(len, stops))
    start = 0
    if tokenizer.concatenates:
        held, start = 0, len(tokens) - 1
        while start and held < longest - 1:
            start -= 1
            held += len(tokenizer.decode_bytes(tokens[start:start + 1]))
    tail = tokens[start:]
    text = tokenizer.decode_bytes(tail)
    since = max(0, len(tokenizer.decode_bytes(tail[:-1])) - longest + 1)
    found = [i for i in (text.find(s, since) for s in stops) if i >= 0]
    if not found:
        return None
    cut = min(found)
    keep = len(tail)
    # Drop tokens until none of the stop's bytes remain (a token straddling the cut goes too; its bytes before
    # the cut are the hit's tail).
    while keep and len(kept := tokenizer.decode_bytes(tail[:keep])) > cut:
        keep -= 1
    kept = tokenizer.decode_bytes(tail[:keep])
    return StopHit(start + keep, text[len(kept):cut] if text.startswith(kept) else b"")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: Any = None) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask), both (B, longest): prompts right-aligned so new tokens line up."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long, device=device)
    for row, p in enumerate(prompts):
        if p:
            ids[row, longest - len(p):] = torch.tensor(list(p), dtype=torch.long, device=device)
            mask[row, longest - len(p):] = 1
    return ids, mask


def grows_cache_in_place(model: Any) -> bool:
    """Whether the model's attention extends its past in place where the past's buffer has room
    (models.cache_growth.extend: the Llama family), so that a caller may hand it a past with room to spare; the
    others concatenate, and room would be copied for nothing. `model`: a text model (models.registry.TextModel,
    whose classes declare it; Any: the PyTorch backend holds it as an nn.Module)."""
    return model.grows_cache_in_place


def keeps_last_logits(model: Any) -> bool:
    """Whether the model's forward can compute the last positions' logits alone (`logits_to_keep`: the LM head and
    SegLU of one row instead of a whole prompt's). `model`: as `grows_cache_in_place`'s."""
    return model.keeps_last_logits


def _last_row_only(model: TextModel) -> dict[str, Any]:
    """The prefill's keyword for one row of logits where the model takes it."""
    return {"logits_to_keep": 1} if model.keeps_last_logits else {}


def _empty_past(model: TextModel, batch_size: int) -> tuple[PastKeyValues, torch.device]:
    """A zero-length cache for `model` and the device it runs on."""
    past = model.empty_past(batch_size)
    return past, past[0][0].device


@torch.no_grad()
def generate(
    model: TextModel,
    prompt_ids: Sequence[int] | Sequence[Sequence[int]],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop: Sequence[str] | Sequence[bytes] | None = None,
    seed: int | None = None,
    eos_id: int | Sequence[int] | None = None,
    tokenizer: Detokenizer | None = None,
    spec: TextSpec | None = None,
) -> list[list[int]]:
    """New tokens per prompt (one prompt or a batch), decoded one token per step from the KV cache.

    `model` is a GPT or a Llama (models.llama: Llama, Qwen2, Qwen3 folders). A row ends at an `eos_id` (one id
    or several; not returned), at a stop sequence (removed from the output), after
    max_new_tokens, or when the context is full: all rows share one cache, so the longest prompt
    leaves `block_size - len(longest)` new tokens. Sampling draws from a generator seeded by `seed`. `spec`: the
    model's description (models.spec) where the caller has it (an export's validation), else described here.
    """
    prompts: list[list[int]] = (
        [list(cast(Sequence[int], prompt_ids))] if not prompt_ids or isinstance(prompt_ids[0], int)
        else [list(cast(Sequence[int], p)) for p in prompt_ids]
    )
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token (e.g. the tokenizer's <|bos|>)")
    spec = spec or describe_text_model(model)
    output_function = spec.reweighting.output_distribution
    longest = max(len(p) for p in prompts)
    if longest > spec.context_length:
        raise ValueError(f"prompt of {longest} tokens does not fit the context of {spec.context_length}")
    budget = min(max_new_tokens, spec.context_length - longest)
    outputs: list[list[int]] = [[] for _ in prompts]
    if budget <= 0:
        return outputs

    stops = stop_bytes(stop)
    tokenizer = tokenizer or ByteTokenizer()
    eos_ids = {eos_id} if isinstance(eos_id, int) else set(eos_id or ())
    past, device = _empty_past(model, len(prompts))
    cache = KVCache(past)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    input_ids, attention_mask = left_pad(prompts, pad_id=0, device=device)  # pad id is masked, any id works
    done = [False] * len(prompts)

    was_training = model.training
    model.eval()
    try:
        logits, cache.layers = model(input_ids, attention_mask=attention_mask, past_key_values=cache.layers,
                                     **_last_row_only(model))
        for step in range(budget):
            next_ids = sample_next(logits[:, -1], temperature, top_k, top_p, generator, output_function)
            for row, tok in enumerate(next_ids.tolist()):
                if done[row]:
                    continue
                if tok in eos_ids:
                    done[row] = True
                    continue
                outputs[row].append(tok)
                hit = stop_match(outputs[row], stops, tokenizer)
                if hit is not None:
                    del outputs[row][hit.keep:]
                    done[row] = True
            if all(done) or step == budget - 1:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], dim=1)
            logits, cache.layers = model(
                next_ids[:, None], attention_mask=attention_mask, past_key_values=cache.layers
            )
    finally:
        model.train(was_training)
    return outputs


class NonFiniteLogits(ValueError):
    """The model produced NaN or infinite logits for this sequence."""
