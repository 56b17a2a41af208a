"""What real clients call, each run only when the client is installed: LangChain's ChatOpenAI
(`with_structured_output` in json_schema and function_calling modes, `bind_tools`) and instructor
(TOOLS and JSON_SCHEMA modes: the ones that constrain the output), against the session's server.
instructor's JSON mode only asks for a JSON object and puts the schema in the prompt, which a 135M
model does not follow reliably."""

from __future__ import annotations

import json

import pytest

pydantic = pytest.importorskip("pydantic")

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
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(
        base_url=f"{server}/v1",
        api_key=API_KEY,
        model=model_name,
        temperature=0,
        max_tokens=96,
        max_retries=0,
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model, method):
    structured = chat_model.with_structured_output(City, method=method)
    city = structured.invoke("Tell me about Paris, France.")
    assert isinstance(city, City) and city.name


def test_langchain_bind_tools(chat_model):
    msg = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "Weather in Rome, in celsius?"
    )
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert set(msg.tool_calls[0]["args"]) == {"city", "unit"}


@pytest.fixture(scope="module")
def instructor_client(client):
    instructor = pytest.importorskip("instructor")
    return instructor


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_modes(instructor_client, client, model_name, mode):
    instructor = instructor_client
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=model_name,
        response_model=City,
        max_retries=0,
        max_tokens=96,
        temperature=0,
        messages=[{"role": "user", "content": "Tell me about Paris, France."}],
    )
    assert isinstance(city, City) and city.name
    json.dumps(city.model_dump())
