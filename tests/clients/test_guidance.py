"""guidance as its docs show it for a vLLM server: `models.experimental.VLLMModel` with `gen`
(a regex) and `select` in a chat. guidance sends its grammar twice, as `guided_grammar` and as
`structured_outputs.grammar` (vLLM's old and new fields), which the server must take as one.

guidance runs in its own environment (tests/clients/venv_client.py: every release pins
llguidance==1.5.0, the server needs llguidance>=1.7)."""

from __future__ import annotations

import re

from tests.clients.venv_client import run_client
from tests.server.conftest import API_KEY

SCRIPT = """
import json, sys
import guidance
from guidance import assistant, gen, select, user

url, model, key = sys.argv[1:4]
lm = guidance.models.experimental.VLLMModel(model, base_url=url + "/v1", api_key=key, echo=False)
with user():
    lm += "How many legs does a cat have?"
with assistant():
    lm += gen("legs", regex=r"[0-9]{1,2}", max_tokens=4, temperature=0)
with user():
    lm += "Is a cat a mammal?"
with assistant():
    lm += select(["yes", "no"], name="mammal")
print(json.dumps({"legs": lm["legs"], "mammal": lm["mammal"]}))
"""


def test_vllm_model_gen_and_select(server, model_name):
    out = run_client("guidance", SCRIPT, server, model_name, API_KEY)
    assert re.fullmatch(r"[0-9]{1,2}", out["legs"]), out
    assert out["mammal"] in ("yes", "no"), out
