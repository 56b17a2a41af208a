"""pydantic-ai as its docs show it for an OpenAI-compatible service: an Agent on OpenAIChatModel
with OpenAICompatibleProvider, its output a pydantic model asked for as a tool call
(the default) or as a json_schema response_format (NativeOutput)."""

from __future__ import annotations

import pytest

pydantic = pytest.importorskip("pydantic")
pydantic_ai = pytest.importorskip("pydantic_ai")
pytest.importorskip("openai")

from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.openai_compatible import OpenAICompatibleProvider  # noqa: E402

from tests.server.conftest import API_KEY  # noqa: E402

SETTINGS = {"max_tokens": 64, "temperature": 0}


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)


@pytest.fixture(scope="module")
def model(server, model_name):
    provider = OpenAICompatibleProvider("kvserve", base_url=f"{server}/v1", api_key=API_KEY)
    return OpenAIChatModel(model_name, provider=provider)


@pytest.mark.parametrize("native", [False, True], ids=["tool_output", "native_output"])
def test_agent_with_structured_output(model, native):
    """The default asks for the output as a `final_result` tool call (tool_choice required);
    NativeOutput asks for it as a json_schema response_format."""
    output_type = pydantic_ai.NativeOutput(City) if native else City
    agent = pydantic_ai.Agent(model, output_type=output_type, model_settings=SETTINGS, retries=0)
    result = agent.run_sync("Tell me about Paris, France.")
    assert isinstance(result.output, City) and result.output.name
    assert result.usage.output_tokens > 0
