"""instructor as its docs show it: `instructor.from_openai` in TOOLS and JSON_SCHEMA modes (the
ones that constrain the output) and partial streaming. instructor's JSON mode only asks for a JSON
object and puts the schema in the prompt, which a 135M model does not follow reliably."""

from __future__ import annotations

import pytest

pydantic = pytest.importorskip("pydantic")
# Not in the `clients` extra: instructor caps jiter<0.15, openai 3.4+ needs jiter>=0.16, and the
# pinned pydantic-ai-slim[openai] needs openai>=3.31.
instructor = pytest.importorskip(
    "instructor",
    reason="instructor is not installed: it caps jiter<0.15, openai>=3.4 needs jiter>=0.16 "
    "(pydantic-ai-slim[openai]==2.68.0 needs openai>=3.31)",
)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


ASK = [{"role": "user", "content": "Tell me about Paris, France."}]


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_modes(client, model_name, mode):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=model_name,
        response_model=City,
        max_retries=0,
        max_tokens=64,
        temperature=0,
        messages=ASK,
    )
    assert isinstance(city, City) and city.name


def test_partial_streaming(client, model_name):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    partials = list(
        patched.chat.completions.create_partial(
            model=model_name,
            response_model=City,
            max_retries=0,
            max_tokens=64,
            temperature=0,
            messages=ASK,
        )
    )
    assert len(partials) > 1 and partials[-1].name
    City.model_validate(partials[-1].model_dump())  # the last one is complete
