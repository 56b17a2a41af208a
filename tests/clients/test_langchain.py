"""LangChain's ChatOpenAI as its docs show it: invoke, stream, batch, `with_structured_output`
(json_schema and function_calling modes), `bind_tools`, and langchain's `create_agent` running a
tool."""

from __future__ import annotations

import pytest

pydantic = pytest.importorskip("pydantic")
langchain_openai = pytest.importorskip("langchain_openai")

from tests.server.conftest import API_KEY  # noqa: E402


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


def get_weather(city: str, unit: str) -> str:
    """Current weather of a city.

    Args:
        city: the city's name
        unit: celsius or fahrenheit
    """
    return f"21 {unit} in {city}"


@pytest.fixture(scope="module")
def chat_model(server, model_name):
    return langchain_openai.ChatOpenAI(
        base_url=f"{server}/v1",
        api_key=API_KEY,
        model=model_name,
        temperature=0,
        max_tokens=64,
        max_retries=0,
    )


def test_invoke_stream_batch(chat_model):
    short = chat_model.bind(max_tokens=8)
    msg = short.invoke("Name a color.")
    assert msg.content and msg.usage_metadata["output_tokens"] <= 8
    streamed = "".join(chunk.content for chunk in short.stream("Name a color."))
    assert streamed == msg.content  # temperature 0: the same answer
    answers = short.batch(["Name a color.", "Name a fruit."])
    assert len(answers) == 2 and answers[0].content == msg.content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(City, method=method)
    city = structured.invoke("Tell me about Paris, France.")
    assert isinstance(city, City) and city.name


def test_bind_tools(chat_model):
    msg = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "Weather in Rome, in celsius?"
    )
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}


def test_create_agent_runs_a_tool(chat_model):
    agents = pytest.importorskip("langchain.agents")
    middleware = pytest.importorskip("langchain.agents.middleware")
    tools = pytest.importorskip("langchain_core.tools")
    calls = []

    @tools.tool(return_direct=True)  # the agent stops at the tool's answer
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(city)
        return "10:00"

    @middleware.wrap_model_call
    def tool_first(request, handler):
        """A 135M model does not reliably choose a tool: the first step must call one."""
        if not any(m.type == "tool" for m in request.messages):
            request = request.override(tool_choice="required")
        return handler(request)

    agent = agents.create_agent(chat_model, [get_time], middleware=[tool_first])
    state = agent.invoke({"messages": [{"role": "user", "content": "What time is it in Tokyo?"}]})
    assert len(calls) == 1 and calls[0]
    assert [m.type for m in state["messages"]] == ["human", "ai", "tool"]
    assert state["messages"][-1].content == "10:00"
