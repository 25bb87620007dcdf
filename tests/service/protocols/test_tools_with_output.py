"""Tools beside `response_format` (issue 41: an agent with an output type and tools sends both, and OpenAI takes
them): a reply either calls a tool, its arguments valid, or is JSON of the response format's schema, one grammar
deciding; with tool_choice "required" the reply is calls. On the shipped demo LLM through the openai SDK."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from benchmarks.server import in_thread
from service.base.config import Settings
from service.edge.app import create_app

openai = pytest.importorskip("openai")

LLM = "llama_seglu"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
TOOL = {"type": "function", "function": {"name": "weather", "parameters": CITY}}
REPLY = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 12}}, "required": ["answer"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": REPLY}}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with in_thread(create_app(Settings(models=(LLM,), warmup_calls=0))) as base:
        yield openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("seed", range(6))
def test_a_reply_beside_tools_is_a_valid_call_or_json_of_the_response_format(client: Any, seed: int) -> None:
    out = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL], tool_choice="auto",
        parallel_tool_calls=False, response_format=FORMAT, temperature=1.0, seed=seed, max_tokens=60)
    choice = out.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert call.function.name == "weather"
            jsonschema.validate(json.loads(call.function.arguments), CITY)
    elif choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), REPLY)
    else:  # cut by max_tokens: what there is begins as the grammar allows
        assert choice.finish_reason == "length" and (choice.message.content or "").lstrip().startswith(("{", "<"))


def test_required_calls_whatever_the_response_format(client: Any) -> None:
    out = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[TOOL],
        tool_choice="required", parallel_tool_calls=False, response_format=FORMAT, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), CITY)


def test_other_structured_output_beside_tools_is_still_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "Hi"}], tools=[TOOL],
                                       extra_body={"guided_regex": "[0-9]+"})
    assert err.value.body["param"] == "guided_regex" and err.value.body["code"] == "conflicting_parameters"
    with pytest.raises(openai.BadRequestError) as err:  # a bad response_format is the 400 it is without tools
        client.chat.completions.create(model=LLM, messages=[{"role": "user", "content": "Hi"}], tools=[TOOL],
                                       response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert "response_format.json_schema" in err.value.body["param"]
