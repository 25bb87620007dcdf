"""Real client libraries, installed from the package registry and used as their documentation shows, against the
server in this process on the shipped demo LLM (issue 41): the official `openai` SDK's own helpers (pydantic
tools, `chat.completions.parse` / `.stream`, `responses.create` / `.parse` / `.stream`), LangChain's `ChatOpenAI`
(`bind_tools`, `with_structured_output`, a tool run from the call) and instructor (`response_model` in TOOLS mode).
The agent frameworks (openai-agents, pydantic-ai) are in test_clients_agents.py.

The demo LLM (models/demo/llama_seglu) cannot write sensible text and has 256 tokens of context, so every turn
here forces a call (tool_choice "required" or a named function, as each client lets one set it) on small tools;
the server's call grammar makes the arguments parse and validate, and each test checks that they do, through
the client's own parsing where it has one. Greedy decoding (temperature 0) keeps the runs repeatable.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from benchmarks.server import in_thread
from service.base.config import Settings
from service.edge.app import create_app

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

LLM = "llama_seglu"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


# Small tools: they are written into the prompt, and prompt and call share the model's 256 tokens of context.
CITY = Field(pattern=r"^[a-z]+$", max_length=8)
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 8}},
                  "required": ["city"]}


class Weather(BaseModel):
    city: str = CITY


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with in_thread(create_app(Settings(models=(LLM,), warmup_calls=0))) as base:
        yield base + "/v1"


@pytest.fixture(scope="module")
def client(url: str) -> Any:
    return openai.OpenAI(base_url=url, api_key="x", max_retries=0)


def valid(arguments: str, schema: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments: a JSON object that validates against the tool's schema."""
    value = json.loads(arguments)
    jsonschema.validate(value, schema)
    return value


# ---- the openai SDK ---------------------------------------------------------------------------------------------


def test_openai_chat_required_call_parses_into_the_pydantic_tool(client: Any) -> None:
    tool = openai.pydantic_function_tool(Weather)  # strict: additionalProperties false, every field required
    r = client.chat.completions.parse(model=LLM, messages=ASK, tools=[tool], tool_choice="required",
                                      parallel_tool_calls=False, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "Weather" and call.id.startswith("call_")
    assert isinstance(call.function.parsed_arguments, Weather)  # the SDK's own parse, strict schema and all
    assert valid(call.function.arguments, tool["function"]["parameters"]) == call.function.parsed_arguments.model_dump()


def test_openai_chat_stream_helper_accumulates_the_call_from_its_deltas(client: Any) -> None:
    tool = openai.pydantic_function_tool(Weather)
    deltas, done = [], []
    with client.chat.completions.stream(model=LLM, messages=ASK, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False, temperature=0) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                deltas.append(event.arguments_delta)
            elif event.type == "tool_calls.function.arguments.done":
                done.append(event)
        final = stream.get_final_completion()
    assert len(deltas) > 1  # the arguments came in pieces, not in one chunk
    (event,) = done
    (call,) = final.choices[0].message.tool_calls
    assert event.name == call.function.name == "Weather" and final.choices[0].finish_reason == "tool_calls"
    assert "".join(deltas) == event.arguments == call.function.arguments
    assert isinstance(event.parsed_arguments, Weather) and event.parsed_arguments == call.function.parsed_arguments
    valid(call.function.arguments, tool["function"]["parameters"])


def test_openai_responses_create_with_a_function_tool(client: Any) -> None:
    tool = {"type": "function", "name": "weather", "parameters": WEATHER_SCHEMA, "strict": False}
    r = client.responses.create(model=LLM, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                parallel_tool_calls=False, temperature=0)
    assert r.status == "completed", r
    (call,) = r.output
    assert call.type == "function_call" and call.name == "weather" and call.call_id.startswith("call_")
    valid(call.arguments, WEATHER_SCHEMA)


def test_openai_responses_parse_with_a_pydantic_tool(client: Any) -> None:
    r = client.responses.parse(model=LLM, input="Weather in Paris?", tools=[openai.pydantic_function_tool(Weather)],
                               tool_choice={"type": "function", "name": "Weather"}, temperature=0)
    (call,) = r.output
    assert call.type == "function_call" and isinstance(call.parsed_arguments, Weather), r


def test_openai_responses_stream_sends_the_call_as_events(client: Any) -> None:
    tool = {"type": "function", "name": "weather", "parameters": WEATHER_SCHEMA, "strict": False}
    with client.responses.stream(model=LLM, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                 parallel_tool_calls=False, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    (call,) = final.output
    assert call.type == "function_call" and final.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    valid(call.arguments, WEATHER_SCHEMA)


# ---- LangChain --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_model(url: str) -> Any:
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=url, api_key="x", model=LLM, temperature=0, max_retries=0)


RAN: list[str] = []  # the cities the LangChain tool ran for


@pytest.fixture(scope="module")
def weather_tool() -> Any:
    tools = pytest.importorskip("langchain_core.tools")

    @tools.tool
    def weather(city: Annotated[str, CITY]) -> str:
        """Weather in a city."""
        RAN.append(city)
        return "18 C"

    return weather


@pytest.mark.parametrize("choice", ["required", "weather"])
def test_langchain_bind_tools_call_validates_and_the_tool_runs_from_it(chat_model: Any, weather_tool: Any,
                                                                        choice: str) -> None:
    messages = pytest.importorskip("langchain_core.messages")
    reply = chat_model.bind_tools([weather_tool], tool_choice=choice, parallel_tool_calls=False).invoke(
        "Weather in Paris?")
    assert isinstance(reply, messages.AIMessage) and not reply.invalid_tool_calls
    (call,) = reply.tool_calls
    assert call["name"] == "weather" and reply.response_metadata["finish_reason"] == "tool_calls"
    jsonschema.validate(call["args"], weather_tool.tool_call_schema.model_json_schema())
    result = weather_tool.invoke(call)  # what an agent loop does next: the call runs the tool
    assert isinstance(result, messages.ToolMessage) and result.tool_call_id == call["id"] and result.content == "18 C"
    assert RAN[-1] == call["args"]["city"]


def test_langchain_streamed_tool_call_chunks_add_up_to_the_call(chat_model: Any, weather_tool: Any) -> None:
    bound = chat_model.bind_tools([weather_tool], tool_choice="required", parallel_tool_calls=False)
    chunks = list(bound.stream("Weather in Paris?"))
    assert sum(1 for c in chunks if c.tool_call_chunks) > 1  # the call arrived in pieces
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    (call,) = whole.tool_calls
    assert call["name"] == "weather" and not whole.invalid_tool_calls
    jsonschema.validate(call["args"], weather_tool.tool_call_schema.model_json_schema())


def test_langchain_structured_output_by_function_calling(chat_model: Any) -> None:
    out = chat_model.with_structured_output(Weather, method="function_calling").invoke("Weather in Paris?")
    assert isinstance(out, Weather)
    raw = chat_model.with_structured_output(Weather, method="function_calling", include_raw=True).invoke(
        "Weather in Paris?")
    assert raw["parsing_error"] is None and raw["parsed"] == out  # greedy: the same answer twice


# ---- instructor -------------------------------------------------------------------------------------------------


def test_instructor_tools_mode_returns_the_response_model(url: str) -> None:
    instructor = pytest.importorskip("instructor")
    patched = instructor.from_openai(openai.OpenAI(base_url=url, api_key="x", max_retries=0),
                                     mode=instructor.Mode.TOOLS)
    out, completion = patched.chat.completions.create_with_completion(
        model=LLM, response_model=Weather, messages=ASK, temperature=0, max_retries=0)
    assert isinstance(out, Weather)
    (call,) = completion.choices[0].message.tool_calls
    assert call.function.name == "Weather" and json.loads(call.function.arguments) == out.model_dump()
