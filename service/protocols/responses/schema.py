"""The body of `POST /v1/responses` (`ResponsesRequest`), the fields it knows beyond its model (which change
nothing, which are refused) and the check that refuses what this server cannot honour."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from service.base.errors import bad_request, shown
from service.protocols import fields

MAX_TOP_LOGPROBS = 20  # OpenAI's bound
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
