"""A Responses body in chat's terms: its input items as chat messages, `text.format` as chat's response_format,
its sampling fields as completions' `SamplingOptions`, its function tools as chat's, and a shared check's 400
renamed to name this body's field."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from service.base.errors import ServiceError, bad_request, shown
from service.engine.runtime import TextRuntime
from service.protocols import tools
from service.protocols.chat_api import ChatCompletionRequest, chat_template
from service.protocols.generation_request import SamplingOptions
from service.protocols.responses.schema import (
    CALL_KEYS,
    LOGPROBS_INCLUDE,
    MESSAGE_KEYS,
    OUTPUT_KEYS,
    PART_KEYS,
    ROLES,
    TEXT_PARTS,
    ResponsesRequest,
)


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


def size_of(messages: Sequence[Mapping[str, Any]]) -> int:
    """Characters of the conversation (the template adds a few per message): how long rendering it takes."""
    return sum(64 + len(m.get("content") or "") + sum(len(c["function"]["arguments"]) for c in m.get("tool_calls")
                                                       or ()) for m in messages)

