"""instructor as its docs show it: `instructor.from_openai` in TOOLS and JSON_SCHEMA modes (the
ones that constrain the output) and partial streaming. instructor's JSON mode only asks for a JSON
object and puts the schema in the prompt, which a 135M model does not follow reliably.

instructor runs in its own environment (tests/clients/venv_client.py: it caps jiter<0.15, the
openai the other clients need requires jiter>=0.16)."""

from __future__ import annotations

from tests.clients.venv_client import run_client
from tests.server.conftest import API_KEY

SCRIPT = """
import json, sys
import instructor, openai, pydantic

url, model, key = sys.argv[1:4]

class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float

ASK = [{"role": "user", "content": "Tell me about Paris, France."}]
client = openai.OpenAI(base_url=url + "/v1", api_key=key)
out = {"instructor": instructor.__version__}
for mode in ("TOOLS", "JSON_SCHEMA"):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    city = patched.chat.completions.create(
        model=model, response_model=City, max_retries=0, max_tokens=64, temperature=0,
        messages=ASK,
    )
    out[mode] = city.model_dump()
patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
partials = list(patched.chat.completions.create_partial(
    model=model, response_model=City, max_retries=0, max_tokens=64, temperature=0, messages=ASK,
))
out["partials"] = [p.model_dump() for p in partials]
print(json.dumps(out))
"""

FIELDS = {"name", "country", "population_millions"}


def test_modes_and_partial_streaming(server, model_name):
    out = run_client("instructor", SCRIPT, server, model_name, API_KEY)
    for mode in ("TOOLS", "JSON_SCHEMA"):
        city = out[mode]
        assert set(city) == FIELDS and city["name"], (mode, city)
        assert isinstance(city["population_millions"], float), (mode, city)
        assert len(city["name"]) <= 30 and len(city["country"]) <= 30, (mode, city)
    partials = out["partials"]
    assert len(partials) > 1 and partials[-1]["name"], partials
    assert set(partials[-1]) == FIELDS and None not in partials[-1].values(), partials[-1]
