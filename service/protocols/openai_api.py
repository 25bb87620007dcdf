"""OpenAI-compatible endpoints: `GET /v1/models` and `POST /v1/completions` (with SSE streaming).

Field names, defaults, the error shape and the stream format (`data: {chunk}` events ending in
`data: [DONE]`) are OpenAI's, so the official client works unchanged. logprobs, echo, n and best_of work as
OpenAI's legacy completions API has them (`service.protocols.choices`), with vLLM's extensions ignore_eos, min_tokens,
repetition_penalty and stream_options.continuous_usage_stats (docs/SERVICE.md has the table); presence_penalty,
frequency_penalty and logit_bias as OpenAI defines them (service.engine.text.sampler applies them).
Options this server cannot
honour (suffix, tools, unknown fields: `service.protocols.fields`) are refused with 400 rather than silently ignored;
structured output (response_format, guided_*) is `service.protocols.structured`.

A completion is read (`service.protocols.openai_body`), its prompts encoded, its body built into a
`GenerationRequest` (`service.protocols.generation_request`) and answered by `service.protocols.generation`, in
the shape `CompletionFormat` gives its choices and chunks.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response

from models.onnx_contract import attention_function, output_function
from models.tokenizer import TextTokenizer
from service.base.errors import LOOKUP, MODEL_CALL, bad_request, error_responses
from service.base.tracing import phase
from service.engine.runtime import ModelRuntime, Runtimes, TextRuntime
from service.engine.text import GenSequence
from service.protocols import choices, fields, generation, generation_request, prompt_encoding
from service.protocols.endpoint import model_call, model_endpoint
from service.protocols.generation_request import GenerationRequest
from service.protocols.openai_body import SamplingExtensions, Stop, StreamOptions, openapi_body, read_text_body

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
    # A Hugging Face folder served from its cached onnxruntime-genai export (service.engine.folder_export): the source
    # folder's name, the cache key, when it was exported and its validation verdict
    served_from: dict[str, Any] | None = None
    # A Hugging Face folder: which backend serves it now and why (service.engine.export_status), e.g. PyTorch while
    # its export runs in the background, the export once it passed, PyTorch with the reason its export failed
    serving: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


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


# ---- completions: the body -> token ids -----------------------------------------------------------------


def _unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise bad_request("suffix is not supported by this server", "suffix", code="unsupported_parameter")
    fields.refuse_undeclared(req.model_extra)


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


# ---- completions ----------------------------------------------------------------------------------------


COMPLETION_BODY = openapi_body(CompletionRequest)


@router.post("/v1/completions", response_model=Completion, summary="Text completion (OpenAI), streamed with SSE",
             openapi_extra=COMPLETION_BODY,
             responses={200: {"content": {"text/event-stream": {}}, "description": "a completion, or its stream"},
                        **error_responses(False, MODEL_CALL)})
@model_endpoint("completions")
async def completions(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    settings = runtimes.settings
    req = await read_text_body(request, runtimes, CompletionRequest, token_prompt=True)
    async with model_call(request, req.model, finish=False) as call:
        rt = call.runtime(req.model, TextRuntime)
        _unsupported(req)
        with phase("tokenize"):
            prompts = await prompt_encoding.run(_prompt_size(req.prompt), prompts_of, req, rt,
                                                settings.max_prompts_per_request)
        options = req.options(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                              top_k=req.top_k, n=req.n, best_of=req.best_of, stop=req.stop, seed=req.seed,
                              logprobs=req.logprobs, echo=bool(req.echo), stream=bool(req.stream),
                              stream_options=req.stream_options)
        gen = await generation_request.build(prompts, options, rt, settings,
                                             default_max_tokens=settings.default_max_tokens)
        return await generation.respond(call, rt, gen, CompletionFormat(rt.tokenizer, gen))


class CompletionFormat(generation.ResponseFormat):
    """A completion's choices as OpenAI's legacy completions API has them: the text (after the echoed prompt) and
    its `logprobs` object; a chunk carries the choice's new text."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"
    usage_on_last_chunk = True

    def __init__(self, tokenizer: TextTokenizer, request: GenerationRequest) -> None:
        self.tokenizer, self.echo, self.logprobs = tokenizer, request.echo, request.logprobs is not None
        self.started: dict[int, bool] = {}  # choice -> its echoed prompt went out
        self.sent_tokens: dict[int, int] = {}  # choice -> of choices.echoed(s)'s tokens, those whose logprobs went out

    def choice(self, index: int, seq: GenSequence) -> dict[str, Any]:
        return choices.choice(self.tokenizer, seq, index, self.echo, self.logprobs)

    def entries(self, index: int, seq: GenSequence, texts: list[tuple[str, int]],
                finished: bool) -> list[dict[str, Any]]:
        tok, echo = self.tokenizer, self.echo
        # The echoed prompt goes out in the first chunk, once the prefill gave its logprobs.
        if echo and not self.started.get(index) and (seq.generated > 0 or seq.done):
            head, covered = texts[0] if texts else ("", 0)
            texts, self.started[index] = [(tok.decode(seq.prompt) + head, covered), *texts[1:]], True
        out = []
        for k, (text, covered) in enumerate(texts):
            ends = finished and k == len(texts) - 1
            entry: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                     "finish_reason": seq.finish_reason if ends else None}
            if self.logprobs:
                shown, lps = choices.echoed(seq, echo)
                sent = self.sent_tokens.get(index, 0)
                upto = max(sent, (len(seq.prompt) if echo else 0) + covered)
                entry["logprobs"] = choices.logprobs_object(tok, shown, lps, sent, upto)
                self.sent_tokens[index] = upto
            out.append(entry)
        return out
