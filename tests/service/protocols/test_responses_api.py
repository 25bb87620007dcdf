"""/v1/responses (OpenAI's Responses API) through the official `openai` client, against the server in this process
(uvicorn on a loopback socket) on the shipped demo LLM (models/demo/llama_seglu: a Llama with a chat template):
the same text as /v1/chat/completions for the same conversation, the response object and its stream of events,
structured output through text.format, logprobs, kept responses (previous_response_id, GET, DELETE) and bad
requests as 400s naming the field. A wrapper over the model scripts the tokens it generates or gives a row NaN
logits (an engine error mid-stream: `error` and `response.failed`).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from benchmarks.server import in_thread
from service.base.config import Settings
from service.edge.app import create_app
from service.protocols.responses.store import ResponseStore
from tests.service.support import Steered

openai = pytest.importorskip("openai")

LLM, BYTES, VISION = "llama_seglu", "text_multimax", "digits_multimax"
ENDS = "What is Python?"  # greedy, the demo LLM ends its answer (eos) well within 100 tokens
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}
WEATHER = {"type": "function", "name": "weather", "parameters": WEATHER_SCHEMA}  # small: the context is 256
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, Steered, Any]]:
    app = create_app(Settings(models=(LLM, BYTES, VISION), warmup_calls=0, intra_op_threads=1))
    rt = app.state.runtimes.models[LLM]
    wrapper = Steered(rt.scheduler.backend)
    rt.scheduler.backend = wrapper
    with in_thread(app) as url:
        yield url, wrapper, rt.tokenizer


@pytest.fixture(scope="module")
def url(served: tuple[str, Steered, Any]) -> str:
    return served[0]


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _chat(client: Any, messages: list[dict[str, Any]], max_tokens: int) -> Any:
    return client.chat.completions.create(model=LLM, messages=messages, max_tokens=max_tokens, temperature=0)


def _raw_events(url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(the stream's raw text, its events' data)."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/responses", json.dumps({"model": LLM, **body}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("content-type", "").startswith("text/event-stream")
    raw = response.read().decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data.removeprefix("data: ")))
        assert events[-1]["type"] == name.removeprefix("event: ")  # the event line names its type
    return raw, events


# ---- the response object ----------------------------------------------------------------------------------------


def test_a_response_is_the_chat_completion_of_its_conversation(client: Any) -> None:
    r = client.responses.create(model=LLM, input="Hello there", instructions="Be brief.", max_output_tokens=20,
                                temperature=0)
    chat = _chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}], 20)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == LLM and r.created_at > 0
    assert r.output_text == chat.choices[0].message.content  # the SDK's convenience over output
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert [p.type for p in item.content] == ["output_text"] and item.content[0].annotations == []
    # max_output_tokens ended it: incomplete, as OpenAI's
    assert chat.choices[0].finish_reason == "length"
    assert r.status == item.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == \
        (chat.usage.prompt_tokens, 20, chat.usage.prompt_tokens + 20)
    assert r.instructions == "Be brief." and r.max_output_tokens == 20 and r.temperature == 0 and r.top_p == 1
    assert r.text.format.type == "text" and r.tools == [] and r.store is True and r.error is None


def test_a_response_that_ends_is_completed(client: Any) -> None:
    r = client.responses.create(model=LLM, input=ENDS, max_output_tokens=100, temperature=0)
    chat = _chat(client, [{"role": "user", "content": ENDS}], 100)
    assert chat.choices[0].finish_reason == "stop"
    assert r.status == "completed" and r.incomplete_details is None and r.output[0].status == "completed"
    assert r.output_text == chat.choices[0].message.content and r.usage.output_tokens == chat.usage.completion_tokens


def test_input_items_are_the_chats_messages(client: Any) -> None:
    items = [{"role": "developer", "content": "Answer in one line."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is"},
                                                              {"type": "input_text", "text": "MultiMax?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "A function.", "annotations": []}]},
             {"role": "user", "content": "Say more."}]
    r = client.responses.create(model=LLM, input=items, max_output_tokens=12, temperature=0)
    # developer is the system's voice (a template knows no developer); text parts are joined by newlines
    chat = _chat(client, [{"role": "system", "content": "Answer in one line."},
                          {"role": "user", "content": "What is\nMultiMax?"},
                          {"role": "assistant", "content": "A function."},
                          {"role": "user", "content": "Say more."}], 12)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_output_is_schema_valid(client: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "string", "enum": ["yes", "no"]}
    r = client.responses.create(model=LLM, input="Answer yes or no", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"


def test_json_schema_constrains_an_object(served: tuple[str, Steered, Any], client: Any) -> None:
    """The demo model alone writes blanks after a key until max_output_tokens (the grammar allows blanks); scripted
    towards one valid object, the output is that object, whole."""
    jsonschema = pytest.importorskip("jsonschema")
    _, wrapper, tok = served
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "obj", "schema": schema}}
    start = client.responses.create(model=LLM, input="Give JSON", max_output_tokens=1, text=fmt).usage.input_tokens
    want = '{"ok": true, "n": 7}'
    wrapper.script = {start - 1 + k: t for k, t in enumerate([*tok.encode(want, bos=False), tok.eos_id])}
    try:
        r = client.responses.create(model=LLM, input="Give JSON", max_output_tokens=40, text=fmt)
        streamed = list(client.responses.create(model=LLM, input="Give JSON", max_output_tokens=40, text=fmt,
                                                stream=True))
    finally:
        wrapper.script = {}
    assert r.status == "completed" and r.output_text == want
    jsonschema.validate(json.loads(r.output_text), schema)
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == want
    assert streamed[-1].type == "response.completed"


def test_json_object_starts_an_object(client: Any) -> None:
    r = client.responses.create(model=LLM, input="Give JSON", max_output_tokens=10, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{")  # cut by max_output_tokens: not whole JSON yet


def test_logprobs(client: Any) -> None:
    r = client.responses.create(model=LLM, input="Hello", max_output_tokens=6, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 6 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text
    assert all(lp.logprob == lp.top_logprobs[0].logprob for lp in lps)  # greedy: the best one
    streamed = list(client.responses.create(model=LLM, input="Hello", max_output_tokens=6, temperature=0,
                                            top_logprobs=2, include=["message.output_text.logprobs"], stream=True))
    deltas = [lp for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in deltas] == [(lp.token, lp.logprob) for lp in lps]
    assert client.responses.create(model=LLM, input="Hello", max_output_tokens=2).output[0].content[0].logprobs == []


# ---- the stream -------------------------------------------------------------------------------------------------


def test_stream_events_in_order_with_sequence_numbers(url: str, client: Any) -> None:
    body = {"input": "Hello there", "max_output_tokens": 15, "temperature": 0}
    whole = client.responses.create(model=LLM, **body)
    raw, events = _raw_events(url, {**body, "stream": True})
    assert "[DONE]" not in raw  # a Responses stream ends with its last event
    types = [e["type"] for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"} and len(types[4:-4]) > 1  # step by step
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and created["id"].startswith("resp_")
    assert all(e["response"]["id"] == created["id"] for e in events if "response" in e)
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == whole.output_text == events[-4]["text"] == events[-3]["part"]["text"]
    item = events[-2]["item"]
    assert item["id"] == events[2]["item"]["id"] == events[4]["item_id"] and item["status"] == "incomplete"
    final = events[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == \
        (whole.usage.input_tokens, whole.usage.output_tokens)
    assert final["output"] == [item]


def test_stream_through_the_sdk(client: Any) -> None:
    whole = client.responses.create(model=LLM, input=ENDS, max_output_tokens=100, temperature=0)
    events = list(client.responses.create(model=LLM, input=ENDS, max_output_tokens=100, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    with client.responses.stream(model=LLM, input=ENDS, max_output_tokens=100, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_an_engine_error_mid_stream_ends_it_with_error_and_failed(served: tuple[str, Steered, Any],
                                                                  client: Any) -> None:
    _, wrapper, _ = served
    start = client.responses.create(model=LLM, input="Hello", max_output_tokens=1).usage.input_tokens
    wrapper.nan_at = {start + 2}  # the third token
    try:
        events = list(client.responses.create(model=LLM, input="Hello", max_output_tokens=20, stream=True))
    finally:
        wrapper.nan_at = set()
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-2:] == ["error", "response.failed"] and "response.completed" not in types
    assert "non-finite" in events[-2].message and events[-2].code == "model_error"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "model_error" and failed.id == events[0].response.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the server goes on
    assert client.responses.create(model=LLM, input="Hello", max_output_tokens=3).status == "incomplete"


# ---- kept responses ---------------------------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(client: Any) -> None:
    first = client.responses.create(model=LLM, input="Hello there", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=LLM, input="Say more.", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    # the earlier input and output, without the earlier instructions (OpenAI does not carry them over)
    chat = _chat(client, [{"role": "user", "content": "Hello there"},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Say more."}], 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    third = client.responses.create(model=LLM, input="And?", previous_response_id=second.id, max_output_tokens=4,
                                    temperature=0, instructions="Be kind.")
    chat = _chat(client, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello there"},
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "Say more."},
                          {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And?"}], 4)
    assert third.output_text == chat.choices[0].message.content


def test_kept_responses_are_retrieved_and_deleted(client: Any) -> None:
    r = client.responses.create(model=LLM, input="Hello", max_output_tokens=4)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.usage == r.usage
    with client.responses.stream(model=LLM, input=ENDS, max_output_tokens=100, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text  # a stream is kept too
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(r.id)
    assert caught.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=LLM, input="x", previous_response_id=r.id, max_output_tokens=1)
    assert caught.value.body["param"] == "previous_response_id"
    unkept = client.responses.create(model=LLM, input="Hello", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_the_store_keeps_the_most_recent_within_its_bounds() -> None:
    store = ResponseStore(max_responses=2, max_chars=150)
    overhead = len(json.dumps([{"role": "user", "content": ""}]))  # a conversation's JSON around its text

    def put(name: str, chars: int) -> None:
        store.put({"id": name}, [{"role": "user", "content": "x" * chars}])

    put("a", 1)
    put("b", 1)
    assert store.get("a") is not None  # a is now the most recent
    put("c", 1)
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    put("d", 150 - overhead)  # the whole budget: a and c leave for it
    assert store.get("d") is not None and len(store) == 1 and store.chars == 150
    put("e", 200)  # alone over the budget: not kept, nothing else lost
    assert store.get("e") is None and store.get("d") is not None
    assert store.delete("d") and not store.delete("d") and store.chars == 0


# ---- function tools (service.protocols.tools) --------------------------------------------------------------------


def test_a_required_call_is_a_function_call_item_whose_arguments_validate(client: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    r = client.responses.create(model=LLM, input=ASK, tools=[WEATHER], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = r.output  # only the call: the reply has no text
    assert call.type == "function_call" and call.status == "completed" and call.name == "weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert r.status == "completed" and r.output_text == "" and r.tools[0].name == "weather"
    assert r.tool_choice == "required" and r.parallel_tool_calls is False
    named = client.responses.create(model=LLM, input=ASK, tools=[WEATHER], max_output_tokens=60, temperature=0,
                                    tool_choice={"type": "function", "name": "weather"})
    assert [o.type for o in named.output] == ["function_call"] and named.output[0].arguments == call.arguments


def test_a_call_streams_as_its_arguments_grow(client: Any) -> None:
    args = {"model": LLM, "input": ASK, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 60, "temperature": 0}
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"} and len(types[3:-3]) > 1
    added, done = events[2].item, events[-2].item
    assert added.type == "function_call" and added.arguments == "" and added.status == "in_progress"
    assert (done.id, done.call_id, done.status) == (added.id, added.call_id, "completed")
    grown = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert grown == events[-3].arguments == done.arguments == whole.output[0].arguments
    assert [o.type for o in events[-1].response.output] == ["function_call"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(**args) as stream:
        final = stream.get_final_response()
    assert final.output[0].arguments == whole.output[0].arguments


def test_a_call_and_its_output_go_back_as_input(client: Any) -> None:
    first = client.responses.create(model=LLM, input=ASK, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=60, temperature=0)
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    # the SDK's output item sent back as it came, then its result: the chat conversation with tool_calls
    again = client.responses.create(model=LLM, input=[{"role": "user", "content": ASK}, call, result],
                                    tools=[WEATHER], max_output_tokens=3, temperature=0)
    chat = client.chat.completions.create(
        model=LLM, max_tokens=3, temperature=0, tools=[{"type": "function", "function": {
            "name": "weather", "parameters": WEATHER_SCHEMA}}],
        messages=[{"role": "user", "content": ASK},
                  {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                   "function": {"name": "weather", "arguments": call.arguments}}]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}])
    assert again.usage.input_tokens == chat.usage.prompt_tokens
    assert again.output_text == (chat.choices[0].message.content or "")
    # the same through previous_response_id: the kept conversation holds the call
    kept = client.responses.create(model=LLM, input=[result], previous_response_id=first.id, tools=[WEATHER],
                                   max_output_tokens=3, temperature=0)
    assert kept.usage.input_tokens == again.usage.input_tokens and kept.output_text == again.output_text


def test_tool_choice_none_writes_the_tools_and_calls_nothing(client: Any) -> None:
    plain = client.responses.create(model=LLM, input=ASK, max_output_tokens=6, temperature=0)
    none = client.responses.create(model=LLM, input=ASK, tools=[WEATHER], tool_choice="none", max_output_tokens=6,
                                   temperature=0)
    assert [o.type for o in none.output] == ["message"] and none.usage.input_tokens > plain.usage.input_tokens


# ---- bad requests -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "status", "param", "code"), [
    ({"input": []}, 400, "input", "empty_prompt"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role", "invalid_value"),
    ({"input": [{"role": "user"}]}, 400, "input.0.content", "invalid_value"),
    ({"input": [{"role": "user", "content": "x", "name": "a"}]}, 400, "input.0.name", "unknown_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]}, 400,
     "input.0.content.0", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, 400, "input.0.content.0.text",
     "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, 400, "input.0.arguments", "invalid_value"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "5"}]}, 400, "input.0.call_id",
     "invalid_value"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "extra": 1}]}, 400,
     "input.0.extra", "unknown_parameter"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type", "unsupported_parameter"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "no spaces"}]}, 400, "tools.0.name", "invalid_value"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice.name",
     "invalid_value"),
    ({"tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id", "response_not_found"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, 400, "text.format.name", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "a"}}}, 400, "text.format.schema", "invalid_value"),
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "frob"}}}}, 400,
     "text.format.schema", "invalid_value"),
    ({"text": {"format": {"type": "yaml"}}}, 400, "text.format.type", "invalid_value"),
    ({"text": {"format": {"type": "text", "x": 1}}}, 400, "text.format.x", "unknown_parameter"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity", "unsupported_parameter"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens", "invalid_value"),
    ({"max_output_tokens": 1000}, 400, "max_output_tokens", "context_length_exceeded"),
    ({"input": "many words " * 200}, 400, "input", "context_length_exceeded"),
    ({"temperature": "1"}, 400, "temperature", "invalid_value"),
    ({"top_p": 2}, 400, "top_p", "invalid_value"),
    ({"top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    ({"include": ["file_search_call.results"]}, 400, "include", "unsupported_parameter"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning", "unsupported_parameter"),
    ({"truncation": "auto"}, 400, "truncation", "unsupported_parameter"),
    ({"background": True}, 400, "background", "unsupported_parameter"),
    ({"conversation": "conv_1"}, 400, "conversation", "unsupported_parameter"),
    ({"min_p": 0.1}, 400, "min_p", "unsupported_parameter"),
    ({"max_tokens": 5}, 400, "max_tokens", "unsupported_parameter"),
    ({"frobnicate": 1}, 400, "frobnicate", "unknown_parameter"),
    ({"model": BYTES}, 400, "model", "no_chat_template"),
    ({"model": VISION}, 400, "model", "wrong_task"),
    ({"model": "nope"}, 404, "model", "model_not_found"),
])
def test_bad_requests_name_the_field(url: str, body: dict[str, Any], status: int, param: str, code: str) -> None:
    r = httpx.post(url + "/v1/responses", json={"model": LLM, "input": "Hello", "max_output_tokens": 2, **body},
                   timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert error["message"]


def test_fields_that_change_nothing_pass(url: str) -> None:
    body = {"model": LLM, "input": "Hello", "max_output_tokens": 2, "store": True, "user": "u1",
            "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "p", "service_tier": "auto",
            "stream_options": {"include_obfuscation": False}, "truncation": "disabled", "background": False,
            "tool_choice": "none", "tools": [], "parallel_tool_calls": False, "reasoning": None,
            "text": {"format": {"type": "text"}, "verbosity": "medium"}}
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["user"] == "u1"
