"""Tool calling (OpenAI's function tools) whose arguments always parse: what /v1/chat/completions (and
/v1/responses) call.

A request's `tools`, `tool_choice` and `parallel_tool_calls` become a `ToolPlan` (`read_tools`: 400 naming the
field for anything malformed). The plan's call syntax comes from the model's chat template
(service.protocols.tool_grammar: Hermes / Qwen `<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`). The
conversation is prepared for the template (`prepare_messages`): a template with tool support gets `tools=` and
the assistant's `tool_calls` (arguments as objects, as transformers passes them) and `tool` messages as they are;
a template without gets the tool definitions written into the system message (FALLBACK_PROMPT, asking for the
Hermes syntax), earlier calls written into the assistant's text and tool results as user messages in
`<tool_response>` tags, as Qwen's template writes them. Every `tool` message must answer a call an earlier
assistant message made (400 naming its `tool_call_id`).

Generation is constrained by the call grammar (`processors`, llguidance through service.protocols.structured:
the schemas measured by grammar_limits, the grammar compiled first in a worker process by grammar_guard, so a
hostile schema is a 400, never a crash): with tool_choice `required` or a named function from the first token,
with `auto` from the syntax's trigger on (free text before it). So every call's arguments are JSON that validates
against its function's schema. The reply is split into content and calls by service.protocols.tool_parser, whole
(`parse`) or as it streams (`ToolPlan.parser()`).

Choices made here (docs/SERVICE.md): tool_choice `none` renders the tools but constrains nothing and parses no
calls (vLLM's default); a named function is called exactly once; `parallel_tool_calls` (default true) lets the
grammar write several calls, false exactly one (required) or at most one (auto); `tool_choice` other than none, or
`parallel_tool_calls`, without tools is a 400 (as OpenAI answers); tools that may be called cannot be combined
with structured output (response_format, guided_*), ignore_eos or min_tokens (400 conflicting_parameters). The
syntax is chosen from the template only (no server option).

Public API, in the order an endpoint uses it (chat_api.chat_completions is the worked example):
- `read_tools(tools, tool_choice, parallel_tool_calls, template=...)` -> `ToolPlan | None` (400s naming fields);
- `refuse_conflicts(plan, body_fields)`, `check_schemas(plan, limits)` (before rendering);
- `prepare_messages(messages, template, plan)` -> (messages, extra template variables) for chat_template.render;
- `constraint(plan, tokenizer, settings)` for generation_request.build (or `processors` / `processors_here`,
  `grammar_job`: the logits processors, the grammar);
- `decoder(plan, tokenizer)`: the decode that keeps a special-token trigger (None: the tokenizer's own);
- `parse(text, plan)` -> `Parsed(content, calls)` for a whole reply, `plan.parser()` -> `CallParser` whose
  `feed(text, final=)` gives a stream's `Delta`s; `ToolCall.openai()`; `finish_reason(called, reason)`;
- `unconstrained()`: the benchmark's switch (calls parsed after the fact, nothing constrained).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from models.tokenizer import TextTokenizer
from service.base.config import Settings
from service.base.errors import ServiceError, bad_request, shown
from service.engine.text.sampler import LogitsProcessor
from service.protocols import grammar_limits, structured
from service.protocols.grammar_limits import GrammarLimits
from service.protocols.grammar_worker import GrammarJob, GrammarRefused
from service.protocols.tool_grammar import (
    HERMES,
    MISTRAL,
    NAME,
    CallSyntax,
    call_grammar,
    grammar_schema,
    syntax_for_template,
)
from service.protocols.tool_parser import CallParser, Parsed, ToolCall, new_call_id, parse_calls

__all__ = ["FALLBACK_PROMPT", "MAX_TOOLS", "CallParser", "Function", "Parsed", "ToolCall", "ToolPlan", "check_schemas",
           "constraint", "decoder",
           "finish_reason", "grammar_job", "parse", "prepare_messages", "processors", "processors_here",
           "read_tools", "refuse_conflicts", "unconstrained"]

MAX_TOOLS = 128  # OpenAI's limit
CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# What a template without tool support gets in its system message (Hermes' instructions, shortened: the demo
# model's whole context is 256 tokens). {tools}: one function's JSON a line.
FALLBACK_PROMPT = ("Functions you may call:\n<tools>\n{tools}\n</tools>\nTo call one, answer <tool_call>\n"
                   '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')
_constrained = True  # False only inside `unconstrained()` (benchmarks.tool_calls)
_free_arguments = False  # True only inside `unconstrained(frame=True)`


@dataclass(frozen=True)
class Function:
    """One function tool: its name, description and parameters (a JSON schema), and the request field it came
    from (`tools.0.function`, or `tools.0` for the Responses API's flat shape)."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    field: str

    def openai(self) -> dict[str, Any]:
        """As chat templates (and OpenAI's chat API) take a tool: {"type": "function", "function": {...}}."""
        spec: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            spec["description"] = self.description
        spec["parameters"] = self.parameters
        return {"type": "function", "function": spec}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tool fields ask for: the functions, tool_choice ("none", "auto", "required", or
    "function" with `forced` its name), whether several calls may be made, and the model's call syntax
    (`native`: its template renders tools itself)."""

    functions: tuple[Function, ...]
    choice: str
    forced: str | None
    parallel: bool
    syntax: CallSyntax
    native: bool
    # the JSON schema a reply that calls nothing must follow (response_format json_schema / json_object beside
    # tools that may be called, as an agent with an output type sends them); None: free text
    reply_schema: Mapping[str, Any] | None = None

    @property
    def calls(self) -> bool:
        """Whether the reply may hold calls (constrained, and parsed)."""
        return bool(self.functions) and self.choice != "none"

    @property
    def required(self) -> bool:
        return self.choice in ("required", "function")

    def callable(self) -> tuple[Function, ...]:
        """The functions the reply may call."""
        return tuple(f for f in self.functions if self.forced in (None, f.name))

    def parser(self, new_id: Callable[[], str] = new_call_id) -> CallParser:
        """A stream's parser of one reply (service.protocols.tool_parser)."""
        return CallParser(self.syntax, new_id)


# ---- the request's fields ---------------------------------------------------------------------------------------


def _function(tool: Any, where: str, names: set[str]) -> Function:
    if not isinstance(tool, Mapping):
        raise bad_request(f"{where} must be an object", where)
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type must be 'function' (only function tools are supported), not "
                          f"{shown(str(tool.get('type')))}", f"{where}.type", code="unsupported_parameter")
    nested = "function" in tool
    spec, field = (tool["function"], f"{where}.function") if nested else (tool, where)
    outer = set(tool) - ({"type", "function"} if nested else {"type", "name", "description", "parameters", "strict"})
    if not isinstance(spec, Mapping):
        raise bad_request(f"{field} must be an object", field)
    unknown = sorted(outer | (set(spec) - {"name", "description", "parameters", "strict"} if nested else set()))
    if unknown:
        raise bad_request(f"{where}: unknown field {shown(unknown[0])}", f"{where}.{unknown[0]}",
                          code="unknown_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"{field}.name must be 1 to 64 letters, digits, underscores or dashes"
                          + (f", not {shown(name)}" if isinstance(name, str) else ""), f"{field}.name")
    if name in names:
        raise bad_request(f"{field}.name: two tools are named {name!r}", f"{field}.name")
    names.add(name)
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{field}.description must be a string", f"{field}.description")
    parameters = spec.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, Mapping):
        raise bad_request(f"{field}.parameters must be a JSON schema object", f"{field}.parameters")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{field}.strict must be a boolean", f"{field}.strict")
    return Function(name, description, dict(parameters), field)


def _choice(value: Any, functions: tuple[Function, ...], field: str) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if functions else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise bad_request(f"{field} must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                              f"\"function\": {{\"name\": ...}}}}, not {shown(value)}", field)
        return value, None
    if not isinstance(value, Mapping) or value.get("type") != "function":
        raise bad_request(f"{field} must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", field)
    inner = value.get("function")
    name, where = (inner.get("name"), f"{field}.function.name") if isinstance(inner, Mapping) else \
        (value.get("name"), f"{field}.name")
    if not isinstance(name, str):
        raise bad_request(f"{where} must be the name of one of the tools", where)
    if name not in {f.name for f in functions}:
        raise bad_request(f"{where}: no tool is named {shown(name)}", where)
    return "function", name


def read_tools(tools: Any, tool_choice: Any, parallel_tool_calls: Any, *, template: str | None,
               fields: tuple[str, str, str] = ("tools", "tool_choice", "parallel_tool_calls")) -> ToolPlan | None:
    """The plan of a request's tool fields (None when it has no tools and asks for none), or a 400 naming the
    field. Tools in chat's shape ({"type": "function", "function": {...}}) or the Responses API's flat one
    ({"type": "function", "name": ..., "parameters": ...}); tool_choice's named form likewise. `template`: the
    model's chat template (its call syntax); `fields`: the body's names of the three fields."""
    tools_field, choice_field, parallel_field = fields
    functions: tuple[Function, ...] = ()
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request(f"{tools_field} must be a list of tools", tools_field)
        if len(tools) > MAX_TOOLS:
            raise bad_request(f"{tools_field} has {len(tools)} tools; at most {MAX_TOOLS}", tools_field)
        names: set[str] = set()
        functions = tuple(_function(t, f"{tools_field}.{i}", names) for i, t in enumerate(tools))
    choice, forced = _choice(tool_choice, functions, choice_field)
    if choice != "none" and not functions:
        raise bad_request(f"{choice_field} needs tools to choose from ({tools_field} is empty)", choice_field)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise bad_request(f"{parallel_field} must be a boolean", parallel_field)
    if parallel_tool_calls is not None and not functions:
        raise bad_request(f"{parallel_field} is only allowed with {tools_field}", parallel_field)
    if not functions:
        return None
    syntax, native = syntax_for_template(template)
    return ToolPlan(functions, choice, forced, parallel_tool_calls is not False, syntax, native)


def refuse_conflicts(plan: ToolPlan | None, fields: Mapping[str, Any]) -> ToolPlan | None:
    """The plan with the body's other constraints folded in, or a 400 for those that cannot go with tools that may
    be called. `response_format` (json_schema, json_object) becomes the schema of a reply that calls nothing, in
    the same grammar (OpenAI takes both: an agent with an output type and tools sends them); with tool_choice
    "required" or a named function the reply is calls, and it has no effect. The other structured-output fields
    (one grammar decides the reply), ignore_eos and min_tokens (the grammar decides where it ends) are refused."""
    if plan is None or not plan.calls:
        return plan
    used = structured.requested(fields)
    reply_schema = None
    if used == ["response_format"]:
        reply_schema = _reply_schema(fields["response_format"])
        used = []
    if fields.get("guided_whitespace_pattern") is not None:
        used.append("guided_whitespace_pattern")
    used += [f for f in ("ignore_eos", "min_tokens") if fields.get(f)]
    if used:
        raise bad_request(f"{used[0]} cannot be combined with tools (tool_choice {plan.choice!r}): the tool-call "
                          "grammar decides the reply", used[0], code="conflicting_parameters")
    return dataclasses.replace(plan, reply_schema=reply_schema) if reply_schema is not None else plan


def _reply_schema(value: Any) -> Mapping[str, Any] | None:
    """response_format's schema (checked as structured output checks it), None for {"type": "text"}."""
    structured.grammar_job({"response_format": value})  # the same 400s as without tools
    if value.get("type") == "json_object":
        return {"type": "object"}
    if value.get("type") == "json_schema":
        schema = value["json_schema"]["schema"]
        if not isinstance(schema, Mapping):
            raise bad_request("response_format.json_schema.schema must be an object",
                              "response_format.json_schema.schema")
        return schema
    return None


# ---- the conversation -------------------------------------------------------------------------------------------


def _arguments_value(arguments: str) -> Any:
    """A call's arguments as templates want them: the object its JSON text holds (the text itself otherwise)."""
    try:
        value = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):
        return arguments
    return value if isinstance(value, dict) else arguments


def _mistral_id(call_id: str) -> str:
    """Mistral's templates insist on 9 letters or digits."""
    return ("".join(c for c in call_id if c.isascii() and c.isalnum())[-9:]).rjust(9, "0")


def prepare_messages(messages: Sequence[Mapping[str, Any]], template: str | None,
                     plan: ToolPlan | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(the messages as the chat template gets them, the template's extra variables: `tools`). `messages`: chat
    messages with string (or None) content, an assistant's `tool_calls` ([{"id", "type", "function": {"name",
    "arguments"}}]) and a tool message's `tool_call_id`; a tool message that answers no earlier call is a 400
    naming messages.{i}.tool_call_id."""
    syntax, native = syntax_for_template(template)
    ids = _mistral_id if native and syntax is MISTRAL else (lambda i: i)
    called: dict[str, str] = {}  # call id -> function name
    out: list[dict[str, Any]] = []
    responses = False  # the last message made is tool results as a user message (fallback)
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content")
        calls = m.get("tool_calls") or []
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise bad_request(f"messages.{i}.tool_call_id: a tool message needs the id of the call it answers",
                                  f"messages.{i}.tool_call_id")
            if call_id not in called:
                raise bad_request(f"messages.{i}.tool_call_id: no earlier assistant message made a tool call with "
                                  f"id {shown(call_id)}", f"messages.{i}.tool_call_id")
            text = content or ""
            if native:
                out.append({"role": "tool", "content": text, "tool_call_id": ids(call_id), "name": called[call_id]})
            elif responses:
                out[-1]["content"] += f"\n<tool_response>\n{text}\n</tool_response>"
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            responses = not native
            continue
        responses = False
        message = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            for c in calls:
                called[c["id"]] = c["function"]["name"]
            if native:
                message["content"] = content or ""
                message["tool_calls"] = [{"id": ids(c["id"]), "type": "function", "function": {
                    "name": c["function"]["name"], "arguments": _arguments_value(c["function"]["arguments"])}}
                    for c in calls]
            else:
                text = HERMES.call_text([(c["function"]["name"], _compact(c["function"]["arguments"]))
                                         for c in calls])
                message["content"] = f"{content}\n{text}" if content else text
        out.append(message)
    extra: dict[str, Any] = {}
    if plan is not None and plan.functions:
        if native:
            extra["tools"] = [f.openai() for f in plan.functions]
        else:
            listing = "\n".join(json.dumps(f.openai()["function"], ensure_ascii=False) for f in plan.functions)
            prompt = FALLBACK_PROMPT.format(tools=listing)
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
    return out, extra


def _compact(arguments: str) -> str:
    value = _arguments_value(arguments)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else arguments


# ---- the constraint ---------------------------------------------------------------------------------------------


def trigger_token(tokenizer: TextTokenizer, syntax: CallSyntax) -> int | None:
    """The id of the special token that is the syntax's trigger in this vocabulary (Mistral's [TOOL_CALLS]), if
    it is one."""
    if not syntax.trigger:
        return None
    ids = tokenizer.encode(syntax.trigger, bos=False)
    return ids[0] if len(ids) == 1 and not tokenizer.token_bytes(ids[0]) else None


def check_schemas(plan: ToolPlan | None, limits: GrammarLimits = grammar_limits.DEFAULT) -> None:
    """Every tool's parameters schema measured against structured output's limits (size, depth through $refs,
    its regexes: service.protocols.grammar_limits), a 400 naming its field otherwise; linear scans, so an endpoint
    runs this before it renders the tools into the prompt."""
    for f in plan.functions if plan is not None else ():
        field = f"{f.field}.parameters"
        try:
            text = json.dumps(f.parameters)
        except (RecursionError, ValueError):
            raise bad_request(f"{field} is nested too deeply", field, code=grammar_limits.CODE) from None
        grammar_limits.check_schema(f.parameters, text, field, limits)


def grammar_job(plan: ToolPlan, tokenizer: TextTokenizer,
                limits: GrammarLimits = grammar_limits.DEFAULT) -> GrammarJob:
    """The call grammar as a structured-output job (field "tools"), the schemas measured first (`check_schemas`)."""
    check_schemas(plan, limits)
    functions = plan.callable()
    source = call_grammar([(f.name, f.parameters) for f in functions], plan.syntax, required=plan.required,
                          parallel=plan.parallel and plan.choice != "function",
                          trigger_token=trigger_token(tokenizer, plan.syntax), free_arguments=_free_arguments,
                          reply_schema=None if plan.required else plan.reply_schema)
    grammar_limits.check_size(source, "tools", limits)
    return GrammarJob("tools", "lark", source)


def _schema_job(f: Function) -> GrammarJob:
    return GrammarJob(f"{f.field}.parameters", "json_schema", json.dumps(grammar_schema(f.parameters)))


def _unsupported(exc: ValueError) -> ServiceError:
    return bad_request(f"tools cannot be used with this model: {exc}", "tools", code="unsupported_parameter")


async def processors(plan: ToolPlan | None, tokenizer: TextTokenizer,
                     settings: Settings) -> tuple[LogitsProcessor, ...]:
    """The logits processor that keeps the reply inside the call grammar (none when no call may be made), as the
    server compiles it: measured on a thread, compiled and probed in a grammar worker, then built on the grammar
    build thread. 400 naming the function's parameters for a schema over the limits or one llguidance refuses."""
    if plan is None or not plan.calls or not _constrained:
        return ()
    job = await asyncio.to_thread(grammar_job, plan, tokenizer, GrammarLimits.from_settings(settings))
    try:
        made = await structured.compile_job(job, tokenizer, settings)
    except GrammarRefused as exc:
        for f in plan.callable():  # which schema? each alone (rare: only when the whole grammar is refused)
            try:
                await structured.compile_job(_schema_job(f), tokenizer, settings)
            except GrammarRefused as alone:
                raise bad_request(f"{f.field}.parameters {alone.reason}", f"{f.field}.parameters") from None
        raise bad_request(f"tools {exc.reason}", "tools") from None
    except ValueError as exc:
        raise _unsupported(exc) from None
    return (structured.GrammarProcessor(made, int(tokenizer.vocab_size), "tools"),)


def processors_here(plan: ToolPlan | None, tokenizer: TextTokenizer,
                    limits: GrammarLimits = grammar_limits.DEFAULT) -> tuple[LogitsProcessor, ...]:
    """`processors` compiled in this process and thread (tests, tools)."""
    if plan is None or not plan.calls or not _constrained:
        return ()
    job = grammar_job(plan, tokenizer, limits)
    try:
        made = structured.compile_here(job, tokenizer)
    except GrammarRefused as exc:
        for f in plan.callable():
            try:
                structured.compile_here(_schema_job(f), tokenizer)
            except GrammarRefused as alone:
                raise bad_request(f"{f.field}.parameters {alone.reason}", f"{f.field}.parameters") from None
        raise bad_request(f"tools {exc.reason}", "tools") from None
    except ValueError as exc:
        raise _unsupported(exc) from None
    return (structured.GrammarProcessor(made, int(tokenizer.vocab_size), "tools"),)


def constraint(plan: ToolPlan | None, tokenizer: TextTokenizer,
               settings: Settings) -> Callable[[], Awaitable[tuple[LogitsProcessor, ...]]] | None:
    """`processors` for generation_request.build to await in its turn (None: no call may be made)."""
    if plan is None or not plan.calls:
        return None
    return lambda: processors(plan, tokenizer, settings)


@contextlib.contextmanager
def unconstrained(frame: bool = False) -> Iterator[None]:
    """For benchmarks.tool_calls only. Within it, calls are parsed but never constrained (what a server that
    parses the reply after the fact returns); with `frame`, the grammar still opens the call (trigger, name, up to
    the arguments) and leaves its arguments and the rest free (how well the model writes arguments itself)."""
    global _constrained, _free_arguments
    _constrained, _free_arguments = frame, frame
    try:
        yield
    finally:
        _constrained, _free_arguments = True, False


# ---- the reply --------------------------------------------------------------------------------------------------


def decoder(plan: ToolPlan | None, tokenizer: TextTokenizer) -> Callable[[Sequence[int]], str] | None:
    """How to decode a reply so the parser sees its trigger when the trigger is a special token (which decoding
    drops); None when plain decoding keeps it."""
    if plan is None or not plan.calls:
        return None
    token = trigger_token(tokenizer, plan.syntax)
    if token is None:
        return None
    trigger = plan.syntax.trigger

    def decode(ids: Sequence[int]) -> str:
        parts: list[list[int]] = [[]]
        for t in ids:
            if t == token:
                parts.append([])
            else:
                parts[-1].append(t)
        return trigger.join(tokenizer.decode(p) for p in parts)

    return decode


def parse(text: str, plan: ToolPlan) -> Parsed:
    """A whole reply's content (None when it is only calls) and complete calls."""
    return parse_calls(text, plan.syntax)


def finish_reason(called: bool, reason: str | None) -> str | None:
    """OpenAI's: "tool_calls" when the reply made calls and ended by itself."""
    return "tool_calls" if called and reason == "stop" else reason

