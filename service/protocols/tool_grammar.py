r"""How a model family writes its tool calls (`CallSyntax`), which one a chat template speaks (`syntax_for_template`),
and the grammar that makes a call's arguments parse (`call_grammar`: Lark for llguidance, each function's parameter
schema as an inline `%json {...}`).

- `hermes` (Hermes, Qwen 2.5 / 3), when the template mentions `<tool_call>`; two calls:
  `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>\n<tool_call>\n{...}\n</tool_call>`
- `llama3_json` (Llama 3.1 / 3.2), when it mentions `<|python_tag|>` or `ipython`; two calls:
  `{"name": "f", "parameters": {...}}; {"name": "g", "parameters": {...}}`
- `mistral` (Mistral v0.3), when it mentions `[TOOL_CALLS]`; two calls:
  `[TOOL_CALLS] [{"name": "f", "arguments": {...}}, {"name": "g", "arguments": {...}}]`

A template that mentions none of them has no tool support of its own: the server writes the tool definitions into
the system message itself and asks for the `hermes` syntax (service.protocols.tools.FALLBACK_PROMPT).

The grammar (`call_grammar`): with tool_choice `required` or a named function the reply is calls from its first
token; with `auto` it is free text, or free text up to the syntax's trigger (`<tool_call>`, `[TOOL_CALLS]`; for
`llama3_json` a reply whose first non-blank character is `{`) followed by calls. The trigger is an llguidance lazy
lexeme, so the text before it is unconstrained (only the trigger itself cannot appear in it); from the trigger on,
each call is `{"name": <one of the tools>, "<args key>": <that tool's parameters schema>}` with fixed separators
(`", "`, `": "`), so the arguments are always JSON that validates. After the last call only the end of the reply
may follow; several calls only with parallel_tool_calls. A trigger that is one special token of the model's
vocabulary (Mistral's `[TOOL_CALLS]`) is written as that token (`<[id]>`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
# The arguments' JSON as the grammar writes it: json.dumps's separators, no free whitespace (a small model given
# free whitespace may spend its tokens on it).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class CallSyntax:
    """How a model family writes its calls: the trigger that opens them ("" for a reply that starts with the call
    object itself), the text around each call object `{"name": ..., "<args_key>": ...}`, and the same as literal
    words for the parser (service.protocols.tool_parser), which allows any whitespace between them."""

    name: str
    trigger: str  # text that opens the calls; "" : the reply starts with the first call object
    open: str  # after the trigger, before the first call object
    separator: str  # between two call objects
    close: str  # after the last call object
    args_key: str  # "arguments" or "parameters"
    open_words: tuple[str, ...] = ()
    separator_words: tuple[str, ...] = ()
    close_words: tuple[str, ...] = ()

    def call_text(self, calls: Sequence[tuple[str, str]]) -> str:
        """`calls` ((name, arguments JSON)) as this syntax writes them, trigger included."""
        objects = [f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": {args}}}'
                   for name, args in calls]
        return self.trigger + self.open + self.separator.join(objects) + self.close


HERMES = CallSyntax("hermes", "<tool_call>", "\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>", "arguments",
                    separator_words=("</tool_call>", "<tool_call>"), close_words=("</tool_call>",))
LLAMA3_JSON = CallSyntax("llama3_json", "", "", "; ", "", "parameters", separator_words=(";",))
MISTRAL = CallSyntax("mistral", "[TOOL_CALLS]", " [", ", ", "]", "arguments", open_words=("[",),
                     separator_words=(",",), close_words=("]",))
SYNTAXES = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL)}


def syntax_for_template(template: str | None) -> tuple[CallSyntax, bool]:
    """(the call syntax, whether the template renders tools itself) from the chat template's text."""
    text = template or ""
    if "<tool_call>" in text:
        return HERMES, True
    if "[TOOL_CALLS]" in text:
        return MISTRAL, True
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3_JSON, True
    return HERMES, False


# ---- the grammar ------------------------------------------------------------------------------------------------


def _lit(text: str) -> str:
    """A Lark string literal ("" for no text)."""
    return json.dumps(text) if text else ""


def _regex_literal(text: str) -> str:
    """`text` matched literally inside a Lark /regex/."""
    return "".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in text)


def grammar_schema(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A function's parameters schema as the grammar uses it: JSON_OPTIONS for llguidance, and an object schema
    that lists `properties` without saying whether others may appear gets `additionalProperties: false` (a
    stricter grammar: what it allows still validates against the schema as given)."""
    out = dict(schema)
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
    out["x-guidance"] = {**JSON_OPTIONS, **(out.get("x-guidance") or {})}
    return out


def call_grammar(functions: Sequence[tuple[str, Mapping[str, Any]]], syntax: CallSyntax, *, required: bool,
                 parallel: bool, trigger_token: int | None = None, free_arguments: bool = False,
                 reply_schema: Mapping[str, Any] | None = None) -> str:
    """The Lark grammar of a reply that may (or, `required`, must) call one of `functions` ((name, parameters
    schema)); several calls only when `parallel`. `trigger_token`: the id of the special token that is the
    syntax's trigger, when it is one. `free_arguments` (benchmarks only): a call's opening up to its arguments
    is the grammar's, everything after it free text. `reply_schema`: a reply that calls nothing is a JSON value
    of that schema (then the grammar holds from the first token: JSON or the calls' opening)."""
    lines = ["%llguidance {}"]
    for i, (name, schema) in enumerate(functions):
        head = '{"name": ' + json.dumps(name) + f', "{syntax.args_key}": '
        if free_arguments:
            lines.append(f"call_{i}: {_lit(head)} REST")
            continue
        lines.append(f"call_{i}: {_lit(head)} args_{i} " + _lit("}"))
        lines.append(f"args_{i}: %json " + json.dumps(grammar_schema(schema)))
    if free_arguments:
        lines.append("REST: /(?s:.*)/")
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    more = f"({_lit(syntax.separator)} call)*" if parallel and not free_arguments else ""
    close = "" if free_arguments else _lit(syntax.close)
    lines.append("calls: " + " ".join(p for p in (_lit(syntax.open), "call", more, close) if p))
    trigger = f"<[{trigger_token}]>" if trigger_token is not None else _lit(syntax.trigger)
    if required:
        lines.append(f"start: {trigger} calls")
    elif reply_schema is not None:
        lines.append("reply: %json " + json.dumps(grammar_schema(reply_schema)))
        lines.append(f"start: reply | {trigger} calls" if syntax.trigger or trigger_token is not None
                     else "start: reply | calls")
    elif syntax.trigger:
        # free text that never holds the trigger, or free text up to the first trigger, then calls
        lines.append(f"FREE: /(?s:.*)/ & ~/(?s:.*){_regex_literal(syntax.trigger)}(?s:.*)/")
        if trigger_token is not None:
            lines.append(f"start: FREE | FREE {trigger} calls")
        else:
            lines.append(f"head[lazy]: TEXT {trigger}")
            lines.append("TEXT: /(?s:.*)/")
            lines.append("start: FREE | head calls")
    else:  # the reply is text that does not start with "{", or calls
        lines.append(r"FREE: /(?s:.*)/ & ~/[ \t\r\n]*\{(?s:.*)/")
        lines.append("start: FREE | calls")
    return "\n".join(lines) + "\n"
