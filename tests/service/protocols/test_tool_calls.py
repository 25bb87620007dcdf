"""Tool calling on /v1/chat/completions (issue 41): tools rendered through the model's chat template (as
transformers renders them), the reply constrained by the call grammar so every call's arguments parse and validate,
split into content and tool_calls whole and streamed, as the official `openai` client reads them
(service.protocols.tools, tool_grammar, tool_parser).

The served model is the shipped demo LLM (llama_seglu: a tiny Qwen-style chat model whose ChatML template renders
tools in Qwen 2.5's Hermes style, so the server passes them to it and parses `<tool_call>`; its whole context is
256 tokens, hence the small tools). The fallback for a template without tool support (the tools written into the
system message) is shown on plain ChatML here and served in test_tool_families.py. It was never trained to call
tools: what it writes unconstrained is noise, which is the point of the constraint.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import llguidance
import pytest

from benchmarks.server import in_thread
from models.demo import DEMO_DIR
from models.hf_text import HFTextTokenizer
from models.hf_tokenizer import HFTokenizer
from service.base.config import Settings
from service.base.errors import ServiceError
from service.edge.app import create_app
from service.protocols import grammar_worker, structured, tools
from service.protocols.chat_template import render
from service.protocols.tool_grammar import HERMES, LLAMA3_JSON, MISTRAL, call_grammar, syntax_for_template
from service.protocols.tool_parser import CallParser, parse_calls

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

LLAMA = "llama_seglu"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
ADD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "b": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["a", "b"]}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": WEATHER_SCHEMA}}
ADD = {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}}
SCHEMAS = {"weather": WEATHER_SCHEMA, "add": ADD_SCHEMA}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NO_EOS = {"0": -100, "2": -100}  # the demo's end tokens, discouraged: the grammar alone decides where it ends

# Plain ChatML: a template without tool support
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")

# A Hermes-style template with tool support (Qwen 2.5's, as transformers' chat-template docs show tool use)
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- \"\\n\" }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

HISTORY = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris, and 2+3?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                 "arguments": '{"city": "Paris", "unit": "c"}'}},
               {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
           {"role": "tool", "tool_call_id": "call_2", "content": "5"}]


@pytest.fixture(scope="module")
def tok() -> HFTextTokenizer:
    return HFTextTokenizer(HFTokenizer.from_folder(DEMO_DIR / LLAMA))


def validate(call: Any) -> dict[str, Any]:
    """A returned call (SDK object or dict): its arguments parse and validate against its function's schema."""
    function = call.function if hasattr(call, "function") else call["function"]
    name = function.name if hasattr(function, "name") else function["name"]
    arguments = function.arguments if hasattr(function, "arguments") else function["arguments"]
    value = json.loads(arguments)
    jsonschema.validate(value, SCHEMAS[name])
    return {"name": name, "arguments": value}


# ---- call syntax, grammar, parser -------------------------------------------------------------------------------


def test_syntax_is_chosen_from_the_template() -> None:
    assert syntax_for_template(HERMES_TEMPLATE) == (HERMES, True)
    assert syntax_for_template("{{ '<|python_tag|>' }}{% if m.role == 'ipython' %}") == (LLAMA3_JSON, True)
    assert syntax_for_template("{{ '[TOOL_CALLS] [' }}") == (MISTRAL, True)
    assert syntax_for_template(None) == (HERMES, False)
    assert syntax_for_template("{{ messages[0]['content'] }}") == (HERMES, False)


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda s: s.name)
@pytest.mark.parametrize("required, parallel", [(True, True), (True, False), (False, True), (False, False)])
def test_grammar_admits_exactly_the_calls_asked_for(tok: HFTextTokenizer, syntax: Any, required: bool,
                                                    parallel: bool) -> None:
    grammar = llguidance.LLMatcher.grammar_from_lark(
        call_grammar([("weather", WEATHER_SCHEMA), ("add", ADD_SCHEMA)], syntax, required=required,
                     parallel=parallel))
    matcher = grammar_worker.matcher(structured.lltokenizer(tok), grammar)

    def whole(text: str) -> bool:
        m = matcher.deep_copy()
        return bool(m.consume_tokens(tok.encode(text, bos=False))) and not m.is_error() and m.is_accepting()

    one = syntax.call_text([("weather", '{"city": "Paris", "unit": "c"}')])
    two = syntax.call_text([("weather", '{"city": "Paris", "unit": "c"}'), ("add", '{"a": 2, "b": 3}')])
    assert whole(one) and whole(two) == parallel
    assert whole("It is sunny.") == (not required)
    assert not whole(syntax.call_text([("weather", '{"city": "Paris"}')]))  # misses a required argument
    assert not whole(syntax.call_text([("add", '{"a": 100, "b": 3}')]))  # out of the schema's range
    assert not whole(syntax.call_text([("other", "{}")]))  # no such tool
    assert not whole(one + "and more")  # nothing after the calls
    if syntax.trigger and not required:  # text before the trigger is free, the call after it is not
        assert whole("Let me see. " + one)
        assert not whole("Let me see. " + syntax.trigger + syntax.open + '{"name": "weather", "arguments": 3}')


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda s: s.name)
def test_parser_streamed_in_any_pieces_equals_the_whole(syntax: Any) -> None:
    calls = [("weather", '{"city": "Pa\\"ris }", "unit": "c"}'), ("add", '{"a": 2, "b": 3}')]
    before = "" if syntax is LLAMA3_JSON else "Sure, one moment.\n"
    for text, content, n in [(before + syntax.call_text(calls), before.strip() or None, 2),
                             ("No tool needed <tool ... [TOOL ", "No tool needed <tool ... [TOOL ", 0)]:
        whole = parse_calls(text, syntax)
        assert whole.content == content and [(c.name, c.arguments) for c in whole.calls] == calls[:n]
        for seed in range(5):
            ids = (f"call_{i}" for i in itertools.count())
            parser, rng, i, deltas = CallParser(syntax, lambda ids=ids: next(ids)), random.Random(seed), 0, []
            while i < len(text):
                k = rng.randint(1, 6)
                deltas += parser.feed(text[i:i + k])
                i += k
            deltas += parser.feed("", final=True)
            streamed: dict[int, list[str]] = {}
            for d in deltas:
                if d.kind == "call":
                    streamed[d.index] = [d.name, ""]
                elif d.kind == "arguments":
                    streamed[d.index][1] += d.text
            assert "".join(d.text for d in deltas if d.kind == "content") == (content or "")
            assert [tuple(v) for v in streamed.values()] == calls[:n]


def test_parser_reads_unconstrained_calls_and_leaves_cut_or_broken_ones_as_content() -> None:
    loose = parse_calls('<tool_call>\n{"arguments": {"a": 1}, "name": "add"}\n</tool_call>', HERMES)
    assert [(c.name, c.arguments) for c in loose.calls] == [("add", '{"a": 1}')] and loose.content is None
    cut = '<tool_call>\n{"name": "add", "arguments": {"a": 1'
    assert parse_calls(cut, HERMES).calls == [] and parse_calls(cut, HERMES).content == cut[len("<tool_call>\n"):]
    assert parse_calls("<tool_call> not json", HERMES).content == "<tool_call> not json"
    assert parse_calls('Hi {"name": "add", "parameters": {}}', LLAMA3_JSON).calls == []  # llama: calls come first


# ---- rendering ---------------------------------------------------------------------------------------------------


def test_tools_render_through_a_hermes_template_as_transformers_renders_them(tok: HFTextTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_DIR / LLAMA / "tokenizer.json"))
    theirs.chat_template = HERMES_TEMPLATE
    plan = tools.read_tools([WEATHER, ADD], "auto", None, template=HERMES_TEMPLATE)
    assert plan is not None and plan.native and plan.syntax is HERMES
    messages, extra = tools.prepare_messages(HISTORY, HERMES_TEMPLATE, plan)
    ours = render(HERMES_TEMPLATE, messages, tok.special_texts(), add_generation_prompt=True, **extra)
    hf_messages = [m if "tool_calls" not in m else {**m, "content": "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in m["tool_calls"]]} for m in HISTORY]
    want = theirs.apply_chat_template(hf_messages, tools=[WEATHER, ADD], tokenize=False, add_generation_prompt=True)
    assert ours == want
    assert '{"type": "function", "function": {"name": "weather"' in ours
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in ours
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n5\n</tool_response>" in ours


def test_a_template_without_tools_gets_them_in_the_system_message(tok: HFTextTokenizer) -> None:
    template = CHATML  # the demo's template before it rendered tools
    plan = tools.read_tools([WEATHER], "required", None, template=template)
    assert plan is not None and not plan.native
    messages, extra = tools.prepare_messages(HISTORY, template, plan)
    assert extra == {} and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\nFunctions you may call:\n<tools>\n{\"name\": \"weather\"")
    assert messages[2]["content"] == HERMES.call_text([("weather", '{"city": "Paris", "unit": "c"}'),
                                                       ("add", '{"a": 2, "b": 3}')])
    assert messages[3]["content"] == "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n5\n</tool_response>"
    mistral = "{{ '[TOOL_CALLS]' }}"  # Mistral's templates want call ids of 9 letters or digits
    messages, _ = tools.prepare_messages(HISTORY, mistral, None)
    assert messages[2]["tool_calls"][0]["id"] == "0000call1" and messages[3]["tool_call_id"] == "0000call1"


# ---- served: the demo LLM through the openai client -------------------------------------------------------------


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with in_thread(create_app(Settings(models=(LLAMA,), warmup_calls=0))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def test_required_call_parses_validates_and_finishes_with_tool_calls(client: Any) -> None:
    r = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    assert validate(call)["name"] == "weather"


def test_named_function_is_called_once(client: Any) -> None:
    r = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[ADD], logit_bias=NO_EOS, seed=1,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = r.choices[0].message.tool_calls
    assert validate(call)["name"] == "add" and r.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_allows_several_and_false_exactly_one(client: Any) -> None:
    # the end token discouraged: the grammar alone decides whether a second call may follow
    several = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[ADD], tool_choice="required",
                                             logit_bias=NO_EOS, seed=2)
    calls = several.choices[0].message.tool_calls
    assert len(calls) >= 2 and several.choices[0].finish_reason == "length"  # cut inside the next call
    assert len({c.id for c in calls}) == len(calls) and all(validate(c)["name"] == "add" for c in calls)
    one = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[ADD], tool_choice="required",
                                         parallel_tool_calls=False, logit_bias=NO_EOS, seed=2)
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"


def test_stream_sends_call_deltas_that_add_up_to_the_whole_answer(client: Any) -> None:
    args = {"model": LLAMA, "messages": ASK, "tools": [ADD], "tool_choice": "required", "logit_bias": NO_EOS,
            "seed": 5, "max_tokens": 80, "logprobs": True}
    whole = client.chat.completions.create(**args).choices[0]
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == whole.finish_reason
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        for tc in d.delta.tool_calls or ():
            if tc.id is not None:  # a call opens with its id, type, name and empty arguments
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
    complete = [calls[i] for i in range(len(whole.message.tool_calls))]
    assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in complete]
    assert all(validate({"function": c}) for c in complete)
    assert "".join(d.delta.content or "" for d in deltas) == (whole.message.content or "")
    assert chunks[-1].usage.completion_tokens == 80 == len(whole.logprobs.content)
    assert sum(len(d.logprobs.content) for d in deltas if d.logprobs) == 80  # every token's, once


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_every_returned_call_parses_and_validates_over_seeded_samples(client: Any, choice: str) -> None:
    returned = 0
    for seed in range(10):
        r = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[WEATHER], tool_choice=choice,
                                           max_tokens=60, seed=seed, temperature=1.0, n=2)
        for c in r.choices:
            for call in c.message.tool_calls or ():
                validate(call)
                returned += 1
            if choice == "required" and c.finish_reason != "length":
                assert c.message.tool_calls and c.finish_reason == "tool_calls"
    assert returned >= (16 if choice == "required" else 0)


def test_a_conversation_with_calls_and_tool_results(client: Any) -> None:
    history = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "5"}]
    r = client.chat.completions.create(model=LLAMA, messages=history, tools=[ADD], max_tokens=8, seed=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    sent_back = client.chat.completions.create(model=LLAMA, messages=[*ASK, r.choices[0].message], max_tokens=4)
    assert sent_back.choices[0].message.role == "assistant"  # an answer's message goes back as it came


HOSTILE = {"$ref": "#/$defs/d0", "$defs": {**{f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"type": "null"}]}
                                              for i in range(300)}, "d300": {"type": "integer"}}}


@pytest.mark.parametrize("body, param, needle", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "no tool is named"),
    ({"tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters", "Invalid type: nope"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": HOSTILE}}]},
     "tools.1.function.parameters", "levels deep"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools.0.function.name", "letters"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "two tools"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": None, "parallel_tool_calls": False}, "parallel_tool_calls", "only allowed with tools"),
    ({"extra_body": {"guided_choice": ["a", "b"]}}, "guided_choice", "cannot be combined with tools"),
    ({"extra_body": {"min_tokens": 3}}, "min_tokens", "cannot be combined with tools"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "5"}]}, "messages.1.tool_call_id",
     "no earlier assistant message"),
    ({"messages": [*ASK, {"role": "tool", "content": "5"}]}, "messages.1.tool_call_id", "needs the id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content", "required"),
    ({"extra_body": {"functions": [{"name": "f"}]}}, "functions", "not supported"),
])
def test_bad_tool_requests_are_400_naming_the_field(client: Any, body: dict[str, Any], param: str,
                                                    needle: str) -> None:
    args = {"model": LLAMA, "messages": ASK, "tools": [WEATHER], "max_tokens": 4} | body
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**args)
    error = caught.value.body
    assert caught.value.status_code == 400 and needle in error["message"], error
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_tool_choice_none_constrains_nothing(client: Any) -> None:
    plain = client.chat.completions.create(model=LLAMA, messages=ASK, max_tokens=12, seed=4)
    none = client.chat.completions.create(model=LLAMA, messages=ASK, tools=[ADD], tool_choice="none", max_tokens=12,
                                          seed=4)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
    assert none.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are still written into the prompt


def test_a_word_level_tokenizer_cannot_constrain_calls() -> None:
    from models.fairseq_dict import TOKENIZER_TYPE, FairseqTokenizer, word_tokenizer

    symbols = ["<s>", "<pad>", "</s>", "<unk>", "the", "cat", "sat"]
    words = FairseqTokenizer({"type": TOKENIZER_TYPE, "fairseq": "word", "vocab_size": len(symbols), "bos_id": 2,
                              "eos_id": 2, "pad_id": 1, "tokenizer_json": json.loads(word_tokenizer(symbols).to_str())})
    plan = tools.read_tools([ADD], "required", None, template=None)
    with pytest.raises(ServiceError) as caught:
        tools.processors_here(plan, words)
    assert caught.value.status == 400 and caught.value.param == "tools" and "word-level" in caught.value.message


def test_a_special_token_trigger_is_kept_for_the_parser_and_named_by_id_in_the_grammar() -> None:
    class Specials:  # Mistral-like: [TOOL_CALLS] is the special token 5, which decoding drops
        def encode(self, text: str, bos: bool = False) -> list[int]:
            return [5] if text == "[TOOL_CALLS]" else [ord(c) for c in text]

        def token_bytes(self, token: int) -> bytes:
            return b"" if token == 5 else bytes([token])

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids if i != 5)

    plan = tools.read_tools([ADD], "auto", None, template="{{ '[TOOL_CALLS]' }}")
    assert plan is not None and plan.syntax is MISTRAL
    tok: Any = Specials()
    assert tools.trigger_token(tok, MISTRAL) == 5 and "<[5]>" in tools.grammar_job(plan, tok).source
    decode = tools.decoder(plan, tok)
    assert decode is not None
    text = decode([ord(c) for c in "Hi "] + [5] + [ord(c) for c in ' [{"name": "add", "arguments": {"a": 1}}]'])
    parsed = tools.parse(text, plan)
    assert parsed.content == "Hi" and [(c.name, c.arguments) for c in parsed.calls] == [("add", '{"a": 1}')]
