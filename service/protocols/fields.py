"""Honest request fields: a field the request models do not declare is never silently ignored.

OpenAI-compatible clients send fields from OpenAI's API and vLLM's extensions. Each one that would change the
output either has its own request-model field (and is implemented) or is refused here with a 400 naming it;
only fields that change nothing about the output (who asked, scheduling hints) pass. docs/SERVICE.md lists
every field of /v1/completions and its status.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.base.errors import bad_request

# Tool calling (OpenAI's tools / tool_choice and the deprecated functions / function_call): not implemented.
TOOL_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")

# Fields that change nothing this server returns: accepted and ignored.
NO_EFFECT = frozenset({
    "user",  # OpenAI: an end-user id for abuse monitoring
    "metadata", "store", "service_tier",  # OpenAI: stored-completion tags, storage, the billing tier
    "request_id", "priority", "cache_salt",  # vLLM: request naming, scheduling priority, prefix-cache salt
})

# Known fields (OpenAI's and vLLM's) that change the output and are not implemented, with what to do instead.
NOT_SUPPORTED: dict[str, str] = {
    "min_p": "not supported by this server; use top_p or top_k",
    "use_beam_search": "beam search is not supported by this server",
    "length_penalty": "beam search is not supported by this server",
    "early_stopping": "beam search is not supported by this server",
    "stop_token_ids": "not supported by this server; use stop with the tokens' text",
    "include_stop_str_in_output": "not supported by this server",
    "skip_special_tokens": "not supported by this server (special tokens are always skipped)",
    "spaces_between_special_tokens": "not supported by this server",
    "truncate_prompt_tokens": "not supported by this server (a prompt over the context is refused)",
    "allowed_token_ids": "not supported by this server; use guided_choice or guided_regex",
    "bad_words": "not supported by this server",
    "prompt_logprobs": "not supported by this server; use echo with logprobs",
    "add_special_tokens": "not supported by this server",
    "return_tokens_as_token_ids": "not supported by this server",
    "logits_processors": "not supported by this server",
    "structured_outputs": "not supported by this server; use guided_json, guided_choice, guided_regex, "
                          "guided_grammar or response_format",
    "guided_decoding": "not supported by this server; use guided_json, guided_choice, guided_regex, guided_grammar "
                       "or response_format",
    "vllm_xargs": "not supported by this server",
    "top_logprobs": "applies to chat completions; completions take logprobs: N",
}


# /v1/chat/completions' own known fields (OpenAI's and vLLM's chat extensions) that change the output and are not
# implemented, on top of NOT_SUPPORTED; "modalities": ["text"] is what the server does anyway and passes.
CHAT_NOT_SUPPORTED: dict[str, str] = {
    **{k: v for k, v in NOT_SUPPORTED.items() if k != "top_logprobs"},
    "modalities": "not supported by this server beyond [\"text\"]",
    "audio": "not supported by this server (text only)",
    "prediction": "not supported by this server",
    "reasoning_effort": "not supported by this server",
    "web_search_options": "not supported by this server",
    "echo": "not supported on chat completions by this server",
    "add_generation_prompt": "not supported by this server (the generation prompt is always added)",
    "continue_final_message": "not supported by this server",
    "chat_template": "not supported by this server (the model's own template is used)",
    "chat_template_kwargs": "not supported by this server",
    "documents": "not supported by this server",
    "mm_processor_kwargs": "not supported by this server (text only)",
}
NEUTRAL: dict[str, object] = {"modalities": ["text"]}  # values of known fields that ask for the default


def _used(value: Any) -> bool:
    return value is not None and value != [] and value != {}


def refuse_tools(fields: Mapping[str, Any]) -> None:
    """400 naming the first tool-calling field in use (tool_choice / function_call "none" ask for no tool)."""
    for name in TOOL_FIELDS:
        value = fields.get(name)
        if _used(value) and value != "none":
            raise bad_request(f"{name} is not supported: this server does not implement tool calling", name,
                              code="unsupported_parameter")


def refuse_undeclared(extra: Mapping[str, Any] | None, not_supported: Mapping[str, str] = NOT_SUPPORTED) -> None:
    """400 naming the first undeclared field that is not known to change nothing: tool calling and known
    output-changing fields as "not supported", anything else as unknown (a typo must not pass unnoticed)."""
    if not extra:
        return
    refuse_tools(extra)
    for name, value in extra.items():
        if name in NO_EFFECT or name in TOOL_FIELDS:
            continue
        if name in not_supported:
            if value is None or (name in NEUTRAL and value == NEUTRAL[name]):  # unset, or the default behaviour
                continue
            raise bad_request(f"{name} is {not_supported[name]}", name, code="unsupported_parameter")
        raise bad_request(f"unknown field {name!r}", name, code="unknown_parameter")
