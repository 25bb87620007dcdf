"""One text-generation request as the engine runs it, whatever endpoint it came in by (`GenerationRequest`), and
how an endpoint builds it (`build`) from its prompts and its body's sampling fields (`SamplingOptions`).

/v1/completions and /v1/chat/completions each read their own body, turn its prompt (text, token ids, or messages
through the chat template) into token ids and its sampling fields into `SamplingOptions` (mapping their own
names: chat's max_completion_tokens, logprobs + top_logprobs). `build` then checks them against the model and the
server's limits, in one order for every endpoint: n and best_of, logit_bias, the context and max_tokens,
min_tokens, stop strings, then structured output (service.protocols.structured's logits processors, compiled off
the event loop; or the endpoint's own `Constraint`: chat's tool-call grammar, service.protocols.tools).
`service.protocols.generation` runs the result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from models.generate import stop_bytes
from models.tokenizer import TextTokenizer
from service.base.config import Settings
from service.base.errors import bad_request, shown
from service.engine.runtime import TextRuntime
from service.engine.text import SamplingParams
from service.engine.text.sampler import LogitsProcessor
from service.protocols import structured


@dataclass(frozen=True)
class SamplingOptions:
    """A body's sampling fields, not yet checked against the model, in /v1/completions' names (an endpoint that
    names them otherwise maps its own). None is "not given" where the body allows it."""

    max_tokens: int | None = None  # None: the endpoint's default, bounded by what fits the context
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = None
    n: int | None = 1  # choices returned per prompt
    best_of: int | None = None  # sequences generated per prompt (>= n), the n most likely returned
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    echo: bool = False  # the prompt before the completion (with its logprobs)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[str, float] | None = None  # token id (as a string) -> bias
    structured: Mapping[str, Any] = field(default_factory=dict)  # the body's fields (service.protocols.structured)
    stream: bool = False
    include_usage: bool = False  # a stream's last chunk: the usage
    continuous_usage: bool = False  # every chunk of a stream: the usage so far


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate and how to answer, checked: the engine's terms, no protocol's."""

    prompts: list[list[int]]  # token ids, one list per prompt
    params: list[SamplingParams]  # one per prompt (structured output's processors in them)
    n: int  # choices returned per prompt
    best_of: int  # sequences generated per prompt (>= n; the n of highest cumulative logprob are returned)
    echo: bool
    logprobs: int | None  # alternatives per token; None: no logprobs
    stream: bool
    include_usage: bool
    continuous_usage: bool


# An endpoint's own constraint in place of the body's structured-output fields (tool calling's grammar,
# service.protocols.tools.constraint): awaited for its logits processors in structured output's turn.
Constraint = Callable[[], Awaitable[tuple[LogitsProcessor, ...]]]


async def build(prompts: list[list[int]], options: SamplingOptions, rt: TextRuntime, settings: Settings, *,
                default_max_tokens: int, prompt_field: str = "prompt",
                constraint: Constraint | None = None) -> GenerationRequest:
    """The request for `prompts` (token ids, checked) with `options`, checked against the model `rt` and the
    server's limits (400 naming the field). `default_max_tokens`: max_tokens when the body gives none (bounded
    by what fits the context); `prompt_field`: the body's field a prompt too long for the context is blamed on;
    `constraint`: the endpoint's logits processors instead of the structured-output fields' (the endpoint has
    refused a body that asks for both)."""
    n, best_of = choice_counts(options, len(prompts), settings)
    bias = logit_bias(options, rt.tokenizer.vocab_size)
    params = [sampling_params(options, len(p), rt.context_length, default_max_tokens, bias, prompt_field)
              for p in prompts]
    if constraint is not None:
        processors = await constraint()
        params = [dataclasses.replace(p, processors=processors) for p in params] if processors else params
    else:
        params = await with_structured_output(options.structured, rt.tokenizer, params, settings)
    return GenerationRequest(prompts, params, n, best_of, options.echo, options.logprobs, options.stream,
                             options.include_usage, options.continuous_usage)


def choice_counts(options: SamplingOptions, prompts: int, settings: Settings) -> tuple[int, int]:
    """(n, best_of), checked: best_of >= n, no streaming of best_of, and prompts * best_of sequences within
    the request's bound, the batch (a group is admitted whole) and the waiting room, so that one request
    cannot take the server; a request over them is 400 (it could never fit), not 429."""
    n = options.n or 1
    best_of = n if options.best_of is None else options.best_of
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if options.stream and best_of > n:
        raise bad_request("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    total = prompts * best_of
    limit = min(settings.max_choices_per_request, settings.max_waiting_sequences)
    if total > limit or best_of > settings.max_running_sequences:
        raise bad_request(f"{prompts} prompt(s) x {best_of} completions = {total} sequences; this server allows "
                          f"at most {limit} per request and {settings.max_running_sequences} per prompt",
                          "best_of" if options.best_of is not None else "n", code="too_many_choices")
    return n, best_of


def logit_bias(options: SamplingOptions, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias) pairs; 400 naming logit_bias for a key that is not a token id
    of this model's vocabulary."""
    pairs = []
    for key, bias in (options.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias: {shown(key)} is not a token id of this model (0..{vocab_size - 1})",
                              "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def sampling_params(options: SamplingOptions, prompt_len: int, context: int, default_max: int,
                    bias: tuple[tuple[int, float], ...] = (), prompt_field: str = "prompt") -> SamplingParams:
    """One prompt's SamplingParams: max_tokens within what the context leaves it, min_tokens within that, at most
    4 stop strings."""
    room = context - prompt_len
    if room <= 0:
        raise bad_request(f"this model's maximum context length is {context} tokens, and the prompt alone has "
                          f"{prompt_len}", prompt_field, code="context_length_exceeded")
    if options.max_tokens is None:
        max_tokens = min(default_max, room)
    elif prompt_len + options.max_tokens > context:
        raise bad_request(f"this model's maximum context length is {context} tokens; you requested "
                          f"{prompt_len + options.max_tokens} ({prompt_len} in the prompt, {options.max_tokens} for "
                          "the completion)", "max_tokens", code="context_length_exceeded")
    else:
        max_tokens = options.max_tokens
    min_tokens = options.min_tokens
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    stops = [options.stop] if isinstance(options.stop, str) else list(options.stop or [])
    if len(stops) > 4:
        raise bad_request(f"at most 4 stop sequences, got {len(stops)}", "stop")
    n = options.n or 1
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if options.temperature is None else options.temperature,
        top_p=1.0 if options.top_p is None else options.top_p,
        top_k=options.top_k,
        stop=tuple(stop_bytes(stops)),
        seed=options.seed,
        logprobs=options.logprobs,
        prompt_logprobs=options.echo and options.logprobs is not None,
        rank=(options.best_of or 1) > n,
        ignore_eos=options.ignore_eos,
        min_tokens=min_tokens,
        repetition_penalty=options.repetition_penalty,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        logit_bias=bias,
    )


async def with_structured_output(fields: Mapping[str, Any], tokenizer: TextTokenizer, params: list[SamplingParams],
                                 settings: Settings) -> list[SamplingParams]:
    """`params` with the structured-output processors the body's `fields` ask for (service.protocols.structured),
    if any; 400 naming the field for a grammar over the limits, one llguidance refuses, or one that crashes or
    stalls the grammar worker. Measured, compiled and probed off the event loop, before the request is admitted."""
    if not structured.requested(fields) and fields.get("guided_whitespace_pattern") is None:
        return params
    processors = await structured.processors_for_request(fields, tokenizer, settings)
    return [dataclasses.replace(p, processors=processors) for p in params] if processors else params
