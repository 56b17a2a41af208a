"""The OpenAI Agents SDK as its docs show it for other providers: an Agent on
OpenAIChatCompletionsModel over an AsyncOpenAI client to the server, with one function tool."""

from __future__ import annotations

import pytest

pytest.importorskip("agents")
openai = pytest.importorskip("openai")

import agents  # noqa: E402

from tests.server.conftest import API_KEY  # noqa: E402


def test_agent_runs_a_tool(server, model_name):
    agents.set_tracing_disabled(True)  # no trace upload to OpenAI
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        calls.append(city)
        return f"21 C and sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the get_weather tool.",
        model=agents.OpenAIChatCompletionsModel(model=model_name, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48, temperature=0),
        tools=[get_weather],
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the agent's
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=2)
    assert len(calls) == 1 and calls[0]
    assert result.final_output == f"21 C and sunny in {calls[0]}"
