"""`POST /tokenize` and `POST /detokenize`, as vLLM's server names them, for text models.

/tokenize takes `{model, prompt, add_special_tokens}` (the ids /v1/completions feeds the model for that prompt) or
`{model, messages, add_generation_prompt, add_special_tokens}` (the conversation rendered with the model's chat
template as /v1/chat/completions renders it, then encoded) and answers `{count, max_model_len, tokens,
token_strs}`; `return_token_strs` fills token_strs with each token's text (as logprobs name it); a chat's `tools`
are rendered as chat renders them (service.protocols.tools). /detokenize takes `{model, tokens}` and answers
`{prompt}`, special tokens included. `model` may be left out when the server serves one text model. Nothing runs
the model: no scheduler room is asked for. Undeclared fields are judged by `service.protocols.fields` (vLLM's
chat_template, chat_template_kwargs, continue_final_message: 400).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import JSONResponse

from service.base.errors import MODEL_CALL, ServiceError, bad_request, error_responses
from service.base.tracing import phase
from service.engine.runtime import Runtimes, TextRuntime
from service.protocols import choices, fields, prompt_encoding, tools
from service.protocols.chat_api import ChatCompletionRequest, ChatMessage, conversation
from service.protocols.chat_template import ChatTemplateError, render
from service.protocols.endpoint import count_refused, model_call, model_endpoint
from service.protocols.openai_body import openapi_body, read_json_object

router = APIRouter(tags=["tokenizer"])

# vLLM's chat-tokenize fields this server does not implement (the model's own template renders the messages).
TOKENIZE_NOT_SUPPORTED: dict[str, str] = dict(fields.CHAT_NOT_SUPPORTED)


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, min_length=1, max_length=256,
                              description="may be left out when the server serves one text model")
    prompt: str
    add_special_tokens: bool = Field(True, description="as /v1/completions encodes a prompt (the model's BOS, if "
                                                       "its tokenizer adds one)")
    return_token_strs: bool | None = Field(False, description="also each token's text")


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, min_length=1, max_length=256,
                              description="may be left out when the server serves one text model")
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(True, description="end with the assistant's turn (as chat completions)")
    add_special_tokens: bool = Field(False, description="special tokens on top of what the template writes")
    return_token_strs: bool | None = Field(False, description="also each token's text")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools, rendered as chat renders them")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = Field(None, min_length=1, max_length=256,
                              description="may be left out when the server serves one text model")
    tokens: list[int]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


async def _body(request: Request, kinds: tuple[type[BaseModel], ...]) -> tuple[Any, str]:
    """(the body as the first of `kinds`, or the last when it has messages: validated; the model it names), a
    refusal before the model is known counted under the route's label."""
    runtimes: Runtimes = request.app.state.runtimes
    try:
        with phase("preprocess"):
            obj = await read_json_object(request, runtimes)
            kind = kinds[-1] if isinstance(obj, dict) and "messages" in obj else kinds[0]
            try:
                req = kind.model_validate(obj)
            except ValidationError as exc:
                raise RequestValidationError(exc.errors(include_url=False)) from None
        return req, model_name(runtimes, req.model)  # type: ignore[attr-defined]
    except ServiceError as exc:
        count_refused(request.app, request.scope, exc.status)
        raise


def model_name(runtimes: Runtimes, model: str | None) -> str:
    """The model the body names, or the one text model served when it names none."""
    if model is not None:
        return model
    text = [name for name, rt in runtimes.models.items() if isinstance(rt, TextRuntime)]
    if len(text) != 1:
        served = ", ".join(text) or "none"
        raise bad_request(f"model is required: this server serves {len(text)} text models ({served})", "model")
    return text[0]


def tokens_of(rt: TextRuntime, req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
    tok = rt.tokenizer
    if isinstance(req, TokenizeCompletionRequest):
        return tok.encode(req.prompt) if req.add_special_tokens else tok.encode(req.prompt, bos=False)
    if not tok.chat_template:
        raise bad_request(f"model {rt.name!r} has no chat template (tokenizer_config.json has no chat_template); "
                          "tokenize a prompt instead", "model", code="no_chat_template")
    template = tok.chat_template
    plan = tools.read_tools(req.tools, None, None, template=template)
    chat = ChatCompletionRequest.model_construct(model=rt.name, messages=req.messages)
    messages, extra = tools.prepare_messages(conversation(chat), template, plan)
    try:
        text = render(template, messages, tok.special_texts(), add_generation_prompt=req.add_generation_prompt,
                      **extra)
    except ChatTemplateError as exc:
        raise bad_request(f"the model's chat template refused the messages: {exc}", "messages",
                          code="chat_template_error") from None
    return tok.encode(text, bos=req.add_special_tokens)


def _size(req: TokenizeCompletionRequest | TokenizeChatRequest) -> int:
    """Characters to encode (and render): whether to do it on a thread."""
    if isinstance(req, TokenizeCompletionRequest):
        return len(req.prompt)
    return len(req.model_dump_json())


@router.post("/tokenize", response_model=TokenizeResponse, summary="Text or chat messages -> token ids (vLLM's)",
             openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [
                 openapi_body(TokenizeCompletionRequest)["requestBody"]["content"]["application/json"]["schema"],
                 openapi_body(TokenizeChatRequest)["requestBody"]["content"]["application/json"]["schema"]]}}}}},
             responses=error_responses(False, MODEL_CALL))
@model_endpoint("tokenize")
async def tokenize(request: Request) -> JSONResponse:
    req, name = await _body(request, (TokenizeCompletionRequest, TokenizeChatRequest))
    async with model_call(request, name) as call:
        rt = call.runtime(name, TextRuntime)
        fields.refuse_undeclared(req.model_extra, TOKENIZE_NOT_SUPPORTED)
        with phase("tokenize"):
            ids = await prompt_encoding.run(_size(req), tokens_of, rt, req)
        strs = [choices.token_text(rt.tokenizer, t) for t in ids] if req.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": rt.context_length, "tokens": ids,
                             "token_strs": strs})


@router.post("/detokenize", response_model=DetokenizeResponse, summary="Token ids -> text (vLLM's)",
             openapi_extra=openapi_body(DetokenizeRequest), responses=error_responses(False, MODEL_CALL))
@model_endpoint("tokenize")
async def detokenize(request: Request) -> JSONResponse:
    req, name = await _body(request, (DetokenizeRequest,))
    async with model_call(request, name) as call:
        rt = call.runtime(name, TextRuntime)
        fields.refuse_undeclared(req.model_extra, TOKENIZE_NOT_SUPPORTED)
        size = rt.tokenizer.vocab_size
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < size), None)
        if bad is not None:
            raise bad_request(f"tokens.{bad}: token id {req.tokens[bad]} is outside the vocabulary (0..{size - 1})",
                              "tokens")
        with phase("tokenize"):
            text = await prompt_encoding.run(len(req.tokens), rt.tokenizer.decode, req.tokens, False)
        return JSONResponse({"prompt": text})
