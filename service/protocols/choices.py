"""The choices of one /v1/completions request: n and best_of expanded into sequences, ranked back into choices,
and their text and `logprobs` objects in OpenAI's legacy completions format.

A request with P prompts, `n` and `best_of` (>= n) generates P * best_of sequences. The best_of sequences of one
prompt share a group: the scheduler admits them together and prefills the prompt once (its KV cache is copied).
Choice j of prompt i has index i * n + j. With best_of > n, the n sequences of highest cumulative logprob (raw
model logprobs of every sampled token) are returned, best first.
"""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Sequence
from typing import Any

from models.tokenizer import TextTokenizer
from service.engine.text import GenSequence, SamplingParams, TokenLogprobs


def expand(prompts: list[list[int]], params: list[SamplingParams], best_of: int,
           changed: Any) -> list[list[GenSequence]]:
    """best_of sequences per prompt, one group each; choice c draws from the seed `seed + c` (mod 2**64), so
    a seeded request is reproducible and its choices differ."""
    out = []
    for prompt, p in zip(prompts, params, strict=True):
        group = object() if best_of > 1 else None
        out.append([GenSequence(prompt, p if p.seed is None else dataclasses.replace(p, seed=(p.seed + c) % 2**64),
                                changed=changed, group=group) for c in range(best_of)])
    return out


def ranked(seqs: list[GenSequence], n: int) -> list[GenSequence]:
    """The n sequences to return: all of them without best_of, else the n of highest cumulative logprob."""
    if len(seqs) == n:
        return seqs
    return sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:n]


def usage(groups: list[list[GenSequence]]) -> dict[str, int]:
    """Each prompt counted once; completion tokens of every generated sequence, best_of's discarded ones too
    (what OpenAI bills)."""
    prompt = sum(len(g[0].prompt) for g in groups)
    completion = sum(s.generated for g in groups for s in g)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def token_text(tokenizer: TextTokenizer, token: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or `bytes:\\xNN` for a byte that is not a whole UTF-8
    character; special tokens by name."""
    data = tokenizer.token_bytes(token)
    if not data:
        return tokenizer.decode([token], skip_special=False)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def offsets(tokenizer: TextTokenizer, tokens: Sequence[int]) -> list[int]:
    """Character offset in the decoded text where each token starts (a byte inside a character counts from
    the character's end, as only whole characters are text)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out, chars = [], 0
    for t in tokens:
        out.append(chars)
        chars += len(decoder.decode(tokenizer.decode_bytes([t])))
    return out


def logprobs_object(tokenizer: TextTokenizer, tokens: Sequence[int], lps: TokenLogprobs, start: int = 0,
                    end: int | None = None) -> dict[str, Any]:
    """OpenAI's `choices[i].logprobs` for tokens[start:end] (offsets count from the start of `tokens`)."""
    end = len(tokens) if end is None else end
    where = offsets(tokenizer, tokens[:end])[start:end]
    return {
        "tokens": [token_text(tokenizer, t) for t in tokens[start:end]],
        "token_logprobs": lps.chosen[start:end],
        "top_logprobs": [None if top is None else {token_text(tokenizer, t): lp for t, lp in top.items()}
                         for top in lps.top[start:end]],
        "text_offset": where,
    }


def echoed(seq: GenSequence, echo: bool) -> tuple[list[int], TokenLogprobs]:
    """The tokens a choice shows (the prompt first when echoing) and their logprobs."""
    if not echo:
        return seq.tokens, seq.logprobs
    prompt = seq.prompt_logprobs or TokenLogprobs([None] * len(seq.prompt), [None] * len(seq.prompt))
    return seq.prompt + seq.tokens, TokenLogprobs(prompt.chosen + seq.logprobs.chosen,
                                                  prompt.top + seq.logprobs.top)


def choice(tokenizer: TextTokenizer, seq: GenSequence, index: int, echo: bool, logprobs: bool) -> dict[str, Any]:
    """One whole (non-streamed) choice."""
    tokens, lps = echoed(seq, echo)
    return {"index": index, "text": tokenizer.decode(tokens) + seq.stop_tail.decode("utf-8", "replace"),
            "logprobs": logprobs_object(tokenizer, tokens, lps) if logprobs else None,
            "finish_reason": seq.finish_reason}
