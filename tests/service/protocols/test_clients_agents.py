"""Agent frameworks, installed from the package registry and run as their documentation shows, against the server
in this process on the shipped demo LLM (issue 41): the OpenAI Agents SDK (`openai-agents`: an agent turn with a
`@function_tool`, on both its Responses and its Chat Completions model) and pydantic-ai (an `@agent.tool_plain`
that runs, structured output through its `final_result` tool, on its Chat Completions and Responses models).
The plain clients (openai SDK, LangChain, instructor) are in test_clients.py.

The demo LLM cannot write sensible text and has 256 tokens of context (the tools are written into the prompt), so
each agent is told to call a tool on its first step, its tools are small, and a run has room for one call and
its result; the frameworks' own loop executes the call, as it would against any OpenAI-compatible server.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from benchmarks.server import in_thread
from service.base.config import Settings
from service.edge.app import create_app

openai = pytest.importorskip("openai")

LLM = "llama_seglu"
# Small, without a description: the SDK's two-turn run (call, then answer) needs the tool, the call and its result
# in one 256-token prompt (the second prompt is about 245 tokens)
CITY = Field(max_length=8)
ASK = "Paris?"


class Weather(BaseModel):
    city: str = CITY


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with in_thread(create_app(Settings(models=(LLM,), warmup_calls=0))) as base:
        yield base + "/v1"


def weather_tool(ran: list[str]) -> Any:
    """The Agents SDK's tool: records the city it ran for."""

    def weather(city: Annotated[str, CITY]) -> str:
        Weather(city=city)  # the arguments the framework passes validate against the tool's own model
        ran.append(city)
        return "18 C"

    return weather


# ---- the OpenAI Agents SDK (openai-agents) ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def agents() -> Any:
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)
    return sdk


def run_agent(agents: Any, url: str, model_kind: str, ran: list[str], streamed: bool = False,
              **agent_options: Any) -> tuple[Any, list[str]]:
    """One `Runner.run` (or `run_streamed`, then the names of its run-item events) of an agent whose tool records
    its calls in `ran`, told to call a tool (the SDK resets tool_choice after a call, as by default)."""

    async def run() -> tuple[Any, list[str]]:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            agent = agents.Agent(name="forecaster", model=getattr(agents, model_kind)(model=LLM, openai_client=client),
                                 tools=[agents.function_tool(weather_tool(ran))],
                                 model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                                     temperature=0), **agent_options)
            if not streamed:
                return await agents.Runner.run(agent, ASK, max_turns=3), []
            result = agents.Runner.run_streamed(agent, ASK, max_turns=3)
            names = [e.name async for e in result.stream_events() if e.type == "run_item_stream_event"]
            return result, names

    return asyncio.run(run())


def test_agents_sdk_responses_model_runs_the_tool_and_finishes(agents: Any, url: str) -> None:
    ran: list[str] = []
    # The run ends with the tool's output: a second model turn (free text, tool_choice reset) would not fit the
    # 256-token context after the call, and the SDK treats a response cut at max_output_tokens as an error.
    result, _ = run_agent(agents, url, "OpenAIResponsesModel", ran, tool_use_behavior="stop_on_first_tool")
    assert len(ran) == 1 and result.final_output == "18 C"
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item"], kinds
    call = result.new_items[0].raw_item
    assert call.name == "weather" and json.loads(call.arguments) == {"city": ran[0]}
    assert len(result.raw_responses) == 1 and result.raw_responses[0].response_id.startswith("resp_")


def test_agents_sdk_chat_completions_model_calls_then_answers(agents: Any, url: str) -> None:
    ran: list[str] = []
    # The SDK's default loop: the forced call runs the tool, tool_choice is reset (reset_tool_choice), the tool's
    # result goes back, and the model's next turn is the final output.
    result, _ = run_agent(agents, url, "OpenAIChatCompletionsModel", ran)
    assert len(ran) == 1 and len(result.raw_responses) == 2
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert json.loads(result.new_items[0].raw_item.arguments) == {"city": ran[0]}
    assert result.new_items[1].output == "18 C"
    assert isinstance(result.final_output, str) and result.final_output  # the demo model's text: noise


def test_agents_sdk_streamed_run_reports_the_call_and_its_output(agents: Any, url: str) -> None:
    ran: list[str] = []
    result, names = run_agent(agents, url, "OpenAIResponsesModel", ran, streamed=True,
                              tool_use_behavior="stop_on_first_tool")
    assert names == ["tool_called", "tool_output"] and len(ran) == 1 and result.final_output == "18 C"


# ---- pydantic-ai ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pydantic_ai() -> Any:
    return pytest.importorskip("pydantic_ai")


def run_pydantic_ai(url: str, api: str, build: Any) -> Any:
    """`agent.run(ASK)` of the agent `build(model)` makes, on pydantic-ai's Chat Completions or Responses model."""
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            kind = OpenAIChatModel if api == "chat" else OpenAIResponsesModel
            return await build(kind(LLM, provider=OpenAIProvider(openai_client=client))).run(ASK)

    return asyncio.run(run())


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_tool_plain_runs(pydantic_ai: Any, url: str, api: str) -> None:
    ran: list[str] = []

    def first_step_calls_a_tool(ctx: Any) -> Any:
        # pydantic-ai refuses a static tool_choice "required" (the agent could never answer); per step is how
        # its docs force a tool on the first step only
        return pydantic_ai.ModelSettings(tool_choice="required" if ctx.run_step <= 1 else "none",
                                         parallel_tool_calls=False, temperature=0)

    def build(model: Any) -> Any:
        agent = pydantic_ai.Agent(model, model_settings=first_step_calls_a_tool)

        @agent.tool_plain
        def weather(city: Annotated[str, CITY]) -> str:
            ran.append(city)
            return "18 C"

        return agent

    result = run_pydantic_ai(url, api, build)
    assert len(ran) == 1 and isinstance(result.output, str)
    Weather(city=ran[0])  # what the tool got validates against its own schema
    parts = [p for m in result.all_messages() for p in m.parts]
    (call,) = [p for p in parts if p.part_kind == "tool-call"]
    (returned,) = [p for p in parts if p.part_kind == "tool-return"]
    assert call.tool_name == "weather" and call.args_as_dict() == {"city": ran[0]}
    assert returned.tool_call_id == call.tool_call_id and returned.content == "18 C"


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_structured_output_through_its_final_result_tool(pydantic_ai: Any, url: str, api: str) -> None:
    result = run_pydantic_ai(url, api, lambda model: pydantic_ai.Agent(
        model, output_type=Weather, model_settings=pydantic_ai.ModelSettings(parallel_tool_calls=False, temperature=0)))
    assert isinstance(result.output, Weather)
    (call,) = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-call"]
    assert call.tool_name == "final_result" and Weather.model_validate(call.args_as_dict()) == result.output
