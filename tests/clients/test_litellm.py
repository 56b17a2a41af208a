"""litellm as its docs show it for an OpenAI-compatible server: model "openai/<name>" with
api_base, plain and streamed."""

from __future__ import annotations

import os

import pytest

# litellm fetches a model price list from the internet when imported, unless told to use its own.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

from tests.server.conftest import API_KEY  # noqa: E402


def test_completion_and_stream(server, model_name):
    kw = dict(
        model=f"openai/{model_name}",
        api_base=f"{server}/v1",
        api_key=API_KEY,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=8,
        temperature=0,
        num_retries=0,
    )
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text and 0 < r.usage.completion_tokens <= 8
    chunks = list(litellm.completion(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
