"""`POST /v1/responses` (OpenAI's Responses API), with `GET` and `DELETE /v1/responses/{id}` over the responses
this server keeps, for text models with a chat template.

A response is a chat completion in another envelope: the body's `instructions` (a system message first), its
`input` (a string, or items: messages whose content is a string or `input_text` / `output_text` parts, the
model's earlier `function_call`s and their `function_call_output`s) and, with `previous_response_id`, the
conversation of a response this server kept, become chat messages; they are rendered with the model's chat
template as /v1/chat/completions renders them (`service.protocols.chat_api.chat_prompt`, function tools through
`service.protocols.tools`), built into a `GenerationRequest` (max_output_tokens, temperature, top_p; `text.format`
as chat's `response_format`: structured output) and run by `service.protocols.generation`, whose answer
`ResponsesFormat` shapes: one response object (`output`: an assistant message with one `output_text` part and/or
`function_call` items; `status` completed, or incomplete with `incomplete_details` when max_output_tokens ended
it), or a stream of the Responses events, each with its `sequence_number` (`event:` lines name them; no `[DONE]`).

Kept responses (`store`, true unless the body says false, as OpenAI's): the last MAX_STORED of them, within
MAX_STORED_CHARS of conversation, in this server process's memory (lost on restart; each replica has its own). A
response's kept conversation is its input (without its instructions, which OpenAI does not carry over) and its
output. Undeclared fields are judged by `service.protocols.fields` as on chat (RESPONSES_NOT_SUPPORTED).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.responses import Response

from models.tokenizer import TextTokenizer
from service.base.errors import LOOKUP, MODEL_CALL, ServiceError, bad_request, error_responses, shown
from service.base.tracing import phase
from service.engine.runtime import Runtimes, TextRuntime
from service.engine.text import GenSequence, IncrementalDetokenizer
from service.protocols import fields, generation, generation_request, prompt_encoding, tools
from service.protocols.chat_api import ChatCompletionRequest, chat_prompt, chat_template, logprobs_content
from service.protocols.endpoint import model_call, model_endpoint
from service.protocols.generation_request import GenerationRequest, SamplingOptions
from service.protocols.openai_body import openapi_body, read_text_body
from service.protocols.stream_steps import StepReader
from service.protocols.tool_parser import CallParser, Delta, ToolCall

router = APIRouter(tags=["openai"])
MAX_TOP_LOGPROBS = 20  # OpenAI's bound
MAX_STORED = 1000  # responses kept for previous_response_id and GET
MAX_STORED_CHARS = 64 * 1024 * 1024  # their conversations (as JSON), together
LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Input message roles -> chat roles (a chat template knows no "developer": it is the system's voice).
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text")
# The keys of each input item (an output item sent back as input too); any other key must be null.
MESSAGE_KEYS = frozenset({"type", "role", "content", "id", "status", "phase"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
CALL_KEYS = frozenset({"type", "call_id", "name", "arguments", "id", "status"})
OUTPUT_KEYS = frozenset({"type", "call_id", "output", "id", "status", "name"})

# Undeclared fields that change nothing this server returns (on top of fields.NO_EFFECT).
RESPONSES_NO_EFFECT = frozenset({"safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                                 "stream_options"})
# Known Responses fields that change the output and are not implemented (on top of fields.NOT_SUPPORTED's).
RESPONSES_NOT_SUPPORTED: dict[str, str] = {
    **{k: v for k, v in fields.NOT_SUPPORTED.items() if k != "top_logprobs"},
    "reasoning": "not supported by this server (its models do not reason apart)",
    "prompt": "not supported by this server (no stored prompt templates); give instructions and input",
    "conversation": "not supported by this server; use previous_response_id",
    "context_management": "not supported by this server",
    "max_tool_calls": "not supported by this server (parallel_tool_calls: false allows one call)",
    "max_tokens": "not a Responses field: use max_output_tokens",
    "messages": "not a Responses field: use input",
    "response_format": "not a Responses field: use text.format",
}


class ResponsesRequest(BaseModel):
    # Strict: "10", "true" are not numbers or booleans. Undeclared fields: service.protocols.fields (those that change
    # nothing pass; known unimplemented ones are 400 unsupported_parameter, anything else 400 unknown_parameter).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]] = Field(
        description="a string (one user message), or items: messages {role, content} (content a string or "
                    "input_text / output_text parts), function_call and function_call_output items")
    instructions: str | None = Field(None, description="a system message before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="default: what fits the context")
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    stream: bool | None = False
    store: bool | None = Field(None, description="keep the response for previous_response_id and GET (default "
                                                 "true; in this process's memory, the last 1,000)")
    previous_response_id: str | None = Field(None, max_length=256, description="continue that kept response's "
                                                                               "conversation")
    text: dict[str, Any] | None = Field(None, description='{"format": {"type": "text"}, {"type": "json_object"} or '
                                                          '{"type": "json_schema", "name": ..., "schema": {...}}}')
    include: list[str] | None = Field(None, description=f'["{LOGPROBS_INCLUDE}"]: the output tokens\' logprobs')
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, description='function tools: {"type": "function", "name": ..., '
                                                                 '"description": ..., "parameters": {...}}')
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none", "auto", "required" or {"type": '
                                                                       '"function", "name": ...}')
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16, description="returned as given")
    truncation: Literal["auto", "disabled"] | None = Field(None, description='"auto" is not supported')
    background: bool | None = Field(None, description="true is not supported")
    user: str | None = None


# ---- the body -> chat messages --------------------------------------------------------------------------------


def unsupported_fields(req: ResponsesRequest) -> None:
    """400 naming the first field this server cannot honour (never accepted and ignored)."""
    extra = {k: v for k, v in (req.model_extra or {}).items() if k not in RESPONSES_NO_EFFECT}
    fields.refuse_undeclared(extra, RESPONSES_NOT_SUPPORTED)
    if req.truncation == "auto":
        raise bad_request('truncation "auto" is not supported by this server: an input over the context is refused',
                          "truncation", code="unsupported_parameter")
    if req.background:
        raise bad_request("background responses are not supported by this server", "background",
                          code="unsupported_parameter")
    for item in req.include or []:
        if item != LOGPROBS_INCLUDE:
            raise bad_request(f"include: {shown(item)} is not supported by this server (only {LOGPROBS_INCLUDE})",
                              "include", code="unsupported_parameter")


def tool_plan(req: ResponsesRequest, rt: TextRuntime) -> tools.ToolPlan | None:
    """The body's function tools (service.protocols.tools, in the Responses API's flat shape). Without tools,
    tool_choice "none" or "auto" and parallel_tool_calls change nothing and pass (a Responses body carries them
    by default); "required" or a named function is a 400."""
    if not req.tools:
        choice = None if req.tool_choice == "auto" else req.tool_choice
        return tools.read_tools(None, choice, None, template=rt.tokenizer.chat_template)
    return tools.read_tools(req.tools, req.tool_choice, req.parallel_tool_calls, template=chat_template(rt))


def _known(item: Mapping[str, Any], keys: frozenset[str], at: str, what: str) -> None:
    extra = sorted(k for k, v in item.items() if k not in keys and v is not None)
    if extra:
        raise bad_request(f"{at}: unknown field {shown(extra[0])} in {what}", f"{at}.{extra[0]}",
                          code="unknown_parameter")


def _text_of(content: Any, at: str) -> str:
    """A message item's content (or a call output) as one text: a string, or its text parts joined by newlines
    (as chat's)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at} must be a string or a list of input_text / output_text parts", at)
    texts = []
    for j, part in enumerate(content):
        where = f"{at}.{j}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad_request(f"{where}: only text parts (input_text, output_text) are supported, not "
                              f"{shown(str(kind), 32)}", where, code="unsupported_parameter")
        _known(part, PART_KEYS, where, "a text part")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.text: a text part's text must be a string", f"{where}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: Mapping[str, Any], key: str, at: str, limit: int | None = 256) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value or (limit is not None and len(value) > limit):
        bound = f" of at most {limit} characters" if limit is not None else ""
        raise bad_request(f"{at}.{key} must be a non-empty string{bound}", f"{at}.{key}")
    return value


def _message(item: dict[str, Any], at: str) -> dict[str, Any]:
    _known(item, MESSAGE_KEYS, at, "a message item")
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"{at}.role must be one of {', '.join(ROLES)}, not {shown(str(role), 32)}", f"{at}.role")
    if "content" not in item:
        raise bad_request(f"{at}.content is missing", f"{at}.content")
    return {"role": ROLES[role], "content": _text_of(item["content"], f"{at}.content")}


def _call(item: dict[str, Any], at: str) -> dict[str, Any]:
    """A function_call item (a call the model made) as chat's tool call."""
    _known(item, CALL_KEYS, at, "a function_call item")
    call_id, name = _string(item, "call_id", at), _string(item, "name", at)
    if not isinstance(item.get("arguments"), str):
        raise bad_request(f"{at}.arguments must be the arguments' JSON text", f"{at}.arguments")
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": item["arguments"]}}


def _call_output(item: dict[str, Any], at: str, called: set[str]) -> dict[str, Any]:
    """A function_call_output item (a call's result) as chat's tool message."""
    _known(item, OUTPUT_KEYS, at, "a function_call_output item")
    call_id = _string(item, "call_id", at)
    if call_id not in called:
        raise bad_request(f"{at}.call_id: no earlier function_call has call_id {shown(call_id)}", f"{at}.call_id")
    if "output" not in item:
        raise bad_request(f"{at}.output is missing", f"{at}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": _text_of(item["output"], f"{at}.output")}


def calls_in(messages: Sequence[Mapping[str, Any]]) -> set[str]:
    return {c["id"] for m in messages for c in m.get("tool_calls") or ()}


def input_messages(items: str | list[dict[str, Any]], earlier: Sequence[Mapping[str, Any]] = ()
                   ) -> list[dict[str, Any]]:
    """The body's `input` as chat messages: messages {role, content}, function_call items as the tool_calls of
    an assistant message (the one before them, or a new one: the calls of one turn together), function_call_output
    items as tool messages answering a call made earlier (in `earlier` or in the input); 400 naming the item
    (input.3.content.0) otherwise."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise bad_request("input is empty: give a string or at least one item", "input", code="empty_prompt")
    out: list[dict[str, Any]] = []
    called = calls_in(earlier)
    for i, item in enumerate(items):
        at = f"input.{i}"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            call = _call(item, at)
            called.add(call["id"])
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*(out[-1].get("tool_calls") or ()), call]}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(_call_output(item, at, called))
        else:
            raise bad_request(f"{at}.type: {shown(str(kind), 32)} items are not supported by this server (message, "
                              "function_call and function_call_output items are)", f"{at}.type",
                              code="unsupported_parameter")
    return out


FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"},
               "json_schema": {"type", "name", "schema", "strict", "description"}}


def text_format(text: Mapping[str, Any] | None) -> dict[str, Any]:
    """The body's `text.format` (default {"type": "text"}), checked: 400 naming text.format.<field>."""
    if text is None:
        return {"type": "text"}
    for key, value in text.items():
        if key == "verbosity" and value not in (None, "medium"):
            raise bad_request("text.verbosity is not supported by this server", "text.verbosity",
                              code="unsupported_parameter")
        if key not in ("format", "verbosity"):
            raise bad_request(f"unknown field {shown(key)} in text", f"text.{key}", code="unknown_parameter")
    fmt = text.get("format")
    if fmt is None:
        return {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", "text.format")
    kind = fmt.get("type")
    allowed = FORMAT_KEYS.get(kind) if isinstance(kind, str) else None
    if allowed is None:
        raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', not "
                          f"{shown(str(kind), 32)}", "text.format.type")
    extra = sorted(set(fmt) - allowed)
    if extra:
        raise bad_request(f"unknown field {shown(extra[0])} in text.format", f"text.format.{extra[0]}",
                          code="unknown_parameter")
    if kind == "json_schema":
        name = fmt.get("name")
        if not isinstance(name, str) or not 1 <= len(name) <= 64:
            raise bad_request("text.format.name must be a string of 1 to 64 characters", "text.format.name")
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        if fmt.get("strict") is not None and not isinstance(fmt["strict"], bool):
            raise bad_request("text.format.strict must be a boolean", "text.format.strict")
        if fmt.get("description") is not None and not isinstance(fmt["description"], str):
            raise bad_request("text.format.description must be a string", "text.format.description")
    return dict(fmt)


def response_format(fmt: Mapping[str, Any]) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (service.protocols.structured), None for plain text."""
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"],
                                                       "strict": fmt.get("strict")}}
    return None


# What a shared check names in chat's or completions' terms, renamed to this body's fields.
RENAMED = (("response_format.json_schema.schema", "text.format.schema"), ("response_format.json_schema", "text.format"),
           ("response_format.type", "text.format.type"), ("response_format", "text.format"),
           ("max_tokens", "max_output_tokens"), ("messages", "input"))


def renamed(exc: ServiceError) -> ServiceError:
    """`exc` (a chat or completions check's 400) naming this body's field."""
    param, message = exc.param, exc.message
    for old, new in RENAMED:
        if param is not None and (param == old or param.startswith(old + ".")):
            param = new + param[len(old):]
            if old.startswith("response_format"):
                message = message.replace(old, new)
            break
    return ServiceError(exc.status, message, code=exc.code, param=param, headers=exc.headers)


def chat_request(model: str, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The conversation as a chat completion's body: rendered by chat's own path."""
    try:
        return ChatCompletionRequest.model_validate({"model": model, "messages": messages})
    except ValidationError as exc:  # input_messages gives only what chat accepts
        raise bad_request(f"input: {exc.errors()[0]['msg']}", "input") from None


def sampling_options(req: ResponsesRequest, fmt: Mapping[str, Any]) -> SamplingOptions:
    """The body's sampling fields in /v1/completions' terms."""
    wanted = LOGPROBS_INCLUDE in (req.include or []) or bool(req.top_logprobs)
    logprobs = (req.top_logprobs or 0) if wanted else None
    structured = response_format(fmt)
    return SamplingOptions(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p, n=1,
                           logprobs=logprobs, structured={"response_format": structured} if structured else {},
                           stream=bool(req.stream))


def _size(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of the conversation (the template adds a few per message): how long rendering it takes."""
    return sum(64 + len(m.get("content") or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls")
                                                       or ()) for m in messages)


# ---- kept responses -------------------------------------------------------------------------------------------


@dataclass
class Kept:
    response: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its input and output as chat messages, without its instructions
    chars: int


class ResponseStore:
    """The last responses answered with store on, for previous_response_id and GET: at most `max_responses`,
    their conversations (as JSON) within `max_chars` (least recently used first out)."""

    def __init__(self, max_responses: int = MAX_STORED, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._kept: OrderedDict[str, Kept] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = len(json.dumps(conversation))
        if chars > self.max_chars:
            return
        self.delete(response["id"])
        self._kept[response["id"]] = Kept(response, conversation, chars)
        self.chars += chars
        while len(self._kept) > self.max_responses or self.chars > self.max_chars:
            _, old = self._kept.popitem(last=False)
            self.chars -= old.chars

    def get(self, response_id: str) -> Kept | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self.chars -= kept.chars
        return kept is not None


def store_of(app: Any) -> ResponseStore:
    """The app's store of kept responses (service.edge.app.create_app makes it)."""
    store: ResponseStore = app.state.responses
    return store


def _kept(store: ResponseStore, response_id: str, param: str | None) -> Kept:
    kept = store.get(response_id)
    if kept is None:
        raise ServiceError(404, f"response {shown(response_id)} not found: this server keeps the last "
                                f"{store.max_responses} responses answered with store on, in its memory",
                           code="response_not_found", param=param)
    return kept


# ---- the routes -----------------------------------------------------------------------------------------------


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
            _kept(store, req.previous_response_id, "previous_response_id").conversation
        given = input_messages(req.input, earlier)
        system = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
        messages = system + earlier + given
        chat = chat_request(req.model, messages)
        options = sampling_options(req, fmt)
        try:
            plan = tool_plan(req, rt)
            plan = tools.refuse_conflicts(plan, options.structured)
            with phase("tokenize"):
                prompt = await prompt_encoding.run(_size(messages) + len(str(req.tools or "")), chat_prompt, rt,
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
    kept = _kept(store_of(request.app), response_id, None)
    return Response(json.dumps(kept.response), media_type="application/json")


@router.delete("/v1/responses/{response_id}", summary="Forget a kept response (OpenAI's Responses API)",
               responses=error_responses(False, LOOKUP))
async def delete_response(response_id: str, request: Request) -> Response:
    store = store_of(request.app)
    _kept(store, response_id, None)
    store.delete(response_id)
    return Response(json.dumps({"id": response_id, "object": "response", "deleted": True}),
                    media_type="application/json")


# ---- the answer -----------------------------------------------------------------------------------------------


def _event(body: dict[str, Any]) -> bytes:
    """One Server-Sent Event as OpenAI's Responses stream writes it: its type on the `event:` line."""
    return b"event: " + body["type"].encode() + b"\ndata: " + generation.event_json(body) + b"\n\n"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesFormat(generation.ResponseFormat):
    """A generation's answer as a Responses object: an assistant message with one output_text part, and with
    tools that may be called (`plan`) the reply split into its content (the message, when it has any) and its
    calls (`function_call` items; service.protocols.tools). A stream sends response.created and
    response.in_progress, then each output item as it begins (response.output_item.added; a message's
    content_part.added), its text one decode step at a time (response.output_text.delta) or a call's arguments
    (response.function_call_arguments.delta), then each item's ends (output_text.done, content_part.done or
    function_call_arguments.done; output_item.done) and response.completed (response.incomplete when
    max_output_tokens ended it). An engine error after the first event ends the stream with `error` and
    `response.failed`. Every event has its sequence_number."""

    object = "response"
    chunk_object = "response"
    id_prefix = "resp"
    done: ClassVar[bytes] = b""  # a Responses stream ends with its last event

    def __init__(self, tokenizer: TextTokenizer, request: GenerationRequest, echo: dict[str, Any],
                 keep: Callable[[dict[str, Any], dict[str, Any]], None] | None,
                 plan: tools.ToolPlan | None = None) -> None:
        self.tokenizer, self.top, self.echo, self.keep = tokenizer, request.logprobs, echo, keep
        self.plan = plan if plan is not None and plan.calls else None
        self.own_decode = tools.decoder(self.plan, tokenizer)  # None: the tokenizer's own decode keeps the trigger
        self.decode = self.own_decode or tokenizer.decode
        self.id = _new_id("resp")
        self.created, self.model = int(time.time()), ""
        self.sequence = 0  # the next event's sequence_number
        # a stream's output items so far, in output order: the message's text in its part, a call's arguments
        self.items: list[dict[str, Any]] = []
        self.message: int | None = None  # the message's output_index, once it began
        self.calls: dict[int, int] = {}  # the parser's call index -> its output_index
        self.parser: CallParser | None = None if self.plan is None else self.plan.parser()
        self.sent_tokens = 0  # generated tokens whose logprobs went out

    def start(self, meta: dict[str, Any]) -> None:
        self.created, self.model = meta["created"], meta["model"]

    def reader(self, tokenizer: TextTokenizer, seq: GenSequence) -> StepReader:
        if self.own_decode is None:
            return super().reader(tokenizer, seq)
        stops = [b.decode("utf-8", errors="replace") for b in seq.params.stop]
        return StepReader(seq, IncrementalDetokenizer(self.own_decode, seq.prompt, stops, tokenizer.joins_next))

    # -- objects

    def _logprobs(self, seq: GenSequence, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        return [] if self.top is None else logprobs_content(self.tokenizer, seq.tokens, seq.logprobs, self.top,
                                                            start, end)

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    @staticmethod
    def _message_item(status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": content}

    @staticmethod
    def _call_item(call: ToolCall, status: str) -> dict[str, Any]:
        return {"id": _new_id("fc"), "type": "function_call", "status": status, "call_id": call.id,
                "name": call.name, "arguments": call.arguments}

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "error": error, "incomplete_details": None if incomplete is None else {"reason": incomplete},
                "model": self.model, "output": output, **self.echo, "reasoning": None, "usage": usage}

    def finished(self, seq: GenSequence, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The whole response of a finished sequence whose output items are `output` (kept when asked for)."""
        prompt = len(seq.prompt)
        usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": seq.generated, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": prompt + seq.generated}
        incomplete = "max_output_tokens" if seq.finish_reason == "length" else None
        body = self.response("incomplete" if incomplete else "completed", output, usage, incomplete)
        if self.keep is not None:
            content = next((i["content"][0]["text"] for i in output if i["type"] == "message"), None)
            reply: dict[str, Any] = {"role": "assistant", "content": content}
            calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"],
                                                                            "arguments": i["arguments"]}}
                     for i in output if i["type"] == "function_call" and i["status"] == "completed"]
            if calls:
                reply["tool_calls"] = calls
            elif content is None:
                reply["content"] = ""
            self.keep(body, reply)
        return body

    def _status(self, seq: GenSequence) -> str:
        return "incomplete" if seq.finish_reason == "length" else "completed"

    # -- the whole answer

    def _output(self, seq: GenSequence) -> list[dict[str, Any]]:
        text = self.decode(seq.tokens) + seq.stop_tail.decode("utf-8", "replace")
        status = self._status(seq)
        if self.plan is None:
            return [self._message_item(status, [self._part(text, self._logprobs(seq))])]
        parsed = tools.parse(text, self.plan)
        output = [] if parsed.content is None else \
            [self._message_item(status, [self._part(parsed.content, self._logprobs(seq))])]
        return output + [self._call_item(c, "completed") for c in parsed.calls]

    def choice(self, index: int, seq: GenSequence) -> dict[str, Any]:
        return self._output(seq)[0]

    def answer(self, meta: dict[str, Any], returned: list[tuple[int, GenSequence]],
               usage: dict[str, int]) -> dict[str, Any]:
        ((_, seq),) = returned  # n is 1
        return self.finished(seq, self._output(seq))

    # -- the stream

    def opening(self, index: int) -> list[dict[str, Any]]:
        head = self.response("in_progress", [])
        out = [{"type": "response.created", "response": head}, {"type": "response.in_progress", "response": head}]
        return out if self.plan is not None else out + self._open_message()  # with tools: once it has content

    def _open_message(self) -> list[dict[str, Any]]:
        self.message = len(self.items)
        item = self._message_item("in_progress", [])
        self.items.append({**item, "content": [self._part("", [])]})
        return [{"type": "response.output_item.added", "output_index": self.message, "item": item},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": self.message,
                 "content_index": 0, "part": self._part("", [])}]

    def _news(self, delta: Delta, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The events of one piece of the reply: text of the message, a call that begins, a call's arguments."""
        if delta.kind == "content":
            if not delta.text:
                return []
            out = self._open_message() if self.message is None else []
            assert self.message is not None
            item = self.items[self.message]
            item["content"][0]["text"] += delta.text
            return [*out, {"type": "response.output_text.delta", "item_id": item["id"], "output_index": self.message,
                           "content_index": 0, "delta": delta.text, "logprobs": logprobs}]
        if delta.kind == "call":
            index = self.calls[delta.index] = len(self.items)
            item = self._call_item(ToolCall(delta.id, delta.name), "in_progress")
            self.items.append(item)
            return [{"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        index = self.calls[delta.index]
        self.items[index]["arguments"] += delta.text
        return [{"type": "response.function_call_arguments.delta", "item_id": self.items[index]["id"],
                 "output_index": index, "delta": delta.text}]

    def entries(self, index: int, seq: GenSequence, texts: list[tuple[str, int]],
                finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for k, (text, covered) in enumerate(texts):
            lps = self._logprobs(seq, self.sent_tokens, covered)
            self.sent_tokens = max(self.sent_tokens, covered)
            last = finished and k == len(texts) - 1
            deltas = [Delta("content", text)] if self.parser is None else self.parser.feed(text, final=last)
            for j, delta in enumerate(deltas):  # a step's logprobs ride on its first piece of text
                out += self._news(delta, lps if j == 0 and delta.kind == "content" else [])
        if finished:
            if self.parser is not None and not texts:
                for delta in self.parser.feed("", final=True):
                    out += self._news(delta, [])
            out += self._closing(seq)
        return out

    def _closing(self, seq: GenSequence) -> list[dict[str, Any]]:
        """The events that end every output item, then the response's."""
        out = self._open_message() if not self.items else []  # an empty reply is an empty message
        status = self._status(seq)
        complete = {self.calls[c] for c, call in enumerate(self.parser.calls) if call.complete} if self.parser \
            else set()
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                part = {**item["content"][0], "logprobs": self._logprobs(seq)}
                item.update(status=status, content=[part])
                where = {"item_id": item["id"], "output_index": index, "content_index": 0}
                out += [{"type": "response.output_text.done", **where, "text": part["text"],
                         "logprobs": part["logprobs"]},
                        {"type": "response.content_part.done", **where, "part": part}]
            else:
                item["status"] = "completed" if index in complete else "incomplete"
                out.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                            "output_index": index, "arguments": item["arguments"]})
            out.append({"type": "response.output_item.done", "output_index": index, "item": item})
        body = self.finished(seq, self.items)
        out.append({"type": f"response.{body['status']}", "response": body})
        return out

    def chunk(self, base: dict[str, Any], entry: dict[str, Any], usage: dict[str, int] | None) -> bytes:
        event = {"type": entry["type"], "sequence_number": self.sequence,
                 **{k: v for k, v in entry.items() if k != "type"}}
        self.sequence += 1
        return _event(event)

    def failure(self, exc: ServiceError) -> list[bytes]:
        failed = self.response("failed", [], error={"code": exc.code or "server_error", "message": exc.message})
        return [self.chunk({}, {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param}, None),
                self.chunk({}, {"type": "response.failed", "response": failed}, None)]
