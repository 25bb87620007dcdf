"""The routes: `POST /v1/responses` (a chat completion in the Responses envelope), `GET` and
`DELETE /v1/responses/{id}` over the kept ones."""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from service.base.errors import LOOKUP, MODEL_CALL, ServiceError, error_responses
from service.base.tracing import phase
from service.engine.runtime import Runtimes, TextRuntime
from service.protocols import generation, generation_request, prompt_encoding, tools
from service.protocols.chat_api import chat_prompt
from service.protocols.endpoint import model_call, model_endpoint
from service.protocols.openai_body import openapi_body, read_text_body
from service.protocols.responses.answer import ResponsesFormat
from service.protocols.responses.schema import ResponsesRequest, unsupported_fields
from service.protocols.responses.store import find, store_of
from service.protocols.responses.translate import (
    chat_request,
    input_messages,
    renamed,
    sampling_options,
    size_of,
    text_format,
    tool_plan,
)

router = APIRouter(tags=["openai"])



@router.post("/v1/responses", summary="Response (OpenAI's Responses API), streamed with SSE",
             openapi_extra=openapi_body(ResponsesRequest),
             responses={200: {"content": {"text/event-stream": {}}, "description": "a response, or its events"},
                        **error_responses(False, MODEL_CALL)})
@model_endpoint("responses")
async def create_response(request: Request) -> Response:
    runtimes: Runtimes = request.app.state.runtimes
    settings = runtimes.settings
    req = await read_text_body(request, runtimes, ResponsesRequest)
    async with model_call(request, req.model, finish=False) as call:
        rt = call.runtime(req.model, TextRuntime)
        unsupported_fields(req)
        fmt = text_format(req.text)
        store = store_of(request.app)
        earlier = [] if req.previous_response_id is None else \
            find(store, req.previous_response_id, "previous_response_id").conversation
        given = input_messages(req.input, earlier)
        system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
        messages = system + earlier + given
        chat = chat_request(req.model, messages)
        options = sampling_options(req, fmt)
        try:
            plan = tool_plan(req, rt)
            plan = tools.refuse_conflicts(plan, options.structured)
            with phase("tokenize"):
                prompt = await prompt_encoding.run(size_of(messages) + len(str(req.tools or "")), chat_prompt, rt,
                                                   chat, plan)
            # a conversation too long for the context is blamed on the input
            gen = await generation_request.build([prompt], options, rt, settings, default_max_tokens=rt.context_length,
                                                 prompt_field="input",
                                                 constraint=tools.constraint(plan, rt.tokenizer, settings))
        except ServiceError as exc:
            raise renamed(exc) from None
        keep = None
        if req.store is not False:
            def keep(response: dict[str, Any], reply: dict[str, Any]) -> None:
                store.put(response, [*earlier, *given, reply])
        echo: dict[str, Any] = {
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p, "text": {"format": fmt},
            "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "truncation": "disabled",
            "top_logprobs": req.top_logprobs, "user": req.user, "metadata": req.metadata or {}}
        return await generation.respond(call, rt, gen, ResponsesFormat(rt.tokenizer, gen, echo, keep, plan))


@router.get("/v1/responses/{response_id}", summary="A kept response (OpenAI's Responses API)",
            responses=error_responses(False, LOOKUP))
async def get_response(response_id: str, request: Request) -> Response:
    kept = find(store_of(request.app), response_id, None)
    return Response(json.dumps(kept.response), media_type="application/json")


@router.delete("/v1/responses/{response_id}", summary="Forget a kept response (OpenAI's Responses API)",
               responses=error_responses(False, LOOKUP))
async def delete_response(response_id: str, request: Request) -> Response:
    store = store_of(request.app)
    find(store, response_id, None)
    store.delete(response_id)
    return Response(json.dumps({"id": response_id, "object": "response", "deleted": True}),
                    media_type="application/json")

