"""guidance as its docs show it for a vLLM server: `models.experimental.VLLMModel` with `gen`
(a regex) and `select` in a chat. guidance sends its grammar twice, as `guided_grammar` and as
`structured_outputs.grammar` (vLLM's old and new fields), which the server must take as one."""

from __future__ import annotations

import re

import pytest

# Not in the `clients` extra: every guidance release pins llguidance<=1.5.0, and the server hands
# llguidance a list of EOS ids, which needs llguidance>=1.7.
guidance = pytest.importorskip(
    "guidance",
    reason="guidance is not installed: guidance 0.3.1 pins llguidance==1.5.0, the server needs "
    "llguidance>=1.7 (a list of EOS ids)",
)
pytest.importorskip("openai")

from tests.server.conftest import API_KEY  # noqa: E402


def test_vllm_model_gen_and_select(server, model_name):
    from guidance import assistant, gen, select, user

    lm = guidance.models.experimental.VLLMModel(
        model_name, base_url=f"{server}/v1", api_key=API_KEY, echo=False
    )
    with user():
        lm += "How many legs does a cat have?"
    with assistant():
        lm += gen("legs", regex=r"[0-9]{1,2}", max_tokens=4, temperature=0)
    assert re.fullmatch(r"[0-9]{1,2}", lm["legs"])
    with user():
        lm += "Is a cat a mammal?"
    with assistant():
        lm += select(["yes", "no"], name="mammal")
    assert lm["mammal"] in ("yes", "no")
