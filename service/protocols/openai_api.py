"""OpenAI-compatible endpoints: `GET /v1/models` and `POST /v1/completions` (with SSE streaming).

Field names, defaults, the error shape and the stream format (`data: {chunk}` events ending in
`data: [DONE]`) are OpenAI's, so the official client works unchanged. logprobs, echo, n and best_of work as
OpenAI's legacy completions API has them (`service.protocols.choices`), with vLLM's extensions ignore_eos, min_tokens,
repetition_penalty and stream_options.continuous_usage_stats (docs/SERVICE.md has the table); presence_penalty,
frequency_penalty and logit_bias as OpenAI defines them (service.engine.text.sampler applies them).
Options this server cannot
honour (suffix, tools, unknown fields: `service.protocols.fields`) are refused with 400 rather than silently ignored;
structured output (response_format, guided_*) is `service.protocols.structured`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar, cast

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from models.generate import stop_bytes
from models.onnx_contract import attention_function, output_function
from service.base.bodies import JSON, read_body, require_media
from service.base.config import Settings
from service.base.errors import LOOKUP, MODEL_CALL, ServiceError, bad_request, error_responses, openai_body, shown
from service.base.jsonio import check_size, loads
from service.base.tracing import phase
from service.engine.text.detokenizer import IncrementalDetokenizer
from service.engine.engine_errors import EngineError
from service.engine.runtime import ModelRuntime, Runtimes, TextRuntime
from service.engine.text.sampler import MAX_LOGIT_BIAS, SamplingParams
from service.engine.text.scheduler import GenSequence
from service.protocols import choices, fields, prompt_encoding, request_text, structured
from service.protocols.endpoint import ModelCall, count_refused, model_call, model_endpoint
from service.protocols.engine_status import http_error
from service.protocols.lifecycle import Tracker
from service.protocols.stream_steps import StepReader

RequestT = TypeVar("RequestT")
router = APIRouter(tags=["openai"])
OWNER = "multimax-serve"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = OWNER
    task: str
    backend: str
    provider: str
    context_length: int | None = None
    labels: list[str] | None = None
    # ONNX Runtime backend: whether the fused MultiMax CPU ops (plugins.ort_ops) run this model, or why not.
    fused_multimax: dict[str, Any] | None = None
    # PyTorch backend on a CPU: "cpu" where the LM head's SegLU runs the fused library's kernel (plugins.cpu_sigma).
    fused_seglu: str | None = None
    version: str = "1"  # the version that serves requests naming this model (its latest loaded)
    versions: list[str] = Field(default_factory=lambda: ["1"])  # every loaded version (KServe V2 routes reach each)
    # The attention reweighting the model uses (models.reweighting: multimax, softmax, sparsemax, ...), from its
    # config (the ONNX file's metadata), and that function's options (top-k's k, ...).
    attention_function: str | None = None
    attention_options: dict[str, Any] | None = None
    # The output distribution (models.output_function: softmax, multimax, sparsemax, entmax15, evsoftmax):
    # what classification probabilities, sampling and logprobs are taken from.
    output_function: str | None = None
    # What the model is: its architecture (e.g. Qwen3ForCausalLM), format, where SegLU / MultiMax sits and its
    # parameters, its tokenizer (type, vocabulary, special tokens, whether it has a chat template).
    architecture: str | None = None
    format: str | None = None
    multimax: dict[str, Any] | None = None
    tokenizer: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="extension (vLLM): usage so far in every chunk")


Stop = Annotated[str, Field(max_length=256)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


class SamplingExtensions(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share beyond OpenAI's basics: vLLM's extensions, the
    penalties and logit_bias (service.engine.text.sampler), and structured output (service.protocols.structured)."""

    model_config = ConfigDict(extra="allow", strict=True)

    ignore_eos: bool | None = Field(False, description="extension (vLLM): never end at eos")
    min_tokens: int | None = Field(0, ge=0, description="extension (vLLM): no eos nor stop before this many")
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                           description="subtracted from the logit of every token generated so far")
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, allow_inf_nan=False,
                                            description="subtracted per occurrence of each token generated so far")
    repetition_penalty: float | None = Field(1.0, gt=0, le=2, allow_inf_nan=False, description=(
        "extension (vLLM): tokens of the prompt and the completion have positive logits divided by it, negative "
        "ones multiplied"))
    logit_bias: dict[str, Bias] | None = Field(None, description="token id (as a string) -> bias in [-100, 100] "
                                                                 "added to its logit")
    # Structured output (service.protocols.structured), at most one of these.
    response_format: dict[str, Any] | None = Field(
        None, description='{"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "json_schema": '
                          '{"name": ..., "schema": {...}}}: the output is valid JSON (matching the schema)')
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM): a JSON schema to match")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM): the output is one of these")
    guided_regex: str | None = Field(None, description="extension (vLLM): the output matches this regex")
    guided_grammar: str | None = Field(None, description="extension (vLLM): the output matches this Lark/GBNF grammar")
    guided_whitespace_pattern: str | None = Field(None, description="extension (vLLM): JSON whitespace regex")
    guided_decoding_backend: str | None = Field(
        None, description="extension (vLLM): accepted, but the engine is always llguidance")


class CompletionRequest(SamplingExtensions):
    # Undeclared fields: service.protocols.fields (user, metadata, ... pass; others are refused). Strict: "10", "true",
    # [[false]] are not numbers, booleans or token ids (OpenAI refuses them too), so nothing is coerced.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, a list of texts, or token ids (one list per prompt)")
    max_tokens: int | None = Field(None, ge=0, description="default: 16 (or what fits the context)")
    temperature: float | None = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(1.0, ge=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=1, description="extension (vLLM): keep the k most likely tokens")
    n: int | None = Field(1, ge=1, description="completions per prompt (bounded by max_choices_per_request)")
    best_of: int | None = Field(None, ge=1, description="generate this many (>= n), return the n most likely")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Stop | list[Stop] | None = Field(None, description="up to 4 sequences; generation ends before them")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    echo: bool | None = Field(False, description="the prompt before the completion (its logprobs too)")
    logprobs: int | None = Field(None, ge=0, le=5, description="raw model logprobs, with this many alternatives")
    suffix: str | None = Field(None, description="not supported: must be null")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Logprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Logprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None  # "<model>:<version>": which loaded version answered


# ---- models --------------------------------------------------------------------------------------------


def model_card(rt: ModelRuntime, versions: list[int]) -> ModelCard:
    entry = rt.entry
    described = entry.backend.describe()
    return ModelCard(id=entry.name, created=entry.created, task=entry.task, backend=entry.backend.kind,
                     provider=entry.backend.provider, context_length=entry.context_length, labels=entry.labels,
                     fused_multimax=described.get("fused_multimax"), fused_seglu=described.get("fused_seglu"),
                     version=str(entry.version),
                     versions=[str(v) for v in versions],
                     attention_function=attention_function(entry.config),
                     attention_options=entry.config.get("attention_options"),
                     output_function=output_function(entry.config),
                     **{k: v for k, v in entry.model_info().items() if k != "context_length"})


@router.get("/v1/models", response_model=ModelList, summary="Every served model (OpenAI list format)")
async def list_models(request: Request) -> ModelList:
    runtimes: Runtimes = request.app.state.runtimes
    return ModelList(data=[model_card(rt, list(runtimes.versions[n])) for n, rt in runtimes.models.items()])


@router.get("/v1/models/{name}", response_model=ModelCard, summary="One served model",
            responses=error_responses(False, LOOKUP))
async def get_model(name: str, request: Request) -> ModelCard:
    runtimes: Runtimes = request.app.state.runtimes
    return model_card(runtimes.get(name), list(runtimes.versions[name]))


# ---- completions: decode request ------------------------------------------------------------------------


def _unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix", code="unsupported_parameter")
    fields.refuse_undeclared(req.model_extra)


def logit_bias(req: CompletionRequest, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """The request's logit_bias as (token id, bias) pairs; 400 naming logit_bias for a key that is not a token id
    of this model's vocabulary."""
    pairs = []
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise bad_request(f"logit_bias: {shown(key)} is not a token id of this model (0..{vocab_size - 1})",
                              "logit_bias")
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def prompts_of(req: CompletionRequest, rt: TextRuntime, limit: int) -> list[list[int]]:
    """The request's prompts as token ids, checked. Its texts were checked for valid Unicode where the body
    entered (service.protocols.request_text); long prompts are encoded on a thread (prompt_encoding.run)."""
    tok = rt.tokenizer
    p = req.prompt
    if isinstance(p, str):
        prompts = [tok.encode(p)]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(cast(list[int], p))]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [tok.encode(x) for x in cast(list[str], p)]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in cast(list[list[int]], p)]
    else:
        raise bad_request("prompt is empty", "prompt", code="empty_prompt")
    if len(prompts) > limit:
        raise bad_request(f"at most {limit} prompts per request, got {len(prompts)}", "prompt")
    for i, ids in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not ids:
            raise bad_request(f"{where} is empty: give at least one token", "prompt", code="empty_prompt")
        bad = next((t for t in ids if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{where}: token id {bad} is outside the vocabulary (0..{tok.vocab_size - 1})",
                              "prompt")
    return prompts


def _prompt_size(prompt: Any) -> int:
    """Characters (or token ids) of a prompt: how long encoding and checking it takes."""
    if isinstance(prompt, (str, int)):
        return len(prompt) if isinstance(prompt, str) else 1
    return sum(_prompt_size(p) if isinstance(p, (str, int)) else len(p) for p in prompt)


def sampling_params(req: CompletionRequest, prompt_len: int, context: int, default_max: int,
                    bias: tuple[tuple[int, float], ...] = ()) -> SamplingParams:
    room = context - prompt_len
    if room <= 0:
        raise bad_request(f"this model's maximum context length is {context} tokens, and the prompt alone has "
                          f"{prompt_len}", "prompt", code="context_length_exceeded")
    if req.max_tokens is None:
        max_tokens = min(default_max, room)
    elif prompt_len + req.max_tokens > context:
        raise bad_request(f"this model's maximum context length is {context} tokens; you requested "
                          f"{prompt_len + req.max_tokens} ({prompt_len} in the prompt, {req.max_tokens} for the "
                          "completion)", "max_tokens", code="context_length_exceeded")
    else:
        max_tokens = req.max_tokens
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > 4:
        raise bad_request(f"at most 4 stop sequences, got {len(stops)}", "stop")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k,
        stop=tuple(stop_bytes(stops)),
        seed=req.seed,
        logprobs=req.logprobs,
        prompt_logprobs=bool(req.echo) and req.logprobs is not None,
        rank=(req.best_of or 1) > (req.n or 1),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=bias,
    )


def choice_counts(req: CompletionRequest, prompts: int, settings: Any) -> tuple[int, int]:
    """(n, best_of), checked: best_of >= n, no streaming of best_of, and prompts * best_of sequences within
    the request's bound, the batch (a group is admitted whole) and the waiting room, so that one request
    cannot take the server; a request over them is 400 (it could never fit), not 429."""
    n = req.n or 1
    best_of = n if req.best_of is None else req.best_of
    if best_of < n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    if req.stream and best_of > n:
        raise bad_request("best_of > n cannot be streamed (the best are known only at the end)", "best_of")
    total = prompts * best_of
    limit = min(settings.max_choices_per_request, settings.max_waiting_sequences)
    if total > limit or best_of > settings.max_running_sequences:
        raise bad_request(f"{prompts} prompt(s) x {best_of} completions = {total} sequences; this server allows "
                          f"at most {limit} per request and {settings.max_running_sequences} per prompt",
                          "best_of" if req.best_of is not None else "n", code="too_many_choices")
    return n, best_of


# ---- completions: encode response -------------------------------------------------------------------------


def _timing(seqs: list[GenSequence], until: str) -> tuple[float, float]:
    now = time.perf_counter()
    queue = max((s.started or now) - s.arrival for s in seqs)
    compute = max((getattr(s, until) or now) - (s.started or now) for s in seqs)
    return queue, compute


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic model's JSON schema with its $defs inlined (an OpenAPI requestBody cannot point into them)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        return [walk(v) for v in node] if isinstance(node, list) else node

    return walk(schema)


COMPLETION_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inline_refs(CompletionRequest.model_json_schema())}}}}


def _prompt_too_long(obj: Any, limit: int) -> bool:
    """Cheap look at the raw prompt before validation: no prompt may hold more token ids than the context (nor
    more prompts than allowed), so millions of ids are refused before pydantic walks them."""
    prompt = obj.get("prompt") if isinstance(obj, dict) else None
    if not isinstance(prompt, list):
        return False
    return len(prompt) > limit or any(isinstance(p, list) and len(p) > limit for p in prompt)


async def read_json_object(request: Request, runtimes: Runtimes) -> Any:
    """The request body as parsed JSON: the media type checked, its size bounded before and after reading, every
    text in it valid Unicode (service.protocols.request_text: checked here, once, for the whole request)."""
    settings = runtimes.settings
    require_media(request, (JSON,))
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and request.headers.get("content-encoding") is None:
        check_size(int(declared), settings.max_json_bytes)
    body = await read_body(request, settings.max_json_bytes)
    check_size(len(body), settings.max_json_bytes)
    parsed = loads(body)
    request_text.check_text(body, parsed)
    return parsed


async def read_completion(request: Request, runtimes: Runtimes) -> CompletionRequest:
    """The request body as a CompletionRequest: bounded, strict JSON, cheap checks before validation."""
    settings = runtimes.settings
    obj = await read_json_object(request, runtimes)
    model = obj.get("model") if isinstance(obj, dict) else None
    rt = runtimes.models.get(model) if isinstance(model, str) else None
    if isinstance(rt, TextRuntime):
        limit = max(rt.context_length, settings.max_prompts_per_request)
        if _prompt_too_long(obj, limit):
            raise bad_request(f"prompt holds more token ids (or prompts) than this model's context of "
                              f"{rt.context_length} tokens", "prompt", code="context_length_exceeded")
    try:
        return CompletionRequest.model_validate(obj)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def text_models_full(runtimes: Runtimes) -> None:
    """429 before the body is read when no text model could take a sequence (the model is named in the body)."""
    schedulers = [rt.scheduler for rt in runtimes.models.values() if isinstance(rt, TextRuntime)]
    if not schedulers:
        return
    for sched in schedulers:
        try:
            sched.check_room()
        except EngineError as exc:
            error = http_error(exc)
            continue
        return
    raise error


async def read_text_request(request: Request, runtimes: Runtimes,
                            read: Callable[[Request, Runtimes], Awaitable[RequestT]]) -> RequestT:
    """A text route's body, read and validated after checking there is room for it; a refusal before the model
    is known is counted under the route's label."""
    try:
        text_models_full(runtimes)
        with phase("preprocess"):
            return await read(request, runtimes)
    except (ServiceError, RequestValidationError, HTTPException) as exc:
        if isinstance(exc, ServiceError):
            count_refused(request.app, request.scope, exc.status)
        raise


async def with_structured_output(req: BaseModel, tokenizer: Any, params: list[SamplingParams],
                                 settings: Settings) -> list[SamplingParams]:
    """`params` with the request's structured-output processors (service.protocols.structured), if it asks for
    any; 400 naming the field for a grammar over the limits, one llguidance refuses, or one that crashes or
    stalls the grammar worker. Measured, compiled and probed off the event loop, before the request is admitted."""
    asked = dict(req)
    if not structured.requested(asked) and asked.get("guided_whitespace_pattern") is None:
        return params
    processors = await structured.processors_for_request(asked, tokenizer, settings)
    return [dataclasses.replace(p, processors=processors) for p in params] if processors else params


async def run_sequences(call: ModelCall, rt: TextRuntime, seqs: list[GenSequence], changed: asyncio.Event,
                        stream: Callable[[], AsyncIterator[bytes]] | None) -> Response | None:
    """Submit `seqs` and wait for them (None: they are done), or, given `stream`, for their first token and then
    answer with its Server-Sent Events (waiting first: a failure until then is still a proper HTTP error, and
    Server-Timing can tell the queue time). However the wait ends early, the sequences are cancelled."""
    rt.scheduler.submit(seqs)
    try:
        if stream is not None:
            await call.wait(_first_update(seqs, changed))
            call.timing(*_timing(seqs, "first_token"))

            def cleanup() -> None:
                for s in seqs:
                    rt.scheduler.cancel(s)
                call.tracker.finish("cancelled")  # no-op if the stream ended normally

            return _SSEResponse(stream(), cleanup)
        await call.wait(_all_done(seqs, changed))
    except BaseException:
        for s in seqs:
            rt.scheduler.cancel(s)
        raise
    call.timing(*_timing(seqs, "finished"))
    return None


@router.post("/v1/completions", response_model=Completion, summary="Text completion (OpenAI), streamed with SSE",
             openapi_extra=COMPLETION_BODY,
             responses={200: {"content": {"text/event-stream": {}}, "description": "a completion, or its stream"},
                        **error_responses(False, MODEL_CALL)})
@model_endpoint("completions")
async def completions(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    settings = runtimes.settings
    req = await read_text_request(request, runtimes, read_completion)
    async with model_call(request, req.model, finish=False) as call:
        tracker = call.tracker
        rt = call.runtime(req.model, TextRuntime)
        _unsupported(req)
        with phase("tokenize"):
            prompts = await prompt_encoding.run(_prompt_size(req.prompt), prompts_of, req, rt,
                                                settings.max_prompts_per_request)
        n, best_of = choice_counts(req, len(prompts), settings)
        context = rt.context_length
        changed = asyncio.Event()
        bias = logit_bias(req, rt.tokenizer.vocab_size)
        params = [sampling_params(req, len(p), context, settings.default_max_tokens, bias) for p in prompts]
        params = await with_structured_output(req, rt.tokenizer, params, settings)
        groups = choices.expand(prompts, params, best_of, changed)
        seqs = [s for g in groups for s in g]
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": rt.name,
                "system_fingerprint": f"{rt.name}:{rt.version}"}  # the model version that answers
        sse = await run_sequences(call, rt, seqs, changed,
                                  (lambda: _stream(rt, groups, changed, meta, req, tracker)) if req.stream else None)
        if sse is not None:
            return sse
        body = {
            **meta,
            "object": "text_completion",
            "choices": [choices.choice(rt.tokenizer, s, i * n + j, bool(req.echo), req.logprobs is not None)
                        for i, g in enumerate(groups) for j, s in enumerate(choices.ranked(g, n))],
            "usage": choices.usage(groups),
        }
        tracker.finish("success")
    with phase("encode"):
        content = json.dumps(body)
    return Response(content, media_type="application/json")


class _SSEResponse(StreamingResponse):
    """A stream that releases its sequences however it ends, even when the client left before the first byte
    (then the body generator never starts, and its own `finally` never runs)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._cleanup()


def _raise_errors(seqs: list[GenSequence]) -> None:
    for s in seqs:
        if s.error is not None:
            raise http_error(s.error)


async def _first_update(seqs: list[GenSequence], changed: asyncio.Event) -> None:
    while not any(s.generated or s.done for s in seqs):
        await changed.wait()
        changed.clear()
    _raise_errors(seqs)


async def _all_done(seqs: list[GenSequence], changed: asyncio.Event) -> None:
    while not all(s.done for s in seqs):
        await changed.wait()
        changed.clear()
    _raise_errors(seqs)


def step_reader(tokenizer: Any, seq: GenSequence) -> StepReader:
    """A sequence's stream of step texts, detokenized incrementally, stop strings held back."""
    stops = [b.decode("utf-8", errors="replace") for b in seq.params.stop]
    return StepReader(seq, IncrementalDetokenizer(tokenizer.decode, seq.prompt, stops, tokenizer.joins_next))


async def _stream(rt: TextRuntime, groups: list[list[GenSequence]], changed: asyncio.Event, meta: dict[str, Any],
                  req: CompletionRequest, tracker: Tracker) -> AsyncIterator[bytes]:
    """Chunks of every choice as their text grows, interleaved, each with its choice index (no best_of here:
    every sequence is a choice)."""
    tok = rt.tokenizer
    seqs = [s for g in groups for s in g]
    opts = req.stream_options or StreamOptions()
    echo, want_lps = bool(req.echo), req.logprobs is not None
    readers = [step_reader(tok, s) for s in seqs]
    sent_finish = [False] * len(seqs)
    sent_tokens = [0] * len(seqs)  # of choices.echoed(s)'s tokens: their logprobs went out
    started = [False] * len(seqs)
    base = {**meta, "object": "text_completion"}
    outcome = "cancelled"  # unless the loop below runs to its end
    try:
        while True:
            _raise_errors(seqs)
            events: list[bytes] = []  # this wake-up's events (one per step and choice), sent in one write
            for i, (s, reader) in enumerate(zip(seqs, readers, strict=True)):
                if sent_finish[i]:
                    continue
                texts, finished = reader.pieces()
                # The echoed prompt goes out in the first chunk, once the prefill gave its logprobs.
                if echo and not started[i] and (s.generated > 0 or s.done):
                    head, covered = texts[0] if texts else ("", 0)
                    texts, started[i] = [(tok.decode(s.prompt) + head, covered), *texts[1:]], True
                for k, (text, covered) in enumerate(texts):
                    ends = finished and k == len(texts) - 1
                    entry: dict[str, Any] = {"index": i, "text": text, "logprobs": None,
                                             "finish_reason": s.finish_reason if ends else None}
                    if want_lps:
                        shown, lps = choices.echoed(s, echo)
                        upto = max(sent_tokens[i], (len(s.prompt) if echo else 0) + covered)
                        entry["logprobs"] = choices.logprobs_object(tok, shown, lps, sent_tokens[i], upto)
                        sent_tokens[i] = upto
                    chunk = {**base, "choices": [entry]}
                    sent_finish[i] = ends
                    if opts.continuous_usage_stats or (all(sent_finish) and not opts.include_usage):
                        chunk["usage"] = choices.usage(groups)  # usage counts even for clients that did not ask
                    events.append(_sse(chunk))
            if all(sent_finish):
                if opts.include_usage:
                    events.append(_sse({**base, "choices": [], "usage": choices.usage(groups)}))
                yield b"".join([*events, b"data: [DONE]\n\n"])
                break
            if events:
                yield b"".join(events)
            await changed.wait()
            changed.clear()
        outcome = "success"
    except ServiceError as exc:
        outcome = exc.outcome
        yield _sse(openai_body(exc.status, exc.message, exc.code))
        yield b"data: [DONE]\n\n"
    finally:
        for s in seqs:
            rt.scheduler.cancel(s)  # a closed stream frees its slot now (no-op for finished sequences)
        tracker.finish(outcome)
