"""What the bodies of the OpenAI text endpoints (/v1/completions, /v1/chat/completions) share: the sampling fields
beyond OpenAI's basics (`SamplingExtensions`, with `options`, their engine-neutral form), `stream_options`, and
reading a body: room first (an engine `QueueFull` is a 429 before the body is read), the body bounded, strict
JSON whose every text is valid Unicode, then validated; a refusal before the model is known is counted under the
route's label.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from service.base.bodies import JSON, read_body, require_media
from service.base.errors import ServiceError, bad_request
from service.base.jsonio import check_size, loads
from service.base.tracing import phase
from service.engine.engine_errors import EngineError
from service.engine.runtime import Runtimes, TextRuntime
from service.engine.text.sampler import MAX_LOGIT_BIAS
from service.protocols import request_text
from service.protocols.endpoint import count_refused
from service.protocols.engine_status import http_error
from service.protocols.generation_request import SamplingOptions

BodyT = TypeVar("BodyT", bound=BaseModel)

Stop = Annotated[str, Field(max_length=256)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = Field(default=False, description="extension (vLLM): usage so far in every chunk")


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

    def options(self, *, max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
                n: int | None, best_of: int | None, stop: str | list[str] | None, seed: int | None,
                logprobs: int | None, echo: bool, stream: bool, stream_options: StreamOptions | None
                ) -> SamplingOptions:
        """The body's sampling fields as every text endpoint gives them to the engine: these and the endpoint's
        own (named as /v1/completions names them)."""
        usage = stream_options or StreamOptions()
        return SamplingOptions(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n, best_of=best_of,
            stop=stop, seed=seed, logprobs=logprobs, echo=echo, ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.logit_bias, structured=dict(self), stream=stream, include_usage=usage.include_usage,
            continuous_usage=usage.continuous_usage_stats)


def openapi_body(body: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra` documenting its JSON body (the route reads the body itself)."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": _inline_refs(body.model_json_schema())}}}}


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


async def read_text_body(request: Request, runtimes: Runtimes, body: type[BodyT], *,
                         token_prompt: bool = False) -> BodyT:
    """A text route's body as `body`, read and validated after checking there is room for it (a refusal before the
    model is known is counted under the route's label). `token_prompt`: its `prompt` may be token ids, bounded by
    the named model's context before validation walks them."""
    try:
        text_models_full(runtimes)
        with phase("preprocess"):
            obj = await read_json_object(request, runtimes)
            if token_prompt:
                _refuse_long_token_prompt(obj, runtimes)
            try:
                return body.model_validate(obj)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors(include_url=False)) from None
    except ServiceError as exc:
        count_refused(request.app, request.scope, exc.status)
        raise


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


def _refuse_long_token_prompt(obj: Any, runtimes: Runtimes) -> None:
    """Cheap look at the raw prompt before validation: no prompt may hold more token ids than the context (nor
    more prompts than allowed), so millions of ids are refused before pydantic walks them."""
    model = obj.get("model") if isinstance(obj, dict) else None
    rt = runtimes.models.get(model) if isinstance(model, str) else None
    if not isinstance(rt, TextRuntime):
        return
    limit = max(rt.context_length, runtimes.settings.max_prompts_per_request)
    prompt = obj.get("prompt")
    if isinstance(prompt, list) and (len(prompt) > limit or any(isinstance(p, list) and len(p) > limit
                                                                for p in prompt)):
        raise bad_request(f"prompt holds more token ids (or prompts) than this model's context of "
                          f"{rt.context_length} tokens", "prompt", code="context_length_exceeded")
